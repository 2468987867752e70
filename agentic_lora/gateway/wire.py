"""What the gateway puts on the wire: JSON forms of registry and publication values, and the HTTP
answer for every typed error. Nothing here imports the ASGI stack, so the CLI can use it too.

Every error answer has one shape, ``{"error": {"code", "message", "details"}}``, where ``code`` is
the stable code of :mod:`agentic_lora.errors`. On the generation routes the header
``X-Agentic-Outcome`` also says whether the engine may have accepted the request:

* ``refused``: provably not accepted (``REQUEST_REFUSED``, and every error raised before a
  request left the gateway: a malformed body, a closed Session, a version no longer dispatchable);
* ``indeterminate``: it may have run (``REQUEST_INDETERMINATE``, or an unexpected failure).

Answers that must not be resent carry ``x-should-retry: false``, which the official OpenAI SDKs
obey, so a client's built-in retry never runs an indeterminate generation twice.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import NoPublishedVersionError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import TooManySessionsError
from agentic_lora.foundation.outcomes import DispatchOutcome
from agentic_lora.foundation.outcomes import classify_failure
from agentic_lora.publication.publisher import PhaseEvent
from agentic_lora.publication.publisher import PublicationResult
from agentic_lora.publication.reclaimer import ReclaimReport
from agentic_lora.publication.resolver import ResolveReport
from agentic_lora.registry.types import RegistryStatus

__all__ = [
    "JSONABLE_MAX_DEPTH",
    "NDJSON",
    "OUTCOME_HEADER",
    "SHOULD_RETRY_HEADER",
    "DispatchOutcome",
    "classify_failure",
    "error_payload",
    "http_status",
    "jsonable",
    "phase_event_json",
    "publication_json",
    "reclaim_report_json",
    "resolve_report_json",
    "should_retry",
    "status_json",
]

#: Media type of a streamed publication: one JSON object per line.
NDJSON = "application/x-ndjson"
#: Response header naming the :class:`DispatchOutcome` of a generation.
OUTCOME_HEADER = "x-agentic-outcome"
#: Response header the OpenAI SDKs read before retrying on their own.
SHOULD_RETRY_HEADER = "x-should-retry"

#: HTTP status per error code; a code missing here takes the entry of its nearest base class.
_STATUS_BY_CODE: Mapping[str, int] = {
    "INVALID_REQUEST": 400,
    "REQUEST_TOO_LARGE": 413,
    "TOO_MANY_SESSIONS": 429,
    "ADAPTER_MISMATCH": 400,
    "INVALID_ADAPTER": 400,
    "INVALID_IDENTITY": 400,
    "ACCESS_DENIED": 401,
    "UNKNOWN_VERSION": 404,
    "UNKNOWN_ENGINE": 404,
    "REGISTRY_ERROR": 409,
    "SESSION_STATE": 409,
    "SESSION_CLOSED": 409,
    "SESSION_EXPIRED": 409,
    "VERSION_TOO_STALE": 409,
    "LEASE_EXPIRED": 409,
    "VERSION_NOT_DISPATCHABLE": 410,
    "DISPATCH_ERROR": 400,
    "REQUEST_REFUSED": 503,
    "VERSION_UNAVAILABLE": 503,
    "REQUEST_INDETERMINATE": 502,
    "NO_PUBLISHED_VERSION": 503,
    "SESSION_RELEASE_FAILED": 503,
    "BACKEND_ERROR": 502,
    "CONFIG_ERROR": 500,
    "JOURNAL_ERROR": 500,
    "JOURNAL_LOCKED": 503,
    "AGENTIC_LORA_ERROR": 500,
}


def http_status(exc: BaseException) -> int:
    """The HTTP status for ``exc`` (500 for anything that is not a typed error).

    ``REQUEST_REFUSED`` passes an engine's own 4xx through (the engine judged the request); a
    refusal without one (engine unreachable, no healthy engine) is 503.
    """
    if not isinstance(exc, AgenticLoRAError):
        return 500
    if isinstance(exc, RequestRefusedError):
        status = exc.details.get("status")
        if isinstance(status, int) and 400 <= status < 500:
            return status
    for cls in type(exc).__mro__:
        code = getattr(cls, "code", None)
        if isinstance(code, str) and code in _STATUS_BY_CODE:
            return _STATUS_BY_CODE[code]
    return 500


def should_retry(exc: BaseException) -> bool:
    """Whether a client may resend on its own: only when nothing ran and a retry can help."""
    if isinstance(exc, NoPublishedVersionError | TooManySessionsError):
        return True
    if not isinstance(exc, RequestRefusedError):
        return False
    # An unreachable or busy engine may take it next time; any other 4xx would be refused again.
    return exc.details.get("status") in (None, 408, 429)


def error_payload(exc: BaseException) -> dict[str, Any]:
    """``{"error": {"code", "message", "details"}}`` for ``exc``; always strict JSON (see
    :func:`jsonable`), whatever an engine's answer put in the details or the message."""
    if isinstance(exc, AgenticLoRAError):
        return {
            "error": {
                "code": exc.code,
                "message": _text(exc.message),
                "details": jsonable(exc.details),
            }
        }
    return {
        "error": {
            "code": AgenticLoRAError.code,
            "message": _text(f"unexpected {type(exc).__name__}: {_render(str, exc)}"),
            "details": {},
        }
    }


