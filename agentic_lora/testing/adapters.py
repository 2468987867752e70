"""Tiny, valid LoRA snapshots built from raw bytes (no torch), distinct per seed."""

from __future__ import annotations

import struct

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.adapters.snapshot import TensorBlob

__all__ = ["tiny_snapshot"]

_MODULE = "base_model.model.layers.0.self_attn.q_proj"


def tiny_snapshot(seed: int, *, rank: int = 2, width: int = 4) -> AdapterSnapshot:
    """A rank-``rank`` LoRA on one ``q_proj``; different seeds give different digests."""
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ["q_proj"],
    }

    def floats(count: int, offset: int) -> bytes:
        return struct.pack(f"<{count}f", *((seed * 131 + offset + i) / 64.0 for i in range(count)))

    tensors = [
        TensorBlob(f"{_MODULE}.lora_A.weight", "F32", (rank, width), floats(rank * width, 0)),
        TensorBlob(f"{_MODULE}.lora_B.weight", "F32", (width, rank), floats(width * rank, 97)),
    ]
    return AdapterSnapshot.from_blobs(config, tensors)
