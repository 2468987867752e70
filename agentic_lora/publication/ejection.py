"""Ejection: an engine that fails its health probes for ``eject_after`` seconds leaves the
publication set, so one hung engine never stalls a publication for its whole load timeout.

The repairer's probe reads every engine's incarnation each ``probe_interval`` (bounded by
``probe_timeout``). The :class:`Ejector` is told each round's reads:

* an engine whose reads have failed since a round that started ``eject_after`` seconds ago or
  more is ejected in the registry (``eject_engine``, fenced by the incarnation the registry
  holds for it), and then marked in :class:`Ejections`, which a running publication waits on:
  the publisher stops waiting for an ejected engine's load and commits over the live members
  (the registry no longer counts it for readiness), and a reclaim or a publication's cleanup
  stops waiting for its unload (the version stays RECLAIMING or ABORTED, its slot held, and is
  finished there once the engine answers again), so no call on a hung engine holds the trainer
  for its timeout;
* an EJECTED engine that answers again rejoins only after repair: the repairer loads every
  dispatchable version onto it (it answers, so it is repaired like a restarted engine), and
  ``activate_engine`` with its observed incarnation succeeds only once it holds them all
  (``MEMBER_NOT_READY`` until then: tried again next round).

The registry's refusal wins over this process's view: an ejection refused because the engine
restarted (``ENGINE_RESTARTED``) or is no longer a member changes nothing here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Mapping
from typing import TypeVar

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.types import MemberState
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import new_request_id

__all__ = ["DEFAULT_EJECT_AFTER", "ENGINE_EJECTED", "Ejections", "Ejector"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds of failed health probes after which an engine is ejected (the documented default).
DEFAULT_EJECT_AFTER = 10.0

#: A publication's report of an engine ejected while it waited on it (not waited for any more).
ENGINE_EJECTED = "ENGINE_EJECTED"

_EJECTABLE = (MemberState.ACTIVE, MemberState.JOINING, MemberState.DRAINING)


class Ejections:
    """Which engines this process saw ejected: an :class:`asyncio.Event` per engine, set while
    it is ejected, that a publication waiting on the engine races its work against."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def _event(self, engine: str) -> asyncio.Event:
        return self._events.setdefault(engine, asyncio.Event())

    def is_ejected(self, engine: str) -> bool:
        return self._event(engine).is_set()

    def mark(self, engine: str, ejected: bool) -> None:
        if ejected:
            self._event(engine).set()
        else:
            self._event(engine).clear()

    async def unless_ejected(self, engine: str, work: Awaitable[T], ejected: Callable[[], T]) -> T:
        """``work``'s answer; or, once ``engine`` is ejected (before ``work`` ends), ``work``
        cancelled and ``ejected()``'s answer."""
        flag = self._event(engine)
        task = asyncio.ensure_future(work)
        if flag.is_set():
            task.cancel()
            return ejected()
        waiter = asyncio.ensure_future(flag.wait())
        try:
            await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.wait((task,))  # its end (cancelled, or whatever) is not this call's answer
        return ejected()


async def unless_ejected(
    ejections: Ejections | None, engine: str, work: Awaitable[T], ejected: Callable[[], T]
) -> T:
    """:meth:`Ejections.unless_ejected`; with no ``ejections`` (ejection off), ``work``'s answer.
    What publication, cleanup and reclaim share: none of them waits for an ejected engine."""
    if ejections is None:
        return await work
    return await ejections.unless_ejected(engine, work, ejected)


class Ejector:
    """Ejects engines whose probes fail for ``eject_after`` seconds and reactivates repaired
    ones (see module docstring). ``eject_after=None`` turns ejection off."""

    def __init__(
        self,
        registry: RegistryAPI,
        ejections: Ejections,
        *,
        eject_after: float | None = DEFAULT_EJECT_AFTER,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.ejections = ejections
        self.eject_after = eject_after
        self._monotonic = monotonic
        self._failing_since: dict[str, float] = {}

    def round_started(self) -> float:
        return self._monotonic()

    async def observe(
        self,
        started: float,
        incarnations: Mapping[str, str | None],
        status: RegistryStatus | None,
    ) -> None:
        """One probe round's reads (``None``: the engine did not answer), begun at ``started``."""
        if status is None:
            return  # the registry did not answer: nothing to decide against
        members = {e.engine: e for e in status.engines}
        now = self._monotonic()
        for engine, incarnation in incarnations.items():
            member = members.get(engine)
            if member is None:
                continue
            if incarnation is None:
                since = self._failing_since.setdefault(engine, started)
                if (
                    self.eject_after is not None
                    and now - since >= self.eject_after
                    and member.membership in _EJECTABLE
                ):
                    await self._eject(engine, member.incarnation, now - since)
                continue
            self._failing_since.pop(engine, None)
            if member.membership is MemberState.EJECTED and member.incarnation == incarnation:
                await self._activate(engine, incarnation)

    async def _eject(self, engine: str, incarnation: str | None, failing: float) -> None:
        try:
            await self.registry.eject_engine(
                request_id=new_request_id(), engine=engine, incarnation=incarnation
            )
        except AgenticLoRAError as exc:
            logger.warning(
                "ejection refused",
                extra={"engine": engine, "error_code": exc.code},
            )
            return
        self.ejections.mark(engine, True)
        logger.error(
            "engine ejected after failing its health probes",
            extra={"engine": engine, "incarnation": incarnation, "failing_s": round(failing, 3)},
        )

    async def _activate(self, engine: str, incarnation: str) -> None:
        try:
            await self.registry.activate_engine(
                request_id=new_request_id(), engine=engine, incarnation=incarnation
            )
        except AgenticLoRAError as exc:
            # MEMBER_NOT_READY until the repair loaded every dispatchable version: next round.
            logger.info(
                "ejected engine not rejoined yet", extra={"engine": engine, "error_code": exc.code}
            )
            return
        self.ejections.mark(engine, False)
        logger.warning(
            "ejected engine rejoined after repair",
            extra={"engine": engine, "incarnation": incarnation},
        )
