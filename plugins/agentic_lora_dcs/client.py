"""The publisher's typed HTTP client for one receiver sidecar (one attempt per call, no retries).

Every reply is classified the way :mod:`agentic_lora.engines.backends` asks:

* a 2xx body that parses: the message was acted on (its reply model is returned);
* a :class:`~agentic_lora_dcs.protocol.RefusalReply` with ``clean=True``:
  :class:`~agentic_lora.errors.BackendRefusedError` (``details["reason"]`` is the sidecar's
  stable reason); the sidecar holds nothing of the attempt the message named;
* the request provably never left this process (connect failure):
  :class:`~agentic_lora.errors.BackendRefusedError` with ``reason="NOT_SENT"``; the message did
  nothing, though earlier messages of the same attempt may have (the driver decides);
* anything else (a timeout after sending, a reset, 5xx, ``clean=False``, a body that does not
  parse): :class:`~agentic_lora.errors.BackendAmbiguousError`.
"""

from __future__ import annotations

import logging
from typing import Any
from typing import TypeVar

import httpx
from pydantic import BaseModel
from pydantic import ValidationError

from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendError
from agentic_lora.errors import BackendRefusedError
from agentic_lora_dcs.protocol import PATHS
from agentic_lora_dcs.protocol import BeginReply
from agentic_lora_dcs.protocol import BeginRequest
from agentic_lora_dcs.protocol import BucketReply
from agentic_lora_dcs.protocol import BucketRequest
from agentic_lora_dcs.protocol import CleanupReply
from agentic_lora_dcs.protocol import CleanupRequest
from agentic_lora_dcs.protocol import EndRequest
from agentic_lora_dcs.protocol import IncarnationReply
from agentic_lora_dcs.protocol import ReadyReply
from agentic_lora_dcs.protocol import ReclaimReply
from agentic_lora_dcs.protocol import ReclaimRequest
from agentic_lora_dcs.protocol import RefusalReply
from agentic_lora_dcs.protocol import StatusReply

__all__ = ["NOT_SENT", "SidecarClient"]

logger = logging.getLogger(__name__)

NOT_SENT = "NOT_SENT"

_R = TypeVar("_R", bound=BaseModel)

# Failures that happen before a request leaves this process: the sidecar never saw it.
_NOT_SENT_ERRORS: tuple[type[httpx.TransportError], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.UnsupportedProtocol,
)


class _Default:
    """Marker: use the HTTP client's own timeout."""


_DEFAULT = _Default()


class SidecarClient:
    """Control messages to the sidecar at ``base_url`` for engine ``engine``."""

    def __init__(
        self,
        base_url: str,
        *,
        engine: str,
        client: httpx.AsyncClient,
        end_timeout: float | None,
        token: str,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"sidecar URL must be http(s): {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.engine = engine
        self._client = client
        self._end_timeout = end_timeout
        # Sent on every call; never logged (the client's repr and our log lines omit it).
        self._auth = {"authorization": f"Bearer {token}"}

    async def incarnation(self) -> IncarnationReply:
        return await self._call("GET", "incarnation", None, IncarnationReply)

    async def begin(self, message: BeginRequest) -> BeginReply:
        return await self._call("POST", "begin", message, BeginReply)

    async def bucket(self, message: BucketRequest) -> BucketReply:
        return await self._call("POST", "bucket", message, BucketReply)

    async def end(self, message: EndRequest) -> ReadyReply:
        # End materialises and loads the adapter: it may take as long as an engine load.
        return await self._call("POST", "end", message, ReadyReply, read_timeout=self._end_timeout)

    async def cleanup(self, message: CleanupRequest) -> CleanupReply:
        # A cleanup may wait for a running End and an unload.
        return await self._call(
            "POST", "cleanup", message, CleanupReply, read_timeout=self._end_timeout
        )

    async def reclaim(self, message: ReclaimRequest) -> ReclaimReply:
        # The engine's unload waits for in-flight requests using the adapter: no read deadline.
        return await self._call("POST", "reclaim", message, ReclaimReply, read_timeout=None)

    async def status(self) -> StatusReply:
        return await self._call("GET", "status", None, StatusReply)

    async def _call(
        self,
        method: str,
        op: str,
        message: BaseModel | None,
        reply_model: type[_R],
        *,
        read_timeout: float | _Default | None = _DEFAULT,
    ) -> _R:
        url = self.base_url + PATHS[op]
        kwargs: dict[str, Any] = {}
        if not isinstance(read_timeout, _Default):
            default = self._client.timeout
            kwargs["timeout"] = httpx.Timeout(
                connect=default.connect, read=read_timeout, write=default.write, pool=default.pool
            )
        try:
            if message is None:
                response = await self._client.request(method, url, headers=self._auth, **kwargs)
            else:
                response = await self._client.request(
                    method,
                    url,
                    content=message.model_dump_json(),
                    headers={"content-type": "application/json", **self._auth},
                    **kwargs,
                )
        except httpx.TransportError as exc:
            raise self._transport_failure(op, exc) from exc
        return self._classify(op, response, reply_model)

    def _classify(self, op: str, response: httpx.Response, reply_model: type[_R]) -> _R:
        status = response.status_code
        if 200 <= status < 300:
            try:
                return reply_model.model_validate_json(response.content)
            except ValidationError as exc:
                raise self._ambiguous(op, f"HTTP {status} with an unreadable reply: {exc}") from exc
        try:
            refusal = RefusalReply.model_validate_json(response.content)
        except ValidationError:
            raise self._ambiguous(
                op, f"HTTP {status} without a refusal body", status=status
            ) from None
        details = {"reason": str(refusal.reason), "status": status, **refusal.details}
        if refusal.clean:
            logger.info(
                "sidecar of %s refused %s: %s %s",
                self.engine,
                op,
                refusal.reason,
                refusal.message,
                extra={"engine": self.engine},
            )
            raise BackendRefusedError(
                f"{self.engine} {op}: {refusal.reason}: {refusal.message}",
                engine=self.engine,
                op=op,
                **details,
            )
        raise self._ambiguous(op, f"{refusal.reason}: {refusal.message}", **details)

    def _transport_failure(self, op: str, exc: httpx.TransportError) -> BackendError:
        message = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, _NOT_SENT_ERRORS):
            return BackendRefusedError(
                f"{self.engine} {op}: not sent: {message}",
                engine=self.engine,
                op=op,
                reason=NOT_SENT,
            )
        return self._ambiguous(op, message, reason=type(exc).__name__)

    def _ambiguous(self, op: str, message: str, **details: Any) -> BackendAmbiguousError:
        logger.warning(
            "sidecar of %s: %s outcome unknown: %s",
            self.engine,
            op,
            message,
            extra={"engine": self.engine},
        )
        details.setdefault("reason", "UNKNOWN")
        return BackendAmbiguousError(
            f"{self.engine} {op}: {message}", engine=self.engine, op=op, **details
        )
