"""The fixed bucket plan of one staged transfer.

A plan is computed from the snapshot before ``begin`` and travels inside it: tensors sorted by
name, packed greedily into buckets of at most ``bucket_bytes`` (a tensor larger than the limit gets
a bucket of its own), each tensor with its manifest checksum (name, dtype, shape, SHA-256 of its
contiguous bytes) and its byte range inside the bucket. Packing is a pure function of the manifest
and the limit, so the receiver rebuilds the plan from the entries it was sent and refuses ``begin``
when the result differs: both sides agree on how many collectives will happen and how large each
one is before the first byte moves.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping

from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import model_validator

from agentic_lora.adapters.safetensors_io import DTYPE_SIZES
from agentic_lora.adapters.safetensors_io import expected_nbytes
from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.adapters.snapshot import TensorBlob
from agentic_lora.errors import InvalidAdapterError
from agentic_lora.foundation.identity import ManifestEntry
from agentic_lora.foundation.identity import tensor_sha256

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "PLAN_FORMAT",
    "Bucket",
    "BucketPlan",
    "ChecksumMismatch",
    "TensorSlot",
    "plan_for_snapshot",
]

PLAN_FORMAT = "agentic-lora-dcs-plan/1"
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TensorSlot(_Frozen):
    """One tensor of the plan: its manifest entry plus where its bytes sit in its bucket."""

    name: str = Field(min_length=1)
    dtype: str
    shape: tuple[int, ...]
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)

    @model_validator(mode="after")
    def _size_matches_shape(self) -> TensorSlot:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {self.name!r}: unknown dtype {self.dtype!r}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: negative dimension in {self.shape}")
        if expected_nbytes(self.dtype, self.shape) != self.nbytes:
            raise ValueError(
                f"tensor {self.name!r}: {self.nbytes} bytes do not fit {self.dtype}{list(self.shape)}"
            )
        return self


class Bucket(_Frozen):
    """One collective: the concatenated bytes of ``tensors``, in plan order."""

    index: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    tensors: tuple[TensorSlot, ...] = Field(min_length=1)


class ChecksumMismatch(_Frozen):
    """A tensor whose received bytes do not hash to its manifest checksum."""

    bucket: int
    tensor: str
    expected: str
    actual: str


class BucketPlan(_Frozen):
    """The whole transfer: every tensor of the snapshot, bucketed, in name order."""

    format: str = PLAN_FORMAT
    bucket_bytes: int = Field(ge=1)
    buckets: tuple[Bucket, ...] = Field(min_length=1)

    @property
    def tensors(self) -> tuple[TensorSlot, ...]:
        """Every slot of the plan in transfer order (which is name order)."""
        return tuple(slot for bucket in self.buckets for slot in bucket.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @classmethod
    def build(cls, entries: Iterable[_Entry], bucket_bytes: int) -> BucketPlan:
        """Pack ``entries`` (name, dtype, shape, sha256, nbytes) into buckets, sorted by name."""
        if bucket_bytes < 1:
            raise InvalidAdapterError("bucket_bytes must be at least 1", reason="bad_plan")
        ordered = sorted(entries, key=lambda e: e[0])
        if not ordered:
            raise InvalidAdapterError("an adapter without tensors has no plan", reason="empty")
        names = [e[0] for e in ordered]
        if len(set(names)) != len(names):
            raise InvalidAdapterError("duplicate tensor names in the manifest", reason="bad_plan")
        buckets: list[Bucket] = []
        pending: list[TensorSlot] = []
        filled = 0
        for name, dtype, shape, sha256, nbytes in ordered:
            if pending and filled + nbytes > bucket_bytes:
                buckets.append(Bucket(index=len(buckets), nbytes=filled, tensors=tuple(pending)))
                pending, filled = [], 0
            pending.append(
                TensorSlot(
                    name=name, dtype=dtype, shape=shape, sha256=sha256, offset=filled, nbytes=nbytes
                )
            )
            filled += nbytes
        buckets.append(Bucket(index=len(buckets), nbytes=filled, tensors=tuple(pending)))
        return cls(bucket_bytes=bucket_bytes, buckets=tuple(buckets))

    def manifest_entries(self) -> tuple[ManifestEntry, ...]:
        """The plan's tensors as manifest entries (what the content digest is computed over)."""
        return tuple(ManifestEntry(s.name, s.dtype, s.shape, s.sha256) for s in self.tensors)

    def entries(self) -> list[_Entry]:
        """The manifest part of the plan, without the packing (input of :meth:`build`)."""
        return [(s.name, s.dtype, s.shape, s.sha256, s.nbytes) for s in self.tensors]

    def is_canonical(self) -> bool:
        """True when repacking this plan's own entries gives exactly this plan."""
        if self.format != PLAN_FORMAT:
            return False
        try:
            return BucketPlan.build(self.entries(), self.bucket_bytes) == self
        except (InvalidAdapterError, ValueError):
            return False

    def pack(self, index: int, tensors: Mapping[str, bytes]) -> bytearray:
        """The bytes of bucket ``index`` taken from ``tensors`` (name -> contiguous bytes)."""
        bucket = self.buckets[index]
        out = bytearray(bucket.nbytes)
        for slot in bucket.tensors:
            data = tensors[slot.name]
            if len(data) != slot.nbytes:
                raise InvalidAdapterError(
                    f"tensor {slot.name!r} has {len(data)} bytes, the plan says {slot.nbytes}",
                    reason="shape_mismatch",
                )
            out[slot.offset : slot.offset + slot.nbytes] = data
        return out

    def unpack(self, index: int, data: bytes) -> tuple[dict[str, bytes], list[ChecksumMismatch]]:
        """Split a received bucket into tensors and check every one against its checksum."""
        bucket = self.buckets[index]
        if len(data) != bucket.nbytes:
            raise ValueError(f"bucket {index}: got {len(data)} bytes, expected {bucket.nbytes}")
        view = memoryview(data)
        tensors: dict[str, bytes] = {}
        mismatches: list[ChecksumMismatch] = []
        for slot in bucket.tensors:
            raw = bytes(view[slot.offset : slot.offset + slot.nbytes])
            actual = tensor_sha256(raw)
            if actual != slot.sha256:
                mismatches.append(
                    ChecksumMismatch(
                        bucket=index, tensor=slot.name, expected=slot.sha256, actual=actual
                    )
                )
            tensors[slot.name] = raw
        return tensors, mismatches

    def blobs(self, tensors: Mapping[str, bytes]) -> tuple[TensorBlob, ...]:
        """The received tensors as snapshot blobs, in plan order."""
        return tuple(
            TensorBlob(name=s.name, dtype=s.dtype, shape=s.shape, data=tensors[s.name])
            for s in self.tensors
        )


_Entry = tuple[str, str, tuple[int, ...], str, int]


def plan_for_snapshot(snapshot: AdapterSnapshot, bucket_bytes: int) -> BucketPlan:
    """The plan that moves ``snapshot``; its checksums are the snapshot manifest's entries."""
    sizes = {blob.name: len(blob.data) for blob in snapshot.tensors}
    entries: list[_Entry] = [
        (e.name, e.dtype, e.shape, e.sha256, sizes[e.name]) for e in snapshot.manifest.tensors
    ]
    return BucketPlan.build(entries, bucket_bytes)
