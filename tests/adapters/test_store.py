"""The immutable adapter store: atomic publish, never overwrite, verify what is there."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.adapters.store import MARKER_FILE
from agentic_lora.adapters.store import AdapterStore
from agentic_lora.errors import InvalidIdentityError
from agentic_lora.errors import VersionConflictError
from agentic_lora.foundation.identity import make_lora_name
from agentic_lora.testing.adapters import tiny_snapshot

A = tiny_snapshot(1)
B = tiny_snapshot(2)
NAME_A = make_lora_name("policy_lora", 0, "v1", A.digest)


def test_put_writes_a_loadable_directory_with_a_marker(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "store")
    path = store.put_sync(NAME_A, A)
    assert path == store.root / NAME_A
    assert path.is_absolute()
    assert AdapterSnapshot.from_peft_dir(path).digest == A.digest
    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker["digest"] == A.digest
    assert marker["lora_name"] == NAME_A
    assert marker["manifest"] == A.manifest.to_dict()
    # Nothing half-written is left beside it.
    assert sorted(p.name for p in store.root.iterdir()) == [NAME_A]


def test_put_flushes_every_file_and_name_before_the_rename_publishes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AdapterStore(tmp_path / "store")
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename
    lock = threading.Lock()

    def fsync(fd: int) -> None:
        real_fsync(fd)
        with lock:
            events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))

    def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("rename", os.fspath(src)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    store.put_sync(NAME_A, A)
    (renamed,) = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
    tmp = events[renamed][1]
    before = {path for kind, path in events[:renamed] if kind == "fsync"}
    names = ("adapter_config.json", "adapter_model.safetensors", MARKER_FILE)
    assert before == {tmp, *(os.path.join(tmp, name) for name in names)}
    assert events[renamed + 1 :] == [("fsync", str(store.root))]


def test_relative_root_becomes_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = AdapterStore("rel")
    assert store.root == tmp_path / "rel"
    assert store.put_sync(NAME_A, A).is_absolute()


def test_a_second_put_of_the_same_content_verifies_and_never_rewrites(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    path = store.put_sync(NAME_A, A)
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert store.put_sync(NAME_A, A) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before


def test_other_content_under_an_existing_name_is_a_conflict(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    store.put_sync(NAME_A, A)
    with pytest.raises(VersionConflictError) as info:
        store.put_sync(NAME_A, B)
    assert info.value.details["reason"] == "marker_mismatch"
    # The stored copy is untouched.
    assert AdapterSnapshot.from_peft_dir(store.path_for(NAME_A)).digest == A.digest


def test_tampered_files_behind_a_correct_marker_are_a_conflict(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    path = store.put_sync(NAME_A, A)
    weights = path / "adapter_model.safetensors"
    os.chmod(weights, 0o644)
    B.write_peft_dir(tmp_path / "b")
    weights.write_bytes((tmp_path / "b" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(VersionConflictError) as info:
        store.put_sync(NAME_A, A)
    assert info.value.details["reason"] == "content_mismatch"


def test_a_foreign_directory_without_marker_is_a_conflict(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    A.write_peft_dir(store.path_for(NAME_A))  # right files, but nobody vouched for them
    with pytest.raises(VersionConflictError):
        store.put_sync(NAME_A, A)


def test_remove_deletes_exactly_one_name(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    name_b = make_lora_name("policy_lora", 0, "v2", B.digest)
    store.put_sync(NAME_A, A)
    store.put_sync(name_b, B)
    assert store.remove_sync(NAME_A) is True
    assert store.names() == [name_b]
    assert store.remove_sync(NAME_A) is False
    assert store.names() == [name_b]


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", ".hidden", "x\x00y", "a\\b", "n" * 256])
def test_names_that_are_not_one_path_component_are_refused(tmp_path: Path, bad: str) -> None:
    store = AdapterStore(tmp_path)
    with pytest.raises(InvalidIdentityError):
        store.put_sync(bad, A)
    with pytest.raises(InvalidIdentityError):
        store.remove_sync(bad)


def test_partials_of_interrupted_writes_are_discarded(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    store.put_sync(NAME_A, A)
    (store.root / f".tmp-{NAME_A}-dead").mkdir()
    (store.root / f".trash-{NAME_A}-dead").mkdir()
    assert store.discard_partials() == 2
    assert store.names() == [NAME_A]


def test_a_failed_write_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AdapterStore(tmp_path)

    def broken(self: AdapterSnapshot, path: object, *, fsync: bool = False) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(AdapterSnapshot, "write_peft_dir", broken)
    with pytest.raises(OSError, match="No space"):
        store.put_sync(NAME_A, A)
    assert list(store.root.iterdir()) == []


def test_losing_the_rename_race_keeps_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = AdapterStore(tmp_path)
    real_rename = os.rename

    def racing_rename(src: object, dst: object) -> None:
        # Another writer finishes the same name between our existence check and our rename.
        if Path(str(dst)) == store.path_for(NAME_A) and not store.path_for(NAME_A).exists():
            A.write_peft_dir(tmp_path / "winner")
            winner_marker = Path(str(src)) / MARKER_FILE
            (tmp_path / "winner" / MARKER_FILE).write_text(winner_marker.read_text())
            real_rename(tmp_path / "winner", dst)
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", racing_rename)
    assert store.put_sync(NAME_A, A) == store.path_for(NAME_A)
    assert AdapterSnapshot.from_peft_dir(store.path_for(NAME_A)).digest == A.digest
    assert store.names() == [NAME_A]


@pytest.mark.asyncio
async def test_async_front_runs_the_same_operations(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    path = await store.put(NAME_A, A)
    assert await store.verify(NAME_A, A.digest) == path
    with pytest.raises(VersionConflictError):
        await store.verify(NAME_A, B.digest)
    assert await store.remove(NAME_A) is True
    with pytest.raises(VersionConflictError):
        await store.verify(NAME_A, A.digest)
