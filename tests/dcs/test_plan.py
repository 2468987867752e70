"""The bucket plan: a pure function of the manifest and the limit, checked by both sides."""

from __future__ import annotations

import json
import random

import pytest
from agentic_lora_dcs.plan import BucketPlan
from agentic_lora_dcs.plan import plan_for_snapshot
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from agentic_lora.errors import InvalidAdapterError
from agentic_lora.foundation.identity import tensor_sha256
from tests.dcs.util import make_snapshot

Entry = tuple[str, str, tuple[int, ...], str, int]


@st.composite
def manifests(draw: st.DrawFn) -> tuple[list[Entry], dict[str, bytes]]:
    names = draw(
        st.lists(st.text("abcxyz._", min_size=1, max_size=6), unique=True, min_size=1, max_size=12)
    )
    entries: list[Entry] = []
    data: dict[str, bytes] = {}
    for name in names:
        elements = draw(st.integers(0, 40))
        raw = draw(st.binary(min_size=4 * elements, max_size=4 * elements))
        data[name] = raw
        entries.append((name, "F32", (elements,), tensor_sha256(raw), len(raw)))
    return entries, data


@given(manifests(), st.integers(1, 200), st.randoms(use_true_random=False))
def test_packing_is_sorted_greedy_bounded_and_independent_of_input_order(
    manifest: tuple[list[Entry], dict[str, bytes]], limit: int, rnd: random.Random
) -> None:
    entries, _ = manifest
    plan = BucketPlan.build(entries, limit)

    assert [s.name for s in plan.tensors] == sorted(e[0] for e in entries)
    for position, bucket in enumerate(plan.buckets):
        assert bucket.index == position
        offsets = [s.offset for s in bucket.tensors]
        assert offsets == [sum(s.nbytes for s in bucket.tensors[:i]) for i in range(len(offsets))]
        assert bucket.nbytes == sum(s.nbytes for s in bucket.tensors)
        assert bucket.nbytes <= limit or len(bucket.tensors) == 1
        if position + 1 < len(plan.buckets):
            # Greedy: the next tensor did not fit into this bucket.
            assert bucket.nbytes + plan.buckets[position + 1].tensors[0].nbytes > limit
    shuffled = list(entries)
    rnd.shuffle(shuffled)
    assert BucketPlan.build(shuffled, limit) == plan
    assert plan.is_canonical()
    assert BucketPlan.model_validate_json(plan.model_dump_json()) == plan


@given(manifests(), st.integers(1, 200), st.data())
def test_pack_then_unpack_gives_the_bytes_back_and_flags_exactly_a_corrupted_tensor(
    manifest: tuple[list[Entry], dict[str, bytes]], limit: int, data: st.DataObject
) -> None:
    entries, tensors = manifest
    plan = BucketPlan.build(entries, limit)
    received: dict[str, bytes] = {}
    for bucket in plan.buckets:
        got, mismatches = plan.unpack(bucket.index, bytes(plan.pack(bucket.index, tensors)))
        assert mismatches == []
        received.update(got)
    assert received == tensors

    victim = data.draw(st.sampled_from([s for s in plan.tensors if s.nbytes > 0] or [None]))
    if victim is None:
        return
    bucket = next(b for b in plan.buckets if victim in b.tensors)
    raw = plan.pack(bucket.index, tensors)
    raw[victim.offset + data.draw(st.integers(0, victim.nbytes - 1))] ^= 0x80
    _, mismatches = plan.unpack(bucket.index, bytes(raw))
    assert [m.tensor for m in mismatches] == [victim.name]
    assert mismatches[0].expected == victim.sha256


def test_a_plan_packed_with_another_limit_is_not_canonical() -> None:
    plan = plan_for_snapshot(make_snapshot(seed=61), 1024)
    assert len(plan.buckets) > 1
    relabelled = BucketPlan(bucket_bytes=plan.bucket_bytes * 4, buckets=plan.buckets)
    assert plan.is_canonical()
    assert not relabelled.is_canonical()
    assert not BucketPlan(format="other/1", bucket_bytes=1024, buckets=plan.buckets).is_canonical()


def test_snapshot_plans_carry_the_manifest_checksums() -> None:
    snapshot = make_snapshot(seed=62)
    plan = plan_for_snapshot(snapshot, 1024)
    assert plan.manifest_entries() == snapshot.manifest.tensors
    assert plan.total_bytes == snapshot.nbytes
    assert json.loads(plan.model_dump_json())["format"] == "agentic-lora-dcs-plan/1"


def test_bad_plans_are_typed_errors() -> None:
    sha = tensor_sha256(b"")
    with pytest.raises(InvalidAdapterError) as empty:
        BucketPlan.build([], 10)
    assert empty.value.details["reason"] == "empty"
    with pytest.raises(InvalidAdapterError) as duplicate:
        BucketPlan.build([("a", "F32", (0,), sha, 0), ("a", "F32", (0,), sha, 0)], 10)
    assert duplicate.value.details["reason"] == "bad_plan"
    with pytest.raises(InvalidAdapterError):
        BucketPlan.build([("a", "F32", (0,), sha, 0)], 0)
    with pytest.raises(ValidationError, match="do not fit"):
        BucketPlan.build([("a", "F32", (3,), sha, 8)], 10)
    with pytest.raises(ValidationError, match="unknown dtype"):
        BucketPlan.build([("a", "Q4", (3,), sha, 12)], 10)
    plan = BucketPlan.build([("a", "F32", (1,), tensor_sha256(b"abcd"), 4)], 10)
    with pytest.raises(InvalidAdapterError) as short:
        plan.pack(0, {"a": b"abc"})
    assert short.value.details["reason"] == "shape_mismatch"
    with pytest.raises(ValueError, match="expected 4"):
        plan.unpack(0, b"abc")
