"""A small typed async client for SGLang's LoRA control endpoints.

Shapes follow SGLang 0.5.23 (``python/sglang/srt/entrypoints/http_server.py``):

* ``POST /load_lora_adapter`` ``{lora_name, lora_path, pinned}`` -> ``LoRAUpdateOutput``
  ``{success, error_message, loaded_adapters: {name: path}}``; HTTP 200 on success, 400 otherwise.
* ``POST /unload_lora_adapter`` ``{lora_name}`` -> the same body. The engine first unregisters the
  name (no new request can acquire it), then waits for its native request refcount to reach zero,
  then unloads: the call blocks while requests using the adapter are in flight. An unknown name
  answers ``success: false`` with ``"LoRA with name <n> does not exist"``.
* ``GET /server_info`` (``/get_server_info`` before it was renamed) -> resolved server args,
  scheduler info (including ``startup_time``), ``internal_states`` and ``version``.
* ``GET /v1/models`` -> the base model plus one card per registered adapter
  (``id`` = adapter name, ``root`` = its path, ``parent`` = the base model).
* ``POST /generate`` with ``lora_path`` naming a loaded adapter.

Every call is one HTTP attempt; nothing here retries. A failure is classified:

* :class:`~agentic_lora.errors.BackendRefusedError`: the engine provably did not act on the
  request (the connection was never made, or the engine answered "no");
* :class:`~agentic_lora.errors.BackendAmbiguousError`: it may have (the reply was lost, a 5xx,
  an answer that does not parse).

HTTP 200 with ``success: false`` is a failure: bodies are checked, not just status codes.

:class:`AdminHttpClient` is the plumbing every engine's admin client shares (one attempt per call,
transport failures classified by :mod:`agentic_lora.engines.wire`'s table, the one the generation
transport uses, typed errors logged with stable keys), with the requests that are the same on
every engine: the adapter listing of ``GET /v1/models`` (each engine reads its answer's cards,
:meth:`AdminHttpClient._model_cards`), the unload post and the probe post. It is an
:class:`~agentic_lora.engines.wire.EngineHttp`, so the engine dialect reads server info and the
incarnation through it with the same code as through the generation transport.
:class:`EngineAdminClient` adds SGLang's routes and answer shapes,
``agentic_lora_vllm.admin.VllmAdminClient`` vLLM's.
"""

from __future__ import annotations

import abc
import enum
import logging
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from typing import Generic
from typing import Self
from typing import TypeVar

import httpx

from agentic_lora.engines.sglang import FINGERPRINT_FIELDS
from agentic_lora.engines.sglang import SGLANG
from agentic_lora.engines.sglang import server_fingerprint
from agentic_lora.engines.wire import WIRE_ERRORS
from agentic_lora.engines.wire import HttpAnswer
from agentic_lora.engines.wire import Outcome
from agentic_lora.engines.wire import ReplyTooDeepError
from agentic_lora.engines.wire import classify_exception
from agentic_lora.engines.wire import classify_status
from agentic_lora.engines.wire import decode_body
from agentic_lora.engines.wire import error_detail
from agentic_lora.engines.wire import make_engine_client
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendError
from agentic_lora.errors import BackendRefusedError
from agentic_lora.foundation.http_limits import engine_limits

__all__ = [
    "FINGERPRINT_FIELDS",
    "LIST_MODELS",
    "AdminHttpClient",
    "AdminTimeouts",
    "EngineAdminClient",
    "LoadResult",
    "ProbeResult",
    "ServerInfo",
    "UnloadOutcome",
    "server_fingerprint",
]

logger = logging.getLogger(__name__)

# How a failed admin call is raised and logged, by what the engine may have done: a refusal is
# routine (the engine did nothing), an unknown outcome is worth a warning (it may have acted).
_FAILURES: dict[Outcome, tuple[type[BackendError], int, str]] = {
    Outcome.REFUSED: (BackendRefusedError, logging.INFO, "refused"),
    Outcome.INDETERMINATE: (BackendAmbiguousError, logging.WARNING, "outcome unknown"),
}

