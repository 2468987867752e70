"""The SGLang dialect (entry point ``agentic_lora.engines: sglang``), after SGLang 0.5.23.

* Routes: ``/generate`` and the OpenAI routes. ``/generate`` names its adapter in ``lora_path``;
  an OpenAI route in ``model="<base>:<lora_name>"`` (SGLang gives the adapter in ``model``
  precedence over ``lora_path``, and a bare adapter name there would be read as a base model name
  and silently served without the adapter).
* Abort by id: ``POST /abort_request {"rid": ...}`` (answered 200 whether or not the request is
  still running; the request then ends with ``finish_reason.type == "abort"``).
* Server info: ``GET /server_info`` (``/get_server_info`` on builds before the rename; newer ones
  still answer it but log a deprecation per call). The incarnation fingerprint hashes its
  process-identifying fields (:data:`FINGERPRINT_FIELDS`).
* Unload waits: SGLang unregisters the name, waits for its native request refcount to drain, then
  unloads, so no drain hook is needed.
* LoRA slots: ``enable_lora``, ``max_loaded_loras`` and ``max_loras_per_batch`` of the server info.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from agentic_lora.engines.dialect import DialectBase
from agentic_lora.engines.dialect import SlotSettings
from agentic_lora.engines.dialect import check_lora_slots
from agentic_lora.engines.wire import EngineHttp
from agentic_lora.engines.wire import HttpAnswer
from agentic_lora.engines.wire import Outcome
from agentic_lora.engines.wire import classify_status
from agentic_lora.engines.wire import error_detail
from agentic_lora.errors import AdapterMismatchError
from agentic_lora.errors import ConfigurationError
from agentic_lora.foundation.requests import Route

__all__ = [
    "FINGERPRINT_FIELDS",
    "SERVER_INFO_PATHS",
    "SGLANG",
    "SGLangDialect",
    "server_fingerprint",
]

#: ``/server_info`` fields that identify one engine process. ``startup_time`` holds the
#: process's own measured start-up durations (perf-counter deltas) and ``random_seed`` is drawn
#: at start unless pinned, so together they change on every restart and never during a run.
FINGERPRINT_FIELDS: tuple[str, ...] = (
    "version",
    "model_path",
    "served_model_name",
    "port",
    "random_seed",
    "startup_time",
)

#: Where server info is read, newest first; a 404 moves on to the next.
SERVER_INFO_PATHS: tuple[str, ...] = ("/server_info", "/get_server_info")


def server_fingerprint(info: Mapping[str, Any]) -> str:
    """A short stable hash of the process-identifying fields of a ``/server_info`` body."""
    picked = {name: info.get(name) for name in FINGERPRINT_FIELDS}
    canonical = json.dumps(picked, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class SGLangDialect(DialectBase):
    """SGLang's rules (see module docstring)."""

    name = "sglang"
    label = "SGLang"
    routes = frozenset(Route)
    can_abort = True
    unload_waits_for_requests = True

    def pin(
        self, route: Route, body: Mapping[str, Any], lora_name: str, base_model: str | None
    ) -> dict[str, Any]:
        """``lora_path=lora_name`` for ``/generate``; ``model="<base>:<lora_name>"`` otherwise
        (an explicit ``lora_path`` is still checked so the two can never disagree)."""
        out = dict(body)
        given_path = out.get("lora_path")
        self._check_lora_path(given_path, lora_name)
        if route is Route.GENERATE:
            out["lora_path"] = lora_name
            return out
        if not base_model:
            raise ConfigurationError(
                "OpenAI routes need the base model name to address an adapter",
                check="base_model_name",
            )
        out["model"] = self._model(base_model, lora_name, out.get("model"))
        return out

    @staticmethod
    def _model(base_model: str, lora_name: str, given: Any) -> str:
        pinned = f"{base_model}:{lora_name}"
        if given is None or given in (base_model, pinned, lora_name):
            # A bare adapter name in ``model`` would be read by SGLang as a base model name and
            # silently served without the adapter: it is rewritten to the explicit form.
            return pinned
        if not isinstance(given, str):
            raise AdapterMismatchError("`model` must be a string", given=repr(given))
        _, sep, adapter = given.partition(":")
        raise AdapterMismatchError(
            f"request names model {given!r} but this Session is bound to {pinned!r}",
            given=given,
            bound=lora_name,
            given_adapter=adapter.strip() if sep else given,
        )

    def abort_request(self, rid: str) -> tuple[str, dict[str, Any]]:
        """``POST /abort_request {"rid": rid}``."""
        return "/abort_request", {"rid": rid}

    async def read_server_info(self, http: EngineHttp) -> Mapping[str, Any]:
        """``/server_info``, else (404) ``/get_server_info``; a JSON object or a typed error."""
        op = "server_info"
        answer: HttpAnswer | None = None
        path = SERVER_INFO_PATHS[0]
        for path in SERVER_INFO_PATHS:
            answer = await http.get_answer(op, path)
            if answer.status != 404:
                break
        assert answer is not None
        outcome = classify_status(answer.status)
        if outcome is not None:
            raise http.failure(
                outcome,
                op,
                f"HTTP {answer.status}: {error_detail(answer.body)}",
                status=answer.status,
            )
        if not isinstance(answer.body, Mapping):
            raise http.failure(
                Outcome.INDETERMINATE,
                op,
                f"{path} is not a JSON object",
                status=answer.status,
            )
        return answer.body

    async def fingerprint(self, http: EngineHttp, base_url: str) -> str:
        """:func:`server_fingerprint` of the server info (it carries the port already)."""
        return server_fingerprint(await self.read_server_info(http))

    def check_server_info(
        self, info: Mapping[str, Any], *, engine: str, slots: SlotSettings
    ) -> None:
        """LoRA on, enough slots, and the slots the settings declare (if they declare any)."""
        if not info.get("enable_lora"):
            raise ConfigurationError(
                f"engine {engine} runs without --enable-lora", check="engine_lora", engine=engine
            )

        def as_int(key: str) -> int | None:
            v = info.get(key)
            return v if isinstance(v, int) else None

        max_loaded, per_batch = as_int("max_loaded_loras"), as_int("max_loras_per_batch")
        check_lora_slots(slots.capacity, max_loaded, per_batch, source=f"engine {engine}")
        for key, declared, actual in (
            ("max_loaded_loras", slots.max_loaded_loras, max_loaded),
            ("max_loras_per_batch", slots.max_loras_per_batch, per_batch),
        ):
            if declared is not None and actual is not None and declared != actual:
                raise ConfigurationError(
                    f"engine {engine} runs with {key}={actual}, settings say {declared}",
                    check="engine_lora_slots",
                    engine=engine,
                )


#: The default dialect, shared (dialects are stateless).
SGLANG = SGLangDialect()
