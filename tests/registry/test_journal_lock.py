"""One writer per journal, and a journal whose creation crashed is never refused forever."""

from __future__ import annotations

import fcntl
import gc
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from agentic_lora.errors import JournalCorruptError
from agentic_lora.errors import JournalError
from agentic_lora.errors import JournalLockedError
from agentic_lora.registry import journal as journal_module
from agentic_lora.registry.journal import Journal
from agentic_lora.registry.journal import JournalEntry
from agentic_lora.registry.local import LocalRegistry

from .util import E0
from .util import E1

REPO = Path(__file__).resolve().parents[2]
IDENTITY = {"x": 1}

# Opens the journal and holds it until killed; with "fork", first forks a child that outlives it.
HOLDER = """
import os, sys
from agentic_lora.registry.journal import Journal

journal = Journal(sys.argv[1], identity={"x": 1})
journal.open()
child = 0
if sys.argv[2] == "fork":
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.read(r, 1)  # never returns: this process holds the write end too
        os._exit(0)
print(child, flush=True)
sys.stdin.read()
"""

# Tries to open the journal and prints what happened as JSON.
CONTENDER = """
import json, sys
from agentic_lora.errors import JournalLockedError
from agentic_lora.registry.journal import Journal

journal = Journal(sys.argv[1], identity={"x": 1})
try:
    journal.open()
except JournalLockedError as exc:
    print(json.dumps({"code": exc.code, "message": exc.message, "details": exc.details}))
else:
    journal.close()
    print(json.dumps({"code": "OPENED"}))
"""

# For every side-effecting builtin call that Journal.open() makes on a new journal (found by a
# first, complete run), a forked child runs open() and dies by os._exit() right before that call:
# exactly the files a crash there leaves (the page cache survives, as in a process crash).
CRASH_SWEEP = """
import json, os, sys
from pathlib import Path
from agentic_lora.registry.journal import Journal

EFFECTS = {
    "connect", "execute", "executemany", "close", "fsync", "replace", "unlink", "open",
    "flock", "ftruncate", "pwrite", "mkdir", "rename", "write",
}
root = Path(sys.argv[1])

def child(directory, crash_at):
    calls = []
    def hook(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", None) in EFFECTS:
            if len(calls) == crash_at:
                os._exit(17)
            calls.append(arg.__name__)
    sys.setprofile(hook)
    Journal(directory / "j.sqlite", identity={"x": 1}).open()
    sys.setprofile(None)
    (root / "steps.json").write_text(json.dumps(calls))
    os._exit(0)

def run(directory, crash_at):
    directory.mkdir()
    pid = os.fork()
    if pid == 0:
        child(directory, crash_at)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

assert run(root / "complete", -1) == 0
steps = json.loads((root / "steps.json").read_text())
codes = [run(root / f"crash-{k}", k) for k in range(len(steps))]
print(json.dumps({"steps": steps, "codes": codes}))
"""


def _python(script: str, *args: str, timeout: float = 120) -> str:
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _contend(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(_python(CONTENDER, str(path)))
    return result


def _start_holder(path: Path, mode: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), mode],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # printed once the journal is open (and locked)
    if not line:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"holder did not start: {err}")
    return proc, int(line)


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.kill()  # SIGKILL: no close(), no atexit
    proc.wait()  # not communicate(): a forked child still holds the pipes open
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if ".creating" in p.name)


# --- the lock ----------------------------------------------------------------------------------


