"""Shared helpers for the dispatch-path tests (no tests here).

* :class:`FakeEngines`: respx routes standing in for two SGLang engines. Every request body that
  reaches them is recorded; generations can be held in flight (released by ``/abort_request`` or
  by the test), answered with an error status, or "lost" (recorded, then ReadTimeout).
* :class:`RecordingRegistry`: a thin wrapper around the real ``LocalRegistry`` that counts calls
  per verb, can hold a verb at a gate, and can fail a verb before or after it ran (a lost reply).
* :func:`publish` / :func:`stage`: drive publications with the registry verbs directly
  (:mod:`agentic_lora.testing.publish`, with each engine's READY naming ``<engine>-inc-1``).
* :class:`Calls`: a listener for a product hook, with an event set once it was called ``count``
  times, so a test can act exactly while the code under test waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections import Counter
from collections import deque
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import httpx
import respx
from tenacity import wait_none

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.foundation.replay import RegistryRetry
from agentic_lora.leases import LeaseKeeper
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import Reservation
from agentic_lora.session import Versioning
from agentic_lora.testing import publish as verbs
from agentic_lora.testing.publish import digest_for

ENGINES = {"e0": "http://127.0.0.1:30000", "e1": "http://127.0.0.1:30001"}
GEN_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions")
BASE_MODEL = "Qwen/Qwen3-0.6B"


@dataclass
class Sent:
    """One request that reached a fake engine."""

    seq: int
    engine: str
    path: str
    body: dict[str, Any]
    content: bytes


@dataclass
class Hold:
    """A generation the fake engine keeps in flight until released."""

    rid: str | None
    engine: str
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    reply: asyncio.Future[httpx.Response] | None = None


class Clock:
    """A shared sequence counter, to order engine and registry events."""

    def __init__(self) -> None:
        self._ticks = itertools.count(1)

    def tick(self) -> int:
        return next(self._ticks)


def ok_body(path: str, body: dict[str, Any], *, finish: str = "stop") -> dict[str, Any]:
    """What SGLang answers on ``path`` (trimmed to the fields the tests read)."""
    rid = body.get("rid")
    if path == "/generate":
        return {
            "text": "ok",
            "output_ids": [1, 2],
            "meta_info": {"id": rid, "finish_reason": {"type": finish}},
        }
    return {
        "id": rid,
        "model": body.get("model"),
        "choices": [{"index": 0, "finish_reason": finish, "text": "ok"}],
    }


class FakeEngines:
    """respx-backed SGLang engines; see module docstring. ``actions`` script the next generations."""

    def __init__(self, mock: respx.MockRouter, clock: Clock) -> None:
        self.clock = clock
        self.sent: list[Sent] = []
        self.aborts: list[Sent] = []
        # Each generation pops one action: "ok", "hold", "lose", or an int HTTP status.
        self.actions: deque[str | int] = deque()
        self.holds: dict[str, Hold] = {}
        self.held: list[Hold] = []
        self._held_changed = asyncio.Event()
        self.server_info: dict[str, dict[str, Any]] = {}
        for name, url in ENGINES.items():
            for path in GEN_PATHS:
                mock.post(url + path).mock(side_effect=self._generation(name, path))
            mock.post(url + "/abort_request").mock(side_effect=self._abort(name))
            mock.get(url + "/get_server_info").mock(side_effect=self._info(name))

    def generations(self, *, path: str | None = None) -> list[Sent]:
        """Generation requests that reached an engine, in order."""
        return [s for s in self.sent if path is None or s.path == path]

    def _record(self, engine: str, path: str, request: httpx.Request) -> Sent:
        body = json.loads(request.content) if request.content else {}
        return Sent(self.clock.tick(), engine, path, body, request.content)

    def _generation(self, engine: str, path: str) -> Callable[[httpx.Request], Any]:
        async def handle(request: httpx.Request) -> httpx.Response:
            sent = self._record(engine, path, request)
            self.sent.append(sent)
            action = self.actions.popleft() if self.actions else "ok"
            if action == "lose":
                # The engine accepted the request; the reply never arrives.
                raise httpx.ReadTimeout("reply lost", request=request)
            if isinstance(action, int):
                return httpx.Response(action, json={"error": {"message": f"scripted {action}"}})
            if action == "hold":
                rid = sent.body.get("rid")
                hold = Hold(rid=rid, engine=engine)
                hold.reply = asyncio.get_running_loop().create_future()
                if rid is not None:
                    self.holds[rid] = hold
                self.held.append(hold)
                hold.entered.set()
                self._held_changed.set()
                return await hold.reply
            return httpx.Response(200, json=ok_body(path, sent.body))

        return handle

    def _abort(self, engine: str) -> Callable[[httpx.Request], Any]:
        def handle(request: httpx.Request) -> httpx.Response:
            sent = self._record(engine, "/abort_request", request)
            self.aborts.append(sent)
            rid = sent.body.get("rid")
            hold = self.holds.pop(rid, None) if rid is not None else None
            if (
                hold is not None
                and hold.engine == engine
                and hold.reply is not None
                and not hold.reply.done()
            ):
                hold.reply.set_result(
                    httpx.Response(200, json=ok_body("/generate", {"rid": rid}, finish="abort"))
                )
            return httpx.Response(200)

        return handle

    def _info(self, engine: str) -> Callable[[httpx.Request], Any]:
        def handle(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, json=self.server_info.get(engine, {}))

        return handle

    async def wait_held(self, count: int = 1) -> list[Hold]:
        """Wait until ``count`` held generations have reached an engine."""
        while len(self.held) < count:
            self._held_changed.clear()
            await self._held_changed.wait()
        return self.held[:count]

    def release(self, hold: Hold, status: int = 200) -> None:
        """Let a held generation answer normally."""
        assert hold.reply is not None
        if hold.rid is not None:
            self.holds.pop(hold.rid, None)
        hold.reply.set_result(httpx.Response(status, json=ok_body("/generate", {"rid": hold.rid})))


class RecordingRegistry:
    """The real LocalRegistry behind a recorder (counts, gates, scripted faults)."""

    def __init__(self, inner: LocalRegistry, clock: Clock | None = None) -> None:
        self.inner = inner
        self.clock = clock or Clock()
        self.calls: Counter[str] = Counter()
        self.log: list[tuple[int, str, dict[str, Any]]] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.entered: dict[str, asyncio.Event] = {}
        self.returned: dict[str, asyncio.Event] = {}
        self._seen: dict[str, asyncio.Event] = {}
        self.fail_before: Counter[str] = Counter()  # fail n calls before they run
        self.lose_reply: Counter[str] = Counter()  # run n calls, then lose the reply
        self._called = asyncio.Event()

    def gate(self, verb: str) -> asyncio.Event:
        """Hold every call of ``verb`` until the returned event is set."""
        self.gates[verb] = asyncio.Event()
        self.entered[verb] = asyncio.Event()
        return self.gates[verb]

    def seen(self, verb: str) -> asyncio.Event:
        """Set once ``verb`` has been called (before it runs)."""
        return self._seen.setdefault(verb, asyncio.Event())

    def request_ids(self, verb: str) -> list[str]:
        return [kw["request_id"] for _, v, kw in self.log if v == verb]

    async def called(self, verb: str, count: int = 1) -> None:
        """Return once ``verb`` has been called ``count`` times (counted before each runs)."""
        while self.calls[verb] < count:
            self._called.clear()
            await self._called.wait()

    async def _call(self, verb: str, **kwargs: Any) -> Any:
        self.calls[verb] += 1
        self.log.append((self.clock.tick(), verb, kwargs))
        self.seen(verb).set()
        self._called.set()
        if verb in self.entered:
            self.entered[verb].set()
        gate = self.gates.get(verb)
        if gate is not None:
            await gate.wait()
        if self.fail_before[verb] > 0:
            self.fail_before[verb] -= 1
            raise ConnectionError(f"registry unreachable during {verb}")
        result = await getattr(self.inner, verb)(**kwargs)
        self.returned.setdefault(verb, asyncio.Event()).set()
        if self.lose_reply[verb] > 0:
            self.lose_reply[verb] -= 1
            raise ConnectionError(f"reply of {verb} lost")
        return result

    def __getattr__(self, name: str) -> Any:
        # Verbs go through the recorder; sync reads (peek_version...) straight to the registry.
        if name in {
            "reserve", "record_ready", "observe_incarnation", "commit", "abort",
            "confirm_cleanup", "bind_first", "begin_close", "release", "forget_sessions",
            "claim_reclaim", "confirm_reclaim", "open_lease", "renew_lease", "close_lease",
            "open_named",
        }:  # fmt: skip

            async def verb(**kwargs: Any) -> Any:
                return await self._call(name, **kwargs)

            return verb
        if name == "close_session_now":
            # Its one synchronous step would pass the recorder by: Sessions behind it close
            # through the verbs (the one-step close has tests of its own, test_session_close_now).
            raise AttributeError(name)
        return getattr(self.inner, name)


digest_of = digest_for


def _incarnation(engine: str) -> str:
    return f"{engine}-inc-1"


async def stage(
    registry: Any, version_id: str, engines: tuple[str, ...] = ("e0", "e1")
) -> Reservation:
    """reserve ``version_id`` and record READY from ``engines`` (no commit)."""
    return await verbs.stage(registry, version_id, engines, incarnation=_incarnation)


async def ready(registry: Any, r: Reservation, engines: tuple[str, ...]) -> None:
    await verbs.ready_on(registry, r, engines, incarnation=_incarnation)


async def commit(registry: Any, r: Reservation) -> None:
    await verbs.commit_staged(registry, r)


async def publish(registry: Any, version_id: str) -> Reservation:
    """reserve -> READY on every engine -> commit."""
    return await verbs.publish_by_verbs(
        registry, version_id, tuple(ENGINES), incarnation=_incarnation
    )


@dataclass
class Harness:
    versioning: Versioning
    registry: RecordingRegistry
    engines: FakeEngines
    transport: EngineTransport
    clock: Clock
    inner: LocalRegistry  # the real registry behind the recorder, for reads the recorder hides
    lease: LeaseKeeper | None = None

    def refs(self, version_id: str) -> int:
        """How many Sessions the registry counts on ``version_id``."""
        status = self.inner.peek_version(version_id)
        assert status is not None
        return status.session_refs


def make_transport(kind: str = "httpx") -> EngineTransport:
    return EngineTransport(
        [EngineRef(n, u) for n, u in ENGINES.items()],
        http_transport=kind,  # type: ignore[arg-type]
        control_wait=wait_none(),
    )


@contextlib.asynccontextmanager
async def harness(
    *,
    enabled: bool = True,
    registry_options: Mapping[str, Any] | None = None,
    lease: Mapping[str, Any] | None = None,
    published: str | None = None,
    **versioning_options: Any,
) -> AsyncIterator[Harness]:
    """A real LocalRegistry and Versioning over respx-mocked engines.

    ``registry_options`` go to the LocalRegistry (e.g. an injected ``clock``); ``lease`` (keyword
    arguments of :class:`LeaseKeeper`) gives the Versioning an owner lease over the recorder;
    ``published`` is published (through the recorder) before the harness is handed out.
    """
    clock = Clock()
    inner = LocalRegistry(engines=tuple(ENGINES), capacity=2, **(registry_options or {}))
    registry = RecordingRegistry(inner, clock)
    keeper = LeaseKeeper(registry, **lease) if lease is not None else None  # type: ignore[arg-type]
    if keeper is not None:
        versioning_options["lease"] = keeper
    transport = make_transport()
    versioning_options.setdefault("registry_retry", RegistryRetry(attempts=4, wait=wait_none()))
    with respx.mock(using="httpx", assert_all_called=False) as mock:
        engines = FakeEngines(mock, clock)
        versioning = Versioning(
            transport=transport,
            registry=registry if enabled else None,
            enabled=enabled,
            base_model=BASE_MODEL,
            **versioning_options,
        )
        try:
            if published is not None:
                await publish(registry, published)
            yield Harness(versioning, registry, engines, transport, clock, inner, keeper)
        finally:
            for hold in engines.held:
                if hold.reply is not None and not hold.reply.done():
                    hold.reply.set_result(httpx.Response(200, json={}))
            with contextlib.suppress(Exception):
                await versioning.aclose()
            await transport.aclose()
            await inner.aclose()


class Calls:
    """A listener for a product hook: records every call, sets ``event`` at the ``count``-th.

    Append it to a hook (``versioning.on_drain_wait``, ``resolver.on_queued``) to act exactly
    while the code under test waits.
    """

    def __init__(self, count: int = 1) -> None:
        self.count = count
        self.calls: list[tuple[object, ...]] = []
        self.event = asyncio.Event()

    def __call__(self, *args: object) -> None:
        self.calls.append(args)
        if len(self.calls) >= self.count:
            self.event.set()

    async def wait(self) -> None:
        """Return once ``count`` calls arrived."""
        await self.event.wait()
