"""An engine or sidecar restart changes the incarnation and is never mistaken for progress."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendRefusedError
from tests.dcs.conftest import Cases
from tests.dcs.conftest import Publisher
from tests.dcs.util import BUCKET_BYTES
from tests.dcs.util import SidecarProcess

pytestmark = [pytest.mark.dcs, pytest.mark.asyncio, pytest.mark.timeout(60)]


async def test_engine_restart_changes_the_incarnation_and_fences_messages_for_the_old_one(
    cases: Cases, publisher: Publisher
) -> None:
    case = cases("E1", seed=41, version_id="restart-before-begin")
    before = await publisher.backend.incarnation(case.sidecar.engine)
    # A Begin prepared against the old engine process (the publisher read it before the restart).
    publisher.edge.before("/begin", case.restart_engine)

    refused = await publisher.prepare_fails(case, BackendRefusedError, "INCARNATION_MISMATCH")

    after = await publisher.backend.incarnation(case.sidecar.engine)
    assert before != after
    assert before.split("/")[0] == after.split("/")[0] == case.sidecar.sidecar_id
    assert refused["current"] == after
    assert await case.view() is None


async def test_engine_restart_between_transfer_and_load_is_a_clean_refusal(
    cases: Cases, publisher: Publisher
) -> None:
    case = cases("E0", seed=42, version_id="restart-before-end")
    publisher.edge.before("/end", case.restart_engine)

    await publisher.prepare_fails(case, BackendRefusedError, "ENGINE_RESTARTED")

    assert await case.loads() == 0
    assert await case.stash_bytes() == 0
    assert await case.state() == "FAILED"


async def test_engine_restart_right_after_the_load_is_ambiguous_until_cleaned_up(
    cases: Cases, publisher: Publisher
) -> None:
    case = cases("E1", seed=43, version_id="restart-after-load")
    await case.script("load", "restart_after")

    await publisher.prepare_fails(case, BackendAmbiguousError, "ENGINE_UNCERTAIN")

    assert await case.state() == "UNCERTAIN"
    assert case.stored()

    await publisher.cleanup(case)

    assert await case.state() == "CLEANED"
    assert await case.served() is None
    assert not case.stored()


@pytest.fixture
def lone_sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    sidecar = SidecarProcess.start("E9", tmp_path / "store")
    try:
        yield sidecar
    finally:
        sidecar.stop()


async def test_sidecar_restart_changes_the_incarnation_and_refuses_the_old_attempt(
    lone_sidecar: SidecarProcess, cases: Cases
) -> None:
    case = cases.on(lone_sidecar, seed=44, version_id="sidecar-restart")
    publisher = Publisher({"E9": lone_sidecar}, BUCKET_BYTES)
    try:
        before = await publisher.backend.incarnation(case.sidecar.engine)
        await publisher.prepare(case)
        old_begin = publisher.edge.bodies("/begin")[0]
        old_end = publisher.edge.bodies("/end")[0]

        lone_sidecar.stop()
        restarted = SidecarProcess.start("E9", lone_sidecar.store_dir)
        try:
            again = replace(case, sidecar=restarted)
            begin = await again.resend("/begin", old_begin)
            end = await again.resend("/end", old_end)
            fresh = Publisher({"E9": restarted}, BUCKET_BYTES)
            try:
                after = await fresh.backend.incarnation(restarted.engine)
            finally:
                await fresh.aclose()
        finally:
            restarted.stop()
    finally:
        await publisher.aclose()

    assert before.split("/")[0] != after.split("/")[0]
    assert begin.status_code == 409
    assert begin.json()["reason"] == "INCARNATION_MISMATCH"
    assert begin.json()["clean"] is True
    # An End that crossed the restart may have loaded through the old sidecar: not clean.
    assert end.status_code == 503
    assert end.json()["reason"] == "INCARNATION_MISMATCH"
    assert end.json()["clean"] is False


async def test_an_engine_that_cannot_be_reached_at_begin_is_a_clean_refusal(
    cases: Cases, publisher: Publisher
) -> None:
    case = cases("E0", seed=45, version_id="engine-unreachable")
    publisher.edge.before("/begin", lambda: case.script("server_info", "unreachable"))

    await publisher.prepare_fails(case, BackendRefusedError, "ENGINE_UNAVAILABLE")

    assert await case.state() is None
