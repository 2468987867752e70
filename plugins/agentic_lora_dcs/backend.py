"""``DcsBackend``: the publisher side of the staged transfer (a :class:`~agentic_lora.engines.backends.Backend`).

Per engine, ``prepare`` runs one *driver* for the attempt: read the sidecar's incarnation, send
``begin`` with the fixed bucket plan, join the attempt's process group as rank 0, then for every
bucket in plan order send ``bucket`` and broadcast only when the sidecar answered ``ARMED`` and
this driver has not broadcast that index yet, then ``end`` and check the READY_LOCAL reply.

Exactly one driver exists per (engine, lora_name, attempt): a second ``prepare`` for the same
attempt (a reentrant publisher, a retry after a lost reply) awaits the first driver instead of
starting another, so a key is broadcast at most once by this process. The sidecar arms each key at
most once, so the two sides always agree on which collectives happen.

A control message whose reply was lost is asked again (``control_replays`` times, default once):
begin, bucket and end are idempotent on the sidecar, and the answer to the repeat tells the
driver whether the original was acted on. Generation requests are never repeated; this is the
control plane.

Outcomes follow the Backend contract: a clean refusal means the sidecar states it holds nothing of
the attempt (or the very first message never left this process); everything else that fails after
``begin`` may have left a stash or a load behind and is ambiguous.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import logging
import uuid
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Mapping
from typing import TypeVar

import httpx

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.backends import PublicationTarget
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendError
from agentic_lora.errors import BackendRefusedError
from agentic_lora.errors import ConfigurationError
from agentic_lora.foundation.auth import read_token
from agentic_lora.foundation.http_limits import engine_limits
from agentic_lora.foundation.identity import thaw_json
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora_dcs.attempts import AttemptState
from agentic_lora_dcs.client import NOT_SENT
from agentic_lora_dcs.client import SidecarClient
from agentic_lora_dcs.collective import SUPPORTED_BACKENDS
from agentic_lora_dcs.collective import AttemptGroup
from agentic_lora_dcs.collective import CollectiveCounter
from agentic_lora_dcs.collective import connect_store
from agentic_lora_dcs.collective import default_backend
from agentic_lora_dcs.plan import DEFAULT_BUCKET_BYTES
from agentic_lora_dcs.plan import BucketPlan
from agentic_lora_dcs.plan import plan_for_snapshot
from agentic_lora_dcs.protocol import PROTOCOL_VERSION
from agentic_lora_dcs.protocol import SIDECAR_TOKEN_ENV
from agentic_lora_dcs.protocol import BeginReply
from agentic_lora_dcs.protocol import BeginRequest
from agentic_lora_dcs.protocol import BucketRequest
from agentic_lora_dcs.protocol import BucketState
from agentic_lora_dcs.protocol import CleanupRequest
from agentic_lora_dcs.protocol import CollectiveName
from agentic_lora_dcs.protocol import EndRequest
from agentic_lora_dcs.protocol import ReadyReply
from agentic_lora_dcs.protocol import ReclaimRequest

__all__ = ["DcsBackend"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_DriverKey = tuple[str, str, int]


class DcsBackend:
    """Publishes adapters to engines through their receiver sidecars over torch.distributed.

    ``sidecars`` maps each engine name to its sidecar's base URL. ``bucket_bytes`` caps one
    collective; ``collective_backend`` is ``"gloo"`` or ``"nccl"`` (default: NCCL when CUDA is
    available); ``local_host`` is the interface this process's data plane binds to.
    """

    def __init__(
        self,
        sidecars: Mapping[str, str],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        collective_backend: str | None = None,
        local_host: str = "127.0.0.1",
        http_timeout: float = 30.0,
        end_timeout: float | None = 600.0,
        control_replays: int = 1,
        client: httpx.AsyncClient | None = None,
        sidecar_token: str | None = None,
        sidecar_token_file: str | None = None,
    ) -> None:
        if not sidecars:
            raise ConfigurationError("the DCS backend needs one sidecar URL per engine")
        if bucket_bytes < 1:
            raise ConfigurationError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if control_replays < 0:
            raise ConfigurationError(f"control_replays must be >= 0, got {control_replays}")
        backend = collective_backend or default_backend()
        if backend not in ("gloo", "nccl") or backend not in SUPPORTED_BACKENDS:
            raise ConfigurationError(
                f"collective backend {backend!r} is not available here "
                f"(available: {SUPPORTED_BACKENDS})"
            )
        token = sidecar_token or read_token(
            path=sidecar_token_file, env=SIDECAR_TOKEN_ENV, what="sidecar"
        )
        if not token:
            raise ConfigurationError(
                "the DCS backend needs the sidecars' control token: sidecar_token, "
                f"sidecar_token_file or ${SIDECAR_TOKEN_ENV}",
                check="sidecar_token",
            )
        self.bucket_bytes = bucket_bytes
        self.collective_backend: CollectiveName = "nccl" if backend == "nccl" else "gloo"
        self.local_host = local_host
        self.control_replays = control_replays
        #: Collectives this process entered, per (lora_name, attempt).
        self.collectives = CollectiveCounter()
        self._owns_client = client is None
        self._http = client or httpx.AsyncClient(
            timeout=httpx.Timeout(http_timeout),
            limits=engine_limits(),
            trust_env=False,  # no environment proxy between the control plane and a sidecar
            follow_redirects=False,
        )
        self._sidecars = {
            name: SidecarClient(
                url, engine=name, client=self._http, end_timeout=end_timeout, token=token
            )
            for name, url in sidecars.items()
        }
        self._drivers: dict[_DriverKey, asyncio.Task[ReadyReceipt]] = {}

    def _sidecar(self, engine: EngineRef) -> SidecarClient:
        try:
            return self._sidecars[engine.name]
        except KeyError:
            raise ConfigurationError(
                f"no DCS sidecar configured for engine {engine.name!r}",
                engine=engine.name,
                configured=sorted(self._sidecars),
            ) from None

    # --- Backend protocol -----------------------------------------------------------------------

    async def incarnation(self, engine: EngineRef) -> str:
        """The sidecar-plus-engine incarnation (changes when either process restarts)."""
        return (await self._sidecar(engine).incarnation()).incarnation

    async def prepare(
        self, engine: EngineRef, target: PublicationTarget, snapshot: AdapterSnapshot
    ) -> ReadyReceipt:
        """Stage ``snapshot`` on ``engine`` and return its READY receipt (one driver per attempt)."""
        if snapshot.digest != target.digest:
            raise BackendRefusedError(
                f"snapshot digest {snapshot.digest[:16]} is not the target's {target.digest[:16]}",
                engine=engine.name,
                reason="SNAPSHOT_MISMATCH",
            )
        key = (engine.name, target.lora_name, target.attempt)
        task = self._drivers.get(key)
        if task is None:
            task = asyncio.create_task(self._drive(engine, target, snapshot))
            task.add_done_callback(functools.partial(self._driver_done, key))
            self._drivers[key] = task
        else:
            logger.info(
                "prepare joins the running driver of %s attempt %d",
                target.lora_name,
                target.attempt,
                extra=_extra(engine, target),
            )
        # Shielded: a cancelled caller never cancels a transfer half-way.
        return await asyncio.shield(task)

    def _driver_done(self, key: _DriverKey, task: asyncio.Task[ReadyReceipt]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved: the awaiting callers got it
        # Only a running driver is shared. A later prepare of the same attempt starts a new
        # driver, which the sidecar answers from its record (READY again, no second load) or
        # lets take the attempt over when nothing of it is held.
        if self._drivers.get(key) is task:
            del self._drivers[key]

    async def cleanup(self, engine: EngineRef, target: PublicationTarget) -> None:
        """Drop everything of this attempt on the sidecar (stale attempts are fenced there)."""
        client = self._sidecar(engine)
        try:
            reply = await client.cleanup(
                CleanupRequest(lora_name=target.lora_name, attempt=target.attempt)
            )
        except (BackendRefusedError, BackendAmbiguousError) as exc:
            what = f"cleanup of {target.lora_name} attempt {target.attempt}"
            raise _not_confirmed(what, engine, exc) from exc
        logger.info(
            "cleanup %s attempt %d on %s: %s",
            target.lora_name,
            target.attempt,
            engine.name,
            reply.outcome,
            extra=_extra(engine, target),
        )

    async def reclaim(self, engine: EngineRef, *, lora_name: str, reclaim_id: str) -> None:
        """Unload ``lora_name`` once its in-flight requests finished (idempotent per name)."""
        client = self._sidecar(engine)
        try:
            reply = await client.reclaim(ReclaimRequest(lora_name=lora_name, reclaim_id=reclaim_id))
        except (BackendRefusedError, BackendAmbiguousError) as exc:
            raise _not_confirmed(f"reclaim of {lora_name}", engine, exc) from exc
        logger.info(
            "reclaim %s on %s: %s",
            lora_name,
            engine.name,
            reply.outcome,
            extra={"engine": engine.name, "version": lora_name},
        )

    async def aclose(self) -> None:
        """Stop waiting for running drivers and close the HTTP client if this backend made it."""
        running = [t for t in self._drivers.values() if not t.done()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
        self._drivers.clear()
        if self._owns_client:
            await self._http.aclose()

    # --- the driver -----------------------------------------------------------------------------

    async def _drive(
        self, engine: EngineRef, target: PublicationTarget, snapshot: AdapterSnapshot
    ) -> ReadyReceipt:
        client = self._sidecar(engine)
        extra = _extra(engine, target)
        incarnation = (await client.incarnation()).incarnation
        plan = await asyncio.to_thread(plan_for_snapshot, snapshot, self.bucket_bytes)
        begin = BeginRequest(
            driver=uuid.uuid4().hex,
            lora_name=target.lora_name,
            attempt=target.attempt,
            version_id=target.version_id,
            digest=target.digest,
            incarnation=incarnation,
            config=thaw_json(snapshot.config),
            plan=plan,
            backend=self.collective_backend,
            protocol=PROTOCOL_VERSION,
        )
        # Until the sidecar acknowledged Begin, a message that never left here left nothing.
        began = await self._ask(functools.partial(client.begin, begin), extra, first=True)
        if began.state == AttemptState.PREPARED:
            group = await self._join(began, target, extra)
            try:
                await self._send_buckets(client, group, plan, snapshot, target, incarnation, extra)
            finally:
                group.close()
        elif began.state not in _PAST_TRANSFER:
            raise BackendAmbiguousError(
                f"Begin answered with state {began.state!r}",
                reason="PROTOCOL_MISMATCH",
                **extra,
            )
        # else: an earlier driver moved the bytes; End answers for the load (no second one).
        end = EndRequest(
            lora_name=target.lora_name, attempt=target.attempt, incarnation=incarnation
        )
        ready = await self._ask(functools.partial(client.end, end), extra, first=False)
        return self._receipt(engine, target, incarnation, ready)

    async def _join(
        self, began: BeginReply, target: PublicationTarget, extra: dict[str, object]
    ) -> AttemptGroup:
        rv = began.rendezvous
        timeout = datetime.timedelta(seconds=rv.timeout_s)

        def join() -> AttemptGroup:
            store = connect_store(rv.host, rv.port, timeout=timeout)
            return AttemptGroup.join(
                store=store,
                prefix=rv.prefix,
                rank=0,
                backend=self.collective_backend,
                local_host=self.local_host,
                timeout=timeout,
                label=(target.lora_name, target.attempt),
                counter=self.collectives,
            )

        try:
            return await asyncio.to_thread(join)
        except Exception as exc:
            raise BackendAmbiguousError(
                f"joining the process group of {target.lora_name} attempt {target.attempt} "
                f"failed: {exc!r}",
                reason="TRANSPORT_FAILED",
                **extra,
            ) from exc

    async def _send_buckets(
        self,
        client: SidecarClient,
        group: AttemptGroup,
        plan: BucketPlan,
        snapshot: AdapterSnapshot,
        target: PublicationTarget,
        incarnation: str,
        extra: dict[str, object],
    ) -> None:
        tensors = {blob.name: blob.data for blob in snapshot.tensors}
        # This driver's half of the collective contract: one pass over the plan, one broadcast at
        # most per index, and a failed broadcast ends the attempt (it is never sent again).
        for bucket in plan.buckets:
            message = BucketRequest(
                lora_name=target.lora_name,
                attempt=target.attempt,
                incarnation=incarnation,
                index=bucket.index,
            )
            reply = await self._ask(functools.partial(client.bucket, message), extra, first=False)
            if reply.state is BucketState.RECEIVED:
                # The sidecar says it already holds these bytes: there is no receiver waiting,
                # so a broadcast now could only hang. Nothing to send.
                continue
            data = plan.pack(bucket.index, tensors)
            try:
                await asyncio.to_thread(group.send, data)
            except Exception as exc:
                raise BackendAmbiguousError(
                    f"broadcast of bucket {bucket.index} failed: {exc!r}",
                    reason="TRANSPORT_FAILED",
                    bucket=bucket.index,
                    **extra,
                ) from exc

    async def _ask(
        self, send: Callable[[], Awaitable[_T]], extra: dict[str, object], *, first: bool
    ) -> _T:
        """One control message, asked again only when its reply was lost (it is idempotent)."""
        for replay in range(self.control_replays + 1):
            try:
                return await send()
            except BackendRefusedError as exc:
                if exc.details.get("reason") == NOT_SENT and not first:
                    # This message did nothing, but earlier ones of the attempt did.
                    raise BackendAmbiguousError(
                        exc.message, **{**exc.details, "reason": "UNREACHABLE_MID_ATTEMPT"}
                    ) from exc
                raise
            except BackendAmbiguousError as exc:
                if exc.details.get("reason") not in _LOST_REPLY or replay == self.control_replays:
                    raise
                logger.warning(
                    "control reply lost (%s); asking again (%d of %d)",
                    exc.message,
                    replay + 1,
                    self.control_replays,
                    extra=extra,
                )
        raise AssertionError("unreachable")  # pragma: no cover

    def _receipt(
        self, engine: EngineRef, target: PublicationTarget, incarnation: str, ready: ReadyReply
    ) -> ReadyReceipt:
        expected = (target.lora_name, target.attempt, target.version_id, target.digest, incarnation)
        got = (ready.lora_name, ready.attempt, ready.version_id, ready.digest, ready.incarnation)
        if got != expected:
            raise BackendAmbiguousError(
                f"READY for {got} does not match the attempt {expected}",
                engine=engine.name,
                reason="READY_MISMATCH",
            )
        logger.info(
            "READY %s attempt %d on %s (%d collectives)",
            target.lora_name,
            target.attempt,
            engine.name,
            self.collectives.of(target.lora_name, target.attempt),
            extra=_extra(engine, target),
        )
        return ReadyReceipt(engine=engine.name, ref=target, incarnation=ready.incarnation)


# Transport failures after the request was sent: the sidecar may have acted, the reply is gone.
_LOST_REPLY = frozenset(
    {"ReadError", "ReadTimeout", "RemoteProtocolError", "WriteError", "WriteTimeout"}
)


_PAST_TRANSFER = frozenset(
    {str(AttemptState.LOADING), str(AttemptState.READY), str(AttemptState.UNCERTAIN)}
)


def _extra(engine: EngineRef, target: PublicationTarget) -> dict[str, object]:
    return {"engine": engine.name, "version": target.lora_name, "attempt": target.attempt}


def _not_confirmed(what: str, engine: EngineRef, exc: BackendError) -> BackendAmbiguousError:
    """A cleanup or reclaim the sidecar did not confirm proves nothing about what the engine holds."""
    return BackendAmbiguousError(
        f"{what} on {engine.name} not confirmed: {exc.message}",
        engine=engine.name,
        reason=exc.details.get("reason", "UNKNOWN"),
    )
