"""The Session gateway, driven by the official ``openai`` client and the admin client, in front
of scripted SGLang engines (respx at the engine HTTP edge; the real registry, Sessions,
publisher, reclaimer and HTTP push run underneath).

The helpers at the top are shared with ``test_metrics.py`` and ``test_cli.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from agentic_lora.config import load_settings
from agentic_lora.errors import AccessDeniedError
from agentic_lora.errors import CapacityError
from agentic_lora.errors import InvalidAdapterError
from agentic_lora.errors import VersionConflictError
from agentic_lora.gateway.app import Gateway
from agentic_lora.gateway.client import AdminClient
from agentic_lora.gateway.sessions import IdleReaped
from agentic_lora.registry.types import VersionState
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault
from agentic_lora.testing.sglang_engine import FaultKind
from agentic_lora.testing.sglang_engine import ScriptedSGLangEngine
from agentic_lora.testing.streams import ScriptedStream
from agentic_lora.testing.streams import openai_chunks
from agentic_lora.testing.streams import stream_reply

pytestmark = pytest.mark.asyncio

BASE_MODEL = "base-model"  # what ScriptedSGLangEngine serves
ADMIN_TOKEN = "admin-secret-token"
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions")


# --- helpers (shared) -----------------------------------------------------------------------------


@dataclass
class OpenAIRoutes:
    """SGLang's OpenAI routes on every engine of a ScriptedFleet.

    Like SGLang, ``model="<base>:<adapter>"`` must name the served base model and a registered
    adapter; ``"stream": true`` is answered with server-sent chunks. Faults are scripted per engine: ``"unreachable"`` (never reaches the engine) or
    ``"lose_reply"`` (the engine runs it, the reply is lost).
    """

    fleet: ScriptedFleet
    sent: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    faults: dict[str, deque[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for engine in self.fleet.engines.values():
            self.faults[engine.name] = deque()
            for path in OPENAI_PATHS:
                self.fleet.router.post(engine.base_url + path).mock(
                    side_effect=self._handler(engine, path)
                )

    def fail_next(self, kind: str) -> None:
        for queue in self.faults.values():
            queue.append(kind)

    def models(self, path: str | None = None) -> list[str]:
        return [body["model"] for _, p, body in self.sent if path is None or p == path]

    def _handler(self, engine: ScriptedSGLangEngine, path: str) -> Any:
        def handle(request: httpx.Request) -> httpx.Response:
            fault = self.faults[engine.name].popleft() if self.faults[engine.name] else None
            if fault == "unreachable":
                raise httpx.ConnectError("connection refused (scripted)", request=request)
            body = json.loads(request.content)
            self.sent.append((engine.name, path, body))
            if fault == "lose_reply":
                raise httpx.ReadError("connection dropped (scripted)", request=request)
            base, sep, adapter = str(body.get("model")).partition(":")
            if base != engine.served_model_name or (sep and adapter not in engine.adapters):
                return httpx.Response(
                    400, json={"error": {"message": f"unknown model {body.get('model')!r}"}}
                )
            if body.get("stream"):
                # Like SGLang: server-sent chunks (the engine's queued ScriptedStream, if any).
                stream = engine.streams.popleft() if engine.streams else ScriptedStream()
                if stream.chunks is None:
                    stream.chunks = openai_chunks(3, path, body["model"])
                engine.streamed[body.get("rid")] = stream
                return stream_reply(stream)
            if path.endswith("chat/completions"):
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"hi from {engine.name}"},
                    "finish_reason": "stop",
                }
                kind = "chat.completion"
            else:
                choice = {"index": 0, "text": "hi", "finish_reason": "stop", "logprobs": None}
                kind = "text_completion"
            return httpx.Response(
                200,
                json={
                    "id": "cmpl-1",
                    "object": kind,
                    "created": 0,
                    "model": body["model"],
                    "choices": [choice],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                },
            )

        return handle


def lora_server_info(fleet: ScriptedFleet, **fields: Any) -> None:
    """Serve ``/server_info`` and ``/get_server_info`` with SGLang's LoRA fields added."""
    info = {
        "enable_lora": True,
        "max_loaded_loras": 3,
        "max_loras_per_batch": 3,
        "max_lora_rank": 8,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        **fields,
    }
    for engine in fleet.engines.values():
        for path in ("/server_info", "/get_server_info"):

            def handle(request: httpx.Request, engine: ScriptedSGLangEngine = engine) -> Any:
                base = {
                    "version": "0.5.23",
                    "served_model_name": engine.served_model_name,
                    "model_path": engine.served_model_name,
                    "random_seed": engine.restarts,
                }
                return httpx.Response(200, json={**base, **info})

            fleet.router.route(method="GET", url=engine.base_url + path).mock(side_effect=handle)


