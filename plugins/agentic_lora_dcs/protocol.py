"""The control protocol between the publisher and a receiver sidecar (JSON over HTTP).

One attempt is ``begin`` -> ``bucket`` x N -> ``end``; ``cleanup`` and ``reclaim`` stand alone and
``GET /incarnation`` names the sidecar-plus-engine pair a message is meant for.

The collective contract: a ``bucket`` message *arms* the receiver for the collective keyed by
(lora_name, attempt, index) and the publisher broadcasts only after it read ``ARMED``. The
receiver arms a key at most once, and the publisher's driver broadcasts a key at most once, so a
duplicated or replayed control message can never drive a second broadcast on either side. Every
driver of every attempt rendezvouses in its own process group (store prefix
``<lora_name>/<attempt>/<driver>``), so a receive left pending by a superseded attempt or driver
can never pair with a newer one's broadcast.

Every refusal carries a stable ``reason`` and ``clean``: ``clean=True`` means the sidecar holds
nothing of that attempt and loaded nothing into its engine (the publisher may treat it as a clean
refusal); ``clean=False`` means resources may exist (ambiguous; needs a cleanup).
"""

from __future__ import annotations

import enum
from typing import Any
from typing import Literal

from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field

from agentic_lora_dcs.plan import BucketPlan

__all__ = [
    "PATHS",
    "PROTOCOL_VERSION",
    "SIDECAR_TOKEN_ENV",
    "AttemptView",
    "BeginReply",
    "BeginRequest",
    "BucketReply",
    "BucketRequest",
    "BucketState",
    "CleanupOutcome",
    "CleanupReply",
    "CleanupRequest",
    "CollectiveName",
    "EndRequest",
    "IncarnationReply",
    "ReadyReply",
    "Reason",
    "ReclaimOutcome",
    "ReclaimReply",
    "ReclaimRequest",
    "RefusalReply",
    "Rendezvous",
    "StatusReply",
]

PROTOCOL_VERSION = 1

#: Where a sidecar and the DCS backend read the shared control token from (else a token file).
SIDECAR_TOKEN_ENV = "AGENTIC_LORA_SIDECAR_TOKEN"

PATHS = {
    "incarnation": "/incarnation",
    "begin": "/begin",
    "bucket": "/bucket",
    "end": "/end",
    "cleanup": "/cleanup",
    "reclaim": "/reclaim",
    "status": "/status",
    "health": "/health",
}

_NAME = r"^[A-Za-z0-9._@-]{1,200}$"

CollectiveName = Literal["gloo", "nccl"]


class Reason(enum.StrEnum):
    """Why the sidecar refused a message (stable, safe to match on)."""

    # clean: the sidecar holds nothing of the attempt the message named
    STALE_ATTEMPT = "STALE_ATTEMPT"  # a newer attempt of this name exists
    FENCED = "FENCED"  # this attempt was cleaned up (possibly before its begin arrived)
    RECLAIMED = "RECLAIMED"  # the name was reclaimed; it never comes back
    UNKNOWN_ATTEMPT = "UNKNOWN_ATTEMPT"  # no begin was accepted for this attempt
    ATTEMPT_CONFLICT = "ATTEMPT_CONFLICT"  # same attempt, different identity or plan
    STALE_DRIVER = "STALE_DRIVER"  # a newer driver took this attempt over
    ATTEMPT_ACTIVE = "ATTEMPT_ACTIVE"  # an older attempt still holds the engine; clean it first
    ATTEMPT_FAILED = "ATTEMPT_FAILED"  # this attempt already failed (root cause unrecorded)
    BAD_PLAN = "BAD_PLAN"  # the plan is not the canonical packing of its manifest
    MANIFEST_MISMATCH = "MANIFEST_MISMATCH"  # manifest/config do not hash to the digest
    CHECKSUM_MISMATCH = "CHECKSUM_MISMATCH"  # received bytes differ from the manifest
    BAD_BUCKET = "BAD_BUCKET"  # index outside the plan
    OUT_OF_ORDER = "OUT_OF_ORDER"  # bucket index skips ahead of the plan order
    INCOMPLETE = "INCOMPLETE"  # end before every bucket was sent
    INCARNATION_MISMATCH = "INCARNATION_MISMATCH"  # message meant for another incarnation
    ENGINE_RESTARTED = "ENGINE_RESTARTED"  # engine restarted before anything was loaded
    ENGINE_REFUSED = "ENGINE_REFUSED"  # the engine refused the load; nothing loaded
    ENGINE_UNAVAILABLE = "ENGINE_UNAVAILABLE"  # its incarnation could not be read; nothing done
    PROTOCOL_MISMATCH = "PROTOCOL_MISMATCH"
    BAD_REQUEST = "BAD_REQUEST"
    UNSUPPORTED_BACKEND = "UNSUPPORTED_BACKEND"
    UNAUTHORIZED = "UNAUTHORIZED"  # no or wrong control token; nothing was done
    # not clean: something may exist
    TRANSPORT_FAILED = "TRANSPORT_FAILED"  # a collective failed after the attempt was armed
    ENGINE_UNCERTAIN = "ENGINE_UNCERTAIN"  # the engine's answer to load/unload is unknown
    INTERNAL = "INTERNAL"


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _AttemptMsg(_Msg):
    lora_name: str = Field(pattern=_NAME)
    attempt: int = Field(ge=1)


