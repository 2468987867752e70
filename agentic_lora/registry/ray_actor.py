"""The registry as a named, detached Ray actor with one writer, and an async client for it.

At fleet scale the rollout workers, the publisher and the reclaimer run in different processes and
must all ask the same single writer. :func:`connect` gets or creates one named, detached actor
(``get_if_exists``), so every process that connects with the same name shares it.

* The actor is an async actor holding a :class:`~agentic_lora.registry.local.LocalRegistry`;
  verbs never await anything but the journal, so each is atomic with respect to the others.
* Journal replay happens in the actor's constructor: with ``max_restarts`` a crashed actor comes
  back with every version, binding and slot it had accepted.
* Ray task retries are off (``max_task_retries=0``): a call whose reply was lost is replayed by the
  *caller*, with the same request id, and answered from the registry's memory of that id.
* Errors travel as data (code, message, details) and are rebuilt as the same typed errors here, so
  ``except CapacityError`` works across the process boundary.

Ray is an optional extra (``agentic-lora[ray]``); importing this module does not import Ray.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentic_lora.errors import AgenticLoRAError, error_from_code
from agentic_lora.registry.core import MUTATING_VERBS
from agentic_lora.registry.types import (
    Binding,
    RegistryStatus,
    VersionStatus,
    from_wire,
    to_wire,
)
from agentic_lora.registry.verbs import RegistryVerbs

__all__ = ["DEFAULT_NAME", "DEFAULT_NAMESPACE", "RayRegistryClient", "RegistryActor", "connect"]

DEFAULT_NAME = "agentic-lora-registry"
DEFAULT_NAMESPACE = "agentic-lora"


class RegistryActor:
    """The actor body (wrapped with ``ray.remote`` by :func:`connect`)."""

    def __init__(self, config: dict[str, Any]) -> None:
        from agentic_lora.registry.local import LocalRegistry

        self._registry = LocalRegistry(**config)

    async def call(self, verb: str, request_id: str, args: Any) -> dict[str, Any]:
        if verb not in MUTATING_VERBS:
            return _failure(AgenticLoRAError(f"unknown verb {verb!r}"))
        try:
            result = await getattr(self._registry, verb)(request_id=request_id, **from_wire(args))
        except AgenticLoRAError as exc:
            return _failure(exc)
        return {"ok": True, "result": to_wire(result)}

    async def call_batch(self, calls: list[tuple[str, str, Any]]) -> list[dict[str, Any]]:
        """Many verbs in one actor call; applied in list order, made durable together."""
        # Each call applies to the core before its first await, so gather keeps list order.
        return list(await asyncio.gather(*(self.call(v, rid, args) for v, rid, args in calls)))

    async def read(self, what: str, version_id: str | None = None) -> dict[str, Any]:
        try:
            if what == "status":
                result: Any = await self._registry.status()
            elif what == "version" and version_id is not None:
                result = await self._registry.version(version_id)
            elif what == "peek_version" and version_id is not None:
                result = self._registry.peek_version(version_id)
            else:
                raise AgenticLoRAError(f"unknown read {what!r}")
        except AgenticLoRAError as exc:
            return _failure(exc)
        return {"ok": True, "result": to_wire(result)}

    async def flush(self) -> None:
        """Close the journal cleanly (before a planned shutdown)."""
        await self._registry.aclose()

    def pid(self) -> int:
        import os

        return os.getpid()


def _failure(exc: AgenticLoRAError) -> dict[str, Any]:
    return {"ok": False, "error": to_wire(exc.to_dict())}


class RayRegistryClient(RegistryVerbs):
    """Implements :class:`~agentic_lora.registry.api.RegistryAPI` by calling the actor.

    Calls made in the same event-loop turn are coalesced into one actor call (``call_batch``):
    one Ray round trip carries many Sessions' binds and releases, and the actor makes them durable
    in one group commit. A lost batch reply fails every call in it; each caller replays its own
    call with its own request id, as with any lost reply.
    """

    def __init__(self, actor: Any, *, coalesce: bool = True) -> None:
        self._actor = actor
        self._coalesce = coalesce
        self._pending: list[tuple[str, str, Any, asyncio.Future[dict[str, Any]]]] = []
        self._deliveries: set[asyncio.Task[None]] = set()
        self._versions: dict[str, VersionStatus] = {}

    @property
    def actor(self) -> Any:
        return self._actor

    async def _call(self, verb: str, request_id: str, args: dict[str, Any]) -> Any:
        if not self._coalesce:
            result = _unwrap(await self._actor.call.remote(verb, request_id, to_wire(args)))
        else:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[dict[str, Any]] = loop.create_future()
            if not self._pending:
                loop.call_soon(self._flush)
            self._pending.append((verb, request_id, to_wire(args), fut))
            result = _unwrap(await fut)
        if isinstance(result, VersionStatus):
            self._versions[result.version_id] = result
        return result

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        ref = self._actor.call_batch.remote([(v, rid, args) for v, rid, args, _ in batch])
        task = asyncio.get_running_loop().create_task(self._deliver(ref, [f for *_, f in batch]))
        self._deliveries.add(task)
        task.add_done_callback(self._deliveries.discard)

    @staticmethod
    async def _deliver(ref: Any, futures: list[asyncio.Future[dict[str, Any]]]) -> None:
        try:
            replies = await ref
        except BaseException as exc:  # the reply was lost: every caller learns it
            for f in futures:
                if not f.done():
                    f.set_exception(exc)
            return
        for f, reply in zip(futures, replies, strict=True):
            if not f.done():
                f.set_result(reply)

    async def _read(self, what: str, version_id: str | None = None) -> Any:
        return _unwrap(await self._actor.read.remote(what, version_id))

    async def bind_first(
        self, *, request_id: str, session_key: str, lease: str | None = None
    ) -> Binding:
        r = await super().bind_first(request_id=request_id, session_key=session_key, lease=lease)
        if r.version_id not in self._versions:
            await self.fetch_version(r.version_id)
        return r

    async def status(self) -> RegistryStatus:
        r: RegistryStatus = await self._read("status")
        self._versions = {v.version_id: v for v in r.versions}
        return r

    async def version(self, version_id: str) -> VersionStatus:
        r: VersionStatus = await self._read("version", version_id)
        self._versions[version_id] = r
        return r

    async def fetch_version(self, version_id: str) -> VersionStatus | None:
        """One version's status from the actor (None if unknown); refreshes the local cache."""
        r: VersionStatus | None = await self._read("peek_version", version_id)
        if r is None:
            self._versions.pop(version_id, None)
        else:
            self._versions[version_id] = r
        return r

    async def refresh(self) -> None:
        """Refresh the local version cache behind :meth:`peek_version`."""
        await self.status()

    def peek_version(self, version_id: str) -> VersionStatus | None:
        """The cached status of a version (no I/O; see the class docstring for its freshness)."""
        return self._versions.get(version_id)


