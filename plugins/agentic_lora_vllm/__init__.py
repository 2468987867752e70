"""The vLLM plugin: the backend (entry point ``agentic_lora.backends: vllm``) and the engine
dialect (``agentic_lora.engines: vllm``, :mod:`agentic_lora_vllm.dialect`).

Writes each version as an immutable adapter directory and has vLLM register it at runtime over
HTTP; reclaim waits for a drain hook because vLLM's unload does not wait for in-flight requests.
See :mod:`agentic_lora_vllm.backend`.
"""

from agentic_lora_vllm.backend import DrainHook
from agentic_lora_vllm.backend import VllmBackend
from agentic_lora_vllm.dialect import VllmDialect

__all__ = ["DrainHook", "VllmBackend", "VllmDialect"]
