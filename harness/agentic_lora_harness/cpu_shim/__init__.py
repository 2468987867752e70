"""Test-harness compatibility shim for running SGLang on a CPU-only machine (CPU only).

This is not part of agentic-lora. SGLang 0.5.23's ``--device cpu`` path, as used by the test
harness, assumes two things only a GPU build provides:

* rotary embeddings fall back to ``vllm._custom_ops.rotary_embedding`` (vLLM is not installed in
  the engine venv), and
* the LoRA layers allocate host tensors with ``pin_memory=True`` or call ``Tensor.pin_memory()``,
  which raises when no accelerator is present.

:data:`SITE_DIR` holds a ``sitecustomize.py`` that the engine launcher puts on the engine's
``PYTHONPATH`` only when the engine venv reports ``torch.cuda.is_available() == False``. It provides
a pure-torch ``vllm._custom_ops.rotary_embedding`` and makes pinning a no-op. On a GPU machine
nothing here is loaded.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SHIM_ENV_FLAG", "SITE_DIR"]

SITE_DIR: Path = Path(__file__).resolve().parent / "pythonpath"
"""Directory to prepend to the engine's ``PYTHONPATH`` to load the shim."""

SHIM_ENV_FLAG = "AGENTIC_LORA_CPU_SHIM"
"""Set to ``1`` in the engine's environment together with ``PYTHONPATH``; the shim checks it."""
