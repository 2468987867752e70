"""Sessions: bind once at the first generation, send exactly that version, release exactly once.

Users hold a :class:`Versioning` (one per rollout worker) and open a :class:`Session` per agent
episode::

    async with versioning.session(session_id) as s:
        out = await s.generate({"text": prompt, "sampling_params": {"max_new_tokens": 64}})

or, for frameworks without context managers, ``s = versioning.open_session(id)`` ... ``await
s.close()``.

A Session's life (one transition table, :data:`TRANSITIONS`)::

    OPEN --first generation binds--> BOUND --close--> FINALIZING --released--> CLOSED
      \\------------------------------close-----------^

* OPEN binds nothing. The first generation starts ONE bind task (registry ``bind_first``); every
  concurrent first generation awaits that task through :func:`asyncio.shield`, so cancelling a
  waiter never cancels the binding, and once bound no request reads the default again.
* If the bind task fails (no version published yet, a lost reply), the next generation replays
  ``bind_first`` with the same request id; the registry answers per Session, so a replay can
  only ever return the first answer, never a fresh choice.
* Close: FINALIZING (no new dispatch) -> ``begin_close`` (a late bind is now refused) -> wait for
  the bind task -> abort and drain in-flight requests -> ``release`` (retried with the same
  request id until confirmed; on failure :class:`~agentic_lora.errors.SessionReleaseError` and the
  Session stays FINALIZING so close can be called again) -> drop the record -> ``forget_sessions``.

With the feature flag off a Session is a pass-through (its binder is the null one): no registry,
no binding, and every body goes out exactly as the caller sent it (the legacy fixed adapter name
included).

Engine dialects (``engine_kind``, see :mod:`agentic_lora.engines.dialect`): SGLang is the default.
A versioned Session checks the route once, before binding (a route the engine does not serve,
such as vLLM's missing ``/generate``, is refused and binds nothing); the adapter pin names the
adapter the dialect's way (vLLM: ``model=<lora_name>``). On an engine that cannot abort a request
by id (vLLM), :meth:`Session.abort` raises, and close waits for in-flight requests to end instead
of aborting them.

The package is split by job: :mod:`~agentic_lora.session.transitions` (the phases and their one
table, pure), :mod:`~agentic_lora.session.lifecycle` (the Session: its dispatch and close, moving
only through that table), :mod:`~agentic_lora.session.binder` (the registry side of a Session:
:class:`~agentic_lora.session.binder.RegistryBinder`, or the null binder when passing through) and
:mod:`~agentic_lora.session.versioning` (the manager).

Owner leases (``Versioning(lease=LeaseKeeper(...))``; built from settings when the flag is on, see
:mod:`agentic_lora.leases`): a Session binds under its worker's lease, so the ref is released by
the registry when the worker dies (TTL) or restarts (at once). A Session keeps the lease it first
tried to bind under for life: every replay of its bind carries that lease (with the same request
id), so the registry can only ever hold its ref under it. Every dispatch checks that lease first
(sync, no I/O): once it is lost the dispatch is refused with
:class:`~agentic_lora.errors.SessionExpiredError` (``SESSION_EXPIRED``) before the bind and before
any engine call, because the ref may already be released and the version reclaimed. Such a Session
can only be closed (``begin_close``/``release`` answer ``released_now=False``). Sessions that first
bind after the loss get the keeper's fresh incarnation and work. ``lease=None`` keeps Sessions
lease-free (their refs then live until closed).

Bounded staleness (``Versioning(max_version_lag=K)``, settings ``max_version_lag``; off by
default): a Session's version never changes, but once its bound version is more than K
publications behind the current default (the lag, see :mod:`agentic_lora.registry.provenance`), its next
dispatch is refused with :class:`~agentic_lora.errors.VersionTooStaleError`
(``VERSION_TOO_STALE``, details ``lag`` and ``version``) after the bind and before any engine
call. The check runs only when a dispatch starts, so a generation already running is never cut.
The refusal is sticky (every later dispatch is refused too); the Session can only be closed,
which releases its ref so the retired version can be reclaimed and its capacity slot reused.
Every versioned reply carries :class:`~agentic_lora.registry.provenance.TurnProvenance`
(``reply.provenance``) and :meth:`Session.provenance` returns the whole trajectory's record.

:meth:`Versioning.wait_drained` waits until no request of this manager's Sessions is in flight on
an adapter; the vLLM backend awaits it before unloading a reclaimed version, because vLLM's unload
does not wait for requests still running on it.
"""

from agentic_lora.session.binder import PASS_THROUGH
from agentic_lora.session.binder import RegistryBinder
from agentic_lora.session.binder import SessionBinder
from agentic_lora.session.lifecycle import Session
from agentic_lora.session.transitions import TRANSITIONS
from agentic_lora.session.transitions import SessionPhase
from agentic_lora.session.transitions import next_phase
from agentic_lora.session.versioning import Versioning

__all__ = [
    "PASS_THROUGH",
    "TRANSITIONS",
    "RegistryBinder",
    "Session",
    "SessionBinder",
    "SessionPhase",
    "Versioning",
    "next_phase",
]
