"""Durable renames: every path given is flushed, together, and a failure is not swallowed."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from agentic_lora.foundation import fsync as fsync_module
from agentic_lora.foundation.fsync import fsync_paths


def _record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Path], set[str]]:
    """Record the path behind every fd handed to os.fsync, and the thread that flushed it."""
    flushed: list[Path] = []
    threads: set[str] = set()
    real = os.fsync
    lock = threading.Lock()

    def recording(fd: int) -> None:
        real(fd)
        with lock:
            flushed.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
            threads.add(threading.current_thread().name)

    monkeypatch.setattr(fsync_module.os, "fsync", recording)
    return flushed, threads


def test_every_path_is_flushed_each_on_a_thread_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = [tmp_path / name for name in ("a", "b", "c")]
    for f in files:
        f.write_bytes(b"x")
    flushed, threads = _record_fsyncs(monkeypatch)
    fsync_paths([*files, tmp_path])
    assert sorted(flushed) == sorted([*files, tmp_path])
    assert all(name.startswith("fsync") for name in threads)


def test_one_path_is_flushed_on_the_caller_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").write_bytes(b"x")
    flushed, threads = _record_fsyncs(monkeypatch)
    fsync_paths([tmp_path / "a"])
    assert flushed == [tmp_path / "a"]
    assert threads == {threading.current_thread().name}


def test_a_failure_is_raised_after_the_others_were_flushed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    present = tmp_path / "present"
    present.write_bytes(b"x")
    flushed, _ = _record_fsyncs(monkeypatch)
    with pytest.raises(FileNotFoundError):
        fsync_paths([tmp_path / "missing", present, tmp_path])
    assert sorted(flushed) == sorted([present, tmp_path])
