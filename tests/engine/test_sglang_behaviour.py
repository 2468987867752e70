"""What real SGLang 0.5.23 does with LoRA adapters, pinned down on two live engines.

The middleware's design leans on each of these behaviours (DESIGN.md, "Engines"); if an SGLang
upgrade changes one, a test here fails before the middleware silently goes wrong:

* the same adapter gives bit-identical logprobs on E0 and E1 (engines are interchangeable);
* adapters A, B and C really change the output, and differently;
* ``/unload_lora_adapter`` waits for in-flight requests that use the adapter;
* a request naming an unloaded adapter silently reloads it from its old path (so the middleware
  must refuse dispatch for a reclaimed version itself);
* a restarted engine comes back with no adapter and a new ``/server_info`` fingerprint (the
  incarnation the product reads), and refuses a request naming an adapter it lost with a 400,
  never running the base model in its place (nor reloading it: the new process knows no path);
* the prefix cache is per adapter: no KV is shared across versions, a repeat hits the cache;
* at most ``max_loras_per_batch - 1`` adapters can be pinned;
* OpenAI routes select an adapter only as ``"<base>:<lora>"``; a bare adapter name silently
  serves the base model.

Adapters are loaded under names unique to each test and unloaded afterwards, so the tests share
the session's engines without seeing each other's adapters.

Timing. No verdict depends on which of two things finishes first by wall clock. A request that
must outlive something else is given far more tokens than the test lets it produce (it ends by
the test's abort) and what is asserted is the engine's own account: its log says the unload had
arrived and had not started, the request kept streaming, and the physical unload began only after
the test sent the abort (log offsets, not clocks).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from collections.abc import Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from agentic_lora_harness.engines import EngineFleet

from agentic_lora.engines.admin import EngineAdminClient

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PROMPT = "the agent will call the weather tool and then answer the question"
#: Far more tokens than a test lets a long request produce (prompt + this stays inside the
#: model's 4096 positions): such a request ends by the test's abort, never by length.
LONG_TOKENS = 3000
#: How long a test waits for the engine to log something it must log. A liveness guard only.
WAIT_GUARD_SECONDS = 120.0


class EngineLog:
    """One engine's log file, read by byte offset (the engine is another process)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def offset(self) -> int:
        return self.path.stat().st_size

    def lines(self, needle: str, *, since: int = 0) -> list[str]:
        with self.path.open("rb") as handle:
            handle.seek(since)
            text = handle.read().decode(errors="replace")
        return [line for line in text.splitlines() if needle in line]

    async def wait_for_line(self, needle: str, *, since: int, what: str) -> str:
        """The first line containing ``needle`` written after byte ``since``."""
        try:
            async with asyncio.timeout(WAIT_GUARD_SECONDS):
                # Another process writes the file: there is no event to wait on, only the file.
                while not (found := self.lines(needle, since=since)):  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise AssertionError(f"never logged: {what}") from None
        return found[0]


def _name(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


async def _load(
    client: httpx.AsyncClient, url: str, name: str, path: Path, *, pinned: bool = False
) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path), "pinned": pinned}
    return await client.post(f"{url}/load_lora_adapter", json=body)


async def _unload(client: httpx.AsyncClient, url: str, name: str) -> httpx.Response:
    return await client.post(f"{url}/unload_lora_adapter", json={"lora_name": name})


@asynccontextmanager
async def _loaded(
    client: httpx.AsyncClient,
    urls: Iterable[str],
    adapters: dict[str, Path],
    *,
    pinned: bool = False,
) -> AsyncIterator[None]:
    """Load ``adapters`` (name -> dir) on every engine in ``urls``; unload them on exit."""
    loaded: list[tuple[str, str]] = []
    try:
        for url in urls:
            for name, path in adapters.items():
                response = await _load(client, url, name, path, pinned=pinned)
                assert response.status_code == 200, response.text
                assert response.json()["success"] is True, response.text
                loaded.append((url, name))
        yield
    finally:
        for url, name in loaded:
            await _unload(client, url, name)


