"""Sessions named by ``X-Session-ID`` under a gateway API key (what verifiers and SkyRL send),
and token ids and logprobs through the gateway: the real registry and gateway, scripted engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from agentic_lora.errors import ConfigurationError
from agentic_lora.gateway.session_header import API_KEYS_ENV
from agentic_lora.gateway.session_header import SessionHeaders
from agentic_lora.gateway.tokens import TurnTokens
from agentic_lora.gateway.tokens import turn_tokens
from tests.gateway.test_gateway import ADMIN_TOKEN
from tests.gateway.test_gateway import BASE_MODEL
from tests.gateway.test_gateway import gateway_stack

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"
pytestmark = pytest.mark.asyncio


def headers(key: str | None, session: str | None, **extra: str) -> dict[str, str]:
    out = dict(extra)
    if key is not None:
        out["authorization"] = f"Bearer {key}"
    if session is not None:
        out["x-session-id"] = session
    return out


async def turn(http: httpx.AsyncClient, key: str | None, session: str | None) -> httpx.Response:
    return await http.post(
        "/v1/chat/completions",
        headers=headers(key, session),
        json={"model": BASE_MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )


async def test_many_sessions_under_one_key_each_stay_on_their_version(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A", api_keys=[KEY_A, KEY_B]) as stack:
        http = stack.http()
        first = [await turn(http, KEY_A, f"rollout-{i}") for i in range(3)]
        assert {r.headers["x-agentic-version"] for r in first} == {"A"}
        assert (await stack.publish("B", 2))["outcome"] == "PUBLISHED"
        # The same key, the old rollouts: still A; a new rollout id: B.
        for i in range(3):
            assert (await turn(http, KEY_A, f"rollout-{i}")).headers["x-agentic-version"] == "A"
        assert (await turn(http, KEY_A, "rollout-new")).headers["x-agentic-version"] == "B"
        # The same X-Session-ID under another key is another Session: bound now, to B.
        assert (await turn(http, KEY_B, "rollout-0")).headers["x-agentic-version"] == "B"
        # Four distinct Sessions under key A, one under key B (the key itself is none).
        assert len(stack.gateway.versioning.live_sessions()) == 5


async def test_one_key_can_never_close_another_keys_session(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A", api_keys=[KEY_A, KEY_B]) as stack:
        http = stack.http()
        assert (await turn(http, KEY_A, "r1")).status_code == 200
        # Key B "closes" r1, by either route: its own r1, which never existed.
        own = await http.post("/v1/sessions/close", headers=headers(KEY_B, "r1"))
        assert own.status_code == 200
        assert own.json()["found"] is False
        path = await http.post("/v1/sessions/r1/close", headers=headers(KEY_B, None))
        assert path.json()["found"] is False
        # A's r1 is untouched: it still serves (a closed id would be 409 SESSION_CLOSED).
        assert (await turn(http, KEY_A, "r1")).status_code == 200
        # Its own key closes it; the answer names the header id, never the scoped id.
        closed = await http.post("/v1/sessions/r1/close", headers=headers(KEY_A, None))
        assert closed.json() == {
            "session": "r1",
            "found": True,
            "version_id": "A",
            "released_now": True,
        }
        refused = await turn(http, KEY_A, "r1")
        assert (refused.status_code, refused.json()["error"]["code"]) == (409, "SESSION_CLOSED")
        # The own-close route with the header closes too.
        assert (await turn(http, KEY_A, "r2")).status_code == 200
        own = await http.post("/v1/sessions/close", headers=headers(KEY_A, "r2"))
        assert (own.json()["session"], own.json()["found"]) == ("r2", True)


@pytest.mark.parametrize(
    ("key", "session", "extra", "status", "code", "reason"),
    [
        (KEY_A, "x" * 129, {}, 400, "INVALID_REQUEST", "bad_session_header"),
        (KEY_A, "has space", {}, 400, "INVALID_REQUEST", "bad_session_header"),
        (KEY_A, "semi;colon", {}, 400, "INVALID_REQUEST", "bad_session_header"),
        (KEY_A, "", {}, 400, "INVALID_REQUEST", "bad_session_header"),
        (None, "r1", {}, 401, "ACCESS_DENIED", "session_header_needs_api_key"),
        ("not-a-key", "r1", {}, 401, "ACCESS_DENIED", "session_header_needs_api_key"),
        (ADMIN_TOKEN, "r1", {}, 401, "ACCESS_DENIED", "session_header_needs_api_key"),
        (KEY_A, None, {}, 401, "ACCESS_DENIED", "missing_session_header"),
        (
            KEY_A,
            "r1",
            {"x-agentic-session": "other"},
            400,
            "INVALID_REQUEST",
            "conflicting_session_headers",
        ),
    ],
)
async def test_bad_headers_are_refused_before_any_session_exists(
    tmp_path: Path,
    key: str | None,
    session: str | None,
    extra: dict[str, str],
    status: int,
    code: str,
    reason: str,
) -> None:
    async with gateway_stack(tmp_path, published="A", api_keys=[KEY_A]) as stack:
        sent = headers(key, session, **extra)
        response = await stack.http().post("/v1/chat/completions", headers=sent, content=b"{")
        assert response.status_code == status
        error = response.json()["error"]
        assert (error["code"], error["details"]["reason"]) == (code, reason)
        assert KEY_A not in response.text
        assert not stack.gateway.versioning.live_sessions()
        assert stack.routes.sent == []


async def test_bearer_session_ids_still_work_next_to_api_keys(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A", api_keys=[KEY_A]) as stack:
        http = stack.http()
        assert (await turn(http, "episode-1", None)).headers["x-agentic-version"] == "A"
        # A header-keyed Session is reached through its key only, never by its scoped id.
        assert (await turn(http, KEY_A, "r1")).status_code == 200
        scoped = SessionHeaders([KEY_A], None).session_id(headers(KEY_A, "r1"))
        for sent in (
            headers(scoped, None),
            {"x-agentic-session": scoped},
            headers(ADMIN_TOKEN, None, **{"x-agentic-session": scoped}),
        ):
            bearer = await http.post("/v1/chat/completions", headers=sent, json={})
            assert bearer.json()["error"]["details"]["reason"] == "reserved_session_id"
        for auth in (f"Bearer {scoped}", f"bearer {scoped}"):
            path = f"/v1/sessions/{scoped}/close"
            closing = await http.post(path, headers={"authorization": auth})
            assert closing.json()["error"]["details"]["reason"] == "reserved_session_id"
        assert (await turn(http, KEY_A, "r1")).status_code == 200


async def test_without_api_keys_the_header_is_refused(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        response = await turn(stack.http(), "episode-1", "r1")
        assert response.json()["error"]["details"]["reason"] == "session_header_needs_api_key"


async def test_keys_come_from_the_environment_and_must_differ_from_the_admin_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(API_KEYS_ENV, f" {KEY_A} , {KEY_B} ,")
    scoped = SessionHeaders(None, ADMIN_TOKEN).session_id(headers(KEY_B, "r"))
    assert scoped == SessionHeaders([KEY_B], None).session_id(headers(KEY_B, "r"))
    assert scoped != SessionHeaders([KEY_A], None).session_id(headers(KEY_A, "r"))
    assert scoped.startswith("xsid-")
    assert len(scoped) == 53
    with pytest.raises(ConfigurationError):
        SessionHeaders([ADMIN_TOKEN], ADMIN_TOKEN)
    with pytest.raises(ConfigurationError):
        SessionHeaders(["two words"], None)


# --- token ids and logprobs ----------------------------------------------------------------------


async def test_logprobs_and_token_id_requests_reach_the_engine_as_sent(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path, published="A", api_keys=[KEY_A]) as stack:
        asks: dict[str, Any] = {
            "logprobs": True,
            "top_logprobs": 2,
            "return_prompt_token_ids": True,
            "return_token_ids": True,
        }
        response = await stack.http().post(
            "/v1/chat/completions",
            headers=headers(KEY_A, "r1"),
            json={"model": BASE_MODEL, "messages": [{"role": "user", "content": "hi"}], **asks},
        )
        assert response.status_code == 200
        ((_, _, sent),) = stack.routes.sent
        assert {name: sent[name] for name in asks} == asks
        completion = await stack.http().post(
            "/v1/completions",
            headers=headers(KEY_A, "r1"),
            json={"model": BASE_MODEL, "prompt": "hi", "logprobs": 2, "return_token_ids": True},
        )
        assert completion.status_code == 200
        assert stack.routes.sent[-1][2]["logprobs"] == 2
        assert stack.routes.sent[-1][2]["return_token_ids"] is True


async def test_turn_tokens_reads_sglangs_chat_and_completion_replies() -> None:
    chat_reply = {
        "choices": [
            {
                "prompt_token_ids": [1, 2, 3],
                "response_token_ids": [7, 8],
                "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -1.25}]},
            }
        ],
        "agentic_lora": {"version_id": "A"},
    }
    assert turn_tokens(chat_reply) == TurnTokens([1, 2, 3], [7, 8], [-0.5, -1.25], "A")
    completion = {
        "choices": [
            {"prompt_token_ids": [4], "token_ids": [9], "logprobs": {"token_logprobs": [-2]}}
        ]
    }
    assert turn_tokens(completion) == TurnTokens([4], [9], [-2.0], None)
    with pytest.raises(ValueError, match="completion token ids"):
        turn_tokens({"choices": [{"message": {}}]})
    with pytest.raises(ValueError, match="logprob per completion token"):
        turn_tokens({"choices": [{"prompt_token_ids": [1], "token_ids": [2]}]})


async def test_an_idle_header_keyed_session_expires_and_its_version_is_released(
    tmp_path: Path,
) -> None:
    now = [0.0]
    async with gateway_stack(
        tmp_path, published="A", api_keys=[KEY_A], clock=lambda: now[0]
    ) as stack:
        http = stack.http()
        assert (await turn(http, KEY_A, "idle")).status_code == 200
        assert (await turn(http, KEY_A, "busy")).status_code == 200
        registry: Any = stack.gateway.deployment.registry
        assert registry.peek_version("A").session_refs == 2
        now[0] = 600.0
        assert (await turn(http, KEY_A, "busy")).status_code == 200
        now[0] = 1000.0
        await stack.gateway.sessions.reap_idle(900.0)  # "idle" unused for 1000 s, "busy" 400 s
        assert registry.peek_version("A").session_refs == 1
        expired = await turn(http, KEY_A, "idle")
        assert (expired.status_code, expired.json()["error"]["code"]) == (409, "SESSION_CLOSED")
        assert (await turn(http, KEY_A, "busy")).status_code == 200
