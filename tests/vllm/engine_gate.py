"""The test side of the engine gate in ``engine_site/agentic_lora_hold_gate.py``.

A request sent with ``vllm_xargs=gate.xargs`` is held by the engine at its second sampling step
(its first token is out, the rest is not) until the test calls :meth:`EngineGate.open`. While it
is held nothing on that engine makes progress, so "the request is still running" is a fact the
test arranged, not a race it hopes to win. The vLLM fleet of ``tests/vllm/conftest.py`` loads
the gate into every engine.

A stepwise gate (``EngineGate(..., stepwise=True)``) holds its request at every step from the
second on; :meth:`EngineGate.release_step` lets exactly one step pass, so a test can count the
tokens an engine produced after an event without racing the engine for them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

__all__ = [
    "ENGINE_SITE",
    "HOLD_ARG",
    "HOLD_GATE_PROCESSOR",
    "STEPWISE_ARG",
    "WAIT_GUARD_SECONDS",
    "EngineGate",
]

#: The folder put on every engine's ``PYTHONPATH``.
ENGINE_SITE = Path(__file__).parent / "engine_site"
#: The ``--logits-processors`` value that loads the gate.
HOLD_GATE_PROCESSOR = "agentic_lora_hold_gate:HoldGate"
#: The ``vllm_xargs`` key naming a request's gate file (``agentic_lora_hold_gate.HOLD_ARG``).
HOLD_ARG = "agentic_lora_hold"
#: The ``vllm_xargs`` key of a stepwise gate (``agentic_lora_hold_gate.STEPWISE_ARG``).
STEPWISE_ARG = "agentic_lora_hold_stepwise"
#: How long a test waits for the engine to reach its gate before calling the run broken. A
#: liveness guard only: no verdict depends on how long anything took.
WAIT_GUARD_SECONDS = 120.0
_POLL_SECONDS = 0.02


class EngineGate:
    """One gate file; closed until :meth:`open` creates it."""

    def __init__(self, directory: Path, name: str = "gate", *, stepwise: bool = False) -> None:
        self.path = directory / name
        self.stepwise = stepwise
        self._held = directory / f"{name}.held"
        self._step = directory / f"{name}.step"

    @property
    def xargs(self) -> dict[str, str]:
        """The ``vllm_xargs`` that put a request behind this gate."""
        if self.stepwise:
            return {HOLD_ARG: str(self.path), STEPWISE_ARG: "1"}
        return {HOLD_ARG: str(self.path)}

    @property
    def is_open(self) -> bool:
        return self.path.exists()

    def holding(self) -> bool:
        """Whether the engine has reached this gate (and holds its request unless it is open)."""
        return self._held.exists()

    async def reached(self, *, what: str) -> None:
        """Return once the engine holds the request at this gate."""
        try:
            async with asyncio.timeout(WAIT_GUARD_SECONDS):
                # The engine is another process: the marker file is the only signal it gives.
                while not self.holding():  # noqa: ASYNC110
                    await asyncio.sleep(_POLL_SECONDS)
        except TimeoutError:
            raise AssertionError(f"the engine never reached the gate: {what}") from None

    def held_step(self) -> int:
        """The sampling step the engine holds (or last held) the request at; 0 before any."""
        try:
            return int(self._held.read_text() or 0)
        except FileNotFoundError:
            return 0

    def release_step(self) -> int:
        """Let the step held now pass (a stepwise gate), and return its number."""
        assert self.stepwise, "release_step() is for a stepwise gate"
        step = self.held_step()
        staged = self._step.with_name(self._step.name + ".tmp")
        staged.write_text(str(step))
        staged.replace(self._step)  # whole, so the engine never reads half a number
        return step

    def open(self) -> None:
        """Let the held request (and the engine) go on. Idempotent."""
        self.path.touch()
