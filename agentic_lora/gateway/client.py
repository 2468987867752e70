"""A client for a running gateway's admin API (what ``agentic-lora
publish/status/reclaim/resolve/rollback`` use).

Every call is one HTTP attempt, never resent. Failures are typed like everywhere else:

* the gateway's own error answers are rebuilt from their stable code
  (:func:`~agentic_lora.errors.error_from_code`);
* a gateway that cannot be reached is :class:`~agentic_lora.errors.RequestRefusedError`: the
  call was not sent;
* a connection lost after the call went out is
  :class:`~agentic_lora.errors.RequestIndeterminateError`: a publication or reclaim may have
  happened; ``status`` tells.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NoReturn

import httpx

from agentic_lora.engines.transport import Outcome
from agentic_lora.engines.transport import classify_exception
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import error_from_code
from agentic_lora.foundation.http_limits import engine_limits
from agentic_lora.gateway.wire import NDJSON

__all__ = ["AdminClient"]

#: Receives each progress event of a streamed publication (the JSON form of a PhaseEvent).
EventCallback = Callable[[Mapping[str, Any]], None]


class AdminClient:
    """The ``/admin`` routes of the gateway at ``base_url``, authenticated with ``token``.

    ``transport`` replaces the HTTP transport (e.g. ``httpx.ASGITransport`` in tests).
    Publications and reclaims wait as long as they take (a reclaim waits for in-flight
    generations); ``timeout`` bounds connecting and status reads.
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise RequestRefusedError(
                f"the gateway URL {base_url!r} is not http(s)", server=base_url
            )
        self.base_url = base_url.rstrip("/")
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout),
            limits=engine_limits(),  # the gateway is uvicorn too: idle connections expire first
            transport=transport,
            trust_env=False,  # an environment proxy would be one more hop that may retry
            follow_redirects=False,
        )

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- calls ----------------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        """``GET /admin/status``: registry status, fleet and gateway Sessions."""
        return await self._call("GET", "/admin/status", read_limit=self._timeout)

    async def reclaim(self) -> dict[str, Any]:
        """``POST /admin/reclaim``: one reclaim round now."""
        return await self._call("POST", "/admin/reclaim", read_limit=None)

    async def resolve(self, version_id: str | None = None) -> dict[str, Any]:
        """``POST /admin/resolve``: finish ``version_id`` (None: every blocked publication)."""
        body = {} if version_id is None else {"version_id": version_id}
        return await self._call("POST", "/admin/resolve", read_limit=None, payload=body)

    async def engines(self, action: str | None = None, engine: str | None = None) -> dict[str, Any]:
        """``GET /admin/engines`` (no ``action``), or ``POST /admin/engines`` with ``action``
        (``add``, ``drain``, ``remove``) on ``engine``: the members and their membership."""
        if action is None:
            return await self._call("GET", "/admin/engines", read_limit=self._timeout)
        body = {"action": action, "engine": engine}
        return await self._call("POST", "/admin/engines", read_limit=None, payload=body)

    async def rollback(self, version_id: str, *, adapter_dir: str | None = None) -> dict[str, Any]:
        """``POST /admin/rollback``: make ``version_id`` the default again; the result (as a
        publication's). ``adapter_dir``: its content, a path on the gateway's host (only for a
        reclaimed version the gateway's store no longer holds)."""
        body: dict[str, Any] = {"version_id": version_id}
        if adapter_dir is not None:
            body["adapter_dir"] = adapter_dir
        return await self._call("POST", "/admin/rollback", read_limit=None, payload=body)

    async def publish(
        self, adapter_dir: str, version_id: str, *, on_event: EventCallback | None = None
    ) -> dict[str, Any]:
        """``POST /admin/publish``, streamed: ``on_event`` gets each phase; returns the result.

        ``adapter_dir`` is read by the gateway, so it must be a path on the gateway's host.
        """
        payload = {"adapter_dir": adapter_dir, "version_id": version_id}
        timeout = httpx.Timeout(None, connect=self._timeout)
        try:
            async with self._client.stream(
                "POST", "/admin/publish", json=payload, headers={"accept": NDJSON}, timeout=timeout
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    self._raise_answer(response)
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    item = self._decode_line(line)
                    if "event" in item:
                        if on_event is not None:
                            on_event(item["event"])
                    elif "result" in item:
                        result: dict[str, Any] = item["result"]
                        return result
                    else:
                        self._raise_error_body(item, status=response.status_code)
        except httpx.TransportError as exc:
            self._raise_transport(exc, "POST /admin/publish")
        raise RequestIndeterminateError(
            f"the gateway at {self.base_url} ended the publication stream of {version_id!r} "
            "without an outcome; the publication may have happened (check `agentic-lora status`)",
            server=self.base_url,
        )

    # --- plumbing -------------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        *,
        read_limit: float | None,
        payload: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        try:
            response = await self._client.request(
                method,
                path,
                json=payload,
                timeout=httpx.Timeout(read_limit, connect=self._timeout),
            )
        except httpx.TransportError as exc:
            self._raise_transport(exc, f"{method} {path}")
        if response.status_code != 200:
            self._raise_answer(response)
        body = self._decode(response.text, where=f"{method} {path}")
        if not isinstance(body, dict):
            raise RequestIndeterminateError(
                f"{method} {path} answered something that is not a JSON object",
                server=self.base_url,
            )
        return body

    def _raise_transport(self, exc: httpx.TransportError, what: str) -> NoReturn:
        if classify_exception(exc) is Outcome.REFUSED:
            raise RequestRefusedError(
                f"cannot reach the agentic-lora gateway at {self.base_url} "
                f"({type(exc).__name__}: {exc}); is `agentic-lora serve` running?",
                server=self.base_url,
            ) from exc
        raise RequestIndeterminateError(
            f"{what} to {self.base_url}: the connection failed after the call went out "
            f"({type(exc).__name__}: {exc}); it may have taken effect (check `agentic-lora status`)",
            server=self.base_url,
        ) from exc

    def _raise_answer(self, response: httpx.Response) -> NoReturn:
        try:
            body = json.loads(response.text)
        except ValueError:
            body = None
        self._raise_error_body(body, status=response.status_code)

    def _raise_error_body(self, body: Any, *, status: int) -> NoReturn:
        error = body.get("error") if isinstance(body, Mapping) else None
        if isinstance(error, Mapping) and isinstance(error.get("code"), str):
            details = error.get("details")
            raise error_from_code(
                error["code"],
                str(error.get("message", "")),
                **(dict(details) if isinstance(details, Mapping) else {}),
            )
        raise AgenticLoRAError(
            f"the gateway at {self.base_url} answered HTTP {status} without an error body "
            "(is this an agentic-lora gateway?)",
            server=self.base_url,
            status=status,
        )

    def _decode(self, text: str, *, where: str) -> Any:
        try:
            return json.loads(text)
        except ValueError as exc:
            raise RequestIndeterminateError(
                f"{where}: the gateway's answer is not JSON", server=self.base_url
            ) from exc

    def _decode_line(self, line: str) -> dict[str, Any]:
        item = self._decode(line, where="POST /admin/publish")
        if not isinstance(item, dict):
            raise RequestIndeterminateError(
                "POST /admin/publish: a progress line is not a JSON object", server=self.base_url
            )
        return item
