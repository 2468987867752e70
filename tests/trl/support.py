"""Helpers the TRL integration's tests share (no tests here).

* :class:`TokenEngine`: the scripted SGLang engine, answering ``/generate`` on token ids the way
  SGLang 0.5 does (``output_ids`` and ``meta_info.output_token_logprobs``), with tokens that
  depend only on the request, so a test can say which tokens a turn produced.
* :func:`bridge_on`: a started :class:`DeploymentThread` on a scripted fleet.
* :func:`loop_event`, :func:`set_on_loop`, :func:`wait_on_loop`: ``asyncio.Event`` gates that
  live on the bridge's loop, driven from the test's thread.
* :func:`weights`: :class:`AdapterWeights` for a step, from the test kit's tiny snapshots.
* :class:`TinyPeft`: a real PEFT model over two small linear layers, for the callback's capture.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import httpx
import torch
from agentic_lora_trl import AdapterWeights
from agentic_lora_trl import DeploymentThread
from peft import LoraConfig
from peft import get_peft_model
from transformers import TrainerControl
from transformers import TrainerState

from agentic_lora import AdapterSnapshot
from agentic_lora.foundation.identity import thaw_json
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import ScriptedSGLangEngine

__all__ = [
    "GUARD_SECONDS",
    "Signal",
    "TinyPeft",
    "TokenEngine",
    "bridge_on",
    "digest_of",
    "loop_event",
    "registry_of",
    "set_on_loop",
    "trainer_state",
    "turn_tokens",
    "wait_on_loop",
    "weights",
]

#: A liveness guard only: how long a test waits for something that must happen before it calls
#: the run broken. No verdict depends on how long anything took.
GUARD_SECONDS = 120.0

#: Tokens per model turn the scripted engine answers with (fewer if max_new_tokens is lower).
TURN_LENGTH = 3


def turn_tokens(input_length: int, count: int = TURN_LENGTH) -> list[int]:
    """The tokens :class:`TokenEngine` answers a prompt of ``input_length`` tokens with."""
    return [100 + input_length + i for i in range(count)]


def turn_logprob(position: int) -> float:
    """The logprob :class:`TokenEngine` reports for the ``position``-th token of a turn."""
    return -0.25 * (position + 1)


class TokenEngine(ScriptedSGLangEngine):
    """``/generate`` on ``input_ids`` answers :func:`turn_tokens` and, when asked for
    (``return_logprob``), their logprobs in SGLang's ``[logprob, token_id, null]`` form."""

    async def _generate(self, request: httpx.Request) -> httpx.Response:
        response = await super()._generate(request)
        body = json.loads(request.content)
        if response.status_code != 200 or body.get("stream") or "input_ids" not in body:
            return response
        count = min(TURN_LENGTH, int(body["sampling_params"]["max_new_tokens"]))
        output = turn_tokens(len(body["input_ids"]), count)
        meta = dict(response.json()["meta_info"])
        meta["finish_reason"] = {"type": "length", "length": count}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [
                [turn_logprob(i), token, None] for i, token in enumerate(output)
            ]
        return httpx.Response(200, json={"text": "", "output_ids": output, "meta_info": meta})


def bridge_on(fleet: ScriptedFleet, store_root: Path, **settings: Any) -> DeploymentThread:
    """A started bridge whose Deployment runs on ``fleet`` (the HTTP push backend into
    ``store_root``); ``settings`` override the fleet's."""
    return DeploymentThread.from_settings(
        fleet.settings(lora_name_prefix="trl", **settings),
        backend_options={"store_root": str(store_root)},
    ).start()


def registry_of(thread: DeploymentThread) -> LocalRegistry:
    registry = thread.deployment.registry
    assert isinstance(registry, LocalRegistry)
    return registry


async def _new_event() -> asyncio.Event:
    return asyncio.Event()


def loop_event(thread: DeploymentThread) -> asyncio.Event:
    """An event made on the bridge's loop (set it with :func:`set_on_loop`)."""
    return thread.run(_new_event())


def set_on_loop(thread: DeploymentThread, event: asyncio.Event) -> None:
    thread.call_soon(event.set)


def wait_on_loop(thread: DeploymentThread, event: asyncio.Event) -> None:
    """Block until ``event`` (a loop event) is set; AssertionError after the guard."""

    async def wait() -> None:
        async with asyncio.timeout(GUARD_SECONDS):
            await event.wait()

    try:
        thread.run(wait())
    except TimeoutError:
        raise AssertionError("the event was never set") from None


def weights(step: int, *, seed: int | None = None, prefix: str = "step") -> AdapterWeights:
    """The weights of ``step`` (a tiny snapshot's tensors; ``seed`` defaults to the step)."""
    snapshot = tiny_snapshot(step if seed is None else seed)
    return AdapterWeights(
        step=step,
        version_id=f"{prefix}-{step}",
        tensors=snapshot.to_torch_state_dict(),
        config=thaw_json(snapshot.config),
    )


def digest_of(step: int, *, seed: int | None = None) -> str:
    return tiny_snapshot(step if seed is None else seed).digest


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(4, 4, bias=False)
        self.v_proj = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.v_proj(self.q_proj(x))


class TinyPeft:
    """A real PEFT LoRA model (rank 2 on ``q_proj``/``v_proj``) and a stand-in optimizer step."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        config = LoraConfig(
            r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        )
        self.model = get_peft_model(_TwoLayers(), config)

    def step(self, amount: float = 0.5) -> None:
        """Change every LoRA weight in place, as an optimizer step would."""
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                if "lora_" in name:
                    parameter.add_(amount)

    def digest(self) -> str:
        """The digest of the adapter as it is now."""
        return AdapterSnapshot.from_module(self.model).digest


def trainer_state(step: int) -> tuple[TrainerState, TrainerControl]:
    state = TrainerState()
    state.global_step = step
    return state, TrainerControl()


class Signal:
    """A hook listener that keeps its calls; a test thread waits for the n-th one."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self._called = threading.Condition()

    def __call__(self, *args: Any) -> None:
        with self._called:
            self.calls.append(args)
            self._called.notify_all()

    def wait(self, count: int = 1) -> None:
        """Block until the listener was called ``count`` times in all."""
        with self._called:
            assert self._called.wait_for(lambda: len(self.calls) >= count, GUARD_SECONDS), (
                f"the listener was called {len(self.calls)} times, never {count}"
            )
