"""What makes an adapter valid LoRA, and the canonical form of its config.

Every :class:`~agentic_lora.adapters.snapshot.AdapterSnapshot` constructor goes through :func:`validate`;
bad input raises :class:`~agentic_lora.errors.InvalidAdapterError` with ``details["reason"]`` one
of :class:`AdapterProblem`.

The config is normalised before it is hashed, so equal adapters get equal digests however they
were produced: set-like fields (``target_modules``, ``exclude_modules``, ``modules_to_save``,
``layers_to_transform``, and any Python ``set``) are sorted and de-duplicated, and fields that
describe the writer rather than the adapter (``inference_mode``, ``peft_version``,
``auto_mapping``) are dropped. Tensors use PEFT's saved layout: ``<module>.lora_A.weight`` and
``<module>.lora_B.weight``, 2-D, float (F16/BF16/F32/F64), all values finite.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Protocol
from typing import cast

from agentic_lora.adapters import safetensors_io
from agentic_lora.errors import InvalidAdapterError
from agentic_lora.errors import InvalidIdentityError
from agentic_lora.foundation.identity import Manifest
from agentic_lora.foundation.identity import canonical_json
from agentic_lora.foundation.identity import freeze_json

__all__ = [
    "SET_LIKE_CONFIG_FIELDS",
    "WRITER_CONFIG_FIELDS",
    "AdapterProblem",
    "HasToDict",
    "TensorBlob",
    "invalid",
    "normalize_config",
    "validate",
]

# PEFT treats these as sets (it converts target/exclude lists to sets, tests membership in the
# others); writers emit them in arbitrary order, so only the sorted form is canonical.
SET_LIKE_CONFIG_FIELDS: frozenset[str] = frozenset(
    {"target_modules", "exclude_modules", "modules_to_save", "layers_to_transform"}
)
# Written by PEFT's save_pretrained about the writer (its version, the live model's class,
# training vs inference), not about the adapter: the same weights saved twice differ here.
WRITER_CONFIG_FIELDS: frozenset[str] = frozenset({"inference_mode", "peft_version", "auto_mapping"})

_LORA_WEIGHT = re.compile(r"(?P<module>.+)\.lora_(?P<side>[AB])\.weight")


class AdapterProblem(enum.StrEnum):
    """The stable ``reason`` detail of an :class:`~agentic_lora.errors.InvalidAdapterError`."""

    MISSING_CONFIG = "missing_config"  # no adapter_config.json / no config given
    BAD_CONFIG = "bad_config"  # config is not valid JSON or lacks/mistypes a LoRA field
    NOT_LORA = "not_lora"  # config describes another PEFT method (or DoRA)
    MISSING_WEIGHTS = "missing_weights"  # no adapter_model.safetensors
    BAD_SAFETENSORS = "bad_safetensors"  # the weights file is not a valid safetensors file
    BAD_TENSOR = "bad_tensor"  # not a tensor, or bytes that do not fit dtype and shape
    NON_LORA_TENSOR = "non_lora_tensor"  # a tensor that is not a lora_A/lora_B weight
    UNPAIRED_TENSOR = "unpaired_tensor"  # lora_A without lora_B or the other way round
    BAD_DTYPE = "bad_dtype"  # not F16/BF16/F32/F64
    SHAPE_MISMATCH = "shape_mismatch"  # not 2-D, empty, or inconsistent with the rank
    NON_FINITE = "non_finite"  # NaN or infinity in a weight
    EMPTY = "empty"  # no tensors at all
    DUPLICATE_TENSOR = "duplicate_tensor"  # one name twice
    DIGEST_MISMATCH = "digest_mismatch"  # a given digest does not name this content


def invalid(problem: AdapterProblem, message: str, **details: Any) -> InvalidAdapterError:
    """The typed error for ``problem``: ``details["reason"]`` is its stable value."""
    return InvalidAdapterError(message, reason=problem.value, **details)


@dataclass(frozen=True, slots=True)
class TensorBlob:
    """One tensor as bytes: ``dtype`` is a safetensors dtype code ("BF16", "F32", ...).

    ``data`` is the contiguous little-endian content; its length must be
    ``itemsize(dtype) * prod(shape)``. A ``bytearray``/``memoryview`` is copied into ``bytes``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise invalid(AdapterProblem.BAD_TENSOR, f"tensor name {self.name!r} is not a name")
        if self.dtype not in safetensors_io.DTYPE_SIZES:
            raise invalid(
                AdapterProblem.BAD_DTYPE,
                f"{self.name!r} has dtype {self.dtype!r}, not a safetensors dtype code",
                tensor=self.name,
            )
        shape = self.shape
        if not isinstance(shape, tuple | list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise invalid(
                AdapterProblem.BAD_TENSOR, f"{self.name!r} has shape {shape!r}", tensor=self.name
            )
        object.__setattr__(self, "shape", tuple(shape))
        data: object = self.data
        if isinstance(data, bytearray | memoryview):
            data = bytes(data)
            object.__setattr__(self, "data", data)
        if not isinstance(data, bytes):
            raise invalid(
                AdapterProblem.BAD_TENSOR,
                f"{self.name!r} data is {type(data).__name__}, not bytes",
                tensor=self.name,
            )
        expected = safetensors_io.expected_nbytes(self.dtype, self.shape)
        if len(data) != expected:
            raise invalid(
                AdapterProblem.BAD_TENSOR,
                f"{self.name!r} has {len(data)} bytes, {self.dtype}{list(self.shape)} needs {expected}",
                tensor=self.name,
            )

    @property
    def nbytes(self) -> int:
        """Length of ``data`` in bytes."""
        return len(self.data)


# --- config ----------------------------------------------------------------------------------


class HasToDict(Protocol):
    """A PEFT config object (``LoraConfig``): anything with ``to_dict()``."""

    def to_dict(self) -> Mapping[str, Any]: ...


def _sorted_unique(items: Iterable[Any]) -> list[Any]:
    values = list(items)
    if all(isinstance(v, str) for v in values) or all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        return sorted(set(values))
    # Mixed or compound members: order and de-duplicate by their canonical JSON bytes.
    by_bytes = {canonical_json(v): v for v in values}
    return [by_bytes[k] for k in sorted(by_bytes)]


def _without_sets(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return _sorted_unique(_without_sets(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _without_sets(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_without_sets(v) for v in value]
    return value


def normalize_config(config: Mapping[str, Any] | HasToDict | None) -> Mapping[str, Any]:
    """Validate a LoRA adapter config and return its canonical, read-only form.

    Accepts a mapping (e.g. parsed ``adapter_config.json``) or a PEFT config object (anything
    with ``to_dict()``). See the module docstring for what is normalised.
    """
    if config is None:
        raise invalid(AdapterProblem.MISSING_CONFIG, "no adapter config given")
    if not isinstance(config, Mapping):
        to_dict = getattr(config, "to_dict", None)
        if not callable(to_dict):
            raise invalid(
                AdapterProblem.BAD_CONFIG,
                f"adapter config is a {type(config).__name__}, not a mapping or PEFT config",
            )
        config = cast(Mapping[str, Any], to_dict())
    plain: dict[str, Any] = {}
    for key, value in config.items():
        if key in WRITER_CONFIG_FIELDS:
            continue
        value = _without_sets(value)
        if key in SET_LIKE_CONFIG_FIELDS and isinstance(value, list):
            value = _sorted_unique(value)
        plain[key] = value
    try:
        frozen: Mapping[str, Any] = freeze_json(plain)
    except InvalidIdentityError as exc:
        raise invalid(
            AdapterProblem.BAD_CONFIG, f"adapter config is not plain JSON: {exc.message}"
        ) from exc
    _check_lora_config(frozen)
    return frozen


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_lora_config(config: Mapping[str, Any]) -> None:
    if config.get("peft_type") != "LORA":
        raise invalid(
            AdapterProblem.NOT_LORA,
            f"peft_type is {config.get('peft_type')!r}, expected 'LORA'",
        )
    if config.get("use_dora"):
        raise invalid(AdapterProblem.NOT_LORA, "DoRA adapters (use_dora) are not plain LoRA")
    if not _is_positive_int(config.get("r")):
        raise invalid(
            AdapterProblem.BAD_CONFIG, f"r must be a positive int, got {config.get('r')!r}"
        )
    if not _is_number(config.get("lora_alpha")):
        raise invalid(
            AdapterProblem.BAD_CONFIG,
            f"lora_alpha must be a number, got {config.get('lora_alpha')!r}",
        )
    targets = config.get("target_modules")
    if not (isinstance(targets, str) and targets) and not (
        isinstance(targets, tuple) and targets and all(isinstance(t, str) and t for t in targets)
    ):
        raise invalid(
            AdapterProblem.BAD_CONFIG,
            f"target_modules must be a non-empty name list or pattern, got {targets!r}",
        )
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, Mapping) or not all(
        _is_positive_int(rank) for rank in pattern.values()
    ):
        raise invalid(
            AdapterProblem.BAD_CONFIG, f"rank_pattern must map to positive ints, got {pattern!r}"
        )
    for key in pattern:
        try:
            re.compile(key)
        except re.error as exc:
            raise invalid(
                AdapterProblem.BAD_CONFIG, f"rank_pattern key {key!r} is not a regex: {exc}"
            ) from exc


def _rank_for(module: str, config: Mapping[str, Any]) -> int:
    # The same lookup PEFT does (utils.other.get_pattern_key): first key whose pattern matches
    # the end of the module path, else the global r.
    pattern: Mapping[str, int] = config.get("rank_pattern") or {}
    for key, rank in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return rank
    return cast(int, config["r"])


# --- tensors ---------------------------------------------------------------------------------


def _check_lora_tensors(config: Mapping[str, Any], tensors: tuple[TensorBlob, ...]) -> None:
    if not tensors:
        raise invalid(AdapterProblem.EMPTY, "the adapter has no tensors")
    pairs: dict[str, dict[str, TensorBlob]] = {}
    for t in tensors:
        match = _LORA_WEIGHT.fullmatch(t.name)
        if match is None:
            raise invalid(
                AdapterProblem.NON_LORA_TENSOR,
                f"{t.name!r} is not a LoRA weight (expected '<module>.lora_A.weight' or "
                "'<module>.lora_B.weight', PEFT's saved layout)",
                tensor=t.name,
            )
        if t.dtype not in safetensors_io.FLOAT_DTYPES:
            raise invalid(
                AdapterProblem.BAD_DTYPE,
                f"{t.name!r} is {t.dtype}; LoRA weights must be F16, BF16, F32 or F64",
                tensor=t.name,
            )
        if len(t.shape) != 2 or 0 in t.shape:
            raise invalid(
                AdapterProblem.SHAPE_MISMATCH,
                f"{t.name!r} has shape {list(t.shape)}; LoRA weights are non-empty 2-D matrices",
                tensor=t.name,
            )
        pairs.setdefault(match["module"], {})[match["side"]] = t
    for module, sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            (present,) = sides.values()
            raise invalid(
                AdapterProblem.UNPAIRED_TENSOR,
                f"{present.name!r} has no matching lora_{'B' if 'A' in sides else 'A'} weight",
                tensor=present.name,
            )
        a, b = sides["A"], sides["B"]
        rank = _rank_for(module, config)
        # lora_A is (rank, in_features) and lora_B is (out_features, rank).
        if a.shape[0] != rank or b.shape[1] != rank:
            raise invalid(
                AdapterProblem.SHAPE_MISMATCH,
                f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not have rank {rank}",
                tensor=a.name,
            )
    for t in tensors:
        bad = safetensors_io.count_non_finite(t.dtype, t.data)
        if bad:
            raise invalid(
                AdapterProblem.NON_FINITE,
                f"{t.name!r} holds {bad} NaN/inf value(s)",
                tensor=t.name,
                count=bad,
            )


def validate(
    config: Mapping[str, Any] | HasToDict | None, tensors: Iterable[TensorBlob]
) -> tuple[Mapping[str, Any], tuple[TensorBlob, ...], Manifest]:
    """The normalised config, the tensors sorted by name, and their manifest; or a typed error."""
    normalized = normalize_config(config)
    blobs = tuple(tensors)
    for t in blobs:
        if not isinstance(t, TensorBlob):
            raise invalid(AdapterProblem.BAD_TENSOR, f"{t!r} is not a TensorBlob")
    blobs = tuple(sorted(blobs, key=lambda t: t.name))
    _check_lora_tensors(normalized, blobs)
    manifest = Manifest.build(normalized, blobs)  # refuses duplicate names
    return manifest.config, blobs, manifest
