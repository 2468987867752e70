"""What a version *is*: its names, its canonical manifest and its content digest.

Pure Python (no torch, no numpy), so the registry, the Session middleware and the receivers
next to each engine can all import it and agree, byte for byte, on one definition.

Names::

    lora_name = <prefix>@<deployment_epoch>-<version_id>-<digest[:16]>

``prefix`` and ``version_id`` use ``[A-Za-z0-9._-]`` (1..64 characters), the epoch is a
non-negative decimal integer without leading zeros, and the digest is 64 lowercase hex
characters. ``@`` cannot occur in a prefix, so a name splits back into its parts unambiguously
(:func:`parse_lora_name`). The digest prefix in the name is for people; code compares the full
digest.

Digest (manifest format ``agentic-lora-manifest/1``)::

    digest = sha256(canonical_json({
        "format": "agentic-lora-manifest/1",
        "config": <adapter config>,
        "tensors": [{"name", "dtype", "shape", "sha256"}, ...],   # sorted by name
    })).hexdigest()

where each tensor's ``sha256`` is over its contiguous little-endian bytes and ``dtype`` is its
safetensors code ("BF16", "F32", ...). :func:`canonical_json` fixes the byte form: sorted keys,
no whitespace, UTF-8, no NaN/inf, and an integral float written as an integer (``16.0`` and
``16`` are the same JSON number, as in RFC 8785). The format tag lets the definition evolve
without two definitions ever producing comparable digests.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections.abc import Iterable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import NoReturn
from typing import Protocol
from typing import TypeGuard

from agentic_lora.errors import InvalidAdapterError
from agentic_lora.errors import InvalidIdentityError

__all__ = [
    "DIGEST_PREFIX_LENGTH",
    "MANIFEST_FORMAT",
    "MAX_JSON_DEPTH",
    "LoraName",
    "Manifest",
    "ManifestEntry",
    "TensorLike",
    "VersionRef",
    "canonical_json",
    "compute_digest",
    "freeze_json",
    "is_plain_token",
    "make_lora_name",
    "parse_lora_name",
    "tensor_sha256",
    "thaw_json",
    "validate_deployment_epoch",
    "validate_digest",
    "validate_prefix",
    "validate_version_id",
]

MANIFEST_FORMAT = "agentic-lora-manifest/1"
DIGEST_PREFIX_LENGTH = 16

_TOKEN = r"[A-Za-z0-9._-]{1,64}"
_TOKEN_RE = re.compile(_TOKEN)
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_LORA_NAME_RE = re.compile(
    rf"(?P<prefix>{_TOKEN})@(?P<epoch>0|[1-9][0-9]{{0,18}})-(?P<version_id>{_TOKEN})"
    rf"-(?P<digest_prefix>[0-9a-f]{{{DIGEST_PREFIX_LENGTH}}})"
)
# The epoch is journaled as a SQLite INTEGER (signed 64 bit).
_MAX_EPOCH = 2**63 - 1
# Integral floats up to 2**53 are exact integers; beyond that repr() keeps the float form.
_MAX_EXACT_INT_FLOAT = 2.0**53


# --- names -----------------------------------------------------------------------------------


def is_plain_token(value: object, max_length: int) -> TypeGuard[str]:
    """``value`` is 1 to ``max_length`` printable characters without whitespace.

    The registry's rule for owners, incarnations, session keys and durable names, which the
    lease owner id must also meet.
    """
    return (
        isinstance(value, str)
        and 0 < len(value) <= max_length
        and value.isprintable()
        and not any(c.isspace() for c in value)
    )


def _check_token(value: object, field_name: str) -> str:
    if not isinstance(value, str) or not _TOKEN_RE.fullmatch(value):
        raise InvalidIdentityError(
            f"{field_name} must be 1..64 characters of [A-Za-z0-9._-], got {value!r}",
            field=field_name,
            value=repr(value),
        )
    return value


def validate_version_id(version_id: object) -> str:
    """Return ``version_id`` if it is 1..64 characters of ``[A-Za-z0-9._-]``.

    Raises :class:`~agentic_lora.errors.InvalidIdentityError` (``INVALID_IDENTITY``) otherwise.
    """
    return _check_token(version_id, "version_id")


def validate_prefix(prefix: object) -> str:
    """Return ``prefix`` if it is 1..64 characters of ``[A-Za-z0-9._-]`` (so never ``@``)."""
    return _check_token(prefix, "prefix")


def validate_deployment_epoch(deployment_epoch: object) -> int:
    """Return ``deployment_epoch`` if it is an ``int`` (not ``bool``) in ``0 .. 2**63-1``."""
    if (
        not isinstance(deployment_epoch, int)
        or isinstance(deployment_epoch, bool)
        or not 0 <= deployment_epoch <= _MAX_EPOCH
    ):
        raise InvalidIdentityError(
            f"deployment_epoch must be an int in 0..2**63-1, got {deployment_epoch!r}",
            field="deployment_epoch",
            value=repr(deployment_epoch),
        )
    return deployment_epoch


def validate_digest(digest: object) -> str:
    """Return ``digest`` if it is a full SHA-256 hex digest (64 lowercase hex characters)."""
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise InvalidIdentityError(
            f"digest must be 64 lowercase hex characters (SHA-256), got {digest!r}",
            field="digest",
            value=repr(digest),
        )
    return digest


@dataclass(frozen=True, slots=True)
class LoraName:
    """The parts of a ``lora_name``; ``str(name)`` gives the name back exactly."""

    prefix: str
    deployment_epoch: int
    version_id: str
    digest_prefix: str

    def __str__(self) -> str:
        return f"{self.prefix}@{self.deployment_epoch}-{self.version_id}-{self.digest_prefix}"

    def names_digest(self, digest: str) -> bool:
        """Whether this name's digest prefix is the prefix of ``digest``."""
        return digest[:DIGEST_PREFIX_LENGTH] == self.digest_prefix


