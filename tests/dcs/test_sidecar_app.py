"""The sidecar's HTTP layer in process: typed refusals, status codes, and its command line."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import respx
from agentic_lora_dcs.plan import plan_for_snapshot
from agentic_lora_dcs.protocol import PROTOCOL_VERSION, BeginRequest, StatusReply
from agentic_lora_dcs.sidecar import SidecarConfig, build_receiver, create_app, parse_args

from agentic_lora.engine_admin import EngineAdminClient
from agentic_lora.errors import ConfigurationError
from agentic_lora.identity import thaw_json
from agentic_lora.testing.sglang_engine import ScriptedSGLangEngine
from tests.dcs.util import make_snapshot, target_for

ENGINE = "http://127.0.0.1:9/app"


@pytest_asyncio.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    engine = ScriptedSGLangEngine(name="E0", base_url=ENGINE)
    with respx.mock(assert_all_called=False) as router:
        engine.mount(router)
        admin = EngineAdminClient(ENGINE, engine="E0")
        receiver, _ = build_receiver(
            SidecarConfig(engine_url=ENGINE, store_dir=tmp_path), engine_client=admin
        )
        app = create_app(receiver)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sidecar") as client:
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


def test_the_command_line_refuses_a_wildcard_host(tmp_path: Path) -> None:
    config = parse_args(["--engine-url", ENGINE, "--store-dir", str(tmp_path), "--port", "31000"])
    assert (config.host, config.port, config.probe) == ("127.0.0.1", 31000, True)
    with pytest.raises(ConfigurationError, match="wildcard"):
        parse_args(["--engine-url", ENGINE, "--store-dir", str(tmp_path), "--host", "0.0.0.0"])
