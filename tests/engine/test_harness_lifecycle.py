"""The harness's own contracts: the engine venv stamp, start-up failures, and process clean-up."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from agentic_lora_harness.engine_env import SGLANG_VERSION
from agentic_lora_harness.engine_env import EngineEnv
from agentic_lora_harness.engine_env import EngineEnvError
from agentic_lora_harness.engine_env import engine_venv_dir
from agentic_lora_harness.engine_env import ensure_engine_env
from agentic_lora_harness.engines import CPU_FLAGS
from agentic_lora_harness.engines import EngineFleet
from agentic_lora_harness.engines import EngineStartError
from agentic_lora_harness.engines import lora_flags
from agentic_lora_harness.fixture import Fixture
from agentic_lora_harness.fixture import FixtureSpec

STAMP = ".agentic-lora-engine-env.json"


def test_venv_lives_under_the_cache_keyed_by_version(tmp_path: Path) -> None:
    assert engine_venv_dir(tmp_path) == tmp_path.resolve() / "venvs" / f"sglang-{SGLANG_VERSION}"


def test_a_failed_step_is_named_and_leaves_no_stamp(tmp_path: Path) -> None:
    with pytest.raises(EngineEnvError, match="could not create the venv"):
        ensure_engine_env(tmp_path, base_python=str(tmp_path / "no-such-python"))
    assert not (engine_venv_dir(tmp_path) / STAMP).exists()


def test_a_venv_with_an_outdated_stamp_is_rebuilt_from_scratch(tmp_path: Path) -> None:
    venv = engine_venv_dir(tmp_path)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "leftover").write_text("from an older install")
    (venv / STAMP).write_text(json.dumps({"format": 1, "requirements": ["sglang==0.0.1"]}))
    log = tmp_path / "install.log"
    with pytest.raises(EngineEnvError, match=r"could not create the venv \(exit 1\)"):
        ensure_engine_env(tmp_path, base_python="/bin/false", log_path=log)
    assert not (venv / "leftover").exists()  # the stale venv was removed before rebuilding
    assert "/bin/false -m venv" in log.read_text()


@pytest.mark.engine
def test_ensure_is_idempotent(engine_env: EngineEnv) -> None:
    stamp = engine_env.venv / STAMP
    before = stamp.stat().st_mtime_ns
    again = ensure_engine_env()
    assert again == engine_env
    assert stamp.stat().st_mtime_ns == before
    assert engine_env.sglang_version == SGLANG_VERSION
    assert engine_env.python.is_file()
    assert engine_env.needs_cpu_shim is not engine_env.cuda_available


@pytest.mark.engine
@pytest.mark.slow
def test_an_engine_that_cannot_start_reports_its_log_and_leaves_nothing(
    engine_env: EngineEnv, model_fixture: Fixture, tmp_path: Path
) -> None:
    fleet = EngineFleet(
        engine_env,
        model_fixture,
        count=1,
        extra_args=("--no-such-flag",),
        log_dir=tmp_path,
        startup_timeout=240,
    )
    with pytest.raises(EngineStartError) as caught:
        fleet.start()
    message = str(caught.value)
    assert "E0 exited with code" in message
    assert "--no-such-flag" in message  # argparse's complaint, quoted from the log tail
    assert fleet.pid("E0") is None
    assert (tmp_path / "E0.log").is_file()


def test_default_flags_are_the_measured_cpu_set() -> None:
    flags = [*CPU_FLAGS, *lora_flags()]
    for flag in (
        "--sleep-on-idle",
        "--disable-cuda-graph",
        "--enable-lora",
        "--enable-cache-report",
    ):
        assert flag in flags
    assert flags[flags.index("--max-total-tokens") + 1] == "32768"
    assert flags[flags.index("--max-loras-per-batch") + 1] == "3"
    modules = flags[flags.index("--lora-target-modules") + 1 :]
    assert modules == ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.engine
def test_fleet_engines_lead_their_own_process_groups(engine_fleet: EngineFleet) -> None:
    for name in engine_fleet.names:
        pid = engine_fleet.pid(name)
        assert pid is not None
        assert os.getpgid(pid) == pid
        memory = engine_fleet.memory(name)
        assert memory.processes >= 3  # server, scheduler, detokenizer
        assert 0 < memory.pss <= memory.rss <= memory.peak_rss


# A stand-in for ``python -m sglang.launch_server``: serves /health on --port, forks a child into
# its process group, and ignores SIGTERM (both of them), so only a group SIGKILL can end it.
_STUBBORN_SERVER = r"""
import http.server, os, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
port = int(sys.argv[sys.argv.index("--port") + 1])
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"])
with open(os.environ["STUB_CHILD_PIDS"], "a") as f:
    f.write(f"{child.pid}\n")
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def stub_fleet(tmp_path: Path) -> Iterator[tuple[EngineFleet, Path]]:
    server = tmp_path / "stub_server.py"
    server.write_text(_STUBBORN_SERVER)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{server}" "$@"\n')
    python.chmod(0o755)
    env = EngineEnv(
        venv=tmp_path,
        python=python,
        sglang_version="stub",
        torch_version="stub",
        cuda_available=True,
        requirements=(),
        install_seconds=0.0,
        size_bytes=0,
    )
    fixture = Fixture(
        root=tmp_path, key="stub", spec=FixtureSpec(), model_dir=tmp_path, adapters_dir=tmp_path
    )
    children = tmp_path / "children"
    fleet = EngineFleet(
        env,
        fixture,
        count=2,
        log_dir=tmp_path / "logs",
        startup_timeout=60,
        stop_grace=0.5,
        extra_env={"STUB_CHILD_PIDS": str(children)},
    )
    try:
        yield fleet, children
    finally:
        fleet.stop()


