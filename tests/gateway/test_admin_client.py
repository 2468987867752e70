"""What the admin client (the CLI's way to a gateway) makes of a peer that is not, or no longer,
an agentic-lora gateway: a streamed publication cut off or ending without an outcome, an
unreachable or lost call, answers that are not the gateway's, a URL that is not HTTP.

The broken peer is an ``httpx.MockTransport``: the edge of the client under test.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import VersionConflictError
from agentic_lora.gateway.client import AdminClient
from agentic_lora.gateway.wire import NDJSON
from tests.gateway.test_gateway import ADMIN_TOKEN


class Peer:
    """An HTTP peer scripted as a list of answers (a response, or an exception to raise)."""

    def __init__(self, *answers: httpx.Response | Exception) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def client(self, token: str | None = ADMIN_TOKEN) -> AdminClient:
        return AdminClient("http://gw/", token=token, transport=httpx.MockTransport(self))


def ndjson(*items: dict[str, Any], blank_lines: bool = False) -> httpx.Response:
    sep = "\n\n" if blank_lines else "\n"
    body = sep.join(json.dumps(i) for i in items) + "\n"
    return httpx.Response(200, content=body.encode(), headers={"content-type": NDJSON})


class CutOffStream(httpx.AsyncByteStream):
    """A response body that delivers ``first`` and then loses the connection."""

    def __init__(self, first: bytes) -> None:
        self.first = first

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.first
        raise httpx.ReadError("connection reset by peer")


PROGRESS = {"engine": "e0", "phase": "prepare", "status": "DONE", "seconds": 0.1}


@pytest.mark.asyncio
async def test_a_streamed_publication_skips_blank_lines_and_returns_the_result() -> None:
    peer = Peer(ndjson({"event": PROGRESS}, {"result": {"outcome": "PUBLISHED"}}, blank_lines=True))
    events: list[Any] = []
    async with peer.client() as admin:
        result = await admin.publish("/srv/a", "A", on_event=events.append)
        # Without a listener the events are read and dropped.
        peer.answers.append(ndjson({"event": PROGRESS}, {"result": {"outcome": "SKIPPED"}}))
        assert (await admin.publish("/srv/b", "B"))["outcome"] == "SKIPPED"
    assert result == {"outcome": "PUBLISHED"}
    assert events == [PROGRESS]
    first = peer.requests[0]
    assert (first.method, first.url.path) == ("POST", "/admin/publish")
    assert first.headers["accept"] == NDJSON
    assert first.headers["authorization"] == f"Bearer {ADMIN_TOKEN}"
    assert json.loads(first.content) == {"adapter_dir": "/srv/a", "version_id": "A"}


@pytest.mark.asyncio
async def test_an_error_line_in_the_stream_comes_back_as_its_typed_error() -> None:
    error = {"code": "VERSION_CONFLICT", "message": "A has other content", "details": {"v": "A"}}
    peer = Peer(
        ndjson({"event": PROGRESS}, {"error": error}),
        ndjson({"surprise": 1}),
    )
    async with peer.client() as admin:
        with pytest.raises(VersionConflictError) as conflict:
            await admin.publish("/srv/a", "A")
        with pytest.raises(AgenticLoRAError) as odd:
            await admin.publish("/srv/a", "A")
    assert (conflict.value.message, conflict.value.details) == ("A has other content", {"v": "A"})
    assert type(odd.value) is AgenticLoRAError
    assert odd.value.message == (
        "the gateway at http://gw answered HTTP 200 without an error body "
        "(is this an agentic-lora gateway?)"
    )
    assert odd.value.details == {"server": "http://gw", "status": 200}
    assert len(peer.requests) == 2


@pytest.mark.asyncio
async def test_a_stream_that_ends_or_breaks_without_an_outcome_is_indeterminate() -> None:
    cut = httpx.Response(200, stream=CutOffStream(json.dumps({"event": PROGRESS}).encode() + b"\n"))
    not_objects = httpx.Response(200, content=b"[1, 2]\n")
    peer = Peer(ndjson({"event": PROGRESS}), cut, not_objects)
    events: list[Any] = []
    async with peer.client() as admin:
        with pytest.raises(RequestIndeterminateError) as ended:
            await admin.publish("/srv/a", "A", on_event=events.append)
        with pytest.raises(RequestIndeterminateError) as broken:
            await admin.publish("/srv/a", "B", on_event=events.append)
        with pytest.raises(RequestIndeterminateError) as not_object:
            await admin.publish("/srv/a", "C")
    assert ended.value.message == (
        "the gateway at http://gw ended the publication stream of 'A' without an outcome; "
        "the publication may have happened (check `agentic-lora status`)"
    )
    assert broken.value.message.startswith(
        "POST /admin/publish to http://gw: the connection failed after the call went out "
        "(ReadError: connection reset by peer)"
    )
    assert not_object.value.message == ("POST /admin/publish: a progress line is not a JSON object")
    assert events == [PROGRESS, PROGRESS]  # each stream's progress arrived before it failed
    assert len(peer.requests) == 3  # nothing was resent


@pytest.mark.asyncio
async def test_unreachable_and_lost_calls_are_refused_or_indeterminate() -> None:
    peer = Peer(
        httpx.ConnectError("connection refused"),
        httpx.ConnectError("connection refused"),
        httpx.ReadTimeout("timed out"),
        httpx.RemoteProtocolError("server disconnected"),
    )
    async with peer.client() as admin:
        with pytest.raises(RequestRefusedError) as status_refused:
            await admin.status()
        with pytest.raises(RequestRefusedError) as publish_refused:
            await admin.publish("/srv/a", "A")
        with pytest.raises(RequestIndeterminateError) as reclaim_lost:
            await admin.reclaim()
        with pytest.raises(RequestIndeterminateError) as publish_lost:
            await admin.publish("/srv/a", "A")
    for refused in (status_refused.value, publish_refused.value):
        assert refused.message == (
            "cannot reach the agentic-lora gateway at http://gw (ConnectError: connection "
            "refused); is `agentic-lora serve` running?"
        )
        assert refused.details == {"server": "http://gw"}
    assert reclaim_lost.value.message == (
        "POST /admin/reclaim to http://gw: the connection failed after the call went out "
        "(ReadTimeout: timed out); it may have taken effect (check `agentic-lora status`)"
    )
    assert "(RemoteProtocolError: server disconnected)" in publish_lost.value.message
    assert [r.url.path for r in peer.requests] == [
        "/admin/status",
        "/admin/publish",
        "/admin/reclaim",
        "/admin/publish",
    ]


@pytest.mark.asyncio
async def test_answers_that_are_not_the_gateways_are_typed_errors() -> None:
    peer = Peer(
        httpx.Response(502, text="<html>Bad Gateway</html>"),
        httpx.Response(200, text="<html>welcome</html>"),
        httpx.Response(200, json=["not", "an", "object"]),
        httpx.Response(
            401,
            json={"error": {"code": "ACCESS_DENIED", "message": "wrong token", "details": 3}},
        ),
        httpx.Response(503, json={"error": {"code": "NO_SUCH_CODE", "message": "new"}}),
        httpx.Response(
            400,
            json={"error": {"code": "INVALID_REQUEST", "message": "relative", "details": {}}},
        ),
    )
    async with peer.client(token=None) as admin:
        with pytest.raises(AgenticLoRAError) as html_error:
            await admin.status()
        with pytest.raises(RequestIndeterminateError) as html_ok:
            await admin.reclaim()
        with pytest.raises(RequestIndeterminateError) as listed:
            await admin.status()
        with pytest.raises(AgenticLoRAError) as denied:
            await admin.status()
        with pytest.raises(AgenticLoRAError) as unknown:
            await admin.status()
        with pytest.raises(AgenticLoRAError) as refused_stream:
            await admin.publish("rel", "A")
    assert type(html_error.value) is AgenticLoRAError
    assert html_error.value.details == {"server": "http://gw", "status": 502}
    assert "answered HTTP 502 without an error body" in html_error.value.message
    assert html_ok.value.message == "POST /admin/reclaim: the gateway's answer is not JSON"
    assert listed.value.message == "GET /admin/status answered something that is not a JSON object"
    assert (denied.value.code, denied.value.message, denied.value.details) == (
        "ACCESS_DENIED",
        "wrong token",
        {},
    )
    assert (type(unknown.value), unknown.value.message) == (AgenticLoRAError, "new")
    assert refused_stream.value.code == "INVALID_REQUEST"
    assert all("authorization" not in r.headers for r in peer.requests)


def test_a_gateway_url_must_be_http() -> None:
    for url in ("ftp://gw", "gw:8000", ""):
        with pytest.raises(RequestRefusedError) as err:
            AdminClient(url, token="t")
        assert err.value.message == f"the gateway URL {url!r} is not http(s)"
        assert err.value.details == {"server": url}
