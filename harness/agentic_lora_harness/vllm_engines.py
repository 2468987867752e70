"""Launch and stop a fleet of real vLLM (CPU build) engines on loopback for tests.

:class:`VllmFleet` is the SGLang :class:`~agentic_lora_harness.engines.EngineFleet` with another
command line: the process-group handling, health wait (``GET /health``), log files, restart, kill,
memory accounting and the finaliser that ends every engine with the test process are inherited
unchanged. Each engine is ``python -m vllm.entrypoints.openai.api_server`` from the vLLM venv
(the ``vllm serve`` console script of 0.32.0 fails to start here).

vLLM's runtime LoRA endpoints (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) exist only
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``. On CPU, vLLM sizes its KV cache from
``VLLM_CPU_KVCACHE_SPACE`` (GiB); unset, it takes about 20 GB per engine, so the fleet sets 1.
Two engines share two cores, so OpenMP core binding is off (``nobind``) and the OS schedules them.
Every address vLLM uses for its own processes is pinned to loopback, and usage reporting is off.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from agentic_lora_harness.engines import EngineFleet, _Engine
from agentic_lora_harness.fixture import Fixture
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

    Same lifecycle and accessors as :class:`~agentic_lora_harness.engines.EngineFleet`.
    ``flags`` replaces the default flags (:data:`VLLM_CPU_FLAGS` plus :func:`vllm_lora_flags`);
    ``extra_args`` is appended; ``extra_env`` is laid over :data:`VLLM_ENV`.
    """

    def __init__(
        self,
        env: VllmEnv,
        fixture: Fixture,
        *,
        count: int = 2,
        flags: Sequence[str] | None = None,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        startup_timeout: float = 600.0,
        stop_grace: float = 30.0,
    ) -> None:
        # EngineFleet reads only ``python`` and ``needs_cpu_shim`` of its env, and VllmEnv has
        # both; it is typed to the SGLang venv description, hence the ignore.
        super().__init__(
            env,  # type: ignore[arg-type]
            fixture,
            count=count,
            flags=tuple(flags) if flags is not None else (*VLLM_CPU_FLAGS, *vllm_lora_flags()),
            extra_args=extra_args,
            extra_env={**VLLM_ENV, **(extra_env or {})},
            log_dir=log_dir,
            startup_timeout=startup_timeout,
            stop_grace=stop_grace,
        )
        self._vllm_env = env

    @property
    def vllm_env(self) -> VllmEnv:
        """The venv the engines run from."""
        return self._vllm_env

    def _command(self, engine: _Engine) -> list[str]:
        return [
            str(self._vllm_env.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.fixture.model_dir),
            "--served-model-name",
            self.fixture.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(engine.port),
            *self._flags,
            *self._extra_args,
        ]