async def _generate(
    client: httpx.AsyncClient,
    url: str,
    lora: str | None,
    *,
    text: str = PROMPT,
    max_new_tokens: int = 8,
    prompt_logprobs: bool = True,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "text": text,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        "return_logprob": prompt_logprobs,
    }
    if prompt_logprobs:
        # Scores every prompt token too; note that this bypasses the prefix cache.
        body["logprob_start_len"] = 0
    if lora is not None:
        body["lora_path"] = lora
    response = await client.post(f"{url}/generate", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def _logprobs(result: dict[str, Any]) -> list[float]:
    meta = result["meta_info"]
    entries = meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]
    return [float(entry[0]) for entry in entries]


async def _model_ids(client: httpx.AsyncClient, url: str) -> set[str]:
    response = await client.get(f"{url}/v1/models")
    assert response.status_code == 200, response.text
    return {model["id"] for model in response.json()["data"]}


@pytest.fixture
def fleet(engine_fleet: EngineFleet) -> EngineFleet:
    return engine_fleet


@pytest.mark.asyncio
async def test_server_runs_the_configuration_the_harness_asked_for(fleet: EngineFleet) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        for url in [url for _, url in fleet.engines]:
            info = (await client.get(f"{url}/server_info")).json()
            assert info["version"] == "0.5.23"
            assert info["served_model_name"] == fleet.served_model_name
            assert info["enable_lora"] is True
            assert (info["max_loras_per_batch"], info["max_loaded_loras"]) == (3, 3)
            assert info["max_total_tokens"] == 32768
            assert info["sleep_on_idle"] is True
            assert await _model_ids(client, url) == {fleet.served_model_name}


@pytest.mark.asyncio
async def test_same_adapter_gives_bit_identical_logprobs_on_both_engines(
    fleet: EngineFleet,
) -> None:
    name = _name("a")
    urls = [url for _, url in fleet.engines]
    async with (
        httpx.AsyncClient(timeout=60) as client,
        _loaded(client, urls, {name: fleet.fixture.adapter("A")}),
    ):
        results = [await _generate(client, url, name) for url in urls]
    e0, e1 = results
    assert e0["output_ids"] == e1["output_ids"]
    assert len(_logprobs(e0)) > 8
    assert _logprobs(e0) == _logprobs(e1)  # exact float equality, not approximate


@pytest.mark.asyncio
async def test_adapters_differ_from_each_other_and_from_the_base(fleet: EngineFleet) -> None:
    url = fleet.base_url("E0")
    names = {letter: _name(letter.lower()) for letter in ("A", "B", "C")}
    adapters = {names[letter]: fleet.fixture.adapter(letter) for letter in names}
    async with (
        httpx.AsyncClient(timeout=60) as client,
        _loaded(client, [url], adapters),
    ):
        results = {"base": await _generate(client, url, None)}
        for letter, name in names.items():
            results[letter] = await _generate(client, url, name)
    keys = list(results)
    for i, left in enumerate(keys):
        for right in keys[i + 1 :]:
            assert _logprobs(results[left]) != _logprobs(results[right]), (left, right)
            assert results[left]["output_ids"] != results[right]["output_ids"], (left, right)


@pytest.mark.asyncio
async def test_unload_waits_for_an_in_flight_request_using_the_adapter(
    fleet: EngineFleet,
) -> None:
    url = fleet.base_url("E0")
    log = EngineLog(fleet.log_path("E0"))
    name = _name("inflight")
    rid = f"rid-{uuid.uuid4().hex}"
    body = {
        "text": PROMPT,
        "lora_path": name,
        "rid": rid,
        "stream": True,
        "sampling_params": {"max_new_tokens": LONG_TOKENS, "temperature": 0.0, "ignore_eos": True},
    }
    # The engine's own log lines: the unload request arrived (before its wait for the request
    # refcount), and the physical unload began (after that wait).
    arrived, started = f"Start unload Lora adapter. Lora name={name}", "unloading starts"
    async with httpx.AsyncClient(timeout=300) as client:
        response = await _load(client, url, name, fleet.fixture.adapter("A"))
        assert response.json()["success"] is True

        unload_task: asyncio.Task[httpx.Response] | None = None
        chunks_while_unload_waits = 0
        abort_sent_at = 0
        final: dict[str, Any] = {}
        async with client.stream("POST", f"{url}/generate", json=body) as stream:
            assert stream.status_code == 200
            async for line in stream.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                final = json.loads(line.removeprefix("data:"))
                if unload_task is None:
                    # The first streamed token proves the request is running with the adapter.
                    since = log.offset()
                    unload_task = asyncio.create_task(_unload(client, url, name))
                    await log.wait_for_line(arrived, since=since, what="the unload arrived")
                    continue
                chunks_while_unload_waits += 1
                if chunks_while_unload_waits == 100:
                    # The engine decoded 100 more tokens of the request with the unload pending:
                    # the unload has neither returned nor begun to unload anything.
                    assert not unload_task.done()
                    assert [s for s in log.lines(started) if name in s] == []
                    abort_sent_at = log.offset()
                    aborted = await client.post(f"{url}/abort_request", json={"rid": rid})
                    assert aborted.status_code == 200
        assert unload_task is not None
        unloaded = await unload_task
    assert unloaded.status_code == 200
    assert unloaded.json()["success"] is True
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert final["meta_info"]["completion_tokens"] < LONG_TOKENS
    # The engine's account: one physical unload, begun only after the test ended the request.
    assert len([s for s in log.lines(started, since=abort_sent_at) if name in s]) == 1
    assert len([s for s in log.lines(started) if name in s]) == 1


