"""The settings model, :class:`AgenticLoRASettings`, and its fail-fast validation.

Every rule is checked at construction, and each failure is a
:class:`~agentic_lora.errors.ConfigurationError` whose ``details["check"]`` names the rule (see
:mod:`agentic_lora.config` for the list). Only the checks against live engines live elsewhere
(:mod:`agentic_lora.config.engine_checks`).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from typing import Literal
from typing import TypeVar

from pydantic import ValidationError
from pydantic import field_validator
from pydantic import model_validator
from pydantic_settings import BaseSettings
from pydantic_settings import SettingsConfigDict

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.dialect import check_lora_slots
from agentic_lora.engines.dialect import dialect_names
from agentic_lora.engines.pd import PDFleet
from agentic_lora.engines.pd import PDGroup
from agentic_lora.engines.pd import parse_pd_group
from agentic_lora.errors import ConfigurationError
from agentic_lora.foundation.discovery import BACKENDS_GROUP
from agentic_lora.foundation.discovery import ROUTERS_GROUP
from agentic_lora.foundation.discovery import plugin_names
from agentic_lora.foundation.identity import is_plain_token
from agentic_lora.leases import check_lease_timing
from agentic_lora.leases import check_owner
from agentic_lora.registry.journal import RegistryIdentity

__all__ = ["BUILTIN_BACKEND_ENGINE_KINDS", "AgenticLoRASettings", "load_settings"]

_ItemT = TypeVar("_ItemT")


def _parse_engine(value: Any, index: int) -> EngineRef:
    if isinstance(value, EngineRef):
        ref = value
    elif isinstance(value, Mapping):
        ref = EngineRef(name=str(value.get("name", "")), base_url=str(value.get("base_url", "")))
    elif isinstance(value, str):
        name, sep, url = value.partition("=")
        ref = (
            EngineRef(name=name.strip(), base_url=url.strip())
            if sep
            else EngineRef(f"e{index}", value.strip())
        )
    else:
        raise ValueError(f"engine #{index}: expected 'name=url', got {value!r}")
    if not ref.name:
        raise ValueError(f"engine #{index}: empty name in {value!r}")
    if not ref.base_url.startswith(("http://", "https://")):
        raise ValueError(f"engine {ref.name!r}: base URL {ref.base_url!r} is not http(s)")
    return EngineRef(ref.name, ref.base_url.rstrip("/"))


def _one_or_many(
    value: Any, item: type[_ItemT], parse: Callable[[Any, int], _ItemT]
) -> tuple[_ItemT, ...]:
    """A list setting given as a list, as one item (an ``item``, its string or its mapping) or
    as None (none); each entry parsed with its index, which names it in an error."""
    if value is None:
        return ()
    if isinstance(value, str | Mapping | item):
        value = [value]
    return tuple(parse(v, i) for i, v in enumerate(value))


class AgenticLoRASettings(BaseSettings):
    """Everything the versioned-publication feature needs, checked at construction.

    ``engine_kind`` names the engine dialect (``"sglang"`` or ``"vllm"``, or any installed
    ``agentic_lora.engines`` plugin): how requests address an adapter, and which built-in
    backends fit. Engine slot counts are the engines' SGLang options:
    ``engine_max_loaded_loras`` is
    ``--max-loaded-loras`` (must hold every managed version plus one: ``capacity + 1``) and
    ``engine_max_loras_per_batch`` is ``--max-loras-per-batch`` (SGLang keeps one slot unpinned,
    so ``max_loras_per_batch - 1`` must hold ``capacity`` pinned versions). Leave them unset to
    have :func:`~agentic_lora.config.engine_checks.verify_fleet` read them from the engines at start-up.

    ``probe_interval`` is how often (seconds) the repairer (:mod:`agentic_lora.publication.repair`) reads
    every engine's incarnation: an engine that restarted is noticed within it (or at once, when
    it refuses a Session's request) and gets every dispatchable version loaded again; an engine
    that does not answer is routed around and counts as not ready. ``probe_timeout`` bounds one
    engine's probe (default 5 s). An engine whose probes have failed for ``eject_after`` seconds
    (default 10; ``None`` turns ejection off) is ejected: it leaves the publication set, so a
    hung engine never stalls a publication, and rejoins once repaired
    (:mod:`agentic_lora.publication.ejection`).

    ``lease_ttl``, ``lease_renew_interval`` and ``owner_id`` are the rollout worker's owner lease
    (:mod:`agentic_lora.leases`): every Session ref hangs on it, it is renewed every
    ``lease_renew_interval`` seconds (default ``lease_ttl / 3``), and a worker that stops renewing
    loses its Sessions' refs ``lease_ttl`` seconds later (default 60, plus the registry's sweep
    interval). ``owner_id`` names the worker slot (``rollout-worker-3``): a restart of the same
    slot releases its predecessor's Sessions at once. Unset, it is ``<hostname>-<pid>``, which no
    restart reuses, so only the TTL frees a dead worker's Sessions.

    ``max_version_lag`` (unset: off) is the per-Session staleness bound: a Session whose bound
    version is more than that many publications behind the current default is refused at its
    next dispatch with ``VERSION_TOO_STALE`` and can then only be closed (see
    :mod:`agentic_lora.session`). 0 refuses any turn after a newer publication.

    ``resolve_backoff_initial`` and ``resolve_backoff_max`` pace the background resolver
    (:mod:`agentic_lora.publication.resolver`): after a round that left a publication blocked it waits the
    initial seconds, then twice as long each time, never more than the max (a poke, e.g. a new
    BLOCKED result, retries at once).

    ``pd_groups`` are prefill.decode-disaggregated engines (:mod:`agentic_lora.engines.pd`), each one
    fleet member for routing (reached at its SGLang PD router, whose retries must be off:
    ``gateway_retries_disabled``) whose prefill and decode servers are each an engine for
    publication, readiness and reclaim. ``pd_decode_max_loaded_loras`` and
    ``pd_decode_max_loras_per_batch`` are the decode servers' slot options when they differ from
    the ``engine_*`` ones; a decode server needs ``capacity + 1`` slots too (SGLang decode
    servers admit requests per adapter slot), and settings that would let it run out fail here.

    ``gateway_id`` is the Session gateway's owner id in the registry (not the SGLang router's
    ``gateway_url``): keep it stable across restarts, so a restarted gateway adopts its
    predecessor's Sessions at once; give each replica its own. ``session_name_ttl`` is how long
    the registry keeps a closed gateway Session id refused (seconds; see
    :mod:`agentic_lora.gateway.sessions`).
    """

    model_config = SettingsConfigDict(env_prefix="AGENTIC_LORA_", extra="forbid", frozen=True)

    enable_versioned_lora_publication: bool = False
    engines: tuple[EngineRef, ...] = ()
    pd_groups: tuple[PDGroup, ...] = ()
    pd_decode_max_loaded_loras: int | None = None
    pd_decode_max_loras_per_batch: int | None = None
    capacity: int = 2
    router: str = "session-affinity"
    backend: str = "http-push"
    journal_path: Path | None = None
    lora_name_prefix: str = "policy_lora"
    base_model_name: str | None = None
    deployment_epoch: int = 0
    engine_max_loaded_loras: int | None = None
    engine_max_loras_per_batch: int | None = None
    engine_kind: str = "sglang"
    gateway_url: str | None = None
    gateway_retries_disabled: bool = False
    gateway_id: str = "gateway"
    session_name_ttl: float = 3600.0
    request_timeout: float = 600.0
    connect_timeout: float = 5.0
    probe_interval: float = 2.0
    probe_timeout: float = 5.0
    eject_after: float | None = 10.0
    http_transport: Literal["aiohttp", "httpx"] = "aiohttp"
    resolve_backoff_initial: float = 1.0
    resolve_backoff_max: float = 30.0
    lease_ttl: float = 60.0
    lease_renew_interval: float | None = None
    owner_id: str | None = None
    max_version_lag: int | None = None
    # The Session gateway's input limits and Session bounds (docs/gateway.md, "Security").
    gateway_max_body_bytes: int = 4 * 1024 * 1024
    gateway_max_json_depth: int = 64
    gateway_max_messages: int = 1024
    gateway_max_n: int = 8
    gateway_max_tokens: int = 32768
    gateway_max_sessions: int = 2048
    gateway_idle_timeout: float = 900.0

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            problems = [
                f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}"
                for e in exc.errors()
            ]
            raise ConfigurationError(
                f"invalid settings: {'; '.join(problems)}", check="settings", problems=problems
            ) from exc

    @field_validator("engines", mode="before")
    @classmethod
    def _engines(cls, value: Any) -> tuple[EngineRef, ...]:
        return _one_or_many(value, EngineRef, _parse_engine)

    @field_validator("pd_groups", mode="before")
    @classmethod
    def _pd_groups(cls, value: Any) -> tuple[PDGroup, ...]:
        return _one_or_many(value, PDGroup, parse_pd_group)

    @property
    def fleet(self) -> PDFleet:
        """The fleet both ways: routing members and the servers publication drives."""
        return PDFleet(self.engines, self.pd_groups)

    @property
    def publication_engines(self) -> tuple[EngineRef, ...]:
        """Every server that holds adapters: plain engines and every PD role server."""
        return self.fleet.publication_engines

    @property
    def registry_identity(self) -> RegistryIdentity:
        """The identity of the registry these settings describe (its fleet of publication
        engines, capacity, deployment epoch and name prefix), as ``LocalRegistry`` and the Ray
        actor's ``connect`` take it: a journal opened under any other is refused."""
        return RegistryIdentity(
            engines=[e.name for e in self.publication_engines],
            capacity=self.capacity,
            deployment_epoch=self.deployment_epoch,
            prefix=self.lora_name_prefix,
        )

    @property
    def dispatch_engines(self) -> tuple[EngineRef, ...]:
        """The routing fleet: plain engines and one member per PD group (its router URL)."""
        return self.fleet.members

    def decode_slots(self) -> tuple[int | None, int | None]:
        """The decode servers' (max_loaded_loras, max_loras_per_batch) as the settings say."""
        return (
            self.pd_decode_max_loaded_loras
            if self.pd_decode_max_loaded_loras is not None
            else self.engine_max_loaded_loras,
            self.pd_decode_max_loras_per_batch
            if self.pd_decode_max_loras_per_batch is not None
            else self.engine_max_loras_per_batch,
        )

    @field_validator("engine_kind")
    @classmethod
    def _engine_kind(cls, value: str) -> str:
        installed = dialect_names()
        if value not in installed:
            raise ValueError(f"no engine dialect named {value!r}; installed: {list(installed)}")
        return value

    @model_validator(mode="after")
    def _fail_fast(self) -> AgenticLoRASettings:
        _validate(self)
        return self


