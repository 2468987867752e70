"""Rules 5.1 and 7.1-7 on real engines: when a retired version may be unloaded, and what after.

* Session refs = 0 but the engine still runs a request for A: A stays loaded; the physical
  unload happens only after that request ended, once per engine, and the version becomes
  RECLAIMED only when both engines confirmed.
* A request for A after its reclaim began is refused by the middleware before any engine sees
  it (state RECLAIMING, and later RECLAIMED). The control shows why that matters: raw SGLang,
  asked for the unloaded name, silently loads it again from its old path.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentic_lora.errors import VersionNotDispatchableError
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import new_request_id
from agentic_lora.session import Session
from tests.e2e.conftest import Stack
from tests.e2e.recording_proxy import Exchange
from tests.e2e.recording_proxy import Waiters
from tests.e2e.support import Held
from tests.e2e.support import fresh_id
from tests.e2e.support import scored
from tests.e2e.support import scored_request
from tests.e2e.support import stored_names

pytestmark = [pytest.mark.engine, pytest.mark.slow]

#: Chunks the engine must stream while an unload of the request's adapter waits: proof that the
#: engine keeps decoding the request rather than the unload cutting it short.
CHUNKS_WHILE_UNLOAD_WAITS = 40


class LongRequest:
    """A streamed generation the engine accepted and keeps running until the test ends it.

    It stands for a request whose Session has already let go of it (a caller that gave up on
    an indeterminate reply): no Session ref covers it, only the engine's own request refcount.
    """

    def __init__(self, client: httpx.AsyncClient, base_url: str, lora_name: str) -> None:
        self.client = client
        self.base_url = base_url
        self.rid = fresh_id("long")
        self.body = {
            "text": "the agent will call the weather tool and then answer the question",
            "lora_path": lora_name,
            "rid": self.rid,
            "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "temperature": 0.0, "ignore_eos": True},
        }
        self.chunks: Waiters[int] = Waiters()
        self.count = 0
        self.final: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        async with self.client.stream("POST", f"{self.base_url}/generate", json=self.body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                self.final = json.loads(line.removeprefix("data:"))
                self.count += 1
                self.chunks.publish(self.count)

    async def running(self) -> None:
        """Start it and return once the engine streams its first token."""
        self._task = asyncio.create_task(self._run())
        await self.chunks.wait_for(lambda n: n >= 1, what=f"{self.rid} first token")

    async def advanced_by(self, chunks: int) -> None:
        """Return once the engine streamed ``chunks`` more tokens of it."""
        target = self.count + chunks
        await self.chunks.wait_for(lambda n: n >= target, what=f"{self.rid} decoding on")

    @property
    def finished(self) -> bool:
        return self._task is not None and self._task.done()

    async def end(self) -> None:
        """Abort it on its engine and wait until its stream is over."""
        response = await self.client.post(f"{self.base_url}/abort_request", json={"rid": self.rid})
        assert response.status_code == 200
        assert self._task is not None
        await self._task
        assert self.final["meta_info"]["finish_reason"]["type"] == "abort"

    async def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            await self.client.post(f"{self.base_url}/abort_request", json={"rid": self.rid})
            await asyncio.gather(self._task, return_exceptions=True)


@asynccontextmanager
async def long_requests(stack: Stack, lora_name: str) -> AsyncIterator[dict[str, LongRequest]]:
    """One running LongRequest per engine; any still running on exit is aborted."""
    requests = {
        engine: LongRequest(stack.raw, stack.engine_url(engine), lora_name)
        for engine in stack.engine_names
    }
    try:
        for request in requests.values():
            await request.running()
        yield requests
    finally:
        for request in requests.values():
            await request.cancel()


def _unload_of(engine: str, lora_name: str) -> Callable[[Exchange], bool]:
    def matches(e: Exchange) -> bool:
        return e.engine == engine and e.path == "/unload_lora_adapter" and e.lora == lora_name

    return matches


def _unload_log(stack: Stack, engine: str, lora_name: str, phase: str) -> list[str]:
    """The engine's own log lines for ``phase`` ("unloading starts"/"completes") of a name."""
    return [line for line in stack.logs[engine].lines(phase) if lora_name in line]


