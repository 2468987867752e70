"""Checks PromQL written against the exporter (the dashboard's panels, the alert rules) without
a Prometheus: each expression is parsed by a real PromQL parser, and every series it names must
be one the metrics catalogue (:data:`agentic_lora.assembly.metrics.CATALOGUE`) really exposes,
selected and grouped only by labels that series has.

Rules beyond parsing, each a mistake a dashboard can make and still render (empty):

* a series name that no instrument exposes (a renamed metric, a typo, a counter without
  ``_total``, a histogram read without ``_bucket``/``_sum``/``_count``);
* a label the series does not carry (``job`` and ``instance`` are Prometheus' own target labels;
  ``le`` exists on ``_bucket`` series only);
* ``rate``/``increase``/``irate`` over a gauge (they assume a counter's resets), or a gauge read
  without a counter function being a counter (a raw counter on a graph climbs forever);
* ``histogram_quantile`` whose input does not keep ``le``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import promql_parser
from prometheus_client import Counter
from prometheus_client import Histogram

from agentic_lora.assembly.metrics import CATALOGUE

__all__ = ["SERIES", "TARGET_LABELS", "Series", "problems", "series_in"]

#: Labels Prometheus attaches to every scraped series.
TARGET_LABELS = frozenset({"job", "instance"})
_COUNTER_FUNCTIONS = frozenset({"rate", "increase", "irate", "resets"})


@dataclass(frozen=True)
class Series:
    """One series name a scrape shows: its instrument's name and kind, and its labels."""

    instrument: str
    kind: str  # counter, gauge, bucket, sum, count
    labels: frozenset[str]

    @property
    def counts(self) -> bool:
        """A monotonic series (a counter, or a histogram's parts)."""
        return self.kind != "gauge"


def _exposed() -> dict[str, Series]:
    series: dict[str, Series] = {}
    for spec in CATALOGUE:
        labels = frozenset(spec.labels)
        if spec.kind is Counter:
            series[spec.exposed] = Series(spec.exposed, "counter", labels)
        elif spec.kind is Histogram:
            series[f"{spec.exposed}_bucket"] = Series(spec.exposed, "bucket", labels | {"le"})
            series[f"{spec.exposed}_sum"] = Series(spec.exposed, "sum", labels)
            series[f"{spec.exposed}_count"] = Series(spec.exposed, "count", labels)
        else:
            series[spec.exposed] = Series(spec.exposed, "gauge", labels)
    return series


#: Every series name the exporter declares.
SERIES: dict[str, Series] = _exposed()


def _children(node: Any) -> list[Any]:
    if isinstance(node, promql_parser.BinaryExpr):
        return [node.lhs, node.rhs]
    if isinstance(node, promql_parser.AggregateExpr):
        return [node.expr, *([node.param] if node.param is not None else [])]
    if isinstance(node, promql_parser.Call):
        return list(node.args)
    if isinstance(
        node, promql_parser.ParenExpr | promql_parser.UnaryExpr | promql_parser.SubqueryExpr
    ):
        return [node.expr]
    if isinstance(node, promql_parser.MatrixSelector):
        return [node.vector_selector]
    return []


def _selectors(node: Any) -> list[Any]:
    if isinstance(node, promql_parser.VectorSelector):
        return [node]
    return [s for child in _children(node) for s in _selectors(child)]


def series_in(expr: str) -> set[str]:
    """The series names ``expr`` selects (it must parse)."""
    return {s.name for s in _selectors(promql_parser.parse(expr)) if s.name}


def problems(expr: str) -> list[str]:
    """What is wrong with ``expr`` (empty: nothing this module can see)."""
    try:
        tree = promql_parser.parse(expr)
    except ValueError as exc:
        return [f"does not parse: {exc}"]
    found: list[str] = []
    _check(tree, found, under_counter_function=False)
    return found


def _labels_below(node: Any) -> frozenset[str]:
    """Every label the series under ``node`` can carry."""
    labels: set[str] = set(TARGET_LABELS)
    for selector in _selectors(node):
        known = SERIES.get(selector.name or "")
        if known is not None:
            labels |= known.labels
    return frozenset(labels)


def _check(node: Any, found: list[str], *, under_counter_function: bool) -> None:
    if isinstance(node, promql_parser.VectorSelector):
        _check_selector(node, found, under_counter_function)
        return
    if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
        unknown = set(node.modifier.labels) - _labels_below(node.expr)
        if unknown:
            found.append(f"{node.op} groups by {sorted(unknown)}, which no series under it has")
    if isinstance(node, promql_parser.Call):
        name = node.func.name
        if name == "histogram_quantile":
            inner = node.args[1]
            kept = inner.modifier.labels if isinstance(inner, promql_parser.AggregateExpr) else ()
            if not isinstance(inner, promql_parser.AggregateExpr) or "le" not in kept:
                found.append("histogram_quantile over an aggregation that drops `le`")
            if not any(
                SERIES.get(s.name or "") and SERIES[s.name].kind == "bucket"
                for s in _selectors(inner)
            ):
                found.append("histogram_quantile over no _bucket series")
        for child in node.args:
            _check(child, found, under_counter_function=name in _COUNTER_FUNCTIONS)
        return
    for child in _children(node):
        _check(child, found, under_counter_function=under_counter_function)


def _check_selector(node: Any, found: list[str], under_counter_function: bool) -> None:
    name = node.name or ""
    series = SERIES.get(name)
    if series is None:
        found.append(f"{name!r} is no series the exporter declares")
        return
    for matcher in node.matchers.matchers:
        if matcher.name != "__name__" and matcher.name not in series.labels | TARGET_LABELS:
            found.append(f"{name} has no label {matcher.name!r}")
    if under_counter_function and not series.counts:
        found.append(f"rate/increase over the gauge {name}")
    if not under_counter_function and series.counts:
        found.append(f"{name} is a counter read without rate/increase")
