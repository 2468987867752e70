"""The LoRA version registry: the single writer that decides versions, the default, Session
bindings, capacity and reclaim eligibility.

* :class:`RegistryCore`: the I/O-free state machine.
* :class:`LocalRegistry`: the core behind the async :class:`RegistryAPI`, optionally journaled.
* :mod:`agentic_lora.registry.ray_actor`: the same registry as a named, detached Ray actor.

Every value the registry takes and returns (:mod:`agentic_lora.registry.types`) is importable
from here too.
"""

from agentic_lora.registry import types
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.core import RegistryCore
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import *  # noqa: F403  (the registry's values: types.__all__)

__all__ = ["LocalRegistry", "RegistryAPI", "RegistryCore"]
__all__ += types.__all__
