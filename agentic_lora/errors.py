"""The exception tree of agentic-lora.

Every error the library raises on purpose is an :class:`AgenticLoRAError` with a stable
``code`` (a string that never changes between releases, safe to match on, log and count)::

    AgenticLoRAError
    ├── InvalidAdapterError            INVALID_ADAPTER       bad adapter input (config, tensors, values)
    ├── InvalidIdentityError           INVALID_IDENTITY      malformed version id, prefix, epoch, digest, name or manifest
    ├── ConfigurationError             CONFIG_ERROR          settings that cannot work, found at start-up
    ├── RegistryError                  (one subclass per registry code)
    │   ├── VersionConflictError       VERSION_CONFLICT      same version id, different content
    │   ├── CapacityError              CAPACITY_ERROR        no free version slot; nothing was transferred
    │   ├── PublicationBlockedError    PUBLICATION_BLOCKED   another publication is pending or unresolved
    │   ├── NoPublishedVersionError    NO_PUBLISHED_VERSION  bind before the first commit
    │   ├── SessionClosedError         SESSION_CLOSED        the Session is closing or closed
    │   ├── SessionExpiredError        SESSION_EXPIRED       the Session's lease expired; its ref was released
    │   ├── LeaseExpiredError          LEASE_EXPIRED         an owner's lease expired or was superseded by a restart
    │   ├── NotReadyError              NOT_READY             commit without READY from every engine
    │   ├── ReadyMismatchError         READY_MISMATCH        receipt for another version, digest or engine
    │   ├── StaleAttemptError          STALE_ATTEMPT         message of a superseded publication attempt
    │   ├── EngineRestartedError       ENGINE_RESTARTED      receipt from an engine incarnation that is gone
    │   ├── RevisionConflictError      REVISION_CONFLICT     commit against a default revision that moved
    │   ├── UnknownVersionError        UNKNOWN_VERSION       no such version
    │   ├── UnknownEngineError         UNKNOWN_ENGINE        engine not in the fixed fleet
    │   ├── InvalidStateError          INVALID_STATE         verb not allowed in the version's state
    │   ├── RollbackRefusedError       ROLLBACK_REFUSED      rollback to the default, a version never committed, an aborted one
    │   ├── MembershipError            (an engine's membership; one subclass per refused event)
    │   │   ├── EngineAlreadyMemberError ENGINE_ALREADY_MEMBER join of an engine that is a member already
    │   │   ├── ActivateRefusedError   ACTIVATE_REFUSED      activate of an engine that is not JOINING or EJECTED
    │   │   ├── MemberNotReadyError    MEMBER_NOT_READY      activate before every dispatchable version is loaded there
    │   │   ├── DrainRefusedError      DRAIN_REFUSED         drain of an engine not ACTIVE or JOINING, or of the last ACTIVE one
    │   │   ├── RemoveRefusedError     REMOVE_REFUSED        remove of an engine not DRAINING or EJECTED
    │   │   └── EjectRefusedError      EJECT_REFUSED         eject of an engine already EJECTED
    │   └── SessionStillBoundError     SESSION_STILL_BOUND   reclaim/forget while a Session holds it
    ├── JournalError                   (the durable journal)
    │   ├── JournalCorruptError        JOURNAL_CORRUPT       unreadable or inconsistent journal
    │   ├── JournalLockedError         JOURNAL_LOCKED        the journal is held by another opener (single writer)
    │   └── JournalForeignError        JOURNAL_FOREIGN       journal of another deployment or format
    ├── DispatchError                  (the generation path)
    │   ├── VersionNotDispatchableError VERSION_NOT_DISPATCHABLE  version is reclaiming or gone
    │   ├── AdapterMismatchError       ADAPTER_MISMATCH      caller named another adapter than the binding
    │   ├── SessionStateError          SESSION_STATE         Session cannot dispatch in its state
    │   ├── InvalidRequestError        INVALID_REQUEST       malformed generation request; nothing was sent
    │   │   └── RequestTooLargeError   REQUEST_TOO_LARGE     body over the gateway's size limit; nothing was sent
    │   ├── TooManySessionsError       TOO_MANY_SESSIONS     the gateway holds its maximum of open Sessions
    │   ├── VersionTooStaleError       VERSION_TOO_STALE     bound version too many publications behind; nothing sent
    │   ├── RequestRefusedError        REQUEST_REFUSED       engine provably did not accept the request
    │   │   └── VersionUnavailableError VERSION_UNAVAILABLE  no engine holds the bound version right now; nothing sent
    │   └── RequestIndeterminateError  REQUEST_INDETERMINATE engine may have accepted the request
    ├── SessionReleaseError            SESSION_RELEASE_FAILED release not confirmed; record kept for retry
    ├── AccessDeniedError              ACCESS_DENIED         missing or wrong token on a gateway route
    └── BackendError                   (publication and reclaim on engines)
        ├── BackendRefusedError        BACKEND_REFUSED       engine cleanly refused; nothing left behind
        └── BackendAmbiguousError      BACKEND_AMBIGUOUS     outcome unknown; resources may exist

``RequestRefusedError`` and ``RequestIndeterminateError`` are the two answers to "may the engine
have accepted this generation?". Nothing below the Session retries either; the caller decides.
"""

