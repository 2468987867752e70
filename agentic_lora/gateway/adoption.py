"""The Sessions a gateway adopted at a restart, until used again or closed for idleness.

A restarted gateway with the same ``gateway_id`` adopts its predecessor's Sessions the moment its
lease opens (``on_restart="adopt"``, see :mod:`agentic_lora.leases`): the registry moves them to
the new lease and lists them in the lease event. Adopted Sessions whose agent never comes back
would hold their version for as long as this gateway renews its lease, so
:class:`AdoptedSessions` remembers them, by key prefix (the tag of their id, see
:class:`~agentic_lora.gateway.security.SessionTagger`), until a request of the id opens them again
(:mod:`agentic_lora.gateway.sessions` takes them out) or the idle expiry closes them
(:meth:`AdoptedSessions.close_idle`), like any other idle Session.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import KW_ONLY
from dataclasses import dataclass
from dataclasses import field

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.gateway.replay import SessionReplay
from agentic_lora.leases import LeaseEvent
from agentic_lora.leases import LeaseEventKind
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.types import new_request_id
from agentic_lora.session import Versioning

__all__ = ["AdoptedSession", "AdoptedSessions", "key_prefix"]

logger = logging.getLogger(__name__)


def key_prefix(session_key: str) -> str:
    """The prefix of a key minted by the gateway (the tag of its id), or the whole key."""
    prefix, sep, _ = session_key.rpartition("#")
    return prefix if sep and prefix else session_key


@dataclass(slots=True)
class AdoptedSession:
    """A Session taken over from this gateway's previous incarnation and not used here yet."""

    session_key: str
    since: float
    closing: bool = False
    # One idempotency key per verb: a close retried by the next expiry round replays them.
    begin_close_id: str = field(default_factory=new_request_id)
    release_id: str = field(default_factory=new_request_id)


@dataclass(eq=False)
class AdoptedSessions:
    """The adopted Sessions of one gateway, by key prefix.

    * ``versioning`` tells which adopted keys this process holds itself (not adopted leftovers).
    * ``clock`` stamps the adoption: an adopted Session counts as used when it was adopted.
    * ``replay`` replays the close's registry calls as the gateway replays its own.
    """

    registry: RegistryAPI
    versioning: Versioning
    _: KW_ONLY
    clock: Callable[[], float]
    replay: SessionReplay
    _by_prefix: dict[str, AdoptedSession] = field(init=False, default_factory=dict)

    def __len__(self) -> int:
        return len(self._by_prefix)

    def __contains__(self, prefix: object) -> bool:
        return prefix in self._by_prefix

    def get(self, prefix: str) -> AdoptedSession | None:
        """The adopted Session of the id tagged ``prefix``, if any."""
        return self._by_prefix.get(prefix)

    def remove(self, prefix: str) -> None:
        """Take the adopted Session of ``prefix`` out: it is held here again."""
        del self._by_prefix[prefix]

    def drop(self, session_key: str) -> None:
        """``session_key`` is held under its name again: no longer an adopted leftover."""
        prefix = key_prefix(session_key)
        adopted = self._by_prefix.get(prefix)
        if adopted is not None and adopted.session_key == session_key:
            del self._by_prefix[prefix]

    def on_lease_event(self, event: LeaseEvent) -> None:
        """The gateway lease's listener: remember the Sessions a new incarnation adopted."""
        if event.kind is not LeaseEventKind.OPENED or not event.adopted:
            return
        now = self.clock()
        held = {s.key for s in self.versioning.live_sessions()}
        for key in event.adopted:
            if key not in held:  # held: this process's own (its lease was lost and reopened)
                self._by_prefix[key_prefix(key)] = AdoptedSession(key, now)
        logger.info(
            "gateway adopted its predecessor's Sessions",
            extra={"lease": event.lease_id, "adopted": len(event.adopted)},
        )

    async def close_idle(self, idle_for: float, *, now: float, opening: set[str]) -> list[str]:
        """Close every adopted Session adopted ``idle_for`` seconds before ``now``, except those
        whose id is being opened (prefixes in ``opening``); returns the prefixes closed."""
        closed: list[str] = []
        for prefix, adopted in list(self._by_prefix.items()):
            if now - adopted.since < idle_for or prefix in opening:
                continue
            if await self._close(prefix, adopted):
                closed.append(prefix)
        return closed

    async def _close(self, prefix: str, adopted: AdoptedSession) -> bool:
        # Set before the first await: a request for this id from now on is refused instead of
        # opening the Session under our feet (see GatewaySessions._open_named).
        adopted.closing = True
        key = adopted.session_key
        try:
            await self.replay(
                "begin_close",
                prefix,
                lambda: self.registry.begin_close(
                    request_id=adopted.begin_close_id, session_key=key
                ),
            )
            result = await self.replay(
                "release",
                prefix,
                lambda: self.registry.release(request_id=adopted.release_id, session_key=key),
            )
        except AgenticLoRAError as exc:
            logger.warning(
                "idle adopted Session close not confirmed; retried next round",
                extra={"session": key, "error": exc.code},
            )
            return False
        if self._by_prefix.get(prefix) is adopted:
            del self._by_prefix[prefix]
        try:
            await self.registry.forget_sessions(request_id=new_request_id(), session_keys=[key])
        except Exception as exc:
            # Only memory: the record is closed; the name stays a tombstone either way.
            logger.warning(
                "forget_sessions failed for an adopted Session",
                extra={"session": key, "error": repr(exc)},
            )
        logger.info(
            "idle adopted Session closed",
            extra={"session": key, "version": result.version_id, "why": "idle"},
        )
        return True
