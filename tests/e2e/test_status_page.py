"""The status page in a real browser, against ``serve`` on a real port in front of real engines.

Headless Chromium (Debian's, installed by ``scripts/browser-env.sh``; never a Playwright
download) is driven by Playwright. The gateway is :func:`agentic_lora.gateway.serve.serve`, the
function ``agentic-lora serve`` runs, listening on a free port of 127.0.0.1 in front of the
shared SGLang fleet. The test:

* refuses a wrong admin token in the login form (no cookie, no data);
* logs in, sees the published version as the default;
* publishes a new version while the page is open and sees it become the default, its
  publication in the timeline, and its Session count rise as Sessions bind through the gateway,
  all without a reload (waits are on the DOM, never sleeps);
* sees a Session of the older version counted at lag 1, and a refused request by its code;
* saves the screenshot of the docs (``docs/img/status-page.png``).

Every adapter it loaded is unloaded by ``engines_restored``; the fleet is left as found.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from agentic_lora_harness.engines import EngineFleet
from playwright.async_api import Page
from playwright.async_api import async_playwright
from playwright.async_api import expect

from agentic_lora.config import load_settings
from agentic_lora.gateway.client import AdminClient
from agentic_lora.gateway.serve import Served
from agentic_lora.gateway.serve import ServeOptions
from agentic_lora.gateway.serve import serve
from tests.e2e.support import fleet_config
from tests.e2e.support import fresh_id

CHROMIUM = Path("/usr/bin/chromium")
#: The flags Chromium needs on a machine without network: headless, no sandbox (root), and no
#: background connections (refused here, and slow to fail).
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "status-page.png"
TOKEN = fresh_id("admin-token")
#: Publication onto CPU engines and first generations take seconds, not milliseconds.
SLOW = 120_000


@contextlib.asynccontextmanager
async def served(fleet: EngineFleet, store: Path) -> AsyncIterator[Served]:
    """``serve`` on a free port in front of the shared fleet, stopped (Sessions closed) on exit."""
    settings = load_settings(
        **fleet_config(dict(fleet.engines), fleet.served_model_name),
        gateway_max_tokens=4,
    )
    options = ServeOptions(
        settings=settings,
        backend_options={"store_root": str(store)},
        port=0,
        admin_token=TOKEN,
    )
    ready: asyncio.Future[Served] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.ensure_future(serve(options, on_ready=ready.set_result, stop=stop))
    try:
        done, _ = await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # a start-up failure: raise it
        yield ready.result()
    finally:
        stop.set()
        await task


async def chat(http: httpx.AsyncClient, model: str, session: str) -> str:
    """One short generation in Session ``session``; the version that served it."""
    response = await http.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {session}"},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert response.status_code == 200, response.text
    return response.headers["x-agentic-version"]


def version_row(page: Page, version_id: str) -> Any:
    return page.locator(f'#versions tr[data-version="{version_id}"]')


@pytest.fixture
def chromium() -> Path:
    """Debian's Chromium (never a browser download): ``scripts/browser-env.sh`` installs it."""
    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/browser-env.sh (make test does)")
    return CHROMIUM


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_status_page_follows_a_live_publication_in_a_real_browser(
    chromium: Path, engines_restored: EngineFleet, tmp_path: Path
) -> None:
    fleet = engines_restored
    model = fleet.served_model_name
    a, b = fresh_id("step-100"), fresh_id("step-200")
    async with (
        served(fleet, tmp_path / "store") as gateway,
        AdminClient(gateway.url, token=TOKEN, timeout=SLOW / 1000) as admin,
        httpx.AsyncClient(base_url=gateway.url, timeout=SLOW / 1000, trust_env=False) as http,
        async_playwright() as playwright,
    ):
        assert (await admin.publish(str(fleet.fixture.adapter("A")), a))["outcome"] == "PUBLISHED"
        old = fresh_id("episode-old")
        assert await chat(http, model, old) == a

        browser = await playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),  # a fresh profile: no cookie of an earlier run
            executable_path=str(chromium),
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 900},
        )
        try:
            page = browser.pages[0] if browser.pages else await browser.new_page()
            problems: list[str] = []
            page.on("pageerror", lambda error: problems.append(str(error)))
            page.on(
                "console",
                lambda m: problems.append(m.text) if "Content Security Policy" in m.text else None,
            )
            await page.goto(f"{gateway.url}/ui/")

            # A wrong credential is refused: a message, no data, no cookie.
            await expect(page.locator("#login-panel")).to_be_visible()
            await page.fill("#token", "not-the-admin-token")
            await page.click("#login-form button[type=submit]")
            await expect(page.get_by_test_id("login-error")).to_have_text("Wrong admin token.")
            await expect(page.locator("#dashboard")).to_be_hidden()
            assert await browser.cookies() == []

            await page.fill("#token", TOKEN)
            await page.click("#login-form button[type=submit]")
            await expect(page.get_by_test_id("default-version")).to_have_text(a)
            (cookie,) = await browser.cookies()
            assert (cookie["httpOnly"], cookie["sameSite"]) == (True, "Strict")
            assert TOKEN not in cookie["value"]
            await expect(version_row(page, a).locator('[data-col="sessions"]')).to_have_text("1")

            # Publish while the page is open: it follows without a reload.
            url_before = page.url
            publication = asyncio.ensure_future(admin.publish(str(fleet.fixture.adapter("B")), b))
            await expect(page.get_by_test_id("default-version")).to_have_text(b, timeout=SLOW)
            assert (await publication)["outcome"] == "PUBLISHED"
            newest = page.locator(f'#timeline details[data-version="{b}"][data-kind="publish"]')
            await expect(newest.get_by_test_id("outcome")).to_have_text("published")
            await expect(newest.locator(".step", has_text="record_ready")).to_have_count(2)
            await expect(version_row(page, b).get_by_test_id("default-badge")).to_be_visible()

            # Sessions bind through the gateway: B's count rises; the old Session stays on A.
            sessions = version_row(page, b).locator('[data-col="sessions"]')
            await expect(sessions).to_have_text("0")
            new = [fresh_id(f"episode-{n}") for n in range(3)]
            for n, session in enumerate(new, start=1):
                assert await chat(http, model, session) == b
                await expect(sessions).to_have_text(str(n))
            assert await chat(http, model, old) == a
            await expect(version_row(page, a).locator('[data-col="lag"]')).to_have_text("1")
            await expect(page.locator('#lag-sessions [data-lag="lag 1"] .took')).to_have_text("1")
            # The old Session's last turn was a dispatch at lag 1 (the metrics' histogram).
            await expect(page.locator('#lag-dispatches [data-lag="≤ 1"] .took')).to_have_text("1")
            await expect(page.get_by_test_id("registry-sessions")).to_have_text("4")
            # A request the gateway refuses shows up by its code.
            refused = await http.post(
                "/v1/chat/completions",
                headers={"authorization": f"Bearer {fresh_id('episode-refused')}"},
                json={
                    "model": "not-a-served-model",
                    "messages": [{"role": "user", "content": "hi"}],
                },
            )
            assert refused.status_code == 400
            await expect(
                page.locator('#refusal-codes tr[data-code="ADAPTER_MISMATCH"] td.num')
            ).to_have_text("1")
            await expect(page.locator("#engines tbody tr .health.healthy")).to_have_count(2)
            assert page.url == url_before

            await expect(page.get_by_test_id("readiness")).to_have_text(re.compile("^ready$"))
            await page.screenshot(path=str(SCREENSHOT), full_page=True)
            assert problems == []

            # Logging out ends the page session: the page asks for the token again.
            await page.click("#logout")
            await expect(page.locator("#login-panel")).to_be_visible()
        finally:
            await browser.close()
        for session in (old, *new):
            await http.post("/v1/sessions/close", headers={"authorization": f"Bearer {session}"})