@pytest.mark.asyncio
async def test_unload_without_in_flight_requests_returns_at_once(fleet: EngineFleet) -> None:
    url = fleet.base_url("E0")
    name = _name("idle")
    async with httpx.AsyncClient(timeout=60) as client:
        assert (await _load(client, url, name, fleet.fixture.adapter("B"))).json()["success"]
        await _generate(client, url, name, max_new_tokens=2)
        unloaded = await _unload(client, url, name)
        assert unloaded.json()["success"] is True
        assert name not in await _model_ids(client, url)


@pytest.mark.asyncio
async def test_request_naming_an_unloaded_adapter_silently_reloads_it(fleet: EngineFleet) -> None:
    url = fleet.base_url("E1")
    name = _name("reload")
    never = _name("never")
    async with httpx.AsyncClient(timeout=60) as client:
        # Control: a name the engine never saw is refused.
        refused = await client.post(
            f"{url}/generate",
            json={"text": PROMPT, "lora_path": never, "sampling_params": {"max_new_tokens": 2}},
        )
        assert refused.status_code == 400
        assert "never been loaded" in refused.text

        base = await _generate(client, url, None)
        assert (await _load(client, url, name, fleet.fixture.adapter("C"))).json()["success"]
        before = await _generate(client, url, name)
        assert (await _unload(client, url, name)).json()["success"] is True
        assert name not in await _model_ids(client, url)

        after = await _generate(client, url, name)  # no error: the engine reloads it
        try:
            assert name in await _model_ids(client, url)
            assert after["output_ids"] == before["output_ids"]
            assert _logprobs(after) == _logprobs(before)
            assert after["output_ids"] != base["output_ids"]  # the adapter, not the base model
        finally:
            assert (await _unload(client, url, name)).json()["success"] is True


@pytest.mark.asyncio
async def test_prefix_cache_is_per_adapter(fleet: EngineFleet) -> None:
    url = fleet.base_url("E1")
    first, second = _name("cache-a"), _name("cache-b")
    # A prompt no other test sends, long enough for the cache hit to be unmistakable.
    text = f"{uuid.uuid4().hex} " + " ".join([PROMPT] * 4)
    adapters = {first: fleet.fixture.adapter("A"), second: fleet.fixture.adapter("B")}
    async with (
        httpx.AsyncClient(timeout=60) as client,
        _loaded(client, [url], adapters),
    ):
        runs = [
            await _generate(client, url, lora, text=text, max_new_tokens=2, prompt_logprobs=False)
            for lora in (first, first, second, None)
        ]
    cold, repeat, other_version, base = runs
    prompt_tokens = cold["meta_info"]["prompt_tokens"]
    assert prompt_tokens > 40
    assert cold["meta_info"]["cached_tokens"] == 0
    assert repeat["meta_info"]["cached_tokens"] >= prompt_tokens - 1
    assert other_version["meta_info"]["cached_tokens"] == 0
    assert base["meta_info"]["cached_tokens"] == 0