#: Which engine kind each built-in backend publishes to (third-party backends are not checked).
BUILTIN_BACKEND_ENGINE_KINDS: Mapping[str, str] = {
    "http-push": "sglang",
    "dcs": "sglang",
    "vllm": "vllm",
}


def _fail(check: str, message: str, **details: Any) -> ConfigurationError:
    return ConfigurationError(message, check=check, **details)


def _validate(s: AgenticLoRASettings) -> None:
    if not s.engines and not s.pd_groups:
        raise _fail(
            "empty_fleet",
            "no engines configured: give at least one engine as name=url or one PD group",
        )
    s.fleet.check_distinct()
    if s.request_timeout <= 0 or s.connect_timeout <= 0:
        raise _fail("settings", "request_timeout and connect_timeout must be positive")
    if not 0 < s.probe_interval < float("inf"):
        raise _fail(
            "probe_interval",
            f"probe_interval {s.probe_interval} must be a finite number of seconds above 0",
        )
    if not 0 < s.probe_timeout < float("inf"):
        raise _fail(
            "probe_timeout",
            f"probe_timeout {s.probe_timeout} must be a finite number of seconds above 0",
        )
    if s.eject_after is not None and not 0 < s.eject_after < float("inf"):
        raise _fail(
            "eject_after",
            f"eject_after {s.eject_after} must be a finite number of seconds above 0, or unset",
        )
    if not 0 < s.resolve_backoff_initial <= s.resolve_backoff_max:
        raise _fail(
            "resolve_backoff",
            f"resolve backoff: need 0 < resolve_backoff_initial ({s.resolve_backoff_initial}) "
            f"<= resolve_backoff_max ({s.resolve_backoff_max})",
        )
    if s.max_version_lag is not None and s.max_version_lag < 0:
        raise _fail(
            "max_version_lag",
            f"max_version_lag {s.max_version_lag} must be 0 or more (unset: no bound)",
        )
    if not s.enable_versioned_lora_publication:
        return  # pass-through mode: nothing else is used
    if s.capacity < 2:
        raise _fail(
            "capacity",
            f"capacity {s.capacity} < 2: a retired version and the published one must coexist",
            capacity=s.capacity,
        )
    check_lora_slots(
        s.capacity, s.engine_max_loaded_loras, s.engine_max_loras_per_batch, source="settings"
    )
    if s.pd_groups:
        loaded, per_batch = s.decode_slots()
        check_lora_slots(s.capacity, loaded, per_batch, source="settings (PD decode servers)")
    if s.pd_groups and not s.gateway_retries_disabled:
        raise _fail(
            "router_retries",
            "PD groups are reached through their SGLang PD routers, which retry failed "
            "generations by default: start each with --disable-retries and set "
            "gateway_retries_disabled to assert so",
            routers=[g.router for g in s.pd_groups],
        )
    if s.gateway_url is not None and not s.gateway_retries_disabled:
        raise _fail(
            "router_retries",
            f"gateway {s.gateway_url} may retry failed generations (SGLang's router does by "
            "default) and its retry policy cannot be queried: start it with --disable-retries "
            "and set gateway_retries_disabled to assert so",
            gateway=s.gateway_url,
        )
    if (
        not s.base_model_name
        or ":" in s.base_model_name
        or s.base_model_name != s.base_model_name.strip()
    ):
        raise _fail(
            "base_model_name",
            f"base_model_name {s.base_model_name!r} must be the served model name, non-empty and "
            "without ':' (SGLang's OpenAI routes address an adapter as '<base>:<adapter>'; on "
            "vLLM a request naming the base model is pinned to the Session's adapter)",
        )
    prefix = s.lora_name_prefix
    if not prefix or any(c.isspace() for c in prefix) or "@" in prefix or ":" in prefix:
        raise _fail(
            "lora_name_prefix",
            f"lora_name_prefix {prefix!r} must be non-empty without whitespace, '@' or ':'",
        )
    for check, group, name in (
        ("router", ROUTERS_GROUP, s.router),
        ("backend", BACKENDS_GROUP, s.backend),
    ):
        installed = plugin_names(group)
        if name not in installed:
            raise _fail(check, f"no {check} plugin named {name!r}; installed: {list(installed)}")
    serves = BUILTIN_BACKEND_ENGINE_KINDS.get(s.backend)
    if serves is not None and serves != s.engine_kind:
        raise _fail(
            "engine_kind",
            f"backend {s.backend!r} publishes to {serves} engines, but engine_kind is "
            f"{s.engine_kind!r}; pick the backend for the engines you run",
            backend=s.backend,
            engine_kind=s.engine_kind,
        )
    check_lease_timing(s.lease_ttl, s.lease_renew_interval)
    if s.owner_id is not None:
        check_owner(s.owner_id)
    if s.journal_path is not None and not s.journal_path.parent.is_dir():
        raise _fail(
            "journal_path",
            f"journal directory {s.journal_path.parent} does not exist",
            journal_path=str(s.journal_path),
        )
    _check_gateway_names(s.gateway_id, s.session_name_ttl)
    _check_gateway_limits(s)