@dataclass(frozen=True, slots=True)
class VersionRef:
    """One attempt of one version, as a single value: what every receipt names.

    ``version_id``, its content ``digest``, the ``lora_name`` the engines serve it under and the
    publication ``attempt`` are only meaningful together. Carried as one immutable value, taken
    whole from the registry's record of the version (or from the target an engine was asked to
    prepare), they cannot be assembled from two sources: no receipt can name one attempt's
    ``lora_name`` with another attempt's number, or one version's id with another's digest, so a
    READY proven for attempt 1 can never be counted for attempt 2's content.

    It checks nothing itself: the registry validates the parts when it mints them
    (:func:`make_lora_name`) and compares every part of a receipt it is handed against its own
    record.
    """

    version_id: str
    digest: str
    lora_name: str
    attempt: int


def make_lora_name(prefix: str, deployment_epoch: int, version_id: str, digest: str) -> str:
    """``<prefix>@<epoch>-<version_id>-<digest[:16]>``, every part validated first."""
    validate_prefix(prefix)
    validate_deployment_epoch(deployment_epoch)
    validate_version_id(version_id)
    validate_digest(digest)
    return f"{prefix}@{deployment_epoch}-{version_id}-{digest[:DIGEST_PREFIX_LENGTH]}"


def parse_lora_name(lora_name: object) -> LoraName:
    """Split a name made by :func:`make_lora_name` back into its parts (strict inverse)."""
    match = _LORA_NAME_RE.fullmatch(lora_name) if isinstance(lora_name, str) else None
    epoch = int(match["epoch"]) if match else -1
    if match is None or epoch > _MAX_EPOCH:
        raise InvalidIdentityError(
            f"not a versioned lora_name <prefix>@<epoch>-<version_id>-<digest[:16]>: {lora_name!r}",
            field="lora_name",
            value=repr(lora_name),
        )
    return LoraName(match["prefix"], epoch, match["version_id"], match["digest_prefix"])


# --- canonical JSON --------------------------------------------------------------------------


class _FrozenDict(dict[str, Any]):
    """A ``dict`` that refuses mutation: still JSON-serialisable and picklable as a dict.

    A snapshot's config is named by its digest; if the config could change after the digest
    was computed, the name would lie about the content.
    """

    __slots__ = ()

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("a frozen adapter config cannot be modified")

    __setitem__ = _refuse
    __delitem__ = _refuse
    __ior__ = _refuse
    clear = _refuse
    pop = _refuse
    popitem = _refuse
    setdefault = _refuse
    update = _refuse

    def __reduce__(self) -> tuple[Any, ...]:
        return (_FrozenDict, (dict(self),))


