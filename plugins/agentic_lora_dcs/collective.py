"""Moving bucket bytes over ``torch.distributed``: one two-rank process group per attempt.

The receiver sidecar hosts a ``TCPStore``; every driver of every attempt rendezvouses under its
own prefix (``<lora_name>/<attempt>/<driver>``) and gets a fresh group with the publisher as rank 0
(the broadcast root) and the sidecar as rank 1. A group is never shared: a receive left pending by
an abandoned attempt can only time out, it can never consume a newer attempt's bytes.

Gloo on CPU, NCCL when CUDA is available. Every call here blocks; callers run them in a thread
(one thread per attempt, so an attempt's collectives happen in plan order).
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore
from torch._C._distributed_c10d import ProcessGroupGloo
from torch._C._distributed_c10d import Store
from torch._C._distributed_c10d import TCPStore

__all__ = [
    "SUPPORTED_BACKENDS",
    "AttemptGroup",
    "CollectiveCounter",
    "RendezvousServer",
    "connect_store",
    "default_backend",
]


def _supported() -> tuple[str, ...]:
    out: list[str] = []
    if dist.is_available() and dist.is_gloo_available():
        out.append("gloo")
    if dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available():
        out.append("nccl")
    return tuple(out)


SUPPORTED_BACKENDS: tuple[str, ...] = _supported()


def default_backend() -> str:
    """NCCL when this process has CUDA and NCCL, else gloo."""
    return "nccl" if "nccl" in SUPPORTED_BACKENDS else "gloo"


@dataclass
class CollectiveCounter:
    """Counts collectives this process joined, per (lora_name, attempt) and in total."""

    total: int = 0
    by_attempt: dict[tuple[str, int], int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, lora_name: str, attempt: int) -> None:
        with self._lock:
            self.total += 1
            key = (lora_name, attempt)
            self.by_attempt[key] = self.by_attempt.get(key, 0) + 1

    def of(self, lora_name: str, attempt: int) -> int:
        with self._lock:
            return self.by_attempt.get((lora_name, attempt), 0)


class RendezvousServer:
    """The TCPStore a sidecar hosts for the process groups of its attempts."""

    def __init__(self, host: str, port: int = 0, *, timeout: datetime.timedelta) -> None:
        self.host = host
        self._store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
        self.port: int = int(self._store.port)

    @property
    def store(self) -> Store:
        return self._store


def connect_store(host: str, port: int, *, timeout: datetime.timedelta) -> Store:
    """A client connection to a sidecar's rendezvous store (the publisher side)."""
    return TCPStore(host, port, is_master=False, timeout=timeout)


class _Work(Protocol):
    def wait(self) -> Any: ...


class _Broadcaster(Protocol):
    def broadcast(self, tensor: torch.Tensor, root: int) -> _Work: ...


@dataclass(frozen=True, kw_only=True, eq=False)
class AttemptGroup:
    """A two-rank group for one attempt; rank 0 broadcasts, rank 1 receives.

    ``label`` is the (lora_name, attempt) its collectives are counted under in ``counter``.
    """

    group: _Broadcaster
    rank: int
    backend: str
    device: torch.device
    label: tuple[str, int]
    counter: CollectiveCounter

    @classmethod
    def join(
        cls,
        *,
        store: Store,
        prefix: str,
        rank: int,
        backend: str,
        local_host: str,
        timeout: datetime.timedelta,
        label: tuple[str, int],
        counter: CollectiveCounter,
    ) -> AttemptGroup:
        """Rendezvous with the peer under ``prefix`` (blocks until both ranks joined or timeout)."""
        scoped = PrefixStore(prefix, store)
        group: Any
        if backend == "gloo":
            # The runtime spells the options class ``_Options`` (its stub says ``Options``).
            options: Any = getattr(ProcessGroupGloo, "_Options")()  # noqa: B009
            options._timeout = timeout
            # Bind the data plane to the named interface (loopback in tests), never a guess.
            options._devices = [ProcessGroupGloo.create_device(hostname=local_host)]
            group = ProcessGroupGloo(scoped, rank, 2, options)
            device = torch.device("cpu")
        elif backend == "nccl":
            if "nccl" not in SUPPORTED_BACKENDS:
                raise RuntimeError("NCCL needs CUDA and an NCCL-enabled torch build")
            # Only CUDA builds define it.
            from torch._C._distributed_c10d import ProcessGroupNCCL

            nccl_options = ProcessGroupNCCL.Options()
            nccl_options._timeout = timeout
            group = ProcessGroupNCCL(scoped, rank, 2, nccl_options)
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"unknown collective backend {backend!r}")
        return cls(
            group=group, rank=rank, backend=backend, device=device, label=label, counter=counter
        )

    def send(self, data: bytearray) -> None:
        """Broadcast one bucket from rank 0 (``data`` is borrowed, not copied, on CPU)."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 sends")
        tensor = torch.frombuffer(data, dtype=torch.uint8) if data else _empty()
        self._broadcast(tensor.to(self.device))

    def receive(self, nbytes: int) -> bytes:
        """Receive one bucket of exactly ``nbytes`` on rank 1."""
        if self.rank != 1:
            raise RuntimeError("only rank 1 receives")
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._broadcast(tensor)
        return bytes(tensor.cpu().numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        # Counted before the wait: a collective that was entered counts even if it then fails.
        self.counter.add(*self.label)
        self.group.broadcast(tensor, 0).wait()
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)

    def close(self) -> None:
        """Release the group's communicators (NCCL) or pairs (gloo, on the last reference)."""
        shutdown = getattr(self.group, "shutdown", None)
        if self.backend == "nccl" and callable(shutdown):
            shutdown()


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)
