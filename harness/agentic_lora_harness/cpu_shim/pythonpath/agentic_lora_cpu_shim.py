"""Test-harness compatibility shim, CPU only. Not used by agentic-lora itself.

Makes real SGLang 0.5.23 run on a machine without a GPU, for the real-engine tests:

1. ``vllm._custom_ops.rotary_embedding``: SGLang's non-CUDA rotary path imports this vLLM kernel.
   We register an in-memory ``vllm._custom_ops`` module whose ``rotary_embedding`` is a pure-torch
   version with vLLM's in-place contract. Nothing else of vLLM is provided, so any other import of
   ``vllm`` still fails as it would without the shim.
2. Pinned host memory: SGLang's LoRA layers pass ``pin_memory=True`` and call
   ``Tensor.pin_memory()``; without an accelerator torch raises. Pinning only affects copy speed
   to a device, so without one it is made a no-op.

:func:`install` does nothing when ``torch.cuda.is_available()`` is true.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["install", "rotary_embedding"]

_PIN_FACTORIES: tuple[str, ...] = ("tensor", "empty", "zeros", "ones", "full", "empty_like")
_installed = False


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Apply rotary embeddings in place, with the contract of vLLM's ``rotary_embedding`` op.

    ``query``/``key`` are ``[num_tokens, num_heads * head_size]`` (or ``[..., num_heads,
    head_size]``); ``cos_sin_cache`` is ``[max_position, rot_dim]`` with cos in the first half and
    sin in the second. Only the first ``rot_dim`` channels of each head are rotated.
    """
    flat_positions = positions.reshape(-1)
    num_tokens = flat_positions.shape[0]
    cos_sin = cos_sin_cache.index_select(0, flat_positions)
    cos, sin = cos_sin.chunk(2, dim=-1)
    for tensor in (query, key):
        if tensor is None:
            continue
        heads = tensor.view(num_tokens, -1, head_size)
        rot_dim = cos.shape[-1] * 2
        rotated = _rotate(heads[..., :rot_dim], cos, sin, is_neox)
        heads[..., :rot_dim] = rotated


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    if is_neox:
        return torch.cat((out1, out2), dim=-1)
    return torch.stack((out1, out2), dim=-1).flatten(-2)


class _VllmOpsFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``vllm`` and ``vllm._custom_ops`` from memory; every other ``vllm.*`` is missing."""

    _names = ("vllm", "vllm._custom_ops")

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._names:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == "vllm")

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = "Test-harness compatibility shim, CPU only (not vLLM)."
        if module.__name__ == "vllm._custom_ops":
            module.rotary_embedding = rotary_embedding  # type: ignore[attr-defined]


def _without_pinning(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapper


def _no_pin(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def install() -> None:
    """Install both shims once, and only in a process that has no CUDA device."""
    global _installed
    if _installed or torch.cuda.is_available():
        return
    _installed = True
    sys.meta_path.insert(0, _VllmOpsFinder())
    for name in _PIN_FACTORIES:
        setattr(torch, name, _without_pinning(getattr(torch, name)))
    torch.Tensor.pin_memory = _no_pin  # type: ignore[method-assign,assignment]
