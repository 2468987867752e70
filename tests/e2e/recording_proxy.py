"""A loopback HTTP proxy that records every exchange between the middleware and one engine.

The end-to-end tests point the whole product (Session transport, publisher, reclaimer, HTTP push
backend) at one :class:`RecordingProxy` per engine instead of at the engine itself. Every request
is forwarded once, unchanged, and recorded as an :class:`Exchange` on a :class:`TrafficLog` that
all proxies of a test share, so the tests can assert on what really went over the wire:

* which paths were called, in which order, with which ``lora_path`` / ``lora_name``;
* that nothing at all reached an engine in a window (``log.since(mark)``);
* that no ``/pause_generation``, ``/flush_cache`` or abort-all was ever sent;
* when an exchange started and when its reply came back, on one clock for every engine and for
  the test's own marks (``log.mark(...)``), so "the unload returned after the request ended" is
  an ordering of two ticks, not a timing.

A test can also script the outer edge (:class:`Rule`): answer one matching request itself
without forwarding it (the engine never sees it), or rewrite its body before forwarding it. That
is how a refused generation or an engine that refuses a load are produced without mocks.

The proxy never retries and never resends: one incoming request is at most one upstream request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Generic
from typing import Self
from typing import TypeVar

import aiohttp
from aiohttp import web

from agentic_lora.foundation.http_limits import ENGINE_KEEPALIVE_EXPIRY

__all__ = [
    "FORBIDDEN_DURING_PUBLICATION",
    "Exchange",
    "Mark",
    "RecordingProxy",
    "Rule",
    "TrafficLog",
    "Waiters",
    "forbidden_exchanges",
]

T = TypeVar("T")

#: Paths that stop or reset every request on an engine; a publication must never send them.
FORBIDDEN_DURING_PUBLICATION: frozenset[str] = frozenset(
    {"/pause_generation", "/continue_generation", "/flush_cache", "/release_memory_occupation"}
)

#: How long a test waits for something the system must do before it calls the run broken. A
#: liveness guard only: no test asserts on how long anything took.
WAIT_GUARD_SECONDS = 120.0


class Waiters(Generic[T]):
    """Items published over time, and futures for "the first item that satisfies P"."""

    def __init__(self) -> None:
        self._items: list[T] = []
        self._waiting: list[tuple[Callable[[T], bool], asyncio.Future[T]]] = []

    def publish(self, item: T) -> None:
        """Record ``item`` and wake every waiter whose predicate it satisfies."""
        self._items.append(item)
        still: list[tuple[Callable[[T], bool], asyncio.Future[T]]] = []
        for predicate, future in self._waiting:
            if future.done():
                continue
            if predicate(item):
                future.set_result(item)
            else:
                still.append((predicate, future))
        self._waiting = still

    async def wait_for(self, predicate: Callable[[T], bool], *, what: str) -> T:
        """The first item (already published or future) for which ``predicate`` holds."""
        for item in self._items:
            if predicate(item):
                return item
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiting.append((predicate, future))
        try:
            async with asyncio.timeout(WAIT_GUARD_SECONDS):
                return await future
        except TimeoutError:
            raise AssertionError(f"never happened: {what}") from None


@dataclass(eq=False)
class Exchange:
    """One request that reached a proxy, and (once it has) its reply."""

    engine: str
    method: str
    path: str
    body: Any
    seq_sent: int
    forwarded: bool = False
    rule: str | None = None  # the label of the Rule that answered or rewrote it
    sent_body: Any = None  # what went upstream when a rule rewrote the body
    status: int | None = None
    reply: Any = None
    seq_done: int | None = None

    @property
    def done(self) -> bool:
        """The reply went back to the caller."""
        return self.seq_done is not None

    def field(self, name: str) -> Any:
        """A top-level field of the JSON request body (None if absent or not JSON)."""
        return self.body.get(name) if isinstance(self.body, Mapping) else None

    @property
    def lora(self) -> str | None:
        """The adapter the request names (``lora_path`` of a generation, ``lora_name`` of a load)."""
        value = self.field("lora_name") or self.field("lora_path")
        return value if isinstance(value, str) else None

    @property
    def is_generation(self) -> bool:
        return self.method == "POST" and self.path == "/generate"

    def __repr__(self) -> str:
        return (
            f"Exchange({self.engine} {self.method} {self.path} lora={self.lora!r} "
            f"rid={self.field('rid')!r} status={self.status} sent={self.seq_sent} "
            f"done={self.seq_done} forwarded={self.forwarded} rule={self.rule!r})"
        )


@dataclass(frozen=True)
class Mark:
    """A point the test itself put on the traffic clock."""

    label: str
    seq: int


@dataclass
class Rule:
    """Script the outer edge for the next ``times`` requests that match.

    Exactly one of ``answer`` (reply with this status and JSON body; nothing is forwarded) or
    ``rewrite`` (forward this body instead) is set.
    """

    label: str
    matches: Callable[[Exchange], bool]
    answer: tuple[int, Mapping[str, Any]] | None = None
    rewrite: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    times: int = 1
    applied: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if (self.answer is None) == (self.rewrite is None):
            raise ValueError("a rule either answers or rewrites")


class TrafficLog:
    """Every exchange through the proxies of one test, and the test's marks, on one clock."""

    def __init__(self) -> None:
        self._seq = 0
        self.exchanges: list[Exchange] = []
        self.marks: list[Mark] = []
        self.events: Waiters[Exchange] = Waiters()

    def tick(self) -> int:
        """The next point on the clock."""
        self._seq += 1
        return self._seq

    def mark(self, label: str) -> int:
        """Put a named point on the clock; returns its sequence number."""
        mark = Mark(label, self.tick())
        self.marks.append(mark)
        return mark.seq

    def since(self, seq: int) -> list[Exchange]:
        """Exchanges that started after clock point ``seq``."""
        return [e for e in self.exchanges if e.seq_sent > seq]

    def select(
        self,
        *,
        engine: str | None = None,
        path: str | None = None,
        lora: str | None = None,
        rid: str | None = None,
    ) -> list[Exchange]:
        """Exchanges matching every given criterion, in the order they started."""
        return [
            e
            for e in self.exchanges
            if (engine is None or e.engine == engine)
            and (path is None or e.path == path)
            and (lora is None or e.lora == lora)
            and (rid is None or e.field("rid") == rid)
        ]

    async def wait_for(self, predicate: Callable[[Exchange], bool], *, what: str) -> Exchange:
        """The first exchange (started or finished, as the predicate decides) matching it."""
        return await self.events.wait_for(predicate, what=what)

    def _started(self, exchange: Exchange) -> None:
        self.exchanges.append(exchange)
        self.events.publish(exchange)

    def _finished(self, exchange: Exchange) -> None:
        exchange.seq_done = self.tick()
        self.events.publish(exchange)


