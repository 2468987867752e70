"""Helpers the end-to-end tests share: a gated backend wrapper, engine logs, prompts, baselines.

Nothing here replaces a part of the product. :class:`GatedBackend` forwards every call to the
real HTTP push backend and only lets a test hold a call at a named point (an asyncio.Event),
which is how "E0 is READY, E1 is not yet" is made to last exactly as long as the test needs.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from agentic_lora_http import HttpPushBackend
from tokenizers import Tokenizer

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.backends import PublicationTarget
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.session import Session
from agentic_lora.session import Versioning
from tests.e2e.recording_proxy import WAIT_GUARD_SECONDS
from tests.e2e.recording_proxy import Exchange
from tests.e2e.recording_proxy import Waiters

__all__ = [
    "ChatTokens",
    "EngineLog",
    "GatedBackend",
    "Held",
    "RegistryEvent",
    "RegistryWatch",
    "Scored",
    "baseline_adapter",
    "fleet_config",
    "fresh_id",
    "open_on",
    "replay",
    "rid_is",
    "scored",
    "scored_request",
    "stored_names",
]


def fleet_config(engines: Mapping[str, str], base_model: str) -> dict[str, Any]:
    """The product settings every stack on the shared two-engine fleet starts from.

    ``engines`` maps each engine's name to the URL the product reaches it at (a recording proxy
    or a tap in front of it). Two slots, and the fleet's own ``--max-loaded-loras`` and
    ``--max-loras-per-batch`` (3), so the product's capacity check sees the engines as started.
    """
    return {
        "enable_versioned_lora_publication": True,
        "engines": [f"{name}={url}" for name, url in engines.items()],
        "capacity": 2,
        "base_model_name": base_model,
        "engine_max_loaded_loras": 3,
        "engine_max_loras_per_batch": 3,
    }


def fresh_id(tag: str) -> str:
    """A version id, Session id or adapter name no other test (or run) uses."""
    return f"{tag}-{uuid.uuid4().hex[:12]}"


def rid_is(rid: str) -> Callable[[Exchange], bool]:
    """Matches the exchange of the request with this ``rid``."""
    return lambda exchange: exchange.field("rid") == rid


def stored_names(store_root: Path, engine: str) -> set[str]:
    """The adapter directories the HTTP push backend's store holds for ``engine``."""
    directory = store_root / engine
    return {p.name for p in directory.iterdir()} if directory.is_dir() else set()


# --- the backend, with gates ----------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """A backend call waiting at a gate."""

    op: str  # "prepare" (its READY is held) or "reclaim" (its unload is held)
    engine: str
    lora_name: str


class GatedBackend:
    """The real :class:`HttpPushBackend`; a test may hold an engine's READY or reclaim.

    ``ready_gates[engine]``: that engine's prepare runs to its end (stored, loaded, probed) and
    then waits for the event before returning its READY receipt. ``reclaim_gates[engine]``: that
    engine's reclaim waits for the event before unloading. ``held`` publishes each wait.
    """

    def __init__(self, inner: HttpPushBackend) -> None:
        self.inner = inner
        self.ready_gates: dict[str, asyncio.Event] = {}
        self.reclaim_gates: dict[str, asyncio.Event] = {}
        self.held: Waiters[Held] = Waiters()

    async def incarnation(self, engine: EngineRef) -> str:
        return await self.inner.incarnation(engine)

    async def prepare(
        self, engine: EngineRef, target: PublicationTarget, snapshot: AdapterSnapshot
    ) -> ReadyReceipt:
        receipt = await self.inner.prepare(engine, target, snapshot)
        gate = self.ready_gates.get(engine.name)
        if gate is not None:
            self.held.publish(Held("prepare", engine.name, target.lora_name))
            await gate.wait()
        return receipt

    async def cleanup(self, engine: EngineRef, target: PublicationTarget) -> None:
        await self.inner.cleanup(engine, target)

    async def reclaim(self, engine: EngineRef, *, lora_name: str, reclaim_id: str) -> None:
        gate = self.reclaim_gates.get(engine.name)
        if gate is not None:
            self.held.publish(Held("reclaim", engine.name, lora_name))
            await gate.wait()
        await self.inner.reclaim(engine, lora_name=lora_name, reclaim_id=reclaim_id)

    async def aclose(self) -> None:
        await self.inner.aclose()


# --- the registry, observed -------------------------------------------------------------------


@dataclass(frozen=True)
class RegistryEvent:
    """One applied registry transition, as its listeners see it."""

    verb: str
    result: Any


class RegistryWatch:
    """Publishes every applied transition of a LocalRegistry, so tests can await one."""

    def __init__(self, registry: LocalRegistry) -> None:
        self.events: Waiters[RegistryEvent] = Waiters()
        registry.add_listener(lambda verb, result: self.events.publish(RegistryEvent(verb, result)))

    async def wait_for(self, verb: str, predicate: Any = None, *, what: str) -> RegistryEvent:
        """The first ``verb`` transition whose result satisfies ``predicate`` (if given)."""
        return await self.events.wait_for(
            lambda e: e.verb == verb and (predicate is None or bool(predicate(e.result))),
            what=what,
        )


# --- Sessions on a chosen engine --------------------------------------------------------------


async def open_on(versioning: Versioning, engine: str, label: str) -> Session:
    """Open a Session that the deployment's own router places on ``engine``.

    The session-affinity router hashes the Session key (which carries a fresh nonce), so a
    Session lands on either engine; this opens Sessions until one lands on ``engine`` and closes
    the others while they are still OPEN (bound to nothing, no engine call).
    """
    engines = tuple(e.name for e in versioning.engines)
    for attempt in range(64):
        session = versioning.open_session(f"{label}-{attempt}")
        if versioning.router.choose(session.key, engines, {}) == engine:
            return session
        await session.close()
    raise AssertionError(f"the router never placed a Session of {label} on {engine}")


