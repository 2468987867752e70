"""The test-side proxies that record engine traffic (tests/e2e, tests/chaos), on a local upstream.

No engine: the upstream is a small aiohttp app on loopback, so the recording, the scripted
rules, the 502 for a lost upstream and the tap's faithful death are checked without the lock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from tests.chaos.support import EngineTap
from tests.e2e.recording_proxy import RecordingProxy
from tests.e2e.recording_proxy import Rule
from tests.e2e.recording_proxy import TrafficLog

pytestmark = pytest.mark.asyncio


async def _echo(request: web.Request) -> web.Response:
    return web.json_response({"path": request.path, "body": await request.json()})


@pytest_asyncio.fixture
async def upstream() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/{tail:.*}", _echo)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def _post(url: str, body: dict[str, object]) -> tuple[int, object]:
    async with aiohttp.ClientSession() as client, client.post(url, json=body) as reply:
        return reply.status, await reply.json()


async def test_the_proxy_records_forwards_once_and_plays_its_rules(upstream: str) -> None:
    log = TrafficLog()
    async with RecordingProxy("e0", upstream, log) as proxy:
        proxy.add_rule(Rule("refuse", lambda e: e.path == "/refused", answer=(503, {"no": 1})))
        proxy.add_rule(
            Rule("pin", lambda e: e.path == "/generate", rewrite=lambda b: {**b, "lora_path": "v"})
        )
        assert await _post(proxy.base_url + "/refused", {"x": 1}) == (503, {"no": 1})
        status, reply = await _post(proxy.base_url + "/generate", {"text": "t"})
        assert (status, reply) == (
            200,
            {"path": "/generate", "body": {"text": "t", "lora_path": "v"}},
        )
        refused, generated = proxy.exchanges()
        assert (refused.rule, refused.forwarded, refused.status) == ("refuse", False, 503)
        assert (generated.rule, generated.forwarded, generated.lora) == ("pin", True, None)
        assert generated.sent_body == {"text": "t", "lora_path": "v"}
        assert refused.seq_done is not None
        assert refused.seq_done < generated.seq_sent
    async with RecordingProxy("e1", "http://127.0.0.1:9", log) as lost:  # nothing listens there
        status, reply = await _post(lost.base_url + "/generate", {"text": "t"})
        assert status == 502
        [(exchange, reason)] = lost.upstream_failures
        assert exchange.status == 502
        assert reason.startswith("Client")


async def test_a_tap_refuses_connections_while_down_and_marks_each_incarnation(
    upstream: str,
) -> None:
    log = TrafficLog()
    async with EngineTap("e0", upstream, log) as tap:
        assert await _post(tap.base_url + "/generate", {"n": 1}) == (
            200,
            {"path": "/generate", "body": {"n": 1}},
        )
        down = await tap.go_down()
        assert tap.down
        with pytest.raises(aiohttp.ClientConnectorError):
            await _post(tap.base_url + "/generate", {"n": 2})
        up = await tap.come_up()
        assert (await _post(tap.base_url + "/generate", {"n": 3}))[0] == 200
        assert [e.body for e in tap.exchanges()] == [{"n": 1}, {"n": 3}]
        assert tap.up_marks[-1] == up
        assert tap.up_marks[0] < down < up
