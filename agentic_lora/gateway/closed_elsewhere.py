"""Whether a Session the gateway holds was closed by *another* replica meanwhile.

A gateway's map of live Session objects is a cache of the registry's names
(:mod:`agentic_lora.gateway.sessions`). Where a Session closed by another replica is noticed:

* With an in-process registry (:class:`~agentic_lora.registry.local.LocalRegistry`, which replicas
  in one process share) every turn of a cached Session reads the registry's name table
  synchronously (no I/O, :func:`closed_elsewhere`) and refuses it once the name is a tombstone or
  names another key.
* Over a remote registry (the Ray actor) a cached Session learns it at its next registry call: an
  unbound one is refused by ``bind_first``, and a bound one keeps dispatching on its binding until
  this replica closes or expires it. It never switches version; only a straggler after a close
  elsewhere may still be served, on the version it was bound to.
"""

from __future__ import annotations

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import SessionClosedError
from agentic_lora.errors import SessionExpiredError
from agentic_lora.registry.core import RegistryCore
from agentic_lora.registry.types import SessionState

__all__ = ["closed_elsewhere"]


def closed_elsewhere(
    core: RegistryCore | None, session_id: str, session_key: str
) -> AgenticLoRAError | None:
    """Why the registry no longer holds ``session_key`` under the name ``session_id`` (None: it
    does, or ``core`` is None: a remote registry, not read here)."""
    if core is None:
        return None  # a remote registry: see the module docstring
    named = core.named(session_id)
    if named is not None and named.session_key == session_key:
        return None
    status = core.session(session_key)
    if status is not None and status.state is SessionState.EXPIRED:
        return SessionExpiredError(
            f"session {session_id!r} expired; start a new Session with a new id",
            session=session_id,
            reason="expired",
        )
    return SessionClosedError(
        f"session {session_id!r} was closed; start a new Session with a new id",
        session=session_id,
        reason="closed",
    )
