"""A tiny, deterministic model fixture for real-engine tests: a Qwen3 model and three LoRA adapters.

Model weights cannot be downloaded here, so the fixture builds everything offline:

* a byte-level BPE tokenizer trained with ``tokenizers`` on a seeded synthetic corpus, with the
  Qwen chat markup as special tokens and a chat template that can express tools, tool calls and
  tool responses;
* a 2-layer Qwen3 causal LM (bf16) with seeded random weights;
* three PEFT LoRA adapters ``A``, ``B`` and ``C`` (rank 8 on q/k/v/o_proj) whose ``lora_B`` is
  seeded and non-zero, so each adapter changes the model's output and no two agree.

The build is byte-for-byte reproducible: same parameters and library versions give the same
files. Results are cached under ``${AGENTIC_LORA_CACHE:-~/.cache/agentic-lora}/fixtures/<key>``
where ``key`` hashes the parameters, this module's source and the library versions. A build
happens in a temporary sibling directory that is renamed into place only when complete, so a
cache entry that exists is always whole, and two concurrent builders cannot corrupt each other.

``python -m agentic_lora_harness.fixture`` builds (or finds) the fixture and prints its paths.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

__all__ = [
    "ADAPTER_NAMES",
    "Fixture",
    "FixtureSpec",
    "build_fixture",
    "build_fixture_into",
    "cache_root",
    "fixture_key",
    "main",
]

logger = logging.getLogger(__name__)

ADAPTER_NAMES: tuple[str, ...] = ("A", "B", "C")
"""The adapters every fixture ships, in a fixed order."""

_CACHE_ENV = "AGENTIC_LORA_CACHE"
# Bump when the layout of a built fixture changes in a way the source hash would not capture.
_LAYOUT_VERSION = 1

_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

# A Qwen-style template: tools are listed in the system turn, assistant tool calls are rendered as
# <tool_call>{json}</tool_call> (what SGLang's qwen tool-call parser reads back), and tool results
# come back inside a user turn as <tool_response>...</tool_response>.
_CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions. Function signatures are inside <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and arguments inside <tool_call></tool_call>:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for tool_call in message.tool_calls | default([], true) %}
{%- set fn = tool_call.function if tool_call.function is defined else tool_call %}
{%- if loop.first and message.content %}{{- '\\n' }}{%- elif not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

_WORDS: tuple[str, ...] = (
    "the", "agent", "tool", "call", "weather", "city", "search", "result", "answer", "question",
    "policy", "adapter", "version", "session", "engine", "token", "model", "reward", "episode",
    "step", "python", "function", "value", "list", "file", "read", "write", "open", "close",
    "error", "retry", "done", "yes", "no", "and", "or", "not", "is", "a", "of", "to", "in", "for",
    "with", "on", "at", "by", "from", "hello", "world", "please", "thanks", "compute", "sum",
    "number", "string", "json", "name", "arguments", "location", "unit", "celsius", "query",
)  # fmt: skip


@dataclass(frozen=True)
class FixtureSpec:
    """The parameters a fixture is built from; every field feeds the cache key."""

    seed: int = 20240607
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 4096
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_target_modules: tuple[str, ...] = ("k_proj", "o_proj", "q_proj", "v_proj")
    lora_b_std: float = 0.5
    corpus_lines: int = 4000
    served_model_name: str = "tiny-qwen3"

    def __post_init__(self) -> None:
        if tuple(sorted(self.lora_target_modules)) != self.lora_target_modules:
            raise ValueError("lora_target_modules must be sorted (the cache key depends on order)")
        if self.vocab_size <= 256 + len(_SPECIAL_TOKENS):
            raise ValueError("vocab_size must exceed the byte alphabet plus the special tokens")


@dataclass(frozen=True)
class Fixture:
    """A built fixture on disk: ``model_dir`` (model + tokenizer) and one directory per adapter."""

    root: Path
    key: str
    spec: FixtureSpec
    model_dir: Path
    adapters_dir: Path
    adapters: Mapping[str, Path] = field(default_factory=dict)

    @property
    def served_model_name(self) -> str:
        """The name engines serve the base model under (``--served-model-name``)."""
        return self.spec.served_model_name

    def adapter(self, name: str) -> Path:
        """The absolute directory of adapter ``name`` (one of :data:`ADAPTER_NAMES`)."""
        return self.adapters[name]


def cache_root(override: Path | None = None) -> Path:
    """The cache root: ``override``, else ``$AGENTIC_LORA_CACHE``, else ``~/.cache/agentic-lora``."""
    if override is not None:
        return Path(override).expanduser().resolve()
    env = os.environ.get(_CACHE_ENV)
    if env:
        return Path(env).expanduser().resolve()
    return (Path.home() / ".cache" / "agentic-lora").resolve()


def _library_versions() -> dict[str, str]:
    import peft
    import safetensors
    import tokenizers
    import torch
    import transformers

    return {
        "peft": peft.__version__,
        "safetensors": safetensors.__version__,
        "tokenizers": tokenizers.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def fixture_key(spec: FixtureSpec) -> str:
    """The cache key of ``spec``: a hash of the parameters, this builder's source and libraries."""
    material = {
        "layout": _LAYOUT_VERSION,
        "spec": dataclasses.asdict(spec),
        "source": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "libraries": _library_versions(),
    }
    blob = json.dumps(material, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def _fixture_at(root: Path, key: str, spec: FixtureSpec) -> Fixture:
    adapters_dir = root / "adapters"
    return Fixture(
        root=root,
        key=key,
        spec=spec,
        model_dir=root / "model",
        adapters_dir=adapters_dir,
        adapters={name: adapters_dir / name for name in ADAPTER_NAMES},
    )


def build_fixture(cache_dir: Path | None = None, spec: FixtureSpec | None = None) -> Fixture:
    """Return the cached fixture for ``spec``, building it first if the cache has none.

    ``cache_dir`` overrides the cache root (see :func:`cache_root`). Safe to call from several
    processes at once: each builds into its own temporary directory and the first rename wins.
    """
    spec = spec or FixtureSpec()
    key = fixture_key(spec)
    fixtures = cache_root(cache_dir) / "fixtures"
    final = fixtures / key
    if final.is_dir():
        return _fixture_at(final, key, spec)
    fixtures.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=fixtures))
    try:
        build_fixture_into(staging, spec)
        staging.chmod(0o755)  # mkdtemp makes it private; the entry is shared by every run
        _fsync_tree(staging)
        try:
            staging.rename(final)
        except OSError:
            # Another builder renamed its (identical) copy first; theirs is complete, keep it.
            if not final.is_dir():
                raise
            logger.info("fixture already built concurrently", extra={"fixture": key})
        else:
            _fsync_entry(fixtures)
            logger.info("fixture built", extra={"fixture": key, "path": str(final)})
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return _fixture_at(final, key, spec)


