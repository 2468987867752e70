"""bench/policy_mixing.py without engines: admission during a drain, one segment's figures from
recorded turns (both attributions and their cross-check), and the JSON round trip."""

import asyncio
import math

import pytest
from mixing_analysis import Publication
from mixing_analysis import SwapWindow
from mixing_analysis import Turn
from policy_mixing import Admission
from policy_mixing import Segment
from policy_mixing import aggregate
from policy_mixing import analyse
from policy_mixing import segment_from
from policy_mixing import timeline

REFS = {0: (-7.6, -7.7), 1: (-7.7, -7.5), 2: (-7.5, -7.9)}


@pytest.mark.asyncio
async def test_a_drain_waits_for_the_trajectories_in_flight_and_admits_no_new_one():
    admission = Admission()
    await admission.enter()
    drained = asyncio.create_task(admission.drained())
    await asyncio.sleep(0)
    late = asyncio.create_task(admission.enter())
    await asyncio.sleep(0)
    assert not drained.done()
    assert not late.done()
    admission.leave()
    await drained
    assert not late.done()
    assert admission.in_flight == 0
    admission.reopen()
    await late
    assert admission.in_flight == 1


@pytest.mark.asyncio
async def test_a_drain_with_nothing_in_flight_returns_at_once():
    admission = Admission()
    await admission.drained()
    admission.reopen()
    await admission.enter()
    assert admission.in_flight == 1


def _inplace_segment():
    seg = Segment("inplace", 0, trajectories=["a", "b", "c", "d"])
    seg.windows = [SwapWindow("E0", 1, 10.0, 10.4), SwapWindow("E1", 1, 10.0, 10.3)]
    seg.publications = [Publication(1, 9.9, 10.4, True)]

    def turn(traj, i, engine, start, end, version, ok=True):
        return Turn(traj, 0, i, engine, start, end, ok, REFS[version] if ok else None)

    seg.turns = [
        # a: crosses the swap between turns: mixed by both attributions
        turn("a", 0, "E0", 5.0, 5.3, 0),
        turn("a", 1, "E0", 11.0, 11.3, 1),
        # b: its second turn is inside E1's swap window; the output says version 1
        turn("b", 0, "E1", 6.0, 6.3, 0),
        turn("b", 1, "E1", 10.1, 10.6, 1),
        # c: all before the swap
        turn("c", 0, "E0", 7.0, 7.2, 0),
        turn("c", 1, "E0", 8.0, 8.2, 0),
        # d: after the swap, one failed turn
        turn("d", 0, "E1", 12.0, 12.3, 1),
        turn("d", 1, "E1", 13.0, 13.1, 1, ok=False),
    ]
    return seg


def test_an_inplace_segment_is_scored_from_outputs_and_cross_checked_with_the_timeline():
    row = analyse(_inplace_segment(), REFS, 5.0, 15.0)
    assert (row["trajectories"], row["turns"], row["failed_turns"]) == (4, 8, 1)
    assert row["unidentified_turns"] == 0
    assert (row["mixed"], row["at_risk"]) == (2, 0)  # a and b, by their outputs
    assert row["timeline"] == {
        "mixed": 1,  # a
        "at_risk": 1,  # b: its turn overlapped the swap
        "clean": 2,
        "at_risk_turns": 1,
        "mixed_or_at_risk_fraction": 0.5,
    }
    assert row["attribution_disagreements"] == 0
    assert row["throughput_turns_s"] == pytest.approx(7 / 10)
    assert row["throughput_before_publication"] == pytest.approx(4 / 9.9)  # until 9.9 s
    assert row["max_gap_s"] == pytest.approx(15.0 - 12.3)  # the failed turn is no progress
    assert row["first_new_turn_s"] == pytest.approx(10.6 - 9.9)
    assert row["publication_s"]["mean"] == pytest.approx(0.5)
    # Turns dispatched after the publication returned on version 0 would be stale; none are.
    assert row["stale_turn_fraction"] == 0.0


