"""PD-disaggregated engines (issue 15): a PD group is one fleet member for routing whose prefill
and decode servers are each an engine for publication, readiness, repair and reclaim.

Here: the fleet model, its configuration and the role servers' checks (respx at the HTTP edge).
Publication, dispatch and reclaim through a Deployment are in ``test_pd_deployment.py``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import pytest
import respx

from agentic_lora.config import AgenticLoRASettings
from agentic_lora.config import add_arguments
from agentic_lora.config import from_args
from agentic_lora.config import verify_fleet
from agentic_lora.engines.pd import PDFleet
from agentic_lora.engines.pd import PDGroup
from agentic_lora.engines.pd import Role
from agentic_lora.engines.pd import RoleHealth
from agentic_lora.engines.pd import check_disaggregation_mode
from agentic_lora.engines.routing import EngineHealth
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.errors import ConfigurationError
from tests.config.test_config import check_of as settings_check_of
from tests.config.test_config import on as settings_on

GROUP = "g1=prefill=http://p:30000,decode=http://d:30001,decode=http://d:30002,router=http://r:8000"
ROLES = ("g1.prefill", "g1.decode0", "g1.decode1")


def on(**values: Any) -> dict[str, Any]:
    """A valid versioned configuration with one plain engine and one PD group."""
    return settings_on(
        **{
            "engines": ["e0=http://e:30000"],
            "pd_groups": [GROUP],
            "gateway_retries_disabled": True,
            "base_model_name": "tiny-qwen3",
            **values,
        }
    )


def check_of(**values: Any) -> str:
    """The check that refuses :func:`on` with ``values`` changed."""
    return settings_check_of(**on(**values))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("AGENTIC_LORA_")]:
        monkeypatch.delenv(key)


# --- 1. fleet model and configuration; rule 5.2-3: slots on every role ----------------------------


def test_a_pd_group_is_one_member_for_routing_and_its_role_servers_are_engines() -> None:
    s = AgenticLoRASettings(**on())
    assert [e.name for e in s.dispatch_engines] == ["e0", "g1"]
    assert s.dispatch_engines[1].base_url == "http://r:8000"
    assert [e.name for e in s.publication_engines] == ["e0", *ROLES]
    assert [e.base_url for e in s.publication_engines][1:] == [
        "http://p:30000",
        "http://d:30001",
        "http://d:30002",
    ]
    # The mapping form (environment JSON) names the same group.
    mapping = {
        "name": "g1",
        "prefill": "http://p:30000",
        "decode": ["http://d:30001", "http://d:30002"],
        "router": "http://r:8000",
    }
    assert AgenticLoRASettings(**on(pd_groups=[mapping])).pd_groups == s.pd_groups
    # A fleet of PD groups only is a fleet.
    only = AgenticLoRASettings(**on(engines=[]))
    assert [e.name for e in only.dispatch_engines] == ["g1"]


def test_pd_groups_from_the_environment_and_the_command_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AGENTIC_LORA_PD_GROUPS", json.dumps([GROUP]))
    monkeypatch.setenv("AGENTIC_LORA_PD_DECODE_MAX_LOADED_LORAS", "4")
    s = AgenticLoRASettings(**{k: v for k, v in on().items() if k != "pd_groups"})
    assert [g.name for g in s.pd_groups] == ["g1"]
    assert s.decode_slots() == (4, 3)
    parser = add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--versioned-lora-pd-group",
            "g2=prefill=http://p2:1,decode=http://d2:2,router=http://r2:3",
            "--versioned-lora-pd-decode-max-loras-per-batch",
            "5",
        ]
    )
    flagged = from_args(args, **{k: v for k, v in on().items() if k != "pd_groups"})
    assert [g.name for g in flagged.pd_groups] == ["g2"]
    assert flagged.decode_slots() == (4, 5)


@pytest.mark.parametrize(
    ("values", "check"),
    [
        # The decode side needs capacity + 1 slots as well: refused before anything starts.
        ({"pd_decode_max_loaded_loras": 2}, "engine_lora_slots"),
        ({"pd_decode_max_loras_per_batch": 2}, "pinned_slots"),
        (
            {
                "capacity": 3,
                "engine_max_loaded_loras": 4,
                "engine_max_loras_per_batch": 4,
                "pd_decode_max_loras_per_batch": 3,
            },
            "pinned_slots",
        ),
        # The group's PD router retries by default: the operator must assert it does not.
        ({"gateway_retries_disabled": False}, "router_retries"),
        ({"engines": ["g1.prefill=http://x:1"]}, "duplicate_engine"),
        ({"engines": ["g1=http://x:1"]}, "duplicate_engine"),
        ({"engines": ["e0=http://d:30001"]}, "duplicate_engine"),
        ({"pd_groups": [GROUP, GROUP.replace("g1=", "g2=")]}, "duplicate_engine"),
        ({"pd_groups": ["g1=prefill=http://p:1,router=http://r:2"]}, "settings"),
        ({"pd_groups": ["g1=prefill=http://p:1,decode=http://d:2"]}, "settings"),
        ({"pd_groups": ["g.1=prefill=http://p:1,decode=http://d:2,router=http://r:3"]}, "settings"),
        ({"pd_groups": ["g1=prefill=ftp://p:1,decode=http://d:2,router=http://r:3"]}, "settings"),
        ({"pd_groups": ["g1=mixed=http://p:1"]}, "settings"),
        ({"engines": [], "pd_groups": []}, "empty_fleet"),
    ],
)
def test_pd_settings_that_cannot_work_fail_fast(values: dict[str, Any], check: str) -> None:
    assert check_of(**values) == check


def test_decode_slots_default_to_the_engine_slots_and_may_be_larger() -> None:
    assert AgenticLoRASettings(**on()).decode_slots() == (3, 3)
    roomy = AgenticLoRASettings(**on(engine_max_loaded_loras=None, engine_max_loras_per_batch=None))
    assert roomy.decode_slots() == (None, None)  # read from the servers at start-up


def _info(mode: str | None, loaded: int = 3) -> dict[str, Any]:
    info: dict[str, Any] = {
        "enable_lora": True,
        "max_loaded_loras": loaded,
        "max_loras_per_batch": 3,
    }
    if mode is not None:
        info["disaggregation_mode"] = mode
    return info


@pytest.mark.asyncio
async def test_verify_fleet_checks_every_role_server_and_its_role() -> None:
    s = AgenticLoRASettings(**on(engine_max_loaded_loras=None, engine_max_loras_per_batch=None))
    t = EngineTransport(s.dispatch_engines, http_transport="httpx")
    try:
        with respx.mock(assert_all_called=False) as mock:
            mock.get("http://e:30000/server_info").respond(200, json=_info(None))
            prefill = mock.get("http://p:30000/server_info").respond(200, json=_info("prefill"))
            mock.get("http://d:30001/server_info").respond(200, json=_info("decode"))
            decode1 = mock.get("http://d:30002/server_info").respond(
                200, json=_info("decode", loaded=2)
            )
            # A decode server with too few slots would run out under load: refused by name.
            with pytest.raises(ConfigurationError, match=r"g1\.decode1") as err:
                await verify_fleet(s, t)
            assert err.value.details["check"] == "engine_lora_slots"
            decode1.respond(200, json=_info("decode"))
            prefill.respond(200, json=_info("decode"))
            with pytest.raises(ConfigurationError, match=r"g1\.prefill") as err:
                await verify_fleet(s, t)
            assert err.value.details["check"] == "pd_role"
            prefill.respond(200, json=_info("prefill"))
            await verify_fleet(s, t)
            assert decode1.call_count == 2  # the second run stopped at the prefill
    finally:
        await t.aclose()


def test_a_plain_engine_that_runs_disaggregated_is_refused() -> None:
    check_disaggregation_mode({"disaggregation_mode": "null"}, engine="e0", role=Role.PLAIN)
    check_disaggregation_mode({}, engine="g1.decode0", role=Role.DECODE)
    with pytest.raises(ConfigurationError) as err:
        check_disaggregation_mode({"disaggregation_mode": "decode"}, engine="e0", role=Role.PLAIN)
    assert err.value.details["check"] == "pd_role"


def test_a_group_is_dispatchable_only_when_every_role_holds_the_version() -> None:
    fleet = AgenticLoRASettings(**on()).fleet
    assert fleet.dispatchable(["e0", *ROLES]) == ("e0", "g1")
    for missing in ROLES:
        holders = ["e0", *(r for r in ROLES if r != missing)]
        assert fleet.dispatchable(holders) == ("e0",), missing
    assert fleet.dispatchable(ROLES) == ("g1",)
    assert fleet.roles_of("g1") == ROLES
    assert fleet.roles_of("e0") == ("e0",)


def test_role_health_folds_a_role_server_into_its_group() -> None:
    fleet = PDFleet(
        groups=(PDGroup("g1", "http://p:1", ("http://d:2", "http://d:3"), "http://r:4"),)
    )
    members = EngineHealth(["g1"])
    roles = RoleHealth(members, fleet)
    roles.mark_unhealthy("g1.decode0")
    roles.mark_unhealthy("g1.prefill")
    assert members.healthy() == ()
    roles.mark_healthy("g1.decode0")
    assert members.healthy() == ()  # the prefill still does not answer
    roles.mark_healthy("g1.prefill")
    assert members.healthy() == ("g1",)
    # An operator's mark on the group stands: a role coming back does not lift it.
    members.mark_unhealthy("g1")
    roles.mark_unhealthy("g1.decode1")
    roles.mark_healthy("g1.decode1")
    assert members.healthy() == ()