def _bad_json(message: str, path: str) -> InvalidIdentityError:
    return InvalidIdentityError(f"{message} at {path or '<root>'}", field="json", path=path)


#: Deepest nesting of objects and arrays a JSON value may have (adapter configs, manifests).
#: Real adapter configs nest 2-3 levels; the bound keeps recursion far from Python's limit.
MAX_JSON_DEPTH = 64


def freeze_json(value: object, _path: str = "", _depth: int = 0) -> Any:
    """A deep, read-only, canonical copy of a JSON value.

    Objects become read-only dicts (string keys only), arrays become tuples, ``str``
    subclasses (such as str-valued enums) become plain ``str`` and integral floats become
    ``int``. NaN, infinities, any non-JSON type and nesting deeper than :data:`MAX_JSON_DEPTH`
    raise :class:`~agentic_lora.errors.InvalidIdentityError`.
    """
    if _depth > MAX_JSON_DEPTH:
        raise _bad_json(f"nested deeper than {MAX_JSON_DEPTH} levels", _path[:200])
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _bad_json(f"non-finite number {value!r}", _path)
        if value.is_integer() and abs(value) <= _MAX_EXACT_INT_FLOAT:
            return int(value)
        return float(value)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise _bad_json(f"object key {key!r} is not a string", _path)
            out[str.__str__(key)] = freeze_json(item, f"{_path}.{key}", _depth + 1)
        return _FrozenDict(out)
    if isinstance(value, list | tuple):
        return tuple(freeze_json(item, f"{_path}[{i}]", _depth + 1) for i, item in enumerate(value))
    raise _bad_json(f"{type(value).__name__} is not a JSON type", _path)


