"""The registry as a named, detached Ray actor with one writer, and an async client for it.

At fleet scale the rollout workers, the publisher and the reclaimer run in different processes and
must all ask the same single writer. :func:`connect` gets or creates one named, detached actor
(``get_if_exists``), so every process that connects with the same name shares it.

* The actor is an async actor holding a :class:`~agentic_lora.registry.local.LocalRegistry`;
  verbs never await anything but the journal, so each is atomic with respect to the others.
* Journal replay happens in the actor's constructor: with ``max_restarts`` a crashed actor comes
  back with every version, binding and slot it had accepted. Its first read, its first state
  change, or :meth:`RayRegistryClient.start` starts the lease sweeper: the actor expires every
  lease it replayed, whoever opened it.
* Ray task retries are off (``max_task_retries=0``): a call whose reply was lost is replayed by the
  *caller*, with the same request id, and answered from the registry's memory of that id.
* Errors travel as data (code, message, details) and are rebuilt as the same typed errors here, so
  ``except CapacityError`` works across the process boundary.

Ray is an optional extra (``agentic-lora[ray]``); importing this module does not import Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any
from typing import Unpack

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import error_from_code
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.core import MUTATING_VERBS
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import CommitReceipt
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import VersionStatus
from agentic_lora.registry.types import from_wire
from agentic_lora.registry.types import to_wire

if TYPE_CHECKING:
    from agentic_lora.registry.journal import RegistryIdentity

__all__ = ["DEFAULT_NAME", "DEFAULT_NAMESPACE", "RayRegistryClient", "RegistryActor", "connect"]

logger = logging.getLogger(__name__)

DEFAULT_NAME = "agentic-lora-registry"
DEFAULT_NAMESPACE = "agentic-lora"


class RegistryActor:
    """The actor body (wrapped with ``ray.remote`` by :func:`connect`)."""

    def __init__(self, config: dict[str, Any]) -> None:
        from agentic_lora.registry.local import LocalRegistry

        self._registry = LocalRegistry(**config)

    async def start(self) -> dict[str, Any]:
        """Take up the registry host's duties now (see :meth:`LocalRegistry.start`)."""
        try:
            await self._registry.start()
        except AgenticLoRAError as exc:
            return _failure(exc)
        return {"ok": True, "result": None}

    async def call(self, verb: str, request_id: str, args: Any) -> dict[str, Any]:
        # No start() here: it may await the lease resume, and nothing may await before the verb
        # applies (call_batch keeps list order). The registry starts its sweeper itself at the
        # first change once it holds a lease.
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
            await self._registry.start()
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


