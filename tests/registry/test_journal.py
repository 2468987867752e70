"""Durability: a restarted registry loses nothing; a bad journal stops start-up with a typed error."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from agentic_lora.errors import CapacityError
from agentic_lora.errors import JournalCorruptError
from agentic_lora.errors import JournalError
from agentic_lora.errors import JournalForeignError
from agentic_lora.registry.journal import Journal
from agentic_lora.registry.journal import JournalEntry
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import SessionState
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import new_request_id
from agentic_lora.testing.publish import publish_by_verbs

from .util import E0
from .util import E1
from .util import digest_of

pytestmark = pytest.mark.asyncio


@pytest.fixture
def path(tmp_path: Path) -> Path:
    """Where the test's journal lives (not created: the registry or the test makes it)."""
    return tmp_path / "registry.sqlite"


def _registry(path: Path, **kw: object) -> LocalRegistry:
    return LocalRegistry(engines=(E0, E1), capacity=2, journal_path=path, **kw)  # type: ignore[arg-type]


async def _publish(reg: LocalRegistry, version_id: str) -> None:
    await publish_by_verbs(reg, version_id, (E0, E1))


async def _scenario(reg: LocalRegistry) -> None:
    await _publish(reg, "A")
    await reg.bind_first(request_id="bind-old", session_key="s_old")
    await _publish(reg, "B")
    await reg.bind_first(request_id="bind-new", session_key="s_new")
    await reg.begin_close(request_id="close-new", session_key="s_new")
    await reg.release(request_id="rel-new", session_key="s_new")
    await reg.begin_close(request_id=new_request_id(), session_key="early")
    await reg.observe_incarnation(request_id=new_request_id(), engine=E1, incarnation="inc-2")


@pytest.mark.parametrize("group_commit", [False, True])
async def test_restart_loses_no_version_default_binding_tombstone_or_slot(
    path: Path, group_commit: bool
) -> None:
    reg = _registry(path, group_commit=group_commit)
    await _scenario(reg)
    before = await reg.status()
    sessions = {k: reg.core.session(k) for k in ("s_old", "s_new", "early")}
    await reg.aclose()

    again = _registry(path, group_commit=group_commit)
    assert await again.status() == before
    assert {k: again.core.session(k) for k in sessions} == sessions
    assert again.core.session("s_new").state is SessionState.CLOSED  # type: ignore[union-attr]
    # Lost replies from before the restart are answered from the journal, not run again.
    b = await again.bind_first(request_id="bind-old", session_key="s_old")
    assert b.version_id == "A"
    assert again.core.version("A").session_refs == 1
    r = await again.release(request_id="rel-new", session_key="s_new")
    assert r.released_now  # the original answer
    with pytest.raises(CapacityError):
        await again.reserve(request_id=new_request_id(), version_id="C", digest=digest_of("C"))
    await again.aclose()


async def test_concurrent_calls_with_group_commit_are_all_durable(path: Path) -> None:
    reg = _registry(path, group_commit=True)
    await _publish(reg, "A")
    bindings = await asyncio.gather(
        *(reg.bind_first(request_id=f"b{i}", session_key=f"s{i}") for i in range(200))
    )
    assert {b.version_id for b in bindings} == {"A"}
    await reg.aclose()
    again = _registry(path, group_commit=True)
    assert again.core.version("A").session_refs == 200
    await again.aclose()


async def test_compaction_keeps_state_and_idempotency(path: Path) -> None:
    reg = _registry(path, compact_every=7)
    await _scenario(reg)
    for i in range(30):
        await reg.bind_first(request_id=f"x{i}", session_key=f"x{i}")
    before = await reg.status()
    await reg.aclose()
    with sqlite3.connect(path) as conn:
        snapshots = conn.execute("SELECT COUNT(*) FROM snapshots").fetchone()[0]
        events = conn.execute("SELECT COUNT(*) FROM events").fetchone()[0]
    conn.close()
    assert snapshots == 1
    assert events < 7
    again = _registry(path, compact_every=7)
    assert await again.status() == before
    replay = await again.bind_first(request_id="x3", session_key="x3")
    assert replay.version_id == "B"
    assert again.core.version("B").session_refs == 30  # x3's replay took no second ref
    await again.aclose()