def build_fixture_into(dest: Path, spec: FixtureSpec | None = None) -> Fixture:
    """Build the fixture into the existing empty directory ``dest`` (no caching, no rename)."""
    spec = spec or FixtureSpec()
    dest = Path(dest).resolve()
    if any(dest.iterdir()):
        raise FileExistsError(f"fixture destination is not empty: {dest}")
    fixture = _fixture_at(dest, fixture_key(spec), spec)
    fixture.model_dir.mkdir()
    fixture.adapters_dir.mkdir()
    with warnings.catch_warnings():
        # The libraries' deprecation notices are theirs to fix and would fail a strict test run.
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        tokenizer = _train_tokenizer(spec)
        _save_tokenizer(tokenizer, fixture.model_dir, spec)
        model = _build_model(spec, tokenizer)
        _save_model(model, fixture.model_dir)
        for index, name in enumerate(ADAPTER_NAMES):
            _build_adapter(spec, model, index, fixture.adapters[name])
    _write_manifest(fixture)
    return fixture


# --- tokenizer -----------------------------------------------------------------------------------


def _corpus(spec: FixtureSpec) -> Iterator[str]:
    rng = random.Random(spec.seed)
    for _ in range(spec.corpus_lines):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 14)))
        shape = rng.randrange(4)
        if shape == 0:
            yield words
        elif shape == 1:
            args = {"query": rng.choice(_WORDS), "n": rng.randint(0, 999)}
            yield '{"name": "' + rng.choice(_WORDS) + '", "arguments": ' + json.dumps(args) + "}"
        elif shape == 2:
            yield words.capitalize() + rng.choice((".", "?", "!")) + " " + str(rng.random())
        else:
            yield f"def {rng.choice(_WORDS)}_{rng.choice(_WORDS)}(x):\n    return x + {rng.randint(0, 99)}"


