"""The test-harness CPU shim: vLLM's rotary contract in pure torch, pinning made a no-op."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from types import ModuleType

import pytest
import torch
from agentic_lora_harness.cpu_shim import SHIM_ENV_FLAG
from agentic_lora_harness.cpu_shim import SITE_DIR


def _shim() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "agentic_lora_cpu_shim_under_test", SITE_DIR / "agentic_lora_cpu_shim.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cos_sin_cache(max_pos: int, rot_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _reference(
    positions: torch.Tensor, x: torch.Tensor, head_size: int, rot_dim: int, neox: bool
) -> torch.Tensor:
    """Rotary embedding as a complex rotation, one head and one position at a time."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    heads = x.view(positions.numel(), -1, head_size).clone()
    for t, pos in enumerate(positions.tolist()):
        angle = torch.polar(torch.ones_like(inv_freq), pos * inv_freq)
        for h in range(heads.shape[1]):
            rot = heads[t, h, :rot_dim]
            if neox:
                pairs = torch.complex(rot[: rot_dim // 2], rot[rot_dim // 2 :]) * angle
                heads[t, h, :rot_dim] = torch.cat((pairs.real, pairs.imag))
            else:
                pairs = torch.complex(rot[0::2], rot[1::2]) * angle
                heads[t, h, :rot_dim] = torch.stack((pairs.real, pairs.imag), -1).flatten()
    return heads.view_as(x)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot_dim", [32, 16])
def test_rotary_matches_a_complex_rotation(neox: bool, rot_dim: int) -> None:
    rotary_embedding = _shim().rotary_embedding
    generator = torch.Generator().manual_seed(7)
    head_size, q_heads, k_heads = 32, 4, 2
    positions = torch.tensor([0, 1, 5, 17, 300])
    query = torch.randn(5, q_heads * head_size, generator=generator, dtype=torch.float64)
    key = torch.randn(5, k_heads * head_size, generator=generator, dtype=torch.float64)
    want_q = _reference(positions, query, head_size, rot_dim, neox)
    want_k = _reference(positions, key, head_size, rot_dim, neox)
    rotary_embedding(positions, query, key, head_size, _cos_sin_cache(512, rot_dim), neox)
    torch.testing.assert_close(query, want_q)  # rotated in place, as vLLM's op does
    torch.testing.assert_close(key, want_k)


def test_rotary_position_zero_is_identity() -> None:
    rotary_embedding = _shim().rotary_embedding
    query = torch.arange(64, dtype=torch.float32).reshape(1, 64)
    before = query.clone()
    rotary_embedding(torch.tensor([0]), query, None, 32, _cos_sin_cache(4, 32).float(), True)
    torch.testing.assert_close(query, before)


def _run_isolated(code: str, *, flag: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", SHIM_ENV_FLAG)}
    env["PYTHONPATH"] = str(SITE_DIR)
    if flag:
        env[SHIM_ENV_FLAG] = "1"
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim only acts without CUDA")
def test_sitecustomize_installs_the_shim_when_flagged() -> None:
    result = _run_isolated(
        """
        import torch
        pinned = torch.tensor([1, 2], dtype=torch.int32, pin_memory=True)
        empty = torch.empty((3,), pin_memory=True)
        same = pinned.pin_memory()
        assert same is pinned and empty.shape == (3,)
        from vllm._custom_ops import rotary_embedding
        try:
            import vllm.model_executor
        except ImportError:
            print("ok")
        """,
        flag=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim only acts without CUDA")
def test_sitecustomize_does_nothing_without_the_flag() -> None:
    result = _run_isolated(
        """
        import importlib.util
        import torch
        print(importlib.util.find_spec("vllm") is None, torch.Tensor.pin_memory.__name__)
        """,
        flag=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "pin_memory"]
