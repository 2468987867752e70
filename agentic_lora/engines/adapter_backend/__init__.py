"""Shared parts of backends that publish an immutable adapter directory over an engine's admin API.

* :class:`AdapterDirectoryBackend`: the prepare / cleanup / reclaim skeleton (store, fences,
  incarnation, serialization per name), with engine-specific hooks for the admin client, the
  restart fingerprint, the load, the probe and the wait before a reclaim's unload. The HTTP push
  (SGLang) and vLLM plugins are thin subclasses; a third-party plugin for another engine can be
  one too, and prove itself with :mod:`agentic_lora.testing.backend_conformance`.
* :data:`DrainHook`: the wait a backend whose engine unloads at once needs before unloading.
* :class:`AttemptFences`: which publication attempt of a name may still act on one engine.
* :class:`IncarnationTracker`: engine incarnations from a fingerprint and lost adapters.
"""

from agentic_lora.engines.adapter_backend.base import DEFAULT_KEEP_RECLAIMED
from agentic_lora.engines.adapter_backend.base import RECLAIMED_DIR
from agentic_lora.engines.adapter_backend.base import AdapterAdmin
from agentic_lora.engines.adapter_backend.base import AdapterDirectoryBackend
from agentic_lora.engines.adapter_backend.base import DrainHook
from agentic_lora.engines.adapter_backend.fences import AttemptFences
from agentic_lora.engines.adapter_backend.fences import Verdict
from agentic_lora.engines.adapter_backend.incarnation import IncarnationTracker

__all__ = [
    "DEFAULT_KEEP_RECLAIMED",
    "RECLAIMED_DIR",
    "AdapterAdmin",
    "AdapterDirectoryBackend",
    "AttemptFences",
    "DrainHook",
    "IncarnationTracker",
    "Verdict",
]
