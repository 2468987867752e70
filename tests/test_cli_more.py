"""The ``agentic-lora`` command line, continued.

* Every way a config file, a flag or a token file can be wrong is one exact error line (exit 1),
  decided before anything is served or any engine is contacted.
* ``serve`` start-up failures (port taken, journal unreadable) leave nothing bound behind.
* ``publish``, ``status`` and ``reclaim`` against a real ``serve`` over scripted engines: JSON
  output, an idempotent re-publication, a publication that fails clean and one whose cleanup is
  unconfirmed (exit 1 with the outcome's code), a reclaim left pending by an engine, and what
  ``status`` shows for each.
* ``doctor`` reports what an engine does not tell, declared slots that disagree with the engine,
  and a router asserted to run without retries.
* ``demo`` finds ``examples/demo.py`` in the working directory, and its child never outlives an
  interrupted command.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentic_lora import cli
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp, Fault, FaultKind
from tests.test_cli import (
    CONSOLE_SCRIPT,
    clean_env,
    closed_port,
    run_cli,
    running_server,
    write_config,
)
from tests.test_gateway import lora_server_info


@pytest.fixture
def root_logging() -> Iterator[None]:
    """``serve`` configures the root logger for its process; put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``AGENTIC_LORA_*`` variable of the machine running the tests leaks into a command."""
    for name in list(os.environ):
        if name.startswith("AGENTIC_LORA_"):
            monkeypatch.delenv(name)


def fleet_config(path: Path, **extra: Any) -> Path:
    """A valid config whose engines nothing listens on (the checks below never reach them)."""
    return write_config(
        path,
        [f"e0=http://127.0.0.1:{closed_port()}", f"e1=http://127.0.0.1:{closed_port()}"],
        backend_options={"store_root": str(path.parent / "store")},
        **extra,
    )


def only_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# --- config files -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_every_unreadable_config_file_is_one_exact_line(tmp_path: Path, no_env: None) -> None:
    cases: dict[str, tuple[str, str]] = {
        "c.yaml": ("engines: []\n", "must end in .toml or .json"),
        "c.json": (
            '{"engines": [',
            "is not valid JSON: Expecting value: line 1 column 14 (char 13)",
        ),
        "list.json": ("[1, 2]", "must hold a table/object at the top level"),
        "gw.toml": ('engines = []\ngateway = "0.0.0.0"\n', "`gateway` must be a table/object"),
        "opts.json": ('{"backend_options": [1]}', "`backend_options` must be a table/object"),
    }
    for name, (text, problem) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        code, out, err = await run_cli("serve", "--config", str(path))
        assert (code, out) == (cli.EXIT_ERROR, ""), name
        assert only_line(err) == f"error: CONFIG_ERROR: config file {path}: {problem}", name


@pytest.mark.asyncio
async def test_bad_gateway_options_and_token_files_are_one_exact_line(
    tmp_path: Path, no_env: None
) -> None:
    config = fleet_config(tmp_path / "c.toml")
    (tmp_path / "empty-token").write_text("  \n")
    cases: list[tuple[list[str], str]] = [
        (["--port", "70000"], "port 70000 is not a TCP port"),
        (["--idle-timeout", "0"], "idle_timeout 0.0 must be positive"),
        (["--backend-option", "store_root"], "--backend-option 'store_root' is not KEY=VALUE"),
        (["--backend-option", " =x"], "--backend-option ' =x' is not KEY=VALUE"),
        (
            ["--admin-token-file", str(tmp_path / "missing-token")],
            f"admin token file {tmp_path / 'missing-token'} cannot be read "
            "(No such file or directory)",
        ),
        (
            ["--admin-token-file", str(tmp_path / "empty-token")],
            f"admin token file {tmp_path / 'empty-token'} is empty",
        ),
        (["--log-level", "LOUD"], "unknown log level 'LOUD'"),
    ]
    for flags, message in cases:
        code, out, err = await run_cli("serve", "--config", str(config), *flags)
        assert (code, out) == (cli.EXIT_ERROR, ""), flags
        assert only_line(err) == f"error: CONFIG_ERROR: {message}", flags
    # The same checks hold for values from the file.
    for gateway, message in (
        ({"port": "8000"}, "port '8000' is not a TCP port"),
        ({"port": -1}, "port -1 is not a TCP port"),
        ({"idle_timeout": -5}, "idle_timeout -5 must be positive"),
        ({"idle_timeout": "soon"}, "idle_timeout 'soon' must be positive"),
    ):
        bad = fleet_config(tmp_path / "bad.toml", gateway=gateway)
        code, _, err = await run_cli("serve", "--config", str(bad))
        assert code == cli.EXIT_ERROR
        assert only_line(err) == f"error: CONFIG_ERROR: {message}", gateway


def test_a_json_config_resolves_like_a_toml_one(tmp_path: Path, no_env: None) -> None:
    (tmp_path / "token").write_text("file-token\n")
    (tmp_path / "state").mkdir()
    document = {
        "engines": ["e0=http://127.0.0.1:30000", "e1=http://127.0.0.1:30001"],
        "capacity": 3,
        "base_model_name": "base-model",
        "journal_path": "state/registry.sqlite",
        "backend_options": {"store_root": "store", "other": 1},
        "gateway": {
            "host": "0.0.0.0",
            "port": 0,
            "admin_token_file": "token",
            "reuse_closed_ids": True,
            "access_log": True,
        },
    }
    config = tmp_path / "agentic-lora.json"
    config.write_text(json.dumps(document))
    options = cli.serve_options(["--config", str(config), "--skip-engine-check"])
    assert [e.name for e in options.settings.engines] == ["e0", "e1"]
    assert options.settings.capacity == 3
    assert options.settings.journal_path == tmp_path / "state" / "registry.sqlite"
    assert options.backend_options == {"store_root": str(tmp_path / "store"), "other": 1}
    assert (options.host, options.port, options.admin_token) == ("0.0.0.0", 0, "file-token")
    assert (options.reuse_closed_ids, options.access_log, options.verify_engines) == (
        True,
        True,
        False,
    )
    assert options.idle_timeout is None


def test_without_a_config_file_flags_alone_make_the_settings(no_env: None) -> None:
    assert cli.read_config_file(None) == cli.ConfigFile()
    options = cli.serve_options(
        [
            "--versioned-lora-engine",
            "e0=http://127.0.0.1:30000",
            "--versioned-lora-engine",
            "e1=http://127.0.0.1:30001",
            "--versioned-lora-base-model",
            "base-model",
            "--idle-timeout",
            "2.5",
        ]
    )
    assert [(e.name, e.base_url) for e in options.settings.engines] == [
        ("e0", "http://127.0.0.1:30000"),
        ("e1", "http://127.0.0.1:30001"),
    ]
    assert options.settings.enable_versioned_lora_publication is True
    assert (options.host, options.port) == (cli.DEFAULT_HOST, cli.DEFAULT_PORT)
    assert (options.admin_token, options.idle_timeout) == (None, 2.5)
    assert options.backend_options == {}


# --- serve start-up failures --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_serve_on_a_taken_port_is_one_line_and_touches_no_engine(
    tmp_path: Path, no_env: None, root_logging: None
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with ScriptedFleet() as fleet:
            config = write_config(
                tmp_path / "c.toml",
                [f"{e.name}={e.base_url}" for e in fleet.refs],
                backend_options={"store_root": str(tmp_path / "store")},
            )
            code, out, err = await run_cli("serve", "--config", str(config), "--port", str(port))
            assert fleet.calls() == 0
    assert (code, out) == (cli.EXIT_ERROR, "")
    assert only_line(err) == (
        f"error: CONFIG_ERROR: cannot listen on 127.0.0.1:{port}: Address already in use"
    )


@pytest.mark.asyncio
async def test_serve_that_cannot_open_its_journal_releases_the_port(
    tmp_path: Path, no_env: None, root_logging: None
) -> None:
    journal = tmp_path / "registry.sqlite"
    journal.write_bytes(b"not a journal" * 100)
    config = fleet_config(
        tmp_path / "c.toml", settings={"journal_path": str(journal), "http_transport": "httpx"}
    )
    port = closed_port()
    code, _, err = await run_cli("serve", "--config", str(config), "--port", str(port))
    assert code == cli.EXIT_ERROR
    assert only_line(err).startswith(
        f"error: JOURNAL_CORRUPT: journal {journal} is not a readable SQLite database"
    )
    # The socket bound before the failure was closed: the port can be listened on again.
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))
        again.listen()


@pytest.mark.asyncio
async def test_serve_without_an_admin_token_warns_and_disables_the_admin_routes(
    tmp_path: Path, no_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    config = fleet_config(tmp_path / "c.toml", settings={"http_transport": "httpx"})
    options = cli.serve_options(["--config", str(config), "--port", "0", "--skip-engine-check"])
    assert options.admin_token is None
    stop = asyncio.Event()
    served: asyncio.Future[cli.Served] = asyncio.get_running_loop().create_future()
    with caplog.at_level(logging.INFO, logger="agentic_lora.cli"):
        task = asyncio.ensure_future(cli.serve(options, on_ready=served.set_result, stop=stop))
        try:
            url = (await served).url
            async with httpx.AsyncClient(trust_env=False) as http:
                denied = await http.get(f"{url}/admin/status")
                health = await http.get(f"{url}/health")
        finally:
            stop.set()
            await task
    assert denied.status_code == 401
    assert denied.json()["error"]["details"] == {"reason": "admin_disabled"}
    assert health.json() == {"status": "ok"}
    messages = [
        (r.levelname, r.getMessage()) for r in caplog.records if r.name == "agentic_lora.cli"
    ]
    assert messages == [
        ("WARNING", "no admin token: the /admin routes are disabled"),
        ("INFO", "agentic-lora gateway stopped"),
    ]


# --- publish / status / reclaim against a running server ----------------------------------------


def engine_lines(out: str) -> dict[str, str]:
    """The per-engine summary lines of a failed publication, by engine."""
    found = {}
    for line in out.splitlines():
        if line.startswith("  e") and ": " in line and "ready" in line:
            engine, _, rest = line.strip().partition(": ")
            found[engine] = rest
    return found


@pytest.mark.asyncio
async def test_publication_outcomes_and_reclaim_rounds_as_the_commands_report_them(
    tmp_path: Path,
) -> None:
    async with running_server(tmp_path) as srv:
        # Reclaim rounds are this test's to run: stop the background ones. D below stays
        # blocked only while the background resolver is stopped too.
        await srv.served.gateway.deployment.reclaimer.stop()
        await srv.served.gateway.deployment.resolver.stop()

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
        srv.fleet["e1"].script(EngineOp.LOAD, Fault(FaultKind.REFUSE, "no room"))
        code, out, err = await srv.cli("publish", srv.adapter(3), "--version-id", "C")
        assert code == cli.EXIT_ERROR
        assert only_line(err) == (
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
        srv.fleet["e1"].script(EngineOp.LOAD, Fault(FaultKind.REFUSE, "no room"))
        srv.fleet["e0"].script(EngineOp.UNLOAD, Fault(FaultKind.UNREACHABLE))
        code, out, err = await srv.cli("publish", srv.adapter(4), "--version-id", "D")
        assert code == cli.EXIT_ERROR
        assert only_line(err) == (
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
    tmp_path: Path,
) -> None:
    async with running_server(tmp_path) as srv:
        # The command is what is tested: the background resolver would settle B on its own.
        await srv.served.gateway.deployment.resolver.stop()
        code, out, _ = await srv.cli("resolve")
        assert (code, out) == (0, "nothing to resolve (no blocked or abandoned publication)\n")
        assert (await srv.cli("publish", srv.adapter(1), "--version-id", "A"))[0] == 0

        # e1 refuses B; e0's cleanup does not arrive, twice: B is BLOCKED, then still BLOCKED.
        srv.fleet["e1"].script(EngineOp.LOAD, Fault(FaultKind.REFUSE, "no room"))
        srv.fleet["e0"].script(EngineOp.UNLOAD, *(Fault(FaultKind.UNREACHABLE) for _ in range(2)))
        code, _, err = await srv.cli("publish", srv.adapter(2), "--version-id", "B")
        assert code == cli.EXIT_ERROR
        assert only_line(err).startswith("error: BACKEND_AMBIGUOUS: publication of B ended BLOCKED")
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


# --- status --journal on files that are not ours ------------------------------------------------


def sqlite_file(path: Path, *statements: str) -> Path:
    conn = sqlite3.connect(path)
    try:
        for statement in statements:
            conn.execute(statement)
        conn.commit()
    finally:
        conn.close()
    return path


def fingerprint(path: Path) -> tuple[str, list[str]]:
    """The file's content hash and the names in its directory."""
    return hashlib.sha256(path.read_bytes()).hexdigest(), sorted(
        p.name for p in path.parent.iterdir()
    )


