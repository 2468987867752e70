"""Publish a version by registry verbs alone: reserve, record READY per engine, commit.

For tests and benchmarks that need a committed (or staged) version without loading anything on an
engine: the registry is told every engine is READY, as a publisher would after its loads. Works
with any registry front end (local, Ray client, a test recorder wrapping one): only the verbs and
``status()`` are called, each with a fresh request id.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from collections.abc import Iterable
from typing import Protocol

from agentic_lora.registry.types import CommitReceipt
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import Reservation
from agentic_lora.registry.types import VersionStatus
from agentic_lora.registry.types import new_request_id

__all__ = [
    "PublishVerbs",
    "commit_staged",
    "digest_for",
    "publish_by_verbs",
    "ready_on",
    "receipt_for",
    "stage",
]


class PublishVerbs(Protocol):
    """The registry verbs a publication by verbs calls."""

    async def reserve(self, *, request_id: str, version_id: str, digest: str) -> Reservation: ...

    async def record_ready(self, *, request_id: str, receipt: ReadyReceipt) -> VersionStatus: ...

    async def commit(
        self, *, request_id: str, version_id: str, attempt: int, expected_default_revision: int
    ) -> CommitReceipt: ...

    async def status(self) -> RegistryStatus: ...


Incarnation = str | Callable[[str], str]
"""One incarnation for every engine, or a function from engine name to its incarnation."""


def digest_for(version_id: str) -> str:
    """A stand-in content digest: SHA-256 of the version id, so each id has its own content."""
    return hashlib.sha256(version_id.encode()).hexdigest()


def receipt_for(reservation: Reservation, engine: str, incarnation: str = "inc-1") -> ReadyReceipt:
    """The READY receipt ``engine`` gives for ``reservation``'s attempt."""
    return ReadyReceipt(engine=engine, ref=reservation.ref, incarnation=incarnation)


async def ready_on(
    registry: PublishVerbs,
    reservation: Reservation,
    engines: Iterable[str],
    *,
    incarnation: Incarnation = "inc-1",
) -> None:
    """Record READY for ``reservation``'s attempt from each of ``engines``, in order."""
    for engine in engines:
        named = incarnation if isinstance(incarnation, str) else incarnation(engine)
        await registry.record_ready(
            request_id=new_request_id(), receipt=receipt_for(reservation, engine, named)
        )


async def commit_staged(registry: PublishVerbs, reservation: Reservation) -> CommitReceipt:
    """Commit a staged version against the default revision the registry reports now."""
    status = await registry.status()
    return await registry.commit(
        request_id=new_request_id(),
        version_id=reservation.version_id,
        attempt=reservation.attempt,
        expected_default_revision=status.default_revision,
    )


async def publish_by_verbs(
    registry: PublishVerbs,
    version_id: str,
    engines: Iterable[str],
    *,
    digest: str | None = None,
    incarnation: Incarnation = "inc-1",
    commit: bool = True,
) -> Reservation:
    """Reserve, record READY from every one of ``engines``, commit; the reservation.

    ``digest`` defaults to :func:`digest_for` of the id; ``incarnation`` is what each READY
    receipt names (the registry checks it against what it observed of the engine, if anything).
    With ``commit=False`` the version is left staged: READY from ``engines``, not committed.
    """
    reservation = await registry.reserve(
        request_id=new_request_id(),
        version_id=version_id,
        digest=digest if digest is not None else digest_for(version_id),
    )
    await ready_on(registry, reservation, engines, incarnation=incarnation)
    if commit:
        await commit_staged(registry, reservation)
    return reservation


stage = functools.partial(publish_by_verbs, commit=False)
"""Reserve and record READY from ``engines``, without committing (:func:`publish_by_verbs`)."""
