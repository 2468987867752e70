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
  a reclaimed name is never loaded again;
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
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.engines.backends import Backend, EngineRef, PublicationTarget
from agentic_lora.errors import BackendAmbiguousError, BackendError, BackendRefusedError
from agentic_lora.foundation.identity import make_lora_name
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


@dataclass
class _Track:
    """The model of one (engine, lora name)."""

    attempt: int = 1  # the attempt the next fresh prepare uses
    prepared: int = 0  # newest attempt whose prepare reached the engine
    cleaned: int = 0  # newest attempt whose cleanup returned
    held: bool = False
    needs_cleanup: bool = False  # a cleanup's outcome is unknown: confirm it before moving on
    reclaimed: bool = False
    reclaim_ids: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class _Version:
    version_id: str
    snapshot: AdapterSnapshot
    lora_name: str


_VERSIONS: tuple[_Version, ...] = tuple(
    _Version(vid, snap, make_lora_name("conformance", 0, vid, snap.digest))
    for vid, snap in (("v1", tiny_snapshot(101)), ("v2", tiny_snapshot(102)))
)


class BackendConformance(RuleBasedStateMachine):
    """Subclass, implement :meth:`make_harness`, and expose ``TestCase`` to pytest."""

    async def make_harness(self) -> ConformanceHarness:
        """Build the backend and its scripted engines (called once per example)."""
        raise TypeError(
            f"{type(self).__name__} must override make_harness() to return the plugin's harness"
        )

    def __init__(self) -> None:
        super().__init__()
        self._loop = asyncio.new_event_loop()
        self.harness = self._run(self.make_harness())
        self.backend = self.harness.backend
        # Slots in harness order: the rules sample slot names, receipts carry the real names.
        self.doubles = dict(zip(("e0", "e1"), self.harness.engines, strict=False))
        self.tracks: dict[tuple[str, str], _Track] = {
            (e, v.lora_name): _Track() for e in self.doubles for v in _VERSIONS
        }
        self.incarnations: dict[str, str] = {
            e: self._run(self.backend.incarnation(d.ref)) for e, d in self.doubles.items()
        }

    def teardown(self) -> None:
        try:
            self._run(self.harness.aclose())
        finally:
            self._loop.close()

    # --- helpers -------------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run_until_complete(coro)

    def _target(self, version: _Version, attempt: int) -> PublicationTarget:
        return PublicationTarget(
            version.version_id, version.snapshot.digest, version.lora_name, attempt
        )

    def _track(self, engine: str, version: _Version) -> _Track:
        return self.tracks[(engine, version.lora_name)]

    def _reclaim(
        self, double: EngineDouble, version: _Version, reclaim_id: str
    ) -> Coroutine[Any, Any, None]:
        return self.backend.reclaim(double.ref, lora_name=version.lora_name, reclaim_id=reclaim_id)

    def _reclaimed(
        self, t: _Track, double: EngineDouble, version: _Version, reclaim_id: str
    ) -> None:
        # A reclaim returned: the engine holds nothing of the name, and for good.
        assert double.held_digest(version.lora_name) is None
        t.held, t.reclaimed = False, True
        t.reclaim_ids.add(reclaim_id)

    def _expect(self, kind: type[BaseException], coro: Coroutine[Any, Any, Any]) -> BaseException:
        try:
            self._run(coro)
        except kind as exc:
            return exc
        raise AssertionError(f"expected {kind.__name__}")

    engines = st.sampled_from(["e0", "e1"])
    versions = st.sampled_from(_VERSIONS)
    failures = st.sampled_from(list(Failure))

    # --- prepare -------------------------------------------------------------------------------

    def _can_prepare(self, engine: str, version: _Version) -> bool:
        t = self._track(engine, version)
        return not t.reclaimed and not t.needs_cleanup and t.attempt > t.cleaned

    @rule(engine=engines, version=versions)
    def prepare(self, engine: str, version: _Version) -> None:
        if engine not in self.doubles or not self._can_prepare(engine, version):
            return
        t, double = self._track(engine, version), self.doubles[engine]
        loads = double.loads(version.lora_name)
        receipt = self._run(
            self.backend.prepare(double.ref, self._target(version, t.attempt), version.snapshot)
        )
        assert (
            receipt.engine,
            receipt.version_id,
            receipt.digest,
            receipt.lora_name,
            receipt.attempt,
        ) == (
            double.ref.name,
            version.version_id,
            version.snapshot.digest,
            version.lora_name,
            t.attempt,
        ), receipt
        assert receipt.incarnation == self.incarnations[engine]
        assert double.held_digest(version.lora_name) == version.snapshot.digest
        assert double.loads(version.lora_name) == loads + (0 if t.held else 1), "a second load"
        t.prepared, t.held = t.attempt, True

    @rule(engine=engines, version=versions, failure=failures)
    def prepare_fails_on_the_engine(self, engine: str, version: _Version, failure: Failure) -> None:
        if engine not in self.doubles or not self._can_prepare(engine, version):
            return
        t, double = self._track(engine, version), self.doubles[engine]
        if t.held:
            return  # nothing would reach the engine's load
        double.fail_next(Operation.PREPARE, failure)
        target = self._target(version, t.attempt)
        try:
            if failure is Failure.REFUSE:
                self._expect(
                    BackendRefusedError, self.backend.prepare(double.ref, target, version.snapshot)
                )
                assert double.held_digest(version.lora_name) is None
            else:
                self._expect(
                    BackendAmbiguousError,
                    self.backend.prepare(double.ref, target, version.snapshot),
                )
                t.prepared, t.held = t.attempt, double.held_digest(version.lora_name) is not None
        finally:
            double.clear_failures()

    @rule(engine=engines, version=versions)
    def prepare_of_a_cleaned_attempt_is_fenced(self, engine: str, version: _Version) -> None:
        t = self._track(engine, version) if engine in self.doubles else None
        if t is None or t.cleaned == 0:
            return
        double = self.doubles[engine]
        loads, held = double.loads(version.lora_name), double.held_digest(version.lora_name)
        self._expect(
            BackendRefusedError,
            self.backend.prepare(double.ref, self._target(version, t.cleaned), version.snapshot),
        )
        assert double.loads(version.lora_name) == loads
        assert double.held_digest(version.lora_name) == held

    # --- cleanup -------------------------------------------------------------------------------

    @rule(engine=engines, version=versions)
    def cleanup(self, engine: str, version: _Version) -> None:
        if engine not in self.doubles:
            return
        t, double = self._track(engine, version), self.doubles[engine]
        if t.reclaimed:
            return
        unloads = double.unloads(version.lora_name)
        self._run(self.backend.cleanup(double.ref, self._target(version, t.attempt)))
        assert double.held_digest(version.lora_name) is None
        assert double.unloads(version.lora_name) == unloads + (1 if t.held else 0)
        t.cleaned, t.held, t.needs_cleanup = t.attempt, False, False
        t.attempt += 1  # a new attempt starts only after a confirmed cleanup

    @rule(engine=engines, version=versions, failure=failures)
    def cleanup_fails_on_the_engine(self, engine: str, version: _Version, failure: Failure) -> None:
        if engine not in self.doubles:
            return
        t, double = self._track(engine, version), self.doubles[engine]
        if t.reclaimed or not t.held:
            return
        double.fail_next(Operation.CLEANUP, failure)
        try:
            # Unconfirmed either way: a cleanup must never look done when it is not known to be.
            self._expect(
                BackendError, self.backend.cleanup(double.ref, self._target(version, t.attempt))
            )
        finally:
            double.clear_failures()
        if failure is Failure.REFUSE:
            assert double.held_digest(version.lora_name) == version.snapshot.digest
        t.held = double.held_digest(version.lora_name) is not None
        t.needs_cleanup = True

    @rule(engine=engines, version=versions)
    def late_cleanup_of_a_superseded_attempt_unloads_nothing(
        self, engine: str, version: _Version
    ) -> None:
        if engine not in self.doubles:
            return
        t, double = self._track(engine, version), self.doubles[engine]
        if t.reclaimed or not t.held or t.prepared < 2:
            return
        unloads = double.unloads(version.lora_name)
        # Refused is also fine: "holds nothing of that attempt".
        with contextlib.suppress(BackendRefusedError):
            self._run(self.backend.cleanup(double.ref, self._target(version, t.prepared - 1)))
        assert double.held_digest(version.lora_name) == version.snapshot.digest
        assert double.unloads(version.lora_name) == unloads

    # --- reclaim -------------------------------------------------------------------------------

    @rule(engine=engines, version=versions)
    def reclaim(self, engine: str, version: _Version) -> None:
        if engine not in self.doubles:
            return
        t, double = self._track(engine, version), self.doubles[engine]
        if not t.held or t.needs_cleanup or t.reclaimed:
            return
        reclaim_id = f"reclaim-{version.version_id}-{engine}"
        self._run(self._reclaim(double, version, reclaim_id))
        self._reclaimed(t, double, version, reclaim_id)

    @rule(engine=engines, version=versions)
    def reclaim_with_a_lost_receipt_converges(self, engine: str, version: _Version) -> None:
        if engine not in self.doubles:
            return
        t, double = self._track(engine, version), self.doubles[engine]
        if not t.held or t.needs_cleanup or t.reclaimed:
            return
        reclaim_id = f"reclaim-{version.version_id}-{engine}"
        unloads = double.unloads(version.lora_name)
        double.fail_next(Operation.RECLAIM, Failure.LOSE_REPLY)
        try:
            self._expect(BackendAmbiguousError, self._reclaim(double, version, reclaim_id))
        finally:
            double.clear_failures()
        self._run(self._reclaim(double, version, reclaim_id))
        assert double.unloads(version.lora_name) == unloads + 1
        self._reclaimed(t, double, version, reclaim_id)

    @rule(engine=engines, version=versions)
    def repeated_reclaim_never_unloads_again(self, engine: str, version: _Version) -> None:
        if engine not in self.doubles:
            return
        t, double = self._track(engine, version), self.doubles[engine]
        if not t.reclaim_ids:
            return
        unloads = double.unloads(version.lora_name)
        for reclaim_id in sorted(t.reclaim_ids):
            self._run(self._reclaim(double, version, reclaim_id))
        assert double.unloads(version.lora_name) == unloads
        assert double.held_digest(version.lora_name) is None

    @rule(engine=engines, version=versions)
    def a_reclaimed_name_is_never_loaded_again(self, engine: str, version: _Version) -> None:
        if engine not in self.doubles:
            return
        t, double = self._track(engine, version), self.doubles[engine]
        if not t.reclaimed:
            return
        loads = double.loads(version.lora_name)
        try:
            self._run(
                self.backend.prepare(double.ref, self._target(version, t.attempt), version.snapshot)
            )
        except BackendError:
            pass
        else:
            raise AssertionError("a reclaimed version was prepared again")
        assert double.loads(version.lora_name) == loads
        assert double.held_digest(version.lora_name) is None

    # --- engines -------------------------------------------------------------------------------

    @rule(engine=engines)
    def engine_restarts(self, engine: str) -> None:
        if engine not in self.doubles:
            return
        double = self.doubles[engine]
        double.restart()
        after = self._run(self.backend.incarnation(double.ref))
        assert after != self.incarnations[engine], "a restart must change the incarnation"
        self.incarnations[engine] = after
        for (e, _), t in self.tracks.items():
            if e == engine:
                t.held = False

    @rule(engine=engines)
    def incarnation_is_stable_while_the_engine_runs(self, engine: str) -> None:
        if engine not in self.doubles:
            return
        assert (
            self._run(self.backend.incarnation(self.doubles[engine].ref))
            == self.incarnations[engine]
        )

    # --- what must always be true --------------------------------------------------------------

    @invariant()
    def engines_hold_exactly_what_the_model_says(self) -> None:
        for (engine, lora_name), t in self.tracks.items():
            double = self.doubles[engine]
            digest = double.held_digest(lora_name)
            expected = next(v.snapshot.digest for v in _VERSIONS if v.lora_name == lora_name)
            if t.held:
                assert digest == expected, (engine, lora_name, digest)
            else:
                assert digest is None, (engine, lora_name, "still held")

    @invariant()
    def never_two_loads_of_one_name(self) -> None:
        for (engine, lora_name), _ in self.tracks.items():
            double = self.doubles[engine]
            live = double.loads(lora_name) - double.unloads(lora_name)
            assert live in (0, 1), (engine, lora_name, live)
