"""The HTTP push backend plugin (entry point ``agentic_lora.backends: http-push``).

Writes each version as an immutable adapter directory and has SGLang load it over HTTP; see
:mod:`agentic_lora_http.backend`.
"""

from agentic_lora_http.backend import HttpPushBackend

__all__ = ["HttpPushBackend"]