def forbidden_exchanges(exchanges: list[Exchange]) -> list[Exchange]:
    """Exchanges that pause, flush or abort everything on an engine.

    ``/abort_request`` is allowed only for one named request (a Session aborting its own
    generation); ``abort_all`` or an empty ``rid`` would end every Session's requests.
    """
    bad: list[Exchange] = []
    for e in exchanges:
        if e.path in FORBIDDEN_DURING_PUBLICATION or (
            e.path == "/abort_request" and (e.field("abort_all") or not e.field("rid"))
        ):
            bad.append(e)
    return bad


def _decode(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


class RecordingProxy:
    """Forwards ``127.0.0.1:<port>`` to one engine's base URL, recording on ``log``.

    Upstream idle connections are dropped at
    :data:`~agentic_lora.foundation.http_limits.ENGINE_KEEPALIVE_EXPIRY`, below the engine's keep-alive, like
    every engine client of the product (a longer one would lose requests to the keep-alive race
    and blame the product for it). A request whose upstream was unreachable or lost is answered,
    and recorded, with status 502 (and listed in ``upstream_failures`` with the reason).
    """

    def __init__(self, engine: str, upstream: str, log: TrafficLog) -> None:
        self.engine = engine
        self.upstream = upstream.rstrip("/")
        self.log = log
        #: The port listened on (0 before the first start: a free one is picked).
        self.port = 0
        self.rules: list[Rule] = []
        #: Requests answered 502 because the upstream was unreachable or lost (with the reason).
        self.upstream_failures: list[tuple[Exchange, str]] = []
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._client: aiohttp.ClientSession | None = None

    @property
    def base_url(self) -> str:
        """Where the product under test should send this engine's traffic."""
        if not self.port:
            raise RuntimeError("the proxy is not started")
        return f"http://127.0.0.1:{self.port}"

    def add_rule(self, rule: Rule) -> Rule:
        """Script the next matching request(s) (see :class:`Rule`)."""
        self.rules.append(rule)
        return rule

    async def start(self) -> Self:
        """Listen on a free loopback port."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        self._client = self._new_client()
        await self._listen()
        return self

    async def aclose(self) -> None:
        """Stop listening and close the upstream client."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def exchanges(self) -> list[Exchange]:
        """Every exchange this proxy's engine received (from the shared log)."""
        return [e for e in self.log.exchanges if e.engine == self.engine]

    @staticmethod
    def _new_client() -> aiohttp.ClientSession:
        # No total timeout: an unload legitimately waits for the engine's requests to drain.
        return aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None),
            connector=aiohttp.TCPConnector(keepalive_timeout=ENGINE_KEEPALIVE_EXPIRY),
        )

    async def _listen(self) -> None:
        assert self._runner is not None
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self._site = site
        if not self.port:
            self.port = int(self._runner.addresses[0][1])

    def _rule_for(self, exchange: Exchange) -> Rule | None:
        for rule in self.rules:
            if rule.applied < rule.times and rule.matches(exchange):
                rule.applied += 1
                return rule
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        exchange = Exchange(
            engine=self.engine,
            method=request.method,
            path=request.path,
            body=_decode(raw),
            seq_sent=self.log.tick(),
        )
        self.log._started(exchange)
        try:
            rule = self._rule_for(exchange)
            if rule is not None:
                exchange.rule = rule.label
                if rule.answer is not None:
                    status, payload = rule.answer
                    exchange.status, exchange.reply = status, dict(payload)
                    return web.json_response(dict(payload), status=status)
                assert rule.rewrite is not None
                assert isinstance(exchange.body, Mapping)
                exchange.sent_body = dict(rule.rewrite(exchange.body))
                raw = json.dumps(exchange.sent_body).encode()
            return await self._forward(request, exchange, raw)
        finally:
            self.log._finished(exchange)

    async def _forward(
        self, request: web.Request, exchange: Exchange, raw: bytes
    ) -> web.StreamResponse:
        client = self._client
        assert client is not None
        headers = {"Content-Type": request.content_type} if request.content_type else {}
        exchange.forwarded = True
        try:
            async with client.request(
                request.method,
                self.upstream + request.path_qs,
                data=raw or None,
                headers=headers,
                allow_redirects=False,
            ) as upstream:
                body = await upstream.read()
                exchange.status = upstream.status
                exchange.reply = _decode(body)
                response = web.Response(status=upstream.status, body=body)
                with contextlib.suppress(KeyError):
                    response.headers["Content-Type"] = upstream.headers["Content-Type"]
                return response
        except aiohttp.ClientError as exc:
            # The engine died under this request (or was unreachable): the caller must treat it as
            # possibly run, like a reset connection. Never resent.
            reason = f"{type(exc).__name__}: {exc}"
            self.upstream_failures.append((exchange, reason))
            exchange.status = 502
            exchange.reply = {"proxy": "upstream lost", "reason": reason}
            return web.json_response(exchange.reply, status=502)