@pytest.mark.asyncio
async def test_sqlite_files_that_are_not_registry_journals_are_refused_read_only(
    tmp_path: Path,
) -> None:
    cases = [
        sqlite_file(tmp_path / "other-app.sqlite", "CREATE TABLE users (name TEXT)"),
        sqlite_file(
            tmp_path / "not-json.sqlite",
            "CREATE TABLE meta (key TEXT, value TEXT)",
            "INSERT INTO meta VALUES ('identity', '{not json')",
        ),
        sqlite_file(
            tmp_path / "partial.sqlite",
            "CREATE TABLE meta (key TEXT, value TEXT)",
            """INSERT INTO meta VALUES ('identity', '{"engines": ["e0"], "capacity": 2}')""",
        ),
        sqlite_file(tmp_path / "no-identity.sqlite", "CREATE TABLE meta (key TEXT, value TEXT)"),
    ]
    for path in cases:
        before = fingerprint(path)
        code, out, err = await run_cli("status", "--journal", str(path))
        assert (code, out) == (cli.EXIT_ERROR, ""), path.name
        assert only_line(err) == (
            f"error: JOURNAL_FOREIGN: {path} is not an agentic-lora registry journal"
        )
        assert fingerprint(path) == before  # same bytes, and no -wal or -shm beside it


