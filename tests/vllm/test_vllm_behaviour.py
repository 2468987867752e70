"""vLLM 0.32.0 (CPU build) behaviour the vLLM backend and the middleware rely on, pinned on real
engines.

Each test states one fact about the engine; if a vLLM upgrade changes it, the matching test fails
and names what to revisit. Every adapter name a test registers is unregistered again, so the
session-wide fleet is left as it was found.

No verdict depends on timing. A request that must still be running while the test does something
else is held inside the engine by a gate (``tests/vllm/engine_gate.py``) at its second token, and
let go only when the test opens the gate: "still running" is then a fact the test arranged, which
the engine's own report (``/metrics``) confirms, not a race between a generation and a round trip.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from agentic_lora_harness.vllm_engines import VllmFleet
from agentic_lora_vllm import VllmBackend
from agentic_lora_vllm.metrics import parse_metrics
from prometheus_client.parser import text_string_to_metric_families

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.backends import PublicationTarget
from agentic_lora.foundation.identity import make_lora_name
from tests.vllm.engine_gate import WAIT_GUARD_SECONDS
from tests.vllm.engine_gate import EngineGate

pytestmark = [pytest.mark.engine, pytest.mark.vllm, pytest.mark.slow]

PROMPT = "def add"
#: Tokens of a gated request: any number above 2 would do, the gate holds it at its second. Enough
#: that the adapter's answer is told apart from the base model's.
HELD_TOKENS = 64


async def load(http: httpx.AsyncClient, base: str, name: str, path: Path) -> httpx.Response:
    return await http.post(
        f"{base}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
    )


async def unload(http: httpx.AsyncClient, base: str, name: str) -> httpx.Response:
    return await http.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": name})


async def listed(http: httpx.AsyncClient, base: str) -> dict[str, str]:
    cards = (await http.get(f"{base}/v1/models")).raise_for_status().json()["data"]
    return {c["id"]: c["root"] for c in cards if c.get("parent") is not None}


async def complete(
    http: httpx.AsyncClient, base: str, model: str, *, max_tokens: int = 8, **extra: Any
) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0}
    return await http.post(f"{base}/v1/completions", json={**body, **extra})


def text_of(response: httpx.Response) -> str:
    response.raise_for_status()
    return str(response.json()["choices"][0]["text"])


async def busy_adapters(http: httpx.AsyncClient, base: str) -> frozenset[str]:
    metrics = parse_metrics((await http.get(f"{base}/metrics")).raise_for_status().text)
    activity = metrics.lora_activity
    return frozenset() if activity is None else activity.running | activity.waiting


async def running_requests(http: httpx.AsyncClient, base: str) -> float:
    """``vllm:num_requests_running``: the scheduler's running count at its last report."""
    text = (await http.get(f"{base}/metrics")).raise_for_status().text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:num_requests_running"
    )


class Stream:
    """A streamed completion read concurrently; see :meth:`started` and :meth:`finished`.

    ``xargs`` go to the engine as ``vllm_xargs`` (an engine gate's, to hold the request).
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        base: str,
        model: str,
        max_tokens: int,
        xargs: dict[str, str] | None = None,
    ) -> None:
        self.first = asyncio.Event()
        self.chunks: list[str] = []
        self._finished = False
        body: dict[str, Any] = {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        if xargs is not None:
            body["vllm_xargs"] = xargs
        self.task = asyncio.create_task(self._read(http, base, body))

    async def _read(self, http: httpx.AsyncClient, base: str, body: dict[str, Any]) -> str:
        async with http.stream("POST", f"{base}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    self._finished = True
                    break
                if line.startswith("data: "):
                    self.chunks.append(json.loads(line[6:])["choices"][0]["text"])
                    self.first.set()
        return "".join(self.chunks)

    async def started(self) -> None:
        """Return once the first streamed chunk arrived: the request runs on the engine."""
        first = asyncio.create_task(self.first.wait())
        try:
            async with asyncio.timeout(WAIT_GUARD_SECONDS):
                await asyncio.wait({first, self.task}, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            raise AssertionError("the stream never produced a chunk") from None
        finally:
            first.cancel()
        if not self.first.is_set():
            await self.task  # it ended without a chunk: raise what went wrong
            raise AssertionError(f"the stream ended without a chunk: {self.chunks}")

    def finished(self) -> bool:
        """Whether the engine's end-of-stream marker has arrived."""
        return self._finished


