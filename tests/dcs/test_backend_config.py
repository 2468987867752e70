"""DcsBackend is found through its entry point and refuses settings that cannot work."""

from __future__ import annotations

from contextlib import aclosing

import pytest
from agentic_lora_dcs import DcsBackend
from agentic_lora_dcs.collective import SUPPORTED_BACKENDS

from agentic_lora.engines.backends import Backend
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.backends import load_backend
from agentic_lora.errors import BackendRefusedError
from agentic_lora.errors import ConfigurationError
from tests.dcs.util import make_snapshot
from tests.dcs.util import target_for


def _backend(collective_backend: str) -> DcsBackend:
    # One engine whose sidecar address is port 1 on loopback: nothing listens there.
    return DcsBackend(
        {"E0": "http://127.0.0.1:1"}, collective_backend=collective_backend, sidecar_token="t"
    )


@pytest.mark.asyncio
async def test_the_dcs_entry_point_builds_a_backend() -> None:
    backend = load_backend(
        "dcs", sidecars={"E0": "http://127.0.0.1:1"}, collective_backend="gloo", sidecar_token="t"
    )
    async with aclosing(backend):
        assert isinstance(backend, DcsBackend)
        assert isinstance(backend, Backend)
        assert backend.collective_backend == "gloo"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sidecars": {}}, "one sidecar URL per engine"),
        ({"sidecars": {"E0": "http://127.0.0.1:1"}, "bucket_bytes": 0}, "bucket_bytes"),
        ({"sidecars": {"E0": "http://127.0.0.1:1"}, "control_replays": -1}, "control_replays"),
        ({"sidecars": {"E0": "http://127.0.0.1:1"}, "collective_backend": "mpi"}, "not available"),
    ],
)
def test_settings_that_cannot_work_are_configuration_errors(
    kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match):
        DcsBackend(**kwargs)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_nccl_is_accepted_only_where_cuda_and_nccl_exist() -> None:
    if "nccl" not in SUPPORTED_BACKENDS:
        with pytest.raises(ConfigurationError, match="nccl"):
            _backend("nccl")
        return
    async with aclosing(_backend("nccl")) as backend:
        assert backend.collective_backend == "nccl"


@pytest.mark.asyncio
async def test_an_engine_without_a_sidecar_is_a_configuration_error() -> None:
    snapshot = make_snapshot(seed=91)
    async with aclosing(_backend("gloo")) as backend:
        with pytest.raises(ConfigurationError, match="E7"):
            await backend.prepare(
                EngineRef("E7", "http://127.0.0.1:1"), target_for(snapshot, "x"), snapshot
            )


@pytest.mark.asyncio
async def test_an_unreachable_sidecar_is_a_clean_refusal_before_anything_is_sent() -> None:
    # Port 1 on loopback: nothing listens, the connection is refused before any byte is sent.
    snapshot = make_snapshot(seed=92)
    async with aclosing(_backend("gloo")) as backend:
        with pytest.raises(BackendRefusedError) as refused:
            await backend.prepare(EngineRef("E0", "x"), target_for(snapshot, "y"), snapshot)
    assert refused.value.details["reason"] == "NOT_SENT"
