"""The shipped publish-by-verbs helper against the real local registry."""

from __future__ import annotations

import hashlib

import pytest

from agentic_lora.errors import NotReadyError
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import VersionState
from agentic_lora.testing.publish import commit_staged
from agentic_lora.testing.publish import digest_for
from agentic_lora.testing.publish import publish_by_verbs
from agentic_lora.testing.publish import receipt_for
from agentic_lora.testing.publish import stage

ENGINES = ("e0", "e1")


@pytest.mark.asyncio
async def test_publish_by_verbs_commits_and_moves_the_default_each_time() -> None:
    registry = LocalRegistry(engines=ENGINES, capacity=2)
    try:
        a = await publish_by_verbs(registry, "A", ENGINES)
        b = await publish_by_verbs(registry, "B", ENGINES, digest="ab" * 32)
        status = await registry.status()
        assert status.default_version == "B"
        assert status.default_revision == 2
        assert a.digest == digest_for("A") == hashlib.sha256(b"A").hexdigest()
        assert b.digest == "ab" * 32
        assert (await registry.version("A")).state is VersionState.RETIRED
    finally:
        await registry.aclose()


@pytest.mark.asyncio
async def test_stage_records_ready_without_committing_and_names_each_engines_incarnation() -> None:
    registry = LocalRegistry(engines=ENGINES, capacity=2)
    try:
        await publish_by_verbs(registry, "A", ENGINES, incarnation=lambda e: f"{e}-boot-7")
        staged = await stage(registry, "B", ("e0",), incarnation=lambda e: f"{e}-boot-7")
        # Only e0 is READY: the commit is refused and the default stays A.
        with pytest.raises(NotReadyError):
            await commit_staged(registry, staged)
        assert (await registry.status()).default_version == "A"
        status = await registry.status()
        assert {e.engine: e.incarnation for e in status.engines} == {
            "e0": "e0-boot-7",
            "e1": "e1-boot-7",
        }
        assert (await registry.version("B")).ready_engines == ("e0",)
    finally:
        await registry.aclose()


def test_receipt_for_carries_the_reservations_identity() -> None:
    registry = LocalRegistry(engines=ENGINES, capacity=2)
    reservation, _ = registry.core.execute("r", "reserve", {"version_id": "A", "digest": "cd" * 32})
    receipt = receipt_for(reservation, "e1", "inc-9")
    assert (receipt.engine, receipt.version_id, receipt.digest) == ("e1", "A", "cd" * 32)
    assert (receipt.lora_name, receipt.attempt) == (reservation.lora_name, reservation.attempt)
    assert receipt.incarnation == "inc-9"
