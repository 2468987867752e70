"""``publish``, ``status``, ``reclaim`` and ``resolve`` against a real ``serve`` over scripted
engines (respx at the engine HTTP edge), while an unmodified OpenAI client generates through it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx2
import openai
import pytest

from agentic_lora import cli
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault
from agentic_lora.testing.sglang_engine import FaultKind
from tests.cli.support import Running
from tests.cli.support import assert_one_error_line
from tests.cli.support import closed_port
from tests.cli.support import engine_lines
from tests.cli.support import only_line
from tests.cli.support import run_cli
from tests.cli.support import run_script
from tests.cli.support import running_server
from tests.gateway.test_gateway import BASE_MODEL


def test_client_commands_without_a_server_are_one_line(tmp_path: Path) -> None:
    server = f"http://127.0.0.1:{closed_port()}"
    for args in (("status",), ("reclaim",)):
        proc = run_script(*args, "--server", server, cwd=tmp_path)
        line = assert_one_error_line(proc, "REQUEST_REFUSED")
        assert "cannot reach the agentic-lora gateway" in line
    # The env var names the server too.
    proc = run_script("status", cwd=tmp_path, AGENTIC_LORA_SERVER=server)
    assert server in assert_one_error_line(proc, "REQUEST_REFUSED")


@pytest.mark.asyncio
async def test_serve_publish_status_reclaim_and_an_openai_agent_over_real_http(
    tmp_path: Path,
) -> None:
    async with running_server(tmp_path) as srv:
        code, out, err = await srv.cli("publish", srv.adapter(1), "--version-id", "A")
        assert (code, err) == (0, "")
        lines = out.splitlines()
        assert lines[0] == f"publishing A from {srv.adapter(1)}"
        for engine in ("e0", "e1"):
            assert any(line.split()[:3] == [engine, "prepare", "done"] for line in lines), out
        assert any(line.split()[:3] == ["fleet", "commit", "done"] for line in lines), out
        assert lines[-1].startswith("PUBLISHED A as policy_lora@0-A-")
        assert "(default revision 1, previous default none)" in lines[-1]

        agent = openai.AsyncOpenAI(
            base_url=f"{srv.url}/v1",
            api_key="episode-1",
            max_retries=0,
            http_client=httpx2.AsyncClient(),
        )
        try:
            await agent.chat.completions.create(
                model=BASE_MODEL, messages=[{"role": "user", "content": "turn 1"}]
            )
            code, out, _ = await srv.cli("publish", srv.adapter(2), "--version-id", "B")
            assert code == 0
            assert "PUBLISHED B" in out
            raw = await agent.chat.completions.with_raw_response.create(
                model=BASE_MODEL, messages=[{"role": "user", "content": "turn 2"}]
            )
            assert raw.headers["x-agentic-version"] == "A"
        finally:
            await agent.close()

        code, out, _ = await srv.cli("publish", srv.adapter(3), "--version-id", "C")
        assert code == cli.EXIT_NOT_PUBLISHED
        assert out.splitlines()[-1].startswith("SKIPPED C: CAPACITY_ERROR: no free capacity slot")

        code, out, _ = await srv.cli("status")
        assert code == 0
        head, *table = out.splitlines()
        assert head.startswith("default B (revision 2) | capacity 2/2 slots in use | pending none")
        assert "1 in the registry, 1 open in the gateway" in head
        rows = [line.split() for line in table]
        assert rows[0] == ["VERSION", "STATE", "DIGEST", "SESSIONS", "e0", "e1"]
        assert rows[1][:2] == ["A", "RETIRED"]
        assert rows[1][3:] == ["1", "ready", "ready"]
        assert rows[2][:3] == ["B", "*", "PUBLISHED"]
        assert rows[1][2] == tiny_snapshot(1).digest[:12]

        code, out, _ = await srv.cli("reclaim")
        assert (code, out) == (0, "nothing to reclaim (no retired version without Sessions)\n")

        # The background reclaimer would race the command for A: stop it, so the command
        # does the reclaim and reports it.
        await srv.served.gateway.deployment.reclaimer.stop()
        async with httpx2.AsyncClient() as http:
            closed = await http.post(
                f"{srv.url}/v1/sessions/episode-1/close",
                headers={"authorization": "Bearer episode-1"},
            )
            assert closed.json()["released_now"] is True
        code, out, _ = await srv.cli("reclaim")
        assert (code, out) == (0, "A  RECLAIMED  unloaded on e0, e1\n")
        a_name = srv.served.gateway.deployment.registry.peek_version("A").lora_name  # type: ignore[attr-defined]
        for scripted in srv.fleet.engines.values():
            assert scripted.physical_unloads[a_name] == 1

        code, out, _ = await srv.cli("status", "--json")
        payload = json.loads(out)
        states = {v["version_id"]: v["state"] for v in payload["registry"]["versions"]}
        assert states == {"A": "RECLAIMED", "B": "PUBLISHED"}
        code, out, _ = await srv.cli("status")
        assert (
            out.splitlines()[-1]
            == "(1 reclaimed or failed-clean version(s) hidden; --all shows them)"
        )

        # While the server appends to it, the journal reads the same, from a consistent copy.
        code, live_json, _ = await run_cli("status", "--journal", str(srv.journal), "--json")
        assert code == 0
        assert json.loads(live_json)["registry"]["versions"] == payload["registry"]["versions"]

        wrong = srv.root / "wrong.token"
        wrong.write_text("wrong")
        code, _, err = await run_cli(
            "status", "--server", srv.url, "--admin-token-file", str(wrong)
        )
        assert code == cli.EXIT_ERROR
        assert err.startswith("error: ACCESS_DENIED: missing or wrong admin token")
        loads = srv.fleet.calls(EngineOp.LOAD)

    # The server is gone; its journal still answers, read-only.
    before = hashlib.sha256(srv.journal.read_bytes()).hexdigest()
    siblings = sorted(p.name for p in srv.journal.parent.iterdir())
    code, out, err = await run_cli("status", "--journal", str(srv.journal), "--all")
    assert (code, err) == (0, "")
    rows = [line.split() for line in out.splitlines()[1:]]
    assert rows[1][:2] == ["A", "RECLAIMED"]
    assert rows[1][-2:] == ["unloaded", "unloaded"]
    assert rows[2][:3] == ["B", "*", "PUBLISHED"]
    assert out.startswith("default B (revision 2) | capacity 1/2 slots in use")
    assert hashlib.sha256(srv.journal.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in srv.journal.parent.iterdir()) == siblings
    assert loads == 4  # A and B on two engines; C never transferred


@pytest.mark.asyncio
async def test_publication_outcomes_and_reclaim_rounds_as_the_commands_report_them(
    srv: Running,
) -> None:
    code, out, _ = await srv.cli("status")
    assert code == 0
    assert out.splitlines() == [
        "default none (revision 0) | capacity 0/2 slots in use | pending none | epoch 0 | "
        "Sessions: 0 in the registry, 0 open in the gateway",
        "no versions yet",
    ]

    code, out, err = await srv.cli("publish", srv.adapter(1), "--version-id", "A", "--json")
    assert (code, err) == (0, "")
    result = json.loads(out)  # the whole output is the JSON result, no progress lines
    assert (result["outcome"], result["ok"], result["version_id"]) == ("PUBLISHED", True, "A")
    assert result["digest"] == tiny_snapshot(1).digest
    assert result["commit"]["default_revision"] == 1
    assert [(e["engine"], e["ready"]) for e in result["engines"]] == [
        ("e0", True),
        ("e1", True),
    ]

    loads = srv.fleet.calls(EngineOp.LOAD)
    code, out, _ = await srv.cli("publish", srv.adapter(1), "--version-id", "A")
    assert code == 0
    assert out.splitlines()[-1] == (
        "ALREADY_PUBLISHED A: the same id and content was published before; nothing changed"
    )
    assert srv.fleet.calls(EngineOp.LOAD) == loads  # nothing transferred again

    code, out, _ = await srv.cli("publish", srv.adapter(2), "--version-id", "B")
    assert code == 0
    assert "(default revision 2, previous default A)" in out.splitlines()[-1]

    # A is retired and unbound; e1's unload never arrives: the round leaves A pending.
    srv.fleet["e1"].script(EngineOp.UNLOAD, Fault(FaultKind.UNREACHABLE))
    code, out, _ = await srv.cli("reclaim")
    assert (code, out) == (
        0,
        "A  PENDING  unconfirmed on e1; slot held, retried later (e1 BACKEND_AMBIGUOUS)\n",
    )
    code, out, _ = await srv.cli("reclaim", "--json")
    assert code == 0
    report = json.loads(out)
    assert (report["reclaimed"], report["pending"]) == (["A"], [])
    (again,) = report["results"]
    assert (again["version_id"], again["outcome"]) == ("A", "RECLAIMED")
    assert again["confirmed"] == ["e0", "e1"]

    # e1 refuses C's load: every engine cleans up, the default stays B.
    out, error = await srv.publish_refused(3, "C")
    assert error == (
        "error: BACKEND_REFUSED: publication of C ended FAILED_CLEAN (prepare failed "
        "(e1: BACKEND_REFUSED)): every engine confirmed its cleanup and the default did "
        "not change"
    )
    (failed_phase,) = [line.split() for line in out.splitlines() if "FAILED" in line]
    assert failed_phase[:3] == ["e1", "prepare", "FAILED"]
    assert failed_phase[-1] == "BACKEND_REFUSED"
    lines = engine_lines(out)
    assert lines["e0"] == "ready, cleaned"
    assert lines["e1"].startswith("not ready, cleaned")
    assert "e1 load_lora_adapter: no room" in lines["e1"]

    # e1 refuses D's load and e0's cleanup is lost: D keeps its slot, exit 1, ambiguous.
    out, error = await srv.publish_refused(4, "D", lost_cleanups=1)
    assert error == (
        "error: BACKEND_AMBIGUOUS: publication of D ended BLOCKED (prepare failed (e1: "
        "BACKEND_REFUSED); cleanup unconfirmed on e0): a cleanup or the commit is "
        "unconfirmed, so its capacity slot stays held and later publications are blocked "
        "until it is resolved"
    )
    lines = engine_lines(out)
    assert lines["e0"].startswith("ready, cleanup UNCONFIRMED")
    assert lines["e1"].startswith("not ready, cleaned")

    code, out, _ = await srv.cli("status", "--all")
    assert code == 0
    head, *table = out.splitlines()
    assert head.startswith("default B (revision 2) | capacity 2/2 slots in use | pending D")
    rows = {row.split()[0]: row.split() for row in table[1:]}
    assert rows["A"][1:2] + rows["A"][-2:] == ["RECLAIMED", "unloaded", "unloaded"]
    assert rows["B"][1:3] + rows["B"][-2:] == ["*", "PUBLISHED", "ready", "ready"]
    assert rows["C"][1:2] + rows["C"][-2:] == ["FAILED_CLEAN", "cleaned", "cleaned"]
    # D's e0 cleanup is unconfirmed: still cleaning there, done on e1.
    assert rows["D"][1:2] + rows["D"][-2:] == ["ABORTED", "cleaning", "cleaned"]
    code, out, _ = await srv.cli("status")
    assert out.splitlines()[-1] == (
        "(2 reclaimed or failed-clean version(s) hidden; --all shows them)"
    )


@pytest.mark.asyncio
async def test_resolve_reports_a_blocked_publication_until_every_engine_confirmed(
    srv: Running,
) -> None:
    code, out, _ = await srv.cli("resolve")
    assert (code, out) == (0, "nothing to resolve (no blocked or abandoned publication)\n")
    assert (await srv.cli("publish", srv.adapter(1), "--version-id", "A"))[0] == 0

    # e1 refuses B; e0's cleanup does not arrive, twice: B is BLOCKED, then still BLOCKED.
    _, error = await srv.publish_refused(2, "B", lost_cleanups=2)
    assert error.startswith("error: BACKEND_AMBIGUOUS: publication of B ended BLOCKED")
    code, out, err = await srv.cli("resolve", "B")
    assert code == cli.EXIT_ERROR
    assert only_line(err) == (
        "error: BACKEND_AMBIGUOUS: B is still BLOCKED (resolved by operator; cleanup "
        "unconfirmed on e0): its capacity slot stays held; the server keeps retrying the "
        "cleanup in the background"
    )
    head, detail = out.splitlines()
    assert head == "B  BLOCKED  resolved by operator; cleanup unconfirmed on e0"
    assert detail.startswith("  e0: cleanup UNCONFIRMED (BACKEND_AMBIGUOUS: ")

    # e0 answers now: resolving everything frees B's slot.
    code, out, err = await srv.cli("resolve")
    assert (code, err) == (0, "")
    assert out == "B  FAILED_CLEAN  resolved by operator: cleanup confirmed on e0\n"
    code, out, _ = await srv.cli("resolve", "B", "--json")
    assert code == 0
    report = json.loads(out)
    assert (report["resolved"], report["blocked"]) == (["B"], [])
    assert report["results"][0]["reason"] == "nothing to resolve: FAILED_CLEAN"
    code, _, err = await srv.cli("resolve", "nope")
    assert code == cli.EXIT_ERROR
    assert only_line(err).startswith("error: UNKNOWN_VERSION: ")
    code, out, _ = await srv.cli("publish", srv.adapter(3), "--version-id", "C")
    assert code == 0
    assert "PUBLISHED C" in out.splitlines()[-1]


@pytest.mark.asyncio
async def test_rollback_makes_an_earlier_version_the_default_and_status_says_so(
    tmp_path: Path,
) -> None:
    async with running_server(tmp_path) as srv:
        for seed, version in ((1, "A"), (2, "B")):
            assert (await srv.cli("publish", srv.adapter(seed), "--version-id", version))[0] == 0
        code, out, err = await srv.cli("rollback", "B")
        assert code == 1
        assert only_line(err).startswith("error: ROLLBACK_REFUSED: 'B' is the default already")

        code, out, err = await srv.cli("rollback", "A")
        assert (code, err) == (0, "")
        assert out.startswith("ROLLED BACK to A as policy_lora@0-A-")
        assert "default revision 3, rolled back from B" in out
        code, out, _ = await srv.cli("rollback", "A")  # again: the same receipt, nothing moves
        assert code == 0
        assert "already (this rollback); nothing changed: default revision 3" in out

        code, out, _ = await srv.cli("status")
        assert code == 0
        assert out.splitlines()[0].startswith("default A (revision 3, rolled back from B) |")
        code, out, _ = await srv.cli("status", "--json")
        assert json.loads(out)["registry"]["rolled_back_from"] == "B"

        code, out, err = await srv.cli("rollback", "never-published", "--json")
        assert code == 1
        assert only_line(err).startswith("error: UNKNOWN_VERSION: ")
        code, out, _ = await srv.cli("rollback", "B", "--json")  # B is RETIRED now: back to B
        result = json.loads(out)
        assert (code, result["outcome"], result["ok"]) == (0, "PUBLISHED", True)
        assert (result["commit"]["rollback"], result["commit"]["previous_default"]) == (True, "A")