def settings_for(fleet: ScriptedFleet, **overrides: Any) -> Any:
    return fleet.settings(**{"base_model_name": BASE_MODEL, **overrides})


@dataclass
class Stack:
    """A gateway over scripted engines, and clients that reach it in-process."""

    fleet: ScriptedFleet
    routes: OpenAIRoutes
    gateway: Gateway
    root: Path
    _clients: list[Any] = field(default_factory=list)

    def adapter(self, seed: int, name: str | None = None) -> str:
        path = self.root / "adapters" / (name or f"seed{seed}")
        if not path.exists():
            tiny_snapshot(seed).write_peft_dir(path)
        return str(path)

    def agent(self, api_key: str, **options: Any) -> openai.AsyncOpenAI:
        """An unmodified OpenAI client whose API key is its Session id."""
        options.setdefault("max_retries", 0)
        client = openai.AsyncOpenAI(
            base_url="http://gateway/v1",
            api_key=api_key,
            http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=self.gateway.app)),
            **options,
        )
        self._clients.append(client)
        return client

    def http(self) -> httpx.AsyncClient:
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.gateway.app), base_url="http://gateway"
        )
        self._clients.append(client)
        return client

    def admin(self, token: str | None = ADMIN_TOKEN) -> AdminClient:
        client = AdminClient(
            "http://gateway", token=token, transport=httpx.ASGITransport(app=self.gateway.app)
        )
        self._clients.append(client)
        return client

    async def publish(self, version_id: str, seed: int) -> dict[str, Any]:
        return await self.admin().publish(self.adapter(seed), version_id)

    async def close_own(self, session: str) -> httpx.Response:
        """Close a Session with its own credential (its id is its API key)."""
        return await self.http().post(
            f"/v1/sessions/{session}/close", headers={"authorization": f"Bearer {session}"}
        )

    async def aclose_clients(self) -> None:
        for client in self._clients:
            await (client.close() if isinstance(client, openai.AsyncOpenAI) else client.aclose())


@contextlib.asynccontextmanager
async def gateway_stack(
    root: Path, *, published: str | None = None, **gateway_options: Any
) -> AsyncIterator[Stack]:
    """A started gateway (its own registry, publisher, reclaimer) over two scripted engines
    (with ``published`` already published from the adapter of seed 1, when given)."""
    with ScriptedFleet() as fleet:
        routes = OpenAIRoutes(fleet)
        gateway_options.setdefault("admin_token", ADMIN_TOKEN)
        gateway = await Gateway.from_settings(
            settings_for(fleet, **gateway_options.pop("settings", {})),
            backend_options={"store_root": str(root / "store")},
            **gateway_options,
        )
        stack = Stack(fleet, routes, gateway, root)
        try:
            async with gateway:
                if published is not None:
                    await stack.publish(published, 1)
                yield stack
        finally:
            await stack.aclose_clients()


def lora_name(stack: Stack, version_id: str) -> str:
    registry: Any = stack.gateway.deployment.registry
    return str(registry.peek_version(version_id).lora_name)


async def chat(client: openai.AsyncOpenAI, text: str = "hello") -> Any:
    return await client.chat.completions.create(
        model=BASE_MODEL, messages=[{"role": "user", "content": text}], max_tokens=4
    )


