"""The sidecar's HTTP layer in process: typed refusals, status codes, and its command line."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import respx
from agentic_lora_dcs import DcsBackend
from agentic_lora_dcs.plan import plan_for_snapshot
from agentic_lora_dcs.protocol import PROTOCOL_VERSION
from agentic_lora_dcs.protocol import SIDECAR_TOKEN_ENV
from agentic_lora_dcs.protocol import BeginRequest
from agentic_lora_dcs.protocol import StatusReply
from agentic_lora_dcs.sidecar import SidecarConfig
from agentic_lora_dcs.sidecar import build_receiver
from agentic_lora_dcs.sidecar import create_app
from agentic_lora_dcs.sidecar import parse_args
from pydantic import SecretStr
from pydantic import ValidationError

from agentic_lora.engines.admin import EngineAdminClient
from agentic_lora.engines.backends import EngineRef
from agentic_lora.errors import BackendRefusedError
from agentic_lora.errors import ConfigurationError
from agentic_lora.foundation.identity import thaw_json
from agentic_lora.testing.sglang_engine import ScriptedSGLangEngine
from tests.dcs.util import SIDECAR_TOKEN
from tests.dcs.util import make_snapshot
from tests.dcs.util import target_for

ENGINE = "http://127.0.0.1:9/app"


@pytest_asyncio.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    engine = ScriptedSGLangEngine(name="E0", base_url=ENGINE)
    with respx.mock(assert_all_called=False) as router:
        engine.mount(router)
        admin = EngineAdminClient(ENGINE, engine="E0")
        receiver, _ = build_receiver(
            SidecarConfig(engine_url=ENGINE, store_dir=tmp_path, token=SecretStr(SIDECAR_TOKEN)),
            engine_client=admin,
        )
        app = create_app(receiver, token=SIDECAR_TOKEN)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport,
            base_url="http://sidecar",
            headers={"authorization": f"Bearer {SIDECAR_TOKEN}"},
        ) as client:
            try:
                yield client
            finally:
                await receiver.aclose()
                await admin.aclose()


@pytest.mark.asyncio
async def test_malformed_messages_are_typed_refusals(sidecar: httpx.AsyncClient) -> None:
    begin = await sidecar.post("/begin", content=b"{}")
    bucket = await sidecar.post("/bucket", content=b"not json")

    # A Begin that does not parse leaves nothing; a bucket's attempt may hold a stash.
    assert (begin.status_code, begin.json()["reason"], begin.json()["clean"]) == (
        409,
        "BAD_REQUEST",
        True,
    )
    assert (bucket.status_code, bucket.json()["reason"], bucket.json()["clean"]) == (
        503,
        "BAD_REQUEST",
        False,
    )


@pytest.mark.asyncio
async def test_a_begin_for_another_protocol_or_incarnation_is_refused(
    sidecar: httpx.AsyncClient,
) -> None:
    snapshot = make_snapshot(seed=111)
    target = target_for(snapshot, "app")
    incarnation = (await sidecar.get("/incarnation")).json()["incarnation"]

    def begin(**overrides: object) -> bytes:
        fields: dict[str, object] = {
            "driver": "ab12cd34",
            "lora_name": target.lora_name,
            "attempt": 1,
            "version_id": target.version_id,
            "digest": snapshot.digest,
            "incarnation": incarnation,
            "config": thaw_json(snapshot.config),
            "plan": plan_for_snapshot(snapshot, 4096),
            "backend": "gloo",
            "protocol": PROTOCOL_VERSION,
        }
        fields.update(overrides)
        return BeginRequest.model_validate(fields).model_dump_json().encode()

    old_protocol = await sidecar.post("/begin", content=begin(protocol=PROTOCOL_VERSION + 1))
    elsewhere = await sidecar.post("/begin", content=begin(incarnation="other/boot"))

    assert old_protocol.json()["reason"] == "PROTOCOL_MISMATCH"
    assert elsewhere.json()["reason"] == "INCARNATION_MISMATCH"
    assert elsewhere.json()["details"]["current"] == incarnation
    status = StatusReply.model_validate_json((await sidecar.get("/status")).content)
    assert status.attempts == ()
    assert status.collectives_total == 0
    assert (await sidecar.get("/health")).json()["status"] == "ok"


def test_the_command_line_refuses_a_wildcard_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SIDECAR_TOKEN_ENV, SIDECAR_TOKEN)
    config = parse_args(["--engine-url", ENGINE, "--store-dir", str(tmp_path), "--port", "31000"])
    assert (config.host, config.port, config.probe) == ("127.0.0.1", 31000, True)
    with pytest.raises(ConfigurationError, match="wildcard"):
        parse_args(["--engine-url", ENGINE, "--store-dir", str(tmp_path), "--host", "0.0.0.0"])


def test_every_option_reaches_its_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SIDECAR_TOKEN_ENV, SIDECAR_TOKEN)
    argv = ["--engine-url", ENGINE, "--engine-name", "E0", "--store-dir", str(tmp_path)]
    argv += ["--host", "127.0.0.2", "--port", "31000", "--rendezvous-port", "31001"]
    argv += ["--collective-timeout", "7.5", "--no-probe", "--ready-file", str(tmp_path / "r")]
    config = parse_args([*argv, "--log-level", "DEBUG"])
    assert config == SidecarConfig(
        engine_url=ENGINE,
        engine_name="E0",
        store_dir=tmp_path,
        token=SecretStr(SIDECAR_TOKEN),
        host="127.0.0.2",
        port=31000,
        rendezvous_port=31001,
        collective_timeout_s=7.5,
        probe=False,
        ready_file=tmp_path / "r",
        log_level="DEBUG",
    )
    with pytest.raises(ValidationError, match="extra"):
        SidecarConfig.model_validate(
            {"engine_url": ENGINE, "store_dir": tmp_path, "token": "t", "no_probe": True}
        )


# --- the control token ---------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("route", ["/status", "/incarnation", "/reclaim", "/cleanup", "/begin"])
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {SIDECAR_TOKEN}"])
async def test_every_control_route_needs_the_token(
    sidecar: httpx.AsyncClient, route: str, authorization: str | None
) -> None:
    headers = {"authorization": authorization} if authorization else {}
    sidecar.headers.pop("authorization")
    method = "GET" if route in ("/status", "/incarnation") else "POST"
    reply = await sidecar.request(method, route, content=b"{}", headers=headers)
    assert reply.status_code == 401
    assert reply.headers["www-authenticate"] == "Bearer"
    # A clean refusal in the protocol's own shape: the backend maps it to BACKEND_REFUSED.
    assert (reply.json()["reason"], reply.json()["clean"]) == ("UNAUTHORIZED", True)
    assert SIDECAR_TOKEN not in reply.text


@pytest.mark.asyncio
async def test_health_stays_open_and_a_right_token_passes(sidecar: httpx.AsyncClient) -> None:
    token = sidecar.headers.pop("authorization")
    assert (await sidecar.get("/health")).status_code == 200
    assert (await sidecar.get("/status")).status_code == 401
    assert (await sidecar.get("/status", headers={"authorization": token})).status_code == 200


def test_the_sidecar_does_not_start_without_a_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SIDECAR_TOKEN_ENV, raising=False)
    base = ["--engine-url", ENGINE, "--store-dir", str(tmp_path)]
    with pytest.raises(ConfigurationError, match="control token"):
        parse_args(base)
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    with pytest.raises(ConfigurationError, match="empty"):
        parse_args([*base, "--token-file", str(empty)])
    with pytest.raises(ConfigurationError, match="cannot be read"):
        parse_args([*base, "--token-file", str(tmp_path / "missing")])
    good = tmp_path / "sidecar.token"
    good.write_text("from-a-file\n")
    from_file = parse_args([*base, "--token-file", str(good)])
    assert from_file.token.get_secret_value() == "from-a-file"
    assert "from-a-file" not in repr(from_file)
    monkeypatch.setenv(SIDECAR_TOKEN_ENV, "from-the-env")
    assert parse_args(base).token.get_secret_value() == "from-the-env"


@pytest.mark.asyncio
async def test_the_backend_needs_the_token_and_sends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SIDECAR_TOKEN_ENV, raising=False)
    with pytest.raises(ConfigurationError, match="control token"):
        DcsBackend({"E0": "http://127.0.0.1:1"}, collective_backend="gloo")
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(401, json={"reason": "UNAUTHORIZED", "message": "no", "clean": True})

    token_file = tmp_path / "t"
    token_file.write_text("file-token")
    backend = DcsBackend(
        {"E0": "http://sidecar"},
        collective_backend="gloo",
        sidecar_token_file=str(token_file),
        client=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
    )
    try:
        with pytest.raises(BackendRefusedError) as refused:
            await backend.incarnation(EngineRef("E0", "http://engine"))
    finally:
        await backend.aclose()
    assert seen == ["Bearer file-token"]
    assert refused.value.details["reason"] == "UNAUTHORIZED"
    assert "file-token" not in str(refused.value)
