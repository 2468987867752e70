"""The metric catalogue is what a scrape shows and what the docs list: no instrument is
undocumented, no documented metric is missing, and each one's type and labels agree."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import Counter
from prometheus_client import Gauge
from prometheus_client import Histogram
from prometheus_client.parser import text_string_to_metric_families

import agentic_lora.assembly.metrics as metrics_module
from agentic_lora.assembly.metrics import CATALOGUE
from agentic_lora.assembly.metrics import Metrics

DOCS = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"
KINDS: dict[type[object], str] = {Counter: "counter", Gauge: "gauge", Histogram: "histogram"}
NAME = re.compile(r"`(agentic_lora_[a-z_]+)`")


def table_rows(text: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.strip().startswith("| `agentic_lora_")
    ]


def test_a_scrape_shows_every_instrument_of_the_catalogue_and_nothing_else() -> None:
    families = {
        family.name: family.type
        for family in text_string_to_metric_families(Metrics().exposition().decode())
        # prometheus_client adds a ``_created`` timestamp beside each counter and histogram.
        if not family.name.endswith("_created")
    }
    # The parser names a counter family without its ``_total`` sample suffix.
    expected = {spec.exposed.removesuffix("_total"): KINDS[spec.kind] for spec in CATALOGUE}
    assert families == expected


def test_the_module_table_gives_each_instrument_its_type_and_labels() -> None:
    assert metrics_module.__doc__ is not None
    rows = {
        name.strip("`"): (kind, labels)
        for name, kind, labels, _ in table_rows(metrics_module.__doc__)
    }
    assert rows == {spec.exposed: (KINDS[spec.kind], ", ".join(spec.labels)) for spec in CATALOGUE}


def test_the_gateway_page_lists_each_instrument_with_its_labels() -> None:
    section = DOCS.read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    # One row may list several metrics; the first cell says which and marks a histogram.
    listed = {name: row for row in table_rows(section) for name in NAME.findall(row[0])}
    assert set(listed) == {spec.exposed for spec in CATALOGUE}
    for spec in CATALOGUE:
        names, labels = listed[spec.exposed]
        assert ("(histogram)" in names) == (spec.kind is Histogram), spec.exposed
        for label in spec.labels:
            assert f"`{label}`" in labels, (spec.exposed, label)