@pytest.mark.asyncio
async def test_an_unexpected_failure_is_one_generic_line_and_debug_adds_the_traceback(
    tmp_path: Path,
) -> None:
    # An identity with every key but a capacity that is no number: not a typed refusal.
    journal = sqlite_file(
        tmp_path / "odd.sqlite",
        "CREATE TABLE meta (key TEXT, value TEXT)",
        """INSERT INTO meta VALUES ('identity', '{"engines": ["e0", "e1"], "capacity": "two",
        "deployment_epoch": 0, "prefix": "p"}')""",
    )
    code, _, err = await run_cli("status", "--journal", str(journal))
    assert code == cli.EXIT_ERROR
    assert only_line(err) == (
        "error: AGENTIC_LORA_ERROR: unexpected ValueError: invalid literal for int() with base "
        "10: 'two' (--debug shows the traceback)"
    )
    code, _, err = await run_cli("--debug", "status", "--journal", str(tmp_path / "none"))
    assert code == cli.EXIT_ERROR
    lines = err.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert "ConfigurationError" in err
    assert lines[-1] == f"error: CONFIG_ERROR: no registry journal at {tmp_path / 'none'}"


# --- doctor -------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_doctor_still_checks_engines_with_invalid_settings_and_skips_the_unreported(
    tmp_path: Path,
) -> None:
    adapter = tmp_path / "adapter"
    tiny_snapshot(1).write_peft_dir(adapter)
    with ScriptedFleet() as fleet:
        lora_server_info(fleet, max_loaded_loras=None, max_loras_per_batch=None, max_lora_rank=None)
        config = tmp_path / "c.json"
        engines = [f"{e.name}={e.base_url}" for e in fleet.refs]
        config.write_text(json.dumps({"engines": engines, "capacity": 2}))  # no base_model_name
        code, out, err = await run_cli("doctor", "--config", str(config), "--adapter", str(adapter))
    # Without base_model_name the settings are invalid; the engines are checked anyway.
    assert code == cli.EXIT_ERROR
    assert out.startswith("config\n  FAIL  settings        base_model_name None must be the served")
    assert only_line(err).startswith(
        "error: CONFIG_ERROR: doctor found 1 problem(s); first: config"
    )
    e0 = out.split("e0\n", 1)[1].split("e1\n", 1)[0].splitlines()
    assert e0 == [
        "  ok    reachable       SGLang 0.5.23 serving base-model",
        "  ok    lora enabled    --enable-lora is on",
        "  skip  served model    base_model_name is not set",
        "  skip  loaded slots    max_loaded_loras not reported",
        "  skip  pinned limit    max_loras_per_batch not reported",
        "  skip  max lora rank   max_lora_rank not reported; cannot check the adapter",
        "  ok    target modules  adapter targets are served",
    ]
    assert out.endswith(
        "router\n  skip  retries off     no gateway_url: engines are reached directly\n"
    )


