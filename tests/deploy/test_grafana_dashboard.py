"""The Grafana dashboard (deploy/grafana/agentic-lora.json) reads only series the exporter
declares, by labels they have, with PromQL that parses; and it covers what operators asked for."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.promql_check import SERIES
from tests.deploy.promql_check import problems
from tests.deploy.promql_check import series_in

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "agentic-lora.json"
#: Grafana's interval macros, replaced by a duration as Grafana does before sending a query.
MACROS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "3h"}
#: What the dashboard must show (the series each topic is read from).
TOPICS = {
    "dispatch rate by outcome": "agentic_lora_dispatches_total",
    "dispatch latency by outcome": "agentic_lora_dispatch_seconds_bucket",
    "live Sessions": "agentic_lora_sessions_live",
    "versions by state": "agentic_lora_versions",
    "slots in use": "agentic_lora_capacity_slots_in_use",
    "publication outcomes": "agentic_lora_publications_total",
    "publication phases": "agentic_lora_publication_phase_seconds_bucket",
    "lease expiries": "agentic_lora_leases_expired_total",
    "engine health": "agentic_lora_engine_up",
    "version-lag histogram": "agentic_lora_session_version_lag_bucket",
    "gateway refusals by code": "agentic_lora_gateway_failed_requests_total",
}


def load() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def panels(document: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in document["panels"]:
        yield panel
        yield from panel.get("panels", ())  # a collapsed row holds its panels


def queries(document: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target, with Grafana's macros expanded."""
    for panel in panels(document):
        for target in panel.get("targets", ()):
            expr = target["expr"]
            for macro, duration in MACROS.items():
                expr = expr.replace(macro, duration)
            yield f"{panel['title']} / {target['refId']}", expr


def test_every_query_parses_and_reads_declared_series_by_their_labels() -> None:
    found = list(queries(load()))
    assert len(found) >= 20
    for where, expr in found:
        assert problems(expr) == [], (where, expr)


def test_the_dashboard_covers_each_topic() -> None:
    read = {name for _, expr in queries(load()) for name in series_in(expr)}
    missing = {topic: name for topic, name in TOPICS.items() if name not in read}
    assert missing == {}
    # And every instrument of the catalogue is on some panel (a new one needs a panel too).
    unread = {s.instrument for s in SERIES.values()} - {SERIES[n].instrument for n in read}
    assert unread == set()


def test_the_dashboard_is_importable() -> None:
    document = load()
    assert (document["uid"], document["title"]) == ("agentic-lora", "agentic-lora")
    assert isinstance(document["schemaVersion"], int)
    assert document["id"] is None  # Grafana assigns it on import
    variables = {v["name"]: v for v in document["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance"):
        assert (
            problems(variables[name]["definition"].removeprefix("label_values(").rsplit(",", 1)[0])
            == []
        )
    ids = [p["id"] for p in panels(document)]
    assert len(ids) == len(set(ids))
    used = {(x, y) for p in panels(document) for x, y in _cells(p["gridPos"])}
    cells = sum(p["gridPos"]["w"] * p["gridPos"]["h"] for p in panels(document))
    assert len(used) == cells, "two panels overlap"
    for panel in panels(document):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["description"], panel["title"]
        assert panel["gridPos"]["x"] >= 0
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            # Every query is scoped to the chosen gateways.
            assert re.search(r'job=~"\$job", instance=~"\$instance"', target["expr"]), panel[
                "title"
            ]


def _cells(grid: dict[str, int]) -> Iterator[tuple[int, int]]:
    for x in range(grid["x"], grid["x"] + grid["w"]):
        for y in range(grid["y"], grid["y"] + grid["h"]):
            yield x, y


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        ("rate(agentic_lora_dispatches[5m])", "no series the exporter declares"),
        ("agentic_lora_dispatches_total", "counter read without rate"),
        ("rate(agentic_lora_sessions_live[5m])", "rate/increase over the gauge"),
        ("sum by (session) (agentic_lora_versions)", "groups by ['session']"),
        ('agentic_lora_versions{version="v1"}', "has no label 'version'"),
        (
            "histogram_quantile(0.9, sum by (outcome) (rate(agentic_lora_dispatch_seconds_bucket[5m])))",
            "drops `le`",
        ),
        ("histogram_quantile(0.9, sum by (le) (agentic_lora_versions))", "over no _bucket series"),
        ("sum(rate(agentic_lora_dispatches_total[5m])", "does not parse"),
    ],
)
def test_the_checker_catches_what_a_dashboard_gets_wrong(expr: str, problem: str) -> None:
    assert any(problem in p for p in problems(expr)), problems(expr)