@pytest.mark.asyncio
async def test_at_most_slots_minus_one_adapters_can_be_pinned(fleet: EngineFleet) -> None:
    url = fleet.base_url("E0")
    names = [_name("pin") for _ in range(3)]
    paths = [fleet.fixture.adapter(letter) for letter in ("A", "B", "C")]
    async with httpx.AsyncClient(timeout=60) as client:
        try:
            for name, path in zip(names[:2], paths[:2], strict=True):
                pinned = await _load(client, url, name, path, pinned=True)
                assert pinned.json()["success"] is True, pinned.text
            third = await _load(client, url, names[2], paths[2], pinned=True)
            assert third.status_code == 400
            assert third.json()["success"] is False
            assert "pin" in third.json()["error_message"]
            assert names[2] not in await _model_ids(client, url)
            # The slot itself is free: the same adapter loads unpinned.
            unpinned = await _load(client, url, names[2], paths[2], pinned=False)
            assert unpinned.json()["success"] is True, unpinned.text
            result = await _generate(client, url, names[2], max_new_tokens=2)
            assert result["meta_info"]["completion_tokens"] == 2
        finally:
            for name in names:
                await _unload(client, url, name)
        assert await _model_ids(client, url) == {fleet.served_model_name}


@pytest.mark.asyncio
async def test_openai_route_needs_base_colon_lora(fleet: EngineFleet) -> None:
    url = fleet.base_url("E0")
    name = _name("oai")

    async def chat(model: str) -> dict[str, Any]:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "what is the weather?"}],
            "max_tokens": 6,
            "temperature": 0.0,
            "logprobs": True,
        }
        response = await client.post(f"{url}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        choice: dict[str, Any] = response.json()["choices"][0]
        return choice

    def logprobs(choice: dict[str, Any]) -> list[float]:
        return [float(item["logprob"]) for item in choice["logprobs"]["content"]]

    async with (
        httpx.AsyncClient(timeout=60) as client,
        _loaded(client, [url], {name: fleet.fixture.adapter("A")}),
    ):
        base = await chat(fleet.served_model_name)
        qualified = await chat(f"{fleet.served_model_name}:{name}")
        bare = await chat(name)
    assert logprobs(qualified) != logprobs(base)
    # The bare adapter name is accepted and silently served by the base model.
    assert logprobs(bare) == logprobs(base)
    assert bare["message"]["content"] == base["message"]["content"]


@pytest.mark.asyncio
async def test_restarted_engine_comes_back_empty_on_the_same_address(fleet: EngineFleet) -> None:
    """What repairing an engine after a restart relies on, after a crash (SIGKILL) and a restart.

    The new process holds none of the old one's adapters, reports a new ``/server_info``
    fingerprint (the incarnation the HTTP push backend reads), and refuses a request that names
    an adapter it lost: HTTP 400, "never been loaded", no output, even though the adapter's
    directory is still on disk (unlike an unloaded name, which the same process would reload).
    The fleet is left as found: E1 is up on its address, with no adapters, like a fresh engine.
    """
    url = fleet.base_url("E1")
    name = _name("restart")
    incarnation = fleet.incarnation("E1")
    request = {
        "text": PROMPT,
        "lora_path": name,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0.0},
    }
    async with (
        httpx.AsyncClient(timeout=60) as client,
        EngineAdminClient(url, engine="E1", client=client) as admin,
    ):
        assert (await _load(client, url, name, fleet.fixture.adapter("A"))).json()["success"]
        served = await client.post(f"{url}/generate", json=request)
        assert served.status_code == 200, served.text
        before = await admin.server_info()
        assert await admin.list_lora_adapters() == {name: str(fleet.fixture.adapter("A"))}

        try:
            await asyncio.to_thread(fleet.kill, "E1")  # a crash: SIGKILL to the whole group
        finally:
            await fleet.arestart("E1")  # whatever happened, the shared fleet gets E1 back

        assert fleet.base_url("E1") == url
        assert fleet.incarnation("E1") == incarnation + 1
        after = await admin.server_info()
        assert after.fingerprint != before.fingerprint
        assert (after.version, after.model_path) == (before.version, before.model_path)
        assert await admin.list_lora_adapters() == {}
        assert await _model_ids(client, url) == {fleet.served_model_name}

        lost = await client.post(f"{url}/generate", json=request)
        assert lost.status_code == 400, lost.text
        assert "never been loaded" in lost.text
        assert "output_ids" not in lost.text  # nothing was generated, by any model
        assert "meta_info" not in lost.text
        assert fleet.fixture.adapter("A").is_dir()  # the path was there to reload from
        assert await _model_ids(client, url) == {fleet.served_model_name}

        result = await _generate(client, url, None, max_new_tokens=2)
        assert result["meta_info"]["completion_tokens"] == 2