class RayRegistryClient(RegistryAPI):
    """Implements :class:`~agentic_lora.registry.api.RegistryAPI` by calling the actor.

    Calls made in the same event-loop turn are coalesced into one actor call (``call_batch``):
    one Ray round trip carries many Sessions' binds and releases, and the actor makes them durable
    in one group commit. A lost batch reply fails every call in it; each caller replays its own
    call with its own request id, as with any lost reply.

    :meth:`peek_version` (the dispatch guard's read) answers from a local cache, refreshed by
    every status read, every verb that returns a version, the first bind to a version, every
    ``interval`` seconds once :meth:`start_refresh` runs, and at once for a version whose request
    an engine refused (:meth:`on_refused`): that is how this process learns that an engine
    restarted and lost a version (its ``ready_engines``), and that it got it back.
    """

    def __init__(self, actor: Any, *, coalesce: bool = True) -> None:
        self._actor = actor
        self._coalesce = coalesce
        self._pending: list[tuple[str, str, Any, asyncio.Future[dict[str, Any]]]] = []
        self._deliveries: set[asyncio.Task[None]] = set()
        self._versions: dict[str, VersionStatus] = {}
        self._refresher: asyncio.Task[None] | None = None
        self._refetching: dict[str, asyncio.Task[None]] = {}
        # The highest default revision any reply showed: replies may arrive out of order, and
        # keeping the maximum means this cache never moves back (a lag is never over-counted).
        self._default_revision: int | None = None

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
        elif isinstance(result, CommitReceipt | Binding):
            self._see_revision(result.default_revision)
        return result

    def _see_revision(self, revision: int) -> None:
        if self._default_revision is None or revision > self._default_revision:
            self._default_revision = revision

    def default_revision(self) -> int | None:
        """The registry's default revision as last seen here (no I/O; None before any read).

        Refreshed by every status read (so by :meth:`start_refresh`), every commit and every
        bind made through this client. It can only lag behind the registry's, so a Session lag
        computed from it is never over-estimated (a
        :class:`~agentic_lora.registry.provenance.DefaultRevisionReader`).
        """
        return self._default_revision

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
        cached = self._versions.get(r.version_id)
        # A bind only ever lands on a committed version, but the cache may hold what an earlier
        # read saw while it was still LOADING (a refresh during its publication): the dispatch
        # guard would then refuse the new Session's first request as VERSION_NOT_DISPATCHABLE
        # until the next periodic refresh. Read it again unless the cache already agrees.
        if cached is None or not cached.state.dispatchable:
            await self.fetch_version(r.version_id)
        return r

    async def start(self) -> None:
        """Make the actor take up the registry host's duties now (its lease sweeper), rather
        than at its first call (see :class:`~agentic_lora.registry.api.RegistryHost`)."""
        _unwrap(await self._actor.start.remote())

    async def status(self) -> RegistryStatus:
        r: RegistryStatus = await self._read("status")
        self._versions = {v.version_id: v for v in r.versions}
        self._see_revision(r.default_revision)
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

    def start_refresh(self, interval: float) -> None:
        """Refresh the version cache every ``interval`` seconds until :meth:`stop_refresh`."""
        if not interval > 0:
            raise ValueError("the refresh interval must be above 0")
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.get_running_loop().create_task(
                self._refresh_every(interval), name="lora-registry-cache-refresh"
            )

    async def stop_refresh(self) -> None:
        """Stop the background refresh and any refused-dispatch re-read still running."""
        tasks = [t for t in (self._refresher, *self._refetching.values()) if t is not None]
        self._refresher = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def on_refused(self, engine: str, binding: Binding) -> asyncio.Task[None]:
        """A dispatch refused by ``engine``: re-read ``binding``'s version now (one read per
        version at a time, returned), so its holders are current before the next dispatch."""
        version_id = binding.version_id
        running = self._refetching.get(version_id)
        if running is not None:
            return running
        task = asyncio.get_running_loop().create_task(
            self._refetch(version_id), name=f"lora-registry-refetch {version_id}"
        )
        self._refetching[version_id] = task
        task.add_done_callback(lambda _: self._refetching.pop(version_id, None))
        return task

    async def _refetch(self, version_id: str) -> None:
        try:
            await self.fetch_version(version_id)
        except Exception as exc:
            logger.warning(
                "version re-read after a refused dispatch failed",
                extra={"version": version_id, "error": repr(exc)},
            )

    async def _refresh_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.refresh()
            except Exception as exc:
                # The cache keeps its last answer; the next interval tries again.
                logger.warning("version cache refresh failed", extra={"error": repr(exc)})


def _unwrap(reply: dict[str, Any]) -> Any:
    if reply["ok"]:
        return from_wire(reply["result"])
    err = reply["error"]
    raise error_from_code(err["code"], err["message"], **err["details"])


def connect(
    *,
    journal_path: str | Path | None = None,
    group_commit: bool = True,
    name: str = DEFAULT_NAME,
    namespace: str = DEFAULT_NAMESPACE,
    max_restarts: int = -1,
    **identity: Unpack[RegistryIdentity],
) -> RayRegistryClient:
    """Get the named registry actor, creating it if it does not exist yet.

    Call after ``ray.init()``. ``identity`` (``engines``, ``capacity``, ``deployment_epoch``,
    ``prefix``) is that of :class:`~agentic_lora.registry.local.LocalRegistry`. A registry
    without ``journal_path`` forgets everything when its actor restarts; production deployments
    must give one on storage that survives the node.
    """
    import ray

    config: dict[str, Any] = {
        **identity,
        "engines": list(identity["engines"]),
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
