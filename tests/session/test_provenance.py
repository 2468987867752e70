"""Trajectory provenance on every reply: the Session API (``reply.provenance``,
``Session.provenance()``) and the gateway (headers and the ``agentic_lora`` body field on OpenAI
and SGLang ``/generate`` replies), against scripted SGLang engines (respx at the HTTP edge; the
real registry, Sessions, publisher and HTTP push run underneath)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import load_settings
from agentic_lora.errors import AccessDeniedError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.foundation.identity import VersionRef
from agentic_lora.gateway.app import PROVENANCE_FIELD
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.registry.provenance import TurnProvenance
from agentic_lora.registry.types import Binding
from agentic_lora.session import Versioning
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault
from agentic_lora.testing.sglang_engine import FaultKind
from tests.gateway.test_gateway import ADMIN_TOKEN
from tests.gateway.test_gateway import BASE_MODEL
from tests.gateway.test_gateway import gateway_stack
from tests.gateway.test_gateway import lora_name

pytestmark = pytest.mark.asyncio

A, B = tiny_snapshot(1), tiny_snapshot(2)


def _deployment(fleet: ScriptedFleet, tmp_path: Path) -> Deployment:
    return Deployment.from_settings(
        fleet.settings(), backend_options={"store_root": str(tmp_path / "adapters")}
    )


async def test_every_reply_carries_its_turn_and_the_session_keeps_each_lag(
    tmp_path: Path,
) -> None:
    with ScriptedFleet(("e0",)) as fleet:
        async with _deployment(fleet, tmp_path) as d:
            await d.publish("A", A)
            s = d.versioning.open_session("episode-7")
            assert s.provenance() == {
                "session_id": "episode-7",
                "version_id": None,
                "digest": None,
                "lora_name": None,
                "default_revision_at_bind": None,
                "rolled_back_from": None,
                "lags": [],
                "turns": 0,
                "too_stale_lag": None,
            }
            first = await s.generate({"text": "turn 0"})
            binding = s.binding
            assert binding is not None
            assert first.provenance == TurnProvenance(
                version_id="A",
                digest_prefix=binding.digest[:16],
                lora_name=binding.lora_name,
                default_revision_at_bind=1,
                lag=0,
            )
            # The provenance names what was sent: the engine ran exactly that adapter.
            assert first.body["meta_info"]["lora_path"] == first.provenance.lora_name
            assert binding.lora_name.endswith(first.provenance.digest_prefix)

            assert (await d.publish("B", B)).outcome is PublicationOutcome.PUBLISHED
            second = await s.generate({"text": "turn 1"})
            assert second.provenance is not None
            assert (second.provenance.version_id, second.provenance.lag) == ("A", 1)

            # A failed turn produced nothing to train on: it adds no lag.
            fleet["e0"].script(EngineOp.GENERATE, Fault(FaultKind.REFUSE))
            with pytest.raises(RequestRefusedError):
                await s.generate({"text": "refused"})
            third = await s.generate({"text": "turn 2"})
            assert third.provenance is not None
            assert third.provenance.lag == 1

            record = s.provenance()
            assert record == {
                "session_id": "episode-7",
                "version_id": "A",
                "digest": binding.digest,
                "lora_name": binding.lora_name,
                "default_revision_at_bind": 1,
                "rolled_back_from": None,
                "lags": [0, 1, 1],
                "turns": 3,
                "too_stale_lag": None,
            }
            assert json.loads(json.dumps(record)) == record  # JSON-able as is
            await s.close()
            assert s.provenance() == record  # still readable after close


async def test_a_pass_through_session_has_no_provenance(tmp_path: Path) -> None:
    with ScriptedFleet(("e0",)) as fleet:
        off = Versioning.from_settings(
            load_settings(
                engines=[f"{e.name}={e.base_url}" for e in fleet.refs], http_transport="httpx"
            )
        )
        try:
            async with off.session("plain") as s:
                reply = await s.generate({"text": "hi"})
                assert reply.status_code == 200
                assert reply.provenance is None
                assert s.provenance()["version_id"] is None
                assert s.provenance()["turns"] == 0
        finally:
            await off.aclose()


async def test_turn_provenance_is_json_for_the_wire() -> None:
    ref = VersionRef("v7", "ab" * 32, "policy_lora@0-v7-" + "ab" * 8, 1)
    binding = Binding("s", ref, default_revision=4)
    turn = TurnProvenance.of(binding, 2)
    assert turn.to_dict() == {
        "version_id": "v7",
        "digest_prefix": "ab" * 8,
        "lora_name": "policy_lora@0-v7-" + "ab" * 8,
        "default_revision_at_bind": 4,
        "lag": 2,
        "rolled_back_from": None,
    }


# --- the gateway --------------------------------------------------------------------------------


def _provenance_headers(headers: Any) -> tuple[str, str, str, str | None]:
    return (
        headers["x-agentic-version"],
        headers["x-agentic-digest"],
        headers["x-agentic-revision-at-bind"],
        headers.get("x-agentic-version-lag"),
    )


async def test_gateway_replies_carry_provenance_headers_and_an_extension_field(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        a_name = lora_name(stack, "A")
        digest: str = stack.gateway.deployment.registry.peek_version("A").digest  # type: ignore[attr-defined]
        agent = stack.agent("episode-1")
        raw = await agent.chat.completions.with_raw_response.create(
            model=BASE_MODEL, messages=[{"role": "user", "content": "turn 0"}], max_tokens=4
        )
        assert _provenance_headers(raw.headers) == ("A", digest[:16], "1", "0")
        body = json.loads(raw.content)
        assert body[PROVENANCE_FIELD] == {
            "version_id": "A",
            "digest_prefix": digest[:16],
            "lora_name": a_name,
            "default_revision_at_bind": 1,
            "lag": 0,
            "rolled_back_from": None,
        }
        # The OpenAI SDK still parses the reply (the extension field is an extra key).
        completion = raw.parse()
        assert completion.choices[0].message.content

        await stack.publish("B", 2)
        later = await agent.chat.completions.with_raw_response.create(
            model=BASE_MODEL, messages=[{"role": "user", "content": "turn 1"}], max_tokens=4
        )
        assert _provenance_headers(later.headers) == ("A", digest[:16], "1", "1")
        assert json.loads(later.content)[PROVENANCE_FIELD]["lag"] == 1

        # OpenAI completions: the same headers and field.
        completed = await agent.completions.with_raw_response.create(
            model=BASE_MODEL, prompt="turn 2", max_tokens=4
        )
        assert _provenance_headers(completed.headers) == ("A", digest[:16], "1", "1")
        assert json.loads(completed.content)[PROVENANCE_FIELD]["lora_name"] == a_name
        assert completed.parse().choices

        # SGLang /generate: the same headers and field; the engine's own keys are untouched.
        http = stack.http()
        generated = await http.post(
            "/generate", json={"text": "hi"}, headers={"x-agentic-session": "episode-1"}
        )
        assert generated.status_code == 200
        assert _provenance_headers(generated.headers) == ("A", digest[:16], "1", "1")
        reply = generated.json()
        assert reply["meta_info"]["lora_path"] == a_name
        assert reply[PROVENANCE_FIELD]["lora_name"] == a_name
        assert reply[PROVENANCE_FIELD]["lag"] == 1

        fresh = await http.post(
            "/generate", json={"text": "hi"}, headers={"x-agentic-session": "episode-2"}
        )
        assert _provenance_headers(fresh.headers)[::2] == ("B", "2")
        assert fresh.json()[PROVENANCE_FIELD]["lag"] == 0


async def test_gateway_refuses_a_too_stale_session_with_409_and_lets_it_close(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path, settings={"max_version_lag": 0}, published="A") as stack:
        http = stack.http()
        headers = {"x-agentic-session": "old"}
        assert (await http.post("/generate", json={"text": "t0"}, headers=headers)).is_success
        await stack.publish("B", 2)
        sent = stack.fleet.calls(EngineOp.GENERATE)
        refused = await http.post("/generate", json={"text": "t1"}, headers=headers)
        assert refused.status_code == 409
        error = refused.json()["error"]
        assert error["code"] == "VERSION_TOO_STALE"
        assert (error["details"]["lag"], error["details"]["version"]) == (1, "A")
        assert refused.headers["x-agentic-outcome"] == "refused"
        assert refused.headers["x-should-retry"] == "false"
        assert stack.fleet.calls(EngineOp.GENERATE) == sent
        closed = await http.post("/v1/sessions/old/close", headers={"x-agentic-session": "old"})
        assert closed.status_code == 200


async def test_after_a_rollback_new_sessions_say_where_their_version_came_back_from(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        http = stack.http()
        old = {"x-agentic-session": "on-b"}
        await stack.publish("B", 2)
        assert (await http.post("/generate", json={"text": "t0"}, headers=old)).is_success
        with pytest.raises(AccessDeniedError):
            await stack.admin(None).rollback("A")
        relative = await http.post(
            "/admin/rollback",
            json={"version_id": "A", "adapter_dir": "adapters/a"},
            headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        assert (relative.status_code, relative.json()["error"]["code"]) == (400, "INVALID_REQUEST")

        result = await stack.admin().rollback("A")

        assert (result["outcome"], result["commit"]["previous_default"]) == ("PUBLISHED", "B")
        fresh = await http.post(
            "/generate", json={"text": "t0"}, headers={"x-agentic-session": "new"}
        )
        assert fresh.headers["x-agentic-version"] == "A"
        assert fresh.headers["x-agentic-revision-at-bind"] == "3"
        assert fresh.headers["x-agentic-rolled-back-from"] == "B"
        assert fresh.json()[PROVENANCE_FIELD]["rolled_back_from"] == "B"
        # A Session bound to B keeps it; by the rule of lags, one move of the default behind.
        kept = await http.post("/generate", json={"text": "t1"}, headers=old)
        assert _provenance_headers(kept.headers)[::2] == ("B", "2")
        assert kept.headers["x-agentic-version-lag"] == "1"
        assert "x-agentic-rolled-back-from" not in kept.headers
        status = (await stack.admin().status())["registry"]
        assert (status["default_version"], status["rolled_back_from"]) == ("A", "B")
