"""A conformance suite every backend plugin can run: a reference model vs the plugin.

:class:`BackendConformance` is a hypothesis :class:`~hypothesis.stateful.RuleBasedStateMachine`.
It drives a :class:`~agentic_lora.engines.backends.Backend` against scripted engines with random sequences
of prepares, cleanups, reclaims, stale and fenced messages, lost replies, refusals and engine
restarts, keeps a small model of what each engine must hold, and checks after every step that the
engines agree with it. A plugin proves conformance by subclassing it with a harness::

    class MyPluginConformance(BackendConformance):
        async def make_harness(self) -> ConformanceHarness:
            return MyHarness(...)   # a Backend plus one EngineDouble per scripted engine

    TestMyPlugin = MyPluginConformance.TestCase

The suite drives two engines, the harness's first and second, as slots ``e0`` and ``e1``; their
real names (a plain engine's, or PD role servers' like ``g1.prefill`` and ``g1.decode0``) are what
receipts must carry. The contract it checks (from :mod:`agentic_lora.engines.backends`):

* a READY receipt names exactly the target (engine, version, digest, lora name, attempt) and the
  engine's current incarnation, and the engine then holds exactly that content;
* a repeated prepare of the same attempt never loads a second time;
* a cleanup that returns leaves the engine holding nothing of that attempt; a cleanup that overtook
  its prepare fences it (the late prepare is refused and loads nothing); a late cleanup of a
  superseded attempt unloads nothing;
* a reclaim that returns leaves nothing loaded; repeating it (same reclaim id) never unloads again;
  a reclaimed attempt is never loaded again; a rollback's reload (a newer attempt) loads exactly
  that content (a new reclaim id unloads it again), or is refused with nothing loaded;
* an engine that refused reports :class:`~agentic_lora.errors.BackendRefusedError` for a prepare
  (nothing held) and never lets a cleanup or reclaim look confirmed; an engine whose reply was lost
  reports :class:`~agentic_lora.errors.BackendAmbiguousError`, and a retry converges without a
  second physical load or unload;
* the incarnation is stable while the engine runs and changes when it restarts;
* at no point does an engine hold two loads of one name (loads - unloads is 0 or 1 per name).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import unittest
from collections.abc import Coroutine
from collections.abc import Iterator
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Protocol
from typing import TypeVar

from hypothesis import HealthCheck
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle
from hypothesis.stateful import MultipleResults
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import initialize
from hypothesis.stateful import invariant
from hypothesis.stateful import multiple
from hypothesis.stateful import rule

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.engines.backends import Backend
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.backends import PublicationTarget
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendError
from agentic_lora.errors import BackendRefusedError
from agentic_lora.foundation.identity import make_lora_name
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.testing.adapters import tiny_snapshot

__all__ = [
    "BackendConformance",
    "BackendHarness",
    "ConformanceHarness",
    "EngineDouble",
    "Failure",
    "Operation",
]

T = TypeVar("T")


class Operation(enum.StrEnum):
    """Backend operations a failure can be scripted for."""

    PREPARE = "prepare"
    CLEANUP = "cleanup"
    RECLAIM = "reclaim"


class Failure(enum.StrEnum):
    """How the engine side fails the next operation."""

    REFUSE = "refuse"  # the engine answers "no" and does nothing
    LOSE_REPLY = "lose_reply"  # the engine does its part; the answer never arrives


class EngineDouble(Protocol):
    """One scripted engine as the suite sees and steers it."""

    @property
    def ref(self) -> EngineRef: ...

    def held_digest(self, lora_name: str) -> str | None:
        """Digest of the content the engine serves under ``lora_name`` (None: nothing)."""
        ...

    def loads(self, lora_name: str) -> int:
        """Physical loads of ``lora_name`` since the engine last started."""
        ...

    def unloads(self, lora_name: str) -> int:
        """Physical unloads of ``lora_name`` since the engine last started."""
        ...

    def restart(self) -> None:
        """Restart the engine process (it forgets every adapter)."""
        ...

    def fail_next(self, operation: Operation, failure: Failure) -> None:
        """Make the engine side of the next ``operation`` fail this way."""
        ...

    def clear_failures(self) -> None:
        """Drop scripted failures that were not consumed."""
        ...


class ConformanceHarness(Protocol):
    """A backend under test and the scripted engines it talks to."""

    @property
    def backend(self) -> Backend: ...

    @property
    def engines(self) -> Sequence[EngineDouble]: ...

    async def aclose(self) -> None: ...


class BackendHarness:
    """A :class:`ConformanceHarness` over a built backend and its engine doubles.

    :meth:`aclose` closes the backend first, then :meth:`release` frees what the harness holds
    besides it (a router, a store directory, an HTTP client), even when the backend's close
    failed.
    """

    def __init__(self, backend: Backend, engines: Sequence[EngineDouble]) -> None:
        self._backend = backend
        self._doubles = list(engines)

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def engines(self) -> Sequence[EngineDouble]:
        return self._doubles

    async def release(self) -> None:
        """What the harness holds besides the backend (nothing here)."""

    async def aclose(self) -> None:
        try:
            await self._backend.aclose()
        finally:
            await self.release()


@dataclass(frozen=True)
class _Version:
    version_id: str
    snapshot: AdapterSnapshot
    lora_name: str


_VERSIONS: tuple[_Version, ...] = tuple(
    _Version(vid, snap, make_lora_name("conformance", 0, vid, snap.digest))
    for vid, snap in (("v1", tiny_snapshot(101)), ("v2", tiny_snapshot(102)))
)


@dataclass
class _Track:
    """The model of one (engine slot, version), with the scripted engine it is about."""

    engine: str
    double: EngineDouble = field(repr=False)
    version: _Version
    attempt: int = 1  # the attempt the next fresh prepare uses
    prepared: int = 0  # newest attempt whose prepare reached the engine
    cleaned: int = 0  # newest attempt whose cleanup returned
    held: bool = False
    needs_cleanup: bool = False  # a cleanup's outcome is unknown: confirm it before moving on
    reclaimed: bool = False
    reclaim_ids: set[str] = field(default_factory=set)
    reloads: int = 0  # rollbacks that loaded the name again after a reclaim

    @property
    def reclaim_id(self) -> str:  # the registry's: a new one for each life of the name
        return f"reclaim-{self.version.version_id}-{self.engine}.{self.reloads}"

    @property
    def lora_name(self) -> str:
        return self.version.lora_name

    def held_digest(self) -> str | None:
        return self.double.held_digest(self.lora_name)

    def loads(self) -> int:
        return self.double.loads(self.lora_name)

    def unloads(self) -> int:
        return self.double.unloads(self.lora_name)

    def target(self, attempt: int) -> PublicationTarget:
        v = self.version
        return PublicationTarget(v.version_id, v.snapshot.digest, v.lora_name, attempt)

    @contextlib.contextmanager
    def failing(self, operation: Operation, failure: Failure) -> Iterator[None]:
        """The engine fails its next ``operation`` with ``failure``; a failure the call did not
        consume is dropped on the way out, so it can never strike a later rule."""
        self.double.fail_next(operation, failure)
        try:
            yield
        finally:
            self.double.clear_failures()


class BackendConformance(RuleBasedStateMachine):
    """Subclass, implement :meth:`make_harness`, and expose ``TestCase`` to pytest."""

    async def make_harness(self) -> ConformanceHarness:
        """Build the backend and its scripted engines (called once per example)."""
        raise TypeError(
            f"{type(self).__name__} must override make_harness() to return the plugin's harness"
        )

    @classmethod
    def test_case(cls, *, max_examples: int, steps: int = 30) -> type[unittest.TestCase]:
        """The suite as a test class for pytest, ``max_examples`` runs of ``steps`` rules each.

        No deadline: a step waits on real backend code and its scripted engines, whose time says
        nothing about conformance.
        """
        case = cls.TestCase
        case.settings = settings(
            max_examples=max_examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        return case

    def __init__(self) -> None:
        super().__init__()
        self._loop = asyncio.new_event_loop()
        self.harness = self._run(self.make_harness())
        self.backend = self.harness.backend
        # Slots in harness order: the rules draw slot names, receipts carry the real names.
        self.doubles = dict(zip(("e0", "e1"), self.harness.engines, strict=False))
        self.tracks: dict[tuple[str, str], _Track] = {
            (e, v.lora_name): _Track(e, d, v) for e, d in self.doubles.items() for v in _VERSIONS
        }
        self.incarnations: dict[str, str] = {
            e: self._run(self.backend.incarnation(d.ref)) for e, d in self.doubles.items()
        }

    def teardown(self) -> None:
        try:
            self._run(self.harness.aclose())
        finally:
            self._loop.close()

    # --- what the rules draw: only the harness's own engines (one or two) -----------------------

    slots: Bundle[str] = Bundle("slots")
    tracked: Bundle[_Track] = Bundle("tracked")
    failures = st.sampled_from(list(Failure))

    @initialize(target=slots)
    def the_harness_engines(self) -> MultipleResults[str]:
        return multiple(*self.doubles)

    @initialize(target=tracked)
    def every_version_on_every_engine(self) -> MultipleResults[_Track]:
        return multiple(*self.tracks.values())

    # --- helpers -------------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run_until_complete(coro)

    def _prepare(self, t: _Track, attempt: int) -> Coroutine[Any, Any, ReadyReceipt]:
        return self.backend.prepare(t.double.ref, t.target(attempt), t.version.snapshot)

    def _cleanup(self, t: _Track, attempt: int) -> Coroutine[Any, Any, None]:
        return self.backend.cleanup(t.double.ref, t.target(attempt))

    def _reclaim(self, t: _Track, reclaim_id: str) -> Coroutine[Any, Any, None]:
        return self.backend.reclaim(t.double.ref, lora_name=t.lora_name, reclaim_id=reclaim_id)

    def _reclaimed(self, t: _Track, reclaim_id: str) -> None:
        # A reclaim returned: the engine holds nothing of the name (until a rollback reloads it).
        assert t.held_digest() is None
        t.held, t.reclaimed = False, True
        t.reclaim_ids.add(reclaim_id)

    def _expect(self, kind: type[BaseException], coro: Coroutine[Any, Any, Any]) -> BaseException:
        try:
            self._run(coro)
        except kind as exc:
            return exc
        raise AssertionError(f"expected {kind.__name__}")

    # --- prepare -------------------------------------------------------------------------------

    @staticmethod
    def _can_prepare(t: _Track) -> bool:
        return not t.reclaimed and not t.needs_cleanup and t.attempt > t.cleaned

    @rule(t=tracked)
    def prepare(self, t: _Track) -> None:
        if not self._can_prepare(t):
            return
        loads = t.loads()
        receipt = self._run(self._prepare(t, t.attempt))
        assert (
            receipt.engine,
            receipt.version_id,
            receipt.digest,
            receipt.lora_name,
            receipt.attempt,
        ) == (
            t.double.ref.name,
            t.version.version_id,
            t.version.snapshot.digest,
            t.lora_name,
            t.attempt,
        ), receipt
        assert receipt.incarnation == self.incarnations[t.engine]
        assert t.held_digest() == t.version.snapshot.digest
        assert t.loads() == loads + (0 if t.held else 1), "a second load"
        t.prepared, t.held = t.attempt, True

    @rule(t=tracked, failure=failures)
    def prepare_fails_on_the_engine(self, t: _Track, failure: Failure) -> None:
        if not self._can_prepare(t) or t.held:
            return  # held: nothing would reach the engine's load
        with t.failing(Operation.PREPARE, failure):
            if failure is Failure.REFUSE:
                self._expect(BackendRefusedError, self._prepare(t, t.attempt))
                assert t.held_digest() is None
            else:
                self._expect(BackendAmbiguousError, self._prepare(t, t.attempt))
                t.prepared, t.held = t.attempt, t.held_digest() is not None

    @rule(t=tracked)
    def prepare_of_a_cleaned_attempt_is_fenced(self, t: _Track) -> None:
        if t.cleaned == 0:
            return
        loads, held = t.loads(), t.held_digest()
        self._expect(BackendRefusedError, self._prepare(t, t.cleaned))
        assert t.loads() == loads
        assert t.held_digest() == held

    # --- cleanup -------------------------------------------------------------------------------

    @rule(t=tracked)
    def cleanup(self, t: _Track) -> None:
        if t.reclaimed:
            return
        unloads = t.unloads()
        self._run(self._cleanup(t, t.attempt))
        assert t.held_digest() is None
        assert t.unloads() == unloads + (1 if t.held else 0)
        t.cleaned, t.held, t.needs_cleanup = t.attempt, False, False
        t.attempt += 1  # a new attempt starts only after a confirmed cleanup

    @rule(t=tracked, failure=failures)
    def cleanup_fails_on_the_engine(self, t: _Track, failure: Failure) -> None:
        if t.reclaimed or not t.held:
            return
        with t.failing(Operation.CLEANUP, failure):
            # Unconfirmed either way: a cleanup must never look done when it is not known to be.
            self._expect(BackendError, self._cleanup(t, t.attempt))
        if failure is Failure.REFUSE:
            assert t.held_digest() == t.version.snapshot.digest
        t.held = t.held_digest() is not None
        t.needs_cleanup = True

    @rule(t=tracked)
    def late_cleanup_of_a_superseded_attempt_unloads_nothing(self, t: _Track) -> None:
        if t.reclaimed or not t.held or t.prepared < 2:
            return
        unloads = t.unloads()
        # Refused is also fine: "holds nothing of that attempt".
        with contextlib.suppress(BackendRefusedError):
            self._run(self._cleanup(t, t.prepared - 1))
        assert t.held_digest() == t.version.snapshot.digest
        assert t.unloads() == unloads

    # --- reclaim -------------------------------------------------------------------------------

    @staticmethod
    def _can_reclaim(t: _Track) -> bool:
        return t.held and not t.needs_cleanup and not t.reclaimed

    @rule(t=tracked)
    def reclaim(self, t: _Track) -> None:
        if self._can_reclaim(t):
            self._run(self._reclaim(t, t.reclaim_id))
            self._reclaimed(t, t.reclaim_id)

    @rule(t=tracked)
    def reclaim_with_a_lost_receipt_converges(self, t: _Track) -> None:
        if not self._can_reclaim(t):
            return
        reclaim_id, unloads = t.reclaim_id, t.unloads()
        with t.failing(Operation.RECLAIM, Failure.LOSE_REPLY):
            self._expect(BackendAmbiguousError, self._reclaim(t, reclaim_id))
        self._run(self._reclaim(t, reclaim_id))
        assert t.unloads() == unloads + 1
        self._reclaimed(t, reclaim_id)

    @rule(t=tracked)
    def repeated_reclaim_never_unloads_again(self, t: _Track) -> None:
        if not t.reclaim_ids:
            return
        unloads, held = t.unloads(), t.held_digest()
        for reclaim_id in sorted(t.reclaim_ids):
            self._run(self._reclaim(t, reclaim_id))
        # Done already, also one of an earlier life of the name (before a reload).
        assert (t.unloads(), t.held_digest()) == (unloads, held)

    @rule(t=tracked)
    def a_reclaimed_attempt_is_never_loaded_again(self, t: _Track) -> None:
        if not t.reclaimed:
            return
        loads = t.loads()
        self._expect(BackendError, self._prepare(t, max(t.prepared, 1)))
        assert t.loads() == loads
        assert t.held_digest() is None

    @rule(t=tracked)
    def a_rollback_reloads_a_reclaimed_name_or_is_refused(self, t: _Track) -> None:
        if not t.reclaimed:
            return
        # The registry numbers a reload above every attempt of the version before it.
        attempt, loads = max(t.attempt, t.prepared, t.cleaned) + 1, t.loads()
        try:
            receipt = self._run(self._prepare(t, attempt))
        except BackendRefusedError:
            assert (t.loads(), t.held_digest()) == (loads, None)
            return
        assert (receipt.lora_name, receipt.attempt, t.loads()) == (t.lora_name, attempt, loads + 1)
        assert t.held_digest() == t.version.snapshot.digest
        t.attempt = t.prepared = attempt
        t.held, t.reclaimed, t.reloads = True, False, t.reloads + 1

    # --- engines -------------------------------------------------------------------------------

    @rule(engine=slots)
    def engine_restarts(self, engine: str) -> None:
        double = self.doubles[engine]
        double.restart()
        after = self._run(self.backend.incarnation(double.ref))
        assert after != self.incarnations[engine], "a restart must change the incarnation"
        self.incarnations[engine] = after
        for t in self.tracks.values():
            if t.engine == engine:
                t.held = False

    @rule(engine=slots)
    def incarnation_is_stable_while_the_engine_runs(self, engine: str) -> None:
        assert (
            self._run(self.backend.incarnation(self.doubles[engine].ref))
            == self.incarnations[engine]
        )

    # --- what must always be true --------------------------------------------------------------

    @invariant()
    def engines_hold_exactly_what_the_model_says(self) -> None:
        for t in self.tracks.values():
            digest = t.held_digest()
            if t.held:
                assert digest == t.version.snapshot.digest, (t, digest)
            else:
                assert digest is None, (t, "still held")

    @invariant()
    def never_two_loads_of_one_name(self) -> None:
        for t in self.tracks.values():
            live = t.loads() - t.unloads()
            assert live in (0, 1), (t, live)