#: The phrase SGLang's LoRA registry uses when asked to unregister a name it does not hold
#: (``LoRARegistry.unregister``). It is the only signal that an unload found nothing to do.
ABSENT_MARKER = "does not exist"
#: The ``op`` of :meth:`AdminHttpClient.list_lora_adapters` in errors and logs.
LIST_MODELS = "list_models"

#: What an admin client's reader makes of one HTTP answer (the engine's answer shape).
AnswerT = TypeVar("AnswerT")


class UnloadOutcome(enum.StrEnum):
    """What an unload found: it removed the adapter, or there was nothing under that name."""

    UNLOADED = "UNLOADED"
    ABSENT = "ABSENT"


@dataclass(frozen=True, slots=True)
class AdminTimeouts:
    """Per-call time limits in seconds (``None``: wait as long as it takes).

    ``unload`` is long on purpose: SGLang's unload returns only after every in-flight request
    using the adapter finished. A timeout is an ambiguous outcome, never a success.
    """

    connect: float = 10.0
    read: float = 30.0
    load: float = 300.0
    probe: float = 120.0
    unload: float | None = 600.0


@dataclass(frozen=True, slots=True)
class LoadResult:
    """A confirmed load: the engine lists ``lora_name`` at ``lora_path``."""

    lora_name: str
    lora_path: str
    loaded_adapters: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """A one-token generation that went through the named adapter."""

    lora_name: str
    output_ids: tuple[int, ...]
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """The parts of ``/server_info`` this project reads, plus the raw body."""

    version: str | None
    model_path: str | None
    fingerprint: str
    raw: Mapping[str, Any]


