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

Validation and the canonical config form live in :mod:`agentic_lora.adapters.validation`; its
names stay importable from here.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
from collections.abc import Iterable
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from typing import TYPE_CHECKING
from typing import Any
from typing import cast

from agentic_lora.adapters import safetensors_io
from agentic_lora.adapters.validation import SET_LIKE_CONFIG_FIELDS
from agentic_lora.adapters.validation import WRITER_CONFIG_FIELDS
from agentic_lora.adapters.validation import AdapterProblem
from agentic_lora.adapters.validation import HasToDict
from agentic_lora.adapters.validation import TensorBlob
from agentic_lora.adapters.validation import invalid
from agentic_lora.adapters.validation import normalize_config
from agentic_lora.adapters.validation import validate
from agentic_lora.foundation.fsync import fsync_path
from agentic_lora.foundation.identity import Manifest

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
        raise invalid(
            AdapterProblem.BAD_TENSOR,
            f"state dict entry {name!r} is {type(tensor).__name__}, expected str -> torch.Tensor",
        )
    code = codes.get(tensor.dtype)
    if code is None:
        raise invalid(
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
    :func:`~agentic_lora.foundation.identity.thaw_json` gives a mutable copy) and ``tensors`` are sorted
    by name.
    """

    config: Mapping[str, Any]
    tensors: tuple[TensorBlob, ...]
    digest: str

    def __post_init__(self) -> None:
        config, tensors, manifest = validate(self.config, self.tensors)
        if manifest.digest != self.digest:
            raise invalid(
                AdapterProblem.DIGEST_MISMATCH,
                f"digest {self.digest!r} does not name this content ({manifest.digest})",
                expected=manifest.digest,
            )
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "tensors", tensors)
        object.__setattr__(self, "_manifest", manifest)

    @classmethod
    def _from_validated(
        cls, config: Mapping[str, Any] | HasToDict | None, tensors: Iterable[TensorBlob]
    ) -> AdapterSnapshot:
        normalized, blobs, manifest = validate(config, tensors)
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
        cls, config: Mapping[str, Any] | HasToDict, tensors: Iterable[TensorBlob]
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
            raise invalid(
                AdapterProblem.MISSING_CONFIG, f"no {CONFIG_FILE} in {directory}", path=str(path)
            )
        if not weights_path.is_file():
            raise invalid(
                AdapterProblem.MISSING_WEIGHTS, f"no {WEIGHTS_FILE} in {directory}", path=str(path)
            )
        try:
            config = json.loads(config_path.read_bytes(), parse_constant=_reject_json_constant)
        except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
            raise invalid(
                AdapterProblem.BAD_CONFIG, f"{config_path} is not valid JSON: {exc}", path=str(path)
            ) from exc
        if not isinstance(config, dict):
            raise invalid(
                AdapterProblem.BAD_CONFIG, f"{config_path} is not a JSON object", path=str(path)
            )
        records, _metadata = safetensors_io.read_file(weights_path)
        return cls._from_validated(config, (TensorBlob(*r) for r in records))

    @classmethod
    def from_state_dict(
        cls, state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any] | HasToDict
    ) -> AdapterSnapshot:
        """Copy a LoRA state dict in PEFT's saved layout (``...lora_A.weight``) to owned bytes.

        Tensors may live on any device and need not be contiguous; the snapshot shares no
        storage with them.
        """
        if not isinstance(state_dict, Mapping):
            raise invalid(
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
        config: Mapping[str, Any] | HasToDict | None = None,
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
            raise invalid(
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
            fsync_path(directory)
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
