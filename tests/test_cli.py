"""The ``agentic-lora`` command line.

* As a real console script in a subprocess: every failure is one ``error: CODE: message`` line
  and a non-zero exit, never a traceback (bad config file, unreachable engines, no server).
* In-process against scripted engines (respx at the engine HTTP edge): ``doctor`` catches a
  misconfigured engine; ``serve`` runs on a loopback port and ``publish``, ``status`` and
  ``reclaim`` drive it over HTTP while an unmodified OpenAI client generates through it; then
  ``status --journal`` reads what the server left, without writing to it.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from agentic_lora import cli
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp
from tests.test_gateway import BASE_MODEL, OpenAIRoutes, lora_server_info

CONSOLE_SCRIPT = Path(sys.executable).parent / "agentic-lora"
TOKEN = "cli-admin-token"


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTIC_LORA_")}
    env.update(extra)
    return env


def run_script(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CONSOLE_SCRIPT), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=clean_env(**env),
        timeout=120,
        check=False,
    )


def assert_one_error_line(proc: subprocess.CompletedProcess[str], code: str) -> str:
    assert proc.returncode != 0, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {code}: "), lines[0]
    return lines[0]


def write_config(path: Path, engines: list[str], **extra: Any) -> Path:
    settings: dict[str, Any] = {
        "engines": engines,
        "capacity": 2,
        "base_model_name": BASE_MODEL,
        **extra.pop("settings", {}),
    }
    document = {**settings, **extra}
    lines = []
    for key, value in document.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {json.dumps(value)}")
    for key, value in document.items():
        if isinstance(value, dict):
            lines.append(f"[{key}]")
            lines.extend(f"{k} = {json.dumps(v)}" for k, v in value.items())
    path.write_text("\n".join(lines) + "\n")
    return path


# --- one line, never a traceback (real console script) -----------------------------------------


def test_the_console_script_is_installed() -> None:
    assert CONSOLE_SCRIPT.is_file(), "pip install -e . installs the agentic-lora script"


def test_a_bad_config_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('engines = ["e0=http://127.0.0.1:1"\ncapacity = 2\n')
    line = assert_one_error_line(
        run_script("serve", "--config", str(bad), cwd=tmp_path), "CONFIG_ERROR"
    )
    assert "is not valid TOML" in line
    missing = run_script("doctor", "--config", str(tmp_path / "nope.json"), cwd=tmp_path)
    assert "cannot be read" in assert_one_error_line(missing, "CONFIG_ERROR")
    invalid = write_config(
        tmp_path / "invalid.toml", ["e0=http://127.0.0.1:1"], settings={"capacity": 1}
    )
    line = assert_one_error_line(
        run_script("serve", "--config", str(invalid), cwd=tmp_path), "CONFIG_ERROR"
    )
    assert "capacity 1 < 2" in line


def test_serve_with_an_unreachable_engine_is_one_line_and_serves_nothing(tmp_path: Path) -> None:
    port = closed_port()
    config = write_config(
        tmp_path / "c.toml",
        [f"e0=http://127.0.0.1:{port}"],
        backend_options={"store_root": str(tmp_path / "store")},
        gateway={"port": 0},
    )
    proc = run_script("serve", "--config", str(config), cwd=tmp_path)
    line = assert_one_error_line(proc, "REQUEST_REFUSED")
    assert f"127.0.0.1:{port}" in line or "e0" in line
    assert proc.returncode == cli.EXIT_ERROR


def test_doctor_with_an_unreachable_engine_names_it_and_fails(tmp_path: Path) -> None:
    port = closed_port()
    config = write_config(tmp_path / "c.toml", [f"e0=http://127.0.0.1:{port}"])
    proc = run_script("doctor", "--config", str(config), cwd=tmp_path)
    assert_one_error_line(proc, "CONFIG_ERROR")
    assert "e0\n  FAIL  reachable" in proc.stdout
    assert "Connect" in proc.stdout


def test_client_commands_without_a_server_are_one_line(tmp_path: Path) -> None:
    server = f"http://127.0.0.1:{closed_port()}"
    for args in (("status",), ("reclaim",)):
        proc = run_script(*args, "--server", server, cwd=tmp_path)
        line = assert_one_error_line(proc, "REQUEST_REFUSED")
        assert "cannot reach the agentic-lora gateway" in line
    # The env var names the server too.
    proc = run_script("status", cwd=tmp_path, AGENTIC_LORA_SERVER=server)
    assert server in assert_one_error_line(proc, "REQUEST_REFUSED")


def test_a_bad_command_line_is_one_line_with_exit_2(tmp_path: Path) -> None:
    proc = run_script("publish", "some-dir", cwd=tmp_path)
    line = assert_one_error_line(proc, "CONFIG_ERROR")
    assert "--version-id" in line
    assert proc.returncode == cli.EXIT_USAGE
    assert run_script("--help", cwd=tmp_path).returncode == 0


def test_a_missing_journal_is_one_line(tmp_path: Path) -> None:
    proc = run_script("status", "--journal", str(tmp_path / "none.sqlite"), cwd=tmp_path)
    assert "no registry journal" in assert_one_error_line(proc, "CONFIG_ERROR")
    foreign = tmp_path / "foreign.sqlite"
    foreign.write_bytes(b"not a database at all" * 100)
    proc = run_script("status", "--journal", str(foreign), cwd=tmp_path)
    assert_one_error_line(proc, "JOURNAL_FOREIGN")


# --- config resolution --------------------------------------------------------------------------


def test_flags_beat_environment_beat_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("AGENTIC_LORA_"):
            monkeypatch.delenv(name)
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    config = write_config(
        tmp_path / "c.toml",
        ["e0=http://127.0.0.1:30000"],
        settings={"capacity": 3, "lora_name_prefix": "from_file", "journal_path": "j.sqlite"},
        backend_options={"store_root": "store"},
        gateway={"port": 9001, "admin_token_file": "token", "idle_timeout": 60},
    )
    monkeypatch.setenv("AGENTIC_LORA_CAPACITY", "4")
    monkeypatch.setenv("AGENTIC_LORA_LORA_NAME_PREFIX", "from_env")
    options = cli.serve_options(
        ["--config", str(config), "--versioned-lora-capacity", "5", "--backend-option", "x=1"]
    )
    assert options.settings.capacity == 5  # flag
    assert options.settings.lora_name_prefix == "from_env"  # env over file
    assert options.settings.enable_versioned_lora_publication is True  # serve turns it on
    assert options.settings.journal_path == tmp_path / "j.sqlite"  # relative to the file
    assert options.backend_options == {"store_root": str(tmp_path / "store"), "x": "1"}
    assert (options.port, options.idle_timeout, options.admin_token) == (9001, 60.0, "from-file")
    monkeypatch.setenv("AGENTIC_LORA_ADMIN_TOKEN", "from-env")
    assert cli.serve_options(["--config", str(config)]).admin_token == "from-env"
    assert cli.serve_options(["--config", str(config), "--admin-token", "t"]).admin_token == "t"


def test_unknown_gateway_keys_are_refused(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", ["e0=http://127.0.0.1:1"], gateway={"prot": 1})
    with pytest.raises(Exception, match=r"unknown \[gateway\] key\(s\) \['prot'\]"):
        cli.read_config_file(config)


def test_the_json_log_formatter_keeps_the_stable_keys() -> None:
    import logging

    record = logging.makeLogRecord(
        {"msg": "dispatch %s", "args": ("ok",), "levelname": "INFO", "name": "x"}
    )
    for key, value in {"session": "s#1", "version": "A", "engine": "e0", "attempt": 1}.items():
        setattr(record, key, value)
    line = json.loads(cli.JsonLogFormatter().format(record))
    assert line["message"] == "dispatch ok"
    assert {k: line[k] for k in ("session", "version", "engine", "attempt")} == {
        "session": "s#1",
        "version": "A",
        "engine": "e0",
        "attempt": 1,
    }


# --- doctor against scripted engines ------------------------------------------------------------


async def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = await cli.run(list(args), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.asyncio
async def test_doctor_catches_an_engine_with_too_few_slots(tmp_path: Path) -> None:
    with ScriptedFleet() as fleet:
        lora_server_info(fleet, max_loaded_loras=2)
        config = write_config(tmp_path / "c.toml", [f"{e.name}={e.base_url}" for e in fleet.refs])
        code, out, err = await run_cli("doctor", "--config", str(config))
    assert code == cli.EXIT_ERROR
    assert "  FAIL  loaded slots    max_loaded_loras 2 < capacity + 1 = 3" in out
    assert out.count("FAIL") == 2  # once per engine
    assert "  ok    pinned limit    max_loras_per_batch 3 leaves 2 pinnable >= capacity 2" in out
    assert err.count("\n") == 1
    assert err.startswith("error: CONFIG_ERROR: doctor found 2 problem(s); first: e0 loaded slots")


@pytest.mark.asyncio
async def test_doctor_passes_a_healthy_fleet_and_checks_an_adapter_against_it(
    tmp_path: Path,
) -> None:
    small, large = tmp_path / "small", tmp_path / "large"
    tiny_snapshot(1, rank=4).write_peft_dir(small)
    tiny_snapshot(1, rank=16).write_peft_dir(large)
    with ScriptedFleet() as fleet:
        lora_server_info(fleet)
        config = write_config(
            tmp_path / "c.toml",
            [f"{e.name}={e.base_url}" for e in fleet.refs],
            backend_options={"store_root": str(tmp_path)},
        )
        code, out, err = await run_cli("doctor", "--config", str(config), "--adapter", str(small))
        assert (code, err) == (0, ""), out
        assert out.strip().endswith("all checks passed")
        assert "  ok    max lora rank   adapter rank 4 <= max_lora_rank 8" in out
        assert "  skip  retries off     no gateway_url" in out
        assert f"  ok    store root      {tmp_path} is writable" in out

        code, out, err = await run_cli(
            "doctor", "--config", str(config), "--adapter", str(large), "--json"
        )
    assert code == cli.EXIT_ERROR
    checks = json.loads(out)
    failed = {(c["scope"], c["name"]) for c in checks if c["status"] == "fail"}
    assert failed == {("e0", "max lora rank"), ("e1", "max lora rank")}


@pytest.mark.asyncio
async def test_doctor_reports_a_router_whose_retries_are_not_asserted_off(tmp_path: Path) -> None:
    with ScriptedFleet() as fleet:
        lora_server_info(fleet, enable_lora=False)
        config = write_config(
            tmp_path / "c.toml",
            [f"{e.name}={e.base_url}" for e in fleet.refs],
            settings={"gateway_url": "http://127.0.0.1:29000"},
        )
        code, out, _ = await run_cli("doctor", "--config", str(config))
    assert code == cli.EXIT_ERROR
    assert "config\n  FAIL  settings        " in out
    assert "--disable-retries" in out
    assert "router\n  FAIL  retries off" in out
    assert "  FAIL  lora enabled    runs without --enable-lora" in out


# --- serve + publish/status/reclaim over HTTP ----------------------------------------------------


@dataclass
class Running:
    url: str
    served: cli.Served
    fleet: ScriptedFleet
    routes: OpenAIRoutes
    journal: Path
    root: Path

    def adapter(self, seed: int) -> str:
        path = self.root / "adapters" / f"seed{seed}"
        if not path.exists():
            tiny_snapshot(seed).write_peft_dir(path)
        return str(path)

    async def cli(self, *args: str) -> tuple[int, str, str]:
        return await run_cli(*args, "--server", self.url, "--admin-token", TOKEN)


@asynccontextmanager
async def running_server(root: Path) -> AsyncIterator[Running]:
    (root / "token.txt").write_text(TOKEN)
    with ScriptedFleet() as fleet:
        lora_server_info(fleet)
        routes = OpenAIRoutes(fleet)
        config = write_config(
            root / "agentic-lora.toml",
            [f"{e.name}={e.base_url}" for e in fleet.refs],
            settings={"http_transport": "httpx", "journal_path": "registry.sqlite"},
            backend_options={"store_root": "store"},
            gateway={"port": 0, "admin_token_file": "token.txt"},
        )
        options = cli.serve_options(["--config", str(config)])
        ready: asyncio.Future[cli.Served] = asyncio.get_running_loop().create_future()

        def on_ready(served: cli.Served) -> None:
            port = int(served.url.rsplit(":", 1)[1])
            # The CLI's own HTTP calls go to the real socket; the engines stay scripted.
            fleet.router.route(host="127.0.0.1", port=port).pass_through()
            ready.set_result(served)

        stop = asyncio.Event()
        task = asyncio.ensure_future(cli.serve(options, on_ready=on_ready, stop=stop))
        first: set[asyncio.Future[Any]] = {task, ready}
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # start-up failed: raise it here
        served = ready.result()
        try:
            yield Running(served.url, served, fleet, routes, root / "registry.sqlite", root)
        finally:
            stop.set()
            await task


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
            closed = await http.post(f"{srv.url}/v1/sessions/episode-1/close")
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

        code, _, err = await run_cli("status", "--server", srv.url, "--admin-token", "wrong")
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
async def test_stopping_serve_releases_every_open_session(tmp_path: Path) -> None:
    async with running_server(tmp_path) as srv:
        await srv.cli("publish", srv.adapter(1), "--version-id", "A")
        async with httpx2.AsyncClient() as http:
            for session in ("s1", "s2"):
                response = await http.post(
                    f"{srv.url}/generate",
                    json={"text": "hi"},
                    headers={"authorization": f"Bearer {session}"},
                )
                assert response.status_code == 200
        registry: Any = srv.served.gateway.deployment.registry
        assert registry.peek_version("A").session_refs == 2
    code, out, _ = await run_cli("status", "--journal", str(srv.journal), "--json")
    assert code == 0
    (version,) = json.loads(out)["registry"]["versions"]
    assert version["session_refs"] == 0
    assert json.loads(out)["registry"]["live_sessions"] == 0


# --- demo ---------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_demo_delegates_to_the_script_with_its_arguments(tmp_path: Path) -> None:
    script = tmp_path / "demo.py"
    marker = tmp_path / "args.json"
    script.write_text(
        "import json, sys\n"
        f"open({str(marker)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
        "sys.exit(7)\n"
    )
    code, _, _ = await run_cli("demo", "--script", str(script), "--", "--fast", "x")
    assert code == 7
    assert json.loads(marker.read_text()) == ["--fast", "x"]
    code, _, err = await run_cli("demo", "--script", str(tmp_path / "missing.py"))
    assert code == cli.EXIT_ERROR
    assert err.startswith("error: CONFIG_ERROR: no demo script")


def test_serve_as_a_process_logs_json_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    import select
    import signal

    config = write_config(
        tmp_path / "c.toml",
        [f"e0=http://127.0.0.1:{closed_port()}"],
        backend_options={"store_root": str(tmp_path / "store")},
        gateway={"port": 0},
    )
    proc = subprocess.Popen(
        [
            str(CONSOLE_SCRIPT),
            "serve",
            "--config",
            str(config),
            "--skip-engine-check",
            "--log-format",
            "json",
            "--admin-token",
            TOKEN,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=clean_env(),
    )
    assert proc.stderr is not None
    try:
        url = None
        while url is None:
            readable, _, _ = select.select([proc.stderr], [], [], 60)
            assert readable, "serve did not report that it is serving"
            line = proc.stderr.readline()
            assert line, f"serve exited early with {proc.wait()}"
            record = json.loads(line)
            if record["message"].startswith("agentic-lora gateway serving on "):
                url = record["message"].rsplit(" ", 1)[1]
        status = subprocess.run(
            [str(CONSOLE_SCRIPT), "status", "--server", url, "--admin-token", TOKEN, "--json"],
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=60,
            check=False,
        )
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["registry"]["versions"] == []
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    messages = [json.loads(line)["message"] for line in rest.splitlines()]
    assert messages[-1] == "agentic-lora gateway stopped"
