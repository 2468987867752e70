"""Launch and stop a fleet of real SGLang engines (E0, E1, ...) on loopback for tests.

Each engine is ``python -m sglang.launch_server`` from the engine venv, in its own process group
(SGLang forks a scheduler and a detokenizer), on a free ``127.0.0.1`` port, with its output in a
log file that is kept after the fleet stops. Start-up waits (bounded) until ``GET /health``
answers 200; a failure quotes the log tail. Stopping always ends the whole group: SIGTERM to the
server, then SIGKILL to whatever of the group is left after a grace period. A finaliser does the
same if the owner forgets, so no engine outlives the test process.

The default flags are the ones measured to work on a 2-core CPU machine (see :data:`CPU_FLAGS`);
on a CPU-only engine venv the CPU compatibility shim is put on the engine's ``PYTHONPATH``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from typing import ClassVar
from typing import Final
from typing import Self

import httpx

from agentic_lora_harness.cpu_shim import SHIM_ENV_FLAG
from agentic_lora_harness.cpu_shim import SITE_DIR
from agentic_lora_harness.fixture import Fixture
from agentic_lora_harness.fixture import cache_root
from agentic_lora_harness.venv_builder import EngineVenv

__all__ = [
    "CPU_FLAGS",
    "EngineFleet",
    "EngineMemory",
    "EngineStartError",
    "lora_flags",
]

logger = logging.getLogger(__name__)

CPU_FLAGS: tuple[str, ...] = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-cuda-graph",
    # Without a cap one engine sizes its KV pool to most of RAM (21 GB for the tiny model).
    "--max-total-tokens", "32768",
    "--enable-cache-report",
    # Without it each idle scheduler spins one core.
    "--sleep-on-idle",
)  # fmt: skip
"""Engine flags for a CPU-only machine (no CUDA graphs, torch-native kernels, bounded memory)."""


def lora_flags(
    *,
    max_loras_per_batch: int = 3,
    max_loaded_loras: int = 3,
    max_lora_rank: int = 8,
    target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
) -> tuple[str, ...]:
    """The LoRA flags: dynamic loading on, slot counts, and a fixed rank and module set."""
    return (
        "--enable-lora",
        "--lora-backend", "torch_native",
        "--max-loras-per-batch", str(max_loras_per_batch),
        "--max-loaded-loras", str(max_loaded_loras),
        "--max-lora-rank", str(max_lora_rank),
        "--lora-target-modules", *target_modules,
    )  # fmt: skip


_POLL_SECONDS = 0.25
_KILL_WAIT_SECONDS = 10.0
_LOG_TAIL_LINES = 40


class EngineStartError(RuntimeError):
    """An engine did not become healthy; the message carries the engine's log tail."""


@dataclass(frozen=True)
class EngineMemory:
    """Memory of one engine's process group, in bytes.

    ``rss`` and ``peak_rss`` add up each process's VmRSS / VmHWM (so pages shared between the
    server, scheduler and detokenizer count more than once: an upper bound); ``pss`` shares them
    out and is the honest current footprint.
    """

    rss: int
    peak_rss: int
    pss: int
    processes: int


