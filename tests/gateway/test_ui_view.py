"""The status page's view model: counts and pages, never one entry per Session."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import pytest

from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import TooManySessionsError
from agentic_lora.foundation.outcomes import DispatchOutcome
from agentic_lora.foundation.phases import Phase
from agentic_lora.foundation.phases import PhaseEvent
from agentic_lora.foundation.phases import PhaseStatus
from agentic_lora.gateway.ui.activity import OperationLog
from agentic_lora.gateway.ui.activity import RefusalLog
from agentic_lora.gateway.ui.view import MAX_PAGE
from agentic_lora.gateway.ui.view import GatewayFacts
from agentic_lora.gateway.ui.view import ViewQuery
from agentic_lora.gateway.ui.view import build_view
from agentic_lora.gateway.ui.view import lag_histogram
from agentic_lora.registry.types import EngineStatus
from agentic_lora.registry.types import LeaseStatus
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import VersionStatus

ENGINES = ("e0", "e1")
FACTS = GatewayFacts(sessions=3, adopted=1, engine_health={"e0": True, "e1": False}, ready=True)


def version(
    n: int,
    state: VersionState,
    *,
    sessions: int = 0,
    revision: int | None = None,
    ready: tuple[str, ...] = ENGINES,
) -> VersionStatus:
    return VersionStatus(
        version_id=f"v{n}",
        digest=f"{n:064x}",
        lora_name=f"policy@0-v{n}-{n:016x}",
        state=state,
        attempt=1,
        session_refs=sessions,
        ready_engines=ready,
        published_revision=revision,
    )


def lease(owner: str, sessions: int, expires_at: float = 2000.0) -> LeaseStatus:
    return LeaseStatus(
        lease_id=f"{owner}/i",
        owner=owner,
        incarnation="i",
        ttl=30.0,
        expires_at=expires_at,
        sessions=sessions,
        names=sessions,
    )


def fleet_status(
    n_versions: int, sessions_per_live: int, n_leases: int = 3, **overrides: Any
) -> RegistryStatus:
    """``n_versions`` committed one after the other: all but the last two reclaimed, the one
    before the last RETIRED, the last PUBLISHED (the default)."""
    versions = []
    for n in range(n_versions):
        if n == n_versions - 1:
            versions.append(
                version(n, VersionState.PUBLISHED, sessions=sessions_per_live, revision=n + 1)
            )
        elif n == n_versions - 2:
            versions.append(
                version(n, VersionState.RETIRED, sessions=sessions_per_live, revision=n + 1)
            )
        else:
            versions.append(version(n, VersionState.RECLAIMED, revision=n + 1, ready=()))
    fields: dict[str, Any] = {
        "deployment_epoch": 0,
        "capacity": 2,
        "engines": tuple(EngineStatus(e, f"{e}-inc") for e in ENGINES),
        "default_version": f"v{n_versions - 1}",
        "default_revision": n_versions,
        "slots_in_use": 2,
        "pending_version": None,
        "versions": tuple(versions),
        "live_sessions": 2 * sessions_per_live,
        "leases": tuple(lease(f"worker-{i}", i) for i in range(n_leases)),
        "named_sessions": 0,
    }
    return RegistryStatus(**{**fields, **overrides})


def test_the_summary_and_the_default_version_row() -> None:
    view = build_view(fleet_status(5, 7), FACTS, now=1234.5678)
    assert view["at"] == 1234.568
    assert view["summary"] == {
        "default_version": "v4",
        "default_revision": 5,
        "rolled_back_from": None,
        "pending_version": None,
        "capacity": 2,
        "slots_in_use": 2,
        "deployment_epoch": 0,
        "registry_sessions": 14,
        "named_sessions": 0,
        "gateway_sessions": 3,
        "adopted_sessions": 1,
        "ready": True,
        "reasons": [],
    }
    rows = view["versions"]["rows"]
    assert [(r["version_id"], r["state"], r["default"], r["sessions"], r["lag"]) for r in rows] == [
        ("v4", "PUBLISHED", True, 7, 0),
        ("v3", "RETIRED", False, 7, 1),
    ]
    assert rows[0]["digest"] == f"{4:064x}"[:16]
    assert view["versions"]["by_state"]["RECLAIMED"] == 3
    assert view["versions"]["sessions_by_state"]["RETIRED"] == 7
    assert (view["versions"]["total"], view["versions"]["matching"]) == (5, 2)


def test_versions_are_paged_newest_first_and_history_only_on_request() -> None:
    status = fleet_status(500, 10)
    query = ViewQuery(versions_offset=25, versions_limit=25, all_versions=True)
    page = build_view(status, FACTS, query=query, now=0)["versions"]
    assert [r["version_id"] for r in page["rows"]] == [f"v{n}" for n in range(474, 449, -1)]
    assert (page["total"], page["matching"], page["offset"], page["all"]) == (500, 500, 25, True)
    beyond = build_view(status, FACTS, query=ViewQuery(versions_offset=600), now=0)["versions"]
    assert beyond["rows"] == []
    assert beyond["matching"] == 2


def test_sessions_are_only_ever_counted_so_the_view_size_does_not_grow_with_them() -> None:
    few = json.dumps(build_view(fleet_status(500, 10), FACTS, now=0))
    many = json.dumps(build_view(fleet_status(500, 50_000), FACTS, now=0))
    # The same view, but for the digits of the counts.
    assert abs(len(many) - len(few)) < 40
    assert len(many) < 16_000


def test_engines_show_their_health_and_the_adapters_they_hold() -> None:
    status = fleet_status(
        3,
        1,
        versions=(
            version(0, VersionState.RETIRED, revision=1),
            version(1, VersionState.PUBLISHED, revision=2, ready=("e0",)),
            version(2, VersionState.LOADING, ready=("e0",)),
            version(3, VersionState.RECLAIMED, revision=3, ready=()),
        ),
    )
    e0, e1 = build_view(status, FACTS, now=0)["engines"]
    assert (e0["engine"], e0["incarnation"], e0["healthy"], e0["slots_used"]) == (
        "e0",
        "e0-inc",
        True,
        3,
    )
    assert [a["version_id"] for a in e0["adapters"]] == ["v0", "v1", "v2"]
    assert (e1["healthy"], e1["slots_used"], e1["extra"]) == (False, 1, {})
    assert (e0["membership"], e1["membership"]) == ("ACTIVE", "ACTIVE")


class Member(enum.StrEnum):
    ACTIVE = "ACTIVE"
    EJECTED = "EJECTED"


@dataclass(frozen=True, slots=True)
class MemberRow:
    engine: str
    state: Member
    base_url: str | None = None
    incarnation: str | None = None
    fenced: str | None = None
    owes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StatusWithMembers(RegistryStatus):
    members: tuple[MemberRow, ...] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class HeldVersion(VersionStatus):
    held_by: tuple[str, ...] = ()


def test_a_registry_membership_is_shown_when_the_registry_reports_one() -> None:
    base = fleet_status(2, 1)
    joining = HeldVersion(
        **{**vars_of(base.versions[1]), "ready_engines": ENGINES}, held_by=(*ENGINES, "e2")
    )
    status = StatusWithMembers(
        **{**vars_of(base), "versions": (base.versions[0], joining)},
        members=(
            MemberRow("e0", Member.ACTIVE),
            MemberRow("e1", Member.EJECTED, fenced="e1-inc", owes=("v0",)),
            MemberRow("e2", Member.ACTIVE, base_url="http://e2", incarnation="e2-inc"),
        ),
    )
    rows = {r["engine"]: r for r in build_view(status, FACTS, now=0)["engines"]}
    assert list(rows) == ["e0", "e1", "e2"]  # e2 joined at runtime: a member, not a start-up engine
    assert rows["e1"]["extra"] == {"state": "EJECTED", "fenced": "e1-inc", "owes": ["v0"]}
    assert rows["e2"]["incarnation"] == "e2-inc"
    assert rows["e2"]["healthy"] is None  # never probed by this gateway
    assert [a["version_id"] for a in rows["e2"]["adapters"]] == ["v1"]


def vars_of(value: Any) -> dict[str, Any]:
    return {name: getattr(value, name) for name in value.__dataclass_fields__}


def test_staleness_counts_bound_sessions_per_lag_and_reads_the_dispatch_histogram() -> None:
    status = fleet_status(4, 5)
    samples = [
        ("agentic_lora_session_version_lag_bucket", {"le": "0.0"}, 7.0),
        ("agentic_lora_session_version_lag_bucket", {"le": "1.0"}, 9.0),
        ("agentic_lora_session_version_lag_bucket", {"le": "+Inf"}, 10.0),
        ("agentic_lora_session_version_lag_count", {}, 10.0),
        ("agentic_lora_session_version_lag_sum", {}, 6.0),
        ("agentic_lora_session_version_lag_created", {}, 1.0),
    ]
    staleness = build_view(status, FACTS, dispatch_lag=lag_histogram(samples), now=0)["staleness"]
    assert staleness == {
        "sessions_by_lag": [[0, 5], [1, 5]],
        "dispatches": {
            "buckets": [["0.0", 7.0], ["1.0", 9.0], ["+Inf", 10.0]],
            "count": 10.0,
            "sum": 6.0,
        },
    }
    assert build_view(status, FACTS, now=0)["staleness"]["dispatches"] is None


def test_leases_are_ordered_by_sessions_and_paged() -> None:
    status = fleet_status(2, 1, n_leases=30)
    leases = build_view(status, FACTS, query=ViewQuery(leases_offset=10, leases_limit=5), now=0)[
        "leases"
    ]
    assert (leases["total"], leases["sessions"], leases["offset"], leases["limit"]) == (
        30,
        435,
        10,
        5,
    )
    assert [r["owner"] for r in leases["rows"]] == [f"worker-{i}" for i in range(19, 14, -1)]
    assert leases["rows"][0] == {
        "owner": "worker-19",
        "incarnation": "i",
        "sessions": 19,
        "names": 19,
        "ttl": 30.0,
        "expires_at": 2000.0,
    }


def test_recent_operations_and_refusals_are_in_the_view() -> None:
    clock = lambda: 10.0  # noqa: E731
    operations = OperationLog(clock=clock)
    operations(PhaseEvent(None, Phase.RESERVE, PhaseStatus.STARTED, version_id="v1"))
    operations(PhaseEvent(None, Phase.RESERVE, PhaseStatus.DONE, 0.0004, version_id="v1"))
    refusals = RefusalLog(clock=clock)
    refusals.record(TooManySessionsError("full"), DispatchOutcome.REFUSED, "/generate")
    view = build_view(
        fleet_status(2, 1), FACTS, operations=operations.recent(), refusals=refusals, now=0
    )
    (op,) = view["timeline"]
    assert (op["kind"], op["version_id"], op["outcome"]) == ("publish", "v1", "done")
    assert op["steps"] == [
        {
            "phase": "reserve",
            "engine": None,
            "status": "DONE",
            "at": 10.0,
            "seconds": 0.0,
            "error_code": None,
        }
    ]
    assert view["refusals"] == {
        "total": 1,
        "by_code": {"TOO_MANY_SESSIONS": 1},
        "by_outcome": {"refused": 1},
        "recent": [
            {"at": 10.0, "code": "TOO_MANY_SESSIONS", "outcome": "refused", "route": "/generate"}
        ],
    }
    empty = build_view(fleet_status(2, 1), FACTS, now=0)
    assert empty["timeline"] == []
    assert empty["refusals"]["total"] == 0


def test_queries_come_from_url_parameters_and_bad_ones_are_typed_refusals() -> None:
    assert ViewQuery.from_params({}) == ViewQuery()
    assert ViewQuery.from_params(
        {"versions_offset": "50", "versions_limit": "10", "all_versions": "1", "leases_limit": "3"}
    ) == ViewQuery(versions_offset=50, versions_limit=10, all_versions=True, leases_limit=3)
    for params in (
        {"versions_offset": "-1"},
        {"versions_limit": "0"},
        {"leases_limit": str(MAX_PAGE + 1)},
        {"versions_offset": "1e3"},
        {"versions_offset": "9" * 12},
        {"all_versions": "yes"},
    ):
        with pytest.raises(InvalidRequestError):
            ViewQuery.from_params(params)


def test_only_the_newest_operations_carry_their_steps() -> None:
    operations = OperationLog(clock=lambda: 10.0)
    for n in range(10):
        operations(PhaseEvent(None, Phase.RESERVE, PhaseStatus.STARTED, version_id=f"v{n}"))
        operations(PhaseEvent(None, Phase.RESERVE, PhaseStatus.DONE, 0.1, version_id=f"v{n}"))
    timeline = build_view(fleet_status(2, 1), FACTS, operations=operations.recent(), now=0)[
        "timeline"
    ]
    assert [op["version_id"] for op in timeline] == [f"v{n}" for n in range(9, 1, -1)]
    assert [len(op["steps"]) for op in timeline] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert {op["step_count"] for op in timeline} == {1}