def _unwrap(reply: dict[str, Any]) -> Any:
    if reply["ok"]:
        return from_wire(reply["result"])
    err = reply["error"]
    raise error_from_code(err["code"], err["message"], **err["details"])


def connect(
    *,
    engines: Sequence[str],
    capacity: int,
    deployment_epoch: int = 0,
    prefix: str = "policy_lora",
    journal_path: str | Path | None = None,
    group_commit: bool = True,
    name: str = DEFAULT_NAME,
    namespace: str = DEFAULT_NAMESPACE,
    max_restarts: int = -1,
) -> RayRegistryClient:
    """Get the named registry actor, creating it if it does not exist yet.

    Call after ``ray.init()``. A registry without ``journal_path`` forgets everything when its
    actor restarts; production deployments must give one on storage that survives the node.
    """
    import ray

    config: dict[str, Any] = {
        "engines": list(engines),
        "capacity": capacity,
        "deployment_epoch": deployment_epoch,
        "prefix": prefix,
        "journal_path": str(journal_path) if journal_path is not None else None,
        "group_commit": group_commit,
    }
    actor_cls = ray.remote(RegistryActor)
    actor = actor_cls.options(
        name=name,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=max_restarts,
        max_task_retries=0,  # a lost reply is replayed by the caller, never by Ray
        max_concurrency=1000,
        num_cpus=0,
    ).remote(config)
    return RayRegistryClient(actor)
