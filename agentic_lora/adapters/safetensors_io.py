"""The safetensors file format as raw bytes, without torch or numpy.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
padded with spaces), then the tensor bytes. The ``safetensors`` package needs a framework
(torch) to hand out bf16 tensors; adapters are moved and hashed as bytes, so this module
reads and writes the format itself and keeps the core free of heavy dependencies.

Files written here are deterministic: tensors in the order given (callers sort by name),
a compact JSON header with sorted keys, padded to a multiple of 8 bytes (the alignment the
reference implementation uses), metadata ``{"format": "pt"}`` unless told otherwise.

Reading is strict: offsets must tile the data region exactly (no gaps, overlaps or trailing
bytes) and each tensor's byte length must match its dtype and shape; anything else raises
:class:`~agentic_lora.errors.InvalidAdapterError` with ``reason="bad_safetensors"``.

It also knows the float formats bit by bit: :func:`count_non_finite` counts NaN/inf values of
an F16/BF16/F32/F64 buffer from the exponent bits (vectorised with numpy when installed).
"""

from __future__ import annotations

import array
import json
import math
import os
import struct
import sys
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from types import ModuleType
from typing import IO
from typing import Any
from typing import NamedTuple

from agentic_lora.errors import InvalidAdapterError
from agentic_lora.foundation.identity import TensorLike

__all__ = [
    "DEFAULT_METADATA",
    "DTYPE_SIZES",
    "FLOAT_DTYPES",
    "MAX_HEADER_BYTES",
    "TensorRecord",
    "count_non_finite",
    "dumps",
    "expected_nbytes",
    "loads",
    "read_file",
    "write",
]

