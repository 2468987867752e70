"""The Ray rollout example's fleet description (examples/ray_rollout): built and checked in the driver.

No Ray and no engines: these are the values the driver hands the registry actor, the trainer's
Deployment and every worker actor (whose config is pickled to the actor's process). The example
on real engines is tests/e2e/test_ray_rollout.py.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from agentic_lora_rollout import REGISTRY_NAMESPACE
from agentic_lora_rollout import WorkerConfig
from agentic_lora_rollout import fleet_settings
from agentic_lora_rollout import worker_settings

from agentic_lora.config import AgenticLoRASettings
from agentic_lora.engines.backends import EngineRef
from agentic_lora.errors import ConfigurationError

ENGINES = {"e0": "http://127.0.0.1:30000", "e1": "http://127.0.0.1:30001"}

#: What every process of the example must agree on about the fleet.
SHARED = (
    "enable_versioned_lora_publication",
    "engines",
    "capacity",
    "base_model_name",
    "engine_max_loaded_loras",
    "engine_max_loras_per_batch",
    "lora_name_prefix",
    "deployment_epoch",
    "request_timeout",
)


@pytest.fixture
def fleet() -> AgenticLoRASettings:
    return fleet_settings(ENGINES, base_model="tiny-model")


def _check(err: pytest.ExceptionInfo[ConfigurationError]) -> Any:
    return err.value.details["check"]


def test_fleet_settings_describe_the_example_fleet(fleet: AgenticLoRASettings) -> None:
    assert fleet.engines == tuple(EngineRef(n, u) for n, u in ENGINES.items())
    assert [e.name for e in fleet.publication_engines] == ["e0", "e1"]
    assert fleet.enable_versioned_lora_publication
    assert fleet.capacity == 2
    assert fleet.engine_max_loaded_loras == fleet.engine_max_loras_per_batch == 3
    assert fleet.base_model_name == "tiny-model"
    assert fleet.lora_name_prefix == "policy_lora"
    assert fleet.request_timeout == 120.0
    # The trainer's own settings: no worker slot, the default lease, no staleness bound.
    assert (fleet.owner_id, fleet.lease_ttl, fleet.max_version_lag) == (None, 60.0, None)


def test_worker_settings_are_the_fleets_plus_the_slots_own(fleet: AgenticLoRASettings) -> None:
    worker = worker_settings(fleet, owner="rollout-worker-0", lease_ttl=30.0, max_version_lag=0)
    assert {k: getattr(worker, k) for k in SHARED} == {k: getattr(fleet, k) for k in SHARED}
    assert worker.owner_id == "rollout-worker-0"
    assert (worker.lease_ttl, worker.max_version_lag) == (30.0, 0)
    assert fleet.owner_id is None  # the fleet's settings are not changed
    default = worker_settings(fleet, owner="rollout-worker-1")
    assert (default.lease_ttl, default.max_version_lag) == (60.0, None)


@pytest.mark.parametrize(
    ("options", "check"),
    [
        ({"owner": "rollout worker 0"}, "owner_id"),
        ({"owner": "w0", "lease_ttl": 0.0}, "lease"),
        ({"owner": "w0", "max_version_lag": -1}, "max_version_lag"),
    ],
)
def test_a_bad_worker_value_fails_in_the_driver(
    fleet: AgenticLoRASettings, options: dict[str, Any], check: str
) -> None:
    with pytest.raises(ConfigurationError) as err:
        worker_settings(fleet, **options)
    assert _check(err) == check


def test_a_bad_fleet_value_fails_in_the_driver() -> None:
    with pytest.raises(ConfigurationError) as err:
        fleet_settings(ENGINES, base_model="tiny-model", prefix="policy lora")
    assert _check(err) == "lora_name_prefix"
    with pytest.raises(ConfigurationError) as err:
        fleet_settings({}, base_model="tiny-model")
    assert _check(err) == "empty_fleet"


def test_a_worker_config_needs_a_worker_slots_owner_id(fleet: AgenticLoRASettings) -> None:
    with pytest.raises(ConfigurationError) as err:
        WorkerConfig(settings=fleet, registry_name="registry", namespace=REGISTRY_NAMESPACE)
    assert _check(err) == "owner_id"


def test_a_worker_config_travels_to_the_actor_process_whole(fleet: AgenticLoRASettings) -> None:
    config = WorkerConfig(
        settings=worker_settings(fleet, owner="rollout-worker-0", max_version_lag=1),
        registry_name="registry",
        namespace=REGISTRY_NAMESPACE,
        agents=3,
    )
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config
    assert copy.owner == "rollout-worker-0"
    assert copy.settings.engines == fleet.engines
    assert copy.settings.max_version_lag == 1
