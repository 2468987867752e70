"""Small drivers for the registry core in tests: every call mints its own request id."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any

from agentic_lora.registry.core import RegistryCore
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import LeaseGrant
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.registry.types import Reservation
from agentic_lora.registry.types import new_request_id
from agentic_lora.testing.publish import digest_for
from agentic_lora.testing.publish import receipt_for

E0, E1 = "e0", "e1"

digest_of = digest_for


def registry_image(core: RegistryCore) -> dict[str, Any]:
    """The core's full image, through JSON (what the journal stores), for exact comparisons."""
    result: dict[str, Any] = json.loads(json.dumps(core.to_state()))
    return result


def call(core: RegistryCore, verb: str, request_id: str | None = None, **args: Any) -> Any:
    result, _ = core.execute(request_id or new_request_id(), verb, args)
    return result


def receipt(
    core: RegistryCore, r: Reservation, engine: str, incarnation: str = "inc-1"
) -> ReadyReceipt:
    return receipt_for(r, engine, incarnation)


def ready(core: RegistryCore, r: Reservation, *engines: str, incarnation: str = "inc-1") -> None:
    for e in engines or core.engines:
        call(core, "record_ready", receipt=receipt(core, r, e, incarnation))


def publish(core: RegistryCore, version_id: str, content: str | None = None) -> Reservation:
    """reserve -> READY on every engine -> commit; returns the reservation."""
    r: Reservation = call(
        core, "reserve", version_id=version_id, digest=digest_of(content or version_id)
    )
    ready(core, r)
    call(
        core,
        "commit",
        version_id=version_id,
        attempt=r.attempt,
        expected_default_revision=core.default_revision,
    )
    return r


def bind(core: RegistryCore, session: str) -> str:
    return str(call(core, "bind_first", session_key=session).version_id)


def close(core: RegistryCore, session: str) -> None:
    call(core, "begin_close", session_key=session)
    call(core, "release", session_key=session)


def reclaim(core: RegistryCore, version_id: str) -> None:
    claim = call(core, "claim_reclaim", version_id=version_id)
    for e in core.engines:
        call(core, "confirm_reclaim", version_id=version_id, reclaim_id=claim.reclaim_id, engine=e)


def new_core(capacity: int = 2, *, published: str | None = None, **kw: Any) -> RegistryCore:
    """A core on ``e0`` and ``e1`` (with ``published`` already published on both, when given)."""
    core = RegistryCore(engines=(E0, E1), capacity=capacity, **kw)
    if published is not None:
        publish(core, published)
    return core


def lease(
    core: RegistryCore,
    owner: str,
    incarnation: str,
    *,
    now: float,
    ttl: float = 10.0,
    on_restart: str = "release",
) -> LeaseGrant:
    grant: LeaseGrant = call(
        core,
        "open_lease",
        owner=owner,
        incarnation=incarnation,
        ttl=ttl,
        now=now,
        on_restart=on_restart,
    )
    return grant


def bind_on(core: RegistryCore, session: str, lease_id: str | None) -> Binding:
    binding: Binding = call(core, "bind_first", session_key=session, lease=lease_id)
    return binding


class FakeClock:
    """An injected registry clock: time moves only when a test (or machine rule) moves it."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class SweepGate:
    """A registry sweeper's ``sleep``: it returns only when :meth:`round` lets it, once per round,
    so a test (or machine rule) decides exactly when the registry host sweeps."""

    def __init__(self) -> None:
        self._pending: asyncio.Future[None] | None = None
        self._asleep = asyncio.Event()
        self.delays: list[float] = []

    def sleep(self, delay: float) -> Awaitable[None]:
        self.delays.append(delay)
        self._pending = asyncio.get_running_loop().create_future()
        self._asleep.set()
        return self._pending

    async def asleep(self) -> None:
        """Return once the sweeper waits on this gate."""
        async with asyncio.timeout(30):  # a hang guard only
            await self._asleep.wait()

    async def round(self) -> None:
        """Wake the sweeper for one round; return once it sleeps again (that round is done)."""
        await self.asleep()
        assert self._pending is not None
        self._asleep.clear()
        self._pending.set_result(None)
        await self.asleep()