# --- runtime load and unload by name -----------------------------------------------------------


@pytest.mark.asyncio
async def test_an_adapter_is_loaded_and_unloaded_by_name_at_runtime(
    vllm_fleet: VllmFleet, client: httpx.AsyncClient
) -> None:
    base, path = vllm_fleet.base_url("E0"), vllm_fleet.fixture.adapter("A")
    loaded = await load(client, base, "beh-load", path)
    assert (loaded.status_code, loaded.text) == (
        200,
        "Success: LoRA adapter 'beh-load' added successfully.",
    )
    assert (await listed(client, base)).get("beh-load") == str(path)

    again = await load(client, base, "beh-load", path)  # a live name is never replaced
    assert again.status_code == 400
    assert again.json()["error"]["type"] == "InvalidUserInput"
    assert "already been loaded" in again.json()["error"]["message"]

    removed = await unload(client, base, "beh-load")
    assert (removed.status_code, removed.text) == (
        200,
        "Success: LoRA adapter 'beh-load' removed successfully.",
    )
    assert "beh-load" not in await listed(client, base)

    absent = await unload(client, base, "beh-load")
    assert absent.status_code == 404
    assert absent.json()["error"]["type"] == "NotFoundError"
    assert "cannot be found" in absent.json()["error"]["message"]