@dataclass
class _Engine:
    name: str
    port: int
    log_path: Path
    stop_grace: float
    process: subprocess.Popen[bytes] | None = None
    log_handle: IO[bytes] | None = None
    incarnation: int = 0
    launched_at: float = 0.0
    started_seconds: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class EngineFleet:
    """N SGLang engines named ``E0``, ``E1``, ... serving the fixture model on loopback.

    Use as ``with EngineFleet(...) as fleet`` or ``async with``, or call :meth:`start` /
    :meth:`stop`. ``flags`` replaces the default engine flags (:data:`CPU_FLAGS` plus
    :func:`lora_flags`); ``extra_args`` is appended to them; ``extra_env`` is laid over
    :attr:`base_env`. ``startup_timeout`` bounds the wait for health (default 300 s);
    ``stop_grace`` is how long a stopping engine gets before its group is killed (default 15 s).
    """

    #: The module the engine venv's interpreter runs, and its flag naming the model directory.
    server_module: ClassVar[str] = "sglang.launch_server"
    model_flag: ClassVar[str] = "--model-path"
    #: What ``flags=None``, ``startup_timeout=None`` and ``stop_grace=None`` stand for, and the
    #: environment every engine gets under ``extra_env``.
    default_flags: ClassVar[tuple[str, ...]] = (*CPU_FLAGS, *lora_flags())
    default_startup_timeout: ClassVar[float] = 300.0
    default_stop_grace: ClassVar[float] = 15.0
    base_env: ClassVar[Mapping[str, str]] = {}

    def __init__(
        self,
        env: EngineVenv,
        fixture: Fixture,
        *,
        count: int = 2,
        flags: Sequence[str] | None = None,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        startup_timeout: float | None = None,
        stop_grace: float | None = None,
    ) -> None:
        if count < 1:
            raise ValueError("an engine fleet needs at least one engine")
        self._env = env
        # Read-only (Final): a fleet serves one fixture and logs into one directory for its life.
        self.fixture: Final = fixture
        """The model fixture the engines serve."""
        self._flags = tuple(flags) if flags is not None else self.default_flags
        self._extra_args = tuple(extra_args)
        self._extra_env = {**self.base_env, **(extra_env or {})}
        self.log_dir: Final = log_dir or _new_log_dir()
        """Where each engine's log file ``<name>.log`` is kept."""
        self._startup_timeout = (
            self.default_startup_timeout if startup_timeout is None else startup_timeout
        )
        stop_grace = self.default_stop_grace if stop_grace is None else stop_grace
        self._lock = threading.Lock()
        self._engines: dict[str, _Engine] = {}
        for index in range(count):
            name = f"E{index}"
            self._engines[name] = _Engine(name, 0, self.log_dir / f"{name}.log", stop_grace)
        # Ends every engine group still running when the fleet is collected or the interpreter
        # exits, so an aborted test session leaves no engines behind.
        self._finalizer = weakref.finalize(self, _kill_all, list(self._engines.values()))

    # --- what the fleet serves -----------------------------------------------------------------

    @property
    def engines(self) -> list[tuple[str, str]]:
        """``(name, base_url)`` of every engine, in name order."""
        return [(e.name, e.base_url) for e in self._engines.values()]

    @property
    def names(self) -> list[str]:
        """The engine names, in order."""
        return list(self._engines)

    @property
    def served_model_name(self) -> str:
        """The base model name the engines serve (OpenAI routes: ``"<base>:<lora_name>"``)."""
        return self.fixture.served_model_name

    def base_url(self, name: str) -> str:
        """The ``http://127.0.0.1:<port>`` of engine ``name``."""
        return self._engine(name).base_url

    def log_path(self, name: str) -> Path:
        """The log file of engine ``name`` (appended to across restarts)."""
        return self._engine(name).log_path

    def incarnation(self, name: str) -> int:
        """How many times engine ``name`` was started (1 after the first start)."""
        return self._engine(name).incarnation

    def startup_seconds(self, name: str) -> float | None:
        """Seconds the last start of ``name`` took until healthy, or None if never started."""
        return self._engine(name).started_seconds

    def pid(self, name: str) -> int | None:
        """The server process id (and process group id) of ``name``, if running."""
        process = self._engine(name).process
        return process.pid if process is not None and process.poll() is None else None

    def memory(self, name: str) -> EngineMemory:
        """Current and peak memory of engine ``name``'s process group (see :class:`EngineMemory`)."""
        pid = self.pid(name)
        if pid is None:
            raise RuntimeError(f"engine {name} is not running")
        return _group_memory(pid)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Launch every engine and wait until all are healthy; on failure stop them all."""
        with self._lock:
            try:
                for engine in self._engines.values():
                    self._launch(engine)
                for engine in self._engines.values():
                    self._wait_healthy(engine)
            except BaseException:
                for engine in self._engines.values():
                    _stop_engine(engine)
                raise

    def stop(self) -> None:
        """Stop every engine (SIGTERM, then SIGKILL after a grace period). Idempotent."""
        with self._lock:
            for engine in self._engines.values():
                _signal_server(engine, signal.SIGTERM)
            for engine in self._engines.values():
                _stop_engine(engine)

    def restart(self, name: str) -> None:
        """Stop engine ``name`` and start it again on the same port; it loses every adapter."""
        with self._lock:
            engine = self._engine(name)
            _stop_engine(engine)
            try:
                self._launch(engine)
                self._wait_healthy(engine)
            except BaseException:
                _stop_engine(engine)
                raise

    def kill(self, name: str) -> None:
        """SIGKILL engine ``name``'s whole process group at once (a crash, not a shutdown)."""
        with self._lock:
            engine = self._engine(name)
            if engine.process is not None:
                _killpg(engine.process.pid, signal.SIGKILL)
            _stop_engine(engine)

    async def arestart(self, name: str) -> None:
        """:meth:`restart` without blocking the event loop."""
        await asyncio.to_thread(self.restart, name)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    # --- internals -----------------------------------------------------------------------------

    def _engine(self, name: str) -> _Engine:
        try:
            return self._engines[name]
        except KeyError:
            raise KeyError(f"no engine named {name!r}; fleet has {self.names}") from None

    def _command(self, engine: _Engine) -> list[str]:
        return [
            str(self._env.python),
            "-m",
            self.server_module,
            self.model_flag,
            str(self.fixture.model_dir),
            "--served-model-name",
            self.fixture.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(engine.port),
            *self._flags,
            *self._extra_args,
        ]

    def _environment(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", SHIM_ENV_FLAG)
        }
        env["OMP_NUM_THREADS"] = "1"
        # No hub: a missing adapter path must fail, never turn into a download attempt.
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
        if self._env.needs_cpu_shim:
            env["PYTHONPATH"] = str(SITE_DIR)
            env[SHIM_ENV_FLAG] = "1"
        env.update(self._extra_env)
        return env

    def _launch(self, engine: _Engine) -> None:
        if engine.process is not None and engine.process.poll() is None:
            raise RuntimeError(f"engine {engine.name} is already running")
        if engine.port == 0:
            engine.port = _free_port()
        engine.log_path.parent.mkdir(parents=True, exist_ok=True)
        engine.log_handle = engine.log_path.open("ab")
        engine.incarnation += 1
        command = self._command(engine)
        header = f"\n=== {engine.name} incarnation {engine.incarnation}: {' '.join(command)}\n"
        engine.log_handle.write(header.encode())
        engine.log_handle.flush()
        engine.started_seconds = None
        engine.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=engine.log_handle,
            stderr=subprocess.STDOUT,
            env=self._environment(),
            start_new_session=True,
        )
        engine.launched_at = time.monotonic()
        logger.info(
            "engine launched",
            extra={"engine": engine.name, "pid": engine.process.pid, "port": engine.port},
        )

    def _wait_healthy(self, engine: _Engine) -> None:
        assert engine.process is not None
        started = engine.launched_at
        deadline = started + self._startup_timeout
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = engine.process.poll()
                if code is not None:
                    raise EngineStartError(
                        f"engine {engine.name} exited with code {code} before it was healthy;"
                        f" log {engine.log_path}:\n{_log_tail(engine.log_path)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{engine.base_url}/health").status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise EngineStartError(
                        f"engine {engine.name} not healthy after {self._startup_timeout:.0f} s;"
                        f" log {engine.log_path}:\n{_log_tail(engine.log_path)}"
                    )
                time.sleep(_POLL_SECONDS)
        engine.started_seconds = round(time.monotonic() - started, 1)
        logger.info(
            "engine healthy",
            extra={"engine": engine.name, "seconds": engine.started_seconds},
        )