# Element size in bytes of every dtype code the safetensors format defines for whole bytes.
DTYPE_SIZES: Mapping[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

# Exponent mask of each IEEE-like float format: all exponent bits set means inf or NaN.
_EXPONENT_MASKS: Mapping[str, int] = {
    "F16": 0x7C00,
    "BF16": 0x7F80,
    "F32": 0x7F80_0000,
    "F64": 0x7FF0_0000_0000_0000,
}
FLOAT_DTYPES: frozenset[str] = frozenset(_EXPONENT_MASKS)

# The reference implementation refuses headers above 100 MB; so do we, before allocating.
MAX_HEADER_BYTES = 100_000_000
DEFAULT_METADATA: Mapping[str, str] = {"format": "pt"}
_METADATA_KEY = "__metadata__"
_ALIGNMENT = 8


class TensorRecord(NamedTuple):
    """One tensor read from a file: its name, dtype code, shape and owned raw bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes


def _bad(message: str, **details: Any) -> InvalidAdapterError:
    return InvalidAdapterError(
        f"invalid safetensors data: {message}", reason="bad_safetensors", **details
    )


def expected_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Byte length of a tensor of ``dtype`` and ``shape`` (``KeyError`` for unknown dtypes)."""
    return DTYPE_SIZES[dtype] * math.prod(shape)


# --- writing ---------------------------------------------------------------------------------


def _header(tensors: Sequence[TensorLike], metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        header[_METADATA_KEY] = dict(metadata)
    offset = 0
    for t in tensors:
        if t.name in header:
            raise _bad(f"tensor name {t.name!r} used twice or reserved", tensor=t.name)
        end = offset + len(t.data)
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    raw = text.encode("utf-8")
    raw += b" " * (-len(raw) % _ALIGNMENT)
    return struct.pack("<Q", len(raw)) + raw


def write(
    fp: IO[bytes],
    tensors: Sequence[TensorLike],
    metadata: Mapping[str, str] | None = DEFAULT_METADATA,
) -> int:
    """Write ``tensors`` (in the given order) to a binary file object; returns bytes written."""
    head = _header(tensors, metadata)
    fp.write(head)
    total = len(head)
    for t in tensors:
        fp.write(t.data)
        total += len(t.data)
    return total


def dumps(
    tensors: Sequence[TensorLike], metadata: Mapping[str, str] | None = DEFAULT_METADATA
) -> bytes:
    """The file bytes :func:`write` would produce."""
    return _header(tensors, metadata) + b"".join(t.data for t in tensors)


# --- reading ---------------------------------------------------------------------------------


class _Slot(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _bad(f"header names {key!r} twice", tensor=key)
        out[key] = value
    return out


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_header(raw: bytes, data_len: int) -> tuple[list[_Slot], dict[str, str]]:
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (ValueError, RecursionError) as exc:  # Unicode/JSON errors; absurdly deep nesting
        raise _bad(f"header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise _bad("header is not a JSON object")
    metadata = header.pop(_METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _bad("__metadata__ must map strings to strings")
    slots: list[_Slot] = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise _bad(f"entry {name!r} must have exactly dtype, shape, data_offsets", tensor=name)
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise _bad(f"unknown dtype {dtype!r} for {name!r}", tensor=name)
        if not isinstance(shape, list) or not all(_is_index(d) for d in shape):
            raise _bad(f"bad shape {shape!r} for {name!r}", tensor=name)
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_index(o) for o in offsets)
        ):
            raise _bad(f"bad data_offsets {offsets!r} for {name!r}", tensor=name)
        begin, end = offsets
        if end - begin != expected_nbytes(dtype, shape):
            raise _bad(
                f"{name!r} spans {end - begin} bytes, {dtype}{shape} needs "
                f"{expected_nbytes(dtype, shape)}",
                tensor=name,
            )
        slots.append(_Slot(name, dtype, tuple(shape), begin, end))
    # The tensors must tile the data region exactly: a gap or overlap means a corrupt file
    # (or one crafted so that two names alias the same bytes).
    position = 0
    for slot in sorted(slots, key=lambda s: (s.begin, s.end)):
        if slot.begin != position:
            raise _bad(
                f"{slot.name!r} starts at {slot.begin}, expected {position}", tensor=slot.name
            )
        position = slot.end
    if position != data_len:
        raise _bad(f"tensors cover {position} bytes of a {data_len}-byte data region")
    return slots, metadata


def _header_length(prefix: bytes, total: int) -> int:
    if len(prefix) < 8:
        raise _bad("file is shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise _bad(f"header length {length} exceeds {MAX_HEADER_BYTES}")
    if 8 + length > total:
        raise _bad(f"header length {length} runs past the end of the data")
    return int(length)


def _records(slots: Iterable[_Slot], read_at: Any) -> list[TensorRecord]:
    ordered = sorted(slots, key=lambda s: (s.begin, s.end))
    out = [TensorRecord(s.name, s.dtype, s.shape, read_at(s.begin, s.end)) for s in ordered]
    out.sort(key=lambda r: r.name)
    return out


def loads(data: bytes) -> tuple[list[TensorRecord], dict[str, str]]:
    """Parse file bytes; returns the tensors sorted by name and the ``__metadata__`` map."""
    length = _header_length(data[:8], len(data))
    start = 8 + length
    slots, metadata = _parse_header(data[8:start], len(data) - start)
    return _records(slots, lambda b, e: bytes(data[start + b : start + e])), metadata


def _size_of(fp: IO[bytes]) -> int:
    return os.fstat(fp.fileno()).st_size


def read_file(path: str | os.PathLike[str]) -> tuple[list[TensorRecord], dict[str, str]]:
    """Read a safetensors file tensor by tensor (no second copy of the whole file in memory)."""
    with open(path, "rb") as fp:
        total = _size_of(fp)
        length = _header_length(fp.read(8), total)
        raw = fp.read(length)
        start = 8 + length
        slots, metadata = _parse_header(raw, total - start)

        def read_at(begin: int, end: int) -> bytes:
            fp.seek(start + begin)
            chunk = fp.read(end - begin)
            if len(chunk) != end - begin:
                raise _bad("file shrank while it was read", path=os.fspath(path))
            return chunk

        return _records(slots, read_at), metadata


# --- float values ----------------------------------------------------------------------------


def _numpy_or_none() -> ModuleType | None:
    try:
        import numpy
    except ImportError:  # the core does not depend on numpy
        return None
    return numpy


def count_non_finite(dtype: str, data: bytes) -> int:
    """How many NaN or infinite values a little-endian F16/BF16/F32/F64 buffer holds.

    A value is non-finite exactly when all its exponent bits are set, for all four formats,
    so the check is an integer mask over the raw bytes and needs no float conversion (which
    numpy could not do for bf16 anyway).
    """
    mask = _EXPONENT_MASKS[dtype]
    size = DTYPE_SIZES[dtype]
    np = _numpy_or_none()
    if np is not None:
        words = np.frombuffer(data, dtype=f"<u{size}")
        return int(np.count_nonzero((words & np.array(mask, dtype=words.dtype)) == mask))
    typecode = next(c for c in "HILQ" if array.array(c).itemsize == size)
    words_py = array.array(typecode, data)
    if sys.byteorder == "big":  # pragma: no cover - the format is little-endian on every host
        words_py.byteswap()
    return sum(1 for w in words_py if w & mask == mask)
