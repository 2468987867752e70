"""The alert rules and the scrape example (deploy/prometheus/): rules Prometheus would load,
over series the exporter declares, each with what a person needs to act on it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import promql_parser
import yaml

from tests.deploy.promql_check import problems
from tests.deploy.promql_check import series_in

HERE = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULES = HERE / "agentic-lora-rules.yml"
SCRAPE = HERE / "prometheus.yml"
DOCS = Path(__file__).resolve().parents[2] / "docs"
#: The states that need a person, and the series each alert on it must read.
REQUIRED = {
    "a publication blocked too long": "agentic_lora_versions",
    "an engine unhealthy": "agentic_lora_engine_up",
    "an engine ejected": "agentic_lora_engine_members",
    "capacity exhausted": "agentic_lora_publications_total",
    "leases expiring in bulk": "agentic_lora_leases_expired_total",
}
_TEMPLATE_FIELD = re.compile(r"\{\{\s*\$(labels\.([a-z_]+)|value)\b")


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    assert set(document) == {"groups"}
    found: list[dict[str, Any]] = []
    for group in document["groups"]:
        assert set(group) <= {"name", "interval", "rules"}
        found.extend(group["rules"])
    return found


def test_every_rule_is_well_formed_and_reads_declared_series() -> None:
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names))
    for rule in rules():
        name = rule["alert"]
        assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
        assert re.fullmatch(r"AgenticLoRA[A-Z][A-Za-z]+", name), name
        assert problems(rule["expr"]) == [], (name, rule["expr"])
        # An alert's expression is a filter: it ends in a comparison or a set operation.
        top = promql_parser.parse(rule["expr"])
        assert isinstance(top, promql_parser.BinaryExpr), name
        if "for" in rule:
            assert promql_parser.parse_duration(rule["for"]).total_seconds() > 0, name
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        annotations = rule["annotations"]
        assert set(annotations) >= {"summary", "description"}, name
        assert len(annotations["description"]) > 80, name


def test_annotations_only_name_labels_the_alert_keeps() -> None:
    for rule in rules():
        kept = _grouped_labels(promql_parser.parse(rule["expr"]))
        for text in rule["annotations"].values():
            for match in _TEMPLATE_FIELD.finditer(text):
                label = match.group(2)
                if label is not None:
                    assert label in kept, (rule["alert"], label, kept)


def _grouped_labels(node: Any) -> set[str]:
    """The labels an expression's result keeps (those of its outermost aggregations)."""
    if isinstance(node, promql_parser.AggregateExpr):
        return set(node.modifier.labels) if node.modifier is not None else set()
    if isinstance(node, promql_parser.BinaryExpr):
        return _grouped_labels(node.lhs) | _grouped_labels(node.rhs)
    if isinstance(node, promql_parser.ParenExpr):
        return _grouped_labels(node.expr)
    return set()


def test_each_state_that_needs_a_person_has_an_alert() -> None:
    read = {name for rule in rules() for name in series_in(rule["expr"])}
    assert {state: s for state, s in REQUIRED.items() if s not in read} == {}


def test_runbooks_the_alerts_point_to_exist() -> None:
    headings = {
        line.lstrip("#").strip()
        for page in DOCS.glob("*.md")
        for line in page.read_text().splitlines()
        if line.startswith("#")
    }
    checked = 0
    for rule in rules():
        for runbook in re.findall(r'"([^"]+)"\)', rule["annotations"]["description"]):
            assert runbook in headings, (rule["alert"], runbook)
            checked += 1
    assert checked >= 5


def test_the_scrape_example_loads_the_rules_and_scrapes_metrics() -> None:
    config = yaml.safe_load(SCRAPE.read_text())
    assert [(HERE / f).is_file() for f in config["rule_files"]] == [True]
    assert config["rule_files"] == [RULES.name]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "agentic-lora"
    assert job["metrics_path"] == "/metrics"
    interval = promql_parser.parse_duration(job["scrape_interval"])
    assert promql_parser.parse_duration(job["scrape_timeout"]) < interval
    assert job["static_configs"][0]["targets"]


def test_the_docs_list_every_alert() -> None:
    page = (DOCS / "operating.md").read_text()
    listed = set(re.findall(r"^\| `(AgenticLoRA[A-Za-z]+)` \|", page, flags=re.MULTILINE))
    assert listed == {rule["alert"] for rule in rules()}
