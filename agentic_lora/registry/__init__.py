"""The LoRA version registry: the single writer that decides versions, the default, Session
bindings, capacity and reclaim eligibility.

* :class:`RegistryCore`: the I/O-free state machine.
* :class:`LocalRegistry`: the core behind the async :class:`RegistryAPI`, optionally journaled.
* :mod:`agentic_lora.registry.ray_actor`: the same registry as a named, detached Ray actor.
"""

from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.core import RegistryCore
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import (
    Binding,
    CommitReceipt,
    EngineStatus,
    ReadyReceipt,
    ReclaimClaim,
    RegistryStatus,
    ReleaseResult,
    Reservation,
    ReserveOutcome,
    SessionState,
    SessionStatus,
    VersionKey,
    VersionState,
    VersionStatus,
    new_request_id,
)

__all__ = [
    "Binding",
    "CommitReceipt",
    "EngineStatus",
    "LocalRegistry",
    "ReadyReceipt",
    "ReclaimClaim",
    "RegistryAPI",
    "RegistryCore",
    "RegistryStatus",
    "ReleaseResult",
    "Reservation",
    "ReserveOutcome",
    "SessionState",
    "SessionStatus",
    "VersionKey",
    "VersionState",
    "VersionStatus",
    "new_request_id",
]
