"""Gateway hardening: every bad input a typed 4xx before any Session exists, bounded Sessions,
close ownership, no credential in logs (scripted engines at the HTTP edge; the real registry,
Sessions and gateway run)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentic_lora.gateway.limits import GatewayLimits
from agentic_lora.gateway.security import AccessLogRedactor
from agentic_lora.gateway.security import SessionTagger
from tests.gateway.test_gateway import ADMIN_TOKEN
from tests.gateway.test_gateway import BASE_MODEL
from tests.gateway.test_gateway import Stack
from tests.gateway.test_gateway import chat
from tests.gateway.test_gateway import gateway_stack
from tests.gateway.test_gateway import lora_server_info

CHAT = "/v1/chat/completions"


def _as(session_id: str) -> dict[str, str]:
    return {"authorization": f"Bearer {session_id}"}


def _chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": BASE_MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


async def _refused_before_any_session(
    stack: Stack, path: str, content: bytes, *, status: int = 400, session: str = "bad"
) -> dict[str, Any]:
    sent_before = len(stack.routes.sent)
    response = await stack.http().post(
        path, content=content, headers={**_as(session), "content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    assert response.headers["x-agentic-outcome"] == "refused"
    assert response.headers["x-should-retry"] == "false"
    assert stack.gateway.sessions.live() == 0  # no Session was opened for it
    assert stack.gateway.versioning.get(session) is None
    assert len(stack.routes.sent) == sent_before  # nothing reached an engine
    error: dict[str, Any] = response.json()["error"]
    return error


# --- point 1: limits before any Session ---------------------------------------------------------


@pytest.mark.asyncio
async def test_a_body_over_the_limit_is_413_without_reading_the_rest(tmp_path: Path) -> None:
    settings = {"gateway_max_body_bytes": 4096}
    async with gateway_stack(tmp_path, settings=settings, published="A") as stack:
        # Declared too large: refused before a byte of the body is read.
        error = await _refused_before_any_session(
            stack, CHAT, b"x" * 5000, status=413, session="big"
        )
        assert error["code"] == "REQUEST_TOO_LARGE"
        assert error["details"]["limit"] == 4096

        # Streamed without a length: refused once the limit is passed; the rest is never read.
        pulled = 0

        async def chunks() -> AsyncIterator[bytes]:
            nonlocal pulled
            for _ in range(1000):  # 1 MiB in 1 KiB chunks
                pulled += 1
                yield b" " * 1024

        response = await stack.http().post(CHAT, content=chunks(), headers=_as("streamed"))
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "REQUEST_TOO_LARGE"
        assert pulled <= 6  # 4 KiB limit: the fifth chunk passes it (plus one read ahead)
        assert stack.gateway.sessions.live() == 0


@pytest.mark.asyncio
async def test_deep_json_is_a_400_never_a_500(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        deep = b"[" * 100_000 + b"]" * 100_000
        error = await _refused_before_any_session(stack, CHAT, deep)
        assert (error["code"], error["details"]["reason"]) == ("INVALID_REQUEST", "too_deep")
        # Just past the limit (64), inside an otherwise valid body.
        nested: Any = "x"
        for _ in range(64):
            nested = [nested]
        body = json.dumps(_chat_body(extra_field=nested)).encode()
        error = await _refused_before_any_session(stack, CHAT, body)
        assert error["details"]["reason"] == "too_deep"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (CHAT, _chat_body(n=10**9), "n"),
        (CHAT, _chat_body(max_tokens=10**12), "max_tokens"),
        (CHAT, _chat_body(max_completion_tokens=0), "max_completion_tokens"),
        (
            CHAT,
            {"model": BASE_MODEL, "messages": [{"role": "user", "content": [["nested"]]}]},
            "messages",
        ),
        (CHAT, {"model": BASE_MODEL, "messages": [{"role": "user", "content": "x"}] * 1025}, ""),
        (CHAT, _chat_body(n="2"), "n"),  # no string-for-number coercion
        (CHAT, _chat_body(temperature=True), "temperature"),
        (CHAT, {"model": BASE_MODEL, "messages": []}, "messages"),
        (CHAT, {"model": BASE_MODEL, "messages": [{"role": "wizard", "content": "x"}]}, ""),
        ("/v1/completions", {"model": BASE_MODEL, "prompt": "x", "max_tokens": -1}, ""),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 10**12}}, ""),
        ("/generate", {"text": "x", "input_ids": [1]}, ""),
        ("/generate", {"sampling_params": {"n": 10**9}}, ""),
    ],
)
@pytest.mark.asyncio
async def test_out_of_bounds_fields_are_400s_that_open_no_session(
    tmp_path: Path, path: str, body: dict[str, Any], field: str
) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        error = await _refused_before_any_session(stack, path, json.dumps(body).encode())
        assert error["code"] == "INVALID_REQUEST"
        assert error["details"]["reason"] == "schema"
        assert field in error["message"]
        # The refusal names fields, never the values sent.
        assert "1000000000" not in error["message"]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (
            b'{"model": "base-model", "messages": [{"role": "user", "content": "x"}], "top_p": NaN}',
            "not_json",
        ),
        (
            b'{"model": "base-model", "messages": [{"role": "user", "content": "\\ud800"}]}',
            "not_json",
        ),
        # A float out of range is infinity to Python: not JSON an engine can be sent.
        (
            b'{"model": "base-model", "messages": [{"role": "user", "content": "x"}], '
            b'"extra": -1e999}',
            "not_json",
        ),
        # A lone surrogate written as raw bytes, and one escaped in a body that is not ASCII.
        (
            b'{"model": "base-model", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
            "not_json",
        ),
        (
            '{"model": "base-model", "messages": [{"role": "user", "content": "\u00e9\\udc00"}]}'.encode(),
            "not_json",
        ),
        (b'{"messages": ', "not_json"),
        (b"\xff\xfe\x00", "not_json"),
        (b'"a string"', "not_object"),
    ],
)
@pytest.mark.asyncio
async def test_malformed_json_is_a_typed_400(tmp_path: Path, raw: bytes, reason: str) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        error = await _refused_before_any_session(stack, CHAT, raw)
        assert (error["code"], error["details"]["reason"]) == ("INVALID_REQUEST", reason)


@pytest.mark.asyncio
async def test_a_model_no_session_can_serve_is_refused_before_a_session_opens(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        body = json.dumps(_chat_body(model="gpt-4o")).encode()
        error = await _refused_before_any_session(stack, CHAT, body)
        assert (error["code"], error["details"]["reason"]) == ("ADAPTER_MISMATCH", "unknown_model")


@pytest.mark.asyncio
async def test_max_tokens_is_bounded_by_the_engines_context_length(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path) as stack:
        lora_server_info(stack.fleet, context_length=256)
        limits = await stack.gateway.learn_engine_limits()
        assert limits.max_tokens == 256
        await stack.publish("A", 1)
        over = json.dumps(_chat_body(max_tokens=257)).encode()
        await _refused_before_any_session(stack, CHAT, over)
        ok = await stack.http().post(CHAT, json=_chat_body(max_tokens=256), headers=_as("fits"))
        assert ok.status_code == 200
    assert GatewayLimits().with_context_length(None).max_tokens == 32768
    assert GatewayLimits().with_context_length(10**9).max_tokens == 32768


# --- point 2: bounds on Sessions ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_session_bound_answers_429_with_retry_after_and_frees_on_close(
    tmp_path: Path,
) -> None:
    async with gateway_stack(
        tmp_path, settings={"gateway_max_sessions": 2}, published="A"
    ) as stack:
        http = stack.http()
        for session_id in ("one", "two"):
            assert (await http.post(CHAT, json=_chat_body(), headers=_as(session_id))).is_success
        full = await http.post(CHAT, json=_chat_body(), headers=_as("three"))
        assert full.status_code == 429
        assert full.json()["error"]["code"] == "TOO_MANY_SESSIONS"
        assert int(full.headers["retry-after"]) >= 1
        assert full.headers["x-agentic-outcome"] == "refused"
        assert full.headers["x-should-retry"] == "true"  # nothing ran
        assert stack.gateway.versioning.get("three") is None
        # Open Sessions keep working at the bound.
        assert (await http.post(CHAT, json=_chat_body(), headers=_as("one"))).is_success
        closed = await http.post("/v1/sessions/close", headers=_as("two"))
        assert closed.json()["found"] is True
        assert (await http.post(CHAT, json=_chat_body(), headers=_as("three"))).is_success


@pytest.mark.asyncio
async def test_idle_expiry_is_on_by_default_and_can_be_turned_off(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path) as stack:
        assert stack.gateway.idle_timeout == 900.0
    async with gateway_stack(tmp_path, settings={"gateway_idle_timeout": 0}) as stack:
        assert stack.gateway.idle_timeout is None
    async with gateway_stack(tmp_path, idle_timeout=5.0) as stack:
        assert stack.gateway.idle_timeout == 5.0


# --- point 3: ownership -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_session_is_closed_only_with_its_own_credential_or_the_admin_token(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        for victim in ("victim", "victim-2", "victim-3"):
            await chat(stack.agent(victim))
        http = stack.http()

        anonymous = await http.post("/v1/sessions/victim/close")
        assert anonymous.status_code == 401
        assert anonymous.json()["error"]["details"]["reason"] == "not_owner"
        other = await http.post("/v1/sessions/victim/close", headers=_as("attacker"))
        assert other.status_code == 401
        wrong_admin = await http.post("/v1/sessions/victim/close", headers=_as("admin-guess"))
        assert wrong_admin.status_code == 401
        assert stack.gateway.versioning.get("victim") is not None

        own = await http.post("/v1/sessions/close", headers=_as("victim"))
        assert own.json() == {
            "session": "victim",
            "found": True,
            "version_id": "A",
            "released_now": True,
        }
        admin = await http.post("/v1/sessions/victim-2/close", headers=_as(ADMIN_TOKEN))
        assert admin.json()["found"] is True
        admin_by_header = await http.post(
            "/v1/sessions/close",
            headers={**_as(ADMIN_TOKEN), "x-agentic-session": "victim-3"},
        )
        assert admin_by_header.json()["found"] is True
        nobody = await http.post("/v1/sessions/close")
        assert nobody.status_code == 401
        assert stack.gateway.sessions.live() == 0


@pytest.mark.asyncio
async def test_the_admin_token_is_never_a_session_id(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        response = await stack.http().post(CHAT, json=_chat_body(), headers=_as(ADMIN_TOKEN))
        assert response.status_code == 401
        assert response.json()["error"]["details"]["reason"] == "missing_session"
        assert stack.gateway.sessions.live() == 0


# --- point 4: no credential in logs -------------------------------------------------------------


@pytest.mark.asyncio
async def test_no_log_record_carries_the_session_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "sk-credential-0123456789"
    async with gateway_stack(tmp_path, published="A") as stack:
        with caplog.at_level(logging.DEBUG):
            await chat(stack.agent(secret))
            stack.routes.fail_next("lose_reply")
            bad = await stack.http().post(CHAT, json=_chat_body(n=0), headers=_as(secret))
            assert bad.status_code == 400
            await stack.http().post("/v1/sessions/close", headers=_as(secret))
            await stack.gateway.sessions.reap_idle(0.0)
        assert caplog.records
        for record in caplog.records:
            text = record.getMessage() + repr(record.__dict__)
            assert secret not in text, record.getMessage()
        session = stack.gateway.sessions.tag(secret)
        assert any(getattr(r, "session", None) == session for r in caplog.records)


def test_session_tags_are_keyed_and_stable_under_one_key() -> None:
    one, again = SessionTagger.derived("admin-1"), SessionTagger.derived("admin-1")
    assert one.tag("episode-1") == again.tag("episode-1")
    assert one.tag("episode-1") != SessionTagger.derived("admin-2").tag("episode-1")
    assert one.tag("episode-1") != one.tag("episode-2")
    assert SessionTagger().tag("x") != SessionTagger().tag("x")  # random keys


def test_the_access_log_never_shows_the_id_in_a_close_path() -> None:
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5", "POST", "/v1/sessions/sk-secret/close?x=1", "1.1", 200),
        None,
    )
    assert AccessLogRedactor().filter(record)
    assert "sk-secret" not in record.getMessage()
    assert "/v1/sessions/-/close" in record.getMessage()
    other = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "plain", None, None)
    assert AccessLogRedactor().filter(other)
    assert other.getMessage() == "plain"


# --- point 6 and 7: typed answers, and the OpenAPI document -------------------------------------


@pytest.mark.asyncio
async def test_admin_bodies_are_bounded_and_typed(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, settings={"gateway_max_body_bytes": 1024}) as stack:
        http = stack.http()
        admin = _as(ADMIN_TOKEN)
        big = await http.post("/admin/publish", content=b"{" * 2048, headers=admin)
        assert big.status_code == 413
        deep = await http.post("/admin/resolve", content=b"[" * 600 + b"]" * 600, headers=admin)
        assert deep.status_code == 413
        nested = await http.post("/admin/resolve", content=b"[" * 100 + b"]" * 100, headers=admin)
        assert (nested.status_code, nested.json()["error"]["details"]["reason"]) == (
            400,
            "too_deep",
        )
        listed = await http.post("/admin/resolve", content=b"[]", headers=admin)
        assert listed.status_code == 400
        anonymous = await http.post("/admin/reclaim")
        assert anonymous.status_code == 401


@pytest.mark.asyncio
async def test_the_openapi_document_carries_the_request_models_with_their_limits(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path, settings={"gateway_max_n": 3}) as stack:
        document = (await stack.http().get("/openapi.json")).json()
        schemas = document["components"]["schemas"]
        chat_schema = schemas["ChatCompletionRequest"]
        n = chat_schema["properties"]["n"]["anyOf"][0]
        assert (n["minimum"], n["maximum"]) == (1, 3)
        assert chat_schema["properties"]["messages"]["maxItems"] == 1024
        body = document["paths"][CHAT]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ChatCompletionRequest"
        )
        assert "ErrorBody" in schemas
        assert "/v1/sessions/close" in document["paths"]


def test_limits_come_from_settings() -> None:
    from agentic_lora.config import load_settings

    settings = load_settings(
        enable_versioned_lora_publication=True,
        engines=["e0=http://127.0.0.1:1"],
        base_model_name=BASE_MODEL,
        engine_max_loaded_loras=3,
        engine_max_loras_per_batch=3,
        gateway_max_n=2,
        gateway_max_sessions=7,
    )
    limits = GatewayLimits.from_settings(settings)
    assert (limits.max_n, limits.max_sessions, limits.max_body_bytes) == (2, 7, 4 * 1024 * 1024)


def test_bad_limit_settings_are_config_errors() -> None:
    from agentic_lora.config import load_settings
    from agentic_lora.errors import ConfigurationError

    for bad in ({"gateway_max_n": 0}, {"gateway_max_json_depth": 3}, {"gateway_idle_timeout": -1}):
        with pytest.raises(ConfigurationError) as err:
            load_settings(
                enable_versioned_lora_publication=True,
                engines=["e0=http://127.0.0.1:1"],
                base_model_name=BASE_MODEL,
                engine_max_loaded_loras=3,
                engine_max_loras_per_batch=3,
                **bad,
            )
        assert err.value.details["check"] == "gateway_limits"


@pytest.mark.asyncio
async def test_an_engine_reply_json_cannot_carry_is_a_502_indeterminate(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        for engine in stack.fleet.engines.values():
            stack.fleet.router.post(engine.base_url + CHAT).mock(
                return_value=httpx.Response(
                    200,
                    content=b'{"choices": [], "score": NaN}',
                    headers={"content-type": "application/json"},
                )
            )
        response = await stack.http().post(CHAT, json=_chat_body(), headers=_as("nan"))
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "REQUEST_INDETERMINATE"
        assert response.headers["x-agentic-outcome"] == "indeterminate"
        assert response.headers["x-should-retry"] == "false"
