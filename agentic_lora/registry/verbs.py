"""Kept for callers written before :class:`~agentic_lora.registry.api.RegistryAPI` declared the
verbs itself: ``RegistryVerbs`` is that class under its old name."""

from __future__ import annotations

from agentic_lora.registry.api import RegistryAPI as RegistryVerbs

__all__ = ["RegistryVerbs"]
