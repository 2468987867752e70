"""``agentic-lora serve``: start-up failures leave nothing bound behind; a running server
releases every Session when stopped; as a process it logs JSON and stops cleanly on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest

from agentic_lora import cli
from agentic_lora.gateway.serve import serve
from agentic_lora.testing.fleet import ScriptedFleet
from tests.cli.support import CONSOLE_SCRIPT
from tests.cli.support import TOKEN
from tests.cli.support import assert_one_error_line
from tests.cli.support import clean_env
from tests.cli.support import closed_port
from tests.cli.support import fleet_config
from tests.cli.support import only_line
from tests.cli.support import run_cli
from tests.cli.support import run_script
from tests.cli.support import running_server
from tests.cli.support import scripted_fleet_config
from tests.cli.support import write_config


def test_serve_with_unreachable_engines_is_one_line_and_serves_nothing(tmp_path: Path) -> None:
    config = fleet_config(tmp_path / "c.toml", gateway={"port": 0})
    proc = run_script("serve", "--config", str(config), cwd=tmp_path)
    line = assert_one_error_line(proc, "REQUEST_REFUSED")
    assert "/server_info to e0: " in line or "/server_info to e1: " in line
    assert proc.returncode == cli.EXIT_ERROR


@pytest.mark.asyncio
async def test_serve_on_a_taken_port_is_one_line_and_touches_no_engine(
    tmp_path: Path, no_env: None, root_logging: None
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with ScriptedFleet() as fleet:
            config = scripted_fleet_config(
                tmp_path / "c.toml", fleet, backend_options={"store_root": str(tmp_path / "store")}
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
    with caplog.at_level(logging.INFO, logger="agentic_lora.gateway.serve"):
        task = asyncio.ensure_future(serve(options, on_ready=served.set_result, stop=stop))
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
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.name == "agentic_lora.gateway.serve"
    ]
    assert messages == [
        ("WARNING", "no admin token: the /admin routes are disabled"),
        ("INFO", "agentic-lora gateway stopped"),
    ]


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


def test_serve_as_a_process_logs_json_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    import select

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
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=clean_env(AGENTIC_LORA_ADMIN_TOKEN=TOKEN),
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
            [str(CONSOLE_SCRIPT), "status", "--server", url, "--json"],
            capture_output=True,
            text=True,
            env=clean_env(AGENTIC_LORA_ADMIN_TOKEN=TOKEN),
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