# --- prompts as token ids ---------------------------------------------------------------------


class ChatTokens:
    """Chat-formatted prompts for the fixture model, as token ids (Qwen-style chat framing).

    Prompts travel as ``input_ids`` so a full prefix (turn + model output + tool observation) is
    exactly the same sequence for the Session and for its baseline; nothing is re-tokenized.
    """

    def __init__(self, tokenizer_file: Path) -> None:
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        eos = self._tokenizer.token_to_id("<|im_end|>")
        if eos is None:
            raise ValueError(f"{tokenizer_file} has no <|im_end|> token")
        self.eos_id: int = eos

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text).ids)

    def first_turn(self, user: str) -> list[int]:
        """A user message and the assistant header."""
        return self.encode(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")

    def tool_turn(
        self, prefix: Sequence[int], output: Sequence[int], observation: str
    ) -> list[int]:
        """``prefix`` + the model's ``output`` + a tool response + the next assistant header."""
        said = list(output)
        if said and said[-1] == self.eos_id:
            said.pop()
        framing = (
            f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{observation}\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )
        return [*prefix, *said, *self.encode(framing)]


# --- scored generations ---------------------------------------------------------------------


def scored_request(
    input_ids: Sequence[int],
    *,
    max_new_tokens: int,
    rid: str | None = None,
    ignore_eos: bool = False,
) -> dict[str, Any]:
    """A greedy ``/generate`` body that returns the logprob of every prompt and output token.

    ``logprob_start_len=0`` also makes SGLang compute the whole prompt (no prefix reuse), so a
    scored generation never depends on what is in the cache.
    """
    body: dict[str, Any] = {
        "input_ids": list(input_ids),
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": ignore_eos,
        },
    }
    if rid is not None:
        body["rid"] = rid
    return body


@dataclass(frozen=True)
class Scored:
    """What a generation produced, in the terms the baselines are compared in."""

    output_ids: tuple[int, ...]
    input_logprobs: tuple[float, ...]  # from the second prompt token on (the first has none)
    output_logprobs: tuple[float, ...]
    cached_tokens: int
    prompt_tokens: int
    finish: str

    @property
    def logprobs(self) -> tuple[float, ...]:
        return self.input_logprobs + self.output_logprobs


def scored(body: Any) -> Scored:
    """Read a ``/generate`` reply body."""
    assert isinstance(body, Mapping), body
    meta = body["meta_info"]
    inputs = meta.get("input_token_logprobs") or []
    return Scored(
        output_ids=tuple(int(i) for i in body["output_ids"]),
        input_logprobs=tuple(float(e[0]) for e in inputs[1:]),
        output_logprobs=tuple(float(e[0]) for e in meta["output_token_logprobs"]),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        prompt_tokens=int(meta["prompt_tokens"]),
        finish=str(meta["finish_reason"]["type"]),
    )


@asynccontextmanager
async def baseline_adapter(
    client: httpx.AsyncClient, base_url: str, adapter_dir: Path, letter: str
) -> AsyncIterator[str]:
    """Load the fixture adapter ``adapter_dir`` on one engine under its own name; unload on exit.

    The baseline copy is loaded straight from the fixture (not from the middleware's store),
    unpinned, under a fresh name: its own engine-local lora id and its own KV namespace.
    """
    name = fresh_id(f"baseline-{letter}")
    response = await client.post(
        f"{base_url}/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(adapter_dir), "pinned": False},
    )
    assert response.status_code == 200, response.text
    assert response.json()["success"] is True, response.text
    try:
        yield name
    finally:
        unloaded = await client.post(f"{base_url}/unload_lora_adapter", json={"lora_name": name})
        assert unloaded.json()["success"] is True, unloaded.text


async def replay(
    client: httpx.AsyncClient, base_url: str, lora_name: str, request: Mapping[str, Any]
) -> Scored:
    """Send ``request`` (same prompt, same sampling) straight to an engine under ``lora_name``."""
    body = {k: v for k, v in request.items() if k != "rid"}
    body["lora_path"] = lora_name
    response = await client.post(f"{base_url}/generate", json=body)
    assert response.status_code == 200, response.text
    return scored(response.json())


# --- engine logs ----------------------------------------------------------------------------

_ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>/[^ ?"]*)[^"]*" (?P<status>\d{3})')


class EngineLog:
    """One engine's log from the moment this object was made (the engines are shared)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.start = path.stat().st_size

    def offset(self) -> int:
        return self.path.stat().st_size

    def text(self, since: int | None = None) -> str:
        with self.path.open("rb") as handle:
            handle.seek(self.start if since is None else since)
            return handle.read().decode(errors="replace")

    def requests(self, since: int | None = None) -> list[tuple[str, str]]:
        """``(method, path)`` of every HTTP request the engine answered (its access log)."""
        return [(m["method"], m["path"]) for m in _ACCESS.finditer(self.text(since))]

    def lines(self, needle: str, since: int | None = None) -> list[str]:
        return [line for line in self.text(since).splitlines() if needle in line]

    async def wait_for_line(self, needle: str, *, since: int, what: str) -> str:
        """The first line containing ``needle`` written after byte ``since`` (polls the file)."""
        try:
            async with asyncio.timeout(WAIT_GUARD_SECONDS):
                # Another process writes the file: there is no event to wait on, only the file.
                while not (found := self.lines(needle, since)):  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        except TimeoutError:
            raise AssertionError(f"never logged: {what}") from None
        return found[0]