async def served_version(client: openai.AsyncOpenAI, text: str) -> str:
    """One chat turn; the version the gateway says served it (``x-agentic-version``)."""
    raw = await client.chat.completions.with_raw_response.create(
        model=BASE_MODEL, messages=[{"role": "user", "content": text}]
    )
    return raw.headers["x-agentic-version"]


# --- pinning across a publication ---------------------------------------------------------------


async def test_openai_client_stays_on_a_across_the_publication_of_b_and_a_new_one_gets_b(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path) as stack:
        assert (await stack.publish("A", 1))["outcome"] == "PUBLISHED"
        a_name = lora_name(stack, "A")
        old = stack.agent("episode-old")
        await chat(old, "turn 1")

        published = await stack.publish("B", 2)
        assert published["outcome"] == "PUBLISHED"
        b_name = lora_name(stack, "B")

        raw = await old.chat.completions.with_raw_response.create(
            model=BASE_MODEL, messages=[{"role": "user", "content": "tool turn"}]
        )
        assert raw.headers["x-agentic-version"] == "A"
        assert raw.headers["x-agentic-lora-name"] == a_name
        await old.completions.create(model=BASE_MODEL, prompt="resume", max_tokens=2)

        new = stack.agent("episode-new")
        assert await served_version(new, "turn 1") == "B"

        sent = [
            (
                body["messages"][-1]["content"] if "messages" in body else body["prompt"],
                body["model"],
            )
            for _, _, body in stack.routes.sent
        ]
        assert sent == [
            ("turn 1", f"{BASE_MODEL}:{a_name}"),
            ("tool turn", f"{BASE_MODEL}:{a_name}"),
            ("resume", f"{BASE_MODEL}:{a_name}"),
            ("turn 1", f"{BASE_MODEL}:{b_name}"),
        ]


