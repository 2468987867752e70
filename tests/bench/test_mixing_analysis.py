"""The pure parts of bench/policy_mixing.py: workload, attribution, mixing, the figures."""

import math

import pytest
from common import max_gap
from mixing_analysis import AT_RISK
from mixing_analysis import Publication
from mixing_analysis import SwapWindow
from mixing_analysis import Turn
from mixing_analysis import WorkloadSpec
from mixing_analysis import count_mixing
from mixing_analysis import duration_quantile
from mixing_analysis import first_completion_on
from mixing_analysis import identify
from mixing_analysis import live_version
from mixing_analysis import operator_capacity
from mixing_analysis import plan_trajectory
from mixing_analysis import throughput
from mixing_analysis import timeline_version
from mixing_analysis import version_lags


def _turn(engine="E0", dispatched=0.0, finished=1.0, **kw):
    return Turn(
        kw.pop("trajectory", "t"), 0, 0, engine, dispatched, finished, kw.pop("ok", True), **kw
    )


# --- workload ------------------------------------------------------------------------------------


def test_a_plan_is_a_function_of_its_seed_repeat_agent_and_index():
    spec = WorkloadSpec()
    a = plan_trajectory(spec, seed=7, repeat=1, agent=2, index=3)
    assert a == plan_trajectory(spec, seed=7, repeat=1, agent=2, index=3)
    others = {
        plan_trajectory(spec, seed=7, repeat=1, agent=2, index=4),
        plan_trajectory(spec, seed=7, repeat=2, agent=2, index=3),
        plan_trajectory(spec, seed=8, repeat=1, agent=2, index=3),
    }
    assert a not in others


@pytest.mark.parametrize("wait", ["lognormal", "pareto"])
def test_plans_respect_the_turn_range_and_the_wait_cap(wait):
    spec = WorkloadSpec(min_turns=3, max_turns=5, wait=wait, wait_median=0.5, wait_cap=4.0)
    plans = [plan_trajectory(spec, seed=1, repeat=0, agent=0, index=i) for i in range(500)]
    assert {p.turns for p in plans} == {3, 4, 5}
    waits = [w for p in plans for w in p.waits]
    assert all(0 < w <= 4.0 for w in waits)
    assert max(waits) == 4.0  # the tail reaches the cap in 500 plans: it is long
    assert all(len(p.tool_outputs) == len(p.waits) == p.turns - 1 for p in plans)
    if wait == "pareto":
        assert min(waits) >= 0.5  # a Pareto wait never falls below its scale


