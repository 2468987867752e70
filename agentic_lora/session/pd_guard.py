"""The dispatch guard of a fleet with PD groups (see :mod:`agentic_lora.engines.pd` for the fleet model).

It sits in the session layer because it wraps the middleware's guard; the fleet model it reads
sits below, with the engines.
"""

from __future__ import annotations

from agentic_lora.engines.pd import PDFleet
from agentic_lora.engines.pd import members_holding
from agentic_lora.registry.types import Binding
from agentic_lora.session.middleware import DispatchGuard
from agentic_lora.session.middleware import PeekGuard

__all__ = ["PDGuard", "pd_guard"]


class PDGuard:
    """A :class:`~agentic_lora.session.middleware.DispatchGuard` for a fleet with PD groups.

    The inner guard answers which *servers* hold the bound version (the registry's
    ``ready_engines``); this one answers which *members* may get the request: a group only while
    every role server holds the version. A prefill that holds it with a restarted decode that
    does not would mix the version's prefill with the base model's decode, so that group is not
    offered to the router, and with no member left the dispatch is refused before anything is
    sent (:class:`~agentic_lora.errors.VersionUnavailableError`).
    """

    def __init__(self, inner: DispatchGuard, fleet: PDFleet) -> None:
        self._inner = inner
        self._requirements = fleet.requirements()
        # The common case, every server holding the version, is one tuple comparison: the
        # registry lists holders in its engine order, which is the fleet's server order.
        self._all_servers = tuple(ref.name for ref in fleet.publication_engines)
        self._all_members = tuple(m.name for m in fleet.members)

    def check(self, binding: Binding) -> tuple[str, ...] | None:
        """Raise as the inner guard does; else the members that hold the version on every role."""
        holders = self._inner.check(binding)
        if holders is None:
            return None
        if holders == self._all_servers:
            return self._all_members
        return members_holding(self._requirements, holders)


def pd_guard(registry: object, fleet: PDFleet) -> PDGuard | None:
    """The dispatch guard of a fleet with PD groups: the registry's version read
    (:meth:`PeekGuard.of`) folded into members by :class:`PDGuard`; None when the registry has no
    synchronous read (then :class:`~agentic_lora.session.Versioning` refuses to start without an
    explicit guard)."""
    inner = PeekGuard.of(registry)
    return None if inner is None else PDGuard(inner, fleet)
