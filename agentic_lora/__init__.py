"""agentic-lora: immutable LoRA version publication, Session binding at first generation, and safe
reclaim for agentic RL rollouts.

The names here are the public API; everything else is reachable from its module. Importing this
package needs only pydantic, httpx and tenacity (no torch, no Ray).
"""

from agentic_lora import errors
from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.adapters.snapshot import TensorBlob
from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import AgenticLoRASettings
from agentic_lora.config import add_arguments
from agentic_lora.config import from_args
from agentic_lora.config import load_settings
from agentic_lora.engines.backends import Backend
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.backends import PublicationTarget
from agentic_lora.engines.routing import Router
from agentic_lora.errors import *  # noqa: F403  (every error is public: errors.__all__)
from agentic_lora.foundation.identity import VersionRef
from agentic_lora.foundation.replay import RegistryRetry
from agentic_lora.leases import LeaseKeeper
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.publication.publisher import PublicationResult
from agentic_lora.publication.publisher import Publisher
from agentic_lora.publication.reclaimer import Reclaimer
from agentic_lora.publication.reclaimer import ReclaimOutcome
from agentic_lora.publication.repair import Repairer
from agentic_lora.publication.resolver import Resolver
from agentic_lora.registry import Binding
from agentic_lora.registry import LocalRegistry
from agentic_lora.registry import ReadyReceipt
from agentic_lora.registry import RegistryAPI
from agentic_lora.registry import VersionState
from agentic_lora.registry import new_request_id
from agentic_lora.registry.provenance import TurnProvenance
from agentic_lora.session import Session
from agentic_lora.session import Versioning

__version__ = "0.1.0"

__all__ = [
    "AdapterSnapshot",
    "AgenticLoRASettings",
    "Backend",
    "Binding",
    "Deployment",
    "EngineRef",
    "LeaseKeeper",
    "LocalRegistry",
    "PublicationOutcome",
    "PublicationResult",
    "PublicationTarget",
    "Publisher",
    "ReadyReceipt",
    "ReclaimOutcome",
    "Reclaimer",
    "RegistryAPI",
    "RegistryRetry",
    "Repairer",
    "Resolver",
    "Router",
    "Session",
    "TensorBlob",
    "TurnProvenance",
    "VersionRef",
    "VersionState",
    "Versioning",
    "__version__",
    "add_arguments",
    "from_args",
    "load_settings",
    "new_request_id",
]
__all__ += errors.__all__  # one list of the public errors: errors.__all__
