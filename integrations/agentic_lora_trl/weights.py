"""The LoRA weights of one training step, copied off the live model on the training thread.

:meth:`AdapterWeights.capture` copies the tensors of a PEFT adapter (the layout PEFT's
``save_pretrained`` writes) into new CPU memory, so the optimizer's next step cannot change them;
:meth:`AdapterWeights.snapshot` freezes that private copy into an
:class:`~agentic_lora.AdapterSnapshot` (serialise, validate, hash), off the training thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from typing import Any

from agentic_lora import AdapterSnapshot
from agentic_lora.errors import InvalidAdapterError

if TYPE_CHECKING:
    import torch

__all__ = ["AdapterWeights"]


@dataclass(frozen=True)
class AdapterWeights:
    """The LoRA weights of one training step, copied off the live model (see :mod:`agentic_lora_trl.weights`)."""

    step: int
    version_id: str
    tensors: Mapping[str, torch.Tensor]
    config: Mapping[str, Any]

    @classmethod
    def capture(
        cls, model: object, *, step: int, version_id: str, adapter_name: str = "default"
    ) -> AdapterWeights:
        """Copy ``model``'s adapter ``adapter_name`` now (call it on the training thread).

        ``model`` is a PEFT model, or a wrapper of one (``.module``, as DDP has). The tensors come
        from PEFT's ``get_peft_model_state_dict`` (the layout ``save_pretrained`` writes), each
        copied to new CPU memory; the config is copied as a plain dict.
        """
        peft_model = _peft_model(model, adapter_name)
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
        tensors = {name: t.detach().to("cpu", copy=True) for name, t in state.items()}
        config = peft_model.peft_config[adapter_name]
        config_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        return cls(step=step, version_id=version_id, tensors=tensors, config=config_dict)

    def snapshot(self) -> AdapterSnapshot:
        """Freeze these tensors into an AdapterSnapshot (serialise, validate, hash)."""
        return AdapterSnapshot.from_state_dict(self.tensors, self.config)


def _peft_model(model: object, adapter_name: str) -> Any:
    seen: set[int] = set()
    current: Any = model
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        configs = getattr(current, "peft_config", None)
        if isinstance(configs, Mapping) and adapter_name in configs:
            return current
        current = getattr(current, "module", None)
    raise InvalidAdapterError(
        f"{type(model).__name__} is not a PEFT model with adapter {adapter_name!r}: "
        "train with a peft LoraConfig (GRPOTrainer(peft_config=...)) or a PeftModel",
        reason="not_lora",
    )