def test_an_output_that_contradicts_the_timeline_is_counted():
    seg = _inplace_segment()
    seg.turns[5] = Turn("c", 0, 1, "E0", 8.0, 8.2, True, REFS[2])  # the timeline says 0
    row = analyse(seg, REFS, 5.0, 15.0)
    assert row["attribution_disagreements"] == 1
    assert row["mixed"] == 3


def test_a_pinned_segment_is_cross_checked_with_the_named_version():
    seg = Segment("pinned", 0, trajectories=["a", "b"])
    seg.publications = [Publication(1, 10.0, 10.5, True)]
    seg.turns = [
        Turn("a", 0, 0, "E0", 5.0, 5.3, True, REFS[0], 0),
        Turn("a", 0, 1, "E0", 11.0, 11.3, True, REFS[0], 0),  # pinned: stale, not mixed
        Turn("b", 1, 0, "E1", 11.0, 11.4, True, REFS[1], 1),
    ]
    row = analyse(seg, REFS, 5.0, 12.0)
    assert (row["mixed"], row["timeline"]["mixed"], row["attribution_disagreements"]) == (0, 0, 0)
    assert row["stale_turn_fraction"] == pytest.approx(1 / 3)
    assert row["first_new_turn_s"] == pytest.approx(1.4)


def test_a_recorded_segment_scores_the_same_after_the_json_round_trip():
    seg = _inplace_segment()
    again = segment_from(timeline(seg, REFS))
    assert again.turns == seg.turns
    assert again.windows == seg.windows
    assert analyse(again, REFS, 5.0, 15.0) == analyse(seg, REFS, 5.0, 15.0)


def test_aggregate_pairs_the_ratios_within_each_repeat():
    def row(strategy, repeat, thr, pub, mixed=0):
        return {
            "strategy": strategy, "repeat": repeat, "mixed": mixed, "trajectories": 10,
            "mixed_fraction": mixed / 10, "throughput_turns_s": thr, "max_gap_s": 1.0,
            "first_new_turn_s": 1.0, "stale_turn_fraction": 0.0, "publication_s": {"mean": pub}, "turns_per_cpu_s": thr / 2,
            "throughput_before_publication": thr / 10 if strategy == "inplace" else 1.0,
            "failed_turns": 0, "unidentified_turns": 0, "publications": 3,
        }  # fmt: skip

    rows = [
        row("inplace", 0, 10.0, 0.3, mixed=4), row("drain", 0, 6.0, 8.0), row("pinned", 0, 9.9, 0.6),
        row("pinned", 1, 8.0, 0.7), row("drain", 1, 5.0, 6.0), row("inplace", 1, 9.0, 0.4, mixed=5),
    ]  # fmt: skip
    s = aggregate(rows)
    assert s["ratios"]["throughput_pinned_over_inplace"] == pytest.approx([0.99, 8 / 9])
    assert s["ratios"]["barrier_pinned_over_drain"] == pytest.approx([0.075, 0.7 / 6])
    assert s["ratios"]["turns_per_cpu_s_pinned_over_inplace"] == pytest.approx([0.99, 8 / 9])
    assert s["ratios"]["before_publication_drain_over_inplace"] == pytest.approx([1.0, 10 / 9])
    assert s["inplace"]["mixed"] == 9
    assert s["pinned"]["mixed"] == 0
    goals = list(s["goals"].values())
    assert goals == [True, False, True]  # median throughput ratio 0.944 < 0.97
    assert not math.isnan(s["pinned"]["throughput_turns_s"]["median"])


def test_goals_of_strategies_that_did_not_run_are_left_out():
    row = {
        "strategy": "inplace", "repeat": 0, "mixed": 3, "trajectories": 10, "mixed_fraction": 0.3,
        "throughput_turns_s": 10.0, "max_gap_s": 1.0, "first_new_turn_s": 1.0,
        "stale_turn_fraction": 0.0, "publication_s": {"mean": 0.5}, "turns_per_cpu_s": 5.0,
        "throughput_before_publication": 9.0, "failed_turns": 0, "unidentified_turns": 0,
        "publications": 2,
    }  # fmt: skip
    assert aggregate([row])["goals"] == {}
