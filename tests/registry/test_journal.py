"""Durability: a restarted registry loses nothing; a bad journal stops start-up with a typed error."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from agentic_lora.errors import (
    CapacityError,
    JournalCorruptError,
    JournalError,
    JournalForeignError,
)
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import ReadyReceipt, SessionState, VersionState, new_request_id

from .util import E0, E1, digest_of

pytestmark = pytest.mark.asyncio


def _registry(path: Path, **kw: object) -> LocalRegistry:
    return LocalRegistry(engines=(E0, E1), capacity=2, journal_path=path, **kw)  # type: ignore[arg-type]


async def _publish(reg: LocalRegistry, version_id: str) -> None:
    r = await reg.reserve(
        request_id=new_request_id(), version_id=version_id, digest=digest_of(version_id)
    )
    for e in (E0, E1):
        await reg.record_ready(
            request_id=new_request_id(),
            receipt=ReadyReceipt(e, version_id, r.digest, r.lora_name, r.attempt, "inc-1"),
        )
    st = await reg.status()
    await reg.commit(
        request_id=new_request_id(),
        version_id=version_id,
        attempt=r.attempt,
        expected_default_revision=st.default_revision,
    )


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
    tmp_path: Path, group_commit: bool
) -> None:
    path = tmp_path / "registry.sqlite"
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


async def test_concurrent_calls_with_group_commit_are_all_durable(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite"
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


async def test_compaction_keeps_state_and_idempotency(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite"
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


async def test_a_foreign_sqlite_file_stops_start_up(tmp_path: Path) -> None:
    path = tmp_path / "other.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE things (x)")
    conn.close()
    with pytest.raises(JournalForeignError):
        _registry(path)


async def test_a_journal_of_another_fleet_stops_start_up(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite"
    reg = _registry(path)
    await _publish(reg, "A")
    await reg.aclose()
    with pytest.raises(JournalForeignError) as err:
        LocalRegistry(engines=(E0, E1, "e2"), capacity=2, journal_path=path)
    assert "another deployment" in err.value.message
    with pytest.raises(JournalForeignError):
        LocalRegistry(engines=(E0, E1), capacity=2, deployment_epoch=1, journal_path=path)


async def test_another_journal_format_stops_start_up(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite"
    await _registry(path).aclose()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value='99' WHERE key='format'")
    conn.close()
    with pytest.raises(JournalForeignError, match="format"):
        _registry(path)


async def test_a_tampered_row_stops_start_up(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite"
    reg = _registry(path)
    await _scenario(reg)
    await reg.aclose()
    with sqlite3.connect(path) as conn:
        conn.execute(
            "UPDATE events SET args = replace(args, 's_old', 's_odd') WHERE verb='bind_first'"
        )
    conn.close()
    with pytest.raises(JournalCorruptError, match="checksum"):
        _registry(path)


async def test_a_missing_row_stops_start_up(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite"
    reg = _registry(path)
    await _scenario(reg)
    await reg.aclose()
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM events WHERE seq = 3")
    conn.close()
    with pytest.raises(JournalCorruptError, match="skips"):
        _registry(path)


async def test_a_broken_snapshot_stops_start_up(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite"
    reg = _registry(path, compact_every=3)
    await _scenario(reg)
    await reg.aclose()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE snapshots SET state = '{not json'")
    conn.close()
    with pytest.raises(JournalCorruptError, match="snapshot"):
        _registry(path, compact_every=3)


async def test_a_write_failure_stops_the_registry(tmp_path: Path) -> None:
    path = tmp_path / "registry.sqlite"
    reg = _registry(path)
    await _publish(reg, "A")
    assert reg._journal is not None
    reg._journal.close()  # the disk goes away under the registry
    with pytest.raises(JournalError):
        await reg.bind_first(request_id=new_request_id(), session_key="s")
    with pytest.raises(JournalError, match="stopped"):
        await reg.bind_first(request_id=new_request_id(), session_key="t")
    await reg.aclose()
    # What reached the disk is intact and replays.
    again = _registry(path)
    assert again.core.version("A").state is VersionState.PUBLISHED
    await again.aclose()


async def test_listeners_see_applied_changes_only(tmp_path: Path) -> None:
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
    tmp_path: Path, verb: str, args: str, match: str
) -> None:
    path = tmp_path / "registry.sqlite"
    reg = _registry(path)
    await _scenario(reg)
    seq = reg.core.seq
    await reg.aclose()
    _append_raw(path, seq + 1, "bind-old" if verb == "bind_first" else "x", verb, args)
    with pytest.raises(JournalCorruptError, match=match):
        _registry(path)


async def test_a_failed_append_rolls_back_and_leaves_the_journal_usable(tmp_path: Path) -> None:
    from agentic_lora.registry.journal import Journal, JournalEntry

    j = Journal(tmp_path / "j.sqlite", identity={"x": 1})
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
    again = Journal(tmp_path / "j.sqlite", identity={"x": 1})
    assert [e.seq for e in again.open().entries] == [1, 2]
    again.close()
