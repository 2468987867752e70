"""How one generation ended, as far as "may the engine have run it?" goes.

This sits right above :mod:`agentic_lora.errors` so that every layer that reports a dispatch
(the metrics middleware, the gateway's ``X-Agentic-Outcome`` header) uses one vocabulary
without importing a surface: nothing here knows about HTTP or the gateway.
"""

from __future__ import annotations

import enum

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import RequestIndeterminateError

__all__ = ["DispatchOutcome", "classify_failure"]


class DispatchOutcome(enum.StrEnum):
    """How one generation ended, as far as "may the engine have run it?" goes."""

    OK = "ok"
    REFUSED = "refused"  # provably not accepted: safe to send again
    INDETERMINATE = "indeterminate"  # may have run: sending again may run it twice


def classify_failure(exc: BaseException, *, sent: bool) -> DispatchOutcome:
    """The outcome of a failed generation.

    Every typed error except ``REQUEST_INDETERMINATE`` is raised before anything reached an
    engine (or is the engine's own refusal). Anything else (a cancellation, a bug) is judged by
    ``sent``: whether the request may already have left for an engine.
    """
    if isinstance(exc, RequestIndeterminateError):
        return DispatchOutcome.INDETERMINATE
    if isinstance(exc, AgenticLoRAError):
        return DispatchOutcome.REFUSED
    return DispatchOutcome.INDETERMINATE if sent else DispatchOutcome.REFUSED
