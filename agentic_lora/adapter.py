"""Adapter snapshots: an owned, immutable copy of one LoRA adapter and its content digest.

(Interface fixed here; loaders and the manifest/digest are filled in by the identity work.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["AdapterSnapshot", "TensorBlob"]


@dataclass(frozen=True, slots=True)
class TensorBlob:
    """One tensor as bytes: ``dtype`` is a safetensors dtype code ("BF16", "F32", ...)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class AdapterSnapshot:
    """The frozen adapter one publication transfers; ``digest`` names its content."""

    config: Mapping[str, Any]
    tensors: tuple[TensorBlob, ...]
    digest: str
