"""What the CLI tests share: the console script, config files, a served gateway."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import socket
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentic_lora import cli
from agentic_lora.gateway.serve import serve
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault
from agentic_lora.testing.sglang_engine import FaultKind
from tests.gateway.test_gateway import BASE_MODEL
from tests.gateway.test_gateway import OpenAIRoutes
from tests.gateway.test_gateway import lora_server_info

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


def scripted_fleet_config(path: Path, fleet: ScriptedFleet, **extra: Any) -> Path:
    """A config naming ``fleet``'s scripted engines; ``extra`` as :func:`write_config`."""
    return write_config(path, [f"{e.name}={e.base_url}" for e in fleet.refs], **extra)


async def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = await cli.run(list(args), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


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
        token_file = str(self.root / "token.txt")
        return await run_cli(*args, "--server", self.url, "--admin-token-file", token_file)

    async def publish_refused(
        self, seed: int, version: str, *, lost_cleanups: int = 0
    ) -> tuple[str, str]:
        """``publish`` while e1 refuses the load and e0's cleanup of the aborted attempt is lost
        ``lost_cleanups`` times (FAILED_CLEAN without a lost one, BLOCKED with): its output and
        its one error line, after exit 1."""
        self.fleet["e1"].script(EngineOp.LOAD, Fault(FaultKind.REFUSE, "no room"))
        lost = [Fault(FaultKind.UNREACHABLE) for _ in range(lost_cleanups)]
        if lost:
            self.fleet["e0"].script(EngineOp.UNLOAD, *lost)
        code, out, err = await self.cli("publish", self.adapter(seed), "--version-id", version)
        assert code == cli.EXIT_ERROR
        return out, only_line(err)


@asynccontextmanager
async def running_server(root: Path) -> AsyncIterator[Running]:
    (root / "token.txt").write_text(TOKEN)
    with ScriptedFleet() as fleet:
        lora_server_info(fleet)
        routes = OpenAIRoutes(fleet)
        config = scripted_fleet_config(
            root / "agentic-lora.toml",
            fleet,
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
        task = asyncio.ensure_future(serve(options, on_ready=on_ready, stop=stop))
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


def engine_lines(out: str) -> dict[str, str]:
    """The per-engine summary lines of a failed publication, by engine."""
    found = {}
    for line in out.splitlines():
        if line.startswith("  e") and ": " in line and "ready" in line:
            engine, _, rest = line.strip().partition(": ")
            found[engine] = rest
    return found


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
