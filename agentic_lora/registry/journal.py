"""The registry's durable journal: an append-only log of accepted verbs in SQLite.

The registry core is deterministic, so its state is a pure function of the verbs it accepted, in
order. The journal stores exactly that: one row per state-changing call ``(seq, request_id, verb,
args, checksum)``, plus, from time to time, a snapshot of the whole core that lets older rows go
(compaction). Start-up loads the newest snapshot and replays the rows after it.

SQLite runs in WAL mode with ``synchronous=FULL``: a transaction that returned is on disk. The
journal's owner decides how many rows go into one transaction (one per call, or a group).

One writer only. :meth:`Journal.open` first takes an exclusive ``flock`` on ``<journal>.lock`` and
holds it until :meth:`Journal.close` (the OS drops it when the process dies, even by ``kill -9``).
A second opener, in this process or another, gets :class:`~agentic_lora.errors.JournalLockedError`
naming the holder (pid, host, since when), which the holder writes into the lock file. The lock is
taken before anything else is touched, so two processes can never both create or both write.

A new journal is built in ``<journal>.creating`` (tables and identity committed and fsynced), then
renamed onto the journal path and the directory fsynced. A crash before the rename leaves only the
temporary file, which the next opener (holding the lock) deletes; after the rename the journal is
complete. A missing or zero-length journal file counts as new.

A journal that is not ours (another format, another fleet or epoch) or that fails its checks
(unreadable file, a row whose checksum or sequence number is off) stops start-up with a typed
error. It is never reset silently: losing it would lose bindings and capacity accounting.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import sqlite3
import weakref
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC
from datetime import datetime
from pathlib import Path
from typing import Any
from typing import NotRequired
from typing import TypedDict

from agentic_lora.errors import JournalCorruptError
from agentic_lora.errors import JournalError
from agentic_lora.errors import JournalForeignError
from agentic_lora.errors import JournalLockedError
from agentic_lora.foundation.fsync import fsync_path

__all__ = ["IDENTITY_KEYS", "Journal", "JournalEntry", "Recovered", "RegistryIdentity"]

logger = logging.getLogger(__name__)

MAGIC = "agentic-lora/registry-journal"
FORMAT = 1

_SCHEMA = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE events (seq INTEGER PRIMARY KEY, request_id TEXT NOT NULL, "
    "verb TEXT NOT NULL, args TEXT NOT NULL, checksum TEXT NOT NULL)",
    "CREATE TABLE snapshots (seq INTEGER PRIMARY KEY, state TEXT NOT NULL)",
)

#: The files SQLite keeps next to a database while it writes to it.
_SQLITE_SIDECARS = ("-journal", "-wal", "-shm")


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


# --- the single-writer lock ---------------------------------------------------------------------

# Lock fds this process holds. A child made by fork() shares each one's open file description, and
# flock() is released only when every fd on it is closed: a forked child outliving a killed parent
# would keep the journal locked. The child therefore closes its copies right after fork (the parent
# keeps the lock), and its Journal objects know by pid that they no longer own one.
_HELD_LOCKS: set[int] = set()


def _drop_inherited_locks() -> None:
    for fd in _HELD_LOCKS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def _release_lock(fd: int, owner_pid: int) -> None:
    # Also runs from a weakref finalizer (a Journal dropped without close()): no reference to it.
    if os.getpid() != owner_pid:
        return  # a forked child: its copy was closed at fork
    _HELD_LOCKS.discard(fd)
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)  # nobody holds it now; a killed holder's record stays, unlocked
    os.close(fd)


def _read_holder(fd: int) -> dict[str, Any] | None:
    """The holder record in a lock file, or None if it is empty or unreadable.

    Empty happens in the instant between the holder's flock() and its write, and after a clean
    close; a record from a holder that was killed stays in the file but no longer holds the lock.
    """
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw.decode())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


class RegistryIdentity(TypedDict):
    """The keywords that say which registry this is: its fleet, its capacity, its deployment
    epoch and its adapter name prefix (defaults: those of
    :class:`~agentic_lora.registry.state.RegistryState`). A journal records them and refuses to
    open for a registry with any other (:class:`~agentic_lora.errors.JournalForeignError`)."""

    engines: Sequence[str]
    capacity: int
    deployment_epoch: NotRequired[int]
    prefix: NotRequired[str]


#: The identity keys every registry journal records (see :class:`LocalRegistry`).
IDENTITY_KEYS = frozenset(RegistryIdentity.__annotations__)


def _checked_meta(conn: sqlite3.Connection, path: Path) -> tuple[set[str], dict[str, str]]:
    """The table names and the ``meta`` rows of a journal whose magic and format are ours."""
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if "meta" not in tables:
        raise JournalForeignError(
            f"{path} is an SQLite file but not an agentic-lora journal", path=str(path)
        )
    meta = {str(k): str(v) for k, v in conn.execute("SELECT key, value FROM meta").fetchall()}
    if meta.get("magic") != MAGIC:
        raise JournalForeignError(f"{path} is not an agentic-lora journal", path=str(path))
    if meta.get("format") != str(FORMAT):
        raise JournalForeignError(
            f"{path} has journal format {meta.get('format')}, this build reads {FORMAT}",
            path=str(path),
        )
    return tables, meta


def _backup(source: Path, target: Path) -> None:
    # SQLite's backup API gives a consistent copy even while a writer appends. A journal with a
    # write-ahead log may have frames not yet in the main file: read it read-only (``mode=ro``).
    # Without one, nothing is pending and ``immutable=1`` reads without creating any lock file.
    mode = "mode=ro" if Path(f"{source}-wal").exists() else "immutable=1"
    try:
        src = sqlite3.connect(f"{source.resolve().as_uri()}?{mode}", uri=True)
    except sqlite3.Error as exc:
        raise JournalForeignError(f"{source} cannot be opened: {exc}", path=str(source)) from exc
    with (
        _foreign_unless_read(source, "a readable SQLite journal"),
        contextlib.closing(src),
        contextlib.closing(sqlite3.connect(target)) as dst,
    ):
        src.backup(dst)


@contextlib.contextmanager
def _foreign_unless_read(source: Path, what: str) -> Iterator[None]:
    """Reading ``source`` inside: an SQLite error says it is not ``what`` (JournalForeignError)."""
    try:
        yield
    except sqlite3.DatabaseError as exc:
        raise JournalForeignError(f"{source} is not {what}: {exc}", path=str(source)) from exc


class Journal:
    """One SQLite journal file. Not thread-safe: one thread uses it at a time."""

    def __init__(self, path: str | Path, *, identity: Mapping[str, Any]) -> None:
        self.path = Path(path)
        self.identity_values: Mapping[str, Any] = dict(identity)
        self.identity = json.dumps(dict(identity), sort_keys=True, separators=(",", ":"))
        self._conn: sqlite3.Connection | None = None
        self._unlock: weakref.finalize[[int, int], Journal] | None = None

    @classmethod
    def read_only_copy(cls, source: str | Path, target: str | Path) -> Journal:
        """A journal on a consistent copy of ``source`` made at ``target``, with the identity
        ``source`` records (not opened yet).

        ``source`` is never written to, not even a lock or ``-wal`` file beside it, so this is
        safe while its registry runs. Raises :class:`JournalForeignError` unless ``source`` is a
        registry journal of this format.
        """
        source, target = Path(source), Path(target)
        _backup(source, target)
        with (
            _foreign_unless_read(source, "an agentic-lora journal"),
            contextlib.closing(sqlite3.connect(target)) as conn,
        ):
            _, meta = _checked_meta(conn, source)
        try:
            identity = json.loads(meta.get("identity", ""))
        except ValueError:
            identity = None
        if not isinstance(identity, dict) or not identity.keys() >= IDENTITY_KEYS:
            raise JournalForeignError(f"{source} records no registry identity", path=str(source))
        return cls(target, identity=identity)

    @property
    def lock_path(self) -> Path:
        """The sidecar file whose ``flock`` makes this process the journal's only writer."""
        return self.path.with_name(self.path.name + ".lock")

    @property
    def creating_path(self) -> Path:
        """Where a new journal is built before it is renamed onto :attr:`path`."""
        return self.path.with_name(self.path.name + ".creating")

    # --- open / recover ------------------------------------------------------------------------

    def open(self) -> Recovered:
        """Lock, create if new, check it is ours and intact, and return what to replay.

        Raises :class:`JournalLockedError` if another opener holds it, and closes everything it
        took on any error.
        """
        if self._unlock is not None:
            raise RuntimeError("journal is already open")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock()
            self._discard_partial_creation()
            if self._is_new():
                self._create()
            try:
                conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
                self._conn = conn
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")
            except sqlite3.DatabaseError as exc:
                raise JournalCorruptError(
                    f"journal {self.path} is not a readable SQLite database: {exc}",
                    path=str(self.path),
                ) from exc
            self._check_identity(conn)
            return self._recover(conn)
        except JournalError:
            self.close()
            raise
        except sqlite3.DatabaseError as exc:
            self.close()
            raise JournalCorruptError(
                f"journal {self.path} cannot be read: {exc}", path=str(self.path)
            ) from exc
        except OSError as exc:
            self.close()
            raise JournalError(f"journal {self.path}: {exc}", path=str(self.path)) from exc
        except BaseException:
            self.close()
            raise

    def _lock(self) -> None:
        lock_path = self.lock_path
        # Never unlinked: removing a lock file that others may have open would let two
        # processes lock two different files of the same name.
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec (PEP 446)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            if holder is None:
                who = "another process (it has not written its name yet)"
            else:
                who = (
                    f"pid {holder.get('pid')} on {holder.get('hostname')} "
                    f"since {holder.get('since')}"
                )
                if holder.get("pid") == os.getpid() and holder.get("hostname") == (
                    socket.gethostname()
                ):
                    who += " (this process: another Journal or LocalRegistry has it open)"
            raise JournalLockedError(
                f"journal {self.path} is held by {who}: one registry process per journal "
                f"(lock file {lock_path})",
                path=str(self.path),
                lock_path=str(lock_path),
                holder=holder,
            ) from None
        except BaseException:
            os.close(fd)
            raise
        _HELD_LOCKS.add(fd)
        self._unlock = weakref.finalize(self, _release_lock, fd, os.getpid())
        holder = {
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "since": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder, sort_keys=True).encode(), 0)

    def _discard_partial_creation(self) -> None:
        # Holding the lock, so no creator is running: whatever is here is left by a crash.
        tmp = self.creating_path
        for path in (tmp, *(Path(f"{tmp}{suffix}") for suffix in _SQLITE_SIDECARS)):
            if path.exists():
                logger.warning(
                    "removing a journal left half-created by a crash",
                    extra={"journal": str(self.path), "file": str(path)},
                )
                path.unlink()

    def _is_new(self) -> bool:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size > 0:
            return False
        wal = Path(f"{self.path}-wal")
        if wal.exists() and wal.stat().st_size > 0:
            # Committed rows may live only in the write-ahead log: never start over on them.
            raise JournalCorruptError(
                f"journal {self.path} is missing or empty but its write-ahead log {wal} is not: "
                "restore the journal file, or move both away to start a new deployment epoch",
                path=str(self.path),
            )
        return True

    def _create(self) -> None:
        """Build the journal in :attr:`creating_path`, durably, and rename it onto :attr:`path`."""
        tmp = self.creating_path
        # Rollback-journal mode (SQLite's default): a committed transaction is in the file itself,
        # so after close() the temporary file is complete on its own (no -wal to carry along).
        conn = sqlite3.connect(tmp, isolation_level=None)
        try:
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.executemany(
                "INSERT INTO meta VALUES (?, ?)",
                [("magic", MAGIC), ("format", str(FORMAT)), ("identity", self.identity)],
            )
            conn.execute("COMMIT")
        finally:
            conn.close()
        fsync_path(tmp)
        # An empty journal file (or none) may still have an empty -wal and an -shm beside it:
        # they belong to no data, and SQLite must not pair them with the new file.
        for suffix in ("-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)
        os.replace(tmp, self.path)
        fsync_path(self.path.parent)  # the rename itself is durable
        logger.info("registry journal created", extra={"journal": str(self.path)})

    def _check_identity(self, conn: sqlite3.Connection) -> None:
        tables, meta = _checked_meta(conn, self.path)
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
        """Close the database, then release the lock (idempotent)."""
        # In this order: another process may open the journal the moment the lock is free.
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._unlock is not None:
            self._unlock()
            self._unlock = None

    def _require(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("journal is not open")
        return self._conn
