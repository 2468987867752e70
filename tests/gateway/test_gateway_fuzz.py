"""schemathesis fuzzes the gateway's OpenAPI document against a started gateway over scripted
engines (respx at the engine HTTP edge; the real registry, Sessions and gateway run).

Checks for every generated request: never a 5xx, the answer matches the documented status codes
and schemas, and a request the gateway refused (any 4xx but an engine's own refusal) left no
Session behind. Examples are bounded (hypothesis, derandomized) so the run stays short.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Awaitable
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from typing import TypeVar

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import response_schema_conformance
from schemathesis.specs.openapi.checks import status_code_conformance

from tests.gateway.test_gateway import Stack
from tests.gateway.test_gateway import gateway_stack

_T = TypeVar("_T")
# The generation routes and the close routes: where a Session could be opened, leaked or closed
# by someone else (the path form takes any id schemathesis draws, "/" and spaces included).
FUZZED = (
    "/v1/chat/completions",
    "/v1/completions",
    "/generate",
    "/v1/sessions/close",
    "/v1/sessions/{session_id}/close",
)


class _GatewayThread:
    """A started gateway stack on its own event loop thread; requests are sent into it."""

    def __init__(self, root: Path) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._root = root
        self._stack_cm: Any = None
        self.stack: Stack | None = None
        self.http: httpx.AsyncClient | None = None

    def run(self, work: Awaitable[_T]) -> _T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout=60)  # type: ignore[arg-type]

    def __enter__(self) -> _GatewayThread:
        self._thread.start()

        async def start() -> None:
            self._stack_cm = gateway_stack(self._root)
            self.stack = await self._stack_cm.__aenter__()
            await self.stack.publish("A", 1)
            self.http = self.stack.http()

        self.run(start())
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.run(self._stack_cm.__aexit__(None, None, None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_GatewayThread]:
    with _GatewayThread(tmp_path_factory.mktemp("fuzz")) as running:
        yield running


_ids = itertools.count()


def post_operations(document: dict[str, Any], paths: tuple[str, ...]) -> list[Any]:
    """The POST operations on ``paths`` of an OpenAPI ``document`` (those schemathesis parsed)."""
    schema = schemathesis.openapi.from_dict(document)
    return [
        result.ok()
        for result in schema.get_all_operations()
        if isinstance(result, Ok)
        and result.ok().path in paths
        and result.ok().method.upper() == "POST"
    ]


def _strategy(gateway: _GatewayThread) -> Any:
    assert gateway.http is not None
    document = gateway.run(gateway.http.get("/openapi.json")).json()
    operations = post_operations(document, FUZZED)
    assert len(operations) == len(FUZZED)
    return st.one_of([op.as_strategy() for op in operations])


def test_fuzzed_requests_never_get_a_5xx_match_the_schema_and_leak_no_session(
    gateway: _GatewayThread,
) -> None:
    stack, http = gateway.stack, gateway.http
    assert stack is not None
    assert http is not None
    strategy = _strategy(gateway)

    @settings(  # no deadline: the project's hypothesis profile (tests/conftest.py)
        max_examples=150,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy, with_id=st.booleans())
    def one(case: Any, with_id: bool) -> None:
        # Half the requests name a fresh Session (the OpenAI api_key), so bodies are judged.
        headers = {"authorization": f"Bearer fuzz-{next(_ids)}"} if with_id else {}
        kwargs = case.as_transport_kwargs(base_url="http://gateway", headers=headers)
        request = http.build_request(
            kwargs["method"],
            kwargs["url"],
            headers=kwargs.get("headers"),
            params=kwargs.get("params"),
            content=kwargs.get("content"),
            json=kwargs.get("json") if "content" not in kwargs else None,
        )
        before = stack.gateway.sessions.live()
        response = gateway.run(http.send(request))
        case.validate_response(
            response,
            checks=[not_a_server_error, status_code_conformance, response_schema_conformance],
        )
        assert response.status_code < 500, response.text
        if 400 <= response.status_code < 500:
            code = response.json()["error"]["code"]
            if code != "REQUEST_REFUSED":  # an engine's own 4xx comes after a valid request
                assert stack.gateway.sessions.live() <= before, (code, response.text)

    one()
    # The run exercised both sides: some requests were served, most were refused.
    served = [body for _, _, body in stack.routes.sent]
    assert served, "no fuzzed request was valid enough to reach an engine"
