"""Every way an engine exchange can fail has a refused/indeterminate verdict, and nothing a caller
or an engine sends makes the gateway answer an untyped 5xx.

aiohttp failures are raised at ``aiohttp.ClientSession._request`` (below httpx-aiohttp's own
exception mapping, which therefore runs for real) or produced by a loopback socket; httpx
failures come from respx. The expected verdicts are written out here, not read from the table.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import httpx
import pytest
import respx
from aiohttp import client_exceptions as ce
from multidict import CIMultiDict
from multidict import CIMultiDictProxy
from prometheus_client.parser import text_string_to_metric_families
from tenacity import wait_none
from yarl import URL as YURL

from agentic_lora.engines.admin import EngineAdminClient
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.engines.transport import _encode
from agentic_lora.engines.wire import EXCEPTION_TABLE
from agentic_lora.engines.wire import WIRE_ERRORS
from agentic_lora.engines.wire import Outcome
from agentic_lora.engines.wire import ReplyTooDeepError
from agentic_lora.engines.wire import classify_exception
from agentic_lora.engines.wire import decode_body
from agentic_lora.engines.wire import decode_content
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendRefusedError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.gateway.wire import JSONABLE_MAX_DEPTH
from agentic_lora.gateway.wire import error_payload
from agentic_lora.gateway.wire import jsonable
from tests.engines.loopback import loopback_server
from tests.engines.loopback import read_request
from tests.engines.test_transport import send_once
from tests.gateway.test_gateway import BASE_MODEL
from tests.gateway.test_gateway import Stack
from tests.gateway.test_gateway import gateway_stack

URL = "http://127.0.0.1:30000"
REFUSED, MAYBE = Outcome.REFUSED, Outcome.INDETERMINATE
# Deeper than any interpreter stack: json.loads gives up with RecursionError.
TOO_DEEP = 200_000


def transport(kind: str = "aiohttp", url: str = URL) -> EngineTransport:
    return EngineTransport(
        [EngineRef("e0", url)],
        http_transport=kind,  # type: ignore[arg-type]
        control_attempts=2,
        control_wait=wait_none(),
    )


def deep_list(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


# --- aiohttp: every class of its tree ---------------------------------------------------------

_KEY = SimpleNamespace(host="127.0.0.1", port=30000, ssl=False, is_ssl=lambda: False)
_INFO = aiohttp.RequestInfo(YURL(URL), "POST", CIMultiDictProxy(CIMultiDict()), YURL(URL))


def _answered(cls: type[ce.ClientResponseError]) -> Callable[[], BaseException]:
    return lambda: cls(_INFO, (), status=400, message="Invalid response status")


# (class, how to build one, verdict): was anything possibly accepted by the engine?
AIOHTTP_CASES: list[tuple[type[BaseException], Callable[[], BaseException], Outcome]] = [
    # Nothing left this process: the connection was never made, or the URL was never requested.
    (ce.ClientConnectorError, lambda: ce.ClientConnectorError(_KEY, OSError(111, "x")), REFUSED),
    (
        ce.ClientConnectorDNSError,
        lambda: ce.ClientConnectorDNSError(_KEY, OSError(-2, "no such host")),
        REFUSED,
    ),
    (
        ce.ClientProxyConnectionError,
        lambda: ce.ClientProxyConnectionError(_KEY, OSError(111, "x")),
        REFUSED,
    ),
    (
        ce.UnixClientConnectorError,
        lambda: ce.UnixClientConnectorError("/s", _KEY, OSError(2, "x")),
        REFUSED,
    ),
    (ce.ClientSSLError, lambda: ce.ClientSSLError(_KEY, OSError(1, "tls")), REFUSED),
    (
        ce.ClientConnectorSSLError,
        lambda: ce.ClientConnectorSSLError(_KEY, OSError(1, "tls")),
        REFUSED,
    ),
    (
        ce.ClientConnectorCertificateError,
        lambda: ce.ClientConnectorCertificateError(_KEY, ssl.SSLCertVerificationError("bad")),
        REFUSED,
    ),
    (ce.ConnectionTimeoutError, lambda: ce.ConnectionTimeoutError("connect"), REFUSED),
    (
        ce.ServerFingerprintMismatch,
        lambda: ce.ServerFingerprintMismatch(b"a" * 32, b"b" * 32, "127.0.0.1", 443),
        REFUSED,
    ),
    (ce.ClientHttpProxyError, _answered(ce.ClientHttpProxyError), REFUSED),
    (ce.InvalidURL, lambda: ce.InvalidURL("http://[x"), REFUSED),
    (ce.InvalidUrlClientError, lambda: ce.InvalidUrlClientError("http://[x"), REFUSED),
    (ce.NonHttpUrlClientError, lambda: ce.NonHttpUrlClientError("ftp://x"), REFUSED),
    # The request may be with the engine: a live connection failed, or the engine answered.
    (ce.ClientError, lambda: ce.ClientError("x"), MAYBE),
    (ce.ClientConnectionError, lambda: ce.ClientConnectionError("x"), MAYBE),
    (ce.ClientConnectionResetError, lambda: ce.ClientConnectionResetError("reset"), MAYBE),
    (ce.ClientOSError, lambda: ce.ClientOSError(104, "reset"), MAYBE),
    (ce.ServerConnectionError, lambda: ce.ServerConnectionError("x"), MAYBE),
    (ce.ServerDisconnectedError, lambda: ce.ServerDisconnectedError(), MAYBE),
    (ce.ServerTimeoutError, lambda: ce.ServerTimeoutError("x"), MAYBE),
    (ce.SocketTimeoutError, lambda: ce.SocketTimeoutError("read"), MAYBE),
    (ce.UploadAbortedError, lambda: ce.UploadAbortedError("x"), MAYBE),
    (ce.ClientPayloadError, lambda: ce.ClientPayloadError("cut"), MAYBE),
    (ce.ClientResponseError, _answered(ce.ClientResponseError), MAYBE),
    (ce.ContentTypeError, _answered(ce.ContentTypeError), MAYBE),
    (ce.WSServerHandshakeError, _answered(ce.WSServerHandshakeError), MAYBE),
    (ce.TooManyRedirects, _answered(ce.TooManyRedirects), MAYBE),
    (ce.RedirectClientError, lambda: ce.RedirectClientError("x"), MAYBE),
    (
        ce.InvalidUrlRedirectClientError,
        lambda: ce.InvalidUrlRedirectClientError("http://[x"),
        MAYBE,
    ),
    (
        ce.NonHttpUrlRedirectClientError,
        lambda: ce.NonHttpUrlRedirectClientError("ftp://x"),
        MAYBE,
    ),
]


def _aiohttp_tree() -> set[type[BaseException]]:
    found: set[type[BaseException]] = set()
    todo: list[type[BaseException]] = [aiohttp.ClientError]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("aiohttp") and cls not in found:
            found.add(cls)
            todo.extend(cls.__subclasses__())
    return found


def test_every_aiohttp_and_httpx_failure_type_has_its_own_entry() -> None:
    # A type without an entry would get its base's verdict silently: each one is decided here.
    assert _aiohttp_tree() <= set(EXCEPTION_TABLE)
    assert {cls for cls, _, _ in AIOHTTP_CASES} == _aiohttp_tree()
    httpx_tree: set[type[BaseException]] = set()
    todo: list[type[BaseException]] = [httpx.RequestError]
    while todo:
        cls = todo.pop()
        httpx_tree.add(cls)
        todo.extend(cls.__subclasses__())
    assert httpx_tree | {httpx.InvalidURL} <= set(EXCEPTION_TABLE)
    assert {cls for cls, _ in HTTPX_CASES} == httpx_tree | {httpx.InvalidURL}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("cls", "make", "outcome"), AIOHTTP_CASES, ids=[c.__name__ for c, _, _ in AIOHTTP_CASES]
)
async def test_each_aiohttp_failure_of_a_generation_is_classified_once(
    cls: type[BaseException],
    make: Callable[[], BaseException],
    outcome: Outcome,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []

    async def fail(self: aiohttp.ClientSession, method: str, url: Any, **kw: Any) -> Any:
        calls.append(str(url))
        raise make()

    monkeypatch.setattr(aiohttp.ClientSession, "_request", fail)
    async with transport("aiohttp") as t:
        expected = RequestRefusedError if outcome is REFUSED else RequestIndeterminateError
        with pytest.raises(expected) as info:
            await t.send("e0", "/generate", {"text": "x", "rid": "r1"})
    assert type(info.value) is expected  # not VersionUnavailableError or another subclass
    assert info.value.details["outcome"] == outcome.value
    assert calls == [URL + "/generate"]  # one attempt, never a second
    # Raw or mapped to an httpx type by httpx-aiohttp, the aiohttp error is the cause.
    chain: list[BaseException] = []
    cause: BaseException | None = info.value.__cause__
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__
    assert any(type(c) is cls for c in chain)
    assert classify_exception(make()) is outcome


# --- httpx: every class, through both clients -------------------------------------------------

HTTPX_CASES: list[tuple[type[BaseException], Outcome]] = [
    (httpx.ConnectError, REFUSED),
    (httpx.ConnectTimeout, REFUSED),
    (httpx.PoolTimeout, REFUSED),
    (httpx.UnsupportedProtocol, REFUSED),
    (httpx.ProxyError, REFUSED),
    (httpx.InvalidURL, REFUSED),
    (httpx.RequestError, MAYBE),
    (httpx.TransportError, MAYBE),
    (httpx.TimeoutException, MAYBE),
    (httpx.ReadTimeout, MAYBE),
    (httpx.WriteTimeout, MAYBE),
    (httpx.NetworkError, MAYBE),
    (httpx.ReadError, MAYBE),
    (httpx.WriteError, MAYBE),
    (httpx.CloseError, MAYBE),
    (httpx.ProtocolError, MAYBE),
    (httpx.LocalProtocolError, MAYBE),
    (httpx.RemoteProtocolError, MAYBE),
    (httpx.DecodingError, MAYBE),
    (httpx.TooManyRedirects, MAYBE),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("cls", "outcome"), HTTPX_CASES, ids=[c.__name__ for c, _ in HTTPX_CASES])
async def test_each_httpx_failure_is_classified_by_both_clients(
    cls: type[BaseException], outcome: Outcome
) -> None:
    exc = cls("scripted")
    assert classify_exception(exc) is outcome
    t = transport("httpx")
    admin = EngineAdminClient(URL, engine="e0")
    try:
        with respx.mock(using="httpx") as mock:
            generate = mock.post(URL + "/generate").mock(side_effect=exc)
            load = mock.post(URL + "/load_lora_adapter").mock(side_effect=exc)
            models = mock.get(URL + "/v1/models").mock(side_effect=exc)
            generation = RequestRefusedError if outcome is REFUSED else RequestIndeterminateError
            with pytest.raises(generation):
                await t.send("e0", "/generate", {"text": "x"})
            backend = BackendRefusedError if outcome is REFUSED else BackendAmbiguousError
            with pytest.raises(backend):
                await admin.load_lora_adapter("v1", "/p")
            with pytest.raises(backend):
                await admin.get_answer("list_models", "/v1/models")
            assert (generate.call_count, load.call_count, models.call_count) == (1, 1, 1)
    finally:
        await admin.aclose()
        await t.aclose()


GZIP_GARBAGE = {"content-encoding": "gzip", "content-type": "application/json"}


def not_gzip() -> httpx.ByteStream:
    # A stream, not content=: httpx decodes content= when the Response is built.
    return httpx.ByteStream(b"not gzip")


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["aiohttp", "httpx"])
async def test_a_reply_in_an_undecodable_content_encoding(kind: str) -> None:
    # Each stack names the failure its own way; both mean "the engine answered, then the body
    # could not be read".
    error = {"aiohttp": "ClientPayloadError", "httpx": "DecodingError"}[kind]
    statuses = iter([b"200 OK", b"400 Bad Request"])
    received: list[bytes] = []

    async def gzip_garbage(reader: Any, writer: Any) -> None:
        received.append(await read_request(reader))
        writer.write(
            b"HTTP/1.1 " + next(statuses) + b"\r\ncontent-encoding: gzip\r\n"
            b"content-type: application/json\r\ncontent-length: 8\r\n"
            b"connection: close\r\n\r\nnot gzip"
        )
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    async with loopback_server(gzip_garbage) as url, transport(kind, url) as t:
        with pytest.raises(RequestIndeterminateError) as ran:
            await t.send("e0", "/generate", {"text": "x"})
        assert (ran.value.details["status"], ran.value.details["error"]) == (200, error)
        # The engine said no: still a refusal, whatever the body's encoding.
        with pytest.raises(RequestRefusedError) as refused:
            await t.send("e0", "/generate", {"text": "x"})
        assert refused.value.details["status"] == 400
    assert len(received) == 2  # one attempt each


@pytest.mark.asyncio
async def test_an_undecodable_admin_reply_is_ambiguous() -> None:
    async with EngineAdminClient(URL, engine="e0") as admin:
        with respx.mock(using="httpx") as mock:
            mock.post(URL + "/load_lora_adapter").respond(
                200, headers=GZIP_GARBAGE, stream=not_gzip()
            )
            with pytest.raises(BackendAmbiguousError, match="DecodingError"):
                await admin.load_lora_adapter("v1", "/p")


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["aiohttp", "httpx"])
async def test_a_malformed_status_line_over_a_real_socket_is_indeterminate(kind: str) -> None:
    received: list[bytes] = []

    async def garbage(reader: Any, writer: Any) -> None:
        received.append(await read_request(reader))
        writer.write(b"HTTP/1.1 TWO HUNDRED OK\r\ncontent-length: 2\r\n\r\n{}")
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    async with loopback_server(garbage) as url:
        with pytest.raises(RequestIndeterminateError):
            await send_once(kind, url, {"text": "x"})
    assert len(received) == 1  # the engine had it, once


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["aiohttp", "httpx"])
async def test_an_engine_url_that_cannot_be_requested_is_refused(kind: str) -> None:
    async with transport(kind, "http://[::1") as t:
        with pytest.raises(RequestRefusedError, match="was not sent"):
            await t.send("e0", "/generate", {"text": "x"})


@pytest.mark.asyncio
async def test_an_admin_url_that_cannot_be_requested_is_refused() -> None:
    async with EngineAdminClient("http://[::1", engine="e0") as admin:
        with pytest.raises(BackendRefusedError, match="InvalidURL"):
            await admin.load_lora_adapter("v1", "/p")


@pytest.mark.asyncio
async def test_a_close_that_fails_after_a_lost_reply_does_not_replace_its_verdict(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def cut_off(reader: Any, writer: Any) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
        writer.write(b'content-length: 100\r\n\r\n{"text":')  # 9 of 100 bytes
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    release = aiohttp.ClientResponse.close

    def broken_close(self: aiohttp.ClientResponse) -> None:
        release(self)  # the connection is let go; only the report fails
        raise ce.ClientOSError(104, "reset while releasing")

    monkeypatch.setattr(aiohttp.ClientResponse, "close", broken_close)
    caplog.set_level(logging.DEBUG, logger="agentic_lora.engines.transport")
    async with loopback_server(cut_off) as url, transport("aiohttp", url) as t:
        with pytest.raises(RequestIndeterminateError, match="reply lost while reading"):
            await t.send("e0", "/generate", {"text": "x", "rid": "r-close"})
    [record] = [r for r in caplog.records if getattr(r, "rid", None) == "r-close"]
    assert (record.engine, record.rid, record.error) == (  # type: ignore[attr-defined]
        "e0",
        "r-close",
        "ClientOSError",
    )


def test_wire_errors_cover_the_table() -> None:
    for cls in EXCEPTION_TABLE:
        assert issubclass(cls, WIRE_ERRORS) or cls is httpx.HTTPError, cls
    # What is in neither tree cannot be proven unsent.
    assert classify_exception(RuntimeError("not a wire error")) is MAYBE


# --- JSON that cannot be re-encoded ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_caller_body_json_cannot_carry_is_invalid_and_never_sent() -> None:
    async with transport("httpx") as t:
        with respx.mock(using="httpx", assert_all_called=False) as mock:
            route = mock.post(URL + "/generate").respond(200, json={})
            for body in (
                {"text": "x", "sampling_params": {"temperature": float("nan")}},
                {"text": "x", "deep": deep_list(TOO_DEEP)},
                {"text": "\ud800"},
            ):
                with pytest.raises(InvalidRequestError) as info:
                    await t.send("e0", "/generate", body)
                assert info.value.details["reason"] == "not_json"
            assert route.call_count == 0


def test_a_body_is_encoded_as_json_dumps_encodes_it_with_the_same_options() -> None:
    body = {
        "text": 'h\u00e9llo \u2713 "quoted"\n',
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.5, "stop": ["</s>"]},
        "input_ids": None,
        "return_logprob": True,
        "rid": "r-1",
    }
    expected = json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    assert _encode(body) == expected.encode()
    # The encoder is shared: a refused body leaves nothing behind for the next one.
    with pytest.raises(InvalidRequestError):
        _encode({"text": "x", "sampling_params": {"temperature": float("inf")}})
    assert _encode(body) == expected.encode()


def _deep_json(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.asyncio
async def test_an_engine_reply_too_deep_to_decode() -> None:
    async with transport("httpx") as t:
        with respx.mock(using="httpx") as mock:
            route = mock.post(URL + "/generate")
            route.return_value = httpx.Response(200, content=_deep_json(TOO_DEEP))
            with pytest.raises(RequestIndeterminateError) as ran:
                await t.send("e0", "/generate", {"text": "x"})
            assert ran.value.details["reason"] == "reply_not_json"
            assert isinstance(ran.value.__cause__, ReplyTooDeepError)
            route.return_value = httpx.Response(422, content=_deep_json(TOO_DEEP))
            with pytest.raises(RequestRefusedError) as refused:
                await t.send("e0", "/generate", {"text": "x"})
            assert refused.value.details["status"] == 422
            # A control read is asked again (a lost reply), then fails indeterminate.
            info = mock.get(URL + "/server_info").respond(200, content=_deep_json(TOO_DEEP))
            with pytest.raises(RequestIndeterminateError):
                await t.server_info("e0")
            assert info.call_count == 2


@pytest.mark.asyncio
async def test_an_admin_reply_too_deep_to_decode() -> None:
    async with EngineAdminClient(URL, engine="e0") as admin:
        with respx.mock(using="httpx") as mock:
            mock.post(URL + "/load_lora_adapter").respond(200, content=_deep_json(TOO_DEEP))
            with pytest.raises(BackendAmbiguousError, match="not a JSON object"):
                await admin.load_lora_adapter("v1", "/p")
            models = mock.get(URL + "/v1/models")
            models.return_value = httpx.Response(200, content=_deep_json(TOO_DEEP))
            with pytest.raises(BackendAmbiguousError, match="nests deeper"):
                await admin.get_answer("list_models", "/v1/models")
            models.return_value = httpx.Response(404, content=_deep_json(TOO_DEEP))
            with pytest.raises(BackendRefusedError) as refused:
                await admin.get_answer("list_models", "/v1/models")
            assert refused.value.details["status"] == 404


def test_decode_body_keeps_non_json_as_text_and_flags_only_depth() -> None:
    assert decode_body(httpx.Response(200, content=b"")) is None
    assert decode_body(httpx.Response(200, content=b"oops")) == "oops"
    assert decode_body(httpx.Response(200, content=b"[1, NaN]"))[0] == 1
    with pytest.raises(ReplyTooDeepError) as info:
        decode_body(httpx.Response(502, content=_deep_json(TOO_DEEP)))
    assert info.value.status == 502


@pytest.mark.parametrize(
    "content",
    [
        b'{"text": "caf\xc3\xa9"}',
        '{"text": "café"}'.encode("utf-8-sig"),  # a BOM: not UTF-8 text JSON parses
        '{"text": "café"}'.encode("utf-16"),
        '{"text": "café"}'.encode("utf-32-le"),  # no BOM: NULs in valid UTF-8
        b"[1, NaN]",
    ],
)
def test_decode_content_reads_what_json_loads_of_the_bytes_reads(content: bytes) -> None:
    assert decode_content(200, content, "utf-8") == json.loads(content)


class BrokenRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class BrokenStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str")


def test_jsonable_makes_strict_json_of_anything() -> None:
    value = {
        "nan": float("nan"),
        "inf": float("-inf"),
        "ok": 1.5,
        "surrogate": "a\ud800b",
        "\udc00key": 1,
        "deep": deep_list(JSONABLE_MAX_DEPTH + 10),
        "broken": BrokenRepr(),
    }
    out = jsonable(value)
    # Strict JSON, encodable as UTF-8: what the gateway's JSONResponse does with it.
    json.dumps(out, allow_nan=False, ensure_ascii=False).encode()
    assert (out["nan"], out["inf"], out["ok"]) == ("nan", "-inf", 1.5)
    assert out["surrogate"] == "a\\ud800b"
    assert out["\\udc00key"] == 1
    assert out["broken"] == "<BrokenRepr>"
    level = out["deep"]
    for _ in range(JSONABLE_MAX_DEPTH - 1):
        level = level[0]
    assert level == f"<list nested deeper than {JSONABLE_MAX_DEPTH} levels>"
    payload = error_payload(BrokenStr())
    assert payload["error"]["message"] == "unexpected BrokenStr: <BrokenStr>"
    refused = RequestRefusedError("engine said \udfff", body={"score": float("nan")})
    assert error_payload(refused)["error"]["message"] == "engine said \\udfff"


# --- the gateway ---------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": BASE_MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def _engines_answer(stack: Stack, response: httpx.Response) -> None:
    for engine in stack.fleet.engines.values():
        stack.fleet.router.post(engine.base_url + CHAT).mock(return_value=response)


@pytest.mark.asyncio
async def test_odd_engine_answers_get_typed_gateway_answers(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path) as stack:
        await stack.publish("A", 1)
        client = stack.http()
        auth = {"authorization": "Bearer odd-answers"}
        cases: list[tuple[httpx.Response, int, str, str]] = [
            # An engine refusal whose body strict JSON cannot carry: still the engine's 4xx.
            (
                httpx.Response(400, content=b'{"error": {"message": "bad", "p": NaN}}'),
                400,
                "REQUEST_REFUSED",
                "refused",
            ),
            (
                httpx.Response(400, content=b'{"error": {"message": "bad \\ud800"}}'),
                400,
                "REQUEST_REFUSED",
                "refused",
            ),
            (
                httpx.Response(400, content=json.dumps({"e": deep_list(200)}).encode()),
                400,
                "REQUEST_REFUSED",
                "refused",
            ),
            # The engine ran it, and its answer cannot be carried on.
            (httpx.Response(200, content=_deep_json(TOO_DEEP)), 502, "REQUEST_INDETERMINATE", ""),
            (
                httpx.Response(200, headers=GZIP_GARBAGE, stream=not_gzip()),
                502,
                "REQUEST_INDETERMINATE",
                "",
            ),
        ]
        for reply, status, code, _ in cases:
            _engines_answer(stack, reply)
            response = await client.post(CHAT, json=_chat(), headers=auth)
            assert (response.status_code, response.json()["error"]["code"]) == (status, code)
            expected = "refused" if status == 400 else "indeterminate"
            assert response.headers["x-agentic-outcome"] == expected
            assert response.headers["x-should-retry"] == "false"
        metrics = stack.gateway.metrics
        assert metrics is not None
        samples = _samples(metrics.exposition())
        # The engine refused these, not the gateway's input checks.
        assert samples.get(("agentic_lora_gateway_refused_requests_total", "INVALID_REQUEST")) == 0


def _samples(text: bytes) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name.startswith("agentic_lora_gateway_refused_requests"):
                assert set(sample.labels) <= {"code"}, sample  # never a Session or version
            out[(sample.name, sample.labels.get("code", ""))] = sample.value
    return out


@pytest.mark.asyncio
async def test_requests_refused_for_bad_input_are_counted_by_code(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, settings={"gateway_max_body_bytes": 4096}) as stack:
        await stack.publish("A", 1)
        client = stack.http()
        auth = {"authorization": "Bearer counted"}
        name = "agentic_lora_gateway_refused_requests_total"
        metrics = stack.gateway.metrics
        assert metrics is not None
        before = _samples(metrics.exposition())
        assert {code for (n, code) in before if n == name} == {
            "INVALID_REQUEST",
            "REQUEST_TOO_LARGE",
            "ADAPTER_MISMATCH",
            "ACCESS_DENIED",
        }
        refusals = [
            (client.post(CHAT, content=b"{not json", headers=auth), 400),
            (client.post(CHAT, content=b'{"model": "base-model", "x": NaN}', headers=auth), 400),
            (client.post(CHAT, json=_chat(pad="x" * 5000), headers=auth), 413),
            (client.post(CHAT, json=_chat(model="someone-else"), headers=auth), 400),
            (client.post(CHAT, json=_chat()), 401),
        ]
        for pending, status in refusals:
            assert (await pending).status_code == status
        ok = await client.post(CHAT, json=_chat(), headers=auth)
        assert ok.status_code == 200
        after = _samples(metrics.exposition())
        assert after[(name, "INVALID_REQUEST")] == 2
        assert after[(name, "REQUEST_TOO_LARGE")] == 1
        assert after[(name, "ADAPTER_MISMATCH")] == 1
        assert after[(name, "ACCESS_DENIED")] == 1
        # An engine that is unreachable refuses too, but that is not the caller's input.
        stack.routes.fail_next("unreachable")
        failed = await client.post(CHAT, json=_chat(), headers=auth)
        assert failed.json()["error"]["code"] == "REQUEST_REFUSED"
        final = _samples(metrics.exposition())
        assert {k: v for k, v in final.items() if k[0] == name} == {
            k: v for k, v in after.items() if k[0] == name
        }
