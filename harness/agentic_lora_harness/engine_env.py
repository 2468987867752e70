"""The SGLang engine venv: created once per machine, outside the clone, keyed by SGLang version.

The venv lives in ``${AGENTIC_LORA_CACHE:-~/.cache/agentic-lora}/venvs/sglang-<version>``; how it
is built, stamped and locked is :mod:`agentic_lora_harness.venv_builder` (shared with the vLLM
venv). This module is the SGLang recipe.

``sglang==0.5.23`` pins ``torch==2.14.1``; the only build of that on these machines is the CUDA
one, which pulls the NVIDIA runtime wheels (about 11 GB in all, about 3-4 minutes from the local
mirrors). On a machine without a GPU the harness adds a CPU compatibility shim at engine launch
(see :mod:`agentic_lora_harness.cpu_shim`); whether one is needed is probed here, once, and
recorded in the stamp.

``python -m agentic_lora_harness.engine_env`` (or ``scripts/engine-env.sh``) ensures the venv and
prints what it found as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentic_lora_harness.venv_builder import BuiltVenv
from agentic_lora_harness.venv_builder import EngineEnvError
from agentic_lora_harness.venv_builder import VenvKind
from agentic_lora_harness.venv_builder import VenvRecipe

__all__ = [
    "SGLANG_VERSION",
    "EngineEnv",
    "EngineEnvError",
    "engine_venv_dir",
    "ensure_engine_env",
    "main",
]

SGLANG_VERSION = "0.5.23"
"""The SGLang release the harness runs and pins its behaviour tests against."""


def _recipe(version: str = SGLANG_VERSION) -> VenvRecipe:
    # The requirements are part of the stamp: changing them rebuilds the venv.
    return VenvRecipe(
        label="engine",
        dir_name=f"sglang-{version}",
        requirements=(f"sglang=={version}",),
        version_key="sglang",
        version=version,
    )


@dataclass(frozen=True)
class EngineEnv(BuiltVenv):
    """A ready engine venv: its interpreter and what it runs."""

    sglang_version: str


_KIND: VenvKind[EngineEnv] = VenvKind(
    prog="agentic_lora_harness.engine_env",
    recipe=_recipe,
    version=SGLANG_VERSION,
    describe=lambda described, version: EngineEnv(**described, sglang_version=version),
)

engine_venv_dir = _KIND.venv_dir
ensure_engine_env = _KIND.ensure
main = _KIND.main

if __name__ == "__main__":
    raise SystemExit(main())
