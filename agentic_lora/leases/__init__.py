"""Owner leases, client side: the Sessions a rollout worker binds stay held while, and only while,
that worker is alive.

Every Session ref hangs on its owner's registry lease (``open_lease`` / ``renew_lease`` /
``close_lease``; the registry side is :class:`~agentic_lora.registry.core.RegistryCore`). A worker
that dies stops renewing; once the TTL passed, the registry's sweeper expires the lease and
releases the refs, so a retired version can be reclaimed. A :class:`LeaseKeeper` is the owner's
half: one per :class:`~agentic_lora.session.Versioning`, i.e. one per rollout worker process.

One incarnation's lease, as this process sees it (a :class:`LeaseTerm`)::

    PENDING --open granted--> HELD --local deadline passed, or the registry said LEASE_EXPIRED--> LOST
       |                        \\----------------------------aclose: close_lease-------------> CLOSED
       \\--the registry refused the open (LEASE_EXPIRED)--> LOST

* **Owner and incarnation.** ``owner`` names the worker *slot* and should be stable across restarts
  of that slot (``"rollout-worker-3"``; flag ``--versioned-lora-owner-id``). The incarnation is
  minted per process start (uuid4 hex). When a new incarnation of a known owner opens its lease,
  the registry ends the predecessor's at once: with ``on_restart="release"`` (rollout workers) its
  Sessions are expired and their refs released without waiting for the TTL; with ``"adopt"`` (the
  gateway, whose agents outlive it) they move to the new lease. Without a configured owner the
  default is ``f"{hostname}-{pid}"``, which no restart ever reuses: a dead worker's Sessions are
  then released by the TTL only (``ttl`` plus the registry's sweep interval). Owner ids must be
  unique among live processes.
* **Lazy.** Constructing a keeper does no I/O; the first Session bind opens the lease.
* **Renewal.** A background task renews every ``renew_interval`` (default ``ttl / 3``) whether or
  not Sessions dispatch, so an idle worker keeps its Sessions. Every dispatch marks the lease in use
  (:meth:`LeaseTerm.touch`) and, if the last successful renewal is older than ``renew_interval``
  (a late timer, a stalled event loop), wakes the renewer at once. A dispatch never waits for a
  renewal and never makes a registry call of its own.
* **Failed renewals** (registry unreachable, reply lost) are replayed with the same request id,
  which the registry answers from its memory, until the local deadline; then the lease is LOST.
* **Local deadline.** The keeper decides on its own clock (``time.monotonic``) whether its lease
  still holds: ``ttl`` after it *sent* the last successful open or renew (``LeaseTerm._granted``
  argues why that deadline is never later than the registry's).
* **Lost is for good.** A Session bound under a lost lease is refused at every dispatch with
  :class:`~agentic_lora.errors.SessionExpiredError` (``SESSION_EXPIRED``, nothing sent) and can
  only be closed: its ref may already be released, and its version reclaimed. *New* Sessions keep
  working: the next bind mints a fresh incarnation and opens a new lease (with ``"release"`` that
  also ends the lost one at the registry at once, if it still held it). One exception: a keeper
  whose lease was ended because a newer incarnation of its owner opened one (the registry's reason
  ``owner_restarted``: this process was partitioned or hung while its slot was restarted) never
  opens again, because reopening would end the newer process's lease and expire *its* Sessions.
  After a purely local loss the keeper first asks the registry (one ``renew_lease``) whether that
  happened, before it reopens. With ``on_restart="adopt"`` a reopened incarnation adopts whatever
  the lost lease still held; the gateway re-attaches those Sessions by name.
* **What a keeper cannot see.** A process whose lease the registry ended (a restart of its slot
  elsewhere, or expiry after a pause the process did not notice) learns it at its next renewal, at
  most ``renew_interval`` later; until then its bound Sessions still dispatch (the dispatch guard
  still refuses any request for a version that is being reclaimed).

Tests step time with an injected ``clock`` and ``sleep`` (see tests/leases/test_leases.py).
"""

from agentic_lora.leases.keeper import LeaseKeeper
from agentic_lora.leases.options import DEFAULT_LEASE_TTL
from agentic_lora.leases.options import OnRestart
from agentic_lora.leases.options import check_lease_timing
from agentic_lora.leases.options import check_owner
from agentic_lora.leases.options import default_owner
from agentic_lora.leases.term import LeaseEvent
from agentic_lora.leases.term import LeaseEventKind
from agentic_lora.leases.term import LeaseListener
from agentic_lora.leases.term import LeaseState
from agentic_lora.leases.term import LeaseTerm

__all__ = [
    "DEFAULT_LEASE_TTL",
    "LeaseEvent",
    "LeaseEventKind",
    "LeaseKeeper",
    "LeaseListener",
    "LeaseState",
    "LeaseTerm",
    "OnRestart",
    "check_lease_timing",
    "check_owner",
    "default_owner",
]