from __future__ import annotations

from typing import Any
from typing import ClassVar

__all__ = [
    "AccessDeniedError",
    "ActivateRefusedError",
    "AdapterMismatchError",
    "AgenticLoRAError",
    "BackendAmbiguousError",
    "BackendError",
    "BackendRefusedError",
    "CapacityError",
    "ConfigurationError",
    "DispatchError",
    "DrainRefusedError",
    "EjectRefusedError",
    "EngineAlreadyMemberError",
    "EngineRestartedError",
    "InvalidAdapterError",
    "InvalidIdentityError",
    "InvalidRequestError",
    "InvalidStateError",
    "JournalCorruptError",
    "JournalError",
    "JournalForeignError",
    "JournalLockedError",
    "LeaseExpiredError",
    "MemberNotReadyError",
    "MembershipError",
    "NoPublishedVersionError",
    "NotReadyError",
    "PublicationBlockedError",
    "ReadyMismatchError",
    "RegistryError",
    "RemoveRefusedError",
    "RequestIndeterminateError",
    "RequestRefusedError",
    "RequestTooLargeError",
    "RevisionConflictError",
    "RollbackRefusedError",
    "SessionClosedError",
    "SessionExpiredError",
    "SessionReleaseError",
    "SessionStateError",
    "SessionStillBoundError",
    "StaleAttemptError",
    "TooManySessionsError",
    "UnknownEngineError",
    "UnknownVersionError",
    "VersionConflictError",
    "VersionNotDispatchableError",
    "VersionTooStaleError",
    "VersionUnavailableError",
    "error_code",
    "error_from_code",
]


class AgenticLoRAError(Exception):
    """Base of every error agentic-lora raises on purpose. ``code`` is stable."""

    code: ClassVar[str] = "AGENTIC_LORA_ERROR"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __reduce__(self) -> tuple[Any, ...]:
        # Keeps code and details across pickling (Ray actor errors, multiprocessing).
        return (_rebuild, (type(self), self.message, self.details))

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}


def _rebuild(
    cls: type[AgenticLoRAError], message: str, details: dict[str, Any]
) -> AgenticLoRAError:
    return cls(message, **details)


class InvalidAdapterError(AgenticLoRAError):
    code = "INVALID_ADAPTER"


class InvalidIdentityError(AgenticLoRAError):
    """A version id, prefix, epoch, digest, lora name or manifest that is not well formed.

    ``details["field"]`` names which one.
    """

    code = "INVALID_IDENTITY"


class ConfigurationError(AgenticLoRAError):
    code = "CONFIG_ERROR"


class RegistryError(AgenticLoRAError):
    code = "REGISTRY_ERROR"


class VersionConflictError(RegistryError):
    code = "VERSION_CONFLICT"


class CapacityError(RegistryError):
    code = "CAPACITY_ERROR"


class PublicationBlockedError(RegistryError):
    code = "PUBLICATION_BLOCKED"


class NoPublishedVersionError(RegistryError):
    code = "NO_PUBLISHED_VERSION"


class SessionClosedError(RegistryError):
    code = "SESSION_CLOSED"


class SessionExpiredError(RegistryError):
    """The Session's lease expired (its owner stopped renewing, or restarted) and its ref was
    released; it can only be closed. Nothing was sent to an engine."""

    code = "SESSION_EXPIRED"


class LeaseExpiredError(RegistryError):
    """An owner's lease is gone: it expired, or a newer incarnation of the owner replaced it."""

    code = "LEASE_EXPIRED"


class NotReadyError(RegistryError):
    code = "NOT_READY"


class ReadyMismatchError(RegistryError):
    code = "READY_MISMATCH"


class StaleAttemptError(RegistryError):
    code = "STALE_ATTEMPT"


class EngineRestartedError(RegistryError):
    code = "ENGINE_RESTARTED"


class RevisionConflictError(RegistryError):
    code = "REVISION_CONFLICT"


class UnknownVersionError(RegistryError):
    code = "UNKNOWN_VERSION"


class UnknownEngineError(RegistryError):
    code = "UNKNOWN_ENGINE"


class InvalidStateError(RegistryError):
    code = "INVALID_STATE"


class SessionStillBoundError(RegistryError):
    code = "SESSION_STILL_BOUND"


class RollbackRefusedError(RegistryError):
    """A rollback that can never be done as asked; nothing changed. ``details["reason"]`` is one
    of ``"current_default"`` (the version is the default already, and not by a rollback),
    ``"never_committed"`` (it never was the default: there is nothing to roll back to) and
    ``"aborted"`` (its last attempt is aborted and its cleanup unconfirmed); ``details["version"]``
    names it. A rollback that must wait (another publication pending, a reclaim running) gets the
    error of that state instead (``PUBLICATION_BLOCKED``, ``INVALID_STATE``)."""

    code = "ROLLBACK_REFUSED"


