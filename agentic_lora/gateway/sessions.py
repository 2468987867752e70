"""Which Session an HTTP request belongs to, and when the gateway ends one on its own.

An unmodified OpenAI-SDK agent cannot call a Session API; it can only set its API key. So the
gateway reads the Session id from ``Authorization: Bearer <session id>`` (``api_key=<session
id>``), or from ``X-Agentic-Session``; when both are sent they must name the same Session (see
:mod:`agentic_lora.gateway.security`). The first generation of an id opens its Session, which
binds at that generation. Keys minted here start with the id's keyed hash, never the id itself:
the id is the Session's credential, and keys appear in logs.

**Durable names.** The map from a client's Session id to its registry Session, and the memory of
closed ids, live in the registry (journaled), not in this process: the first request of an id
here calls ``open_named(name=<id>, session_key=<fresh key>, lease=<the gateway's lease>)``. For
an id the registry already knows the answer is the *existing* key and binding, so a restarted
gateway, or another replica on the same registry, continues the agent on its bound version; it
never binds a known id again. A closed id is a tombstone there and is refused with
``SESSION_CLOSED`` (``SESSION_EXPIRED`` if its owner's lease expired first) until the registry's
``name_ttl`` (setting ``session_name_ttl``) has passed since the close: tombstones are bounded by
age, not by count. This process keeps no closed ids at all; its map of live Session objects is a
cache, so a turn of a Session it already holds costs no registry round trip.

Where a Session closed by *another* replica is noticed here: see
:mod:`agentic_lora.gateway.closed_elsewhere`.

**Owner lease and restarts.** The gateway binds under its own owner lease (owner
``gateway_id``, one incarnation per process, ``on_restart="adopt"``, see
:mod:`agentic_lora.leases`). A restarted gateway with the same id adopts its predecessor's
Sessions the moment its lease opens (:meth:`GatewaySessions.start`; the bookkeeping is
:mod:`agentic_lora.gateway.adoption`), and a replica with another id adopts one Session by name on
its first request for it (``open_named`` moves it to the caller's lease).

**Reused ids.** With ``reuse_closed_ids=True`` a closed id opens a new lifecycle on purpose: a
``SESSION_CLOSED`` tombstone is not an error, and the new lifecycle gets a fresh key (an id whose
Session *expired* is still refused: its agent did not end it). The registry cannot give a
tombstoned name a new key yet, so a reused lifecycle is held under the gateway's lease but not
under the name: a restarted gateway with the same ``gateway_id`` finds it among the Sessions it
adopts, while another replica, or a restart after the lease expired, does not (it opens another
lifecycle bound to the default of that moment). Use reused ids with one gateway per registry.

Idle expiry (optional) closes a Session only when nothing of it is in flight; closing tombstones
its name in the registry as any close does.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from tenacity import wait_exponential

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import LeaseExpiredError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import SessionClosedError
from agentic_lora.errors import SessionExpiredError
from agentic_lora.errors import SessionReleaseError
from agentic_lora.errors import SessionStateError
from agentic_lora.errors import TooManySessionsError
from agentic_lora.foundation.replay import RegistryRetry
from agentic_lora.gateway.adoption import AdoptedSessions
from agentic_lora.gateway.closed_elsewhere import closed_elsewhere
from agentic_lora.gateway.replay import SessionReplay
from agentic_lora.gateway.security import SessionTagger
from agentic_lora.leases import LeaseKeeper
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.api import in_process_core
from agentic_lora.registry.core import RegistryCore
from agentic_lora.registry.types import NamedSession
from agentic_lora.registry.types import ReleaseResult
from agentic_lora.registry.types import new_request_id
from agentic_lora.session import Session
from agentic_lora.session import SessionPhase
from agentic_lora.session import Versioning

__all__ = ["GatewaySessions", "IdleReaped"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class IdleReaped:
    """What one idle sweep closed: this process's Sessions by id, adopted ones by tag (after a
    restart the gateway knows an adopted Session only by the keyed hash the registry holds)."""

    session_ids: tuple[str, ...] = ()
    adopted_tags: tuple[str, ...] = ()


@dataclass(slots=True)
class _Cached:
    """A Session object this process holds, and what the registry said about it."""

    last_used: float
    #: Opened through its durable name (False: a reused lifecycle, or one the Python API opened).
    named: bool
    #: The keyed hash of its id, computed once (every request's log line names it).
    tag: str


class GatewaySessions:
    """The gateway's Sessions: found by durable name, closed on request or when idle.

    * ``versioning`` opens the local Session objects (and holds the registry).
    * ``lease``: the gateway's owner lease (``on_restart="adopt"``); names and refs hang on it.
      None: names are held without a lease (nothing is adopted, nothing expires).
    * ``clock`` only measures idleness.
    * ``reuse_closed_ids``: a closed id opens a new lifecycle instead of being refused (see the
      module docstring for what survives a restart then).
    * ``deployment_epoch`` goes into the keys minted here, as Versioning mints them.
    * ``registry_retry``: how one ``open_named`` (and an adopted Session's close) is replayed with
      the same request id before the request is refused with ``REQUEST_REFUSED`` (nothing was
      sent); default: 4 attempts, an exponential wait from 0.05 s up to 1 s.
    """

    def __init__(
        self,
        versioning: Versioning,
        *,
        lease: LeaseKeeper | None = None,
        clock: Callable[[], float] = time.monotonic,
        reuse_closed_ids: bool = False,
        deployment_epoch: int = 0,
        registry_retry: RegistryRetry | None = None,
        tagger: SessionTagger | None = None,
        max_sessions: int | None = None,
        retry_after: float = 60.0,
    ) -> None:
        registry = versioning.registry
        if registry is None:
            raise SessionStateError(
                "the gateway needs versioned Sessions (a registry to keep their names)",
                reason="pass_through",
            )
        self._versioning = versioning
        self._registry: RegistryAPI = registry
        self._lease = lease
        self._clock = clock
        self._reuse = reuse_closed_ids
        self._epoch = deployment_epoch
        self._tag = (tagger if tagger is not None else SessionTagger()).tag
        self._max_sessions = max_sessions
        self._retry_after = retry_after
        self.registry_retry: Final = (
            registry_retry
            if registry_retry is not None
            else RegistryRetry(attempts=4, wait=wait_exponential(multiplier=0.05, max=1))
        )
        self._replay = SessionReplay(self._tag, self.registry_retry)
        # A synchronous read of the names, where the registry lives in this process.
        self._core: RegistryCore | None = in_process_core(registry)
        self._cached: dict[str, _Cached] = {}
        # Sessions adopted at a restart, by key prefix: the tag of their id (see SessionTagger).
        self._adopted = AdoptedSessions(registry, versioning, clock=clock, replay=self._replay)
        self._opening: dict[str, asyncio.Task[Session]] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        if lease is not None:
            lease.listeners.append(self._adopted.on_lease_event)

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the gateway's lease now, adopting the predecessor's Sessions at once.

        A failure is logged, not raised: the first request opens the lease instead.
        """
        if self._lease is None:
            return
        try:
            await self._lease.acquire()
        except Exception as exc:
            logger.warning(
                "gateway lease not opened at start; the first request opens it",
                extra={"owner": self._lease.owner, "error": repr(exc)},
            )

    # --- opening --------------------------------------------------------------------------------

    async def open(self, session_id: str) -> Session:
        """The Session for ``session_id``: the cached one, else the registry's by name.

        Raises SESSION_CLOSED / SESSION_EXPIRED for a tombstoned id, REQUEST_REFUSED when the
        registry did not answer (nothing was sent).
        """
        held = self._versioning.get(session_id)
        if held is not None:
            return self._from_cache(session_id, held)
        task = self._opening.get(session_id)
        if task is None:
            self._check_room(session_id)
            # No await between the lookup and the registration: concurrent first requests of
            # one id share one open_named, and so one local Session (and one bind task).
            task = asyncio.get_running_loop().create_task(
                self._open_by_name(session_id), name=f"open session {self._tag(session_id)}"
            )
            self._opening[session_id] = task
            task.add_done_callback(lambda t: self._opened(session_id, t))
        # shield: a request cancelled here leaves the shared open running for the others.
        return await asyncio.shield(task)

    def _check_room(self, session_id: str) -> None:
        """Refuse a new Session while the gateway holds ``max_sessions`` (TOO_MANY_SESSIONS).

        Counted synchronously with the registration of the open that follows (no await in
        between), so concurrent first requests cannot all pass one free place. An id this
        gateway adopted takes no new place: opening it moves it from adopted to held.
        """
        limit = self._max_sessions
        if limit is None or self._tag(session_id) in self._adopted:
            return
        if self.live() + len(self._opening) >= limit:
            raise TooManySessionsError(
                f"the gateway holds its maximum of {limit} open Sessions; retry after "
                f"{self._retry_after:.0f} s or close Sessions you no longer use",
                limit=limit,
                retry_after=self._retry_after,
            )

    def _opened(self, session_id: str, task: asyncio.Task[Session]) -> None:
        if self._opening.get(session_id) is task:
            del self._opening[session_id]
        if not task.cancelled():
            task.exception()  # handed to every waiter already; read so none is left unseen

    def _from_cache(self, session_id: str, session: Session) -> Session:
        if session.phase in (SessionPhase.FINALIZING, SessionPhase.CLOSED):
            raise SessionClosedError(
                f"session {session_id!r} is closing; start a new Session with a new id",
                session=session_id,
                reason="closed",
            )
        cached = self._cached.get(session_id)
        if cached is None:  # opened through the Python API on the same Versioning
            cached = self._cached[session_id] = _Cached(
                self._clock(), named=False, tag=self._tag(session_id)
            )
        refusal = closed_elsewhere(self._core, session_id, session.key) if cached.named else None
        if refusal is not None:
            self._retire(session_id, session)
            raise refusal
        cached.last_used = self._clock()
        return session

    def _retire(self, session_id: str, session: Session) -> None:
        """Close the local copy of a Session that was closed elsewhere (in the background: its
        in-flight requests drain; meanwhile it is FINALIZING, so every request is refused)."""
        logger.info(
            "session closed elsewhere; its local copy is closed too",
            extra={"session": session.key, "version": _version_of(session)},
        )
        self._cached.pop(session_id, None)

        async def close() -> None:
            try:
                await session.close()
            except SessionReleaseError as exc:
                # Its registry record is already closed: nothing is held; logged only.
                logger.warning(
                    "local copy of a Session closed elsewhere not confirmed",
                    extra={"session": session.key, "error": exc.code},
                )

        task = asyncio.get_running_loop().create_task(close(), name=f"retire {session.key}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _open_by_name(self, session_id: str) -> Session:
        named: NamedSession | None
        try:
            named, _ = await self._open_named(session_id)
        except SessionClosedError:
            if not self._reuse:
                raise
            named = None  # a closed id, reused on purpose: a new lifecycle
        held = self._versioning.get(session_id)
        if held is not None:
            # The Python API opened this id on the same Versioning meanwhile.
            if named is not None and held.key != named.session_key:
                raise SessionStateError(
                    f"session {session_id!r} is open here under another registry key",
                    session=session_id,
                )
            return self._from_cache(session_id, held)
        prefix = self._tag(session_id)
        adopted = self._adopted.get(prefix)
        if named is not None:
            key = named.session_key
            # By the key's own prefix, not this process's tag of the id: a predecessor with
            # another tag key minted it, and an entry left in _adopted would be reaped as idle
            # while its agent uses it.
            self._adopted.drop(key)
        elif adopted is not None and not adopted.closing:
            # A reused lifecycle this gateway's predecessor held (not under the name).
            self._adopted.remove(prefix)
            key = adopted.session_key
        else:
            key = self._mint(session_id)
        session = self._versioning.open_session(session_id, session_key=key)
        self._cached[session_id] = _Cached(self._clock(), named=named is not None, tag=prefix)
        if named is not None and (named.binding is not None or named.adopted):
            logger.info(
                "session continued from the registry",
                extra={
                    "session": session.key,
                    "version": named.binding.version_id if named.binding else None,
                    "adopted": named.adopted,
                },
            )
        return session

    async def _open_named(self, session_id: str) -> tuple[NamedSession, bool]:
        """The registry Session behind the name ``session_id``, and whether this call created it."""
        adopted = self._adopted.get(self._tag(session_id))
        if adopted is not None and adopted.closing:
            raise SessionClosedError(
                f"session {session_id!r} is being closed for idleness",
                session=session_id,
                reason="closed",
            )
        key = self._mint(session_id)
        for _ in range(2):
            lease_id = await self._lease_id(session_id)
            request_id = new_request_id()  # every replay of this call reuses it
            try:
                named = await self._replay(
                    "open_named",
                    session_id,
                    functools.partial(
                        self._registry.open_named,
                        request_id=request_id,
                        name=session_id,
                        session_key=key,
                        lease=lease_id,
                    ),
                )
            except LeaseExpiredError as exc:
                # The registry ended the lease before the keeper noticed: lost for good, and
                # the next acquire opens a new incarnation (which adopts what the old one held).
                assert self._lease is not None  # no lease was named, so none can have ended
                self._lease.current.mark_lost(str(exc.details.get("reason") or "expired"))
                continue
            return named, named.session_key == key
        raise SessionExpiredError(
            f"session {session_id!r}: the gateway's lease ended twice while opening it; "
            "nothing was sent",
            session=session_id,
            reason="lease_expired",
        )

    def _mint(self, session_id: str) -> str:
        return f"{self._tag(session_id)}#{self._epoch}-{uuid.uuid4().hex}"

    async def _lease_id(self, session_id: str) -> str | None:
        if self._lease is None:
            return None
        try:
            return (await self._lease.acquire()).lease_id
        except AgenticLoRAError:
            raise
        except Exception as exc:
            raise RequestRefusedError(
                f"session {session_id!r}: the gateway's lease was not confirmed ({exc!r}); "
                "nothing was sent",
                session=session_id,
                stage="lease",
            ) from exc

    # --- use ------------------------------------------------------------------------------------

    def touch(self, session_id: str) -> None:
        """Mark ``session_id`` as used now (called when a request of it ends)."""
        cached = self._cached.get(session_id)
        if cached is not None:
            cached.last_used = self._clock()

    def tag(self, session_id: str) -> str:
        """The keyed hash that stands for ``session_id`` in logs and registry keys."""
        cached = self._cached.get(session_id)
        return cached.tag if cached is not None else self._tag(session_id)

    def live(self) -> int:
        """Sessions this process holds (opened here or adopted) and has not closed yet."""
        return len(self._cached) + len(self._adopted)

    def adopted(self) -> int:
        """Sessions adopted from this gateway's previous incarnation and not used here since."""
        return len(self._adopted)

    # --- closing --------------------------------------------------------------------------------

    async def retired(self) -> None:
        """Wait until every local copy of a Session closed elsewhere has finished its background
        close (started when a turn found the name closed, see :meth:`open`), including copies
        retired while waiting. A close that failed was logged; nothing is raised here."""
        while self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    async def close(self, session_id: str, *, why: str = "closed") -> ReleaseResult | None:
        """Close the Session ``session_id`` wherever it was opened; None when there is none.

        The registry tombstones the id from the moment the close starts (``begin_close``), on
        every replica, so no request can open a second lifecycle while the first one drains. An
        id the registry does not know is tombstoned too (a straggler must not open it later)
        and answers None, as does an id already closed.
        """
        task = self._opening.get(session_id)
        if task is not None:
            await asyncio.wait([task])  # its outcome is its requests' business, not the close's
        session = self._versioning.get(session_id)
        created = False
        if session is None:
            found = await self._find_for_close(session_id)
            if found is None:
                return None
            key, created = found
            # A request may have opened it here meanwhile: that local copy is the one to close.
            session = self._versioning.get(session_id) or self._versioning.open_session(
                session_id, session_key=key
            )
        result = await session.close()
        self._cached.pop(session_id, None)
        logger.info(
            "session closed",
            extra={"session": session.key, "version": _version_of(session), "why": why},
        )
        return None if created else result

    async def _find_for_close(self, session_id: str) -> tuple[str, bool] | None:
        """The registry key to close for ``session_id`` and whether the name was new here, or
        None when it is closed already."""
        prefix = self._tag(session_id)
        try:
            named, created = await self._open_named(session_id)
        except (SessionClosedError, SessionExpiredError):
            adopted = self._adopted.get(prefix)
            if adopted is None or adopted.closing:
                return None
            # A reused lifecycle adopted at a restart: it is not under the (closed) name.
            self._adopted.remove(prefix)
            return adopted.session_key, False
        self._adopted.drop(named.session_key)
        return named.session_key, created

    async def reap_idle(self, idle_for: float) -> IdleReaped:
        """Close every Session unused for ``idle_for`` seconds with nothing in flight.

        Sessions whose earlier release was not confirmed (still FINALIZING) are closed again, and
        adopted Sessions count as used when they were adopted. A release that fails again is
        logged and retried by the next call.
        """
        now = self._clock()
        closed: list[str] = []
        for session_id, cached in list(self._cached.items()):
            session = self._versioning.get(session_id)
            if session is None:  # closed by someone else (e.g. the Python API)
                self._cached.pop(session_id, None)
                continue
            stuck = session.phase is SessionPhase.FINALIZING
            if not stuck and (session.in_flight or now - cached.last_used < idle_for):
                continue
            try:
                await self.close(session_id, why="idle")
            except SessionReleaseError as exc:
                logger.warning(
                    "idle Session close not confirmed; retried next round",
                    extra={"session": session.key, "error": exc.code},
                )
                continue
            closed.append(session_id)
        opening = {self._tag(session_id) for session_id in self._opening}
        adopted = await self._adopted.close_idle(idle_for, now=now, opening=opening)
        return IdleReaped(tuple(closed), tuple(adopted))


def _version_of(session: Session) -> str | None:
    binding = session.binding
    return binding.version_id if binding is not None else None
