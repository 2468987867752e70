"""Owner lease options and their checks: the owner id, the TTL and renew interval, and what a new
incarnation does with its predecessor's Sessions (see :mod:`agentic_lora.leases`)."""

from __future__ import annotations

import os
import socket
from typing import Final
from typing import Literal
from typing import Protocol

from agentic_lora.errors import ConfigurationError
from agentic_lora.foundation.identity import is_plain_token

__all__ = [
    "DEFAULT_LEASE_TTL",
    "LeaseSettings",
    "OnRestart",
    "check_lease_timing",
    "check_owner",
    "default_owner",
]

#: What a new incarnation does with its predecessor's Sessions (see :mod:`agentic_lora.leases`).
OnRestart = Literal["release", "adopt"]


class LeaseSettings(Protocol):
    """The lease part of the settings (:class:`~agentic_lora.config.AgenticLoRASettings` has it);
    declared here so the lease layer does not depend on the configuration layer above it."""

    @property
    def owner_id(self) -> str | None: ...

    @property
    def lease_ttl(self) -> float: ...

    @property
    def lease_renew_interval(self) -> float | None: ...


#: Seconds. Minutes-scale, not hours: a dead worker's refs are released within about a minute.
DEFAULT_LEASE_TTL: Final = 60.0

_MAX_OWNER = 200  # the registry takes 256 for a token; leave room in the lease id


def default_owner() -> str:
    """``"<hostname>-<pid>"``: unique per process, so a restart never releases its predecessor."""
    return f"{socket.gethostname()}-{os.getpid()}"


def check_owner(owner: object) -> str:
    """``owner`` if it is a usable owner id; else ConfigurationError (check ``owner_id``)."""
    if not is_plain_token(owner, _MAX_OWNER):
        raise ConfigurationError(
            f"owner id {owner!r} must be a printable string of 1-{_MAX_OWNER} characters "
            "without whitespace",
            check="owner_id",
        )
    return owner


def check_lease_timing(ttl: object, renew_interval: object) -> None:
    """ttl > 0 and 0 < renew_interval < ttl (None: ttl / 3); else ConfigurationError (``lease``)."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < float("inf"):
        raise ConfigurationError(
            f"lease ttl {ttl!r} must be a finite number of seconds above 0", check="lease"
        )
    if renew_interval is None:
        return
    if (
        isinstance(renew_interval, bool)
        or not isinstance(renew_interval, int | float)
        or not 0 < renew_interval < ttl
    ):
        raise ConfigurationError(
            f"lease renew interval {renew_interval!r} must be above 0 and below the ttl {ttl}: "
            "a lease renewed no more often than it expires is lost between two renewals",
            check="lease",
        )
