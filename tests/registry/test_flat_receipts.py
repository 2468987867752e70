"""Receipts carry one VersionRef; journals and snapshots written before that still load.

Earlier releases wrote each receipt's identity as flat fields (``version_id``, ``digest``,
``lora_name``, ``attempt`` beside the receipt's own), a ``CommitReceipt`` without its digest and a
``Binding`` without its attempt. The images below are written out by hand in that old form; a
registry loaded from them must answer exactly as the registry that lived through the same calls.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from agentic_lora import VersionRef
from agentic_lora.errors import JournalCorruptError
from agentic_lora.foundation.identity import make_lora_name
from agentic_lora.registry.core import RegistryCore
from agentic_lora.registry.journal import _checksum
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import CommitReceipt
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.registry.types import ReclaimClaim
from agentic_lora.registry.types import Reservation
from agentic_lora.registry.types import ReserveOutcome
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import from_wire
from agentic_lora.registry.types import to_wire

from .util import E0
from .util import E1
from .util import digest_of
from .util import new_core

DA, DB = digest_of("A"), digest_of("B")
NAME_A = make_lora_name("policy_lora", 0, "A", DA)
NAME_B = make_lora_name("policy_lora", 0, "B", DB)
A1 = VersionRef("A", DA, NAME_A, 1)
B1 = VersionRef("B", DB, NAME_B, 1)
B2 = VersionRef("B", DB, NAME_B, 2)

#: A publishes; s1 binds A; B's first attempt fails clean; its second publishes; s2 binds B.
STEPS: list[tuple[str, str, dict[str, Any]]] = [
    ("reserve-A", "reserve", {"version_id": "A", "digest": DA}),
    ("ready-A-e0", "record_ready", {"receipt": ReadyReceipt(E0, A1, "inc-1")}),
    ("ready-A-e1", "record_ready", {"receipt": ReadyReceipt(E1, A1, "inc-1")}),
    ("commit-A", "commit", {"version_id": "A", "attempt": 1, "expected_default_revision": 0}),
    ("bind-s1", "bind_first", {"session_key": "s1"}),
    ("reserve-B1", "reserve", {"version_id": "B", "digest": DB}),
    ("abort-B1", "abort", {"version_id": "B", "attempt": 1, "reason": "test"}),
    ("clean-B1-e0", "confirm_cleanup", {"version_id": "B", "attempt": 1, "engine": E0}),
    ("clean-B1-e1", "confirm_cleanup", {"version_id": "B", "attempt": 1, "engine": E1}),
    ("reserve-B2", "reserve", {"version_id": "B", "digest": DB}),
    ("ready-B-e0", "record_ready", {"receipt": ReadyReceipt(E0, B2, "inc-1")}),
    ("ready-B-e1", "record_ready", {"receipt": ReadyReceipt(E1, B2, "inc-1")}),
    ("commit-B", "commit", {"version_id": "B", "attempt": 2, "expected_default_revision": 1}),
    ("bind-s2", "bind_first", {"session_key": "s2"}),
]
#: The calls whose answers the hand-written image remembers (its idempotency window).
REMEMBERED = ("commit-A", "bind-s1", "reserve-B2", "ready-B-e1", "commit-B", "bind-s2")


def _live() -> RegistryCore:
    core = new_core()
    for request_id, verb, args in STEPS:
        core.execute(request_id, verb, args)
    return core


# --- the old form, by hand ---------------------------------------------------------------------


def _ready(engine: str, vid: str, digest: str, name: str, attempt: int) -> dict[str, Any]:
    return {
        "__type__": "ReadyReceipt",
        "engine": engine,
        "version_id": vid,
        "digest": digest,
        "lora_name": name,
        "attempt": attempt,
        "incarnation": "inc-1",
    }


def _commit(vid: str, name: str, attempt: int, revision: int, previous: str | None) -> Any:
    return {
        "__type__": "CommitReceipt",
        "version_id": vid,
        "lora_name": name,
        "attempt": attempt,
        "default_revision": revision,
        "previous_default": previous,
    }


def _binding(key: str, vid: str, name: str, digest: str, revision: int) -> dict[str, Any]:
    return {
        "__type__": "Binding",
        "session_key": key,
        "version_id": vid,
        "lora_name": name,
        "digest": digest,
        "default_revision": revision,
    }


def _version(
    vid: str, digest: str, name: str, state: str, attempt: int, commit: Any
) -> dict[str, Any]:
    return {
        "version_id": vid,
        "digest": digest,
        "lora_name": name,
        "state": state,
        "attempt": attempt,
        "ready": [_ready(e, vid, digest, name, attempt) for e in (E0, E1)],
        "cleaned": [],
        "reclaim_id": None,
        "reclaimed": [],
        "session_refs": 1,
        "commit_receipt": commit,
    }


def _flat_image(s2_digest: str = DB) -> dict[str, Any]:
    """The registry after :data:`STEPS`, as an earlier release wrote its snapshot."""
    commit_a = _commit("A", NAME_A, 1, 1, None)
    commit_b = _commit("B", NAME_B, 2, 2, "A")
    bind_s1 = _binding("s1", "A", NAME_A, DA, 1)
    bind_s2 = _binding("s2", "B", NAME_B, s2_digest, 2)
    status_b = {
        "__type__": "VersionStatus",
        "version_id": "B",
        "digest": DB,
        "lora_name": NAME_B,
        "state": "LOADING",
        "attempt": 2,
        "session_refs": 0,
        "ready_engines": [E0, E1],
        "cleaned_engines": [],
        "reclaim_id": None,
        "reclaimed_engines": [],
        "published_revision": None,
    }
    reservation_b = {
        "__type__": "Reservation",
        "version_id": "B",
        "digest": DB,
        "lora_name": NAME_B,
        "attempt": 2,
        "outcome": "RETRY_STARTED",
        "state": "LOADING",
        "engines": [E0, E1],
    }
    return {
        "seq": len(STEPS),
        "default": "B",
        "default_revision": 2,
        "pending": None,
        "incarnations": {E0: "inc-1", E1: "inc-1"},
        "versions": [
            _version("A", DA, NAME_A, "RETIRED", 1, commit_a),
            _version("B", DB, NAME_B, "PUBLISHED", 2, commit_b),
        ],
        "sessions": [["s1", "BOUND", bind_s1, None], ["s2", "BOUND", bind_s2, None]],
        "now": 0.0,
        "leases": [],
        "owners": {},
        "dead_leases": [],
        "names": [],
        "done": [
            ["commit-A", "commit", ["A", 1, 0], commit_a],
            ["bind-s1", "bind_first", ["s1"], bind_s1],
            ["reserve-B2", "reserve", ["B", DB], reservation_b],
            ["ready-B-e1", "record_ready", [_ready(E1, "B", DB, NAME_B, 2)], status_b],
            ["commit-B", "commit", ["B", 2, 1], commit_b],
            ["bind-s2", "bind_first", ["s2"], bind_s2],
        ],
    }


# --- the wire form now ---------------------------------------------------------------------------


def test_every_receipt_carries_its_identity_as_one_ref_on_the_wire() -> None:
    receipts = [
        ReadyReceipt(E0, B2, "inc-1"),
        Reservation(B2, ReserveOutcome.RETRY_STARTED, VersionState.LOADING, (E0, E1)),
        CommitReceipt(B2, default_revision=2, previous_default="A"),
        Binding("s2", B2, default_revision=2),
        ReclaimClaim(B2, "reclaim-1", (E0, E1), confirmed=(E1,)),
    ]
    for receipt in receipts:
        wire = to_wire(receipt)
        assert wire["ref"] == {"__type__": "VersionRef", **vars_of(B2)}
        assert not {"version_id", "digest", "lora_name", "attempt"} & wire.keys()
        back = from_wire(json.loads(json.dumps(wire)))
        assert back == receipt
        assert (back.version_id, back.digest, back.lora_name, back.attempt) == ("B", DB, NAME_B, 2)


def vars_of(ref: VersionRef) -> dict[str, Any]:
    return {k: getattr(ref, k) for k in ("version_id", "digest", "lora_name", "attempt")}


def test_a_flat_receipt_lacking_a_part_is_refused_without_the_registry_record() -> None:
    with pytest.raises(ValueError, match="digest"):
        from_wire(_commit("B", NAME_B, 2, 2, "A"))
    # A flat receipt that had all four parts needs no record.
    assert from_wire(_ready(E1, "B", DB, NAME_B, 2)) == ReadyReceipt(E1, B2, "inc-1")


def test_a_flat_reclaim_claim_takes_its_ref_from_the_registry_record() -> None:
    # Written before claims carried a ref: the version's id and adapter name only.
    flat = {"__type__": "ReclaimClaim", "version_id": "B", "lora_name": NAME_B}
    flat |= {"reclaim_id": "reclaim-1", "engines": [E0, E1], "confirmed": [E1]}
    with pytest.raises(ValueError, match="attempt"):
        from_wire(flat)
    claim = ReclaimClaim(B2, "reclaim-1", (E0, E1), confirmed=(E1,))
    assert from_wire(flat, known={"B": B2}.__getitem__) == claim
    with pytest.raises(ValueError, match="disagrees"):
        from_wire({**flat, "lora_name": NAME_A}, known={"B": B2}.__getitem__)


# --- snapshots written flat -----------------------------------------------------------------------


def test_a_snapshot_written_flat_loads_to_the_registry_that_lived_through_it() -> None:
    live = _live()
    loaded = new_core()
    loaded.load_state(_flat_image())

    expected = live.to_state()
    expected["done"] = [row for row in expected["done"] if row[0] in REMEMBERED]
    assert loaded.to_state() == expected  # every receipt, binding and remembered answer
    assert loaded.status() == live.status()
    for request_id, verb, args in STEPS:
        if request_id in REMEMBERED:
            # Replays (new-form arguments) are answered from the flat-written window.
            assert loaded.execute(request_id, verb, args) == live.execute(request_id, verb, args)
    # The parts the old form lacked come from the registry's record of the version.
    answer, applied = loaded.execute("bind-s2", "bind_first", {"session_key": "s2"})
    assert not applied
    assert answer.ref == B2  # the attempt the flat Binding did not write
    answer, _ = loaded.execute("commit-A", "commit", STEPS[3][2])
    assert answer.ref == A1  # the digest the flat CommitReceipt did not write


def _open(path: Path) -> LocalRegistry:
    return LocalRegistry(engines=(E0, E1), capacity=2, journal_path=path)


@pytest_asyncio.fixture
async def journal(tmp_path: Path) -> Path:
    """A closed journal that lived through STEPS: each test rewrites part of it in the old form."""
    path = tmp_path / "registry.sqlite"
    async with contextlib.aclosing(_open(path)) as registry:
        for request_id, verb, args in STEPS:
            await getattr(registry, verb)(request_id=request_id, **args)
    return path


@contextlib.contextmanager
def _rewriting(path: Path) -> Iterator[sqlite3.Connection]:
    """A connection to the closed journal that commits what the test wrote, then closes."""
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        yield conn


@pytest.mark.asyncio
async def test_a_journal_whose_snapshot_was_written_flat_recovers_the_same_registry(
    journal: Path,
) -> None:
    with _rewriting(journal) as conn:
        conn.execute("INSERT INTO snapshots VALUES (?, ?)", (len(STEPS), json.dumps(_flat_image())))

    async with contextlib.aclosing(_open(journal)) as again:
        assert await again.status() == _live().status()
        rebound = await again.bind_first(request_id="bind-s1", session_key="s1")
        assert rebound == Binding("s1", A1, default_revision=1)
        assert again.core.version("A").session_refs == 1  # a replay, not a second bind


@pytest.mark.asyncio
async def test_a_flat_receipt_that_disagrees_with_the_record_stops_recovery(
    journal: Path,
) -> None:
    other = digest_of("other")
    with _rewriting(journal) as conn:
        image = _flat_image(s2_digest=other)
        conn.execute("INSERT INTO snapshots VALUES (?, ?)", (len(STEPS), json.dumps(image)))

    with pytest.raises(JournalCorruptError):
        _open(journal)


# --- journal rows written flat --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_journal_whose_ready_rows_were_written_flat_replays_the_same_registry(
    journal: Path,
) -> None:
    flat = {
        "ready-A-e0": _ready(E0, "A", DA, NAME_A, 1),
        "ready-A-e1": _ready(E1, "A", DA, NAME_A, 1),
        "ready-B-e0": _ready(E0, "B", DB, NAME_B, 2),
        "ready-B-e1": _ready(E1, "B", DB, NAME_B, 2),
    }
    with _rewriting(journal) as conn:
        for request_id, receipt in flat.items():
            (seq,) = conn.execute(
                "SELECT seq FROM events WHERE request_id = ?", (request_id,)
            ).fetchone()
            args = json.dumps({"receipt": receipt}, separators=(",", ":"))
            conn.execute(
                "UPDATE events SET args = ?, checksum = ? WHERE seq = ?",
                (args, _checksum(seq, request_id, "record_ready", args), seq),
            )

    async with contextlib.aclosing(_open(journal)) as again:
        assert await again.status() == _live().status()
        ready = again.core.to_state()["versions"][1]["ready"]
        assert [from_wire(r) for r in ready] == [ReadyReceipt(e, B2, "inc-1") for e in (E0, E1)]
        # A replay with the new form is the same call as the flat row it was journaled as.
        replayed = await again.record_ready(
            request_id="ready-B-e1", receipt=STEPS[11][2]["receipt"]
        )
        assert replayed.ready_engines == (E0, E1)
        assert again.core.seq == len(STEPS)  # answered from memory: nothing was applied
