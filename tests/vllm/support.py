"""What the real-vLLM scenario tests share beyond their fixtures."""

from __future__ import annotations

from typing import Any

from agentic_lora_harness.vllm_engines import VllmFleet

from agentic_lora.config import AgenticLoRASettings
from agentic_lora.config import load_settings


def vllm_settings(fleet: VllmFleet, lora_name_prefix: str, **values: Any) -> AgenticLoRASettings:
    """Versioned publication on the fleet's engines through the vLLM dialect and backend
    (capacity 2), naming adapters with ``lora_name_prefix``; ``values`` add or change settings."""
    return load_settings(
        enable_versioned_lora_publication=True,
        engines=[f"{name}={url}" for name, url in fleet.engines],
        capacity=2,
        base_model_name=fleet.fixture.served_model_name,
        lora_name_prefix=lora_name_prefix,
        engine_kind="vllm",
        backend="vllm",
        **values,
    )
