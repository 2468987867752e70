"""The registry as a detached Ray actor on a local Ray cluster: one writer shared by name, typed
errors across the process boundary, lost replies replayed by request id, a killed actor that
comes back from its journal, and owner leases kept by workers through the actor."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from agentic_lora.errors import CapacityError  # noqa: E402
from agentic_lora.errors import NoPublishedVersionError  # noqa: E402
from agentic_lora.errors import SessionClosedError  # noqa: E402
from agentic_lora.leases import LeaseKeeper  # noqa: E402
from agentic_lora.registry.ray_actor import RayRegistryClient  # noqa: E402
from agentic_lora.registry.ray_actor import connect  # noqa: E402
from agentic_lora.registry.types import new_request_id  # noqa: E402
from agentic_lora.testing.publish import commit_staged  # noqa: E402
from agentic_lora.testing.publish import publish_by_verbs  # noqa: E402
from agentic_lora.testing.publish import stage  # noqa: E402

from .util import E0  # noqa: E402
from .util import E1  # noqa: E402
from .util import digest_of  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.asyncio]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray.init(
        num_cpus=2, include_dashboard=False, namespace="agentic-lora-tests", log_to_driver=False
    )
    try:
        yield
    finally:
        ray.shutdown()


def _client(name: str, journal: Path | None) -> RayRegistryClient:
    return connect(engines=(E0, E1), capacity=2, journal_path=journal, name=name, namespace="t")


async def _publish(reg: RayRegistryClient, version_id: str) -> None:
    await publish_by_verbs(reg, version_id, (E0, E1))


async def test_clients_share_one_named_writer_and_errors_stay_typed(
    ray_cluster: None, tmp_path: Path
) -> None:
    a = _client("shared", tmp_path / "j.sqlite")
    b = _client("shared", tmp_path / "j.sqlite")  # get_if_exists: the same actor
    with pytest.raises(NoPublishedVersionError):
        await a.bind_first(request_id=new_request_id(), session_key="s0")
    await _publish(a, "A")
    binding = await b.bind_first(request_id="bind-1", session_key="s1")
    assert binding.version_id == "A"
    # A lost reply: the caller replays with the same request id and gets the same answer.
    assert await a.bind_first(request_id="bind-1", session_key="s1") == binding
    assert (await b.version("A")).session_refs == 1
    await b.begin_close(request_id=new_request_id(), session_key="s1")
    with pytest.raises(SessionClosedError) as err:
        await a.bind_first(request_id=new_request_id(), session_key="s1")
    assert err.value.code == "SESSION_CLOSED"
    await _publish(a, "B")
    with pytest.raises(CapacityError) as cap:
        await a.reserve(request_id=new_request_id(), version_id="C", digest=digest_of("C"))
    assert sorted(cap.value.details["held"]) == ["A", "B"]
    assert await a.fetch_version("nope") is None
    # Concurrent calls are coalesced into batches; each still gets its own answer or error.
    many = await asyncio.gather(
        *(a.bind_first(request_id=f"m{i}", session_key=f"m{i}") for i in range(50)),
        a.bind_first(request_id=new_request_id(), session_key="s1"),
        return_exceptions=True,
    )
    assert [m.version_id for m in many[:50]] == ["B"] * 50  # type: ignore[union-attr]
    assert isinstance(many[50], SessionClosedError)
    assert (await a.version("B")).session_refs == 50
    ray.kill(a.actor, no_restart=True)


async def test_a_bind_refreshes_a_version_the_cache_saw_while_it_was_loading(
    ray_cluster: None, tmp_path: Path
) -> None:
    trainer = _client("loading-cache", None)
    worker = _client("loading-cache", None)
    await _publish(trainer, "A")
    staged = await stage(trainer, "B", (E0, E1))
    await worker.refresh()  # a periodic refresh during B's publication
    loading = worker.peek_version("B")
    assert loading is not None
    assert loading.state.value == "LOADING"
    await commit_staged(trainer, staged)
    binding = await worker.bind_first(request_id=new_request_id(), session_key="s-new")
    assert binding.version_id == "B"
    # The dispatch guard reads this cache: it must not refuse the new Session's first request.
    cached = worker.peek_version("B")
    assert cached is not None
    assert cached.state.dispatchable
    assert cached.ready_engines == (E0, E1)
    ray.kill(trainer.actor, no_restart=True)


async def test_a_killed_actor_restarts_from_its_journal(ray_cluster: None, tmp_path: Path) -> None:
    reg = _client("restarting", tmp_path / "j.sqlite")
    await _publish(reg, "A")
    await reg.bind_first(request_id="bind-old", session_key="s_old")
    await _publish(reg, "B")
    before = await reg.status()
    pid_before = await reg.actor.pid.remote()
    ray.kill(reg.actor, no_restart=False)  # a crash: Ray restarts it (max_restarts=-1)

    async def replayed(call: Callable[[], Awaitable[Any]]) -> Any:
        # A call that fails with "the actor was restarted; the task may or may not have run" is a
        # lost reply: the caller replays it (same request id). Bounded, not a timing assertion.
        # The restarted actor may also refuse its first creations with JOURNAL_LOCKED until the
        # killed process has fully exited and the OS released its journal lock.
        deadline = time.monotonic() + 240.0
        while time.monotonic() < deadline:
            try:
                return await call()
            except ray.exceptions.RayError:
                await asyncio.sleep(0.05)
        raise AssertionError("actor did not come back within 240 s")

    assert await replayed(reg.status) == before
    assert await replayed(lambda: reg.actor.pid.remote()) != pid_before
    replay = await replayed(lambda: reg.bind_first(request_id="bind-old", session_key="s_old"))
    assert replay.version_id == "A"
    assert (await replayed(lambda: reg.version("A"))).session_refs == 1
    ray.kill(reg.actor, no_restart=True)


def _never(delay: float) -> asyncio.Future[None]:
    """The sleep of a dead worker: its keeper never renews again."""
    return asyncio.get_running_loop().create_future()


async def test_workers_keep_leases_through_the_actor_restarts_release_and_the_sweeper_expires(
    ray_cluster: None, tmp_path: Path
) -> None:
    journal = tmp_path / "j.sqlite"
    w1, w2 = _client("leases", journal), _client("leases", journal)  # two workers, one actor
    await _publish(w1, "A")
    dead = LeaseKeeper(w1, owner="worker-1", ttl=60, sleep=_never)
    alive = LeaseKeeper(w2, owner="worker-2", ttl=60)
    for keeper, client, key in ((dead, w1, "w1-s"), (alive, w2, "w2-s")):
        term = await keeper.acquire()
        await client.bind_first(request_id=new_request_id(), session_key=key, lease=term.lease_id)
    assert (await w2.version("A")).session_refs == 2

    # Worker 1 restarts: a new process (client and keeper), the same owner id. Its
    # predecessor's Session is released by the open itself, not by a TTL.
    w1b = _client("leases", journal)
    restarted = LeaseKeeper(w1b, owner="worker-1", ttl=60)
    await restarted.acquire()
    assert restarted.current.incarnation != dead.current.incarnation
    assert (await w1b.version("A")).session_refs == 1

    # A worker that stops renewing: the actor's own sweeper expires its lease after the TTL.
    # Polled with a generous bound: the verdict does not depend on how fast this machine is.
    silent = LeaseKeeper(w2, owner="worker-3", ttl=1.0, sleep=_never)
    term = await silent.acquire()
    await w2.bind_first(request_id=new_request_id(), session_key="w3-s", lease=term.lease_id)
    assert (await w2.version("A")).session_refs == 2
    give_up = time.monotonic() + 60
    while (await w2.version("A")).session_refs != 1:
        assert time.monotonic() < give_up, "the actor's sweeper never expired the silent lease"
        await asyncio.sleep(0.1)
    owners = {lease.owner for lease in (await w2.status()).leases}
    assert owners == {"worker-1", "worker-2"}  # the renewing ones are untouched

    for keeper in (dead, alive, restarted, silent):
        await keeper.aclose()
    assert (await w2.status()).leases == ()
    ray.kill(w1.actor, no_restart=True)