def thaw_json(value: Any) -> Any:
    """A plain, mutable deep copy (dicts and lists) of a value made by :func:`freeze_json`."""
    if isinstance(value, Mapping):
        return {key: thaw_json(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [thaw_json(item) for item in value]
    return value


def canonical_json(value: object) -> bytes:
    """The one byte form of a JSON value used for digests.

    Sorted keys, ``,``/``:`` separators with no whitespace, UTF-8 (non-ASCII kept as is),
    integral floats as integers. Rejects NaN/inf, non-string keys, lone surrogates and
    non-JSON types with :class:`~agentic_lora.errors.InvalidIdentityError`.
    """
    text = json.dumps(freeze_json(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad_json("string is not encodable as UTF-8 (lone surrogate)", "") from exc


# --- manifest and digest ---------------------------------------------------------------------


class TensorLike(Protocol):
    """Anything that carries one tensor as raw bytes (e.g. :class:`~agentic_lora.adapters.snapshot.TensorBlob`)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def data(self) -> bytes: ...


def tensor_sha256(data: bytes) -> str:
    """SHA-256 hex of one tensor's contiguous bytes (the per-tensor checksum of the manifest)."""
    return hashlib.sha256(data).hexdigest()


def _bad_manifest(message: str, **details: Any) -> InvalidIdentityError:
    return InvalidIdentityError(f"malformed manifest: {message}", field="manifest", **details)


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    """One tensor of the manifest: name, safetensors dtype code, shape, SHA-256 of its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    sha256: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise _bad_manifest(f"tensor name {self.name!r}")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise _bad_manifest(f"dtype {self.dtype!r} of {self.name!r}", tensor=self.name)
        shape = self.shape
        if not isinstance(shape, tuple | list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise _bad_manifest(f"shape {shape!r} of {self.name!r}", tensor=self.name)
        object.__setattr__(self, "shape", tuple(shape))
        if not isinstance(self.sha256, str) or not _DIGEST_RE.fullmatch(self.sha256):
            raise _bad_manifest(f"sha256 {self.sha256!r} of {self.name!r}", tensor=self.name)

    @classmethod
    def of(cls, tensor: TensorLike) -> ManifestEntry:
        """The entry for ``tensor`` (hashes its bytes)."""
        return cls(tensor.name, tensor.dtype, tuple(tensor.shape), tensor_sha256(tensor.data))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``shape`` as a list)."""
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "sha256": self.sha256,
        }


_ENTRY_KEYS = frozenset({"name", "dtype", "shape", "sha256"})
_MANIFEST_KEYS = frozenset({"format", "config", "tensors"})


@dataclass(frozen=True)
class Manifest:
    """The canonical description of one adapter's content; its SHA-256 is the digest.

    ``config`` is frozen (see :func:`freeze_json`) and ``tensors`` are sorted by name with no
    duplicates, so one content has exactly one manifest and one digest.
    """

    config: Mapping[str, Any]
    tensors: tuple[ManifestEntry, ...]
    format: str = MANIFEST_FORMAT
    canonical: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.format != MANIFEST_FORMAT:
            raise _bad_manifest(
                f"format {self.format!r}, this library reads {MANIFEST_FORMAT!r}",
                format=repr(self.format),
            )
        if not isinstance(self.config, Mapping):
            raise _bad_manifest("config is not a JSON object")
        object.__setattr__(self, "config", freeze_json(self.config))
        entries = tuple(self.tensors)
        if not all(isinstance(e, ManifestEntry) for e in entries):
            raise _bad_manifest("tensors must be ManifestEntry values")
        names = [e.name for e in entries]
        if names != sorted(names):
            raise _bad_manifest("tensors are not sorted by name")
        _refuse_duplicates(names)
        object.__setattr__(self, "tensors", entries)
        object.__setattr__(self, "canonical", canonical_json(self.to_dict()))

    @classmethod
    def build(cls, config: Mapping[str, Any], tensors: Iterable[TensorLike]) -> Manifest:
        """Hash every tensor and sort by name; duplicate names are an invalid adapter."""
        entries = sorted((ManifestEntry.of(t) for t in tensors), key=lambda e: e.name)
        _refuse_duplicates([e.name for e in entries])
        return cls(config, tuple(entries))

    def __hash__(self) -> int:
        return hash(self.canonical)

    @property
    def digest(self) -> str:
        """SHA-256 hex of :attr:`canonical`: the content identity of the adapter."""
        return hashlib.sha256(self.canonical).hexdigest()

    def entry(self, name: str) -> ManifestEntry | None:
        """The entry for tensor ``name``, if the manifest has one."""
        for e in self.tensors:
            if e.name == name:
                return e
        return None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (a plain, mutable copy)."""
        return {
            "format": self.format,
            "config": thaw_json(self.config),
            "tensors": [e.to_dict() for e in self.tensors],
        }

    @classmethod
    def from_dict(cls, data: object) -> Manifest:
        """Rebuild a manifest from :meth:`to_dict` output (e.g. a marker file or a wire message)."""
        if not isinstance(data, Mapping) or set(data) != _MANIFEST_KEYS:
            raise _bad_manifest(f"expected an object with keys {sorted(_MANIFEST_KEYS)}")
        raw_tensors = data["tensors"]
        if not isinstance(raw_tensors, list | tuple):
            raise _bad_manifest("tensors is not an array")
        entries = []
        for raw in raw_tensors:
            if not isinstance(raw, Mapping) or set(raw) != _ENTRY_KEYS:
                raise _bad_manifest(f"tensor entry must have keys {sorted(_ENTRY_KEYS)}")
            entries.append(ManifestEntry(raw["name"], raw["dtype"], raw["shape"], raw["sha256"]))
        return cls(data["config"], tuple(entries), data["format"])

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        """Rebuild a manifest from JSON text such as :attr:`canonical`."""
        try:
            parsed = json.loads(data, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
            raise _bad_manifest(f"not JSON ({exc})") from exc
        return cls.from_dict(parsed)


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def _refuse_duplicates(sorted_names: list[str]) -> None:
    for a, b in itertools.pairwise(sorted_names):
        if a == b:
            raise InvalidAdapterError(
                f"tensor {a!r} appears more than once", reason="duplicate_tensor", tensor=a
            )


def compute_digest(config: Mapping[str, Any], tensors: Iterable[TensorLike]) -> str:
    """SHA-256 hex of the canonical manifest of ``config`` and ``tensors`` (see module doc)."""
    return Manifest.build(config, tensors).digest