@pytest.mark.asyncio
async def test_doctor_flags_declared_slots_the_engines_do_not_run_with(tmp_path: Path) -> None:
    with ScriptedFleet() as fleet:
        lora_server_info(fleet, max_loaded_loras=4, max_loras_per_batch=3)
        config = write_config(
            tmp_path / "c.toml",
            [f"{e.name}={e.base_url}" for e in fleet.refs],
            settings={
                "engine_max_loaded_loras": 5,
                "engine_max_loras_per_batch": 3,
                "gateway_url": "http://127.0.0.1:29000",
                "gateway_retries_disabled": True,
            },
        )
        code, out, err = await run_cli("doctor", "--config", str(config), "--json")
    assert code == cli.EXIT_ERROR
    checks = json.loads(out)
    failed = [(c["scope"], c["name"], c["detail"]) for c in checks if c["status"] == "fail"]
    assert failed == [
        ("e0", "declared slots", "runs with max_loaded_loras=4, settings say 5"),
        ("e1", "declared slots", "runs with max_loaded_loras=4, settings say 5"),
    ]
    router = [c for c in checks if c["scope"] == "router"]
    assert router == [
        {
            "scope": "router",
            "name": "retries off",
            "status": "ok",
            "detail": "http://127.0.0.1:29000: asserted to run with --disable-retries",
        }
    ]
    assert only_line(err) == (
        "error: CONFIG_ERROR: doctor found 2 problem(s); first: e0 declared slots: runs with "
        "max_loaded_loras=4, settings say 5"
    )


