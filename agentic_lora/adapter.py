"""Adapter snapshots: an owned, immutable copy of one LoRA adapter and its content digest.

A publication freezes the adapter once, at a known point, and from then on hashes and transfers
only that copy: the digest names exactly the bytes that reach the engines, and a trainer that
keeps updating its live tensors cannot change a version already being published.

Build one with :meth:`AdapterSnapshot.from_blobs` (raw bytes, no torch),
:meth:`~AdapterSnapshot.from_peft_dir` (a PEFT ``save_pretrained`` directory, no torch),
:meth:`~AdapterSnapshot.from_state_dict` or :meth:`~AdapterSnapshot.from_module` (torch, imported
lazily). Every constructor validates; bad input raises
:class:`~agentic_lora.errors.InvalidAdapterError` with ``details["reason"]`` one of
:class:`AdapterProblem`.

The config is normalised before it is hashed, so equal adapters get equal digests however they
were produced: set-like fields (``target_modules``, ``exclude_modules``, ``modules_to_save``,
``layers_to_transform``, and any Python ``set``) are sorted and de-duplicated, and fields that
describe the writer rather than the adapter (``inference_mode``, ``peft_version``,
``auto_mapping``) are dropped. Tensors use PEFT's saved layout: ``<module>.lora_A.weight`` and
``<module>.lora_B.weight``, 2-D, float (F16/BF16/F32/F64), all values finite.
"""

from __future__ import annotations

import ctypes
import enum
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol, cast

from agentic_lora import safetensors_io
from agentic_lora.errors import InvalidAdapterError, InvalidIdentityError
from agentic_lora.identity import Manifest, canonical_json, freeze_json

if TYPE_CHECKING:
    import torch

__all__ = [
    "CONFIG_FILE",
    "SET_LIKE_CONFIG_FIELDS",
    "WEIGHTS_FILE",
    "WRITER_CONFIG_FIELDS",
    "AdapterProblem",
    "AdapterSnapshot",
    "TensorBlob",
    "normalize_config",
]

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

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


