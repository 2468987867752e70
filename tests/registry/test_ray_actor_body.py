"""The Ray actor's body and client, in this process: errors travel as data and come back typed,
every verb round-trips through the wire form, and a lost batch reply reaches every caller."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import RollbackRefusedError
from agentic_lora.errors import SessionStillBoundError
from agentic_lora.errors import UnknownVersionError
from agentic_lora.registry.ray_actor import RayRegistryClient
from agentic_lora.registry.ray_actor import RegistryActor
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.registry.types import ReserveOutcome
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import new_request_id

from .util import E0
from .util import E1
from .util import digest_of

pytestmark = pytest.mark.asyncio


class _Method:
    """Stands in for a Ray actor method handle: ``.remote(...)`` returns an awaitable."""

    def __init__(self, fn: Any, lose: list[bool]) -> None:
        self._fn = fn
        self._lose = lose

    def remote(self, *args: Any) -> Any:
        async def run() -> Any:
            result = await self._fn(*args)
            if self._lose and self._lose.pop(0):
                raise ConnectionError("reply lost after the actor ran the call")
            return result

        return run()


class _Handle:
    def __init__(self, actor: RegistryActor, lose: list[bool]) -> None:
        self.call = _Method(actor.call, lose)
        self.call_batch = _Method(actor.call_batch, lose)
        self.read = _Method(actor.read, [])
        self.start = _Method(actor.start, [])


@pytest.mark.parametrize("coalesce", [True, False])
async def test_every_verb_round_trips_through_the_wire_form(tmp_path: Path, coalesce: bool) -> None:
    actor = RegistryActor(
        {"engines": [E0, E1], "capacity": 3, "journal_path": str(tmp_path / "j.sqlite")}
    )
    reg = RayRegistryClient(_Handle(actor, []), coalesce=coalesce)
    for vid in ("A", "B"):
        r = await reg.reserve(request_id=new_request_id(), version_id=vid, digest=digest_of(vid))
        for e in (E0, E1):
            await reg.observe_incarnation(request_id=new_request_id(), engine=e, incarnation="i")
            await reg.record_ready(
                request_id=new_request_id(),
                receipt=ReadyReceipt(e, r.ref, "i"),
            )
        st = await reg.status()
        await reg.commit(
            request_id=new_request_id(),
            version_id=vid,
            attempt=1,
            expected_default_revision=st.default_revision,
        )
        if vid == "A":
            await reg.bind_first(request_id=new_request_id(), session_key="s")
    rc = await reg.reserve(request_id=new_request_id(), version_id="C", digest=digest_of("C"))
    await reg.abort(request_id=new_request_id(), version_id="C", attempt=rc.attempt, reason="t")
    for e in (E0, E1):
        await reg.confirm_cleanup(request_id=new_request_id(), version_id="C", attempt=1, engine=e)
    assert (await reg.version("C")).state is VersionState.FAILED_CLEAN
    with pytest.raises(SessionStillBoundError):
        await reg.claim_reclaim(request_id=new_request_id(), version_id="A")
    await reg.begin_close(request_id=new_request_id(), session_key="s")
    assert (await reg.release(request_id=new_request_id(), session_key="s")).released_now
    assert await reg.forget_sessions(request_id=new_request_id(), session_keys=["s"]) == 1
    claim = await reg.claim_reclaim(request_id=new_request_id(), version_id="A")
    for e in (E0, E1):
        await reg.confirm_reclaim(
            request_id=new_request_id(), version_id="A", reclaim_id=claim.reclaim_id, engine=e
        )
    # Rollbacks: to A (RECLAIMED) by a reload, then to B (RETIRED) in one step; the receipts, bindings and refusals cross the wire typed.
    with pytest.raises(RollbackRefusedError) as refused:
        await reg.rollback(
            request_id=new_request_id(), version_id="B", attempt=1, expected_default_revision=2
        )
    assert refused.value.details["reason"] == "current_default"
    reload = await reg.reserve_rollback(request_id=new_request_id(), version_id="A")
    assert (reload.outcome, reload.attempt) == (ReserveOutcome.RELOAD_STARTED, 2)
    for e in (E0, E1):
        await reg.record_ready(
            request_id=new_request_id(), receipt=ReadyReceipt(e, reload.ref, "i")
        )
    back = await reg.commit(
        request_id=new_request_id(), version_id="A", attempt=2, expected_default_revision=2
    )
    assert (back.rollback, back.previous_default, back.default_revision) == (True, "B", 3)
    bound = await reg.bind_first(request_id=new_request_id(), session_key="after")
    assert (bound.version_id, bound.rolled_back_from) == ("A", "B")
    again = await reg.rollback(
        request_id=new_request_id(), version_id="B", attempt=1, expected_default_revision=3
    )
    assert (again.rollback, again.previous_default) == (True, "A")
    assert (await reg.status()).rolled_back_from == "A"
    await reg.begin_close(request_id=new_request_id(), session_key="after")
    await reg.release(request_id=new_request_id(), session_key="after")
    claim = await reg.claim_reclaim(request_id=new_request_id(), version_id="A")
    assert claim.reclaim_id.endswith(".1")  # a reloaded version's reclaim gets its own id
    for e in (E0, E1):
        await reg.confirm_reclaim(
            request_id=new_request_id(), version_id="A", reclaim_id=claim.reclaim_id, engine=e
        )
    # This client saw A's status in the verbs' answers; another one lags until it refreshes.
    assert reg.peek_version("A").state is VersionState.RECLAIMED  # type: ignore[union-attr]
    watcher = RayRegistryClient(_Handle(actor, []))
    assert watcher.peek_version("A") is None
    await watcher.refresh()
    assert watcher.peek_version("A").state is VersionState.RECLAIMED  # type: ignore[union-attr]
    assert (await reg.fetch_version("A")).state is VersionState.RECLAIMED  # type: ignore[union-attr]
    assert await reg.fetch_version("nope") is None
    assert reg.peek_version("nope") is None
    with pytest.raises(UnknownVersionError):
        await reg.version("nope")
    await actor.flush()


async def test_unknown_verbs_and_reads_are_refused_as_data() -> None:
    actor = RegistryActor({"engines": [E0], "capacity": 2})
    assert (await actor.call("drop_everything", "r", {}))["ok"] is False
    assert (await actor.read("everything"))["ok"] is False
    assert actor.pid() > 0
    reg = RayRegistryClient(_Handle(actor, []))
    with pytest.raises(AgenticLoRAError, match="unknown read"):
        await reg._read("everything")


async def test_a_lost_batch_reply_fails_every_caller_and_a_replay_gets_the_first_answers() -> None:
    actor = RegistryActor({"engines": [E0], "capacity": 2})
    lose = [False, False, False, True]  # reserve, ready, commit go through; the bind batch is lost
    reg = RayRegistryClient(_Handle(actor, lose))
    r = await reg.reserve(request_id="r", version_id="A", digest=digest_of("A"))
    await reg.record_ready(request_id="rr", receipt=ReadyReceipt(E0, r.ref, "i"))
    await reg.commit(request_id="c", version_id="A", attempt=1, expected_default_revision=0)
    lost = await asyncio.gather(
        *(reg.bind_first(request_id=f"b{i}", session_key=f"s{i}") for i in range(5)),
        return_exceptions=True,
    )
    assert all(isinstance(x, ConnectionError) for x in lost)
    replayed = await asyncio.gather(
        *(reg.bind_first(request_id=f"b{i}", session_key=f"s{i}") for i in range(5))
    )
    assert {b.version_id for b in replayed} == {"A"}
    assert (await reg.version("A")).session_refs == 5  # the lost batch ran once, not twice


async def test_a_restarted_actor_sweeps_what_it_replayed_once_started_or_read(
    tmp_path: Path,
) -> None:
    config = {"engines": [E0], "capacity": 2, "journal_path": str(tmp_path / "j.sqlite")}
    first = RegistryActor(config)
    await first.call(
        "open_lease", new_request_id(), {"owner": "w", "incarnation": "i1", "ttl": 30.0}
    )
    await first.flush()
    # What Ray's max_restarts does: a new actor body replays the journal in its constructor.
    restarted = RegistryActor(config)
    assert not restarted._registry.sweeping
    await RayRegistryClient(_Handle(restarted, [])).start()  # what Deployment.start does
    assert restarted._registry.sweeping
    await restarted.flush()
    read_only = RegistryActor(config)
    await RayRegistryClient(_Handle(read_only, [])).status()
    assert read_only._registry.sweeping  # the actor is the host: any use starts its duties
    await read_only.flush()
