"""agentic-lora: immutable LoRA version publication, Session binding at first generation, and safe
reclaim for agentic RL rollouts.

The names here are the public API; everything else is reachable from its module. Importing this
package needs only pydantic, httpx and tenacity (no torch, no Ray).
"""

from agentic_lora.adapters.snapshot import AdapterSnapshot, TensorBlob
from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import AgenticLoRASettings, add_arguments, from_args, load_settings
from agentic_lora.engines.backends import Backend, EngineRef, PublicationTarget
from agentic_lora.engines.routing import Router
from agentic_lora.errors import (
    AdapterMismatchError,
    AgenticLoRAError,
    BackendAmbiguousError,
    BackendError,
    BackendRefusedError,
    CapacityError,
    ConfigurationError,
    DispatchError,
    EngineRestartedError,
    InvalidAdapterError,
    InvalidIdentityError,
    InvalidRequestError,
    InvalidStateError,
    JournalCorruptError,
    JournalError,
    JournalForeignError,
    JournalLockedError,
    LeaseExpiredError,
    NoPublishedVersionError,
    NotReadyError,
    PublicationBlockedError,
    ReadyMismatchError,
    RegistryError,
    RequestIndeterminateError,
    RequestRefusedError,
    RevisionConflictError,
    SessionClosedError,
    SessionExpiredError,
    SessionReleaseError,
    SessionStateError,
    SessionStillBoundError,
    StaleAttemptError,
    UnknownEngineError,
    UnknownVersionError,
    VersionConflictError,
    VersionNotDispatchableError,
    VersionTooStaleError,
    VersionUnavailableError,
)
from agentic_lora.foundation.identity import VersionRef
from agentic_lora.leases import LeaseKeeper
from agentic_lora.publication.publisher import PublicationOutcome, PublicationResult, Publisher
from agentic_lora.publication.reclaimer import Reclaimer, ReclaimOutcome
from agentic_lora.publication.repair import Repairer
from agentic_lora.publication.resolver import Resolver
from agentic_lora.registry import (
    Binding,
    LocalRegistry,
    ReadyReceipt,
    RegistryAPI,
    VersionState,
    new_request_id,
)
from agentic_lora.registry.provenance import TurnProvenance
from agentic_lora.session import Session, Versioning

__version__ = "0.1.0"

__all__ = [
    "AdapterMismatchError",
    "AdapterSnapshot",
    "AgenticLoRAError",
    "AgenticLoRASettings",
    "Backend",
    "BackendAmbiguousError",
    "BackendError",
    "BackendRefusedError",
    "Binding",
    "CapacityError",
    "ConfigurationError",
    "Deployment",
    "DispatchError",
    "EngineRef",
    "EngineRestartedError",
    "InvalidAdapterError",
    "InvalidIdentityError",
    "InvalidRequestError",
    "InvalidStateError",
    "JournalCorruptError",
    "JournalError",
    "JournalForeignError",
    "JournalLockedError",
    "LeaseExpiredError",
    "LeaseKeeper",
    "LocalRegistry",
    "NoPublishedVersionError",
    "NotReadyError",
    "PublicationBlockedError",
    "PublicationOutcome",
    "PublicationResult",
    "PublicationTarget",
    "Publisher",
    "ReadyMismatchError",
    "ReadyReceipt",
    "ReclaimOutcome",
    "Reclaimer",
    "RegistryAPI",
    "RegistryError",
    "Repairer",
    "RequestIndeterminateError",
    "RequestRefusedError",
    "Resolver",
    "RevisionConflictError",
    "Router",
    "Session",
    "SessionClosedError",
    "SessionExpiredError",
    "SessionReleaseError",
    "SessionStateError",
    "SessionStillBoundError",
    "StaleAttemptError",
    "TensorBlob",
    "TurnProvenance",
    "UnknownEngineError",
    "UnknownVersionError",
    "VersionConflictError",
    "VersionNotDispatchableError",
    "VersionRef",
    "VersionState",
    "VersionTooStaleError",
    "VersionUnavailableError",
    "Versioning",
    "__version__",
    "add_arguments",
    "from_args",
    "load_settings",
    "new_request_id",
]