class AdminHttpClient(abc.ABC, Generic[AnswerT]):
    """One engine's admin HTTP endpoint: one attempt per call, every failure classified.

    Subclasses add the engine's routes and read its answers (:meth:`_read`, into ``AnswerT``);
    this class sends, and turns what went wrong on the wire into :class:`~agentic_lora.errors.BackendRefusedError` (the request
    never left, so the engine cannot have acted) or
    :class:`~agentic_lora.errors.BackendAmbiguousError` (it may have). Pass ``client`` to share
    an :class:`httpx.AsyncClient` (its lifetime stays yours); without it the client owns one and
    :meth:`aclose` closes it.
    """

    def __init__(
        self,
        base_url: str,
        *,
        engine: str | None = None,
        client: httpx.AsyncClient | None = None,
        timeouts: AdminTimeouts | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"engine base URL must be http(s): {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.engine = engine or self.base_url
        self.timeouts = timeouts or AdminTimeouts()
        self._owns_client = client is None
        if client is None:
            # The generation transport's factory: no retries, no environment proxy, no redirects.
            client, _ = make_engine_client(
                "httpx",
                httpx.Timeout(self.timeouts.read, connect=self.timeouts.connect),
                engine_limits(),
            )
        self._client = client

    async def aclose(self) -> None:
        """Close the HTTP client if this object created it."""
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @abc.abstractmethod
    def _read(self, op: str, response: httpx.Response, lora_name: str | None) -> AnswerT:
        """The engine's answer to ``op``; raises the classified error for one that never succeeds."""

    async def _post(
        self,
        op: str,
        path: str,
        payload: Mapping[str, Any],
        *,
        limit: float | None,
        lora_name: str | None = None,
    ) -> AnswerT:
        request_timeout = httpx.Timeout(limit, connect=self.timeouts.connect)
        try:
            response = await self._client.post(
                self.base_url + path, json=dict(payload), timeout=request_timeout
            )
        except WIRE_ERRORS as exc:
            raise self._transport_failure(op, exc, lora_name) from exc
        return self._read(op, response, lora_name)

    async def _post_unload(self, op: str, path: str, lora_name: str) -> AnswerT:
        """The unload every engine takes: the name alone, under the unload limit."""
        payload = {"lora_name": lora_name}
        return await self._post(op, path, payload, limit=self.timeouts.unload, lora_name=lora_name)

    async def _post_probe(
        self, op: str, path: str, payload: Mapping[str, Any], lora_name: str
    ) -> AnswerT:
        """A one-token generation through ``lora_name``, under the probe limit."""
        return await self._post(op, path, payload, limit=self.timeouts.probe, lora_name=lora_name)

    async def list_lora_adapters(self) -> dict[str, str]:
        """Registered adapters as ``{name: path}`` (from ``GET /v1/models``)."""
        cards = self._model_cards(await self._get(LIST_MODELS, "/v1/models"))
        # Both engines list the base model too; only adapters have a parent.
        return {
            str(card.get("id")): str(card.get("root"))
            for card in cards
            if isinstance(card, dict) and card.get("parent") is not None
        }

    @abc.abstractmethod
    def _model_cards(self, answer: AnswerT) -> list[Any]:
        """The ``data`` array of a ``/v1/models`` answer; raises the classified error if none."""

    async def _get(self, op: str, path: str) -> AnswerT:
        return self._read(op, await self._send_get(op, path), None)

    async def _send_get(self, op: str, path: str) -> httpx.Response:
        try:
            return await self._client.get(self.base_url + path)
        except WIRE_ERRORS as exc:
            raise self._transport_failure(op, exc, None) from exc

    async def get_answer(self, op: str, path: str) -> HttpAnswer:
        """``GET path`` (one attempt): any answer, or BackendRefused/AmbiguousError on the wire."""
        response = await self._send_get(op, path)
        try:
            body = decode_body(response)
        except ReplyTooDeepError as exc:
            # A 4xx still proves refusal; any other answer the dialect cannot read is ambiguous.
            outcome = classify_status(response.status_code) or Outcome.INDETERMINATE
            raise self.failure(outcome, op, str(exc), status=response.status_code) from exc
        return HttpAnswer(response.status_code, body, response.text)

    def failure(self, outcome: Outcome, op: str, message: str, **details: Any) -> BackendError:
        """BackendRefusedError (refused) or BackendAmbiguousError (indeterminate), logged."""
        kind, level, said = _FAILURES[outcome]
        logger.log(
            level,
            "engine %s %s %s: %s",
            self.engine,
            op,
            said,
            message,
            extra={"engine": self.engine, "version": details.get("lora_name")},
        )
        return kind(f"{self.engine} {op}: {message}", engine=self.engine, op=op, **details)

    def _transport_failure(
        self, op: str, exc: BaseException, lora_name: str | None
    ) -> BackendError:
        reason = f"{type(exc).__name__}: {exc}"
        return self.failure(classify_exception(exc), op, reason, lora_name=lora_name)

    def _refused(self, op: str, message: str, **details: Any) -> BackendError:
        return self.failure(Outcome.REFUSED, op, message, **details)

    def _ambiguous(self, op: str, message: str, **details: Any) -> BackendError:
        return self.failure(Outcome.INDETERMINATE, op, message, **details)


class EngineAdminClient(AdminHttpClient[dict[str, Any]]):
    """Typed access to one SGLang engine's control endpoints (one attempt per call).

    Construction and client sharing as for :class:`AdminHttpClient`.
    """

    # --- adapters --------------------------------------------------------------------------

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, *, pinned: bool = True
    ) -> LoadResult:
        """Load ``lora_path`` under ``lora_name``; confirmed only if the body says so."""
        op = "load_lora_adapter"
        body = await self._post(
            op,
            "/load_lora_adapter",
            {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned},
            limit=self.timeouts.load,
            lora_name=lora_name,
        )
        loaded = _loaded_adapters(body)
        if body.get("success") is True:
            # Trust the listing over the flag: a success that does not show our adapter at our
            # path proves nothing about what the engine now holds.
            if loaded is not None and loaded.get(lora_name) != lora_path:
                raise self._ambiguous(
                    op,
                    "engine reported success but does not list the adapter at its path",
                    lora_name=lora_name,
                    listed_path=loaded.get(lora_name),
                )
            return LoadResult(lora_name, lora_path, dict(loaded or {lora_name: lora_path}))
        message = str(body.get("error_message") or "load refused")
        if loaded is not None and lora_name in loaded:
            # The name is held (already loaded, or a partial load on some rank): not clean.
            raise self._ambiguous(
                op, message, lora_name=lora_name, listed_path=loaded.get(lora_name)
            )
        raise self._refused(op, message, lora_name=lora_name)

    async def unload_lora_adapter(self, lora_name: str) -> UnloadOutcome:
        """Unload ``lora_name`` once its in-flight requests finished; ABSENT if not held."""
        op = "unload_lora_adapter"
        body = await self._post_unload(op, "/unload_lora_adapter", lora_name)
        if body.get("success") is True:
            return UnloadOutcome.UNLOADED
        message = str(body.get("error_message") or "unload refused")
        if ABSENT_MARKER in message:
            return UnloadOutcome.ABSENT
        raise self._refused(op, message, lora_name=lora_name)

    async def probe_generate(
        self, lora_name: str, *, input_ids: Sequence[int] = (0,)
    ) -> ProbeResult:
        """Generate one token through exactly ``lora_name`` (greedy), proving it serves."""
        op = "probe_generate"
        payload = {
            "input_ids": list(input_ids),
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "lora_path": lora_name,
            "stream": False,
        }
        body = await self._post_probe(op, "/generate", payload, lora_name)
        if "error" in body:
            raise self._refused(op, error_detail(body), lora_name=lora_name)
        meta = body.get("meta_info")
        if not isinstance(meta, dict):
            raise self._ambiguous(op, "generation answer has no meta_info", lora_name=lora_name)
        finish = meta.get("finish_reason")
        finish_type = finish.get("type") if isinstance(finish, dict) else finish
        if finish_type == "abort":
            message = finish.get("message") if isinstance(finish, dict) else None
            raise self._refused(op, str(message or "probe aborted"), lora_name=lora_name)
        raw_ids = body.get("output_ids")
        output_ids = tuple(int(x) for x in raw_ids) if isinstance(raw_ids, list) else ()
        if not output_ids and not body.get("text"):
            raise self._ambiguous(op, "probe produced no token", lora_name=lora_name)
        return ProbeResult(lora_name, output_ids, None if finish_type is None else str(finish_type))

    # --- server ----------------------------------------------------------------------------

    async def server_info(self) -> ServerInfo:
        """``/server_info`` (falling back to the older ``/get_server_info``), as the SGLang
        dialect reads it (:meth:`~agentic_lora.engines.sglang.SGLangDialect.read_server_info`)."""
        body = await SGLANG.read_server_info(self)
        version = body.get("version")
        model_path = body.get("model_path")
        return ServerInfo(
            version=None if version is None else str(version),
            model_path=None if model_path is None else str(model_path),
            fingerprint=server_fingerprint(body),
            raw=body,
        )

    # --- plumbing --------------------------------------------------------------------------

    def _read(self, op: str, response: httpx.Response, lora_name: str | None) -> dict[str, Any]:
        status = response.status_code
        try:
            body = response.json()
        except (ValueError, RecursionError):  # RecursionError: nested deeper than we decode
            body = None
        if status >= 500:
            raise self._ambiguous(
                op, f"HTTP {status}: {error_detail(body)}", lora_name=lora_name, status=status
            )
        if not isinstance(body, dict):
            if status >= 400:
                # The engine answered with an error page: the request was not processed.
                raise self._refused(op, f"HTTP {status}", lora_name=lora_name, status=status)
            raise self._ambiguous(
                op, f"HTTP {status} with a body that is not a JSON object", status=status
            )
        if status >= 400 and "success" not in body:
            raise self._refused(
                op, f"HTTP {status}: {error_detail(body)}", lora_name=lora_name, status=status
            )
        return body

    def _model_cards(self, answer: dict[str, Any]) -> list[Any]:
        data = answer.get("data")
        if not isinstance(data, list):
            raise self._ambiguous(LIST_MODELS, "model list has no 'data' array")
        return data


def _loaded_adapters(body: Mapping[str, Any]) -> dict[str, str] | None:
    raw = body.get("loaded_adapters")
    if not isinstance(raw, dict):
        return None
    out: dict[str, str] = {}
    for name, value in raw.items():
        # Older builds put a path here, newer ones may put a serialized LoRARef.
        if isinstance(value, dict):
            out[str(name)] = str(value.get("lora_path"))
        elif isinstance(value, list) and len(value) >= 3:
            out[str(name)] = str(value[2])
        else:
            out[str(name)] = str(value)
    return out