def _check_gateway_limits(s: AgenticLoRASettings) -> None:
    limits = {
        "gateway_max_body_bytes": s.gateway_max_body_bytes,
        "gateway_max_json_depth": s.gateway_max_json_depth,
        "gateway_max_messages": s.gateway_max_messages,
        "gateway_max_n": s.gateway_max_n,
        "gateway_max_tokens": s.gateway_max_tokens,
        "gateway_max_sessions": s.gateway_max_sessions,
    }
    for name, value in limits.items():
        if value < 1:
            raise _fail("gateway_limits", f"{name} {value} must be 1 or more", limit=name)
    # A chat request is already 4 levels deep ({"messages": [{"content": [{...}]}]}).
    if s.gateway_max_json_depth < 4:
        raise _fail("gateway_limits", "gateway_max_json_depth must be 4 or more", limit="depth")
    # 0 turns idle expiry off; anything else must be a finite number of seconds.
    if not 0 <= s.gateway_idle_timeout < float("inf"):
        raise _fail(
            "gateway_limits",
            f"gateway_idle_timeout {s.gateway_idle_timeout} must be 0 (off) or positive seconds",
            limit="gateway_idle_timeout",
        )


def _check_gateway_names(gateway_id: str, name_ttl: float) -> None:
    # The id becomes a lease owner ("<gateway_id>/<incarnation>"): the registry's token rules.
    if not is_plain_token(gateway_id, 200):
        raise _fail(
            "gateway_id",
            f"gateway_id {gateway_id!r} must be 1-200 printable characters without whitespace",
        )
    if not 0 < name_ttl < float("inf"):
        raise _fail(
            "session_name_ttl",
            f"session_name_ttl {name_ttl} must be a finite number of seconds above 0",
        )


def load_settings(**values: Any) -> AgenticLoRASettings:
    """Settings from keyword values over the environment (a typed error on any bad value)."""
    return AgenticLoRASettings(**values)