def _invalid(problem: AdapterProblem, message: str, **details: Any) -> InvalidAdapterError:
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
            raise _invalid(AdapterProblem.BAD_TENSOR, f"tensor name {self.name!r} is not a name")
        if self.dtype not in safetensors_io.DTYPE_SIZES:
            raise _invalid(
                AdapterProblem.BAD_DTYPE,
                f"{self.name!r} has dtype {self.dtype!r}, not a safetensors dtype code",
                tensor=self.name,
            )
        shape = self.shape
        if not isinstance(shape, tuple | list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise _invalid(
                AdapterProblem.BAD_TENSOR, f"{self.name!r} has shape {shape!r}", tensor=self.name
            )
        object.__setattr__(self, "shape", tuple(shape))
        data: object = self.data
        if isinstance(data, bytearray | memoryview):
            data = bytes(data)
            object.__setattr__(self, "data", data)
        if not isinstance(data, bytes):
            raise _invalid(
                AdapterProblem.BAD_TENSOR,
                f"{self.name!r} data is {type(data).__name__}, not bytes",
                tensor=self.name,
            )
        expected = safetensors_io.expected_nbytes(self.dtype, self.shape)
        if len(data) != expected:
            raise _invalid(
                AdapterProblem.BAD_TENSOR,
                f"{self.name!r} has {len(data)} bytes, {self.dtype}{list(self.shape)} needs {expected}",
                tensor=self.name,
            )

    @property
    def nbytes(self) -> int:
        """Length of ``data`` in bytes."""
        return len(self.data)


# --- config ----------------------------------------------------------------------------------


class _HasToDict(Protocol):
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


def normalize_config(config: Mapping[str, Any] | _HasToDict | None) -> Mapping[str, Any]:
    """Validate a LoRA adapter config and return its canonical, read-only form.

    Accepts a mapping (e.g. parsed ``adapter_config.json``) or a PEFT config object (anything
    with ``to_dict()``). See the module docstring for what is normalised.
    """
    if config is None:
        raise _invalid(AdapterProblem.MISSING_CONFIG, "no adapter config given")
    if not isinstance(config, Mapping):
        to_dict = getattr(config, "to_dict", None)
        if not callable(to_dict):
            raise _invalid(
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
        raise _invalid(
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
        raise _invalid(
            AdapterProblem.NOT_LORA,
            f"peft_type is {config.get('peft_type')!r}, expected 'LORA'",
        )
    if config.get("use_dora"):
        raise _invalid(AdapterProblem.NOT_LORA, "DoRA adapters (use_dora) are not plain LoRA")
    if not _is_positive_int(config.get("r")):
        raise _invalid(
            AdapterProblem.BAD_CONFIG, f"r must be a positive int, got {config.get('r')!r}"
        )
    if not _is_number(config.get("lora_alpha")):
        raise _invalid(
            AdapterProblem.BAD_CONFIG,
            f"lora_alpha must be a number, got {config.get('lora_alpha')!r}",
        )
    targets = config.get("target_modules")
    if not (isinstance(targets, str) and targets) and not (
        isinstance(targets, tuple) and targets and all(isinstance(t, str) and t for t in targets)
    ):
        raise _invalid(
            AdapterProblem.BAD_CONFIG,
            f"target_modules must be a non-empty name list or pattern, got {targets!r}",
        )
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, Mapping) or not all(
        _is_positive_int(rank) for rank in pattern.values()
    ):
        raise _invalid(
            AdapterProblem.BAD_CONFIG, f"rank_pattern must map to positive ints, got {pattern!r}"
        )
    for key in pattern:
        try:
            re.compile(key)
        except re.error as exc:
            raise _invalid(
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
        raise _invalid(AdapterProblem.EMPTY, "the adapter has no tensors")
    pairs: dict[str, dict[str, TensorBlob]] = {}
    for t in tensors:
        match = _LORA_WEIGHT.fullmatch(t.name)
        if match is None:
            raise _invalid(
                AdapterProblem.NON_LORA_TENSOR,
                f"{t.name!r} is not a LoRA weight (expected '<module>.lora_A.weight' or "
                "'<module>.lora_B.weight', PEFT's saved layout)",
                tensor=t.name,
            )
        if t.dtype not in safetensors_io.FLOAT_DTYPES:
            raise _invalid(
                AdapterProblem.BAD_DTYPE,
                f"{t.name!r} is {t.dtype}; LoRA weights must be F16, BF16, F32 or F64",
                tensor=t.name,
            )
        if len(t.shape) != 2 or 0 in t.shape:
            raise _invalid(
                AdapterProblem.SHAPE_MISMATCH,
                f"{t.name!r} has shape {list(t.shape)}; LoRA weights are non-empty 2-D matrices",
                tensor=t.name,
            )
        pairs.setdefault(match["module"], {})[match["side"]] = t
    for module, sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            (present,) = sides.values()
            raise _invalid(
                AdapterProblem.UNPAIRED_TENSOR,
                f"{present.name!r} has no matching lora_{'B' if 'A' in sides else 'A'} weight",
                tensor=present.name,
            )
        a, b = sides["A"], sides["B"]
        rank = _rank_for(module, config)
        # lora_A is (rank, in_features) and lora_B is (out_features, rank).
        if a.shape[0] != rank or b.shape[1] != rank:
            raise _invalid(
                AdapterProblem.SHAPE_MISMATCH,
                f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not have rank {rank}",
                tensor=a.name,
            )
    for t in tensors:
        bad = safetensors_io.count_non_finite(t.dtype, t.data)
        if bad:
            raise _invalid(
                AdapterProblem.NON_FINITE,
                f"{t.name!r} holds {bad} NaN/inf value(s)",
                tensor=t.name,
                count=bad,
            )


def _validated(
    config: Mapping[str, Any] | _HasToDict | None, tensors: Iterable[TensorBlob]
) -> tuple[Mapping[str, Any], tuple[TensorBlob, ...], Manifest]:
    normalized = normalize_config(config)
    blobs = tuple(tensors)
    for t in blobs:
        if not isinstance(t, TensorBlob):
            raise _invalid(AdapterProblem.BAD_TENSOR, f"{t!r} is not a TensorBlob")
    blobs = tuple(sorted(blobs, key=lambda t: t.name))
    _check_lora_tensors(normalized, blobs)
    manifest = Manifest.build(normalized, blobs)  # refuses duplicate names
    return manifest.config, blobs, manifest


# --- torch (optional) ------------------------------------------------------------------------


def _torch_dtype_codes() -> dict[Any, str]:
    import torch

    return {
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.float32: "F32",
        torch.float64: "F64",
    }


def _blob_from_torch(name: object, tensor: object, codes: Mapping[Any, str]) -> TensorBlob:
    import torch

    if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
        raise _invalid(
            AdapterProblem.BAD_TENSOR,
            f"state dict entry {name!r} is {type(tensor).__name__}, expected str -> torch.Tensor",
        )
    code = codes.get(tensor.dtype)
    if code is None:
        raise _invalid(
            AdapterProblem.BAD_DTYPE,
            f"{name!r} is {tensor.dtype}; LoRA weights must be float16/bfloat16/float32/float64",
            tensor=name,
        )
    # An owned copy: the bytes below share no storage with the live (possibly GPU, possibly
    # still training) tensor, so a later in-place update cannot change the snapshot.
    # string_at copies exactly the contiguous tensor's bytes from its first element in one pass
    # (torch cannot hand out a buffer without numpy, and copy_ into a frombuffer view is ~50x
    # slower). ``cpu`` is kept alive across the call, so the pointer stays valid.
    cpu = tensor.detach().to("cpu").contiguous()
    nbytes = cpu.numel() * cpu.element_size()
    data = ctypes.string_at(cpu.data_ptr(), nbytes) if nbytes else b""
    return TensorBlob(name, code, tuple(tensor.shape), data)


# --- snapshot --------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterSnapshot:
    """The frozen adapter one publication transfers; ``digest`` names its content.

    Constructing one directly validates ``config`` and ``tensors`` and checks that ``digest``
    is theirs (``reason="digest_mismatch"`` otherwise); the ``from_*`` constructors compute it.
    ``config`` is the normalised, read-only config (``json.dumps`` works on it;
    :func:`~agentic_lora.identity.thaw_json` gives a mutable copy) and ``tensors`` are sorted
    by name.
    """

    config: Mapping[str, Any]
    tensors: tuple[TensorBlob, ...]
    digest: str

    def __post_init__(self) -> None:
        config, tensors, manifest = _validated(self.config, self.tensors)
        if manifest.digest != self.digest:
            raise _invalid(
                AdapterProblem.DIGEST_MISMATCH,
                f"digest {self.digest!r} does not name this content ({manifest.digest})",
                expected=manifest.digest,
            )
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "tensors", tensors)
        object.__setattr__(self, "_manifest", manifest)

    @classmethod
    def _from_validated(
        cls, config: Mapping[str, Any] | _HasToDict | None, tensors: Iterable[TensorBlob]
    ) -> AdapterSnapshot:
        normalized, blobs, manifest = _validated(config, tensors)
        # Bypasses __init__ on purpose: __post_init__ would validate and hash everything again.
        snapshot = cls.__new__(cls)
        for name, value in (
            ("config", normalized),
            ("tensors", blobs),
            ("digest", manifest.digest),
            ("_manifest", manifest),
        ):
            object.__setattr__(snapshot, name, value)
        logger.debug(
            "adapter snapshot frozen",
            extra={"digest": manifest.digest, "tensors": len(blobs), "nbytes": snapshot.nbytes},
        )
        return snapshot

    # --- constructors ------------------------------------------------------------------------

    @classmethod
    def from_blobs(
        cls, config: Mapping[str, Any] | _HasToDict, tensors: Iterable[TensorBlob]
    ) -> AdapterSnapshot:
        """Validate raw tensors and a config, sort tensors by name and compute the digest."""
        return cls._from_validated(config, tensors)

    @classmethod
    def from_peft_dir(cls, path: str | os.PathLike[str]) -> AdapterSnapshot:
        """Read a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

        Needs neither torch nor the ``safetensors`` package.
        """
        directory = Path(path)
        config_path = directory / CONFIG_FILE
        weights_path = directory / WEIGHTS_FILE
        if not config_path.is_file():
            raise _invalid(
                AdapterProblem.MISSING_CONFIG, f"no {CONFIG_FILE} in {directory}", path=str(path)
            )
        if not weights_path.is_file():
            raise _invalid(
                AdapterProblem.MISSING_WEIGHTS, f"no {WEIGHTS_FILE} in {directory}", path=str(path)
            )
        try:
            config = json.loads(config_path.read_bytes(), parse_constant=_reject_json_constant)
        except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
            raise _invalid(
                AdapterProblem.BAD_CONFIG, f"{config_path} is not valid JSON: {exc}", path=str(path)
            ) from exc
        if not isinstance(config, dict):
            raise _invalid(
                AdapterProblem.BAD_CONFIG, f"{config_path} is not a JSON object", path=str(path)
            )
        records, _metadata = safetensors_io.read_file(weights_path)
        return cls._from_validated(config, (TensorBlob(*r) for r in records))

    @classmethod
    def from_state_dict(
        cls, state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any] | _HasToDict
    ) -> AdapterSnapshot:
        """Copy a LoRA state dict in PEFT's saved layout (``...lora_A.weight``) to owned bytes.

        Tensors may live on any device and need not be contiguous; the snapshot shares no
        storage with them.
        """
        if not isinstance(state_dict, Mapping):
            raise _invalid(
                AdapterProblem.BAD_TENSOR,
                f"state_dict is a {type(state_dict).__name__}, not a mapping",
            )
        codes = _torch_dtype_codes()
        blobs = [_blob_from_torch(name, t, codes) for name, t in state_dict.items()]
        return cls._from_validated(config, blobs)

    @classmethod
    def from_module(
        cls,
        module: torch.nn.Module,
        config: Mapping[str, Any] | _HasToDict | None = None,
        *,
        adapter_name: str = "default",
    ) -> AdapterSnapshot:
        """Snapshot the LoRA weights of a live PEFT model (``PeftModel``).

        Tensor names come from PEFT's own ``get_peft_model_state_dict`` (the layout
        ``save_pretrained`` writes); ``config`` defaults to the model's config for
        ``adapter_name``.
        """
        peft_configs = getattr(module, "peft_config", None)
        if not isinstance(peft_configs, Mapping) or adapter_name not in peft_configs:
            raise _invalid(
                AdapterProblem.NOT_LORA,
                f"{type(module).__name__} is not a PEFT model with adapter {adapter_name!r}",
            )
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(module, adapter_name=adapter_name)
        return cls.from_state_dict(state, peft_configs[adapter_name] if config is None else config)

    # --- views ---------------------------------------------------------------------------------

    @property
    def manifest(self) -> Manifest:
        """The canonical manifest (config, and per tensor name/dtype/shape/SHA-256)."""
        return cast(Manifest, self.__dict__["_manifest"])

    @property
    def nbytes(self) -> int:
        """Total tensor bytes (what a transfer moves)."""
        return sum(len(t.data) for t in self.tensors)

    def __hash__(self) -> int:
        # Equal snapshots have equal digests; the config mapping itself is not hashable.
        return hash(self.digest)

    def __repr__(self) -> str:
        return (
            f"AdapterSnapshot(digest={self.digest[:16]}…, r={self.config['r']}, "
            f"tensors={len(self.tensors)}, nbytes={self.nbytes})"
        )

    # --- outputs -------------------------------------------------------------------------------

    def config_json(self) -> bytes:
        """The ``adapter_config.json`` bytes :meth:`write_peft_dir` writes (deterministic)."""
        text = json.dumps(self.config, sort_keys=True, indent=2, ensure_ascii=False)
        return (text + "\n").encode("utf-8")

    def write_peft_dir(self, path: str | os.PathLike[str], *, fsync: bool = False) -> Path:
        """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``path``.

        The bytes depend only on the snapshot, so two writes give identical files. The directory
        is created if needed; existing adapter files are never overwritten (``FileExistsError``),
        and a failed write removes what it created. ``fsync=True`` flushes both files and the
        directory to disk (for callers that publish the directory with an atomic rename).
        """
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        created: list[Path] = []
        try:
            for name, writer in (
                (CONFIG_FILE, lambda fp: fp.write(self.config_json())),
                (WEIGHTS_FILE, lambda fp: safetensors_io.write(fp, self.tensors)),
            ):
                target = directory / name
                with open(target, "xb") as fp:
                    created.append(target)
                    writer(fp)
                    _flush(fp, fsync)
        except BaseException:
            for target in created:
                target.unlink(missing_ok=True)
            raise
        if fsync:
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return directory

    def to_torch_state_dict(self) -> dict[str, torch.Tensor]:
        """New CPU tensors (owning their memory) in PEFT's saved layout, by name."""
        import torch

        by_code = {code: dtype for dtype, code in _torch_dtype_codes().items()}
        return {
            t.name: torch.frombuffer(bytearray(t.data), dtype=by_code[t.dtype]).reshape(t.shape)
            for t in self.tensors
        }


def _flush(fp: IO[bytes], fsync: bool) -> None:
    fp.flush()
    if fsync:
        os.fsync(fp.fileno())


def _reject_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