async def _end(
    stack: Stack, engine: str, request: LongRequest, unload: Exchange
) -> tuple[int, int]:
    """End ``engine``'s long request and wait until its pending ``unload`` returns.

    Returns the traffic mark and the engine log offset taken just before the abort went out.
    """
    ended = stack.traffic.mark(f"ending {engine}'s request")
    abort_sent_at = stack.logs[engine].offset()
    await request.end()
    await stack.traffic.wait_for(lambda e: e is unload and e.done, what=f"{engine} unload returned")
    return ended, abort_sent_at


async def _bound_sessions(stack: Stack, letter: str) -> dict[str, Session]:
    sessions = {}
    for engine in stack.engine_names:
        session = await stack.open_on(engine, f"{letter}-{engine}")
        reply = await session.generate(
            scored_request(stack.chat.first_turn("hi"), max_new_tokens=4)
        )
        assert reply.engine == engine
        binding = session.binding
        assert binding is not None
        assert binding.version_id == stack.versions[letter]
        sessions[engine] = session
    return sessions


@pytest.mark.asyncio
async def test_a_request_in_flight_keeps_a_version_loaded_until_it_ends(stack: Stack) -> None:
    assert (await stack.publish("A")).outcome is PublicationOutcome.PUBLISHED
    name_a = stack.lora_name("A")
    sessions = await _bound_sessions(stack, "A")
    assert (await stack.publish("B")).outcome is PublicationOutcome.PUBLISHED
    assert stack.status("A").state is VersionState.RETIRED
    # The long requests start only now: nothing but the reclaim runs while they must still be
    # decoding (their token budget is far more than the test lets them produce).
    ended_at: dict[str, int] = {}  # traffic marks
    abort_sent_at: dict[str, int] = {}  # engine log offsets
    async with long_requests(stack, name_a) as long:
        # The last Sessions holding A close: refs reach 0 and the reclaimer starts at once.
        closing_at = {engine: stack.logs[engine].offset() for engine in stack.engine_names}
        for session in sessions.values():
            await session.close()
        assert stack.status("A").session_refs == 0
        unloads: dict[str, Exchange] = {}
        for engine in stack.engine_names:
            unloads[engine] = await stack.traffic.wait_for(
                _unload_of(engine, name_a), what=f"unload of A sent to {engine}"
            )
            # The engine's own word that the unload reached it (logged before its refcount wait).
            await stack.logs[engine].wait_for_line(
                f"Start unload Lora adapter. Lora name={name_a}",
                since=closing_at[engine],
                what=f"the unload of A reached {engine}",
            )

        # The unload is waiting on each engine while the engine keeps decoding A's request.
        for request in long.values():
            await request.advanced_by(CHUNKS_WHILE_UNLOAD_WAITS)
        assert stack.status("A").state is VersionState.RECLAIMING
        assert not any(u.done for u in unloads.values())
        for engine in stack.engine_names:
            assert _unload_log(stack, engine, name_a, "unloading starts") == [], engine

        # E0's request ends: E0 unloads. E1's request still runs: E1 still waits.
        ended_at["E0"], abort_sent_at["E0"] = await _end(stack, "E0", long["E0"], unloads["E0"])
        await stack.watch.wait_for(
            "confirm_reclaim",
            lambda s: s.version_id == stack.versions["A"] and "E0" in s.reclaimed_engines,
            what="E0's unload of A confirmed",
        )
        await long["E1"].advanced_by(CHUNKS_WHILE_UNLOAD_WAITS)
        assert not unloads["E1"].done
        assert stack.status("A").state is VersionState.RECLAIMING
        assert stack.status("A").reclaimed_engines == ("E0",)

        ended_at["E1"], abort_sent_at["E1"] = await _end(stack, "E1", long["E1"], unloads["E1"])
        await stack.watch.wait_for(
            "confirm_reclaim",
            lambda s: s.version_id == stack.versions["A"] and s.state is VersionState.RECLAIMED,
            what="A RECLAIMED",
        )

    for engine in stack.engine_names:
        # Each unload was pending until the test ended its engine's request, and returned after.
        seq_done = unloads[engine].seq_done
        assert seq_done is not None
        assert seq_done > ended_at[engine], engine
        (unload,) = stack.traffic.select(engine=engine, path="/unload_lora_adapter", lora=name_a)
        assert unload.status == 200
        assert unload.reply["success"] is True
        # The engine's own account: one physical unload of A, begun only after the test sent
        # the abort (it is in the part of the log written after that point: an offset, not a
        # clock, and not the order of two processes' lines).
        assert len(_unload_log(stack, engine, name_a, "unloading starts")) == 1, engine
        assert len(_unload_log(stack, engine, name_a, "unloading completes")) == 1, engine
        after_abort = stack.logs[engine].lines("unloading starts", since=abort_sent_at[engine])
        assert len([line for line in after_abort if name_a in line]) == 1, engine
        assert name_a not in stored_names(stack.store_root, engine)
    status = await stack.registry.status()
    assert status.slots_in_use == 1
    assert status.default_version == stack.versions["B"]


