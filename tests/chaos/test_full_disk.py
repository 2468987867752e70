"""Chaos: the registry's journal on a real full filesystem (no engines; see
``tests/chaos/full_disk.py`` for the scenario).

A Deployment under agent load and publications has its journal's filesystem filled up: a small
tmpfs of the test's own, in a mount namespace of its own (the kernel's ``ENOSPC``), or, where no
namespace can be had and in the second case, a lowered ``RLIMIT_FSIZE`` (the kernel's ``EFBIG``).
Verdicts (``problems_of``): the registry fail-stops at its next journal write with
``JOURNAL_ERROR`` (and every later call too; readiness says ``registry_failed``); once space is
freed the journal reopens and replays; no write the product acknowledged is lost (bindings,
releases, publications); every version's Session refs are exactly the Sessions holding it; a new
publication and a new Session work.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.full_disk import full_disk_journal
from tests.chaos.full_disk import problems_of


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["tmpfs", "fsize"])
async def test_a_full_disk_fail_stops_the_registry_and_a_reopen_loses_nothing_acknowledged(
    tmp_path: Path, mode: str
) -> None:
    report = await full_disk_journal(tmp_path, mode)
    print(report.as_dict())
    assert problems_of(report) == []