def _new_log_dir() -> Path:
    root = cache_root() / "engine-logs"
    root.mkdir(parents=True, exist_ok=True)
    runs = sorted(p for p in root.iterdir() if p.is_dir())
    for old in runs[:-9]:  # keep the last few runs' logs for post-mortems, not all of them
        # Whole trees: callers keep more than logs in a run's folder (e.g. an adapter store).
        shutil.rmtree(old, ignore_errors=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = root / f"{stamp}-{os.getpid()}"
    path.mkdir(exist_ok=True)
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(log unreadable: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in group ``pgid``.

    ``killpg(pgid, 0)`` is not enough: it also succeeds for zombies nobody has reaped yet, and a
    process that was just sent SIGKILL stays visible, not yet a zombie, until it is scheduled.
    """
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # /proc/<pid>/stat: "pid (comm) state ppid pgrp ..."; comm may contain spaces.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _group_alive(pgid: int) -> bool:
    return bool(_group_members(pgid))


def _signal_server(engine: _Engine, sig: signal.Signals) -> None:
    process = engine.process
    if process is not None and process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)


def _stop_engine(engine: _Engine) -> None:
    """End ``engine``'s whole process group and reap the server; safe to call repeatedly."""
    process = engine.process
    if process is not None:
        pgid = process.pid
        # SIGTERM to the server lets it shut its children down; signalling the whole group at once
        # makes SGLang treat it as a crash and sit in crash diagnostics first.
        _signal_server(engine, signal.SIGTERM)
        deadline = time.monotonic() + engine.stop_grace
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=engine.stop_grace)
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
        if process.poll() is None or _group_alive(pgid):
            logger.warning(
                "engine ignored SIGTERM; killing its group", extra={"engine": engine.name}
            )
            _killpg(pgid, signal.SIGKILL)
            process.wait()
            # SIGKILL is delivered asynchronously: wait (bounded) until every member is gone.
            deadline = time.monotonic() + _KILL_WAIT_SECONDS
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(_POLL_SECONDS)
        engine.process = None
        logger.info("engine stopped", extra={"engine": engine.name})
    if engine.log_handle is not None:
        engine.log_handle.close()
        engine.log_handle = None


def _kill_all(engines: list[_Engine]) -> None:
    for engine in engines:
        if engine.process is not None:
            _killpg(engine.process.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                engine.process.wait(timeout=30)
        if engine.log_handle is not None:
            engine.log_handle.close()


def _group_memory(pgid: int) -> EngineMemory:
    rss = peak = pss = count = 0
    for pid in _group_members(pgid):
        try:
            status = _proc_fields(Path(f"/proc/{pid}/status"))
            rollup = _proc_fields(Path(f"/proc/{pid}/smaps_rollup"))
        except OSError:
            continue
        count += 1
        rss += status.get("VmRSS", 0)
        peak += status.get("VmHWM", 0)
        pss += rollup.get("Pss", 0)
    return EngineMemory(rss=rss, peak_rss=peak, pss=pss, processes=count)


def _proc_fields(path: Path) -> dict[str, int]:
    """``Key:   123 kB`` lines of a /proc file, in bytes."""
    fields: dict[str, int] = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            fields[key] = int(parts[0]) * 1024
    return fields