class MembershipError(RegistryError):
    """A membership event the engine's state does not allow; nothing changed.
    ``details``: ``engine``, ``state`` (its membership state), ``event`` and ``allowed_from``."""

    code = "MEMBERSHIP_ERROR"


class EngineAlreadyMemberError(MembershipError):
    code = "ENGINE_ALREADY_MEMBER"


class ActivateRefusedError(MembershipError):
    code = "ACTIVATE_REFUSED"


class MemberNotReadyError(MembershipError):
    """Activation before the engine holds every dispatchable version under its current
    incarnation; ``details["missing"]`` names the versions."""

    code = "MEMBER_NOT_READY"


class DrainRefusedError(MembershipError):
    code = "DRAIN_REFUSED"


class RemoveRefusedError(MembershipError):
    code = "REMOVE_REFUSED"


class EjectRefusedError(MembershipError):
    code = "EJECT_REFUSED"


class JournalError(AgenticLoRAError):
    code = "JOURNAL_ERROR"


class JournalCorruptError(JournalError):
    code = "JOURNAL_CORRUPT"


class JournalForeignError(JournalError):
    code = "JOURNAL_FOREIGN"


class JournalLockedError(JournalError):
    """Another opener (usually another process) holds the journal (``details["holder"]`` names
    it): one writer only."""

    code = "JOURNAL_LOCKED"


class DispatchError(AgenticLoRAError):
    code = "DISPATCH_ERROR"


class VersionNotDispatchableError(DispatchError):
    code = "VERSION_NOT_DISPATCHABLE"


class AdapterMismatchError(DispatchError):
    code = "ADAPTER_MISMATCH"


class SessionStateError(DispatchError):
    code = "SESSION_STATE"


class InvalidRequestError(DispatchError):
    """The generation request is malformed; it was refused locally and never sent."""

    code = "INVALID_REQUEST"


class RequestTooLargeError(InvalidRequestError):
    """The request body is larger than the gateway accepts (``details``: ``limit`` in bytes).
    Refused as soon as the limit was passed, without reading the rest; nothing was sent."""

    code = "REQUEST_TOO_LARGE"


class TooManySessionsError(DispatchError):
    """The gateway already holds its maximum of open Sessions (``details``: ``limit``,
    ``retry_after`` seconds). A request of a new Session id is refused; nothing was opened."""

    code = "TOO_MANY_SESSIONS"


class VersionTooStaleError(DispatchError):
    """The Session's bound version is more than ``max_version_lag`` publications behind the
    current default (``details``: ``lag``, ``max_version_lag``, ``version``, ``session``).

    Raised at the start of a dispatch, before any engine call: nothing was sent. Sticky: the
    Session refuses every later dispatch too (its version never changes) and can only be closed.
    """

    code = "VERSION_TOO_STALE"


class RequestRefusedError(DispatchError):
    """The engine provably did not accept the request (nothing ran); safe to send again."""

    code = "REQUEST_REFUSED"


class VersionUnavailableError(RequestRefusedError):
    """No engine holds the Session's bound version right now (an engine restarted and the
    version is not loaded on it again yet). Nothing was sent; sending again later is safe."""

    code = "VERSION_UNAVAILABLE"


class RequestIndeterminateError(DispatchError):
    """The engine may have accepted the request; sending it again may run it twice."""

    code = "REQUEST_INDETERMINATE"


class SessionReleaseError(AgenticLoRAError):
    code = "SESSION_RELEASE_FAILED"


class AccessDeniedError(AgenticLoRAError):
    """A gateway route was called without its token, or with a wrong one; nothing was done."""

    code = "ACCESS_DENIED"


class BackendError(AgenticLoRAError):
    code = "BACKEND_ERROR"


class BackendRefusedError(BackendError):
    """The engine cleanly refused; it holds nothing of this attempt."""

    code = "BACKEND_REFUSED"


class BackendAmbiguousError(BackendError):
    """The outcome is unknown; the engine may hold resources of this attempt."""

    code = "BACKEND_AMBIGUOUS"


def _all_subclasses(cls: type[AgenticLoRAError]) -> list[type[AgenticLoRAError]]:
    out: list[type[AgenticLoRAError]] = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


_BY_CODE: dict[str, type[AgenticLoRAError]] = {c.code: c for c in _all_subclasses(AgenticLoRAError)}


def error_from_code(code: str, message: str, **details: Any) -> AgenticLoRAError:
    """Rebuild a typed error from its wire form (``to_dict``); unknown codes give the base class."""
    return _BY_CODE.get(code, AgenticLoRAError)(message, **details)


def error_code(exc: BaseException) -> str:
    """``exc``'s stable code, or its type name when it is not a typed error (for logs and reports).

    Metrics do not use it as a label: a type name is an open set (see :mod:`agentic_lora.assembly.metrics`).
    """
    return exc.code if isinstance(exc, AgenticLoRAError) else type(exc).__name__
