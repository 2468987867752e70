"""A gate inside a vLLM engine: holds one chosen request mid-generation until a test opens it.

Loaded into the test fleet's engines with ``--logits-processors
agentic_lora_hold_gate:HoldGate`` (this folder is on the engines' ``PYTHONPATH``; see
``tests/vllm/conftest.py``). It never changes a logit. A request that names a gate file in
``vllm_xargs`` (``{"agentic_lora_hold": "/path/gate"}``) is held once, at its second sampling
step: its first token has been sampled and sent, its second is not. Holding blocks the engine's
step loop (the whole engine, on purpose: nothing can finish behind the test's back), while the
API server keeps answering. The gate writes ``<gate>.held`` when it starts holding and returns
once ``<gate>`` exists, so a test can tell "the engine is holding the request now" apart from
"not yet" without any clock. A gate that already exists never holds.

A request that also names ``{"agentic_lora_hold_stepwise": "1"}`` is held at *every* sampling
step from its second on, one step at a time: ``<gate>.held`` holds the number of the step held
now (written whole, by rename), and the step passes once ``<gate>.step`` names it (or ``<gate>``
exists, which lets the rest pass). A test that must count how many tokens an engine produced
after something happened releases them one by one instead of racing the engine.

This module runs in the engine's interpreter, which has vLLM; the dev venv has not (hence the
``type: ignore`` comments). vLLM 0.32 has two logits processor interfaces, one per model runner
(V1: ``vllm.v1.sample.logits_processor``; V2, chosen when Triton has a CPU backend:
``vllm.v1.worker.gpu.sample.logits_processor``); the class implements both, so it loads under
either runner.
"""

from __future__ import annotations

import os
import time
from typing import Any

from vllm.v1.sample.logits_processor import BatchUpdate  # type: ignore[import-not-found]
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.sample.logits_processor import MoveDirectionality  # type: ignore[import-not-found]
from vllm.v1.worker.gpu.sample.logits_processor.interface import (  # type: ignore[import-not-found]
    LogitsProcessor as V2LogitsProcessor,
)

#: The ``vllm_xargs`` key naming a request's gate file.
HOLD_ARG = "agentic_lora_hold"
#: The ``vllm_xargs`` key that makes a request's gate hold every step (value ``"1"``).
STEPWISE_ARG = "agentic_lora_hold_stepwise"
#: A forgotten gate must not wedge an engine for good: after this long the request goes on.
MAX_HOLD_SECONDS = 600.0
_POLL_SECONDS = 0.005


def _gate_of(params: Any) -> tuple[str, bool] | None:
    extra = getattr(params, "extra_args", None)
    if not isinstance(extra, dict):
        return None
    gate = extra.get(HOLD_ARG)
    return (gate, extra.get(STEPWISE_ARG) == "1") if isinstance(gate, str) else None


class _Tracked:
    """One gated request: its gate file, whether it holds every step, and how many sampling
    steps included it."""

    def __init__(self, gate: str, stepwise: bool) -> None:
        self.gate = gate
        self.stepwise = stepwise
        self.steps = 0


class HoldGate(V1LogitsProcessor, V2LogitsProcessor):  # type: ignore[misc]
    """Holds each gated request once, at its second sampling step (see the module docstring)."""

    def __init__(self, vllm_config: Any, *_runner_args: Any) -> None:
        # V1 passes (device, is_pin_memory), V2 passes (req_states); neither is needed here.
        self._tracked: dict[int, _Tracked] = {}  # V1: batch index; V2: request slot
        self._done: set[str] = set()

    # --- V1 interface ------------------------------------------------------------------------

    def is_argmax_invariant(self) -> bool:
        return False  # so the V1 sampler calls apply() for greedy requests too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._tracked.pop(index, None)
        for index, params, _prompt, _output in batch_update.added:
            self._track(index, params)
        for first, second, direction in batch_update.moved:
            a, b = self._tracked.pop(first, None), self._tracked.pop(second, None)
            if a is not None:
                self._tracked[second] = a
            if b is not None and direction == MoveDirectionality.SWAP:
                self._tracked[first] = b

    # --- V2 interface ------------------------------------------------------------------------

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        return self._track(req_idx, sampling_params)

    # --- both ----------------------------------------------------------------------------------

    def apply(self, logits: Any, ctx: Any = None) -> Any:
        if not self._tracked:
            return logits
        if ctx is None:  # V1: one logits row per batch index
            present = [i for i in self._tracked if i < logits.shape[0]]
        else:  # V2: the request slots sampled in this step
            present = [int(i) for i in ctx.idx_mapping_np if int(i) in self._tracked]
        for index in present:
            tracked = self._tracked[index]
            tracked.steps += 1
            if tracked.steps < 2 or tracked.gate in self._done:
                continue
            if not tracked.stepwise:
                self._done.add(tracked.gate)
            _hold(tracked.gate, tracked.steps, tracked.stepwise)
        return logits

    def _track(self, index: int, params: Any) -> bool:
        gate = _gate_of(params)
        if gate is None or gate[0] in self._done:
            self._tracked.pop(index, None)
            return False
        self._tracked[index] = _Tracked(*gate)
        return True


def _released(gate: str, step: int, stepwise: bool) -> bool:
    if os.path.exists(gate):
        return True
    if not stepwise:
        return False
    try:
        with open(f"{gate}.step") as released:
            return int(released.read() or 0) >= step
    except FileNotFoundError:
        return False


def _hold(gate: str, step: int, stepwise: bool) -> None:
    if os.path.exists(gate):
        return
    with open(f"{gate}.held.tmp", "w") as marker:
        marker.write(f"{step}\n")
    os.replace(f"{gate}.held.tmp", f"{gate}.held")
    deadline = time.monotonic() + MAX_HOLD_SECONDS
    while not _released(gate, step, stepwise) and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
