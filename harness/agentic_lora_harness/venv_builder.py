"""One builder for the engine venvs: created once per machine, outside the clone, keyed by release.

Engines run in their own interpreter, as in production, so the test suite reaches them only over
HTTP. A :class:`VenvRecipe` says what one engine's venv holds (requirements, packages removed
again, an import probe); :func:`ensure_venv` makes it exist under
``${AGENTIC_LORA_CACHE:-~/.cache/agentic-lora}/venvs/<name>``. :mod:`~agentic_lora_harness.engine_env`
(SGLang) and :mod:`~agentic_lora_harness.vllm_env` (vLLM) are two recipes.

Invariants:

* A stamp file is written (atomically, by rename) only after the install, the removals and the
  import probe succeeded; a venv without a stamp that matches the recipe is removed and rebuilt
  from scratch, so an interrupted install is never mistaken for a finished one.
* An exclusive file lock beside the venv serialises concurrent creators (two test sessions, or a
  test session and ``scripts/engine-env.sh``), so one never deletes the venv the other is filling.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from typing import Generic
from typing import Protocol
from typing import TextIO
from typing import TypeVar

from agentic_lora_harness.fixture import cache_root

__all__ = [
    "BuiltVenv",
    "EngineEnvError",
    "EngineVenv",
    "VenvKind",
    "VenvRecipe",
    "ensure_venv",
    "main_for",
    "venv_dir",
]

logger = logging.getLogger(__name__)

_STAMP_FORMAT = 1


class EngineEnvError(RuntimeError):
    """An engine venv could not be created or does not work; the message says which step."""


class EngineVenv(Protocol):
    """What a fleet needs of a ready venv to launch engines from it."""

    @property
    def python(self) -> Path: ...

    @property
    def needs_cpu_shim(self) -> bool: ...


@dataclass(frozen=True)
class VenvRecipe:
    """What one engine's venv holds and how it is checked.

    ``version_key`` names the engine's import module; the import probe records its version,
    ``torch`` and ``cuda_available`` in the stamp. A probe that finds another version than
    ``version``, or any ``remove`` package still importable, fails the build; ``check`` raises
    :class:`EngineEnvError` for whatever else the engine's recipe requires of what was found.
    """

    label: str
    dir_name: str
    requirements: tuple[str, ...]
    version_key: str
    version: str
    remove: tuple[str, ...] = ()
    check: Callable[[Mapping[str, Any]], None] = lambda found: None

    @property
    def stamp_name(self) -> str:
        return f".agentic-lora-{self.label}-env.json"

    @property
    def stamp_keys(self) -> tuple[str, ...]:
        return (self.version_key, "torch", "cuda_available")

    @property
    def probe_step(self) -> str:
        return f"import {self.version_key} and torch"

    @property
    def probe(self) -> str:
        """Python source for the new interpreter; its last output line is what it found (JSON)."""
        key = self.version_key
        return (
            f"import json, importlib.util, torch, {key}; "
            f"print(json.dumps({{{key!r}: {key}.__version__, 'torch': torch.__version__, "
            "'cuda_available': bool(torch.cuda.is_available()), "
            f"'leftover': [m for m in {list(self.remove)!r} if importlib.util.find_spec(m)]}}))"
        )

    def verify(self, found: Mapping[str, Any]) -> None:
        """Raise :class:`EngineEnvError` unless ``found`` (the probe's answer) fits the recipe."""
        if found[self.version_key] != self.version:
            raise EngineEnvError(
                f"{self.label} venv has {self.version_key} {found[self.version_key]}, "
                f"expected {self.version}"
            )
        if found["leftover"]:
            raise EngineEnvError(
                f"{self.label} venv still has {', '.join(found['leftover'])} after removal"
            )
        self.check(found)


@dataclass(frozen=True)
class BuiltVenv:
    """A ready venv as its stamp describes it (each engine's description adds its version)."""

    venv: Path
    python: Path
    torch_version: str
    cuda_available: bool
    requirements: tuple[str, ...]
    install_seconds: float
    size_bytes: int

    @property
    def needs_cpu_shim(self) -> bool:
        """True when engines must be launched with the CPU compatibility shim."""
        return not self.cuda_available


E = TypeVar("E", bound=BuiltVenv)


@dataclass(frozen=True)
class VenvKind(Generic[E]):
    """One engine's venv: its recipe per release and the description a ready venv gets.

    ``describe`` turns the :class:`BuiltVenv` fields and the engine version the venv runs into
    the engine's own description (a :class:`BuiltVenv` subclass naming that version).
    """

    prog: str
    recipe: Callable[[str], VenvRecipe]
    version: str
    describe: Callable[[dict[str, Any], str], E]

    def venv_dir(self, cache_dir: Path | None = None, version: str | None = None) -> Path:
        """Where the venv for the engine's ``version`` (default: the pinned one) lives."""
        return venv_dir(self.recipe(version or self.version), cache_dir)

    def ensure(
        self,
        cache_dir: Path | None = None,
        *,
        base_python: str | None = None,
        log_path: Path | None = None,
    ) -> E:
        """The engine's venv, created first if it is missing or was never finished.

        ``base_python`` and ``log_path`` are as in :func:`ensure_venv`.
        """
        described, version = ensure_venv(
            self.recipe(self.version), cache_dir, base_python=base_python, log_path=log_path
        )
        return self.describe(described, version)

    def main(self, argv: list[str] | None = None) -> int:
        """Ensure the venv and print its description as JSON."""
        return main_for(self.prog, self.ensure, argv)


def venv_dir(recipe: VenvRecipe, cache_dir: Path | None = None) -> Path:
    """Where ``recipe``'s venv lives under the cache root."""
    return cache_root(cache_dir) / "venvs" / recipe.dir_name


def ensure_venv(
    recipe: VenvRecipe,
    cache_dir: Path | None = None,
    *,
    base_python: str | None = None,
    log_path: Path | None = None,
) -> tuple[dict[str, Any], str]:
    """``recipe``'s venv, created first if it is missing or was never finished.

    Returns the :class:`BuiltVenv` fields (as keyword arguments for the engine's description)
    and the engine version the venv runs.

    ``base_python`` is the interpreter the venv is made from (default: ``python3.11`` if on
    ``PATH``, else this interpreter). pip's output goes to ``log_path`` (default: a file beside the
    venv), whose tail is quoted in :class:`EngineEnvError` if a step fails.
    """
    venv = venv_dir(recipe, cache_dir)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log_path = log_path or venv.parent / f"{venv.name}.install.log"
    with _exclusive(venv.parent / f".{venv.name}.lock"):
        stamp = _read_stamp(recipe, venv)
        if stamp is None:
            stamp = _create(recipe, venv, base_python or _default_base_python(), log_path)
    described = {
        "venv": venv,
        "python": venv / "bin" / "python",
        "torch_version": str(stamp["torch"]),
        "cuda_available": bool(stamp["cuda_available"]),
        "requirements": recipe.requirements,
        "install_seconds": float(stamp["install_seconds"]),
        "size_bytes": int(stamp["size_bytes"]),
    }
    return described, str(stamp[recipe.version_key])


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


def _read_stamp(recipe: VenvRecipe, venv: Path) -> Mapping[str, Any] | None:
    try:
        data = json.loads((venv / recipe.stamp_name).read_text())
    except (OSError, ValueError):
        return None
    if (
        data.get("format") != _STAMP_FORMAT
        or tuple(data.get("requirements", ())) != recipe.requirements
        or tuple(data.get("removed", ())) != recipe.remove
        or not all(key in data for key in (*recipe.stamp_keys, "install_seconds", "size_bytes"))
    ):
        return None
    if not (venv / "bin" / "python").is_file():
        return None
    return dict(data)


def _create(recipe: VenvRecipe, venv: Path, base_python: str, log_path: Path) -> Mapping[str, Any]:
    # No valid stamp: whatever is there is a half-finished or outdated install. Start clean.
    if venv.exists():
        logger.info(
            "removing unfinished engine venv", extra={"venv": str(venv), "engine": recipe.label}
        )
        shutil.rmtree(venv)
    started = time.monotonic()
    logger.info(
        "creating engine venv",
        extra={"venv": str(venv), "engine": recipe.label, "requirements": recipe.requirements},
    )
    label = recipe.label

    def run(cmd: Sequence[str], log: TextIO, step: str) -> str:
        return _run(cmd, log, log_path, step, label)

    with log_path.open("w") as log:
        run([base_python, "-m", "venv", str(venv)], log, "create the venv")
        python = venv / "bin" / "python"
        pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
        run([*pip, "install", "--upgrade", "pip"], log, "upgrade pip")
        run(
            [*pip, "install", *recipe.requirements], log, "install " + " ".join(recipe.requirements)
        )
        if recipe.remove:
            run([*pip, "uninstall", "-y", *recipe.remove], log, "remove " + " ".join(recipe.remove))
        probe = run([str(python), "-c", recipe.probe], log, recipe.probe_step)
    found: dict[str, Any] = json.loads(probe.strip().splitlines()[-1])
    recipe.verify(found)
    stamp: dict[str, Any] = {
        "format": _STAMP_FORMAT,
        "requirements": list(recipe.requirements),
        **({"removed": list(recipe.remove)} if recipe.remove else {}),
        **{key: found[key] for key in recipe.stamp_keys},
        "install_seconds": round(time.monotonic() - started, 1),
        "size_bytes": _tree_size(venv),
    }
    _write_stamp(venv / recipe.stamp_name, stamp)
    logger.info(
        "engine venv ready",
        extra={
            "venv": str(venv),
            "engine": recipe.label,
            "seconds": stamp["install_seconds"],
            "bytes": stamp["size_bytes"],
        },
    )
    return stamp


def _run(cmd: Sequence[str], log: TextIO, log_path: Path, step: str, label: str) -> str:
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
        raise EngineEnvError(f"{label} venv: could not {step}: {exc}") from exc
    log.write(f"$ {' '.join(cmd)}\n{result.stdout}{result.stderr}\n")
    log.flush()
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-30:])
        raise EngineEnvError(
            f"{label} venv: could not {step} (exit {result.returncode}); full log: {log_path}\n{tail}"
        )
    return result.stdout


def _tree_size(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _write_stamp(stamp: Path, data: Mapping[str, Any]) -> None:
    partial = stamp.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(partial, stamp)


def main_for(
    prog: str, ensure: Callable[[Path | None], BuiltVenv], argv: list[str] | None = None
) -> int:
    """``python -m <prog>``: ensure a venv with ``ensure`` and print its description as JSON."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}")
    parser.add_argument("--cache-dir", type=Path, default=None, help="cache root override")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        env = ensure(args.cache_dir)
    except EngineEnvError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    out = dataclasses.asdict(env)
    out["needs_cpu_shim"] = env.needs_cpu_shim
    json.dump(out, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    return 0