class Rendezvous(_Msg):
    """Where the publisher joins the attempt's process group (rank 0 sends, rank 1 receives)."""

    host: str
    port: int = Field(ge=1, le=65535)
    prefix: str
    world_size: Literal[2] = 2
    timeout_s: float = Field(gt=0)


class IncarnationReply(_Msg):
    """``incarnation`` changes when either the sidecar or its engine restarts."""

    incarnation: str
    sidecar_id: str
    engine_incarnation: str
    protocol: int
    backends: tuple[str, ...]


class BeginRequest(_AttemptMsg):
    """Fixes the attempt: identity, incarnation, config, plan, and the driver that owns it.

    ``driver`` is minted once per publisher-side driver run. The same driver repeating its
    Begin gets the same answer; a new driver takes the attempt over (see the ledger).
    """

    driver: str = Field(pattern=r"^[0-9a-f]{8,64}$")
    version_id: str = Field(min_length=1)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    incarnation: str
    config: dict[str, Any]
    plan: BucketPlan
    backend: CollectiveName
    protocol: int = PROTOCOL_VERSION


class BeginReply(_AttemptMsg):
    """``state`` PREPARED: join ``rendezvous`` and send the buckets; LOADING, READY or
    UNCERTAIN: the transfer is over, go straight to End."""

    state: str
    duplicate: bool
    rendezvous: Rendezvous


class BucketState(enum.StrEnum):
    ARMED = "ARMED"  # the receiver joined (or is joining) the collective for this key
    RECEIVED = "RECEIVED"  # bytes arrived and matched every tensor checksum


class BucketRequest(_AttemptMsg):
    incarnation: str
    index: int = Field(ge=0)


class BucketReply(_AttemptMsg):
    index: int
    state: BucketState
    duplicate: bool


class EndRequest(_AttemptMsg):
    incarnation: str


class ReadyReply(_AttemptMsg):
    """READY_LOCAL: the engine holds exactly this version, pinned, for this attempt."""

    version_id: str
    digest: str
    incarnation: str
    lora_path: str
    duplicate: bool


class CleanupOutcome(enum.StrEnum):
    CLEANED = "CLEANED"  # this attempt's resources were dropped now
    ALREADY_CLEAN = "ALREADY_CLEAN"  # it held nothing (failed, or cleaned earlier)
    FENCED = "FENCED"  # never begun here: a fence now refuses its late begin


class CleanupRequest(_AttemptMsg):
    pass


class CleanupReply(_AttemptMsg):
    outcome: CleanupOutcome


class ReclaimOutcome(enum.StrEnum):
    UNLOADED = "UNLOADED"  # unloaded now (after the engine's in-flight requests drained)
    ALREADY_UNLOADED = "ALREADY_UNLOADED"  # an earlier reclaim of this name did it
    ABSENT = "ABSENT"  # the engine did not hold the name


class ReclaimRequest(_Msg):
    lora_name: str = Field(pattern=_NAME)
    reclaim_id: str = Field(min_length=1)


class ReclaimReply(_Msg):
    lora_name: str
    reclaim_id: str
    outcome: ReclaimOutcome


class RefusalReply(_Msg):
    """Every non-2xx answer of the sidecar."""

    reason: Reason
    message: str
    clean: bool
    details: dict[str, Any] = Field(default_factory=dict)


class AttemptView(_Msg):
    lora_name: str
    attempt: int
    state: str
    buckets_armed: int
    buckets_received: int
    collectives: int
    drivers: int


class StatusReply(_Msg):
    """Introspection: every attempt record and the collective count per attempt."""

    sidecar_id: str
    collectives_total: int
    attempts: tuple[AttemptView, ...]
    reclaimed: tuple[str, ...]