def test_a_second_open_in_this_process_is_refused_and_names_the_holder(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    first = Journal(path, identity=IDENTITY)
    first.open()
    second = Journal(path, identity=IDENTITY)
    with pytest.raises(JournalLockedError) as err:
        second.open()
    assert err.value.code == "JOURNAL_LOCKED"
    holder = err.value.details["holder"]
    assert holder["pid"] == os.getpid()
    assert holder["hostname"] == socket.gethostname()
    datetime.fromisoformat(holder["since"])
    assert f"pid {os.getpid()} on {socket.gethostname()}" in err.value.message
    assert "(this process" in err.value.message
    assert err.value.details["lock_path"] == str(first.lock_path)
    with pytest.raises(RuntimeError, match="not open"):
        second.append([])  # the refused opener holds nothing
    first.close()
    assert second.open().entries == []
    second.close()


@pytest.mark.asyncio
async def test_a_second_registry_on_the_same_journal_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    reg = LocalRegistry(engines=(E0, E1), capacity=2, journal_path=path)
    assert reg.failed is None
    assert not reg.closed
    with pytest.raises(JournalLockedError):
        LocalRegistry(engines=(E0, E1), capacity=2, journal_path=path)
    await reg.aclose()
    assert reg.closed
    again = LocalRegistry(engines=(E0, E1), capacity=2, journal_path=path)
    await again.aclose()


def test_the_lock_is_taken_before_anything_is_created(tmp_path: Path) -> None:
    # Another creator holds the lock and is half-way: it has not written its name yet and has
    # only its temporary file. The opener must touch nothing.
    path = tmp_path / "j.sqlite"
    j = Journal(path, identity=IDENTITY)
    fd = os.open(j.lock_path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        j.creating_path.write_bytes(b"the other creator's work in progress")
        with pytest.raises(JournalLockedError, match="not written its name") as err:
            j.open()
        assert err.value.details["holder"] is None
        assert not path.exists()
        assert j.creating_path.read_bytes() == b"the other creator's work in progress"
    finally:
        os.close(fd)
    j.open()  # the other creator died: its temporary file goes, the journal is created
    assert _leftovers(path) == []
    j.close()


def test_close_and_garbage_collection_release_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    j = Journal(path, identity=IDENTITY)
    j.open()
    j.close()
    j.close()
    assert j.lock_path.read_text() == ""  # nobody holds it
    dropped = Journal(path, identity=IDENTITY)
    dropped.open()
    del dropped
    gc.collect()
    again = Journal(path, identity=IDENTITY)
    again.open()
    with pytest.raises(RuntimeError, match="already open"):
        again.open()
    again.close()


def test_another_process_is_refused_until_the_holder_is_killed(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    holder, _ = _start_holder(path, "plain")
    try:
        seen = _contend(path)
        assert seen["code"] == "JOURNAL_LOCKED"
        assert seen["details"]["holder"]["pid"] == holder.pid
        assert seen["details"]["holder"]["hostname"] == socket.gethostname()
        assert f"pid {holder.pid}" in seen["message"]
        with pytest.raises(JournalLockedError) as err:
            Journal(path, identity=IDENTITY).open()
        assert err.value.details["holder"]["pid"] == holder.pid
    finally:
        _kill(holder)
    assert _contend(path) == {"code": "OPENED"}
    j = Journal(path, identity=IDENTITY)
    assert j.open().entries == []
    j.close()


def test_a_forked_child_does_not_keep_a_killed_holders_lock(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    holder, child = _start_holder(path, "fork")
    try:
        _kill(holder)
        os.kill(child, 0)  # alive: it shares the killed holder's open file description
        assert _contend(path) == {"code": "OPENED"}
        os.kill(child, 0)  # still alive, so it was not its death that freed the lock
    finally:
        os.kill(child, signal.SIGKILL)


# --- atomic creation ---------------------------------------------------------------------------


def _assert_new_and_ours(path: Path) -> None:
    j = Journal(path, identity=IDENTITY)
    recovered = j.open()
    assert recovered.snapshot is None
    assert recovered.entries == []
    j.append([JournalEntry(1, "r", "bind_first", "{}")])
    j.close()
    assert _leftovers(path) == []
    again = Journal(path, identity=IDENTITY)
    assert [e.seq for e in again.open().entries] == [1]
    again.close()


def test_a_crash_at_any_step_of_creation_never_leaves_a_refused_journal(tmp_path: Path) -> None:
    sweep = json.loads(_python(CRASH_SWEEP, str(tmp_path), timeout=300))
    steps: list[str] = sweep["steps"]
    assert {"connect", "execute", "fsync", "replace", "flock"} <= set(steps)
    assert sweep["codes"] == [17] * len(steps)  # each child died where it was told to
    before_rename = after_rename = 0
    for k, step in enumerate(steps):
        path = tmp_path / f"crash-{k}" / "j.sqlite"
        if path.exists() and path.stat().st_size > 0:
            after_rename += 1
        elif _leftovers(path):
            before_rename += 1
        try:
            _assert_new_and_ours(path)
        except JournalError as exc:  # pragma: no cover - the failure this test is for
            pytest.fail(f"crash before step {k} ({step}) left a journal refused with {exc}")
    assert before_rename > 0
    assert after_rename > 0


@pytest.mark.parametrize("step", ["fsync temporary file", "replace", "fsync directory"])
def test_a_failed_creation_step_raises_and_the_next_open_creates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    path = tmp_path / "j.sqlite"
    fsyncs: list[Path] = []
    real_fsync, real_replace = journal_module.fsync_path, os.replace

    def fsync(target: Path) -> None:
        fsyncs.append(target)
        if (step == "fsync temporary file" and target.name.endswith(".creating")) or (
            step == "fsync directory" and target == tmp_path
        ):
            raise OSError(5, "Input/output error")
        real_fsync(target)

    def replace(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal_module, "fsync_path", fsync)
    if step == "replace":
        monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(JournalError) as err:
        Journal(path, identity=IDENTITY).open()
    assert type(err.value) is JournalError  # neither corrupt nor foreign: nothing to repair
    monkeypatch.setattr(journal_module, "fsync_path", real_fsync)
    monkeypatch.setattr(os, "replace", real_replace)
    _assert_new_and_ours(path)  # the lock was released and the leftovers are cleaned up


@pytest.mark.parametrize("existing", [False, True])
def test_leftover_temporary_files_are_removed(tmp_path: Path, existing: bool) -> None:
    path = tmp_path / "j.sqlite"
    if existing:
        j = Journal(path, identity=IDENTITY)
        j.open()
        j.append([JournalEntry(1, "r", "bind_first", "{}")])
        j.close()
    creating = Journal(path, identity=IDENTITY).creating_path
    for suffix in ("", "-journal", "-wal", "-shm"):
        Path(f"{creating}{suffix}").write_bytes(b"half-written")
    j = Journal(path, identity=IDENTITY)
    assert len(j.open().entries) == (1 if existing else 0)
    j.close()
    assert _leftovers(path) == []


def test_a_zero_length_journal_file_is_new(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    path.touch()
    Path(f"{path}-shm").write_bytes(b"stale")
    _assert_new_and_ours(path)


def test_an_empty_journal_with_a_non_empty_wal_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    path.touch()
    wal = Path(f"{path}-wal")
    wal.write_bytes(b"frames that may hold committed rows")
    with pytest.raises(JournalCorruptError, match="write-ahead log"):
        Journal(path, identity=IDENTITY).open()
    assert wal.read_bytes() == b"frames that may hold committed rows"  # never discarded
    assert path.stat().st_size == 0
    with pytest.raises(JournalCorruptError):  # not JOURNAL_LOCKED: the refusal released it
        Journal(path, identity=IDENTITY).open()


def test_the_created_journal_is_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    j = Journal(path, identity=IDENTITY)
    j.open()
    j.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
