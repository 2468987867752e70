"""The model fixture: reproducible to the byte, cached atomically, adapters that really differ."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from agentic_lora_harness.fixture import ADAPTER_NAMES
from agentic_lora_harness.fixture import FixtureSpec
from agentic_lora_harness.fixture import build_fixture
from agentic_lora_harness.fixture import build_fixture_into
from agentic_lora_harness.fixture import cache_root
from agentic_lora_harness.fixture import fixture_key


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fixture-a")
    build_fixture_into(root)
    return root


def test_two_builds_are_byte_identical(built: Path, tmp_path: Path) -> None:
    build_fixture_into(tmp_path)
    first, second = _tree(built), _tree(tmp_path)
    assert sorted(first) == sorted(second)
    assert "model/model.safetensors" in first
    differing = [name for name in first if first[name] != second[name]]
    assert differing == []


def test_layout_and_pinned_metadata(built: Path) -> None:
    config = json.loads((built / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 2
    assert config["hidden_size"] == 128
    assert config["vocab_size"] == 2048
    assert config["dtype"] == "bfloat16"
    for name in ADAPTER_NAMES:
        adapter = json.loads((built / "adapters" / name / "adapter_config.json").read_text())
        assert adapter["r"] == 8
        assert adapter["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
        # No absolute path of the build directory leaks into the bytes.
        assert adapter["base_model_name_or_path"] == "tiny-qwen3"
        assert (built / "adapters" / name / "adapter_model.safetensors").stat().st_size > 0
    manifest = json.loads((built / "fixture.json").read_text())
    assert set(manifest["files"]) == set(_tree(built)) - {"fixture.json"}


def test_cache_builds_once_and_leaves_no_staging(tmp_path: Path) -> None:
    first = build_fixture(tmp_path)
    model_file = first.model_dir / "model.safetensors"
    inode = model_file.stat().st_ino
    second = build_fixture(tmp_path)
    assert second.root == first.root == tmp_path.resolve() / "fixtures" / first.key
    assert model_file.stat().st_ino == inode  # found in the cache, not rebuilt
    assert [p.name for p in (tmp_path / "fixtures").iterdir()] == [first.key]
    assert all(second.adapter(name).is_absolute() for name in ADAPTER_NAMES)


def test_cache_root_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTIC_LORA_CACHE", str(tmp_path / "elsewhere"))
    assert cache_root() == (tmp_path / "elsewhere").resolve()
    assert cache_root(tmp_path / "override") == (tmp_path / "override").resolve()
    monkeypatch.delenv("AGENTIC_LORA_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == (tmp_path / "home" / ".cache" / "agentic-lora").resolve()


def test_key_follows_the_parameters() -> None:
    assert fixture_key(FixtureSpec()) == fixture_key(FixtureSpec())
    assert fixture_key(FixtureSpec(seed=1)) != fixture_key(FixtureSpec())
    assert fixture_key(FixtureSpec(lora_rank=4)) != fixture_key(FixtureSpec())


def test_unsorted_target_modules_are_refused() -> None:
    with pytest.raises(ValueError, match="sorted"):
        FixtureSpec(lora_target_modules=("q_proj", "k_proj"))


def test_destination_must_be_empty(tmp_path: Path) -> None:
    (tmp_path / "stray").write_text("x")
    with pytest.raises(FileExistsError):
        build_fixture_into(tmp_path)


def _logits(built: Path, adapter: str | None) -> Any:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = AutoTokenizer.from_pretrained(str(built / "model"))
        model: Any = AutoModelForCausalLM.from_pretrained(str(built / "model"), dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(built / "adapters" / adapter))
    ids = tokenizer("the agent will call the weather tool", return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits[0]


def test_adapters_change_the_output_and_differ_from_each_other(built: Path) -> None:
    outputs = {name: _logits(built, name) for name in (None, *ADAPTER_NAMES)}
    names = list(outputs)
    for i, left in enumerate(names):
        for right in names[i + 1 :]:
            gap = (outputs[left] - outputs[right]).abs().max().item()
            assert gap > 0.05, f"{left} vs {right}: max logit gap {gap}"
            agree = (outputs[left].argmax(-1) == outputs[right].argmax(-1)).float().mean().item()
            assert agree < 1.0, f"{left} and {right} pick the same next token everywhere"


def test_chat_template_expresses_tool_calls(built: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(built / "model"))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert '"name": "get_weather"' in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text).input_ids
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in ids  # a single special token


def test_a_builder_that_loses_the_rename_race_keeps_the_winners_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from agentic_lora_harness import fixture as fixture_module

    real_build = fixture_module.build_fixture_into

    def build_then_lose_the_race(dest: Path, spec: FixtureSpec | None = None) -> Any:
        built = real_build(dest, spec)
        # Another process finishes first and renames its complete copy into place.
        shutil.copytree(dest, dest.parent / built.key)
        (dest.parent / built.key / "winner").write_text("theirs")
        return built

    monkeypatch.setattr(fixture_module, "build_fixture_into", build_then_lose_the_race)
    result = build_fixture(tmp_path)
    assert (result.root / "winner").read_text() == "theirs"
    assert [p.name for p in (tmp_path / "fixtures").iterdir()] == [result.key]


def test_module_entry_prints_the_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agentic_lora_harness.fixture import main

    assert main(["--cache-dir", str(tmp_path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert Path(printed["model_dir"], "config.json").is_file()
    assert sorted(printed["adapters"]) == list(ADAPTER_NAMES)
    for path in printed["adapters"].values():
        assert Path(path).is_absolute()
        assert Path(path, "adapter_config.json").is_file()
    assert printed["served_model_name"] == "tiny-qwen3"