@pytest.mark.asyncio
async def test_a_request_for_a_version_whose_reclaim_began_is_refused_locally(
    stack: Stack,
) -> None:
    assert (await stack.publish("A")).outcome is PublicationOutcome.PUBLISHED
    name_a = stack.lora_name("A")
    session = await stack.open_on("E0", "zombie")
    request = scored_request(stack.chat.first_turn("what is the weather?"), max_new_tokens=8)
    before = scored((await session.generate(request)).body)
    (load_e0,) = stack.traffic.select(engine="E0", path="/load_lora_adapter", lora=name_a)
    a_dir_on_e0 = Path(load_e0.field("lora_path"))
    assert (await stack.publish("B")).outcome is PublicationOutcome.PUBLISHED

    # A controller reaps the Session's registry record (it believes the worker died) while the
    # worker still holds the Session: A's last ref goes, and its reclaim begins (held at the
    # engines by the test, so the version stays RECLAIMING for as long as needed).
    gates = {engine: asyncio.Event() for engine in stack.engine_names}
    stack.backend.reclaim_gates.update(gates)
    await stack.registry.begin_close(request_id=new_request_id(), session_key=session.key)
    await stack.registry.release(request_id=new_request_id(), session_key=session.key)
    for engine in stack.engine_names:
        await stack.backend.held.wait_for(
            Held("reclaim", engine, name_a).__eq__, what=f"reclaim of A begun on {engine}"
        )
    assert stack.status("A").state is VersionState.RECLAIMING

    # The late request: refused by the middleware, nothing reaches any engine.
    quiet = stack.traffic.mark("late request while RECLAIMING")
    with pytest.raises(VersionNotDispatchableError) as refused:
        await session.generate(request)
    assert refused.value.details["state"] == "RECLAIMING"
    assert stack.traffic.since(quiet) == []

    for gate in gates.values():
        gate.set()
    await stack.watch.wait_for(
        "confirm_reclaim",
        lambda s: s.version_id == stack.versions["A"] and s.state is VersionState.RECLAIMED,
        what="A RECLAIMED",
    )
    quiet = stack.traffic.mark("late request after RECLAIMED")
    with pytest.raises(VersionNotDispatchableError) as refused:
        await session.generate(request)
    assert refused.value.details["state"] == "RECLAIMED"
    assert stack.traffic.since(quiet) == []

    # Control: the same request sent to the engine directly. SGLang remembers where A came from
    # and tries to load it again on its own; the backend removed that directory, so it fails...
    url = stack.engine_url("E0")
    raw_body = {**request, "lora_path": name_a}
    assert name_a not in stored_names(stack.store_root, "E0")
    assert a_dir_on_e0 == stack.store_root / "E0" / name_a
    failed = await stack.raw.post(f"{url}/generate", json=raw_body)
    assert failed.status_code == 400
    assert "implicitly load" in failed.text
    # ...but with the directory there (any store that keeps what it wrote, or a request that
    # beats the removal), the engine silently serves the reclaimed version again.
    stack.snapshots["A"].write_peft_dir(a_dir_on_e0)
    revived = await stack.raw.post(f"{url}/generate", json=raw_body)
    assert revived.status_code == 200, revived.text
    again = scored(revived.json())
    assert (again.output_ids, again.logprobs) == (before.output_ids, before.logprobs)
    listed = await stack.raw.get(f"{url}/v1/models")
    assert name_a in {card["id"] for card in listed.json()["data"]}
    assert stack.status("A").state is VersionState.RECLAIMED  # the registry never knew