@pytest.mark.asyncio
async def test_a_path_without_an_adapter_is_refused_with_404(
    vllm_fleet: VllmFleet, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    base = vllm_fleet.base_url("E0")
    refused = await load(client, base, "beh-missing", tmp_path / "nothing-here")
    assert refused.status_code == 404
    assert refused.json()["error"]["type"] == "NotFoundError"
    assert "beh-missing" not in await listed(client, base)


# --- the adapter changes the output ------------------------------------------------------------


@pytest.mark.asyncio
async def test_completions_by_adapter_name_differ_between_a_b_and_the_base(
    vllm_fleet: VllmFleet, client: httpx.AsyncClient
) -> None:
    base, fixture = vllm_fleet.base_url("E0"), vllm_fleet.fixture
    for name in ("A", "B"):
        assert (await load(client, base, f"beh-{name}", fixture.adapter(name))).status_code == 200
    try:
        base_text = text_of(await complete(client, base, fixture.served_model_name))
        a_reply = await complete(client, base, "beh-A")
        a_text, b_text = text_of(a_reply), text_of(await complete(client, base, "beh-B"))
        assert a_reply.json()["model"] == "beh-A"  # the answer names the adapter it ran
        assert len({base_text, a_text, b_text}) == 3, (base_text, a_text, b_text)
        assert text_of(await complete(client, base, "beh-A")) == a_text  # greedy: repeatable
    finally:
        for name in ("A", "B"):
            await unload(client, base, f"beh-{name}")


@pytest.mark.asyncio
async def test_sglang_style_adapter_addressing_does_not_reach_the_adapter(
    vllm_fleet: VllmFleet, client: httpx.AsyncClient
) -> None:
    """The pin must be ``model=<lora_name>`` on vLLM: ``<base>:<lora_name>`` is an unknown model,
    and a ``lora_path`` field is not an adapter selector (the base model answers)."""
    base, fixture = vllm_fleet.base_url("E0"), vllm_fleet.fixture
    assert (await load(client, base, "beh-pin", fixture.adapter("A"))).status_code == 200
    try:
        adapter_text = text_of(await complete(client, base, "beh-pin"))
        base_text = text_of(await complete(client, base, fixture.served_model_name))
        colon = await complete(client, base, f"{fixture.served_model_name}:beh-pin")
        assert colon.status_code == 404
        with_path = await complete(client, base, fixture.served_model_name, lora_path="beh-pin")
        assert text_of(with_path) == base_text != adapter_text
    finally:
        await unload(client, base, "beh-pin")


# --- unload does not wait for in-flight requests -----------------------------------------------


@pytest.mark.asyncio
async def test_unload_returns_while_a_request_on_the_adapter_runs_and_it_finishes_on_it(
    vllm_fleet: VllmFleet, client: httpx.AsyncClient, engine_gate: EngineGate, tmp_path: Path
) -> None:
    base, path = vllm_fleet.base_url("E0"), vllm_fleet.fixture.adapter("A")
    assert (await load(client, base, "beh-inflight", path)).status_code == 200
    # What the adapter answers, through the same gate code path with the gate already open...
    passed = EngineGate(tmp_path, "already-open")
    passed.open()
    reference = text_of(
        await complete(
            client,
            base,
            "beh-inflight",
            max_tokens=HELD_TOKENS,
            ignore_eos=True,
            vllm_xargs=passed.xargs,
        )
    )
    assert not passed.holding()  # an open gate never holds
    # ...and what the base model answers instead.
    base_text = text_of(
        await complete(
            client, base, vllm_fleet.served_model_name, max_tokens=HELD_TOKENS, ignore_eos=True
        )
    )
    assert reference != base_text

    stream = Stream(client, base, "beh-inflight", HELD_TOKENS, engine_gate.xargs)
    try:
        await stream.started()  # a token of it came back: it runs, on the adapter
        await engine_gate.reached(what="the request's second token")
        # From here until the gate opens the engine cannot move the request on: it is running.

        removed = await unload(client, base, "beh-inflight")
        assert (removed.status_code, removed.text) == (
            200,
            "Success: LoRA adapter 'beh-inflight' removed successfully.",
        )
        assert "beh-inflight" not in await listed(client, base)
        # The unload answered while the request was still running: its stream is open, and has
        # only the first token's text; the engine's own report says one request runs, on the
        # adapter.
        assert not stream.finished()
        so_far = "".join(stream.chunks)
        assert reference.startswith(so_far)
        assert len(so_far) < len(reference)
        assert await running_requests(client, base) == 1
        assert "beh-inflight" in await busy_adapters(client, base)
        # New requests for the name are refused at once...
        late = await complete(client, base, "beh-inflight")
        assert late.status_code == 404
    finally:
        engine_gate.open()
    # ...while the one already running finishes normally, on the adapter's weights, not the base's.
    assert await stream.task == reference
    assert stream.finished()
    # Once its last request is answered, the engine no longer reports the adapter busy.
    assert await running_requests(client, base) == 0
    assert "beh-inflight" not in await busy_adapters(client, base)


@pytest.mark.asyncio
async def test_a_request_for_an_unloaded_or_unknown_adapter_is_refused_with_404(
    vllm_fleet: VllmFleet, client: httpx.AsyncClient
) -> None:
    base, path = vllm_fleet.base_url("E0"), vllm_fleet.fixture.adapter("B")
    assert (await load(client, base, "beh-gone", path)).status_code == 200
    assert (await unload(client, base, "beh-gone")).status_code == 200
    for name in ("beh-gone", "beh-never-loaded"):
        reply = await complete(client, base, name)
        assert reply.status_code == 404
        error = reply.json()["error"]
        assert error["type"] == "NotFoundError"
        assert f"The model `{name}` does not exist" in error["message"]
    # No implicit reload (unlike SGLang): the name stays gone.
    assert "beh-gone" not in await listed(client, base)


# --- the backend on real engines -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_backend_publishes_serves_and_reclaims_after_the_drain(
    vllm_fleet: VllmFleet, client: httpx.AsyncClient, engine_gate: EngineGate, tmp_path: Path
) -> None:
    fixture = vllm_fleet.fixture
    snapshot = AdapterSnapshot.from_peft_dir(fixture.adapter("C"))
    name = make_lora_name("policy_lora", 0, "beh-v1", snapshot.digest)
    target = PublicationTarget("beh-v1", snapshot.digest, name, 1)
    refs = [EngineRef(n, url) for n, url in vllm_fleet.engines]
    streams: list[Stream] = []
    draining: list[str] = []
    both_draining = asyncio.Event()

    async def wait_drained(lora_name: str) -> None:
        # What the Session middleware does: wait for the requests it dispatched on the adapter.
        assert lora_name == name
        draining.append(lora_name)
        if len(draining) == len(refs):
            both_draining.set()
        await asyncio.gather(*(s.task for s in streams))

    backend = VllmBackend(tmp_path / "store", wait_drained=wait_drained)
    try:
        receipts = [await backend.prepare(ref, target, snapshot) for ref in refs]
        assert [r.engine for r in receipts] == ["E0", "E1"]
        for ref in refs:
            assert (await listed(client, ref.base_url))[name] == str(
                tmp_path / "store" / ref.name / name
            )
        # The stored copy serves exactly like the fixture's own directory does.
        assert (
            await load(client, refs[0].base_url, "beh-C", fixture.adapter("C"))
        ).status_code == 200
        expected = text_of(await complete(client, refs[0].base_url, "beh-C"))
        await unload(client, refs[0].base_url, "beh-C")
        for ref in refs:
            assert text_of(await complete(client, ref.base_url, name)) == expected

        passed = EngineGate(tmp_path, "already-open")
        passed.open()
        reference = text_of(
            await complete(
                client,
                refs[0].base_url,
                name,
                max_tokens=HELD_TOKENS,
                ignore_eos=True,
                vllm_xargs=passed.xargs,
            )
        )
        streams.append(Stream(client, refs[0].base_url, name, HELD_TOKENS, engine_gate.xargs))
        await streams[0].started()
        await engine_gate.reached(what="the in-flight request's second token")
        reclaims = asyncio.gather(
            *(backend.reclaim(ref, lora_name=name, reclaim_id="beh-r1") for ref in refs)
        )
        drain_entered: asyncio.Future[Any] = asyncio.ensure_future(both_draining.wait())
        try:
            async with asyncio.timeout(WAIT_GUARD_SECONDS):
                await asyncio.wait({drain_entered, reclaims}, return_when=asyncio.FIRST_COMPLETED)
            # Both reclaims wait for the drain while the request is held on E0: nothing unloaded.
            assert both_draining.is_set(), "a reclaim ended without waiting for the drain"
            assert not reclaims.done()
            for ref in refs:
                assert name in await listed(client, ref.base_url)
                assert (tmp_path / "store" / ref.name / name).is_dir()
        finally:
            drain_entered.cancel()
            engine_gate.open()
        await reclaims
        # The reclaim could only unload after the in-flight request finished, on its weights.
        assert streams[0].finished()
        assert await streams[0].task == reference
        for ref in refs:
            assert name not in await listed(client, ref.base_url)
            assert (await complete(client, ref.base_url, name)).status_code == 404
            assert not (tmp_path / "store" / ref.name / name).exists()
    finally:
        await backend.aclose()


# --- restarts ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_process_start_time_is_the_incarnation_and_a_restart_forgets_adapters(
    vllm_fleet: VllmFleet, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    base = vllm_fleet.base_url("E1")
    ref = EngineRef("E1", base)

    async def drained(lora_name: str) -> None:
        return None

    backend = VllmBackend(tmp_path / "store", wait_drained=drained)
    try:
        before = parse_metrics((await client.get(f"{base}/metrics")).text).process_start_time
        incarnation = await backend.incarnation(ref)
        assert before is not None
        assert await backend.incarnation(ref) == incarnation  # stable while it runs
        assert (
            await load(client, base, "beh-restart", vllm_fleet.fixture.adapter("A"))
        ).status_code == 200

        await vllm_fleet.arestart("E1")

        after = parse_metrics((await client.get(f"{base}/metrics")).text).process_start_time
        assert after is not None
        assert after > before
        assert "beh-restart" not in await listed(client, base)
        assert await backend.incarnation(ref) != incarnation
    finally:
        await backend.aclose()
