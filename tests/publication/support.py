"""What the publisher, reclaimer and resolver tests share (no tests here): the snapshots, the
registry retry, the progress recorder, a lossy registry link, and the fleet, registry and backend
every test world stands on."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from typing import Protocol

from agentic_lora_http import HttpPushBackend
from tenacity import wait_none

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.publication.publisher import Phase
from agentic_lora.publication.publisher import PhaseEvent
from agentic_lora.publication.publisher import PhaseStatus
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.publication.publisher import Publisher
from agentic_lora.publication.publisher import RegistryRetry
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from tests.publication_support import RegistryReads

A, B, C = tiny_snapshot(1), tiny_snapshot(2), tiny_snapshot(3)
FAST = RegistryRetry(attempts=3, wait=wait_none())


class Progress:
    """Collects progress events; hands out asyncio.Events that fire on a matching one."""

    def __init__(self) -> None:
        self.events: list[PhaseEvent] = []
        self._waiters: list[tuple[Callable[[PhaseEvent], bool], asyncio.Event]] = []

    def __call__(self, event: PhaseEvent) -> None:
        self.events.append(event)
        for matches, flag in self._waiters:
            if matches(event):
                flag.set()

    def when(
        self, engine: str | None, phase: Phase, status: PhaseStatus = PhaseStatus.DONE
    ) -> asyncio.Event:
        flag = asyncio.Event()
        self._waiters.append(
            (lambda e: (e.engine, e.phase, e.status) == (engine, phase, status), flag)
        )
        return flag


class LossyRegistry:
    """The real registry behind a link that can drop replies: the call runs, its answer is lost."""

    def __init__(self, inner: LocalRegistry) -> None:
        self.inner = inner
        self.drop: Counter[str] = Counter()
        self.seen: list[tuple[str, str | None]] = []

    def __getattr__(self, verb: str) -> Any:
        target = getattr(self.inner, verb)
        if not asyncio.iscoroutinefunction(target):
            return target

        async def call(*args: Any, **kwargs: Any) -> Any:
            self.seen.append((verb, kwargs.get("request_id")))
            result = await target(*args, **kwargs)
            if self.drop[verb] > 0:
                self.drop[verb] -= 1
                raise ConnectionError(f"{verb} reply lost")
            return result

        return call


@dataclass
class LinkedWorld(RegistryReads):
    """A world whose publisher talks to the real registry through a :class:`LossyRegistry` and
    reports its progress to a :class:`Progress`."""

    fleet: ScriptedFleet
    registry: LocalRegistry
    link: LossyRegistry
    backend: HttpPushBackend
    publisher: Publisher
    progress: Progress


class Publishing(Protocol):
    publisher: Publisher


async def publish(
    world: Publishing, version_id: str, snapshot: AdapterSnapshot
) -> PublicationOutcome:
    """Publish through the world's publisher; only the outcome."""
    return (await world.publisher.publish(version_id, snapshot)).outcome


@dataclass
class Ground:
    """What every test world stands on: two scripted engines, the real registry on them (and a
    lossy link to it, for the worlds that lose replies), an HTTP push backend, a progress log."""

    fleet: ScriptedFleet
    registry: LocalRegistry
    link: LossyRegistry
    backend: HttpPushBackend
    progress: Progress


@contextlib.asynccontextmanager
async def ground(store: Path) -> AsyncIterator[Ground]:
    """A :class:`Ground` whose backend stores under ``store``. The backend, then the registry,
    close after the world's own parts (the code in the ``async with`` after its ``yield``)."""
    with ScriptedFleet(("e0", "e1")) as fleet:
        registry = LocalRegistry(engines=("e0", "e1"), capacity=2)
        backend = HttpPushBackend(store)
        try:
            yield Ground(fleet, registry, LossyRegistry(registry), backend, Progress())
        finally:
            await backend.aclose()
            await registry.aclose()
