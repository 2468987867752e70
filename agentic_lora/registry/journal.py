"""The registry's durable journal: an append-only log of accepted verbs in SQLite.

The registry core is deterministic, so its state is a pure function of the verbs it accepted, in
order. The journal stores exactly that: one row per state-changing call ``(seq, request_id, verb,
args, checksum)``, plus, from time to time, a snapshot of the whole core that lets older rows go
(compaction). Start-up loads the newest snapshot and replays the rows after it.

SQLite runs in WAL mode with ``synchronous=FULL``: a transaction that returned is on disk. The
journal's owner decides how many rows go into one transaction (one per call, or a group).

A journal that is not ours (another format, another fleet or epoch) or that fails its checks
(unreadable file, a row whose checksum or sequence number is off) stops start-up with a typed
error. It is never reset silently: losing it would lose bindings and capacity accounting.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentic_lora.errors import JournalCorruptError, JournalForeignError

__all__ = ["Journal", "JournalEntry", "Recovered"]

MAGIC = "agentic-lora/registry-journal"
FORMAT = 1


@dataclass(frozen=True, slots=True)
class JournalEntry:
    seq: int
    request_id: str
    verb: str
    args: str  # canonical JSON of the verb's arguments (wire form)


@dataclass(frozen=True, slots=True)
class Recovered:
    snapshot: dict[str, Any] | None
    entries: list[JournalEntry]


def _checksum(seq: int, request_id: str, verb: str, args: str) -> str:
    h = hashlib.sha256()
    h.update(f"{seq}\x00{request_id}\x00{verb}\x00".encode())
    h.update(args.encode())
    return h.hexdigest()[:32]


class Journal:
    """One SQLite journal file. Not thread-safe: one thread uses it at a time."""

    def __init__(self, path: str | Path, *, identity: Mapping[str, Any]) -> None:
        self.path = Path(path)
        self.identity = json.dumps(dict(identity), sort_keys=True, separators=(",", ":"))
        self._conn: sqlite3.Connection | None = None

    # --- open / recover ------------------------------------------------------------------------

    def open(self) -> Recovered:
        """Create or open the journal, check it is ours and intact, and return what to replay."""
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
        except sqlite3.DatabaseError as exc:
            raise JournalCorruptError(
                f"journal {self.path} is not a readable SQLite database: {exc}", path=str(self.path)
            ) from exc
        self._conn = conn
        try:
            if fresh:
                self._create(conn)
                return Recovered(None, [])
            self._check_identity(conn)
            return self._recover(conn)
        except (JournalCorruptError, JournalForeignError):
            self.close()
            raise
        except sqlite3.DatabaseError as exc:
            self.close()
            raise JournalCorruptError(
                f"journal {self.path} cannot be read: {exc}", path=str(self.path)
            ) from exc

    def _create(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute(
            "CREATE TABLE events (seq INTEGER PRIMARY KEY, request_id TEXT NOT NULL, "
            "verb TEXT NOT NULL, args TEXT NOT NULL, checksum TEXT NOT NULL)"
        )
        conn.execute("CREATE TABLE snapshots (seq INTEGER PRIMARY KEY, state TEXT NOT NULL)")
        conn.executemany(
            "INSERT INTO meta VALUES (?, ?)",
            [("magic", MAGIC), ("format", str(FORMAT)), ("identity", self.identity)],
        )
        conn.execute("COMMIT")

    def _check_identity(self, conn: sqlite3.Connection) -> None:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "meta" not in tables:
            raise JournalForeignError(
                f"{self.path} is an SQLite file but not an agentic-lora journal",
                path=str(self.path),
            )
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("magic") != MAGIC:
            raise JournalForeignError(
                f"{self.path} is not an agentic-lora journal", path=str(self.path)
            )
        if meta.get("format") != str(FORMAT):
            raise JournalForeignError(
                f"{self.path} has journal format {meta.get('format')}, this build reads {FORMAT}",
                path=str(self.path),
            )
        if meta.get("identity") != self.identity:
            raise JournalForeignError(
                f"{self.path} belongs to another deployment: {meta.get('identity')} "
                f"(this registry is {self.identity})",
                path=str(self.path),
                journal_identity=meta.get("identity"),
                identity=self.identity,
            )
        if not {"events", "snapshots"} <= tables:
            raise JournalCorruptError(f"{self.path} lacks its tables", path=str(self.path))

    def _recover(self, conn: sqlite3.Connection) -> Recovered:
        row = conn.execute("SELECT seq, state FROM snapshots ORDER BY seq DESC LIMIT 1").fetchone()
        snapshot: dict[str, Any] | None = None
        base = 0
        if row is not None:
            try:
                snapshot = json.loads(row[1])
            except ValueError as exc:
                raise JournalCorruptError(
                    f"snapshot at seq {row[0]} in {self.path} is not valid JSON",
                    path=str(self.path),
                ) from exc
            if not isinstance(snapshot, dict) or snapshot.get("seq") != row[0]:
                raise JournalCorruptError(
                    f"snapshot at seq {row[0]} in {self.path} is inconsistent", path=str(self.path)
                )
            base = row[0]
        entries: list[JournalEntry] = []
        expected = base + 1
        for seq, request_id, verb, args, checksum in conn.execute(
            "SELECT seq, request_id, verb, args, checksum FROM events WHERE seq > ? ORDER BY seq",
            (base,),
        ):
            if seq != expected:
                raise JournalCorruptError(
                    f"journal {self.path} skips from seq {expected - 1} to {seq}",
                    path=str(self.path),
                    seq=seq,
                )
            if checksum != _checksum(seq, request_id, verb, args):
                raise JournalCorruptError(
                    f"journal {self.path}: entry {seq} fails its checksum",
                    path=str(self.path),
                    seq=seq,
                )
            entries.append(JournalEntry(seq, request_id, verb, args))
            expected += 1
        return Recovered(snapshot, entries)

    # --- writes (each call is one durable transaction) -----------------------------------------

    def append(self, entries: Iterable[JournalEntry]) -> None:
        conn = self._require()
        rows = [
            (e.seq, e.request_id, e.verb, e.args, _checksum(e.seq, e.request_id, e.verb, e.args))
            for e in entries
        ]
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?)", rows)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def write_snapshot(self, seq: int, state: Mapping[str, Any]) -> None:
        """Store a snapshot taken at ``seq`` and drop what it makes redundant (one transaction)."""
        conn = self._require()
        text = json.dumps(state, separators=(",", ":"))
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("INSERT OR REPLACE INTO snapshots VALUES (?, ?)", (seq, text))
            conn.execute("DELETE FROM snapshots WHERE seq < ?", (seq,))
            conn.execute("DELETE FROM events WHERE seq <= ?", (seq,))
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _require(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("journal is not open")
        return self._conn
