"""Gateway and control-plane security beyond the input limits (issue 16, points 1, 4, 5, 6):
unknown routes and methods answered in the typed error shape, a malformed Session id in the
close path refused as input, the access log of a real uvicorn server without Session ids, an
idle-expiry failure logged without its message, the limits' flag and environment forms, and
control-plane clients that never use an environment proxy."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from agentic_lora.config import add_arguments
from agentic_lora.config import from_args
from agentic_lora.engines.backends import EngineRef
from agentic_lora.errors import SessionClosedError
from agentic_lora.gateway.client import AdminClient
from agentic_lora.gateway.limits import GatewayLimits
from agentic_lora.gateway.security import redacted_path
from tests.direct_http import direct_only
from tests.gateway.test_gateway import ADMIN_TOKEN
from tests.gateway.test_gateway import chat
from tests.gateway.test_gateway import gateway_stack

# --- every refusal in one shape -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "status", "reason"),
    [
        ("POST", "/v1/nothing-here", 404, "no_route"),
        ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
        ("GET", "/v1/sessions/sk-secret/close", 405, "method_not_allowed"),
        ("DELETE", "/admin/publish", 405, "method_not_allowed"),
    ],
)
@pytest.mark.asyncio
async def test_an_unknown_route_or_method_is_a_typed_error_that_names_no_path(
    tmp_path: Path, method: str, path: str, status: int, reason: str
) -> None:
    async with gateway_stack(tmp_path) as stack:
        response = await stack.http().request(method, path)
        assert response.status_code == status
        error = response.json()["error"]
        assert (error["code"], error["details"]["reason"]) == ("INVALID_REQUEST", reason)
        assert "sk-secret" not in response.text
        assert response.headers["x-should-retry"] == "false"
        if status == 405:
            assert response.headers["allow"]


@pytest.mark.parametrize("bad_id", ["a" * 257, "two%20words", "tab%09id"])
@pytest.mark.asyncio
async def test_a_malformed_id_in_the_close_path_is_a_400_that_touches_nothing(
    tmp_path: Path, bad_id: str
) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        status_before = await stack.gateway.deployment.status()
        admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        response = await stack.http().post(f"/v1/sessions/{bad_id}/close", headers=admin)
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["details"]["reason"]) == ("INVALID_REQUEST", "bad_session_id")
        assert await stack.gateway.deployment.status() == status_before


# --- no Session id in the access log ------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "logged"),
    [
        ("/v1/sessions/sk-secret/close", "/v1/sessions/-/close"),
        ("/v1/sessions/sk/with/slashes/close", "/v1/sessions/-/close"),  # "sk%2Fwith..." decoded
        ("/v1/sessions/sk-secret/close?x=1", "/v1/sessions/-/close"),
        ("/v1/sessions/sk-secret", "/v1/sessions/-"),
        ("/v1/sessions/close", "/v1/sessions/close"),
        ("/v1/sessions/close?a=b", "/v1/sessions/close?a=b"),
        ("/v1/chat/completions", "/v1/chat/completions"),
    ],
)
def test_redacted_paths(path: str, logged: str) -> None:
    assert redacted_path(path) == logged


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.asyncio
async def test_a_real_uvicorn_access_log_never_shows_a_session_id(tmp_path: Path) -> None:
    secrets = ("sk-plain-0123", "sk/with/slash")
    async with gateway_stack(tmp_path, published="A") as stack:
        for secret in secrets:
            await chat(stack.agent(secret))
        # A bound socket accepts connections before uvicorn serves: no wait for its start.
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        # This client talks to the real server; only the engines are scripted.
        stack.fleet.router.route(host="127.0.0.1", port=port).pass_through()
        server = uvicorn.Server(
            uvicorn.Config(stack.gateway.app, log_config=None, access_log=True, lifespan="off")
        )
        access = logging.getLogger("uvicorn.access")
        records = _Records()
        access.addHandler(records)
        level = access.level
        access.setLevel(logging.INFO)
        serving = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        try:
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", trust_env=False
            ) as http:
                for secret in secrets:
                    quoted = secret.replace("/", "%2F")
                    response = await http.post(
                        f"/v1/sessions/{quoted}/close",
                        headers={"authorization": f"Bearer {secret}"},
                    )
                    # An id with "/" arrives decoded: no route, but the log still hides it.
                    assert response.status_code in (200, 404), response.text
        finally:
            server.should_exit = True
            await serving
            access.removeHandler(records)
            access.setLevel(level)
            sock.close()
    assert len(records.records) == len(secrets)
    for record in records.records:
        assert record.args is not None
        assert "/v1/sessions/-/close" in record.getMessage()
        for secret in secrets:
            assert secret not in record.getMessage()
            assert secret.split("/")[0] not in record.getMessage()


@pytest.mark.asyncio
async def test_an_idle_expiry_failure_is_logged_by_its_code_never_its_message(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "sk-idle-credential"
    failed, survived = asyncio.Event(), asyncio.Event()

    async def reap_idle(idle_for: float) -> tuple[str, ...]:
        if not failed.is_set():
            failed.set()
            raise SessionClosedError(f"session {secret!r} was closed", session=secret)
        survived.set()
        return ()

    with caplog.at_level(logging.DEBUG, logger="agentic_lora.gateway.app"):
        async with gateway_stack(tmp_path, idle_timeout=0.004) as stack:
            monkeypatch.setattr(stack.gateway.sessions, "reap_idle", reap_idle)
            await survived.wait()  # the round after the failing one ran: the loop goes on
    failures = [r for r in caplog.records if getattr(r, "error", None) == "SESSION_CLOSED"]
    assert [(r.levelno, r.exc_info) for r in failures] == [(logging.WARNING, None)]
    for record in caplog.records:
        assert secret not in record.getMessage() + repr(record.__dict__)


# --- every limit from a flag or the environment -------------------------------------------------

_LIMIT_FLAGS = {
    "gateway_max_body_bytes": ("--versioned-lora-gateway-max-body-bytes", 1000),
    "gateway_max_json_depth": ("--versioned-lora-gateway-max-json-depth", 9),
    "gateway_max_messages": ("--versioned-lora-gateway-max-messages", 7),
    "gateway_max_n": ("--versioned-lora-gateway-max-n", 3),
    "gateway_max_tokens": ("--versioned-lora-gateway-max-tokens", 99),
    "gateway_max_sessions": ("--versioned-lora-gateway-max-sessions", 5),
}
_BASE = [
    "--enable-versioned-lora-publication",
    "--versioned-lora-engine",
    "e0=http://127.0.0.1:1",
    "--versioned-lora-base-model",
    "base-model",
    "--versioned-lora-engine-max-loaded-loras",
    "3",
    "--versioned-lora-engine-max-loras-per-batch",
    "3",
]


def _limits(settings: Any) -> dict[str, Any]:
    limits = GatewayLimits.from_settings(settings)
    return {field: getattr(limits, field.removeprefix("gateway_")) for field in _LIMIT_FLAGS}


def test_every_gateway_limit_has_a_flag_and_an_environment_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    parser = add_arguments(argparse.ArgumentParser())
    defaults = _limits(from_args(parser.parse_args(_BASE)))
    assert defaults == {
        "gateway_max_body_bytes": 4 * 1024 * 1024,
        "gateway_max_json_depth": 64,
        "gateway_max_messages": 1024,
        "gateway_max_n": 8,
        "gateway_max_tokens": 32768,
        "gateway_max_sessions": 2048,
    }
    flags = [arg for flag, value in _LIMIT_FLAGS.values() for arg in (flag, str(value))]
    expected = {field: value for field, (_, value) in _LIMIT_FLAGS.items()}
    assert _limits(from_args(parser.parse_args([*_BASE, *flags]))) == expected
    for field, (_, value) in _LIMIT_FLAGS.items():
        monkeypatch.setenv(f"AGENTIC_LORA_{field.upper()}", str(value))
    assert _limits(from_args(parser.parse_args(_BASE))) == expected
    monkeypatch.setenv("AGENTIC_LORA_GATEWAY_IDLE_TIMEOUT", "0")
    idle = parser.parse_args([*_BASE, "--versioned-lora-gateway-idle-timeout", "30"])
    assert from_args(idle).gateway_idle_timeout == 30.0  # the flag wins over the environment
    assert from_args(parser.parse_args(_BASE)).gateway_idle_timeout == 0.0


# --- control-plane clients go direct ------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_gateway_admin_client_never_uses_an_environment_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with (
        direct_only(monkeypatch, {"registry": {}}) as (url, seen),
        AdminClient(url, token="t") as admin,
    ):
        assert await admin.status() == {"registry": {}}
    assert len(seen) == 1
    assert seen[0].startswith(b"GET /admin/status ")


@pytest.mark.asyncio
async def test_the_dcs_sidecar_client_never_uses_an_environment_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agentic_lora_dcs import DcsBackend

    reply = {
        "incarnation": "inc-1",
        "sidecar_id": "s0",
        "engine_incarnation": "e-1",
        "protocol": 1,
        "backends": ["gloo"],
    }
    async with direct_only(monkeypatch, reply) as (url, seen):
        backend = DcsBackend({"e0": url}, sidecar_token="t", collective_backend="gloo")
        try:
            assert await backend.incarnation(EngineRef("e0", "http://engine")) == "inc-1"
        finally:
            await backend.aclose()
    assert len(seen) == 1
    assert seen[0].startswith(b"GET ")
    assert b"authorization: Bearer t" in seen[0].replace(b"Authorization", b"authorization")
