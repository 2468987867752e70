"""``agentic-lora engines`` against a real ``serve`` over scripted engines: the membership listed,
an engine drained, removed and added back (every dispatchable version loaded before it is
routed to), refusals as one line, and the admin token required."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentic_lora import cli
from agentic_lora.testing.sglang_engine import EngineOp
from tests.cli.support import Running
from tests.cli.support import run_cli

pytestmark = pytest.mark.asyncio


async def _members(srv: Running) -> dict[str, str]:
    code, out, _ = await srv.cli("engines", "list", "--json")
    assert code == cli.EXIT_OK
    return {e["engine"]: e["membership"] for e in json.loads(out)["engines"]}


async def test_engines_are_listed_drained_removed_and_added_back(srv: Running) -> None:
    code, _, _ = await srv.cli("publish", srv.adapter(1), "--version-id", "A")
    assert code == cli.EXIT_OK
    assert await _members(srv) == {"e0": "ACTIVE", "e1": "ACTIVE"}

    # A drain waits for the engine's in-flight requests (none here), then removes it.
    code, out, _ = await srv.cli("engines", "drain", "e1")
    assert code == cli.EXIT_OK
    lines = out.splitlines()
    assert lines[0] == "e1: REMOVED"
    assert lines[1].startswith("drain REMOVED: 0 in flight at the drain, 0 left, waited ")
    assert await _members(srv) == {"e0": "ACTIVE"}
    # The last ACTIVE engine cannot be drained: one line, a stable code, nothing changed.
    code, _, err = await srv.cli("engines", "drain", "e0")
    assert code == cli.EXIT_ERROR
    assert err.startswith("error: DRAIN_REFUSED")
    code, _, err = await srv.cli("engines", "remove", "e1")
    assert code == cli.EXIT_ERROR
    assert err.startswith("error: UNKNOWN_ENGINE")
    assert await _members(srv) == {"e0": "ACTIVE"}

    loads = srv.fleet["e1"].calls
    srv.fleet["e1"].restart()  # it comes back as a new process, holding nothing
    since = len(loads)
    code, out, _ = await srv.cli("engines", "add", "e1")
    assert (code, out.splitlines()[0]) == (cli.EXIT_OK, "e1: ACTIVE")
    assert [op for op, _ in srv.fleet["e1"].calls[since:]].count(EngineOp.LOAD) == 1  # A
    a_name = srv.served.gateway.deployment.registry.peek_version("A").lora_name  # type: ignore[attr-defined]
    assert srv.fleet["e1"].holds(a_name)
    assert await _members(srv) == {"e0": "ACTIVE", "e1": "ACTIVE"}


async def test_engines_needs_the_admin_token_and_an_engine_for_a_change(
    srv: Running, tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong.token"
    wrong.write_text("wrong")
    code, _, err = await run_cli(
        "engines", "list", "--server", srv.url, "--admin-token-file", str(wrong)
    )
    assert code == cli.EXIT_ERROR
    assert err.startswith("error: ACCESS_DENIED")
    code, _, err = await srv.cli("engines", "drain")
    assert code == cli.EXIT_ERROR
    assert err.startswith("error: INVALID_REQUEST")
    assert await _members(srv) == {"e0": "ACTIVE", "e1": "ACTIVE"}
