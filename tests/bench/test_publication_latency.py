"""bench/publication_latency.py's figures from recorded timings: the ABBA order, the ratios, the
goal and the breakdown of one publication (no speed is measured here)."""

import math

import pytest
from publication_latency import RATIO_GOAL
from publication_latency import ROWS
from publication_latency import breakdown
from publication_latency import breakdown_rows
from publication_latency import check_goal
from publication_latency import paired_ratio
from publication_latency import step_order

from agentic_lora.foundation.phases import Phase
from agentic_lora.foundation.phases import PhaseTiming


def test_rounds_alternate_which_step_goes_first():
    assert [step_order(k) for k in range(3)] == [
        ("publish", "direct"),
        ("direct", "publish"),
        ("publish", "direct"),
    ]


def test_paired_ratio_is_the_median_over_rounds_and_skips_empty_pairs():
    assert paired_ratio([1.0, 3.0, 1.2], [1.0, 2.0, 1.0]) == pytest.approx(1.2)
    assert paired_ratio([1.0, 5.0], [1.0, 0.0]) == pytest.approx(1.0)


def test_the_goal_is_the_pooled_median_ratio():
    held = check_goal([1.1, 1.1, 1.1], [1.0, 1.0, 1.0])
    assert held["holds"]
    assert held["value"] == pytest.approx(1.1)
    assert held["goal"] == RATIO_GOAL
    missed = check_goal([2.0, 2.0, 2.1], [1.0, 1.0, 1.0])
    assert not missed["holds"]
    assert missed["paired"] == pytest.approx(2.0)


def _t(engine, phase, seconds):
    return PhaseTiming(engine, phase, seconds, True)


def test_breakdown_splits_prepare_and_takes_the_slowest_engine():
    timings = [
        _t(None, Phase.RESERVE, 0.001),
        _t("E0", Phase.OBSERVE, 0.10),
        _t("E1", Phase.OBSERVE, 0.20),
        _t("E0", Phase.PREPARE, 0.50),
        _t("E1", Phase.PREPARE, 0.40),
        _t("E0", Phase.RECORD_READY, 0.002),
        _t("E1", Phase.RECORD_READY, 0.002),
        _t("E0", Phase.OBSERVE, 0.09),  # the second read, right before commit
        _t("E1", Phase.OBSERVE, 0.08),
        _t(None, Phase.COMMIT, 0.003),
    ]
    parts = {
        "E0": {"store_write": 0.05, "engine_load": 0.30, "probe": 0.05},
        "E1": {"store_write": 0.04, "engine_load": 0.25, "probe": 0.06},
    }
    row = breakdown(timings, parts, wall=0.80)
    assert set(row) == {key for key, _ in ROWS}
    assert row["reserve"] == pytest.approx(0.001)
    assert row["observe"] == pytest.approx(0.20)
    assert row["observe_again"] == pytest.approx(0.09)
    assert row["engine_load"] == pytest.approx(0.30)
    assert row["store_write"] == pytest.approx(0.05)
    # The prepare phase less the timed steps: E0 0.10, E1 0.05.
    assert row["engine_reads"] == pytest.approx(0.10)
    assert row["commit"] == pytest.approx(0.003)
    # Slowest engine path: E1 0.2 + 0.4 + 0.002 = 0.602 (E0: 0.602 too); the rest is "other".
    assert row["other"] == pytest.approx(0.80 - (0.001 + 0.602 + 0.09 + 0.003))


def test_breakdown_never_reports_negative_time():
    timings = [_t("E0", Phase.PREPARE, 0.1)]
    row = breakdown(timings, {"E0": {"engine_load": 0.2}}, wall=0.05)
    assert row["engine_reads"] == 0.0
    assert row["other"] == 0.0


def test_breakdown_table_has_every_row_then_the_total():
    rows = [
        {**{key: 0.001 * (i + 1) for i, (key, _) in enumerate(ROWS)}, "wall": 0.5},
        {**{key: 0.003 * (i + 1) for i, (key, _) in enumerate(ROWS)}, "wall": 0.7},
    ]
    table = breakdown_rows(rows)
    assert len(table) == len(ROWS) + 1
    assert table[-1][0] == "publish() total"
    assert table[-1][1] == pytest.approx(600.0)  # median of 500 and 700 ms
    assert all(not math.isnan(r[1]) for r in table)