#: Containers nested deeper than this in a value given to :func:`jsonable` are summarised. An
#: error's details may hold an engine's answer verbatim, nested as deep as JSON parsing allowed;
#: re-encoding that would exhaust the stack while the error answer is being built.
JSONABLE_MAX_DEPTH = 32
_CONTAINERS = (Mapping, list, tuple, set, frozenset)


def jsonable(value: Any) -> Any:
    """A strict-JSON copy of ``value``: dataclasses as plain dicts, enums as their values.

    Anything else that strict JSON cannot carry becomes a string: a non-finite float its
    ``repr`` (``"nan"``), a string with a lone surrogate its escaped form, a container nested
    deeper than :data:`JSONABLE_MAX_DEPTH` a short summary, any other object its ``repr``. So an
    error detail can never break the error answer that carries it.
    """
    return _jsonable(value, 0)


def _jsonable(value: Any, depth: int) -> Any:
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, enum.Enum):
        return _jsonable(value.value, depth)
    if isinstance(value, os.PathLike):
        return _text(os.fspath(value))
    record = dataclasses.is_dataclass(value) and not isinstance(value, type)
    if depth >= JSONABLE_MAX_DEPTH and (record or isinstance(value, _CONTAINERS)):
        return f"<{type(value).__name__} nested deeper than {JSONABLE_MAX_DEPTH} levels>"
    if record:
        return {
            f.name: _jsonable(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)
        }
    if isinstance(value, Mapping):
        return {_text(str(k)): _jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v, depth + 1) for v in value]
    return _text(_render(repr, value))


def _text(value: str) -> str:
    # A lone surrogate (JSON's "\ud800" decodes to one) cannot be encoded as UTF-8: escaped.
    try:
        value.encode()
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode()
    return value


def _render(render: Callable[[object], str], value: object) -> str:
    try:
        return render(value)
    except Exception:  # a broken __repr__, or one that recurses past the stack
        return f"<{type(value).__name__}>"


def status_json(status: RegistryStatus) -> dict[str, Any]:
    """The registry status as JSON (what ``GET /admin/status`` answers under ``registry``)."""
    out: dict[str, Any] = jsonable(status)
    return out


def publication_json(result: PublicationResult) -> dict[str, Any]:
    """A publication result as JSON, with ``ok`` spelled out."""
    out: dict[str, Any] = jsonable(result)
    out["ok"] = result.ok
    return out


def reclaim_report_json(report: ReclaimReport) -> dict[str, Any]:
    """One reclaim round as JSON."""
    return {
        "results": jsonable(report.results),
        "reclaimed": list(report.reclaimed),
        "pending": list(report.pending),
    }


def resolve_report_json(report: ResolveReport) -> dict[str, Any]:
    """A resolve as JSON: each version's publication result, as ``/admin/publish`` answers it."""
    return {
        "results": [publication_json(r) for r in report.results],
        "resolved": list(report.resolved),
        "blocked": list(report.blocked),
    }


def phase_event_json(event: PhaseEvent) -> dict[str, Any]:
    """A publication or reclaim progress event as JSON."""
    out: dict[str, Any] = jsonable(event)
    return out
