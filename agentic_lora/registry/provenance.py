"""Trajectory provenance and the bounded-staleness read: which version answered, and how far behind.

A Session binds once and never switches its version (see :mod:`agentic_lora.session`). What a
trainer needs from each turn is therefore fixed at the bind, except one number: the **lag**, how
many publications (commits) the current default is ahead of the Session's bound version::

    lag = current default_revision - binding.default_revision

(the registry increments ``default_revision`` by one per move of the default, a commit or a
rollback, and a :class:`~agentic_lora.registry.types.Binding` carries the revision it bound at).
So the lag counts moves of the default, not versions: after a rollback from B to A, a Session
bound to B has lag 1 although B is newer than A (it runs what is no longer the default), and a
Session that binds A afterwards has lag 0 and ``rolled_back_from`` = B.

* :class:`TurnProvenance` is attached to every successful versioned reply
  (:attr:`agentic_lora.engines.transport.EngineReply.provenance`); ``Session.provenance()`` gathers the
  turns into one JSON-able record for the trainer.
* :class:`DefaultRevisionReader` is the optional, I/O-free capability a registry client offers to
  say the current default revision without a round trip (the Ray client answers from its cache;
  a :class:`~agentic_lora.registry.local.LocalRegistry` is read through :class:`CoreRevision`).
  A cached revision can only be *older* than the registry's, so a stale cache can only
  under-estimate a lag: it may let a Session one refresh past its bound, never refuse one early.
* :class:`StalenessListener` is told the lag of every versioned dispatch and every
  ``VERSION_TOO_STALE`` refusal (the metrics hook; see :class:`agentic_lora.assembly.metrics.Metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol
from typing import runtime_checkable

from agentic_lora.foundation.identity import DIGEST_PREFIX_LENGTH

if TYPE_CHECKING:
    from agentic_lora.registry.core import RegistryCore
    from agentic_lora.registry.types import Binding

__all__ = [
    "CoreRevision",
    "DefaultRevisionReader",
    "StalenessListener",
    "TurnProvenance",
    "version_lag",
]


@runtime_checkable
class DefaultRevisionReader(Protocol):
    """Reads the registry's current default revision without I/O (None: not known yet)."""

    def default_revision(self) -> int | None: ...


class CoreRevision:
    """A :class:`DefaultRevisionReader` over an in-process registry core (exact, never stale)."""

    __slots__ = ("_core",)

    def __init__(self, core: RegistryCore) -> None:
        self._core = core

    def default_revision(self) -> int | None:
        return self._core.default_revision


class StalenessListener(Protocol):
    """Told about every versioned dispatch's lag (never a Session or version: both unbounded)."""

    def observe_version_lag(self, lag: int) -> None:
        """The lag of one dispatch, measured at its start (refused ones included)."""

    def observe_version_too_stale(self, lag: int) -> None:
        """One dispatch refused with ``VERSION_TOO_STALE`` at ``lag``."""


def version_lag(binding: Binding, current_revision: int | None) -> int | None:
    """Publications the default is ahead of ``binding`` (None when the revision is unknown).

    Never negative: a cached revision older than the bind (another client's cache) reads as 0.
    """
    if current_revision is None:
        return None
    return max(0, current_revision - binding.default_revision)


@dataclass(frozen=True, slots=True)
class TurnProvenance:
    """Where one reply came from: the bound version, and its lag when the turn started.

    ``lag`` is None only when the registry client cannot say the current default revision.
    ``rolled_back_from`` is set when the Session bound a default a rollback brought back: the
    version that rollback replaced.
    """

    version_id: str
    digest_prefix: str
    lora_name: str
    default_revision_at_bind: int
    lag: int | None
    rolled_back_from: str | None = None

    @classmethod
    def of(cls, binding: Binding, lag: int | None) -> TurnProvenance:
        """The provenance of a turn of a Session bound to ``binding``."""
        return cls(
            version_id=binding.version_id,
            digest_prefix=binding.digest[:DIGEST_PREFIX_LENGTH],
            lora_name=binding.lora_name,
            default_revision_at_bind=binding.default_revision,
            lag=lag,
            rolled_back_from=binding.rolled_back_from,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (the gateway's ``agentic_lora`` reply field)."""
        return {
            "version_id": self.version_id,
            "digest_prefix": self.digest_prefix,
            "lora_name": self.lora_name,
            "default_revision_at_bind": self.default_revision_at_bind,
            "lag": self.lag,
            "rolled_back_from": self.rolled_back_from,
        }
