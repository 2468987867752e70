"""Adapter snapshots against real PEFT and torch: one content, one digest, lossless files."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import struct
import subprocess
import sys
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from typing import cast

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from peft import PeftModel
from peft import get_peft_model_state_dict

from agentic_lora.adapters import safetensors_io
from agentic_lora.adapters.snapshot import CONFIG_FILE
from agentic_lora.adapters.snapshot import WEIGHTS_FILE
from agentic_lora.adapters.snapshot import AdapterProblem
from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.adapters.snapshot import TensorBlob
from agentic_lora.adapters.snapshot import normalize_config
from agentic_lora.errors import InvalidAdapterError
from agentic_lora.errors import InvalidIdentityError
from agentic_lora.errors import error_from_code
from agentic_lora.foundation.identity import Manifest
from agentic_lora.foundation.identity import compute_digest
from agentic_lora.foundation.identity import thaw_json
from tests.adapters_util import TinyDecoder
from tests.adapters_util import f32
from tests.adapters_util import lora_config
from tests.adapters_util import peft_model
from tests.adapters_util import tiny_blobs
from tests.adapters_util import tiny_config

# The safetensors package's own parser, typed (it ships without annotations).
reference_deserialize = cast(
    Callable[[bytes], list[tuple[str, dict[str, Any]]]], safetensors.deserialize
)

#: Every float dtype an adapter may carry, with its safetensors code.
FLOAT_DTYPES = pytest.mark.parametrize(
    ("dtype", "code"),
    [
        (torch.float16, "F16"),
        (torch.bfloat16, "BF16"),
        (torch.float32, "F32"),
        (torch.float64, "F64"),
    ],
)


@contextlib.contextmanager
def invalid(problem: AdapterProblem) -> Iterator[None]:
    """Expect an INVALID_ADAPTER error with this ``reason``."""
    with pytest.raises(InvalidAdapterError) as exc_info:
        yield
    assert exc_info.value.code == "INVALID_ADAPTER"
    assert exc_info.value.details["reason"] == problem.value, exc_info.value


def saved_dir(tmp_path: Path, model: PeftModel, name: str = "peft") -> Path:
    out = tmp_path / name
    model.save_pretrained(str(out))
    return out


# --- one adapter, one digest --------------------------------------------------------------------


def test_peft_dir_state_dict_and_module_give_the_same_snapshot(tmp_path: Path) -> None:
    model = peft_model(seed=1)
    from_dir = AdapterSnapshot.from_peft_dir(saved_dir(tmp_path, model))
    from_state = AdapterSnapshot.from_state_dict(
        get_peft_model_state_dict(model), model.peft_config["default"].to_dict()
    )
    from_module = AdapterSnapshot.from_module(model)
    assert from_dir.digest == from_state.digest == from_module.digest
    assert from_dir == from_state == from_module
    assert len(from_dir.tensors) == 8  # 2 layers x (q_proj, v_proj) x (A, B)
    assert from_dir.manifest.digest == from_dir.digest
    assert compute_digest(from_dir.config, from_dir.tensors) == from_dir.digest


def test_different_weights_give_different_digests() -> None:
    a = AdapterSnapshot.from_module(peft_model(seed=1))
    b = AdapterSnapshot.from_module(peft_model(seed=2))
    assert a.digest != b.digest


@settings(max_examples=20, deadline=None)
@given(st.permutations(["q_proj", "k_proj", "v_proj", "o_proj"]), st.booleans())
def test_target_modules_order_does_not_change_the_digest(order: list[str], dup: bool) -> None:
    reference = AdapterSnapshot.from_blobs(
        tiny_config(target_modules=["k_proj", "o_proj", "q_proj", "v_proj"]), tiny_blobs()
    )
    targets = order + order[:1] if dup else order
    shuffled = AdapterSnapshot.from_blobs(tiny_config(target_modules=targets), tiny_blobs())
    as_set = AdapterSnapshot.from_blobs(tiny_config(target_modules=set(order)), tiny_blobs())
    assert shuffled.digest == as_set.digest == reference.digest
    assert shuffled.config["target_modules"] == ("k_proj", "o_proj", "q_proj", "v_proj")


def test_peft_dir_with_reordered_targets_and_other_writer_fields_has_the_same_digest(
    tmp_path: Path,
) -> None:
    model = peft_model(seed=3, config=lora_config(targets=("q_proj", "k_proj", "v_proj")))
    original = saved_dir(tmp_path, model)
    reference = AdapterSnapshot.from_peft_dir(original)
    config = json.loads((original / CONFIG_FILE).read_text())
    config["target_modules"] = list(reversed(sorted(config["target_modules"])))
    # Fields about the writer, not the adapter, differ between saves of the same weights.
    config.update(peft_version="0.0.1", inference_mode=False, auto_mapping={"x": "y"})
    (original / CONFIG_FILE).write_text(json.dumps(config, indent=4))
    assert AdapterSnapshot.from_peft_dir(original).digest == reference.digest


def test_set_like_fields_and_sets_anywhere_are_sorted() -> None:
    config = normalize_config(
        tiny_config(
            layers_to_transform=[10, 2, 2],
            exclude_modules={"b", "a"},
            modules_to_save=[["z"], {"k": 1}, ["a"], ["z"]],
            loftq_config={"nested": {"y", "x"}},
            lora_dropout=0.0,
        )
    )
    assert config["layers_to_transform"] == (2, 10)
    assert config["exclude_modules"] == ("a", "b")
    assert config["modules_to_save"] == (("a",), ("z",), {"k": 1})
    assert config["loftq_config"] == {"nested": ("x", "y")}
    assert config["lora_dropout"] == 0
    assert type(config["lora_dropout"]) is int


def test_one_changed_byte_changes_the_digest(tmp_path: Path) -> None:
    snapshot = AdapterSnapshot.from_module(peft_model(seed=1))
    first = snapshot.tensors[0]
    flipped = bytes([first.data[0] ^ 0x01]) + first.data[1:]
    changed = AdapterSnapshot.from_blobs(
        snapshot.config,
        [TensorBlob(first.name, first.dtype, first.shape, flipped), *snapshot.tensors[1:]],
    )
    assert changed.digest != snapshot.digest
    # The same through a file on disk: flip the last data byte of the safetensors file.
    directory = snapshot.write_peft_dir(tmp_path / "a")
    raw = bytearray((directory / WEIGHTS_FILE).read_bytes())
    raw[-1] ^= 0x01
    (directory / WEIGHTS_FILE).write_bytes(bytes(raw))
    assert AdapterSnapshot.from_peft_dir(directory).digest != snapshot.digest
    # And a config value.
    other = AdapterSnapshot.from_blobs({**snapshot.config, "lora_alpha": 99}, snapshot.tensors)
    assert other.digest != snapshot.digest


def test_golden_digest_of_a_tiny_fixed_adapter() -> None:
    # Pinned on purpose. The digest is journaled, embedded in lora names and checked by engine
    # side receivers; a change to the config normalisation or to the manifest definition must
    # show up here (and come with a new manifest format), never silently.
    snapshot = AdapterSnapshot.from_blobs(
        tiny_config(target_modules=["v_proj", "q_proj"], inference_mode=True), tiny_blobs()
    )
    assert snapshot.digest == GOLDEN


GOLDEN = "6ce1205597d4be2de622266a3302777c00cbdcbee208ae4160ed2eab5b2d84cf"


# --- files ----------------------------------------------------------------------------------------


def test_write_read_round_trip_is_lossless_and_byte_identical(tmp_path: Path) -> None:
    snapshot = AdapterSnapshot.from_module(peft_model(seed=4))
    one = snapshot.write_peft_dir(tmp_path / "one")
    two = snapshot.write_peft_dir(tmp_path / "two", fsync=True)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (one / name).read_bytes() == (two / name).read_bytes()
    assert sorted(p.name for p in one.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    again = AdapterSnapshot.from_peft_dir(one)
    assert again == snapshot
    assert [t.data for t in again.tensors] == [t.data for t in snapshot.tensors]
    # Written from the re-read snapshot: still the same bytes.
    three = again.write_peft_dir(tmp_path / "three")
    assert (three / WEIGHTS_FILE).read_bytes() == (one / WEIGHTS_FILE).read_bytes()
    assert (three / CONFIG_FILE).read_bytes() == snapshot.config_json()


def test_written_weights_load_with_the_safetensors_package(tmp_path: Path) -> None:
    snapshot = AdapterSnapshot.from_module(peft_model(seed=5, dtype=torch.bfloat16))
    directory = snapshot.write_peft_dir(tmp_path / "bf16")
    loaded = safetensors.torch.load_file(directory / WEIGHTS_FILE)
    ours = snapshot.to_torch_state_dict()
    assert loaded.keys() == ours.keys()
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, ours[name])
    with safetensors.safe_open(directory / WEIGHTS_FILE, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_peft_loads_a_written_dir_and_computes_the_same_outputs(tmp_path: Path) -> None:
    model = peft_model(seed=6)
    snapshot = AdapterSnapshot.from_module(model)
    directory = snapshot.write_peft_dir(tmp_path / "written")
    loaded = PeftModel.from_pretrained(TinyDecoder(seed=0), directory)
    theirs = get_peft_model_state_dict(loaded)
    ours = get_peft_model_state_dict(model)
    assert theirs.keys() == ours.keys()
    for name in ours:
        assert torch.equal(theirs[name], ours[name])
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        expected = model(x)
        assert torch.equal(loaded(x), expected)
        # The adapter really changes outputs, so the equality above is not vacuous.
        assert not torch.equal(TinyDecoder(seed=0)(x), expected)


def test_reading_and_writing_need_neither_torch_nor_numpy_nor_safetensors(tmp_path: Path) -> None:
    snapshot = AdapterSnapshot.from_module(peft_model(seed=11, dtype=torch.bfloat16))
    source = saved_dir(tmp_path, peft_model(seed=11, dtype=torch.bfloat16))
    script = (
        "import sys\n"
        "for blocked in ('torch', 'numpy', 'safetensors', 'peft'):\n"
        "    sys.modules[blocked] = None  # any import of these now fails\n"
        "from agentic_lora.adapters.snapshot import AdapterSnapshot\n"
        "s = AdapterSnapshot.from_peft_dir(sys.argv[1])\n"
        "s.write_peft_dir(sys.argv[2])\n"
        "print(s.digest)\n"
    )
    out = tmp_path / "rewritten"
    result = subprocess.run(
        [sys.executable, "-c", script, str(source), str(out)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.stdout.strip() == snapshot.digest
    assert AdapterSnapshot.from_peft_dir(out) == snapshot


def test_peft_writes_and_our_reader_agree_with_the_safetensors_package(tmp_path: Path) -> None:
    directory = saved_dir(tmp_path, peft_model(seed=7, dtype=torch.bfloat16))
    data = (directory / WEIGHTS_FILE).read_bytes()
    records, metadata = safetensors_io.loads(data)
    reference = sorted(reference_deserialize(data))
    assert metadata == {"format": "pt"}
    assert [(r.name, r.dtype, list(r.shape), r.data) for r in records] == [
        (name, info["dtype"], info["shape"], bytes(info["data"])) for name, info in reference
    ]
    assert safetensors_io.read_file(directory / WEIGHTS_FILE) == (records, metadata)


def test_write_peft_dir_never_overwrites_and_leaves_nothing_half_written(tmp_path: Path) -> None:
    snapshot = AdapterSnapshot.from_blobs(tiny_config(), tiny_blobs())
    directory = tmp_path / "d"
    directory.mkdir()
    (directory / WEIGHTS_FILE).write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        snapshot.write_peft_dir(directory)
    # The config it had already written is gone; the existing file is untouched.
    assert sorted(p.name for p in directory.iterdir()) == [WEIGHTS_FILE]
    assert (directory / WEIGHTS_FILE).read_bytes() == b"someone else's"
    done = snapshot.write_peft_dir(tmp_path / "e")
    with pytest.raises(FileExistsError):
        snapshot.write_peft_dir(done)
    assert AdapterSnapshot.from_peft_dir(done) == snapshot


# --- owned copies ---------------------------------------------------------------------------------


def test_snapshot_does_not_follow_later_in_place_updates_of_live_tensors() -> None:
    model = peft_model(seed=8)
    by_module = AdapterSnapshot.from_module(model)
    live = get_peft_model_state_dict(model)
    by_state = AdapterSnapshot.from_state_dict(live, model.peft_config["default"])
    before = [t.data for t in by_module.tensors]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(1.0)  # the trainer keeps training
        for tensor in live.values():
            tensor.mul_(3.0)
    assert [t.data for t in by_module.tensors] == before
    assert [t.data for t in by_state.tensors] == before
    assert compute_digest(by_module.config, by_module.tensors) == by_module.digest
    assert AdapterSnapshot.from_module(model).digest != by_module.digest


def test_non_contiguous_tensors_are_copied_in_logical_order() -> None:
    a = torch.arange(8, dtype=torch.float32).reshape(4, 2).t()  # (2, 4), a transposed view
    assert not a.is_contiguous()
    b = torch.ones(3, 2, dtype=torch.float32)
    state = {"m.q_proj.lora_A.weight": a, "m.q_proj.lora_B.weight": b}
    snapshot = AdapterSnapshot.from_state_dict(state, tiny_config(r=2))
    assert snapshot.tensors[0].data == struct.pack("<8f", 0, 2, 4, 6, 1, 3, 5, 7)
    assert torch.equal(snapshot.to_torch_state_dict()["m.q_proj.lora_A.weight"], a)


def test_torch_state_dict_tensors_own_their_memory() -> None:
    snapshot = AdapterSnapshot.from_blobs(tiny_config(), tiny_blobs())
    state = snapshot.to_torch_state_dict()
    tensor = state["model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert tensor.dtype == torch.float32
    assert tuple(tensor.shape) == (1, 2)
    assert tensor.tolist() == [[0.5, -1.0]]
    tensor.zero_()
    assert snapshot.to_torch_state_dict()[
        "model.layers.0.self_attn.q_proj.lora_A.weight"
    ].tolist() == [[0.5, -1.0]]


@FLOAT_DTYPES
def test_every_float_dtype_round_trips_through_torch(dtype: torch.dtype, code: str) -> None:
    model = peft_model(seed=9, dtype=dtype)
    snapshot = AdapterSnapshot.from_module(model)
    assert {t.dtype for t in snapshot.tensors} == {code}
    state = snapshot.to_torch_state_dict()
    for name, tensor in get_peft_model_state_dict(model).items():
        assert torch.equal(state[name], tensor)


# --- the snapshot object --------------------------------------------------------------------------


def test_snapshot_is_read_only_and_serialisable() -> None:
    snapshot = AdapterSnapshot.from_blobs(tiny_config(), tiny_blobs())
    with pytest.raises(TypeError):
        snapshot.config["r"] = 8  # type: ignore[index]
    with pytest.raises(AttributeError):
        snapshot.digest = "x"  # type: ignore[misc]
    assert json.loads(json.dumps(snapshot.config)) == thaw_json(snapshot.config)
    assert pickle.loads(pickle.dumps(snapshot)) == snapshot
    assert len({snapshot, AdapterSnapshot.from_blobs(tiny_config(), tiny_blobs())}) == 1
    assert pickle.loads(pickle.dumps(snapshot)).manifest == snapshot.manifest
    assert snapshot.nbytes == 16 == sum(t.nbytes for t in snapshot.tensors)
    text = repr(snapshot)
    assert snapshot.digest[:16] in text
    assert "nbytes=16" in text
    assert "\\x" not in text
    assert "data" not in repr(snapshot.tensors[0])


def test_direct_construction_checks_the_digest() -> None:
    built = AdapterSnapshot.from_blobs(tiny_config(), tiny_blobs())
    direct = AdapterSnapshot(
        tiny_config(target_modules={"q_proj"}), tuple(reversed(tiny_blobs())), built.digest
    )
    assert direct == built
    assert direct.manifest == built.manifest
    with invalid(AdapterProblem.DIGEST_MISMATCH):
        AdapterSnapshot(tiny_config(), tuple(tiny_blobs()), "0" * 64)


def test_tensor_blob_copies_mutable_buffers() -> None:
    buffer = bytearray(f32(1.0, 2.0))
    blob = TensorBlob("x", "F32", [1, 2], buffer)  # type: ignore[arg-type]
    buffer[0] ^= 0xFF
    assert blob.data == f32(1.0, 2.0)
    assert blob.shape == (1, 2)
    view = TensorBlob("y", "F32", (2,), memoryview(f32(3.0, 4.0)))  # type: ignore[arg-type]
    assert view.data == f32(3.0, 4.0)
    assert type(view.data) is bytes


# --- bad input: every reason ----------------------------------------------------------------------


def with_config(**changes: Any) -> Callable[[], Any]:
    return lambda: AdapterSnapshot.from_blobs(tiny_config(**changes), tiny_blobs())


def without_key(key: str) -> Callable[[], Any]:
    config = tiny_config()
    del config[key]
    return lambda: AdapterSnapshot.from_blobs(config, tiny_blobs())


def with_tensors(*blobs: TensorBlob, config: dict[str, Any] | None = None) -> Callable[[], Any]:
    return lambda: AdapterSnapshot.from_blobs(config or tiny_config(), list(blobs))


M = "model.layers.0.self_attn.q_proj"
GOOD_A, GOOD_B = tiny_blobs()


@pytest.mark.parametrize(
    ("problem", "build"),
    [
        (AdapterProblem.MISSING_CONFIG, lambda: AdapterSnapshot.from_blobs(None, tiny_blobs())),  # type: ignore[arg-type]
        (AdapterProblem.BAD_CONFIG, lambda: AdapterSnapshot.from_blobs(42, tiny_blobs())),  # type: ignore[arg-type]
        (AdapterProblem.BAD_CONFIG, with_config(r=0)),
        (AdapterProblem.BAD_CONFIG, with_config(r="4")),
        (AdapterProblem.BAD_CONFIG, with_config(r=True)),
        (AdapterProblem.BAD_CONFIG, without_key("r")),
        (AdapterProblem.BAD_CONFIG, without_key("lora_alpha")),
        (AdapterProblem.BAD_CONFIG, with_config(lora_alpha="8")),
        (AdapterProblem.BAD_CONFIG, without_key("target_modules")),
        (AdapterProblem.BAD_CONFIG, with_config(target_modules=[])),
        (AdapterProblem.BAD_CONFIG, with_config(target_modules="")),
        (AdapterProblem.BAD_CONFIG, with_config(target_modules=["q_proj", 3])),
        (AdapterProblem.BAD_CONFIG, with_config(rank_pattern={"q_proj": 0})),
        (AdapterProblem.BAD_CONFIG, with_config(rank_pattern=["q_proj"])),
        (AdapterProblem.BAD_CONFIG, with_config(rank_pattern={"(": 2})),
        (AdapterProblem.BAD_CONFIG, with_config(lora_dropout=float("nan"))),
        (AdapterProblem.BAD_CONFIG, with_config(extra=object())),
        (AdapterProblem.NOT_LORA, with_config(peft_type="IA3")),
        (AdapterProblem.NOT_LORA, without_key("peft_type")),
        (AdapterProblem.NOT_LORA, with_config(use_dora=True)),
        (AdapterProblem.EMPTY, with_tensors()),
        (
            AdapterProblem.NON_LORA_TENSOR,
            with_tensors(TensorBlob(f"{M}.weight", "F32", (1,), f32(0))),
        ),
        (
            AdapterProblem.NON_LORA_TENSOR,
            with_tensors(
                TensorBlob(f"{M}.lora_A.default.weight", "F32", (1, 2), f32(0, 0)), GOOD_B
            ),
        ),
        (
            AdapterProblem.NON_LORA_TENSOR,
            with_tensors(TensorBlob(f"{M}.lora_magnitude_vector", "F32", (2,), f32(1, 1))),
        ),
        (AdapterProblem.UNPAIRED_TENSOR, with_tensors(GOOD_A)),
        (AdapterProblem.UNPAIRED_TENSOR, with_tensors(GOOD_B)),
        (
            AdapterProblem.BAD_DTYPE,
            with_tensors(TensorBlob(f"{M}.lora_A.weight", "I32", (1, 2), f32(0, 0)), GOOD_B),
        ),
        (AdapterProblem.BAD_DTYPE, lambda: TensorBlob("x", "F99", (1,), b"\0")),
        (
            AdapterProblem.SHAPE_MISMATCH,
            with_tensors(TensorBlob(f"{M}.lora_A.weight", "F32", (2,), f32(0, 0)), GOOD_B),
        ),
        (
            AdapterProblem.SHAPE_MISMATCH,
            with_tensors(TensorBlob(f"{M}.lora_A.weight", "F32", (1, 0), b""), GOOD_B),
        ),
        (AdapterProblem.SHAPE_MISMATCH, with_tensors(GOOD_A, GOOD_B, config=tiny_config(r=2))),
        (
            AdapterProblem.SHAPE_MISMATCH,
            with_tensors(GOOD_A, TensorBlob(f"{M}.lora_B.weight", "F32", (1, 2), f32(0, 0))),
        ),
        (
            AdapterProblem.NON_FINITE,
            with_tensors(TensorBlob(GOOD_A.name, "F32", (1, 2), f32(0, math.nan)), GOOD_B),
        ),
        (
            AdapterProblem.NON_FINITE,
            with_tensors(GOOD_A, TensorBlob(GOOD_B.name, "F32", (2, 1), f32(math.inf, 0))),
        ),
        (AdapterProblem.DUPLICATE_TENSOR, with_tensors(GOOD_A, GOOD_B, GOOD_A)),
        (AdapterProblem.BAD_TENSOR, lambda: TensorBlob("x", "F32", (2,), f32(0))),
        (AdapterProblem.BAD_TENSOR, lambda: TensorBlob("x", "F32", (1,), "abcd")),  # type: ignore[arg-type]
        (AdapterProblem.BAD_TENSOR, lambda: TensorBlob("", "F32", (1,), f32(0))),
        (AdapterProblem.BAD_TENSOR, lambda: TensorBlob("x", "F32", (-1,), b"")),
        (AdapterProblem.BAD_TENSOR, lambda: TensorBlob("x", "F32", "1", f32(0))),  # type: ignore[arg-type]
        (
            AdapterProblem.BAD_TENSOR,
            lambda: AdapterSnapshot.from_blobs(tiny_config(), [("a", "F32")]),  # type: ignore[list-item]
        ),
        (AdapterProblem.BAD_TENSOR, lambda: AdapterSnapshot.from_state_dict([1], tiny_config())),  # type: ignore[arg-type]
        (
            AdapterProblem.BAD_TENSOR,
            lambda: AdapterSnapshot.from_state_dict({f"{M}.lora_A.weight": [[1.0]]}, tiny_config()),  # type: ignore[dict-item]
        ),
        (
            AdapterProblem.BAD_DTYPE,
            lambda: AdapterSnapshot.from_state_dict(
                {f"{M}.lora_A.weight": torch.ones(1, 2, dtype=torch.int32)}, tiny_config()
            ),
        ),
        (
            AdapterProblem.SHAPE_MISMATCH,
            lambda: AdapterSnapshot.from_state_dict(
                {f"{M}.lora_A.weight": torch.ones(1, 0), f"{M}.lora_B.weight": torch.ones(2, 1)},
                tiny_config(),
            ),
        ),
        (
            AdapterProblem.NOT_LORA,
            lambda: AdapterSnapshot.from_module(TinyDecoder(), tiny_config()),
        ),
        (
            AdapterProblem.NOT_LORA,
            lambda: AdapterSnapshot.from_module(peft_model(), adapter_name="other"),
        ),
    ],
)
def test_bad_input_raises_its_typed_error(
    problem: AdapterProblem, build: Callable[[], Any]
) -> None:
    with invalid(problem):
        build()


def test_a_plain_state_dict_of_a_live_peft_model_is_refused_with_a_hint() -> None:
    # model.state_dict() has base weights and '.lora_A.default.weight' names, not PEFT's saved layout.
    model = peft_model()
    with pytest.raises(InvalidAdapterError) as exc_info:
        AdapterSnapshot.from_state_dict(model.state_dict(), model.peft_config["default"])
    assert exc_info.value.details["reason"] == "non_lora_tensor"
    assert "saved layout" in exc_info.value.message


def test_rank_pattern_overrides_the_rank_per_module() -> None:
    other = "model.layers.1.self_attn.v_proj"
    rank2 = [
        TensorBlob(f"{other}.lora_A.weight", "F32", (2, 1), f32(1, 2)),
        TensorBlob(f"{other}.lora_B.weight", "F32", (1, 2), f32(3, 4)),
    ]
    config = tiny_config(target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2})
    snapshot = AdapterSnapshot.from_blobs(config, tiny_blobs() + rank2)
    assert len(snapshot.tensors) == 4
    with invalid(AdapterProblem.SHAPE_MISMATCH):
        AdapterSnapshot.from_blobs(
            {**config, "rank_pattern": {"layers.1.self_attn.q_proj": 2}}, tiny_blobs() + rank2
        )


def test_invalid_adapter_errors_carry_details_across_pickling() -> None:
    with pytest.raises(InvalidAdapterError) as exc_info:
        with_tensors(TensorBlob(GOOD_A.name, "F32", (1, 2), f32(math.nan, math.inf)), GOOD_B)()
    err = exc_info.value
    assert err.details == {"reason": "non_finite", "tensor": GOOD_A.name, "count": 2}
    again = pickle.loads(pickle.dumps(err))
    assert again.details == err.details
    wire = err.to_dict()
    assert (
        type(error_from_code(wire["code"], wire["message"], **wire["details"]))
        is InvalidAdapterError
    )


# --- bad PEFT directories -------------------------------------------------------------------------


@pytest.fixture
def good_dir(tmp_path: Path) -> Path:
    return AdapterSnapshot.from_blobs(tiny_config(), tiny_blobs()).write_peft_dir(tmp_path / "good")


def test_missing_files(tmp_path: Path, good_dir: Path) -> None:
    with invalid(AdapterProblem.MISSING_CONFIG):
        AdapterSnapshot.from_peft_dir(tmp_path / "does-not-exist")
    (good_dir / WEIGHTS_FILE).unlink()
    with invalid(AdapterProblem.MISSING_WEIGHTS):
        AdapterSnapshot.from_peft_dir(good_dir)
    (good_dir / CONFIG_FILE).unlink()
    with invalid(AdapterProblem.MISSING_CONFIG):
        AdapterSnapshot.from_peft_dir(good_dir)


@pytest.mark.parametrize(
    "text",
    [b"{not json", b'{"r": NaN}', b"[1, 2]", b"\xff\xfe", b'{"peft_type": "LORA", "r": Infinity}'],
)
def test_unreadable_config_files(good_dir: Path, text: bytes) -> None:
    (good_dir / CONFIG_FILE).write_bytes(text)
    with invalid(AdapterProblem.BAD_CONFIG):
        AdapterSnapshot.from_peft_dir(good_dir)


@pytest.mark.parametrize("depth", [100, 200_000])
def test_a_deeply_nested_config_is_invalid_not_a_crash(good_dir: Path, depth: int) -> None:
    # 100 levels parse but exceed MAX_JSON_DEPTH; 200,000 exceed the JSON parser's own recursion
    # limit (a RecursionError inside json.loads). Both are bad input: INVALID_ADAPTER.
    config = json.loads((good_dir / CONFIG_FILE).read_text())
    nested = "[" * depth + "]" * depth
    text = json.dumps(config)[:-1] + ', "extra": ' + nested + "}"
    (good_dir / CONFIG_FILE).write_text(text)
    with invalid(AdapterProblem.BAD_CONFIG):
        AdapterSnapshot.from_peft_dir(good_dir)


def test_a_deeply_nested_safetensors_header_is_invalid_not_a_crash(good_dir: Path) -> None:
    depth = 200_000
    header = b'{"__metadata__": {"x": ' + b"[" * depth + b"]" * depth + b"}}"
    (good_dir / WEIGHTS_FILE).write_bytes(struct.pack("<Q", len(header)) + header)
    with invalid(AdapterProblem.BAD_SAFETENSORS):
        AdapterSnapshot.from_peft_dir(good_dir)


def test_a_deeply_nested_manifest_is_invalid_identity() -> None:
    with pytest.raises(InvalidIdentityError):
        Manifest.from_json("[" * 200_000 + "]" * 200_000)


def test_a_corrupt_weights_file(good_dir: Path) -> None:
    path = good_dir / WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[:-3])
    with invalid(AdapterProblem.BAD_SAFETENSORS):
        AdapterSnapshot.from_peft_dir(good_dir)


def test_a_non_finite_value_in_a_bf16_file(tmp_path: Path) -> None:
    state = get_peft_model_state_dict(peft_model(dtype=torch.bfloat16))
    name = sorted(state)[3]
    state[name] = state[name].clone()
    state[name][0, 0] = float("inf")
    directory = tmp_path / "bad"
    directory.mkdir()
    safetensors.torch.save_file(state, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(
        json.dumps(tiny_config(r=4, target_modules=["q_proj", "v_proj"]))
    )
    with pytest.raises(InvalidAdapterError) as exc_info:
        AdapterSnapshot.from_peft_dir(directory)
    assert exc_info.value.details == {"reason": "non_finite", "tensor": name, "count": 1}


def test_manifest_matches_the_tensors(tmp_path: Path) -> None:
    snapshot = AdapterSnapshot.from_module(peft_model(seed=10))
    manifest = snapshot.manifest
    assert isinstance(manifest, Manifest)
    assert [(e.name, e.dtype, e.shape) for e in manifest.tensors] == [
        (t.name, t.dtype, t.shape) for t in snapshot.tensors
    ]
    assert manifest.config == snapshot.config
    assert Manifest.from_json(manifest.canonical).digest == snapshot.digest
    assert os.fspath(snapshot.write_peft_dir(tmp_path / "m")) == os.fspath(tmp_path / "m")


# --- the safetensors format -----------------------------------------------------------------------


def _file(
    header: dict[str, Any] | list[Any], data: bytes = b"", *, raw: bytes | None = None
) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _entry(dtype: str = "F32", shape: Any = (1,), offsets: Any = (0, 4)) -> dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def test_dumps_is_deterministic_aligned_and_readable_by_the_reference_implementation() -> None:
    records = [
        safetensors_io.TensorRecord("b", "BF16", (2,), b"\x80\x3f\x00\x40"),
        safetensors_io.TensorRecord("a", "F32", (1,), f32(1.5)),
    ]
    data = safetensors_io.dumps(records)
    assert data == safetensors_io.dumps(list(records))
    (length,) = struct.unpack("<Q", data[:8])
    assert length % 8 == 0
    header = data[8 : 8 + length].rstrip(b" ")
    assert header == (
        b'{"__metadata__":{"format":"pt"},'
        b'"a":{"data_offsets":[4,8],"dtype":"F32","shape":[1]},'
        b'"b":{"data_offsets":[0,4],"dtype":"BF16","shape":[2]}}'
    )
    assert data[8 + length :] == b"\x80\x3f\x00\x40" + f32(1.5)  # in the order given
    assert sorted(reference_deserialize(data)) == [
        ("a", {"dtype": "F32", "shape": [1], "data": bytearray(f32(1.5))}),
        ("b", {"dtype": "BF16", "shape": [2], "data": bytearray(b"\x80\x3f\x00\x40")}),
    ]
    loaded, metadata = safetensors_io.loads(data)
    assert loaded == sorted(records)
    assert metadata == {"format": "pt"}
    bare, no_metadata = safetensors_io.loads(safetensors_io.dumps(records, metadata=None))
    assert (bare, no_metadata) == (sorted(records), {})


def test_reads_what_the_reference_implementation_writes() -> None:
    tensors = {
        "w": torch.tensor([[1.0, -2.0]], dtype=torch.bfloat16),
        "v": torch.tensor([3], dtype=torch.int64),
        "e": torch.zeros(0, 3),
    }
    records, metadata = safetensors_io.loads(safetensors.torch.save(tensors, metadata={"k": "v"}))
    assert metadata == {"k": "v"}
    assert [(r.name, r.dtype, r.shape) for r in records] == [
        ("e", "F32", (0, 3)),
        ("v", "I64", (1,)),
        ("w", "BF16", (1, 2)),
    ]
    assert records[2].data == tensors["w"].view(torch.uint8).numpy().tobytes()


def test_write_reports_bytes_written_and_refuses_name_collisions(tmp_path: Path) -> None:
    records = [safetensors_io.TensorRecord("a", "F32", (1,), f32(1.0))]
    with open(tmp_path / "x.safetensors", "wb") as fp:
        written = safetensors_io.write(fp, records)
    assert (
        written == len(safetensors_io.dumps(records)) == (tmp_path / "x.safetensors").stat().st_size
    )
    with invalid(AdapterProblem.BAD_SAFETENSORS):
        safetensors_io.dumps(records + records)
    with invalid(AdapterProblem.BAD_SAFETENSORS):
        safetensors_io.dumps([records[0]._replace(name="__metadata__")])


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"\x01\x02", id="shorter-than-length"),
        pytest.param(struct.pack("<Q", 2**40) + b"{}", id="header-too-large"),
        pytest.param(struct.pack("<Q", 100) + b"{}", id="header-past-end"),
        pytest.param(_file({}, raw=b"\xff\xfe"), id="header-not-utf8"),
        pytest.param(_file({}, raw=b"{"), id="header-not-json"),
        pytest.param(_file([]), id="header-not-object"),
        pytest.param(_file({"__metadata__": {"a": 1}}), id="metadata-not-strings"),
        pytest.param(_file({"__metadata__": []}), id="metadata-not-object"),
        pytest.param(_file({"t": [1]}, f32(0)), id="entry-not-object"),
        pytest.param(_file({"t": {**_entry(), "extra": 1}}, f32(0)), id="entry-extra-key"),
        pytest.param(_file({"t": _entry(dtype="F128")}, f32(0)), id="unknown-dtype"),
        pytest.param(_file({"t": {**_entry(), "shape": "1"}}, f32(0)), id="shape-not-list"),
        pytest.param(_file({"t": _entry(shape=(-1,))}, f32(0)), id="negative-shape"),
        pytest.param(_file({"t": _entry(offsets=(0, 4, 8))}, f32(0)), id="three-offsets"),
        pytest.param(_file({"t": _entry(offsets=(0, 4.0))}, f32(0)), id="float-offset"),
        pytest.param(_file({"t": _entry(offsets=(0, 8))}, f32(0, 0)), id="size-mismatch"),
        pytest.param(_file({"t": _entry(offsets=(4, 8))}, f32(0, 0)), id="gap"),
        pytest.param(
            _file({"t": _entry(), "u": _entry()}, f32(0)),
            id="overlap",
        ),
        pytest.param(_file({"t": _entry()}, f32(0, 0)), id="trailing-bytes"),
        pytest.param(_file({}, raw=b'{"t": {}, "t": {}}'), id="duplicate-key"),
    ],
)
def test_malformed_safetensors_are_refused(tmp_path: Path, data: bytes) -> None:
    with invalid(AdapterProblem.BAD_SAFETENSORS):
        safetensors_io.loads(data)
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with invalid(AdapterProblem.BAD_SAFETENSORS):
        safetensors_io.read_file(path)


def test_a_file_that_shrinks_while_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = _file({"t": _entry(shape=(2,), offsets=(0, 8))}, f32(1, 2))
    path = tmp_path / "shrinking.safetensors"
    path.write_bytes(whole[:-4])  # what is on disk by the time the tensor is read
    monkeypatch.setattr(safetensors_io, "_size_of", lambda fp: len(whole))
    with invalid(AdapterProblem.BAD_SAFETENSORS):
        safetensors_io.read_file(path)


# --- non-finite values, bit by bit ----------------------------------------------------------------

_SPECIALS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, 65504.0, 1e-8, -3.5]


@pytest.fixture(params=["numpy", "pure-python"])
def finite_check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "pure-python":
        monkeypatch.setattr(safetensors_io, "_numpy_or_none", lambda: None)
    return str(request.param)


@FLOAT_DTYPES
def test_count_non_finite_matches_torch(finite_check: str, dtype: torch.dtype, code: str) -> None:
    generator = torch.Generator().manual_seed(0)
    values = torch.cat([torch.tensor(_SPECIALS), torch.randn(64, generator=generator) * 1e4])
    for scale in (1.0, 1e30, 1e300):  # large scales overflow the narrow formats to inf
        tensor = (values.double() * scale).to(dtype)
        data = tensor.view(torch.uint8).numpy().tobytes()
        expected = int((~torch.isfinite(tensor)).sum())
        assert safetensors_io.count_non_finite(code, data) == expected
        assert expected >= 3


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(width=32), min_size=1, max_size=32))
def test_count_non_finite_agrees_with_math_isfinite_for_any_f32(values: list[float]) -> None:
    data = struct.pack(f"<{len(values)}f", *values)
    expected = sum(1 for v in values if not math.isfinite(v))
    assert safetensors_io.count_non_finite("F32", data) == expected
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(safetensors_io, "_numpy_or_none", lambda: None)
        assert safetensors_io.count_non_finite("F32", data) == expected


def test_numpy_is_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "numpy", None)  # makes `import numpy` raise ImportError
    assert safetensors_io._numpy_or_none() is None
    assert safetensors_io.count_non_finite("BF16", b"\x80\x7f\x80\x3f") == 1
