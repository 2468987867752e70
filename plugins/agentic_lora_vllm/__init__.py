"""The vLLM backend plugin (entry point ``agentic_lora.backends: vllm``).

Writes each version as an immutable adapter directory and has vLLM register it at runtime over
HTTP; reclaim waits for a drain hook because vLLM's unload does not wait for in-flight requests.
See :mod:`agentic_lora_vllm.backend`.
"""

from agentic_lora_vllm.backend import DrainHook, VllmBackend

__all__ = ["DrainHook", "VllmBackend"]
