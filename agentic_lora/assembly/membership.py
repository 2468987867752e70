"""Membership changes at runtime, with their I/O: an engine joins (every dispatchable version
loaded onto it, then ACTIVE) or drains (no new work, its in-flight requests waited for, then
REMOVED). The registry's rules are :mod:`agentic_lora.registry.membership`; this module is what a
:class:`~agentic_lora.assembly.deployment.Deployment` does around them.

**Join** (:func:`join_engine`)::

    join (JOINING) -> repair round (load the default and every version Sessions are bound to)
      -> [publisher held] repair round again -> activate (ACTIVE)

The first round does the long loads without holding anything: publications go on meanwhile and
never wait for the joining engine (it is not in their set of engines). The last round and the
activation run with the publisher held (:meth:`~agentic_lora.publication.publisher.Publisher.exclusive`):
a publication that committed during the first round has its version loaded onto the engine by the
second, and none can commit between that round and the activation. So the engine is ACTIVE
holding every dispatchable version, and a publication that starts meanwhile waits at most for
one round (usually nothing to load).

**Drain** (:func:`drain_engine`)::

    drain (DRAINING: no new request is routed to it) -> wait for its in-flight requests
      -> [publisher held] remove (REMOVED: its slots leave the count)        -> DrainOutcome.REMOVED
      or, at the bound, left DRAINING                                        -> DrainOutcome.TIMED_OUT

From the registry step on, no request of this process is routed to the engine (the Sessions'
routing counts a request in the same step as it reads the holders, see
:class:`~agentic_lora.session.middleware.RoutingMiddleware`), so waiting for the engine's count to
reach zero is exact for this process. The removal runs with the publisher held so that a
publication whose engines included it (reserved before the drain) finishes first. The bound
defaults to ``request_timeout`` + :data:`DRAIN_GRACE`: every request ends within
``request_timeout``, so a request still running past it means something is wrong. Then the
engine is left DRAINING and the outcome says TIMED_OUT with the count still in flight; draining
it again waits again, and ``remove_engine`` removes it regardless.

Only this process's Sessions are waited for. Rollout workers in other processes (a Ray
registry) stop routing to the engine once their view of the registry shows it (their refresh
interval), and their requests end within ``request_timeout``; removing an engine never unloads or
stops anything on it, so such a request still completes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentic_lora.errors import ConfigurationError
from agentic_lora.publication.publisher import Publisher
from agentic_lora.publication.repair import Repairer
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.types import MemberState
from agentic_lora.registry.types import new_request_id
from agentic_lora.session import Versioning

__all__ = ["DRAIN_GRACE", "DrainOutcome", "DrainResult", "drain_engine", "join_engine"]

logger = logging.getLogger(__name__)

#: Seconds a drain waits beyond ``request_timeout`` for the engine's in-flight requests.
DRAIN_GRACE = 5.0


class DrainOutcome(enum.StrEnum):
    """How a drain ended."""

    REMOVED = "REMOVED"  # its in-flight requests ended within the bound; it left the fleet
    DRAINED = "DRAINED"  # they ended; left DRAINING as asked (``remove=False``)
    TIMED_OUT = "TIMED_OUT"  # requests still in flight at the bound; left DRAINING


@dataclass(frozen=True, slots=True)
class DrainResult:
    """One drain: its outcome, the engine's membership after it, and what it waited for."""

    engine: str
    outcome: DrainOutcome
    membership: MemberState
    #: Requests of this process in flight on the engine when it stopped taking new ones.
    in_flight_at_drain: int
    #: Requests of this process still in flight on it at the end (0 unless TIMED_OUT).
    in_flight: int
    waited_s: float

    def as_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "outcome": self.outcome.value,
            "membership": self.membership.value,
            "in_flight_at_drain": self.in_flight_at_drain,
            "in_flight": self.in_flight,
            "waited_s": round(self.waited_s, 3),
        }


async def _membership(registry: RegistryAPI, engine: str) -> MemberState:
    members = {e.engine: e.membership for e in (await registry.status()).engines}
    return members.get(engine, MemberState.REMOVED)


async def join_engine(
    registry: RegistryAPI, repairer: Repairer, publisher: Publisher, engine: str
) -> MemberState:
    """``engine`` joins (see the module docstring); ``MEMBER_NOT_READY`` if a version could not
    be loaded onto it (it stays JOINING: the repairer keeps loading; call it again)."""
    state = await _membership(registry, engine)
    if state is MemberState.ACTIVE:
        return state
    if state is MemberState.DRAINING:
        raise ConfigurationError(
            f"engine {engine!r} is draining; remove it before adding it again", check="engine"
        )
    if state is MemberState.REMOVED:
        await registry.join_engine(request_id=new_request_id(), engine=engine)
        logger.info("engine joining", extra={"engine": engine})
    await repairer.repair_once()  # observes its incarnation, loads what it lacks
    async with publisher.exclusive():
        report = await repairer.repair_once()  # whatever committed meanwhile
        incarnation = report.incarnations.get(engine)
        result = await registry.activate_engine(
            request_id=new_request_id(), engine=engine, incarnation=incarnation or "-"
        )
    logger.warning("engine active", extra={"engine": engine, "incarnation": incarnation})
    return result


async def drain_engine(
    registry: RegistryAPI,
    versioning: Versioning,
    publisher: Publisher,
    engine: str,
    *,
    routed: Sequence[str],
    wait_bound: float,
    remove: bool = True,
    monotonic: Callable[[], float] = time.monotonic,
) -> DrainResult:
    """``engine`` drains (see the module docstring). ``routed``: the routed engines whose
    requests reach it (itself, or the PD groups it serves in); ``wait_bound``: the bound of the
    wait in seconds. Raises ``DRAIN_REFUSED`` (the last ACTIVE member, or an EJECTED one) and
    ``UNKNOWN_ENGINE``."""
    started = monotonic()
    state = await _membership(registry, engine)
    if state is not MemberState.DRAINING:
        # Drained again (a wait that timed out before) it only waits again.
        await registry.drain_engine(request_id=new_request_id(), engine=engine)
    at_drain = sum(versioning.engine_in_flight(r) for r in routed)
    extra = {"engine": engine, "in_flight": at_drain, "wait_bound_s": wait_bound}
    logger.warning("engine draining: no new requests", extra=extra)
    waits = asyncio.gather(*(versioning.wait_engine_drained(r) for r in routed))
    try:
        await asyncio.wait_for(waits, wait_bound)
    except TimeoutError:
        left = sum(versioning.engine_in_flight(r) for r in routed)
        logger.error("engine drain timed out; left DRAINING", extra={**extra, "in_flight": left})
        return DrainResult(
            engine,
            DrainOutcome.TIMED_OUT,
            MemberState.DRAINING,
            at_drain,
            left,
            monotonic() - started,
        )
    if not remove:
        return DrainResult(
            engine, DrainOutcome.DRAINED, MemberState.DRAINING, at_drain, 0, monotonic() - started
        )
    async with publisher.exclusive():
        membership = await registry.remove_engine(request_id=new_request_id(), engine=engine)
    logger.warning("drained engine removed", extra={"engine": engine})
    return DrainResult(engine, DrainOutcome.REMOVED, membership, at_drain, 0, monotonic() - started)
