"""The vLLM dialect (entry point ``agentic_lora.engines: vllm``), after vLLM 0.32.0.

* Routes: only the OpenAI ones (vLLM has no ``/generate``). A request names its adapter as
  ``model=<lora_name>``: ``"<base>:<lora_name>"`` is an unknown model there, and ``lora_path`` is
  ignored, so the base model would answer. A ``model`` naming the base model, or SGLang's
  explicit form, can only mean the Session's adapter and is rewritten to it.
* Abort by id: none (no such route). A Session's close waits for its requests to end instead.
* Server info: none outside vLLM's development mode, so nothing is read; the first
  publication's load and probe prove runtime LoRA on every engine before anything binds to it.
* Incarnation: ``process_start_time_seconds`` of ``GET /metrics`` (the API server process, which
  holds the adapter table), hashed with the base URL: another process on another port is another
  engine, even if both started in the same clock tick.
* Unload does not wait for in-flight requests, so the backend takes a drain hook
  (:data:`~agentic_lora.engines.dialect.DRAIN_OPTION`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from agentic_lora.engines.dialect import DialectBase
from agentic_lora.engines.dialect import SlotSettings
from agentic_lora.engines.wire import EngineHttp
from agentic_lora.engines.wire import Outcome
from agentic_lora.engines.wire import classify_status
from agentic_lora.errors import AdapterMismatchError
from agentic_lora.foundation.requests import Route
from agentic_lora_vllm.metrics import EngineMetrics
from agentic_lora_vllm.metrics import parse_metrics

__all__ = ["VllmDialect", "read_metrics"]


async def read_metrics(http: EngineHttp) -> EngineMetrics:
    """The parts of ``GET /metrics`` this project reads, or a typed error."""
    op = "metrics"
    answer = await http.get_answer(op, "/metrics")
    outcome = classify_status(answer.status)
    if outcome is not None:
        raise http.failure(outcome, op, f"HTTP {answer.status}", status=answer.status)
    try:
        return parse_metrics(answer.text)
    except ValueError as exc:
        raise http.failure(Outcome.INDETERMINATE, op, f"unreadable metrics: {exc}") from exc


class VllmDialect(DialectBase):
    """vLLM's rules (see module docstring)."""

    name = "vllm"
    label = "vLLM"
    routes = frozenset({Route.CHAT_COMPLETIONS, Route.COMPLETIONS})
    can_abort = False
    unload_waits_for_requests = False
    route_hint = (
        "; send /v1/completions or /v1/chat/completions (the Session names its adapter in `model`)"
    )

    def pin(
        self, route: Route, body: Mapping[str, Any], lora_name: str, base_model: str | None
    ) -> dict[str, Any]:
        """``model=<lora_name>``; a ``lora_path`` is checked, then dropped (vLLM ignores it)."""
        out = dict(body)
        given_path = out.pop("lora_path", None)
        self._check_lora_path(given_path, lora_name)
        given = out.get("model")
        # The base model's name, or SGLang's explicit "<base>:<adapter>" form, can only mean this
        # Session's adapter here; vLLM would answer the first without it and 404 the second.
        same = (
            {lora_name} if not base_model else {lora_name, base_model, f"{base_model}:{lora_name}"}
        )
        if given is not None and given not in same:
            if not isinstance(given, str):
                raise AdapterMismatchError("`model` must be a string", given=repr(given))
            raise AdapterMismatchError(
                f"request names model {given!r} but this Session is bound to {lora_name!r}",
                given=given,
                bound=lora_name,
            )
        out["model"] = lora_name
        return out

    async def read_server_info(self, http: EngineHttp) -> None:
        """None, without I/O: vLLM publishes no server info outside its development mode."""
        return None

    async def fingerprint(self, http: EngineHttp, base_url: str) -> str:
        """The API server's start time from ``/metrics``, hashed with the base URL."""
        metrics = await read_metrics(http)
        canonical = json.dumps(
            {"base_url": base_url.rstrip("/"), "process_start_time": metrics.process_start_time},
            sort_keys=True,
        )
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def check_server_info(
        self, info: Mapping[str, Any], *, engine: str, slots: SlotSettings
    ) -> None:
        """Nothing to check: vLLM publishes no server info (see :meth:`read_server_info`)."""