async def test_close_releases_the_binding_and_a_reclaim_unloads_a_once(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        old = stack.agent("episode-old")
        await chat(old)
        await stack.publish("B", 2)
        a_name = lora_name(stack, "A")

        # A is retired but still bound: reclaim leaves it alone.
        report = await stack.admin().reclaim()
        assert report["results"] == []
        assert all(e.holds(a_name) for e in stack.fleet.engines.values())

        closed = await stack.close_own("episode-old")
        assert closed.status_code == 200
        assert closed.json() == {
            "session": "episode-old",
            "found": True,
            "version_id": "A",
            "released_now": True,
        }
        await stack.gateway.deployment.reclaimer.settled()
        report = await stack.admin().reclaim()  # idempotent: the background round did it
        status = (await stack.admin().status())["registry"]
        states = {v["version_id"]: v["state"] for v in status["versions"]}
        assert states == {"A": "RECLAIMED", "B": "PUBLISHED"}
        for engine in stack.fleet.engines.values():
            assert engine.physical_unloads[a_name] == 1
            assert not engine.holds(a_name)

        # The closed id is refused, never silently re-bound to B.
        with pytest.raises(openai.ConflictError) as err:
            await chat(old, "straggler")
        assert err.value.body["code"] == "SESSION_CLOSED"  # type: ignore[index]
        assert err.value.response.headers["x-agentic-outcome"] == "refused"
        assert len(stack.routes.sent) == 1

        again = await stack.close_own("episode-old")
        assert again.json()["found"] is False


async def test_closing_another_sessions_id_is_refused(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        await chat(stack.agent("mine"))
        response = await stack.http().post(
            "/v1/sessions/mine/close", headers={"authorization": "Bearer someone-else"}
        )
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "ACCESS_DENIED"
        assert response.json()["error"]["details"]["reason"] == "not_owner"
        assert stack.gateway.versioning.get("mine") is not None


# --- refusals and failures ----------------------------------------------------------------------


async def test_refused_and_indeterminate_failures_stay_distinguishable(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        stack.routes.fail_next("unreachable")
        with pytest.raises(openai.APIStatusError) as refused:
            await chat(stack.agent("s-refused"))
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == "REQUEST_REFUSED"  # type: ignore[index]
        assert refused.value.response.headers["x-agentic-outcome"] == "refused"
        # Nothing ran, so a client may resend on its own.
        assert refused.value.response.headers["x-should-retry"] == "true"
        assert stack.routes.sent == []

        stack.routes.faults = {name: deque() for name in stack.routes.faults}
        stack.routes.fail_next("lose_reply")
        # The SDK's default retry policy is on: the gateway's answer must switch it off.
        with pytest.raises(openai.InternalServerError) as lost:
            await chat(stack.agent("s-lost", max_retries=2))
        assert lost.value.status_code == 502
        assert lost.value.body["code"] == "REQUEST_INDETERMINATE"  # type: ignore[index]
        assert lost.value.response.headers["x-agentic-outcome"] == "indeterminate"
        assert lost.value.response.headers["x-should-retry"] == "false"
        assert len(stack.routes.sent) == 1, "an indeterminate generation was sent twice"


async def test_native_generate_failures_carry_the_same_classification(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        http = stack.http()
        headers = {"x-agentic-session": "native-1"}
        ok = await http.post("/generate", json={"text": "hi"}, headers=headers)
        assert ok.status_code == 200
        assert ok.json()["meta_info"]["lora_path"] == lora_name(stack, "A")
        engine = stack.fleet[ok.headers["x-agentic-engine"]]

        engine.script(EngineOp.GENERATE, Fault(FaultKind.SERVER_ERROR))
        failed = await http.post("/generate", json={"text": "again"}, headers=headers)
        assert failed.status_code == 502
        assert failed.json()["error"]["code"] == "REQUEST_INDETERMINATE"
        assert failed.headers["x-agentic-outcome"] == "indeterminate"


async def test_a_bad_model_name_is_an_adapter_mismatch_and_never_reaches_an_engine(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        with pytest.raises(openai.BadRequestError) as err:
            await stack.agent("s").chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
            )
        assert err.value.body["code"] == "ADAPTER_MISMATCH"  # type: ignore[index]
        assert err.value.response.headers["x-agentic-outcome"] == "refused"
        assert stack.routes.sent == []


async def test_before_the_first_publication_a_generation_is_a_retryable_503(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path) as stack:
        with pytest.raises(openai.APIStatusError) as err:
            await chat(stack.agent("early"))
        assert err.value.status_code == 503
        assert err.value.body["code"] == "NO_PUBLISHED_VERSION"  # type: ignore[index]
        assert err.value.response.headers["x-should-retry"] == "true"
        # The failed bind left the Session open and unbound: after A it binds to A.
        await stack.publish("A", 1)
        assert await served_version(stack.agent("early"), "hi") == "A"


async def test_requests_without_a_session_or_with_a_bad_one_are_refused(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        http = stack.http()
        missing = await http.post("/v1/chat/completions", json={"messages": []})
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "ACCESS_DENIED"
        spaced = await http.post(
            "/v1/completions",
            json={"prompt": "x"},
            headers={"x-agentic-session": "two words"},
        )
        assert spaced.status_code == 400
        assert spaced.json()["error"]["code"] == "INVALID_REQUEST"
        not_json = await http.post(
            "/generate", content=b"{nope", headers={"x-agentic-session": "s1"}
        )
        assert not_json.status_code == 400
        assert not_json.json()["error"]["code"] == "INVALID_REQUEST"
        assert stack.routes.sent == []
        assert stack.fleet.calls(EngineOp.GENERATE) == 2  # the two publication probes only


async def test_two_headers_naming_different_sessions_are_a_400_that_opens_nothing(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        agent = stack.agent("key-is-not-the-session", default_headers={"X-Agentic-Session": "s7"})
        with pytest.raises(openai.BadRequestError) as err:
            await chat(agent)
        assert err.value.response.json()["error"]["details"] == {
            "reason": "conflicting_session_headers"
        }
        assert stack.gateway.sessions.live() == 0
        # The same id in both headers, or the explicit header alone, is one Session.
        await chat(stack.agent("s7", default_headers={"X-Agentic-Session": "s7"}))
        explicit = await stack.http().post(
            "/v1/completions",
            json={"model": BASE_MODEL, "prompt": "x"},
            headers={"X-Agentic-Session": "s7"},
        )
        assert explicit.status_code == 200
        assert stack.gateway.sessions.live() == 1
        assert stack.gateway.versioning.get("s7") is not None


# --- idle expiry --------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_idle_sessions_expire_but_never_with_a_request_in_flight(tmp_path: Path) -> None:
    clock = FakeClock()
    async with gateway_stack(tmp_path, clock=clock, published="A") as stack:
        http = stack.http()
        await http.post("/generate", json={"text": "x"}, headers={"x-agentic-session": "idle"})
        # Hold one request of "busy" inside an engine.
        gate, reached = asyncio.Event(), asyncio.Event()
        for engine in stack.fleet.engines.values():
            engine.script(EngineOp.GENERATE, Fault.waiting_for(gate, reached))
        held = asyncio.ensure_future(
            http.post("/generate", json={"text": "y"}, headers={"x-agentic-session": "busy"})
        )
        await reached.wait()
        clock.now = 100.0

        closed = await stack.gateway.sessions.reap_idle(30.0)
        assert closed == IdleReaped(session_ids=("idle",))
        assert stack.gateway.versioning.get("busy") is not None

        gate.set()
        assert (await held).status_code == 200
        for engine in stack.fleet.engines.values():
            engine.clear_script()
        refused = await http.post(
            "/generate", json={"text": "z"}, headers={"x-agentic-session": "idle"}
        )
        assert refused.status_code == 409
        # The registry tombstoned the id: the same answer on every replica and after a restart.
        assert refused.json()["error"]["details"] == {"session": "idle", "reason": "closed"}
        status = await stack.gateway.deployment.status()
        assert status.versions[0].session_refs == 1  # "busy" only


async def test_reuse_closed_ids_opens_a_new_session_bound_to_the_new_default(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path, reuse_closed_ids=True, published="A") as stack:
        agent = stack.agent("worker-3")
        await chat(agent)
        await stack.close_own("worker-3")
        await stack.publish("B", 2)
        assert await served_version(agent, "next episode") == "B"


# --- admin --------------------------------------------------------------------------------------


async def test_admin_routes_need_the_admin_token(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path) as stack:
        for token in (None, "wrong", "admin-secret-tok"):
            with pytest.raises(AccessDeniedError):
                await stack.admin(token).status()
        http = stack.http()
        # A Session id is not an admin token, whatever the caller sends.
        response = await http.post("/admin/reclaim", headers={"authorization": "Bearer episode-1"})
        assert response.status_code == 401
        assert response.json()["error"]["details"]["reason"] == "bad_admin_token"
        assert (await stack.admin().status())["registry"]["versions"] == []


async def test_without_an_admin_token_the_admin_routes_are_disabled(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, admin_token=None) as stack:
        with pytest.raises(AccessDeniedError) as err:
            await stack.admin("anything").publish(stack.adapter(1), "A")
        assert err.value.details["reason"] == "admin_disabled"
        assert stack.fleet.calls(EngineOp.LOAD) == 0


async def test_publish_streams_progress_per_engine_and_phase(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path) as stack:
        events: list[dict[str, Any]] = []
        listeners = len(stack.gateway.progress)  # the metrics' and the status page's
        result = await stack.admin().publish(
            stack.adapter(1), "A", on_event=lambda e: events.append(dict(e))
        )
        assert result["outcome"] == "PUBLISHED"
        assert result["ok"] is True
        assert result["commit"]["default_revision"] == 1
        done = {(e["engine"], e["phase"]) for e in events if e["status"] == "DONE"}
        for engine in ("e0", "e1"):
            assert (engine, "prepare") in done
            assert (engine, "record_ready") in done
        assert (None, "reserve") in done
        assert (None, "commit") in done
        # Every phase that started also ended, and the commit came after both prepares.
        started = [(e["engine"], e["phase"]) for e in events if e["status"] == "STARTED"]
        assert set(started) == done
        order = [(e["engine"], e["phase"]) for e in events if e["status"] == "DONE"]
        assert order.index((None, "commit")) > max(
            order.index(("e0", "prepare")), order.index(("e1", "prepare"))
        )
        assert len(stack.gateway.progress) == listeners, "the stream's listener was not removed"


async def test_publication_errors_come_back_typed(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        admin = stack.admin()
        with pytest.raises(VersionConflictError):
            await admin.publish(stack.adapter(2), "A")
        bad = tmp_path / "not-an-adapter"
        bad.mkdir()
        with pytest.raises(InvalidAdapterError):
            await admin.publish(str(bad), "X")
        http = stack.http()
        relative = await http.post(
            "/admin/publish",
            json={"adapter_dir": "adapters/seed1", "version_id": "R"},
            headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        assert relative.status_code == 400
        assert relative.json()["error"]["details"]["field"] == "adapter_dir"
        status = (await admin.status())["registry"]
        assert [v["version_id"] for v in status["versions"]] == ["A"]


async def test_a_full_fleet_skips_a_publication_without_touching_an_engine(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        await chat(stack.agent("holds-a"))
        await stack.publish("B", 2)
        loads = stack.fleet.calls(EngineOp.LOAD)
        result = await stack.publish("C", 3)
        assert result["outcome"] == "SKIPPED"
        assert result["reason"] == CapacityError.code
        assert stack.fleet.calls(EngineOp.LOAD) == loads
        # Non-streaming form of the same route.
        http = stack.http()
        plain = await http.post(
            "/admin/publish",
            json={"adapter_dir": stack.adapter(3), "version_id": "C"},
            headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
        )
        assert plain.status_code == 200
        assert plain.json()["outcome"] == "SKIPPED"


async def test_status_lists_fleet_versions_and_sessions(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        await chat(stack.agent("one"))
        payload = await stack.admin().status()
        assert payload["fleet"] == [
            {"engine": e.name, "base_url": e.base_url} for e in stack.fleet.refs
        ]
        assert payload["gateway"] == {"sessions": 1, "adopted": 0}
        (version,) = payload["registry"]["versions"]
        assert version["state"] == VersionState.PUBLISHED.value
        assert version["session_refs"] == 1
        assert version["ready_engines"] == ["e0", "e1"]
        assert payload["registry"]["default_version"] == "A"


async def test_models_and_health(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path) as stack:
        models = await stack.agent("m").models.list()
        assert [m.id for m in models.data] == [BASE_MODEL]
        assert (await stack.http().get("/health")).json() == {"status": "ok"}


# --- logs ---------------------------------------------------------------------------------------


async def test_dispatch_logs_carry_the_stable_keys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        agent = stack.agent("logged")
        with caplog.at_level(logging.INFO, logger="agentic_lora.gateway.app"):
            await chat(agent)
            stack.routes.fail_next("lose_reply")
            with pytest.raises(openai.InternalServerError):
                await chat(agent)
        records = [r for r in caplog.records if r.name == "agentic_lora.gateway.app"]
        assert [r.getMessage().split(":")[0] for r in records] == [
            "dispatch ok",
            "dispatch indeterminate",
        ]
        tag = stack.gateway.sessions.tag("logged")
        assert tag.startswith("s-")
        assert "logged" not in tag
        for record in records:
            # A keyed hash of the id (the bearer credential), never the id itself.
            assert getattr(record, "session") == tag  # noqa: B009
            assert "logged" not in record.getMessage()
            assert getattr(record, "version") == "A"  # noqa: B009
            assert getattr(record, "engine") in ("e0", "e1")  # noqa: B009
            assert getattr(record, "attempt") == 1  # noqa: B009


# --- real SGLang engines ------------------------------------------------------------------------


async def _adapter_cards(client: httpx.AsyncClient, base_url: str) -> set[str]:
    response = await client.get(f"{base_url}/v1/models")
    assert response.status_code == 200, response.text
    return {card["id"] for card in response.json()["data"] if card.get("parent") is not None}


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first user of the shared fleet may pay for starting it
async def test_openai_client_pinned_across_a_publication_on_real_engines(
    engine_fleet: Any, tmp_path: Path
) -> None:
    """The gateway in front of the shared two-engine SGLang fleet, with the official client.

    Greedy outputs through the gateway equal direct engine calls naming the pinned adapter, so
    the engine really ran that adapter. The fleet is left as found: A is reclaimed through the
    product, B (still the default when the test ends) is unloaded in teardown.
    """
    import uuid

    from agentic_lora.config import verify_fleet
    from agentic_lora.engines.admin import EngineAdminClient

    tag = uuid.uuid4().hex[:8]
    base = engine_fleet.served_model_name
    urls = [url for _, url in engine_fleet.engines]
    settings = load_settings(
        enable_versioned_lora_publication=True,
        engines=[f"{name}={url}" for name, url in engine_fleet.engines],
        capacity=2,
        base_model_name=base,
    )
    prompt: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "policy version engine"}
    ]

    async def direct(client: httpx.AsyncClient, url: str, adapter: str) -> str:
        body = {"model": f"{base}:{adapter}", "messages": prompt, "max_tokens": 8, "temperature": 0}
        response = await client.post(f"{url}/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["message"]["content"])

    async with httpx.AsyncClient(timeout=120, trust_env=False) as raw:
        before = {url: await _adapter_cards(raw, url) for url in urls}
        gateway = await Gateway.from_settings(
            settings, backend_options={"store_root": str(tmp_path / "store")}, admin_token="t"
        )
        published: list[str] = []
        try:
            async with gateway:
                await verify_fleet(settings, gateway.versioning.transport)
                transport = httpx.ASGITransport(app=gateway.app)
                admin = AdminClient("http://gateway", token="t", transport=transport)
                http = httpx.AsyncClient(transport=transport, base_url="http://gateway")
                clients = [
                    openai.AsyncOpenAI(
                        base_url="http://gateway/v1",
                        api_key=f"{tag}-{who}",
                        max_retries=0,
                        http_client=httpx2.AsyncClient(
                            transport=httpx2.ASGITransport(app=gateway.app), timeout=120
                        ),
                    )
                    for who in ("old", "new")
                ]
                old, new = clients
                try:

                    async def ask(agent: openai.AsyncOpenAI) -> tuple[str, str]:
                        raw_reply = await agent.chat.completions.with_raw_response.create(
                            model=base,
                            messages=prompt,
                            max_tokens=8,
                            temperature=0,
                        )
                        text = raw_reply.parse().choices[0].message.content or ""
                        return raw_reply.headers["x-agentic-lora-name"], text

                    a = await admin.publish(str(engine_fleet.fixture.adapter("A")), f"{tag}-A")
                    published.append(a["lora_name"])
                    a_name, first = await ask(old)
                    b = await admin.publish(str(engine_fleet.fixture.adapter("B")), f"{tag}-B")
                    published.append(b["lora_name"])
                    assert (a["outcome"], b["outcome"]) == ("PUBLISHED", "PUBLISHED")

                    old_name, again = await ask(old)
                    new_name, fresh = await ask(new)
                    assert (a_name, old_name, new_name) == (
                        a["lora_name"],
                        a["lora_name"],
                        b["lora_name"],
                    )
                    assert again == first == await direct(raw, urls[0], a["lora_name"])
                    assert fresh == await direct(raw, urls[1], b["lora_name"])

                    closed = await http.post(
                        f"/v1/sessions/{tag}-old/close",
                        headers={"authorization": f"Bearer {tag}-old"},
                    )
                    assert closed.json()["released_now"] is True
                    await gateway.deployment.reclaimer.settled()
                    await admin.reclaim()
                    status = (await admin.status())["registry"]
                    states = {v["version_id"]: v["state"] for v in status["versions"]}
                    assert states == {f"{tag}-A": "RECLAIMED", f"{tag}-B": "PUBLISHED"}
                    for url in urls:
                        assert a["lora_name"] not in await _adapter_cards(raw, url)
                finally:
                    for client in clients:
                        await client.close()
                    await http.aclose()
                    await admin.aclose()
        finally:
            for url in urls:
                async with EngineAdminClient(url, client=raw) as engine:
                    for name in published:
                        await engine.unload_lora_adapter(name)
        assert {url: await _adapter_cards(raw, url) for url in urls} == before
