"""The manager a rollout worker holds: opens Sessions, owns the dispatch chain and the lease."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Final

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.dialect import EngineDialect
from agentic_lora.engines.dialect import load_dialect
from agentic_lora.engines.routing import EngineHealth
from agentic_lora.engines.routing import Router
from agentic_lora.engines.routing import load_router
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import SessionReleaseError
from agentic_lora.errors import SessionStateError
from agentic_lora.foundation.replay import RegistryRetry
from agentic_lora.foundation.requests import new_rid
from agentic_lora.leases import LeaseKeeper
from agentic_lora.leases import OnRestart
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.api import in_process_core
from agentic_lora.registry.api import session_closer
from agentic_lora.registry.provenance import CoreRevision
from agentic_lora.registry.provenance import DefaultRevisionReader
from agentic_lora.registry.provenance import StalenessListener
from agentic_lora.registry.types import ReleaseResult
from agentic_lora.session.binder import PASS_THROUGH
from agentic_lora.session.binder import BinderConfig
from agentic_lora.session.binder import RegistryBinder
from agentic_lora.session.binder import SessionBinder
from agentic_lora.session.lifecycle import Session
from agentic_lora.session.lifecycle import SessionRuntime
from agentic_lora.session.middleware import AdapterInFlight
from agentic_lora.session.middleware import AdapterPinMiddleware
from agentic_lora.session.middleware import DispatchGuard
from agentic_lora.session.middleware import DispatchGuardMiddleware
from agentic_lora.session.middleware import DrainWaitListener
from agentic_lora.session.middleware import Middleware
from agentic_lora.session.middleware import PeekGuard
from agentic_lora.session.middleware import RefusedListener
from agentic_lora.session.middleware import RoutingMiddleware
from agentic_lora.session.middleware import TransportEndpoint
from agentic_lora.session.middleware import build_chain
from agentic_lora.session.pd_guard import pd_guard
from agentic_lora.session.streaming import StreamEndpoint

if TYPE_CHECKING:
    from agentic_lora.config import AgenticLoRASettings

__all__ = ["Versioning"]

logger = logging.getLogger(__name__)


def _revision_reader_of(registry: RegistryAPI) -> DefaultRevisionReader | None:
    if isinstance(registry, DefaultRevisionReader):
        return registry
    core = in_process_core(registry)
    # In process: the core's revision is exact, never a stale copy.
    return CoreRevision(core) if core is not None else None


def _guard_of(registry: RegistryAPI) -> DispatchGuard:
    guard = PeekGuard.of(registry)
    if guard is None:
        raise ConfigurationError(
            f"{type(registry).__name__} has no peek_version; pass a DispatchGuard",
            check="dispatch_guard",
        )
    return guard


class Versioning:
    """The manager a rollout worker holds: opens Sessions and owns the dispatch chain.

    ``enabled=False`` (the framework flag off) makes every Session a pass-through that sends the
    caller's body untouched (its binder is the null one); then ``registry`` is not used.
    ``engine_kind`` names the engine dialect (``"sglang"``, ``"vllm"``, or any installed
    ``agentic_lora.engines`` plugin; ``dialect`` passes one directly): it decides which routes
    exist, how a request names its adapter and whether a request can be aborted by id (see
    :mod:`agentic_lora.engines.dialect`).

    ``lease`` is the worker's :class:`~agentic_lora.leases.LeaseKeeper` (one per Versioning):
    Sessions bind under it, and :meth:`aclose` closes it after the Sessions. None (the default for
    direct construction; :meth:`from_settings` makes one) keeps Sessions lease-free.

    ``max_version_lag`` (None: off) bounds staleness per Session: a dispatch whose bound version
    is more than that many publications behind the current default is refused with
    :class:`~agentic_lora.errors.VersionTooStaleError` (see :meth:`Session.provenance`).
    ``revision_reader`` says the current default revision without I/O; by default the registry
    itself if it is a :class:`~agentic_lora.registry.provenance.DefaultRevisionReader` (the Ray client),
    or the core of a ``LocalRegistry``. Without one, lags are unknown (None) and a bound is a
    configuration error.

    ``registry_retry`` replays a Session's close calls whose reply may have been lost (default:
    4 attempts, exponential wait from 0.05 s up to 2 s; see
    :class:`~agentic_lora.foundation.replay.RegistryRetry`).
    """

    def __init__(
        self,
        *,
        transport: EngineTransport,
        registry: RegistryAPI | None = None,
        enabled: bool = True,
        router: Router | None = None,
        guard: DispatchGuard | None = None,
        base_model: str | None = None,
        engine_kind: str = "sglang",
        dialect: EngineDialect | None = None,
        deployment_epoch: int = 0,
        middleware: Sequence[Middleware] = (),
        registry_retry: RegistryRetry | None = None,
        owns_transport: bool = False,
        owns_registry: bool = False,
        lease: LeaseKeeper | None = None,
        max_version_lag: int | None = None,
        revision_reader: DefaultRevisionReader | None = None,
    ) -> None:
        resolved: EngineDialect = dialect or load_dialect(engine_kind)
        # Read-only after construction (Final: mypy refuses a later assignment).
        self.enabled: Final = enabled
        """Whether versioned publication is on (off: pass-through Sessions)."""
        self.dialect: Final = resolved
        """The engine dialect (its ``name``: ``"sglang"``, ``"vllm"``, ...): routes, adapter naming,
        abort by id."""
        self._adapter_requests = AdapterInFlight()
        self._engine_requests = AdapterInFlight(label="engine")
        #: Told ``(lora_name, in_flight)`` when a :meth:`wait_drained` starts waiting for this
        #: manager's requests on an adapter (the drain of a reclaim); append listeners any time.
        self.on_drain_wait: list[DrainWaitListener] = self._adapter_requests.on_wait
        self.registry: Final = registry
        """The registry Sessions bind through (None in pass-through mode)."""
        self.registry_retry: Final = (
            registry_retry if registry_retry is not None else RegistryRetry(attempts=4)
        )
        """How a Session's close calls (``begin_close``, ``release``) are replayed when their reply
        may have been lost (a bind is replayed by the next generation instead)."""
        self.transport: Final = transport
        """The engine transport (e.g. for :func:`agentic_lora.config.verify_fleet` at start-up)."""
        self._owns_transport = owns_transport
        self._owns_registry = owns_registry
        self._epoch = deployment_epoch
        if lease is not None and not enabled:
            raise ConfigurationError(
                "a lease keeper needs versioned publication (pass-through Sessions bind nothing)",
                check="lease",
            )
        self.lease: Final = lease
        """The owner lease Sessions bind under (None: lease-free Sessions)."""
        if revision_reader is None and enabled and registry is not None:
            revision_reader = _revision_reader_of(registry)
        if max_version_lag is not None:
            if isinstance(max_version_lag, bool) or not isinstance(max_version_lag, int):
                raise ConfigurationError(
                    f"max_version_lag {max_version_lag!r} is not an integer",
                    check="max_version_lag",
                )
            if max_version_lag < 0:
                raise ConfigurationError(
                    f"max_version_lag {max_version_lag} must be 0 or more",
                    check="max_version_lag",
                )
            if not enabled or revision_reader is None:
                raise ConfigurationError(
                    "max_version_lag needs versioned publication and a registry whose current "
                    "default revision can be read without I/O (pass revision_reader)",
                    check="max_version_lag",
                )
        self.max_version_lag: Final = max_version_lag
        """The staleness bound of this manager's Sessions (None: off)."""
        #: Told the lag of every versioned dispatch and every VERSION_TOO_STALE refusal (the
        #: metrics hook, see :meth:`agentic_lora.assembly.metrics.Metrics.watch_staleness`); append any time.
        self.staleness_listeners: list[StalenessListener] = []
        engines = [e.name for e in transport.engines]
        self.health: Final = EngineHealth(engines)
        """Engine health: mark an engine unhealthy to stop routing new dispatches to it."""
        self.router: Final = router if router is not None else load_router("session-affinity")
        """The router plugin in the chain."""
        chain: list[Middleware] = list(middleware)
        self._binder_config: BinderConfig | None = None
        if enabled:
            if registry is None:
                raise ConfigurationError(
                    "versioned publication is enabled but no registry was given", check="registry"
                )
            if guard is None:
                guard = _guard_of(registry)
            chain += [
                Middleware(AdapterPinMiddleware, base_model=base_model, dialect=resolved),
                Middleware(DispatchGuardMiddleware, guard=guard, in_flight=self._adapter_requests),
            ]
            self._binder_config = BinderConfig(
                registry,
                resolved,
                self.registry_retry,
                lease=lease,
                max_version_lag=max_version_lag,
                revision=revision_reader,
                staleness=self.staleness_listeners,
            )
        #: Told ``(engine, binding)`` when an engine refused a versioned request (see
        #: :class:`~agentic_lora.session.middleware.RoutingMiddleware`); append listeners at any time.
        self.on_refused: list[RefusedListener] = []
        chain.append(
            Middleware(
                RoutingMiddleware,
                router=self.router,
                health=self.health,
                on_refused=self.on_refused,
                in_flight=self._engine_requests,
            )
        )
        self._runtime = SessionRuntime(
            chain=build_chain(TransportEndpoint(transport), chain),
            transport=transport,
            dialect=resolved,
            new_binder=self._new_binder,
            on_closed=self._on_closed,
            stream_chain=build_chain(StreamEndpoint(transport), chain),
            close_now=self._close_now,
        )
        self._closer = session_closer(registry) if enabled else None
        self._live: dict[str, Session] = {}
        self._keys: set[str] = set()  # registry keys of live Sessions (explicit keys stay unique)
        self._unforgotten: list[str] = []

    @classmethod
    def from_settings(
        cls,
        settings: AgenticLoRASettings,
        *,
        registry: RegistryAPI | None = None,
        transport: EngineTransport | None = None,
        middleware: Sequence[Middleware] = (),
        lease_owner: str | None = None,
        lease_on_restart: OnRestart = "release",
    ) -> Versioning:
        """Build from validated settings. Without ``registry`` (flag on) a LocalRegistry is made.

        With the flag on, Sessions bind under a :class:`~agentic_lora.leases.LeaseKeeper` built
        from the settings (``owner_id``, ``lease_ttl``, ``lease_renew_interval``); ``lease_owner``
        overrides the owner and ``lease_on_restart`` says what a restart does with the
        predecessor's Sessions (``"release"`` for rollout workers, ``"adopt"`` for a gateway).
        """
        owns_transport = transport is None
        owns_registry = False
        dialect = load_dialect(settings.engine_kind)
        if transport is None:
            transport = EngineTransport(
                settings.dispatch_engines,
                request_timeout=settings.request_timeout,
                connect_timeout=settings.connect_timeout,
                http_transport=settings.http_transport,
                dialect=dialect,
            )
        if settings.enable_versioned_lora_publication and registry is None:
            from agentic_lora.registry.local import LocalRegistry

            registry = LocalRegistry(
                **settings.registry_identity,
                journal_path=settings.journal_path,
                name_ttl=settings.session_name_ttl,
            )
            owns_registry = True
        lease: LeaseKeeper | None = None
        if settings.enable_versioned_lora_publication:
            assert registry is not None
            lease = LeaseKeeper.from_settings(
                settings, registry, owner=lease_owner, on_restart=lease_on_restart
            )
        guard: DispatchGuard | None = None
        if settings.pd_groups and settings.enable_versioned_lora_publication:
            assert registry is not None
            guard = pd_guard(registry, settings.fleet)
        return cls(
            transport=transport,
            registry=registry,
            guard=guard,
            enabled=settings.enable_versioned_lora_publication,
            router=load_router(settings.router),
            base_model=settings.base_model_name,
            dialect=dialect,
            deployment_epoch=settings.deployment_epoch,
            middleware=middleware,
            owns_transport=owns_transport,
            owns_registry=owns_registry,
            lease=lease,
            max_version_lag=(
                settings.max_version_lag if settings.enable_versioned_lora_publication else None
            ),
        )

    def _new_binder(self, key: str, on_bound: Callable[[], None]) -> SessionBinder:
        config = self._binder_config
        return PASS_THROUGH if config is None else RegistryBinder(key, config, on_bound)

    def in_flight(self, lora_name: str) -> int:
        """Requests of this manager's Sessions in flight on adapter ``lora_name``."""
        return self._adapter_requests.count(lora_name)

    async def wait_drained(self, lora_name: str) -> None:
        """Return once no request of this manager's Sessions is in flight on ``lora_name``.

        The drain hook of backends whose engine does not wait for in-flight requests on unload
        (``VllmBackend(wait_drained=versioning.wait_drained)``). Event-driven: it returns at the
        first moment the adapter's count reaches zero (at once if it is zero). It sees only this
        process's Sessions; a reclaim awaits it after the version left the dispatchable states,
        so no new request can start on it meanwhile.
        """
        await self._adapter_requests.wait_drained(lora_name)

    def engine_in_flight(self, engine: str) -> int:
        """Requests of this manager's Sessions in flight on ``engine`` (a routed engine: a plain
        engine, or a PD group)."""
        return self._engine_requests.count(engine)

    async def wait_engine_drained(self, engine: str) -> None:
        """Return once no request of this manager's Sessions is in flight on ``engine``.

        Event-driven, like :meth:`wait_drained`. Await it once ``engine`` can no longer be routed
        to (no longer an ACTIVE member: a drain): then no request starts on it after the call,
        and the return means every one sent to it ended. It sees only this process's Sessions.
        """
        await self._engine_requests.wait_drained(engine)

    @property
    def engines(self) -> tuple[EngineRef, ...]:
        """The fixed engine fleet."""
        return self.transport.engines

    def live_sessions(self) -> tuple[Session, ...]:
        """Sessions not yet closed (including ones whose release failed)."""
        return tuple(self._live.values())

    def get(self, session_id: str) -> Session | None:
        """The live Session with this id, if any."""
        return self._live.get(session_id)

    def open_session(self, session_id: str, *, session_key: str | None = None) -> Session:
        """Open a Session (OPEN, bound to nothing; no I/O). One live lifecycle per id.

        ``session_key`` continues an *existing* registry Session (for instance one the gateway
        found behind a durable name with ``open_named``, after a restart): the first dispatch
        calls ``bind_first`` for that key, which answers the binding the registry already holds,
        never a new choice (a key the registry does not know is simply a new Session). A name is
        opened under this manager's lease: ``(await versioning.lease.acquire()).lease_id``.
        Without ``session_key`` a fresh key is minted for a new lifecycle.
        """
        if not isinstance(session_id, str) or not session_id:
            raise InvalidRequestError(
                "a session id is a non-empty string", session=repr(session_id)
            )
        if session_key is not None and (
            not isinstance(session_key, str)
            or not session_key
            or not session_key.isprintable()
            or any(c.isspace() for c in session_key)
        ):
            raise InvalidRequestError(
                "a session key is a non-empty printable string without whitespace",
                session=repr(session_key),
            )
        if session_key is not None and session_key in self._keys:
            # Two live Session objects on one key would release its one ref twice over.
            raise SessionStateError(
                f"session key {session_key!r} is already open here; close it first",
                session=session_key,
            )
        existing = self._live.get(session_id)
        if existing is not None:
            raise SessionStateError(
                f"session {session_id!r} is still {existing.phase.value}; close it before reusing "
                "the id",
                session=existing.key,
                phase=existing.phase.value,
            )
        key = session_key if session_key is not None else f"{session_id}#{self._epoch}-{new_rid()}"
        s = Session(session_id, key, self._runtime)
        self._live[session_id] = s
        self._keys.add(key)
        return s

    @contextlib.asynccontextmanager
    async def session(self, session_id: str) -> AsyncIterator[Session]:
        """``async with versioning.session(id) as s``: open, then close however the block ends."""
        s = self.open_session(session_id)
        try:
            yield s
        finally:
            await s.close()

    async def close_session(self, session_id: str) -> ReleaseResult | None:
        """Close the live Session with this id (a no-op returning None if there is none)."""
        s = self._live.get(session_id)
        return None if s is None else await s.close()

    def _drop(self, s: Session) -> None:
        if self._live.get(s.session_id) is s:
            del self._live[s.session_id]
        self._keys.discard(s.key)

    def _close_now(self, s: Session) -> tuple[bool, ReleaseResult | None]:
        if not self.enabled:
            self._drop(s)
            return True, None
        # Tombstones a failed forget left behind are retried by a close through the verbs.
        if self._closer is None or self._unforgotten:
            return False, None
        try:
            result = self._closer.close_session_now(s.key)
        except Exception:
            # Nothing was applied (see SessionCloser); the verbs meet the same refusal and
            # report it as the close's error.
            return False, None
        if result is None:
            return False, None
        # The registry forgot the tombstone in the same step: nothing ran between it and here.
        self._drop(s)
        return True, result

    async def _on_closed(self, s: Session) -> None:
        self._drop(s)
        if self.registry is None or not self.enabled:
            return
        # Tombstones go only after the record is gone, so nothing can bind this key again.
        self._unforgotten.append(s.key)
        keys = list(self._unforgotten)
        try:
            await self.registry.forget_sessions(request_id=new_rid(), session_keys=keys)
        except Exception as exc:
            # Not a correctness problem (a tombstone only costs memory): retried with the next.
            logger.warning(
                "forget_sessions failed; will retry with the next close",
                extra={"session": s.key, "pending": len(keys), "error": repr(exc)},
            )
            return
        del self._unforgotten[: len(keys)]

    async def aclose(self) -> None:
        """Close every live Session, then the owner lease (``close_lease``: a clean shutdown
        leaves nothing to expire later) and stop renewing it, then the transport and registry if
        this manager made them.

        If a Session's release is not confirmed, raises its SessionReleaseError *before* closing
        anything, on purpose: the lease, registry and transport stay open so ``aclose()`` can be
        called again and the release retried (closing them would strand the Session's ref for good).
        """
        errors: list[SessionReleaseError] = []
        for s in list(self._live.values()):
            try:
                await s.close()
            except SessionReleaseError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        if self.lease is not None:
            await self.lease.aclose()
        if self._owns_transport:
            await self.transport.aclose()
        closer = getattr(self.registry, "aclose", None) if self._owns_registry else None
        if closer is not None:
            await closer()