@pytest.mark.asyncio
async def test_doctor_fails_a_store_root_that_is_not_a_writable_directory(tmp_path: Path) -> None:
    occupied = tmp_path / "a-file"
    occupied.write_text("")
    with ScriptedFleet() as fleet:
        lora_server_info(fleet)
        config = write_config(
            tmp_path / "c.toml",
            [f"{e.name}={e.base_url}" for e in fleet.refs],
            backend_options={"store_root": str(occupied / "store")},
        )
        code, out, _ = await run_cli("doctor", "--config", str(config))
    assert code == cli.EXIT_ERROR
    assert (
        f"backend\n  FAIL  store root      {occupied / 'store'} is not a writable directory" in out
    )


# --- demo ---------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_demo_runs_examples_demo_py_of_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "ran.json"
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "demo.py").write_text(
        "import json, os, sys\n"
        f"open({str(marker)!r}, 'w').write(json.dumps([os.getcwd(), sys.argv[1:]]))\n"
    )
    monkeypatch.chdir(tmp_path)
    code, _, err = await run_cli("demo", "fast")
    assert (code, err) == (0, "")
    assert json.loads(marker.read_text()) == [str(tmp_path), ["fast"]]


BLOCKING_DEMO = """\
import socket, sys
conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
conn.recv(1)  # blocks until the test side goes away, or the process is stopped
"""


@pytest.mark.asyncio
async def test_a_cancelled_demo_command_stops_its_child(tmp_path: Path) -> None:
    script = tmp_path / "demo.py"
    script.write_text(BLOCKING_DEMO)
    loop = asyncio.get_running_loop()
    connected: asyncio.Future[None] = loop.create_future()
    hung_up: asyncio.Future[bytes] = loop.create_future()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set_result(None)
        hung_up.set_result(await reader.read())  # returns once the child's end is closed
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        demo = asyncio.ensure_future(run_cli("demo", "--script", str(script), "--", str(port)))
        await connected  # the child runs and holds its connection
        demo.cancel()
        with pytest.raises(asyncio.CancelledError):
            await demo
        # The child was stopped (it never sends anything; only its exit closes the connection).
        assert await asyncio.wait_for(hung_up, 60) == b""
    finally:
        server.close()
        await server.wait_closed()


def test_ctrl_c_stops_the_demo_and_its_child_with_exit_130(tmp_path: Path) -> None:
    script = tmp_path / "demo.py"
    script.write_text(BLOCKING_DEMO)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(60)
        port = listener.getsockname()[1]
        proc = subprocess.Popen(
            [str(CONSOLE_SCRIPT), "demo", "--script", str(script), "--", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env=clean_env(),
        )
        try:
            conn, _ = listener.accept()  # the demo's child is running
            with conn:
                proc.send_signal(signal.SIGINT)
                out, err = proc.communicate(timeout=60)
                conn.settimeout(60)
                assert conn.recv(1) == b""  # the child was stopped too
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 130
    assert (out, err) == ("", "error: interrupted\n")


def test_main_returns_the_exit_code_of_the_command(tmp_path: Path) -> None:
    assert cli.main(["status", "--journal", str(tmp_path / "none")]) == cli.EXIT_ERROR
    assert cli.main(["status", "--bogus"]) == cli.EXIT_USAGE


def test_the_json_log_formatter_carries_the_traceback_of_a_failure() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.LogRecord(
            "agentic_lora.x", logging.ERROR, __file__, 1, "failed %s", ("once",), sys.exc_info()
        )
    record.session = "s#1"
    line = json.loads(cli.JsonLogFormatter().format(record))
    assert (line["level"], line["message"], line["session"]) == ("ERROR", "failed once", "s#1")
    assert line["exc"].startswith("Traceback (most recent call last):")
    assert line["exc"].endswith("RuntimeError: boom")
    # A multi-line traceback still makes one line of output.
    assert "\n" not in cli.JsonLogFormatter().format(record)
