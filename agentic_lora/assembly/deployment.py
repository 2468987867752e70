"""One object that wires the whole feature for a process: registry, Sessions, publisher, reclaimer.

::

    settings = load_settings(enable_versioned_lora_publication=True, engines=[...], capacity=2)
    async with Deployment.from_settings(settings, backend_options={"store_root": "/adapters"}) as d:
        await d.publish("step-100", AdapterSnapshot.from_peft_dir(path))
        async with d.session("episode-7") as s:
            reply = await s.generate({"text": prompt, "sampling_params": {...}})

The reclaimer runs in the background and is poked after every commit (by the publisher) and after
every Session release (by a registry listener, where the registry offers one), so a retired
version is unloaded as soon as its last Session is gone and its in-flight requests have drained.
The resolver (:mod:`agentic_lora.publication.resolver`) runs in the background too: at start it aborts and
cleans a publication a dead publishing process left LOADING, and it retries an unconfirmed
cleanup with backoff until the blocked publication's slot is free.
The repairer (:mod:`agentic_lora.publication.repair`) probes every engine each ``probe_interval`` seconds and
whenever an engine refuses a Session's request: an engine that restarted gets every dispatchable
version loaded again (from the snapshots this process published, else from the backend's store),
and until then the Sessions' requests go to the engines that hold their version.

Frameworks that already have their own registry (a Ray actor shared by many workers) pass it in;
then only the process that publishes needs a publisher, and every rollout worker only needs
:attr:`Deployment.versioning`.

With PD groups (:mod:`agentic_lora.engines.pd`) the publisher, reclaimer and repairer drive every role
server as an engine of its own, the Sessions route to groups, and a group gets a request for a
version only while every one of its role servers holds it.

When the engine dialect's unload does not wait for requests still running on the version
(``unload_waits_for_requests`` is False: vLLM), :meth:`Deployment.from_settings` hands the backend
a drain hook (option :data:`~agentic_lora.engines.dialect.DRAIN_OPTION`) bound to
:meth:`Versioning.wait_drained`: a reclaim unloads only once this process's Sessions have no
request in flight on it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.assembly.membership import DRAIN_GRACE
from agentic_lora.assembly.membership import DrainResult
from agentic_lora.assembly.membership import drain_engine as drain_member
from agentic_lora.assembly.membership import join_engine as join_member
from agentic_lora.config import AgenticLoRASettings
from agentic_lora.engines.adapter_backend import DrainHook
from agentic_lora.engines.backends import Backend
from agentic_lora.engines.backends import load_backend
from agentic_lora.engines.dialect import DRAIN_OPTION
from agentic_lora.engines.dialect import load_dialect
from agentic_lora.engines.pd import RoleHealth
from agentic_lora.engines.routing import EngineHealth
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import VersionConflictError
from agentic_lora.leases import OnRestart
from agentic_lora.publication.ejection import Ejections
from agentic_lora.publication.ejection import Ejector
from agentic_lora.publication.publisher import PhaseEvent
from agentic_lora.publication.publisher import PublicationResult
from agentic_lora.publication.reclaimer import Reclaimer
from agentic_lora.publication.reclaimer import ReclaimReport
from agentic_lora.publication.repair import Repairer
from agentic_lora.publication.repair import SnapshotCache
from agentic_lora.publication.resolver import Resolver
from agentic_lora.publication.resolver import ResolveReport
from agentic_lora.publication.resolver import backoff
from agentic_lora.publication.rollback import RollbackPublisher
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.api import change_feed
from agentic_lora.registry.api import refusal_feed
from agentic_lora.registry.api import registry_host
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import EngineStatus
from agentic_lora.registry.types import LeaseGrant
from agentic_lora.registry.types import MemberState
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import ReleaseResult
from agentic_lora.registry.types import SweepResult
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import VersionStatus
from agentic_lora.registry.types import new_request_id
from agentic_lora.session import Session
from agentic_lora.session import Versioning
from agentic_lora.session.middleware import Middleware

__all__ = ["Deployment"]

logger = logging.getLogger(__name__)


class _SessionDrain:
    """A backend drain hook bound, once it exists, to the Versioning built after the backend.

    The backend is built first (so a backend that cannot be built leaves nothing else open);
    a reclaim runs only once the Deployment exists, by which time the hook is bound. A hook the
    caller passed in ``backend_options`` is awaited after the Sessions' own.
    """

    def __init__(self, extra: DrainHook | None) -> None:
        self._sessions: DrainHook | None = None
        self._extra = extra

    def bind(self, sessions: DrainHook) -> None:
        self._sessions = sessions

    async def __call__(self, lora_name: str) -> None:
        if self._sessions is None:
            raise ConfigurationError(
                "the drain hook is not bound to a Versioning yet", check="vllm_drain_hook"
            )
        await self._sessions(lora_name)
        if self._extra is not None:
            await self._extra(lora_name)


class Deployment:
    """Registry + :class:`Versioning` + :class:`RollbackPublisher` + background :class:`Reclaimer`.

    The registry is the one ``versioning``'s Sessions bind through: one Deployment never
    publishes into a registry its Sessions do not read.
    """

    def __init__(
        self,
        *,
        settings: AgenticLoRASettings,
        versioning: Versioning,
        backend: Backend,
        on_progress: Callable[[PhaseEvent], None] | None = None,
        owns_backend: bool = True,
    ) -> None:
        registry = versioning.registry
        if registry is None:
            raise ConfigurationError(
                "a Deployment publishes versions: its Versioning needs a registry "
                "(versioned publication on)",
                check="registry",
            )
        self.settings = settings
        self.versioning = versioning
        self.registry: RegistryAPI = registry
        self.backend = backend
        self._owns_backend = owns_backend
        # With PD groups, every role server is an engine for publication, readiness, repair and
        # reclaim, while the Sessions route to groups (see agentic_lora.engines.pd).
        self.fleet = settings.fleet
        engines = versioning.engines
        health: EngineHealth = versioning.health
        if self.fleet.has_groups:
            engines = self.fleet.publication_engines
            health = RoleHealth(versioning.health, self.fleet)
        #: Engines ejected for failed health probes (see agentic_lora.publication.ejection).
        self.ejections = Ejections()
        self.reclaimer = Reclaimer(
            registry, backend, engines, ejections=self.ejections, on_progress=on_progress
        )
        self.publisher = RollbackPublisher(
            registry,
            backend,
            engines,
            reclaimer=self.reclaimer,
            ejections=self.ejections,
            on_progress=on_progress,
        )
        # This Deployment's publisher is the registry's only one (see agentic_lora.publication.resolver).
        self.resolver = Resolver(
            self.publisher,
            wait=backoff(settings.resolve_backoff_initial, settings.resolve_backoff_max),
        )
        stored = getattr(backend, "stored_snapshot", None)
        #: What the repairer loads onto a restarted engine: what this process published, else
        #: the backend's immutable store (a restarted publisher has nothing cached).
        self.snapshots = SnapshotCache(stored=stored if callable(stored) else None)
        self.repairer = Repairer(
            registry,
            backend,
            engines,
            snapshots=self.snapshots,
            probe_interval=settings.probe_interval,
            probe_timeout=settings.probe_timeout,
            version_locks=self.reclaimer.version_locks,
            health=health,
            ejector=Ejector(registry, self.ejections, eject_after=settings.eject_after),
            on_progress=on_progress,
        )
        versioning.on_refused.append(self._on_refused)
        # A Ray client's version cache must learn about a restart too (see RayRegistryClient).
        refusals = refusal_feed(registry)
        if refusals is not None:
            versioning.on_refused.append(refusals.on_refused)
        changes = change_feed(registry)
        if changes is not None:
            changes.add_listener(self._on_registry_change)
        self._started = False

    @classmethod
    def from_settings(
        cls,
        settings: AgenticLoRASettings,
        *,
        backend: Backend | None = None,
        backend_options: Mapping[str, Any] | None = None,
        registry: RegistryAPI | None = None,
        transport: EngineTransport | None = None,
        middleware: Sequence[Middleware] = (),
        on_progress: Callable[[PhaseEvent], None] | None = None,
        lease_owner: str | None = None,
        lease_on_restart: OnRestart = "release",
    ) -> Deployment:
        """Build every part from validated settings (the flag must be on).

        ``middleware`` are framework middlewares for every Session's dispatch chain (see
        :class:`Versioning`). When the dialect's unload does not wait for in-flight requests and
        no ``backend`` is given, the loaded backend gets its drain hook (``wait_drained``) bound
        to :meth:`Versioning.wait_drained`; a ``backend`` passed in must have been given its drain
        hook by the caller. ``lease_owner`` and
        ``lease_on_restart`` go to :meth:`Versioning.from_settings` (the Sessions' owner lease).
        """
        if not settings.enable_versioned_lora_publication:
            raise ConfigurationError(
                "a Deployment publishes versions; enable --enable-versioned-lora-publication "
                "(with the flag off, use Versioning.from_settings for the legacy pass-through)",
                check="flag",
            )
        owns_backend = backend is None
        drain: _SessionDrain | None = None
        if backend is None:
            options = dict(backend_options or {})
            if not load_dialect(settings.engine_kind).unload_waits_for_requests:
                drain = _SessionDrain(options.pop(DRAIN_OPTION, None))
                options[DRAIN_OPTION] = drain
            backend = load_backend(settings.backend, **options)
        versioning = Versioning.from_settings(
            settings,
            registry=registry,
            transport=transport,
            middleware=middleware,
            lease_owner=lease_owner,
            lease_on_restart=lease_on_restart,
        )
        if drain is not None:
            drain.bind(versioning.wait_drained)
        return cls(
            settings=settings,
            versioning=versioning,
            backend=backend,
            on_progress=on_progress,
            owns_backend=owns_backend,
        )

    def _on_registry_change(self, verb: str, result: Any) -> None:
        # A released Session may have been the last holder of a retired version; so may the
        # Sessions of a lease that ended (expired, or its owner restarted or closed it).
        released = (
            (isinstance(result, ReleaseResult) and result.released_now)
            or (isinstance(result, SweepResult) and bool(result.expired_sessions))
            or (isinstance(result, LeaseGrant) and bool(result.released))
            or (verb == "close_lease" and bool(result))
        )
        if released:
            self.reclaimer.poke()
        if (
            verb == "confirm_reclaim"
            and isinstance(result, VersionStatus)
            and result.state is VersionState.RECLAIMED
        ):
            self.snapshots.evict(result.version_id)  # no engine may ever load it again

    def _on_refused(self, engine: str, binding: Binding) -> None:
        # An engine refused a Session's request: it may have restarted and lost the version. For
        # a PD group, any of its role servers may be the one that did.
        for server in self.fleet.roles_of(engine):
            self.repairer.poke(server)

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the registry host's lease sweeper (where the registry offers one: it expires
        every lease the registry holds, a dead process's replayed from the journal included,
        whether or not this process opens a lease), then the background reclaimer, resolver and
        repairer (idempotent)."""
        if not self._started:
            host = registry_host(self.registry)
            if host is not None:
                await host.start()
            self.reclaimer.start()
            self.resolver.start()
            self.repairer.start()
            start_refresh = getattr(self.registry, "start_refresh", None)
            if callable(start_refresh):
                start_refresh(self.settings.probe_interval)
            self._started = True

    async def aclose(self) -> None:
        """Close live Sessions, stop the repairer, resolver and reclaimer, then close the
        registry and the backend.

        The background parts stop before the registry closes: the last Sessions' releases poke
        the reclaimer, and a round it (or a repair) starts must still be able to record what the
        engines did.
        """
        try:
            for s in self.versioning.live_sessions():
                await s.close()
        finally:
            # First: a repair still loading must record (or clean) while the registry is open.
            await self.repairer.stop()
            stop_refresh = getattr(self.registry, "stop_refresh", None)
            if callable(stop_refresh):
                await stop_refresh()
            await self.resolver.stop()
            await self.reclaimer.stop()
            try:
                await self.versioning.aclose()
            finally:
                if self._owns_backend:
                    await self.backend.aclose()
                self._started = False

    async def __aenter__(self) -> Deployment:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- the verbs users call -----------------------------------------------------------------

    async def publish(self, version_id: str, snapshot: AdapterSnapshot) -> PublicationResult:
        """Publish ``snapshot`` as the immutable version ``version_id`` (two-phase, see Publisher).

        The snapshot is kept for the repairer until the version is reclaimed (or never made it).
        """
        with self.snapshots.publishing(version_id, snapshot):
            return await self.publisher.publish(version_id, snapshot)

    async def rollback(
        self, version_id: str, snapshot: AdapterSnapshot | None = None
    ) -> PublicationResult:
        """Make ``version_id``, a version that was the default before, the default again, without
        a restart (two-phase, see :mod:`agentic_lora.publication.rollback`).

        Sessions already bound keep their version; Sessions that bind afterwards get this one,
        and can tell (``rolled_back_from`` in their binding and provenance). A RETIRED version is
        still loaded; a RECLAIMED one is loaded again, from this process's snapshots or the
        backend's store (which keeps the newest reclaimed versions), or from ``snapshot`` (its
        digest must be the version's: VERSION_CONFLICT otherwise, before anything happens).
        """
        locks = self.reclaimer.version_locks
        if snapshot is None:
            return await self.publisher.rollback(
                version_id, snapshots=self.snapshots, version_locks=locks
            )
        v = await self.registry.version(version_id)
        if snapshot.digest != v.digest:
            raise VersionConflictError(
                f"the snapshot given for {version_id!r} is other content ({snapshot.digest[:16]}, "
                f"not {v.digest[:16]})",
                version=version_id,
                existing_digest=v.digest,
                digest=snapshot.digest,
            )
        with self.snapshots.publishing(version_id, snapshot):
            return await self.publisher.rollback(
                version_id, snapshots=self.snapshots, version_locks=locks
            )

    async def reclaim(self) -> ReclaimReport:
        """One reclaim round now (the background loop does this on its own too)."""
        return await self.reclaimer.reclaim_once()

    async def resolve(self, version_id: str | None = None) -> ResolveReport:
        """Resolve a blocked or abandoned publication now (or all of them; see Resolver)."""
        return await self.resolver.resolve(version_id)

    async def status(self) -> RegistryStatus:
        return await self.registry.status()

    # --- membership (see agentic_lora.registry.membership) -------------------------------------

    async def engines(self) -> tuple[EngineStatus, ...]:
        """Every member of the registry's fleet with its incarnation and membership state."""
        return (await self.registry.status()).engines

    async def drain_engine(
        self, engine: str, *, wait_bound: float | None = None, remove: bool = True
    ) -> DrainResult:
        """``engine`` takes no new work from this step on (DRAINING): its Sessions continue on
        the members that hold their version. Then this waits until no request of this process's
        Sessions is in flight on it, and removes it (REMOVED: its slots leave the count).

        ``wait_bound`` bounds the wait (default ``request_timeout`` + :data:`DRAIN_GRACE` seconds);
        past it the engine stays DRAINING and the outcome is TIMED_OUT (drain it again to wait
        again, or :meth:`remove_engine` it regardless). ``remove=False`` stops after the wait
        (outcome DRAINED). Raises ``DRAIN_REFUSED`` for the last ACTIVE member or an EJECTED
        engine. See :mod:`agentic_lora.assembly.membership`."""
        bound = self.settings.request_timeout + DRAIN_GRACE if wait_bound is None else wait_bound
        # A PD role server is reached through the group it serves in.
        routed = self.fleet.member_of().get(engine, engine)
        return await drain_member(
            self.registry,
            self.versioning,
            self.publisher,
            engine,
            routed=(routed,),
            wait_bound=bound,
            remove=remove,
        )

    async def remove_engine(self, engine: str) -> MemberState:
        """A DRAINING or EJECTED ``engine`` leaves the fleet now, without waiting for anything
        (:meth:`drain_engine` removes a drained engine itself); its slots leave the count."""
        async with self.publisher.exclusive():
            return await self.registry.remove_engine(request_id=new_request_id(), engine=engine)

    async def add_engine(self, engine: str) -> MemberState:
        """``engine`` (one of this Deployment's configured engines that was removed, drained or
        ejected) joins: every dispatchable version (the default, and every version Sessions are
        bound to) is loaded onto it, then it becomes ACTIVE: routable, and counted for readiness.
        Publications go on meanwhile; one that starts during the last step waits for it (see
        :mod:`agentic_lora.assembly.membership`).

        Raises ``MEMBER_NOT_READY`` if a version could not be loaded (try again; the repairer
        keeps loading) and ``CONFIG_ERROR`` for an engine this Deployment has no address for, or
        one still draining.
        """
        if engine not in {e.name for e in self.repairer.engines}:
            raise ConfigurationError(
                f"engine {engine!r} is not one of this deployment's engines", check="engine"
            )
        result = await join_member(self.registry, self.repairer, self.publisher, engine)
        self.ejections.mark(engine, False)
        return result

    def session(self, session_id: str) -> contextlib.AbstractAsyncContextManager[Session]:
        """``async with deployment.session(id) as s``: see :meth:`Versioning.session`."""
        return self.versioning.session(session_id)
