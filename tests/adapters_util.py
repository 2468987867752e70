"""Tiny real LoRA adapters for tests: a small torch model wrapped by real PEFT, and raw blobs.

The base model mimics a decoder's module paths (``layers.N.self_attn.q_proj``) so PEFT's
``target_modules`` matching and saved tensor names look like a real causal LM's, without
pulling a transformers model (and its deprecation warnings) into the unit suite.
"""

from __future__ import annotations

import struct
from typing import Any

import torch
from peft import LoraConfig
from peft import PeftModel
from peft import get_peft_model
from torch import nn

from agentic_lora.adapters.snapshot import TensorBlob

HIDDEN = 8
KV = 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV, bias=False)
        self.o_proj = nn.Linear(KV, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.o_proj(self.v_proj(x)) + self.q_proj(x)
        out = out + self.k_proj(x).sum(-1, keepdim=True)
        return out


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.self_attn(x)
        return out


class TinyDecoder(nn.Module):
    """Two layers; deterministic weights for a given seed."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList([Layer(), Layer()])
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def lora_config(
    r: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj"), **extra: Any
) -> LoraConfig:
    # init_lora_weights=False: lora_B is random too, so the adapter changes outputs.
    return LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False, **extra
    )


def peft_model(
    seed: int = 1, dtype: torch.dtype = torch.float32, config: LoraConfig | None = None
) -> PeftModel:
    """A real PEFT model with non-zero, seed-determined LoRA weights."""
    torch.manual_seed(seed)
    model = get_peft_model(TinyDecoder(seed=0, dtype=dtype), config or lora_config())
    model.to(dtype)
    return model


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """The smallest config our validation accepts, in plain JSON types."""
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "r": 1,
        "lora_alpha": 2,
        "target_modules": ["q_proj"],
    }
    config.update(overrides)
    return config


def tiny_blobs(module: str = "model.layers.0.self_attn.q_proj") -> list[TensorBlob]:
    """One rank-1 LoRA pair on a 2x2 projection, F32."""
    return [
        TensorBlob(f"{module}.lora_A.weight", "F32", (1, 2), f32(0.5, -1.0)),
        TensorBlob(f"{module}.lora_B.weight", "F32", (2, 1), f32(0.25, 2.0)),
    ]