async def test_a_file_that_is_not_a_database_stops_start_up(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite"
    path.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(JournalCorruptError) as err:
        _registry(path)
    assert err.value.code == "JOURNAL_CORRUPT"
    assert path.read_bytes().startswith(b"this is not sqlite")  # never silently reset


async def test_a_foreign_sqlite_file_stops_start_up(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE things (x)")
    conn.close()
    with pytest.raises(JournalForeignError):
        _registry(path)


async def test_a_journal_of_another_fleet_stops_start_up(path: Path) -> None:
    reg = _registry(path)
    await _publish(reg, "A")
    await reg.aclose()
    with pytest.raises(JournalForeignError) as err:
        LocalRegistry(engines=(E0, E1, "e2"), capacity=2, journal_path=path)
    assert "another deployment" in err.value.message
    with pytest.raises(JournalForeignError):
        LocalRegistry(engines=(E0, E1), capacity=2, deployment_epoch=1, journal_path=path)


async def test_another_journal_format_stops_start_up(path: Path) -> None:
    await _registry(path).aclose()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value='99' WHERE key='format'")
    conn.close()
    with pytest.raises(JournalForeignError, match="format"):
        _registry(path)


@pytest.mark.parametrize(
    ("damage", "options", "match"),
    [
        pytest.param(
            "UPDATE events SET args = replace(args, 's_old', 's_odd') WHERE verb='bind_first'",
            {},
            "checksum",
            id="tampered-row",
        ),
        pytest.param("DELETE FROM events WHERE seq = 3", {}, "skips", id="missing-row"),
        pytest.param(
            "UPDATE snapshots SET state = '{not json'",
            {"compact_every": 3},
            "snapshot",
            id="broken-snapshot",
        ),
    ],
)
async def test_a_damaged_journal_stops_start_up(
    path: Path, damage: str, options: dict[str, object], match: str
) -> None:
    reg = _registry(path, **options)
    await _scenario(reg)
    await reg.aclose()
    with sqlite3.connect(path) as conn:
        conn.execute(damage)
    conn.close()
    with pytest.raises(JournalCorruptError, match=match):
        _registry(path, **options)


async def test_a_write_failure_stops_the_registry(path: Path) -> None:
    reg = _registry(path)
    await _publish(reg, "A")
    assert reg._journal is not None
    reg._journal.close()  # the disk goes away under the registry
    assert reg.failed is None
    with pytest.raises(JournalError):
        await reg.bind_first(request_id=new_request_id(), session_key="s")
    assert isinstance(reg.failed, RuntimeError)  # "journal is not open"
    assert not reg.closed
    with pytest.raises(JournalError, match="stopped"):
        await reg.bind_first(request_id=new_request_id(), session_key="t")
    await reg.aclose()
    assert reg.closed
    # What reached the disk is intact and replays.
    again = _registry(path)
    assert again.core.version("A").state is VersionState.PUBLISHED
    await again.aclose()


async def test_listeners_see_applied_changes_only(path: Path) -> None:
    reg = LocalRegistry(engines=(E0, E1), capacity=2)
    seen: list[str] = []
    reg.add_listener(lambda verb, result: seen.append(verb))

    def broken(verb: str, result: object) -> None:
        raise RuntimeError("listener bug")

    reg.add_listener(broken)
    await _publish(reg, "A")
    await reg.bind_first(request_id="b", session_key="s")
    await reg.bind_first(request_id="b", session_key="s")  # a replay: nothing applied
    assert seen == ["reserve", "record_ready", "record_ready", "commit", "bind_first"]
    await reg.aclose()
    with pytest.raises(JournalError, match="closed"):
        await reg.bind_first(request_id="c", session_key="t")


def _append_raw(path: Path, seq: int, request_id: str, verb: str, args: str) -> None:
    from agentic_lora.registry.journal import _checksum

    with sqlite3.connect(path) as conn:
        conn.execute(
            "INSERT INTO events VALUES (?, ?, ?, ?, ?)",
            (seq, request_id, verb, args, _checksum(seq, request_id, verb, args)),
        )
    conn.close()


@pytest.mark.parametrize(
    ("verb", "args", "match"),
    [
        (
            "commit",
            '{"version_id":"nope","attempt":1,"expected_default_revision":0}',
            "UNKNOWN_VERSION",
        ),
        ("reserve", "{}", "does not replay"),
        ("bind_first", '{"session_key":"s_old"}', "same sequence"),  # a duplicate request id
    ],
)
async def test_a_well_formed_row_that_does_not_replay_stops_start_up(
    path: Path, verb: str, args: str, match: str
) -> None:
    reg = _registry(path)
    await _scenario(reg)
    seq = reg.core.seq
    await reg.aclose()
    _append_raw(path, seq + 1, "bind-old" if verb == "bind_first" else "x", verb, args)
    with pytest.raises(JournalCorruptError, match=match):
        _registry(path)


async def test_a_failed_append_rolls_back_and_leaves_the_journal_usable(path: Path) -> None:
    j = Journal(path, identity={"x": 1})
    assert j.open().entries == []
    j.append([JournalEntry(1, "a", "bind_first", "{}")])
    with pytest.raises(sqlite3.IntegrityError):
        j.append(
            [JournalEntry(2, "b", "bind_first", "{}"), JournalEntry(1, "c", "bind_first", "{}")]
        )
    with pytest.raises(TypeError):
        j.write_snapshot(5, {"seq": object()})
    j.append([JournalEntry(2, "b", "bind_first", "{}")])
    j.close()
    with pytest.raises(RuntimeError, match="not open"):
        j.append([])
    again = Journal(path, identity={"x": 1})
    assert [e.seq for e in again.open().entries] == [1, 2]
    again.close()


# --- answers only from durable rows; aclose never misreports ------------------------------------


class _Gate:
    """Holds the journal writer thread inside ``Journal.append`` until :meth:`open` is called."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.released = threading.Event()
        self.fail: BaseException | None = None
        original = Journal.append
        gate = self

        def append(journal: Journal, entries: Iterable[JournalEntry]) -> None:
            if gate.armed:
                gate.entered.set()
                gate.released.wait()
                if gate.fail is not None:
                    raise gate.fail
            original(journal, entries)

        monkeypatch.setattr(Journal, "append", append)

    def arm(self) -> None:
        self.armed = True

    async def writing(self) -> None:
        """Return once the writer thread is held inside an append."""
        assert await asyncio.to_thread(self.entered.wait, 30), "the writer never reached append"

    def open(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.released.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Gate]:
    g = _Gate(monkeypatch)
    yield g
    g.released.set()  # never leave the writer thread parked (aclose would wait for it)


async def _spin() -> None:
    """Let every ready task on the loop run several times (no wall clock involved)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def _assert_truthful(
    reg: LocalRegistry, path: Path, calls: Mapping[str, asyncio.Task[Any]]
) -> None:
    """Close ``reg`` and reopen its journal: each ``bind_first`` that answered is durable, each
    that raised JournalError is not (reopening also proves the close released the lock)."""
    await reg.aclose()  # idempotent: a test of the close itself has already closed it
    again = _registry(path)
    try:
        for session_key, task in calls.items():
            durable = again.core.session(session_key) is not None
            if task.exception() is None:
                assert durable, f"{session_key} was answered but is not in the journal"
            else:
                assert isinstance(task.exception(), JournalError)
                assert not durable, f"{session_key} was reported failed but is in the journal"
    finally:
        await again.aclose()


def _bind(reg: LocalRegistry, key: str, request_id: str | None = None) -> asyncio.Task[Any]:
    return asyncio.create_task(reg.bind_first(request_id=request_id or key, session_key=key))


async def _writing_s1(
    path: Path, gate: _Gate, **kw: object
) -> tuple[LocalRegistry, dict[str, asyncio.Task[Any]]]:
    """A journaled registry with A published whose writer is held in the middle of s1's bind."""
    reg = _registry(path, **kw)
    await _publish(reg, "A")
    gate.arm()
    calls = {"s1": _bind(reg, "s1")}
    await gate.writing()
    return reg, calls


@pytest.mark.parametrize("group_commit", [False, True])
@pytest.mark.parametrize("original_row", ["being written", "queued"])
async def test_a_replay_is_answered_only_once_the_original_row_is_durable(
    path: Path, gate: _Gate, group_commit: bool, original_row: str
) -> None:
    reg = _registry(path, group_commit=group_commit)
    await _publish(reg, "A")
    gate.arm()
    calls = {}
    if original_row == "queued":
        calls["other"] = _bind(reg, "other")
        await gate.writing()  # the writer is busy with another row; the original queues behind
    calls["s"] = original = _bind(reg, "s", "b")
    if original_row == "being written":
        await gate.writing()
    await _spin()
    replay = _bind(reg, "s", "b")
    await _spin()
    assert not original.done()
    assert not replay.done(), "a replay was answered before its original row was durable"
    gate.open()
    await asyncio.wait([*calls.values(), replay])
    assert replay.result() == original.result()
    assert reg.core.version("A").session_refs == len(calls)  # the replay took no second ref
    await _assert_truthful(reg, path, calls)


async def test_a_replay_raises_when_the_original_row_is_never_written(
    path: Path, gate: _Gate
) -> None:
    reg = _registry(path)
    await _publish(reg, "A")
    gate.arm()
    original = _bind(reg, "s", "b")
    await gate.writing()
    replay = _bind(reg, "s", "b")
    await _spin()
    assert not replay.done()
    disk_full = OSError(28, "No space left on device")
    gate.open(fail=disk_full)
    await asyncio.wait([original, replay])
    assert isinstance(original.exception(), JournalError)
    assert isinstance(replay.exception(), JournalError)
    assert reg.failed is disk_full
    with pytest.raises(JournalError, match="stopped"):
        await reg.bind_first(request_id="b", session_key="s")  # a later replay too
    await _assert_truthful(reg, path, {"s": original})


@pytest.mark.parametrize("group_commit", [False, True])
async def test_a_call_racing_aclose_is_told_the_truth(
    path: Path, gate: _Gate, group_commit: bool
) -> None:
    # Formerly: aclose() flushed, then cancelled the writer while it wrote a row that arrived
    # during the flush; that row reached the disk and its caller got JournalError.
    reg, calls = await _writing_s1(path, gate, group_commit=group_commit)
    calls["s2"] = _bind(reg, "s2")  # queued behind s1
    await _spin()
    closing = asyncio.create_task(reg.aclose())
    await _spin()
    calls["s3"] = _bind(reg, "s3")  # during the close
    await _spin()
    assert not closing.done()
    assert not calls["s1"].done()
    gate.open()
    await asyncio.wait([*calls.values(), closing])
    assert calls["s1"].exception() is None
    assert calls["s2"].exception() is None
    await _assert_truthful(reg, path, calls)
    assert isinstance(calls["s3"].exception(), JournalError)  # refused: nothing applied
    assert reg.closed
    assert reg.failed is None


@pytest.mark.parametrize("group_commit", [False, True])
async def test_rows_committed_before_a_failed_snapshot_are_answered(
    path: Path, gate: _Gate, monkeypatch: pytest.MonkeyPatch, group_commit: bool
) -> None:
    # A batch may be several transactions: rows, then a snapshot, then (group commit) more rows.
    # Formerly one failure anywhere failed every caller of the batch.
    # 4 rows for A: a snapshot after every second one.
    reg, calls = await _writing_s1(path, gate, group_commit=group_commit, compact_every=2)
    calls["s2"] = _bind(reg, "s2")  # a snapshot is queued right behind this row
    calls["s3"] = _bind(reg, "s3")
    await _spin()
    broken = OSError(5, "Input/output error")

    def write_snapshot(journal: Journal, seq: int, state: Mapping[str, Any]) -> None:
        raise broken

    monkeypatch.setattr(Journal, "write_snapshot", write_snapshot)
    gate.open()
    await asyncio.wait(calls.values())
    assert calls["s1"].exception() is None
    assert calls["s2"].exception() is None, "a committed row was reported failed"
    assert isinstance(calls["s3"].exception(), JournalError)
    assert reg.failed is broken
    await _assert_truthful(reg, path, calls)


async def test_a_cancelled_writer_still_reports_the_batch_it_was_writing(
    path: Path, gate: _Gate
) -> None:
    reg, calls = await _writing_s1(path, gate)
    calls["s2"] = _bind(reg, "s2")  # queued: the cancelled writer never takes it
    await _spin()
    assert reg._writer is not None
    reg._writer.cancel()
    await _spin()
    assert isinstance(calls["s2"].exception(), JournalError)
    assert not calls["s1"].done(), "answered before the thread finished its batch"
    assert isinstance(reg.failed, JournalError)
    with pytest.raises(JournalError, match="stopped"):
        await reg.bind_first(request_id="s4", session_key="s4")
    gate.open()
    await asyncio.wait(calls.values())
    assert calls["s1"].exception() is None
    await _assert_truthful(reg, path, calls)


async def test_a_cancelled_aclose_still_closes_and_releases_the_journal(
    path: Path, gate: _Gate
) -> None:
    reg, calls = await _writing_s1(path, gate)
    first = asyncio.create_task(reg.aclose())
    second = asyncio.create_task(reg.aclose())
    await _spin()
    first.cancel()
    await _spin()
    assert first.cancelled()
    assert not second.done()  # the close goes on, waiting for s1's row
    gate.open()
    await asyncio.wait([calls["s1"], second])
    assert calls["s1"].exception() is None
    assert second.exception() is None
    await reg.aclose()
    assert reg.failed is None
    await _assert_truthful(reg, path, calls)  # reopening proves the lock was released