def test_lognormal_waits_have_the_median_asked_for():
    spec = WorkloadSpec(min_turns=8, max_turns=8, wait_median=0.4, wait_sigma=1.2, wait_cap=1e9)
    waits = sorted(
        w
        for i in range(1000)
        for w in plan_trajectory(spec, seed=3, repeat=0, agent=0, index=i).waits
    )
    assert waits[len(waits) // 2] == pytest.approx(0.4, rel=0.1)


@pytest.mark.parametrize(
    "kwargs",
    [{"min_turns": 0}, {"min_turns": 3, "max_turns": 2}, {"wait_median": 0}, {"wait_cap": 0}],
)
def test_a_bad_workload_is_refused(kwargs):
    with pytest.raises(ValueError, match=r"must|need"):
        WorkloadSpec(**kwargs)


def test_duration_quantiles_grow_with_q_and_include_the_turns():
    spec = WorkloadSpec(min_turns=4, max_turns=4)
    p50 = duration_quantile(spec, turn_seconds=0.5, q=0.5, seed=1, samples=2000)
    p99 = duration_quantile(spec, turn_seconds=0.5, q=0.99, seed=1, samples=2000)
    assert 4 * 0.5 < p50 < p99
    assert p50 == duration_quantile(spec, turn_seconds=0.5, q=0.5, seed=1, samples=2000)


@pytest.mark.parametrize(
    ("duration", "cadence", "slots"), [(0.0, 6.0, 2), (12.0, 6.0, 4), (12.1, 6.0, 5), (1.0, 6.0, 3)]
)
def test_operator_capacity_is_default_candidate_and_one_slot_per_retired_version(
    duration, cadence, slots
):
    assert operator_capacity(duration, cadence) == slots


def test_operator_capacity_refuses_a_nonsense_cadence():
    with pytest.raises(ValueError, match="cadence > 0"):
        operator_capacity(1.0, 0.0)


# --- attribution ---------------------------------------------------------------------------------

REFS = {0: (-7.6, -7.7, -7.6), 1: (-7.7, -7.5, -7.6), 2: (-7.6, -7.7, -7.7)}


def test_identify_matches_the_reference_a_fingerprint_equals():
    assert identify((-7.7, -7.5, -7.6), REFS) == 1
    assert identify((-7.701, -7.5, -7.599), REFS) == 1  # batching noise within the tolerance


def test_identify_compares_the_positions_both_have():
    assert identify((-7.7, -7.5), REFS) == 1


@pytest.mark.parametrize(
    "fingerprint",
    [
        None,
        (),
        (-1.0, -1.0, -1.0),  # far from every reference
        (-7.6, -7.7, -7.65),  # halfway between references 0 and 2: not guessed
    ],
)
def test_identify_leaves_what_it_cannot_tell_unidentified(fingerprint):
    assert identify(fingerprint, REFS) is None


def test_identify_without_references_is_unidentified():
    assert identify((-7.6,), {}) is None


SWAPS = [
    SwapWindow("E0", 1, 10.0, 10.5),
    SwapWindow("E1", 1, 10.0, 11.0),
    SwapWindow("E0", 2, 20.0, 20.2),
]


@pytest.mark.parametrize(
    ("engine", "dispatched", "finished", "expected"),
    [
        ("E0", 1.0, 2.0, 0),  # before any swap
        ("E0", 10.6, 12.0, 1),  # after swap 1 ended on its engine
        ("E1", 10.6, 12.0, AT_RISK),  # E1's swap 1 was still running
        ("E0", 9.0, 10.1, AT_RISK),  # in flight when the unload came
        ("E0", 10.2, 10.4, AT_RISK),  # dispatched inside the window
        ("E0", 9.0, 10.0, 0),  # finished exactly as the swap began
        ("E0", 10.5, 11.0, 1),  # dispatched exactly as it ended
        ("E0", 25.0, 26.0, 2),
        ("E1", 25.0, 26.0, 1),  # E1 never got version 2
    ],
)
def test_timeline_version(engine, dispatched, finished, expected):
    assert timeline_version(_turn(engine, dispatched, finished), SWAPS) == expected


def test_timeline_version_starts_from_the_initial_version():
    assert timeline_version(_turn(dispatched=1.0, finished=2.0), [], initial=5) == 5


def test_count_mixing_sorts_trajectories_into_mixed_at_risk_and_clean():
    m = count_mixing(
        {
            "mixed": [0, 0, 1],
            "mixed-with-unknown": [0, None, 1],
            "unknown": [0, None, 0],
            "all-unknown": [None],
            "clean": [2, 2, 2],
            "one-turn": [3],
        }
    )
    assert (m.trajectories, m.mixed, m.at_risk, m.clean) == (6, 2, 2, 2)
    assert m.mixed_fraction == pytest.approx(2 / 6)
    assert m.mixed_or_at_risk_fraction == pytest.approx(4 / 6)


def test_no_trajectories_have_no_fraction():
    assert math.isnan(count_mixing({}).mixed_fraction)


# --- figures -------------------------------------------------------------------------------------


def test_throughput_counts_completions_inside_the_window():
    assert throughput([0.5, 1.0, 2.0, 3.0, 3.5], 1.0, 3.0) == pytest.approx(3 / 2)


def test_throughput_of_an_empty_window_is_refused():
    with pytest.raises(ValueError, match="empty window"):
        throughput([1.0], 2.0, 2.0)


def test_max_gap_counts_the_window_edges():
    assert max_gap([2.0, 2.5, 3.0], 0.0, 4.0) == pytest.approx(2.0)
    assert max_gap([1.0, 1.5, 5.0, 9.5], 1.0, 10.0) == pytest.approx(4.5)
    assert max_gap([], 1.0, 4.0) == pytest.approx(3.0)
    assert max_gap([0.5, 4.5], 1.0, 4.0) == pytest.approx(3.0)  # outside the window: ignored


def test_first_completion_on_a_version_after_its_publication():
    done = [(1.0, 0), (5.0, 1), (6.0, 1), (4.0, 1), (7.0, None)]
    assert first_completion_on(done, 1, 3.0) == pytest.approx(1.0)
    assert first_completion_on(done, 1, 4.5) == pytest.approx(0.5)
    assert math.isnan(first_completion_on(done, 2, 0.0))


PUBS = [
    Publication(1, 10.0, 10.5, True),
    Publication(2, 20.0, 20.5, False, "SKIPPED"),
    Publication(2, 30.0, 31.0, True),
]


def test_live_version_is_the_newest_successful_publication_returned():
    assert [live_version(PUBS, t) for t in (5.0, 10.4, 10.5, 25.0, 31.0)] == [0, 0, 1, 1, 2]
    assert PUBS[2].seconds == pytest.approx(1.0)


def test_version_lags_count_versions_behind_the_newest_at_dispatch():
    turns = [(5.0, 0), (12.0, 0), (12.0, 1), (32.0, 0), (32.0, None), (32.0, 2)]
    assert version_lags(turns, PUBS) == [0, 1, 0, 2, 0]
