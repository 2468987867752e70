"""The errors the TRL integration raises on purpose, each with a stable ``code``.

They are :class:`~agentic_lora.errors.AgenticLoRAError` subclasses like every error of the
core, so one ``except AgenticLoRAError`` (and one log field, ``code``) covers both::

    AgenticLoRAError
    ├── BridgeClosedError              TRL_BRIDGE_CLOSED      the DeploymentThread is not running
    ├── PublicationFailedError         TRL_PUBLICATION_FAILED trained weights did not reach the engines
    └── DispatchError
        └── RolloutTooStaleError       TRL_ROLLOUT_TOO_STALE  a trajectory was refused as too stale
                                                              more often than it may be restarted
"""

from __future__ import annotations

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import DispatchError

__all__ = ["BridgeClosedError", "PublicationFailedError", "RolloutTooStaleError"]


class BridgeClosedError(AgenticLoRAError):
    """The :class:`~agentic_lora_trl.DeploymentThread` was never started or is closed: nothing
    was submitted to it."""

    code = "TRL_BRIDGE_CLOSED"


class PublicationFailedError(AgenticLoRAError):
    """Raised by the publish callback at the end of training when a publication failed, or when
    the final weights never became the default. ``details["failures"]`` lists every failure
    (step, version, code, message); each was logged and counted when it happened."""

    code = "TRL_PUBLICATION_FAILED"


class RolloutTooStaleError(DispatchError):
    """A trajectory's Session was refused with ``VERSION_TOO_STALE`` on more attempts than the
    rollout may restart it. ``details``: ``prompt_index``, ``restarts`` (each refused attempt's
    version, lag and turns)."""

    code = "TRL_ROLLOUT_TOO_STALE"
