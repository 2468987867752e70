"""``status --journal``: reads a journaled registry from a consistent copy and never writes to
the file; anything that is not a registry journal is refused with one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentic_lora import cli
from tests.cli.support import assert_one_error_line
from tests.cli.support import fingerprint
from tests.cli.support import only_line
from tests.cli.support import run_cli
from tests.cli.support import run_script
from tests.cli.support import sqlite_file


def test_a_missing_journal_is_one_line(tmp_path: Path) -> None:
    proc = run_script("status", "--journal", str(tmp_path / "none.sqlite"), cwd=tmp_path)
    assert "no registry journal" in assert_one_error_line(proc, "CONFIG_ERROR")
    foreign = tmp_path / "foreign.sqlite"
    foreign.write_bytes(b"not a database at all" * 100)
    proc = run_script("status", "--journal", str(foreign), cwd=tmp_path)
    assert_one_error_line(proc, "JOURNAL_FOREIGN")


@pytest.mark.asyncio
async def test_sqlite_files_that_are_not_registry_journals_are_refused_read_only(
    tmp_path: Path,
) -> None:
    ours = (
        "CREATE TABLE meta (key TEXT, value TEXT)",
        "INSERT INTO meta VALUES ('magic', 'agentic-lora/registry-journal')",
        "INSERT INTO meta VALUES ('format', '1')",
    )
    cases = [
        (
            sqlite_file(tmp_path / "other-app.sqlite", "CREATE TABLE users (name TEXT)"),
            "is an SQLite file but not an agentic-lora journal",
        ),
        (
            sqlite_file(
                tmp_path / "no-magic.sqlite",
                "CREATE TABLE meta (key TEXT, value TEXT)",
                """INSERT INTO meta VALUES ('identity', '{"engines": ["e0"], "capacity": 2}')""",
            ),
            "is not an agentic-lora journal",
        ),
        (
            sqlite_file(
                tmp_path / "format-9.sqlite",
                "CREATE TABLE meta (key TEXT, value TEXT)",
                "INSERT INTO meta VALUES ('magic', 'agentic-lora/registry-journal')",
                "INSERT INTO meta VALUES ('format', '9')",
            ),
            "has journal format 9, this build reads 1",
        ),
        (
            sqlite_file(
                tmp_path / "not-json.sqlite",
                *ours,
                "INSERT INTO meta VALUES ('identity', '{not json')",
            ),
            "records no registry identity",
        ),
        (
            sqlite_file(
                tmp_path / "partial.sqlite",
                *ours,
                """INSERT INTO meta VALUES ('identity', '{"engines": ["e0"], "capacity": 2}')""",
            ),
            "records no registry identity",
        ),
        (sqlite_file(tmp_path / "no-identity.sqlite", *ours), "records no registry identity"),
    ]
    for path, problem in cases:
        before = fingerprint(path)
        code, out, err = await run_cli("status", "--journal", str(path))
        assert (code, out) == (cli.EXIT_ERROR, ""), path.name
        assert only_line(err) == f"error: JOURNAL_FOREIGN: {path} {problem}"
        assert fingerprint(path) == before  # same bytes, and no -wal or -shm beside it


@pytest.mark.asyncio
async def test_status_shows_engines_that_are_not_active_and_what_they_hold(tmp_path: Path) -> None:
    from agentic_lora.registry.local import LocalRegistry
    from agentic_lora.registry.types import new_request_id
    from agentic_lora.testing.publish import publish_by_verbs

    journal = tmp_path / "registry.sqlite"
    reg = LocalRegistry(engines=("e0", "e1"), capacity=2, journal_path=journal)
    await publish_by_verbs(reg, "A", ("e0", "e1"))
    await reg.eject_engine(request_id=new_request_id(), engine="e1", incarnation=None)
    await reg.aclose()
    code, out, _ = await run_cli("status", "--journal", str(journal))
    assert code == 0
    assert "engines: e0 ACTIVE, e1 EJECTED" in out
    [row] = [line.split() for line in out.splitlines() if line.startswith("A")]
    assert row[-2:] == ["ready", "held"]  # e1 holds A, but nothing is routed there
