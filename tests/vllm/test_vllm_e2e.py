"""Publication, binding and reclaim end to end on two real vLLM engines, through real Sessions.

A :class:`~agentic_lora.assembly.deployment.Deployment` built from settings (``engine_kind="vllm"``,
backend ``vllm``) runs the real registry, Sessions, publisher, background reclaimer and vLLM
backend against the engines. Sessions name their adapter as ``model=<lora_name>`` (the adapter
pin's vLLM form), and the backend's drain hook is the Sessions' own per-adapter in-flight count.
Raw HTTP is used only to look at the engines (listings, a late request), never to generate for a
Session.

The long turn that must still be running while the reclaim waits is held inside its engine by a
gate (``tests/vllm/engine_gate.py``) until the test opens it, so "the reclaim waited for it" never
depends on which of the two finished first by wall clock.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from agentic_lora_harness.vllm_engines import VllmFleet

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.assembly.deployment import Deployment
from agentic_lora.engines.transport import EngineReply
from agentic_lora.errors import VersionNotDispatchableError
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.publication.reclaimer import ReclaimOutcome
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import new_request_id
from agentic_lora.session.middleware import Dispatch
from agentic_lora.session.middleware import EngineCall
from agentic_lora.session.middleware import Middleware
from tests.session_support import Calls
from tests.vllm.engine_gate import EngineGate
from tests.vllm.support import vllm_settings

pytestmark = [pytest.mark.engine, pytest.mark.vllm, pytest.mark.slow]

TURN: dict[str, object] = {"prompt": "def add", "max_tokens": 8, "temperature": 0.0}
# A long turn: held by an engine gate at its second token, so its length is not what keeps it
# running; long enough that A's answer is told apart from B's.
LONG_TURN: dict[str, object] = {**TURN, "max_tokens": 64, "ignore_eos": True}


class ReplyLog:
    """A framework middleware: appends ``label`` to ``log`` when the reply of a request sent with
    ``xargs`` as its ``vllm_xargs`` comes back.

    It runs outside the adapter pin and the in-flight count, which return to it without an await:
    the entry is made before anything waiting for that count to drain can run.
    """

    def __init__(
        self, next_dispatch: Dispatch, *, xargs: dict[str, str], label: str, log: list[str]
    ) -> None:
        self._next, self._xargs, self._label, self._log = next_dispatch, xargs, label, log

    async def __call__(self, call: EngineCall) -> EngineReply:
        reply = await self._next(call)
        if call.body.get("vllm_xargs") == self._xargs:
            self._log.append(self._label)
        return reply


async def listed(http: httpx.AsyncClient, base: str) -> set[str]:
    cards = (await http.get(f"{base}/v1/models")).raise_for_status().json()["data"]
    return {c["id"] for c in cards if c.get("parent") is not None}


async def text_on(http: httpx.AsyncClient, base: str, model: str) -> str:
    reply = await http.post(f"{base}/v1/completions", json={**TURN, "model": model})
    reply.raise_for_status()
    return str(reply.json()["choices"][0]["text"])


def text_of(reply: EngineReply) -> str:
    return str(reply.body["choices"][0]["text"])


@pytest.mark.asyncio
async def test_old_sessions_keep_a_new_sessions_get_b_and_a_is_reclaimed_after_its_requests(
    vllm_fleet: VllmFleet, client: httpx.AsyncClient, engine_gate: EngineGate, tmp_path: Path
) -> None:
    fixture = vllm_fleet.fixture
    urls = dict(vllm_fleet.engines)
    store = tmp_path / "store"
    settings = vllm_settings(vllm_fleet, "e2e_vllm")
    ended: list[str] = []
    replies = Middleware(ReplyLog, xargs=engine_gate.xargs, label="long turn", log=ended)
    passed = EngineGate(tmp_path, "already-open")
    passed.open()
    names: list[str] = []
    try:
        async with Deployment.from_settings(
            settings, backend_options={"store_root": str(store)}, middleware=[replies]
        ) as d:
            a = await d.publish("e2e-a", AdapterSnapshot.from_peft_dir(fixture.adapter("A")))
            assert a.outcome is PublicationOutcome.PUBLISHED
            assert a.lora_name is not None
            names.append(a.lora_name)
            old = d.versioning.open_session("old-episode")
            old_turn = await old.completions({**TURN, "model": fixture.served_model_name})
            assert old_turn.body["model"] == a.lora_name  # vLLM names the adapter it ran
            # Both engines serve the same version.
            for url in urls.values():
                assert await text_on(client, url, a.lora_name) == text_of(old_turn)
            # What A answers to the long turn (through the gate's code path, the gate open).
            reference = await old.completions({**LONG_TURN, "vllm_xargs": passed.xargs})

            b = await d.publish("e2e-b", AdapterSnapshot.from_peft_dir(fixture.adapter("B")))
            assert b.outcome is PublicationOutcome.PUBLISHED
            assert b.lora_name is not None
            names.append(b.lora_name)

            # The old Session keeps A on every later turn; a new one gets B.
            tool_turn = await old.completions(TURN)
            assert (tool_turn.body["model"], text_of(tool_turn)) == (a.lora_name, text_of(old_turn))
            new = d.versioning.open_session("new-episode")
            new_turn = await new.completions(TURN)
            assert new_turn.body["model"] == b.lora_name
            assert text_of(new_turn) != text_of(old_turn)

            # A is retired but bound: a reclaim round leaves it loaded.
            assert (await d.reclaim()).reclaimed == ()
            for url in urls.values():
                assert a.lora_name in await listed(client, url)

            # A long turn of the old Session is running on A when the registry drops the
            # Session's ref (as a supervisor releasing a worker's Sessions through a shared
            # registry would). vLLM's unload would return at once; the reclaim must wait for it.
            # The engine holds the turn at its second token until the gate opens.
            long_turn = asyncio.create_task(
                old.completions({**LONG_TURN, "vllm_xargs": engine_gate.xargs})
            )
            try:
                await engine_gate.reached(what="the old Session's long turn on A")
                assert d.versioning.in_flight(a.lora_name) == 1
                w = Calls(count=2)  # both engines' reclaims wait for it
                d.versioning.on_drain_wait.append(w)
                await d.registry.begin_close(request_id=new_request_id(), session_key=old.key)
                await d.registry.release(request_id=new_request_id(), session_key=old.key)
                reclaim = asyncio.create_task(d.reclaimer.reclaim_version("e2e-a"))
                reclaim.add_done_callback(lambda _: ended.append("reclaim"))
                waiting = asyncio.create_task(w.wait())
                done, _ = await asyncio.wait(
                    {reclaim, waiting, long_turn}, return_when=asyncio.FIRST_COMPLETED
                )
                assert done == {waiting}, "the reclaim did not wait for the request in flight"
                assert d.registry.peek_version("e2e-a").state is VersionState.RECLAIMING  # type: ignore[attr-defined]
                for url in urls.values():
                    assert a.lora_name in await listed(client, url)
                assert ended == []
            finally:
                engine_gate.open()

            finished = await long_turn
            assert finished.body["model"] == a.lora_name
            assert text_of(finished) == text_of(reference)  # all of it, on A's weights
            result = await reclaim
            assert result.outcome is ReclaimOutcome.RECLAIMED
            # The long turn's reply was back (and its count released) before the reclaim went on.
            assert ended == ["long turn", "reclaim"]

            status = await d.status()
            states = {v.version_id: v.state for v in status.versions}
            assert states == {"e2e-a": VersionState.RECLAIMED, "e2e-b": VersionState.PUBLISHED}
            assert status.slots_in_use == 1
            for name, url in urls.items():
                assert a.lora_name not in await listed(client, url)
                assert b.lora_name in await listed(client, url)
                late = await client.post(
                    f"{url}/v1/completions", json={**TURN, "model": a.lora_name}
                )
                assert late.status_code == 404
                assert not (store / name / a.lora_name).exists()
            # The old Session can no longer reach A; the new one is untouched.
            with pytest.raises(VersionNotDispatchableError):
                await old.completions(TURN)
            assert text_of(await new.completions(TURN)) == text_of(new_turn)
    finally:
        # Leave the session-wide fleet as it was found.
        for url in urls.values():
            for name in names:
                await client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})
