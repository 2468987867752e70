"""The status page's routes on a real gateway (scripted engines at the HTTP edge; the real
registry, Sessions, publisher and gateway run): login, cookie, CSRF refusals, headers, the
view's ETag, and what the page learns from publications and refused requests.
"""

from __future__ import annotations

import logging
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentic_lora.gateway.ui.routes import CONTENT_SECURITY_POLICY
from agentic_lora.gateway.ui.routes import COOKIE_NAME
from tests.gateway.test_gateway import ADMIN_TOKEN
from tests.gateway.test_gateway import BASE_MODEL
from tests.gateway.test_gateway import chat
from tests.gateway.test_gateway import gateway_stack

pytestmark = pytest.mark.asyncio

JSON = {"content-type": "application/json"}


async def login(
    http: httpx.AsyncClient, token: str = ADMIN_TOKEN, **headers: str
) -> httpx.Response:
    return await http.post("/ui/login", json={"token": token}, headers=headers)


def error_of(response: httpx.Response) -> tuple[str, Any]:
    error = response.json()["error"]
    return error["code"], error["details"].get("reason")


async def test_the_page_and_its_assets_carry_a_strict_policy_and_no_data(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path) as stack:
        http = stack.http()
        moved = await http.get("/ui")
        assert (moved.status_code, moved.headers["location"]) == (308, "/ui/")
        page = await http.get("/ui/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert "'unsafe-inline'" not in CONTENT_SECURITY_POLICY
        assert page.headers["x-frame-options"] == "DENY"
        assert page.headers["x-content-type-options"] == "nosniff"
        html = page.text
        # No inline script or style, and nothing from anywhere else.
        assert '<script src="static/app.js" defer></script>' in html
        assert "<style" not in html
        assert " style=" not in html
        assert "http://" not in html
        assert "https://" not in html
        for name, media in (("app.js", "text/javascript"), ("app.css", "text/css")):
            asset = await http.get(f"/ui/static/{name}")
            assert asset.status_code == 200
            assert asset.headers["content-type"].startswith(media)
            assert "http://" not in asset.text
            assert "https://" not in asset.text
        script = (await http.get("/ui/static/app.js")).text
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
            assert sink not in script, sink
        for missing in ("index.html", "../app.py", "nope.js"):
            response = await http.get(f"/ui/static/{missing}")
            assert response.status_code == 404, missing
        # The page is not in the API document; the API's routes still are.
        paths = (await http.get("/openapi.json")).json()["paths"]
        assert not [p for p in paths if p.startswith("/ui")]


async def test_a_login_exchanges_the_token_for_a_strict_http_only_cookie(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path) as stack:
        http = stack.http()
        denied = await http.get("/ui/api/view")
        assert (denied.status_code, error_of(denied)) == (401, ("ACCESS_DENIED", "not_logged_in"))

        wrong = await login(http, "not-the-token")
        assert (wrong.status_code, error_of(wrong)) == (401, ("ACCESS_DENIED", "bad_admin_token"))
        assert "set-cookie" not in wrong.headers

        ok = await login(http)
        assert ok.status_code == 200
        assert ok.json() == {"expires_in": 8 * 3600}
        assert ok.headers["cache-control"] == "no-store"
        cookie = SimpleCookie(ok.headers["set-cookie"])[COOKIE_NAME]
        assert cookie.value != ADMIN_TOKEN
        assert ADMIN_TOKEN not in ok.headers["set-cookie"]
        assert cookie["httponly"] is True
        assert cookie["samesite"].lower() == "strict"
        assert cookie["path"] == "/ui/"
        assert cookie["max-age"] == str(8 * 3600)
        assert not cookie["secure"]  # plain http here; https sets Secure

        view = await http.get("/ui/api/view")  # the client sends the cookie back
        assert view.status_code == 200
        assert view.json()["summary"]["gateway_sessions"] == 0

        out = await http.post("/ui/logout", json={})
        assert out.json() == {"logged_out": True}
        assert COOKIE_NAME not in http.cookies
        replayed = stack.http()
        replayed.cookies.set(COOKIE_NAME, cookie.value)
        assert (await replayed.get("/ui/api/view")).status_code == 401


async def test_the_admin_bearer_token_reads_the_view_too_and_a_session_id_does_not(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        await chat(stack.agent("episode-1"))
        http = stack.http()
        as_admin = await http.get(
            "/ui/api/view", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        assert as_admin.status_code == 200
        assert as_admin.json()["versions"]["rows"][0]["sessions"] == 1
        as_agent = await http.get("/ui/api/view", headers={"authorization": "Bearer episode-1"})
        assert as_agent.status_code == 401
        forged = stack.http()
        forged.cookies.set(COOKIE_NAME, ADMIN_TOKEN)
        assert (await forged.get("/ui/api/view")).status_code == 401


async def test_an_unchanged_view_is_a_304_and_a_change_a_new_etag(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        http = stack.http()
        await login(http)
        first = await http.get("/ui/api/view")
        etag = first.headers["etag"]
        assert first.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        same = await http.get("/ui/api/view", headers={"if-none-match": etag})
        assert (same.status_code, same.content, same.headers["etag"]) == (304, b"", etag)
        await chat(stack.agent("episode-1"))  # a Session binds A
        # Views are reused for half a second: ask for another page, built fresh.
        changed = await http.get("/ui/api/view?leases_limit=5", headers={"if-none-match": etag})
        assert changed.status_code == 200
        assert changed.headers["etag"] != etag
        assert changed.json()["versions"]["rows"][0]["sessions"] == 1
        bad = await http.get("/ui/api/view?versions_limit=100000")
        assert (bad.status_code, error_of(bad)[0]) == (400, "INVALID_REQUEST")


@pytest.mark.parametrize(
    ("headers", "status", "reason"),
    [
        ({"content-type": "application/x-www-form-urlencoded"}, 400, "not_json"),
        ({"content-type": "text/plain"}, 400, "not_json"),
        ({**JSON, "sec-fetch-site": "cross-site"}, 401, "cross_site"),
        ({**JSON, "sec-fetch-site": "same-site"}, 401, "cross_site"),
        ({**JSON, "origin": "http://evil.example"}, 401, "cross_site"),
    ],
)
async def test_a_cross_site_login_or_logout_is_refused(
    tmp_path: Path, headers: dict[str, str], status: int, reason: str
) -> None:
    async with gateway_stack(tmp_path) as stack:
        http = stack.http()
        body = f'{{"token": "{ADMIN_TOKEN}"}}'
        for path in ("/ui/login", "/ui/logout"):
            response = await http.post(path, content=body, headers=headers)
            assert (response.status_code, error_of(response)[1]) == (status, reason), path
        assert "set-cookie" not in response.headers
        assert len(stack.gateway.status_page.logins) == 0
        same = await http.post(
            "/ui/login",
            content=body,
            headers={**JSON, "sec-fetch-site": "same-origin", "origin": "http://gateway"},
        )
        assert same.status_code == 200


async def test_login_bodies_are_bounded_and_typed(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path) as stack:
        http = stack.http()
        for body, status in (
            (b'{"token": 1}', 400),
            (b"[]", 400),
            (b"{", 400),
            (b'{"token": "' + b"x" * 10_000 + b'"}', 413),
        ):
            response = await http.post("/ui/login", content=body, headers=JSON)
            assert response.status_code == status, body[:20]


async def test_guessing_is_bounded_with_a_429_and_retry_after(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path) as stack:
        http = stack.http()
        for _ in range(10):
            assert (await login(http, "guess")).status_code == 401
        limited = await login(http)  # even the right token, for now
        assert (limited.status_code, error_of(limited)) == (
            429,
            ("ACCESS_DENIED", "too_many_attempts"),
        )
        assert 1 <= int(limited.headers["retry-after"]) <= 61
        assert "set-cookie" not in limited.headers


async def test_without_an_admin_token_the_page_is_disabled(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, admin_token=None) as stack:
        http = stack.http()
        response = await login(http, "anything")
        assert (response.status_code, error_of(response)[1]) == (401, "admin_disabled")
        view = await http.get("/ui/api/view")
        assert (view.status_code, error_of(view)[1]) == (401, "admin_disabled")


async def test_publications_and_refused_requests_appear_on_the_page(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path) as stack:
        await stack.publish("A", 1)
        await stack.publish("B", 2)
        agent = stack.http()
        bad = await agent.post(
            "/v1/chat/completions",
            json={"model": "some-other-model", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": "Bearer episode-9"},
        )
        assert bad.status_code == 400
        anonymous = await agent.post("/generate", json={"text": "hi"})
        assert anonymous.status_code == 401
        http = stack.http()
        await login(http)
        view = (await http.get("/ui/api/view")).json()
        assert view["summary"]["default_version"] == "B"
        # (the background reclaimer may have reclaimed A since: its own operation)
        newest, older = [op for op in view["timeline"] if op["kind"] == "publish"]
        assert (newest["version_id"], newest["kind"], newest["outcome"]) == (
            "B",
            "publish",
            "published",
        )
        assert older["version_id"] == "A"
        done = {(s["engine"], s["phase"]) for s in newest["steps"] if s["status"] == "DONE"}
        assert {("e0", "record_ready"), ("e1", "record_ready"), (None, "commit")} <= done
        assert view["refusals"]["by_code"] == {"ADAPTER_MISMATCH": 1, "ACCESS_DENIED": 1}
        assert [(r["code"], r["route"]) for r in view["refusals"]["recent"]] == [
            ("ACCESS_DENIED", "/generate"),
            ("ADAPTER_MISMATCH", "/v1/chat/completions"),
        ]
        assert view["engines"][0]["healthy"] is True
        assert BASE_MODEL not in str(view["refusals"])


async def test_no_log_record_carries_the_token_or_a_page_session(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        async with gateway_stack(tmp_path) as stack:
            http = stack.http()
            await login(http, "a-wrong-guess")
            ok = await login(http)
            value = SimpleCookie(ok.headers["set-cookie"])[COOKIE_NAME].value
            await http.get("/ui/api/view")
            await http.post("/ui/logout", json={})
    text = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "status page login" in text
    for secret in (ADMIN_TOKEN, value, "a-wrong-guess"):
        assert secret not in text