def test_stop_kills_whole_groups_that_ignore_sigterm(stub_fleet: tuple[EngineFleet, Path]) -> None:
    fleet, children = stub_fleet
    fleet.start()
    leaders = [fleet.pid(name) for name in fleet.names]
    child_pids = [int(line) for line in children.read_text().split()]
    assert len(child_pids) == 2
    assert all(pid is not None and _running(pid) for pid in [*leaders, *child_pids])
    assert {name for name, _ in fleet.engines} == {"E0", "E1"}
    fleet.stop()
    assert [fleet.pid(name) for name in fleet.names] == [None, None]
    assert not any(_running(pid) for pid in [*leaders, *child_pids] if pid is not None)
    fleet.stop()  # idempotent


def test_restart_keeps_the_address_and_replaces_the_group(
    stub_fleet: tuple[EngineFleet, Path],
) -> None:
    fleet, children = stub_fleet
    with fleet:
        url, old_leader = fleet.base_url("E1"), fleet.pid("E1")
        old_children = set(children.read_text().split())
        fleet.restart("E1")
        assert fleet.base_url("E1") == url
        assert fleet.incarnation("E1") == 2
        assert fleet.incarnation("E0") == 1
        assert old_leader is not None
        assert not _running(old_leader)
        new_children = set(children.read_text().split()) - old_children
        assert len(new_children) == 1
        assert fleet.pid("E1") not in (None, old_leader)
        log = fleet.log_path("E1").read_text()
        assert "E1 incarnation 1" in log
        assert "E1 incarnation 2" in log
    assert all(not _running(int(pid)) for pid in children.read_text().split())


def test_unknown_engine_name_is_a_clear_error(stub_fleet: tuple[EngineFleet, Path]) -> None:
    fleet, _ = stub_fleet
    with pytest.raises(KeyError, match="no engine named 'E7'"):
        fleet.restart("E7")


def test_old_run_folders_are_pruned_whole_even_with_subfolders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentic_lora_harness.engines import _new_log_dir

    monkeypatch.setenv("AGENTIC_LORA_CACHE", str(tmp_path))
    root = tmp_path / "engine-logs"
    for i in range(12):
        run = root / f"20260101-0000{i:02d}-1"
        (run / "adapter-store" / "e0").mkdir(parents=True)
        (run / "adapter-store" / "e0" / "adapter_config.json").write_text("{}")
        (run / "E0.log").write_text("log")
    fresh = _new_log_dir()
    assert fresh.is_dir()
    kept = sorted(p.name for p in root.iterdir())
    assert len(kept) == 10  # the nine newest old runs and the new one
    assert "20260101-000000-1" not in kept