def _train_tokenizer(spec: FixtureSpec) -> Any:
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from tokenizers import trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(spec), trainer=trainer)
    return tokenizer


def _save_tokenizer(tokenizer: Any, model_dir: Path, spec: FixtureSpec) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(model_dir))


# --- model and adapters --------------------------------------------------------------------------


#: The :class:`FixtureSpec` fields that give the model its shape: ``Qwen3Config`` keywords of the
#: same names.
_MODEL_SHAPE = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


def _build_model(spec: FixtureSpec, tokenizer: Any) -> Any:
    import torch
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM

    config = Qwen3Config(
        **{name: getattr(spec, name) for name in _MODEL_SHAPE},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.token_to_id("<|endoftext|>"),
        eos_token_id=tokenizer.token_to_id("<|im_end|>"),
        pad_token_id=tokenizer.token_to_id("<|endoftext|>"),
        dtype="bfloat16",
    )
    torch.manual_seed(spec.seed)
    model: Any = Qwen3ForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def _save_model(model: Any, model_dir: Path) -> None:
    model.save_pretrained(str(model_dir), safe_serialization=True)


def _build_adapter(spec: FixtureSpec, base: Any, index: int, out_dir: Path) -> None:
    import torch
    from peft import LoraConfig
    from peft import get_peft_model
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    config = LoraConfig(
        r=spec.lora_rank,
        lora_alpha=spec.lora_alpha,
        target_modules=list(spec.lora_target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    # Each adapter seeds its own generator, so A, B and C are independent of build order.
    generator = torch.Generator().manual_seed(spec.seed * 1000 + index + 1)
    peft_model = get_peft_model(_clone_model(base), config)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                # PEFT zero-initialises lora_B (a no-op adapter); ours must change the output.
                param.copy_(torch.randn(param.shape, generator=generator) * spec.lora_b_std)
    state = get_peft_model_state_dict(peft_model)
    tensors = {name: state[name].detach().to(torch.bfloat16).contiguous() for name in sorted(state)}
    out_dir.mkdir()
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config: dict[str, Any] = config.to_dict()  # type: ignore[no-untyped-call]
    # PEFT stores target_modules as a set (random order on disk) and the base path as an absolute
    # path; both would make the bytes depend on the run, so pin them.
    adapter_config["target_modules"] = sorted(spec.lora_target_modules)
    adapter_config["base_model_name_or_path"] = spec.served_model_name
    adapter_config["peft_type"] = "LORA"
    adapter_config["task_type"] = "CAUSAL_LM"
    (out_dir / "adapter_config.json").write_text(
        json.dumps(_jsonable(adapter_config), indent=2, sort_keys=True) + "\n"
    )


def _clone_model(base: Any) -> Any:
    import copy

    return copy.deepcopy(base)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted(_jsonable(v) for v in value)
    if hasattr(value, "value") and not isinstance(value, int | float | str | bool):
        return _jsonable(value.value)
    return value


def _write_manifest(fixture: Fixture) -> None:
    files = sorted(p for p in fixture.root.rglob("*") if p.is_file())
    manifest = {
        "key": fixture.key,
        "spec": dataclasses.asdict(fixture.spec),
        "files": {
            str(p.relative_to(fixture.root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files
        },
    }
    (fixture.root / "fixture.json").write_text(
        json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    )


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root``, so the rename publishes complete data."""
    for path in sorted(root.rglob("*")):
        _fsync_entry(path)
    _fsync_entry(root)


def _fsync_entry(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    """Build (or find) the fixture and print its paths as JSON."""
    parser = argparse.ArgumentParser(prog="python -m agentic_lora_harness.fixture")
    parser.add_argument("--cache-dir", type=Path, default=None, help="cache root override")
    args = parser.parse_args(argv)
    fixture = build_fixture(args.cache_dir)
    out = {
        "key": fixture.key,
        "root": str(fixture.root),
        "model_dir": str(fixture.model_dir),
        "served_model_name": fixture.served_model_name,
        "adapters_dir": str(fixture.adapters_dir),
        "adapters": {name: str(path) for name, path in fixture.adapters.items()},
    }
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
