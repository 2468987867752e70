"""The SGLang engine venv: created once per machine, outside the clone, keyed by SGLang version.

Engines run in their own interpreter, as in production, so the test suite reaches them only over
HTTP. The venv lives in ``${AGENTIC_LORA_CACHE:-~/.cache/agentic-lora}/venvs/sglang-<version>``
so every clone and CI run on a machine reuses it. Creation is idempotent: a stamp file is written
(atomically) only after the install and an import check succeeded, and a venv without a valid
stamp is rebuilt from scratch. An exclusive file lock serialises concurrent creators.

``sglang==0.5.23`` pins ``torch==2.14.1``; the only build of that on these machines is the CUDA
one, which pulls the NVIDIA runtime wheels (about 11 GB in all, about 3-4 minutes from the local
mirrors). On a machine without a GPU the harness adds a CPU compatibility shim at engine launch
(see :mod:`agentic_lora_harness.cpu_shim`); whether one is needed is probed here, once, and
recorded in the stamp.

``python -m agentic_lora_harness.engine_env`` (or ``scripts/engine-env.sh``) ensures the venv and
prints what it found as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from agentic_lora_harness.fixture import cache_root

__all__ = [
    "SGLANG_VERSION",
    "EngineEnv",
    "EngineEnvError",
    "engine_venv_dir",
    "ensure_engine_env",
    "main",
]

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
"""The SGLang release the harness runs and pins its behaviour tests against."""

# What gets installed; part of the stamp, so changing it rebuilds the venv.
_REQUIREMENTS: tuple[str, ...] = (f"sglang=={SGLANG_VERSION}",)
_STAMP_FORMAT = 1
_STAMP = ".agentic-lora-engine-env.json"
_PROBE = (
    "import json, sglang, torch; "
    "print(json.dumps({'sglang': sglang.__version__, 'torch': torch.__version__, "
    "'cuda_available': bool(torch.cuda.is_available())}))"
)


class EngineEnvError(RuntimeError):
    """The engine venv could not be created or does not work; the message says which step."""


@dataclass(frozen=True)
class EngineEnv:
    """A ready engine venv: its interpreter and what it runs."""

    venv: Path
    python: Path
    sglang_version: str
    torch_version: str
    cuda_available: bool
    requirements: tuple[str, ...]
    install_seconds: float
    size_bytes: int

    @property
    def needs_cpu_shim(self) -> bool:
        """True when engines must be launched with the CPU compatibility shim."""
        return not self.cuda_available


def engine_venv_dir(cache_dir: Path | None = None, version: str = SGLANG_VERSION) -> Path:
    """Where the venv for SGLang ``version`` lives under the cache root."""
    return cache_root(cache_dir) / "venvs" / f"sglang-{version}"


def ensure_engine_env(
    cache_dir: Path | None = None,
    *,
    base_python: str | None = None,
    log_path: Path | None = None,
) -> EngineEnv:
    """Return the engine venv, creating it first if it is missing or was never finished.

    ``base_python`` is the interpreter the venv is made from (default: ``python3.11`` if on
    ``PATH``, else this interpreter). pip's output goes to ``log_path`` (default: a file beside the
    venv), whose tail is quoted in :class:`EngineEnvError` if a step fails.
    """
    venv = engine_venv_dir(cache_dir)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log_path = log_path or venv.parent / f"{venv.name}.install.log"
    with _exclusive(venv.parent / f".{venv.name}.lock"):
        existing = _read_stamp(venv)
        if existing is not None:
            return existing
        return _create(venv, base_python or _default_base_python(), log_path)


def _default_base_python() -> str:
    return shutil.which("python3.11") or sys.executable


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _read_stamp(venv: Path) -> EngineEnv | None:
    stamp = venv / _STAMP
    try:
        data = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    if data.get("format") != _STAMP_FORMAT or tuple(data.get("requirements", ())) != _REQUIREMENTS:
        return None
    python = venv / "bin" / "python"
    if not python.is_file():
        return None
    return EngineEnv(
        venv=venv,
        python=python,
        sglang_version=str(data["sglang"]),
        torch_version=str(data["torch"]),
        cuda_available=bool(data["cuda_available"]),
        requirements=_REQUIREMENTS,
        install_seconds=float(data["install_seconds"]),
        size_bytes=int(data["size_bytes"]),
    )


def _create(venv: Path, base_python: str, log_path: Path) -> EngineEnv:
    # No valid stamp: whatever is there is a half-finished or outdated install. Start clean.
    if venv.exists():
        logger.info("removing unfinished engine venv", extra={"venv": str(venv)})
        shutil.rmtree(venv)
    started = time.monotonic()
    logger.info("creating engine venv", extra={"venv": str(venv), "requirements": _REQUIREMENTS})
    with log_path.open("w") as log:
        _run([base_python, "-m", "venv", str(venv)], log, log_path, "create the venv")
        python = venv / "bin" / "python"
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        _run([*pip, "install", "--upgrade", "pip"], log, log_path, "upgrade pip")
        _run([*pip, "install", *_REQUIREMENTS], log, log_path, "install " + " ".join(_REQUIREMENTS))
        probe = _run([str(python), "-c", _PROBE], log, log_path, "import sglang and torch")
    found = json.loads(probe.strip().splitlines()[-1])
    if found["sglang"] != SGLANG_VERSION:
        raise EngineEnvError(f"engine venv has sglang {found['sglang']}, expected {SGLANG_VERSION}")
    env = EngineEnv(
        venv=venv,
        python=python,
        sglang_version=found["sglang"],
        torch_version=found["torch"],
        cuda_available=found["cuda_available"],
        requirements=_REQUIREMENTS,
        install_seconds=round(time.monotonic() - started, 1),
        size_bytes=_tree_size(venv),
    )
    _write_stamp(env)
    logger.info(
        "engine venv ready",
        extra={"venv": str(venv), "seconds": env.install_seconds, "bytes": env.size_bytes},
    )
    return env


def _run(cmd: Sequence[str], log: TextIO, log_path: Path, step: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        result = subprocess.run(
            list(cmd),
            capture_output=True,
            text=True,
            env=env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except OSError as exc:
        raise EngineEnvError(f"engine venv: could not {step}: {exc}") from exc
    log.write(f"$ {' '.join(cmd)}\n{result.stdout}{result.stderr}\n")
    log.flush()
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-30:])
        raise EngineEnvError(
            f"engine venv: could not {step} (exit {result.returncode}); full log: {log_path}\n{tail}"
        )
    return result.stdout


def _tree_size(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _write_stamp(env: EngineEnv) -> None:
    data = {
        "format": _STAMP_FORMAT,
        "requirements": list(env.requirements),
        "sglang": env.sglang_version,
        "torch": env.torch_version,
        "cuda_available": env.cuda_available,
        "install_seconds": env.install_seconds,
        "size_bytes": env.size_bytes,
    }
    stamp = env.venv / _STAMP
    partial = stamp.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(partial, stamp)


def main(argv: list[str] | None = None) -> int:
    """Ensure the engine venv and print its description as JSON."""
    parser = argparse.ArgumentParser(prog="python -m agentic_lora_harness.engine_env")
    parser.add_argument("--cache-dir", type=Path, default=None, help="cache root override")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        env = ensure_engine_env(args.cache_dir)
    except EngineEnvError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    out = asdict(env)
    out["needs_cpu_shim"] = env.needs_cpu_shim
    json.dump(out, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
