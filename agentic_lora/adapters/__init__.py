"""Adapters: an immutable snapshot of one LoRA adapter, its validation, and the on-disk store.

* :mod:`~agentic_lora.adapters.snapshot`: :class:`AdapterSnapshot`, the owned copy a publication
  freezes and hashes once.
* :mod:`~agentic_lora.adapters.validation`: what a valid adapter is (typed ``INVALID_ADAPTER``
  reasons) and the canonical config form.
* :mod:`~agentic_lora.adapters.safetensors_io`: a torch-free safetensors reader and writer.
* :mod:`~agentic_lora.adapters.store`: immutable adapter directories, one per version.
"""
