"""The generation routes' plain-ASGI path answers exactly as the FastAPI route behind it would:
the same requests, sent to both apps of one gateway, get the same status, error code, outcome
headers and body shape; requests it does not take reach the FastAPI app unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentic_lora.errors import SessionClosedError
from agentic_lora.gateway.fast_path import GenerationFastPath
from agentic_lora.gateway.limits import GatewayLimits
from tests.gateway.test_gateway import ADMIN_TOKEN
from tests.gateway.test_gateway import BASE_MODEL
from tests.gateway.test_gateway import Stack
from tests.gateway.test_gateway import gateway_stack

CHAT = "/v1/chat/completions"
_VOLATILE = {"date", "content-length", "x-agentic-engine"}  # differ from turn to turn


def _chat(**fields: Any) -> bytes:
    body = {"model": BASE_MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


# (path, headers, body): one refusal of each kind the generation routes make, and answers.
_REQUESTS: list[tuple[str, dict[str, str], bytes]] = [
    (CHAT, {}, _chat()),  # no credential
    (CHAT, {"authorization": "Bearer a", "x-agentic-session": "b"}, _chat()),  # two Sessions
    (CHAT, {"authorization": "Bearer xsid-taken"}, _chat()),  # a reserved id
    (CHAT, {"x-session-id": "rollout-1"}, _chat()),  # a header Session without an API key
    (CHAT, {"authorization": "Bearer s"}, b"x" * 5000),  # too large
    (CHAT, {"authorization": "Bearer s"}, b"{not json"),
    (CHAT, {"authorization": "Bearer s"}, b"[" * 100 + b"]" * 100),  # too deep
    (CHAT, {"authorization": "Bearer s"}, _chat(n=99)),  # schema
    (CHAT, {"authorization": "Bearer s"}, _chat(model="other-model")),  # no such model
    ("/generate", {"authorization": "Bearer s"}, b'{"text": "x", "input_ids": [1]}'),
    ("/v1/completions", {"authorization": "Bearer s"}, b'{"prompt": ""}'),
    (CHAT, {"authorization": f"Bearer {ADMIN_TOKEN}"}, _chat()),  # the admin names no Session
    (CHAT, {"authorization": "Bearer ok-1"}, _chat()),  # answered
    (CHAT, {"authorization": "Bearer ok-1"}, _chat(max_tokens=2)),  # its next turn
]


async def _answer(stack: Stack, app: Any, path: str, headers: dict[str, str], body: bytes) -> Any:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gateway"
    ) as http:
        response = await http.post(
            path, content=body, headers={"content-type": "application/json", **headers}
        )
    payload = response.json()
    error = payload.get("error") if isinstance(payload, dict) else None
    shown = {k: v for k, v in response.headers.items() if k not in _VOLATILE}
    if error is not None:
        return response.status_code, shown, error["code"], error["details"].get("reason")
    return response.status_code, shown, sorted(payload)


@pytest.mark.asyncio
async def test_the_fast_path_answers_as_the_fastapi_route(tmp_path: Path) -> None:
    limits = GatewayLimits(max_body_bytes=4096)
    async with gateway_stack(tmp_path, published="A", limits=limits) as stack:
        app = stack.gateway.app
        assert isinstance(app, GenerationFastPath)
        for path, headers, body in _REQUESTS:
            fast = await _answer(stack, app, path, headers, body)
            routed = await _answer(stack, app.app, path, headers, body)
            assert fast == routed, (path, headers, body[:40])
        # Both apps served one Session, and only the requests that passed every check reached it.
        assert stack.gateway.sessions.live() == 1


@pytest.mark.asyncio
async def test_a_typed_error_escaping_the_handler_is_a_typed_answer(tmp_path: Path) -> None:
    async def handler(route: Any, request: Any) -> Any:
        raise SessionClosedError("closed elsewhere", reason="closed")

    async with gateway_stack(tmp_path) as stack:
        app = GenerationFastPath(stack.gateway.fastapi, handler)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway"
        ) as http:
            response = await http.post(CHAT, content=_chat())
        assert response.status_code == 409  # SESSION_CLOSED, as the FastAPI handler answers it
        assert response.json()["error"]["code"] == "SESSION_CLOSED"
        assert response.headers["x-should-retry"] == "false"


@pytest.mark.parametrize(
    ("method", "path", "root_path", "status"),
    [
        ("GET", CHAT, "", 405),  # another method: FastAPI's typed 405
        ("POST", CHAT + "/", "", 307),  # a trailing slash: FastAPI's redirect
        ("POST", "/gw" + CHAT, "/gw", 401),  # mounted under a root path: FastAPI routes it
    ],
)
@pytest.mark.asyncio
async def test_requests_the_fast_path_does_not_take_reach_the_fastapi_app(
    tmp_path: Path, method: str, path: str, root_path: str, status: int
) -> None:
    taken: list[str] = []

    async def handler(route: Any, request: Any) -> Any:
        taken.append(route.value)
        raise AssertionError("not on the fast path")

    async with gateway_stack(tmp_path) as stack:
        app = GenerationFastPath(stack.gateway.fastapi, handler)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, root_path=root_path), base_url="http://gateway"
        ) as http:
            response = await http.request(method, path, content=_chat())
        assert (response.status_code, taken) == (status, [])
