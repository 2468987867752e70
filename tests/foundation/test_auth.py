"""Control tokens: read from a file or the environment, compared in constant time, enforced."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from agentic_lora.errors import ConfigurationError
from agentic_lora.foundation.auth import BearerTokenMiddleware
from agentic_lora.foundation.auth import bearer_matches
from agentic_lora.foundation.auth import read_token


def test_a_file_wins_over_the_environment_and_whitespace_is_not_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "token"
    path.write_text("  from-file \n")
    monkeypatch.setenv("T_ENV", "from-env")
    assert read_token(path=path, env="T_ENV", what="x") == "from-file"
    assert read_token(env="T_ENV", what="x") == "from-env"
    monkeypatch.delenv("T_ENV")
    assert read_token(env="T_ENV", what="x") is None
    assert read_token(what="x") is None


def test_unreadable_or_empty_tokens_are_config_errors_that_never_echo_a_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigurationError, match="cannot be read"):
        read_token(path=tmp_path / "missing", what="admin")
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigurationError, match="cannot be read"):
        read_token(path=binary, what="admin")
    monkeypatch.setenv("T_ENV", "   ")
    with pytest.raises(ConfigurationError, match=r"\$T_ENV is empty") as err:
        read_token(env="T_ENV", what="admin")
    assert err.value.details == {"check": "admin_token"}


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("Bearer s3cret", True),
        ("bearer s3cret", True),
        ("Bearer  s3cret ", True),
        ("Bearer s3cret2", False),
        ("Bearer s3cre", False),
        ("Basic s3cret", False),
        ("s3cret", False),
        ("", False),
        (None, False),
    ],
)
def test_bearer_matches(header: str | None, ok: bool) -> None:
    assert bearer_matches(header, "s3cret") is ok


@pytest.mark.asyncio
async def test_the_middleware_guards_all_but_the_open_paths() -> None:
    async def hello(_: Request) -> PlainTextResponse:
        return PlainTextResponse("hello")

    inner = Starlette(routes=[Route("/health", hello), Route("/secret", hello)])
    app = BearerTokenMiddleware(
        inner, token="t0k", refusal=lambda: {"code": "ACCESS_DENIED"}, open_paths=["/health"]
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        assert (await client.get("/health")).text == "hello"
        denied = await client.get("/secret")
        assert (denied.status_code, denied.json()) == (401, {"code": "ACCESS_DENIED"})
        allowed = await client.get("/secret", headers={"authorization": "Bearer t0k"})
        assert allowed.text == "hello"
    with pytest.raises(ConfigurationError):
        BearerTokenMiddleware(inner, token=" ", refusal=dict)
