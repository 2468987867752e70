"""DCS backend plugin: staged LoRA publication over ``torch.distributed`` into receiver sidecars.

* :class:`DcsBackend` (publisher side) implements :class:`agentic_lora.engines.backends.Backend`;
  register it under the ``agentic_lora.backends`` entry point ``dcs``.
* ``python -m agentic_lora_dcs.sidecar`` runs the receiver beside one engine.

The plugin needs torch (gloo on CPU, NCCL on GPU); the ``agentic_lora`` core never imports it.
"""

from agentic_lora_dcs.backend import DcsBackend

__all__ = ["DcsBackend"]
