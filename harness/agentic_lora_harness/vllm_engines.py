"""Launch and stop a fleet of real vLLM (CPU build) engines on loopback for tests.

:class:`VllmFleet` is the SGLang :class:`~agentic_lora_harness.engines.EngineFleet` with another
server module and flags: the process-group handling, health wait (``GET /health``), log files,
restart, kill, memory accounting and the finaliser that ends every engine with the test process
are inherited unchanged. Each engine is ``python -m vllm.entrypoints.openai.api_server`` from the vLLM venv
(the ``vllm serve`` console script of 0.32.0 fails to start here).

vLLM's runtime LoRA endpoints (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) exist only
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``. On CPU, vLLM sizes its KV cache from
``VLLM_CPU_KVCACHE_SPACE`` (GiB); unset, it takes about 20 GB per engine, so the fleet sets 1.
Two engines share two cores, so OpenMP core binding is off (``nobind``) and the OS schedules them.
Every address vLLM uses for its own processes is pinned to loopback, and usage reporting is off.
"""

from __future__ import annotations

from collections.abc import Mapping

from agentic_lora_harness.engines import EngineFleet
from agentic_lora_harness.vllm_env import VllmEnv

__all__ = ["VLLM_CPU_FLAGS", "VLLM_ENV", "VllmFleet", "vllm_lora_flags"]

VLLM_CPU_FLAGS: tuple[str, ...] = (
    "--dtype", "bfloat16",
    # The fixture model allows 4096 positions; 1024 keeps the KV cache and warm-up small.
    "--max-model-len", "1024",
)  # fmt: skip
"""Engine flags for the tiny fixture model on a CPU-only machine."""

VLLM_ENV: Mapping[str, str] = {
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
"""Environment every vLLM engine of the fleet gets (see the module docstring for why)."""


def vllm_lora_flags(
    *,
    max_loras: int = 3,
    max_cpu_loras: int = 4,
    max_lora_rank: int = 8,
) -> tuple[str, ...]:
    """The LoRA flags: LoRA on, adapters per batch, adapters cached in memory, and the max rank.

    vLLM has no pinning: an adapter beyond ``max_cpu_loras`` is evicted (LRU) and re-read from
    its ``lora_path`` when a request needs it again, which is safe only because published
    adapter directories are immutable. ``max_cpu_loras`` must be at least ``max_loras``.
    """
    if max_cpu_loras < max_loras:
        raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
    return (
        "--enable-lora",
        "--max-loras", str(max_loras),
        "--max-cpu-loras", str(max_cpu_loras),
        "--max-lora-rank", str(max_lora_rank),
    )  # fmt: skip


class VllmFleet(EngineFleet):
    """N vLLM engines named ``E0``, ``E1``, ... serving the fixture model on loopback.

    Same constructor, lifecycle and accessors as :class:`~agentic_lora_harness.engines.EngineFleet`
    (give it a :class:`~agentic_lora_harness.vllm_env.VllmEnv`). ``flags`` replaces the default
    flags (:data:`VLLM_CPU_FLAGS` plus :func:`vllm_lora_flags`); ``extra_args`` is appended;
    ``extra_env`` is laid over :data:`VLLM_ENV`. The start-up and stop defaults are 600 s and 30 s.
    """

    server_module = "vllm.entrypoints.openai.api_server"
    model_flag = "--model"
    default_flags = (*VLLM_CPU_FLAGS, *vllm_lora_flags())
    default_startup_timeout = 600.0
    default_stop_grace = 30.0
    base_env = VLLM_ENV

    @property
    def vllm_env(self) -> VllmEnv:
        """The venv the engines run from."""
        assert isinstance(self._env, VllmEnv)
        return self._env
