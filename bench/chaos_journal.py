"""The journal faults of ``bench/chaos.py`` (no engines): a full disk under the journal
(``tests/chaos/full_disk.py``) and a dead worker's journal reopened
(``tests/leases/dead_worker.py``), each run as a record in the shape of the engine faults'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["journal_fault"]


async def journal_fault(kind: str, workdir: Path, index: int) -> dict[str, Any]:
    """A run of ``disk-full`` or ``reopen`` (no engine fleet) in the shape of the others."""
    if kind == "disk-full":
        from tests.chaos.full_disk import full_disk_journal
        from tests.chaos.full_disk import problems_of

        disk = await full_disk_journal(workdir, "tmpfs")
        failed = sum(disk.failed_requests.values())
        return _run_of(
            kind,
            index,
            choices={"mode": disk.mode, "fill_error": disk.fill_error},
            back_s=disk.back_to_normal_s,
            first_publication_s=disk.back_to_normal_s,
            stopped_after_full_s=disk.stopped_after_full_s,
            reopen_s=disk.reopen_s,
            back_to_normal_s=disk.back_to_normal_s,
            times={"failed_while_stopped": float(failed)},
            requests=sum(disk.acknowledged.values()) + failed,
            failures={"while_stopped": [f"{k} x{n}" for k, n in disk.failed_requests.items()]},
            goals={
                "fail-stop with JOURNAL_ERROR": disk.failed_code == "JOURNAL_ERROR",
                "no acknowledged write lost": not disk.lost,
                "reopens cleanly once space is freed": disk.publication_after == "PUBLISHED",
            },
            problems=problems_of(disk),
            acknowledged=disk.acknowledged,
        )
    from tests.leases.dead_worker import dead_worker_reopened
    from tests.leases.dead_worker import problems_of as reopen_problems

    reopened = await dead_worker_reopened(workdir)
    bound = reopened.ttl + reopened.sweep_interval + 5.0
    return _run_of(
        kind,
        index,
        choices={"ttl": reopened.ttl, "sweep_interval": reopened.sweep_interval},
        back_s=reopened.released_s,
        first_publication_s=reopened.published_s,
        refs_released_s=reopened.released_s,
        published_s=reopened.published_s,
        goals={
            f"refs released within TTL + sweep + 5 s ({bound:.0f} s) of the reopen": (
                reopened.released_s <= bound
            ),
            "the next publication commits": reopened.later_publication == "PUBLISHED",
        },
        problems=reopen_problems(reopened),
    )


def _run_of(kind: str, index: int, **fields: Any) -> dict[str, Any]:
    """A run's record with every key the summary reads (``fields`` win)."""
    base: dict[str, Any] = {
        "kind": kind,
        "seed_name": f"{kind}-{index}",
        "first_affected_generation_s": None,
        "times": {},
        "requests": 0,
        "failures": {},
    }
    return {**base, **fields}
