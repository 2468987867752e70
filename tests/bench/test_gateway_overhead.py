"""bench/gateway_overhead.py's figures from recorded blocks: the proxies' CPU per request with the
idle rate taken out, the p50 ratios, the goals and the table (no speed is measured here)."""

import math

import pytest
from gateway_overhead import CPU_GOAL_US
from gateway_overhead import P50_RATIO_GOAL
from gateway_overhead import TABLE_HEADERS
from gateway_overhead import Block
from gateway_overhead import check_goals
from gateway_overhead import goal_lines
from gateway_overhead import level_report
from gateway_overhead import level_rows
from gateway_overhead import parse_levels
from gateway_overhead import proxy_cpu_us


def _block(variant, latencies, *, wall=1.0, gateway=0.0, floor=0.0, failures=0):
    return Block(
        variant,
        latencies=list(latencies),
        wall=wall,
        client_cpu=0.001 * len(latencies),
        proxy_cpu={"gateway": gateway, "floor": floor},
        failures=failures,
    )


def test_levels_parse_and_refuse_nonsense():
    assert parse_levels("1,64") == [1, 64]
    assert parse_levels(" 8 ,") == [8]
    for bad in ("", "0", "1,-4"):
        with pytest.raises(ValueError, match="must be positive"):
            parse_levels(bad)


def test_proxy_cpu_takes_out_the_idle_rate_seen_in_the_other_blocks():
    blocks = [
        # Idle: 2 ms of gateway CPU over 2 s of other variants' blocks -> 1 ms/s.
        _block("direct", [0.01] * 10, wall=1.0, gateway=0.001),
        _block("floor", [0.01] * 10, wall=1.0, gateway=0.001, floor=0.005),
        # Busy: 20 requests (one failed) over 2 s, 0.102 s of CPU.
        _block("gateway", [0.02] * 9, wall=1.0, gateway=0.051, failures=1),
        _block("gateway", [0.02] * 10, wall=1.0, gateway=0.051),
    ]
    cpu = proxy_cpu_us(blocks, "gateway")
    assert cpu["raw_us_per_request"] == pytest.approx(0.102 / 20 * 1e6)
    assert cpu["idle_us_per_s"] == pytest.approx(1000.0)
    assert cpu["us_per_request"] == pytest.approx((0.102 - 0.001 * 2) / 20 * 1e6)
    # The floor's own figure, from its own process's column.
    assert proxy_cpu_us(blocks, "floor")["raw_us_per_request"] == pytest.approx(500.0)


def test_proxy_cpu_without_requests_is_not_a_number():
    cpu = proxy_cpu_us([_block("direct", [0.01])], "gateway")
    assert math.isnan(cpu["us_per_request"])


def test_level_report_gives_each_proxy_its_ratios_to_direct():
    blocks = [
        _block("direct", [0.010, 0.010, 0.010]),
        _block("gateway", [0.011, 0.011, 0.011], gateway=0.0003),
        _block("gateway", [0.012, 0.012, 0.012], gateway=0.0003),
        _block("direct", [0.010, 0.010, 0.010]),
    ]
    level = level_report(blocks)
    assert set(level["variants"]) == {"direct", "gateway"}  # no floor blocks, no floor row
    gateway = level["variants"]["gateway"]
    assert gateway["p50_ratio"] == pytest.approx(1.15)
    assert gateway["p50_ratio_paired"] == pytest.approx(1.15)  # rounds: 1.1 and 1.2
    assert gateway["proxy_cpu"]["us_per_request"] == pytest.approx(100.0)
    assert "p50_ratio" not in level["variants"]["direct"]


def test_goals_judge_the_ratio_on_sglang_and_the_cpu_on_the_instant_engine():
    def level(ratio, cpu):
        return {"variants": {"gateway": {"p50_ratio": ratio, "proxy_cpu": {"us_per_request": cpu}}}}

    sglang = check_goals("sglang", {1: level(1.01, 900.0), 64: level(1.2, 900.0)})
    assert [c["holds"] for c in sglang.values()] == [True, False]
    assert all(c["goal"] == P50_RATIO_GOAL for c in sglang.values())
    instant = check_goals("instant", {1: level(9.0, 120.0), 64: level(9.0, 151.0)})
    assert [c["holds"] for c in instant.values()] == [True, False]
    assert all(c["goal"] == CPU_GOAL_US for c in instant.values())
    lines = goal_lines(instant)
    assert lines[0].strip().startswith("HOLDS")
    assert lines[1].strip().startswith("MISSED")
    assert "151.000" in lines[1]


def test_table_rows_match_the_headers_and_mark_what_a_variant_has_not():
    blocks = [
        _block("direct", [0.01]),
        _block("floor", [0.011], floor=0.0002),
        _block("gateway", [0.012], gateway=0.0003),
    ]
    rows = level_rows("instant", {1: level_report(blocks)})
    assert [r[0] for r in rows] == [
        "instant c=1 direct",
        "instant c=1 floor",
        "instant c=1 gateway",
    ]
    assert all(len(r) == len(TABLE_HEADERS) for r in rows)
    assert math.isnan(rows[0][4])  # direct has no ratio to itself
    assert rows[2][4] == pytest.approx(1.2)
