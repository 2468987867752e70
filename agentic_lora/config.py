"""The framework flag and its settings, validated before anything starts.

One settings model, :class:`AgenticLoRASettings` (environment prefix ``AGENTIC_LORA_``, e.g.
``AGENTIC_LORA_ENGINES='["e0=http://127.0.0.1:30000", "e1=http://127.0.0.1:30001"]'``), and
:func:`add_arguments`, which adds ``--enable-versioned-lora-publication`` and its
``--versioned-lora-*`` options to a framework's argparse parser; :func:`from_args` reads them back
(command line over environment over defaults).

Validation is fail-fast and each failure is a :class:`~agentic_lora.errors.ConfigurationError`
whose ``details["check"]`` names the rule: ``empty_fleet``, ``duplicate_engine``, ``capacity``,
``engine_lora_slots``, ``pinned_slots``, ``router_retries``, ``base_model_name``,
``lora_name_prefix``, ``router``, ``backend``, ``engine_kind`` (a built-in backend for another
engine kind), ``journal_path``, ``gateway_id``, ``session_name_ttl``, ``resolve_backoff``,
``lease``, ``owner_id``, ``probe_interval``, ``max_version_lag``, ``gateway_limits``, ``settings`` (a value of the wrong type) and, at start-up against live
engines (:func:`verify_fleet`), ``engine_lora``.

``engine_kind`` says what software the engines run: the name of an installed engine dialect
(entry-point group ``agentic_lora.engines``, see :mod:`agentic_lora.engines.dialect`), which
decides how a Session names its adapter: ``"sglang"`` (the default) or ``"vllm"``. A vLLM fleet needs
the ``vllm`` backend (and that backend a vLLM fleet): vLLM's unload does not wait for in-flight
requests, so its backend waits for the Sessions' own count first
(:meth:`agentic_lora.deployment.Deployment.from_settings` wires that).

Why the gateway rule is an operator assertion: an SGLang router/gateway in front of the engines
retries failed requests by default (``--retry-max-retries``, on 408/429/5xx), which could run a
generation twice. It exposes no endpoint that reports its retry policy (its ``/get_server_info``
is a worker's), so start-up cannot query it. Set ``gateway_url`` whenever requests pass through
such a gateway (for instance when an entry of ``engines`` points at it); the operator must then
assert ``gateway_retries_disabled`` (the gateway runs with ``--disable-retries``), otherwise
start-up refuses.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from agentic_lora.backends import EngineRef
from agentic_lora.discovery import BACKENDS_GROUP, ROUTERS_GROUP, plugin_names
from agentic_lora.engines.dialect import (
    SlotSettings,
    check_lora_slots,
    dialect_names,
    load_dialect,
)
from agentic_lora.errors import ConfigurationError
from agentic_lora.leases import check_lease_timing, check_owner

if TYPE_CHECKING:
    from agentic_lora.transport import EngineTransport

__all__ = [
    "BUILTIN_BACKEND_ENGINE_KINDS",
    "AgenticLoRASettings",
    "add_arguments",
    "check_engine_server_info",
    "from_args",
    "given_flags",
    "load_settings",
    "verify_fleet",
]

logger = logging.getLogger(__name__)


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


class AgenticLoRASettings(BaseSettings):
    """Everything the versioned-publication feature needs, checked at construction.

    ``engine_kind`` names the engine dialect (``"sglang"`` or ``"vllm"``, or any installed
    ``agentic_lora.engines`` plugin): how requests address an adapter, and which built-in
    backends fit. Engine slot counts are the engines' SGLang options:
    ``engine_max_loaded_loras`` is
    ``--max-loaded-loras`` (must hold every managed version plus one: ``capacity + 1``) and
    ``engine_max_loras_per_batch`` is ``--max-loras-per-batch`` (SGLang keeps one slot unpinned,
    so ``max_loras_per_batch - 1`` must hold ``capacity`` pinned versions). Leave them unset to
    have :func:`verify_fleet` read them from the engines at start-up.

    ``probe_interval`` is how often (seconds) the repairer (:mod:`agentic_lora.repair`) reads
    every engine's incarnation: an engine that restarted is noticed within it (or at once, when
    it refuses a Session's request) and gets every dispatchable version loaded again; an engine
    that does not answer is routed around and counts as not ready.

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
    (:mod:`agentic_lora.resolver`): after a round that left a publication blocked it waits the
    initial seconds, then twice as long each time, never more than the max (a poke, e.g. a new
    BLOCKED result, retries at once).

    ``gateway_id`` is the Session gateway's owner id in the registry (not the SGLang router's
    ``gateway_url``): keep it stable across restarts, so a restarted gateway adopts its
    predecessor's Sessions at once; give each replica its own. ``session_name_ttl`` is how long
    the registry keeps a closed gateway Session id refused (seconds; see
    :mod:`agentic_lora.gateway.sessions`).
    """

    model_config = SettingsConfigDict(env_prefix="AGENTIC_LORA_", extra="forbid", frozen=True)

    enable_versioned_lora_publication: bool = False
    engines: tuple[EngineRef, ...] = ()
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
        if value is None:
            return ()
        if isinstance(value, str | Mapping | EngineRef):
            value = [value]
        return tuple(_parse_engine(v, i) for i, v in enumerate(value))

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
    if not s.engines:
        raise _fail("empty_fleet", "no engines configured: give at least one engine as name=url")
    names = [e.name for e in s.engines]
    urls = [e.base_url for e in s.engines]
    for label, values in (("name", names), ("URL", urls)):
        dupes = sorted({v for v in values if values.count(v) > 1})
        if dupes:
            raise _fail(
                "duplicate_engine", f"duplicate engine {label}(s): {dupes}", duplicates=dupes
            )
    if s.request_timeout <= 0 or s.connect_timeout <= 0:
        raise _fail("settings", "request_timeout and connect_timeout must be positive")
    if not 0 < s.probe_interval < float("inf"):
        raise _fail(
            "probe_interval",
            f"probe_interval {s.probe_interval} must be a finite number of seconds above 0",
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
    if (
        not gateway_id
        or len(gateway_id) > 200
        or not gateway_id.isprintable()
        or any(c.isspace() for c in gateway_id)
    ):
        raise _fail(
            "gateway_id",
            f"gateway_id {gateway_id!r} must be 1-200 printable characters without whitespace",
        )
    if not 0 < name_ttl < float("inf"):
        raise _fail(
            "session_name_ttl",
            f"session_name_ttl {name_ttl} must be a finite number of seconds above 0",
        )


def slot_settings(settings: AgenticLoRASettings) -> SlotSettings:
    """What ``settings`` say about the engines' LoRA slots."""
    return SlotSettings(
        settings.capacity, settings.engine_max_loaded_loras, settings.engine_max_loras_per_batch
    )


def check_engine_server_info(
    settings: AgenticLoRASettings, engine: str, info: Mapping[str, Any]
) -> None:
    """Check one engine's server info against the settings (LoRA on, enough slots), the way the
    settings' engine dialect reads it."""
    load_dialect(settings.engine_kind).check_server_info(
        info, engine=engine, slots=slot_settings(settings)
    )


async def verify_fleet(settings: AgenticLoRASettings, transport: EngineTransport) -> None:
    """Start-up check against the live engines (versioned mode only): LoRA on, enough slots.

    Server info is read and checked by the settings' engine dialect through ``transport``. A
    dialect whose engines publish none (vLLM, outside its development mode) reads nothing: then
    the first publication's load and probe prove runtime LoRA on every engine before anything
    binds to it.
    """
    if not settings.enable_versioned_lora_publication:
        return
    dialect = load_dialect(settings.engine_kind)
    slots = slot_settings(settings)
    for ref in settings.engines:
        info = await dialect.read_server_info(transport.engine_http(ref.name))
        if info is None:
            logger.info(
                "the engines publish no server info; LoRA support is proven by the first "
                "publication",
                extra={"engine_kind": settings.engine_kind},
            )
            return
        dialect.check_server_info(info, engine=ref.name, slots=slots)


# --- argparse -----------------------------------------------------------------------------------

_PREFIX = "versioned_lora_"

# (flag, settings field, argparse kwargs); every default is None so only given flags override.
_OPTIONS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    (
        "--versioned-lora-engine",
        "engines",
        {
            "action": "append",
            "metavar": "NAME=URL",
            "help": "an engine of the fixed fleet (repeat per engine)",
        },
    ),
    (
        "--versioned-lora-capacity",
        "capacity",
        {"type": int, "help": "managed versions held at once (>= 2)"},
    ),
    (
        "--versioned-lora-router",
        "router",
        {"help": "router plugin name (entry point in agentic_lora.routers)"},
    ),
    (
        "--versioned-lora-backend",
        "backend",
        {"help": "backend plugin name (entry point in agentic_lora.backends)"},
    ),
    ("--versioned-lora-journal-path", "journal_path", {"help": "registry journal (SQLite) path"}),
    (
        "--versioned-lora-name-prefix",
        "lora_name_prefix",
        {"help": "prefix of immutable adapter names"},
    ),
    (
        "--versioned-lora-base-model",
        "base_model_name",
        {"help": "served base model name (OpenAI routes)"},
    ),
    (
        "--versioned-lora-deployment-epoch",
        "deployment_epoch",
        {"type": int, "help": "deployment epoch"},
    ),
    (
        "--versioned-lora-engine-max-loaded-loras",
        "engine_max_loaded_loras",
        {"type": int, "help": "the engines' --max-loaded-loras (>= capacity + 1)"},
    ),
    (
        "--versioned-lora-engine-max-loras-per-batch",
        "engine_max_loras_per_batch",
        {"type": int, "help": "the engines' --max-loras-per-batch (>= capacity + 1)"},
    ),
    (
        "--versioned-lora-engine-kind",
        "engine_kind",
        {"help": "engine dialect (entry point in agentic_lora.engines): sglang or vllm"},
    ),
    (
        "--versioned-lora-gateway-url",
        "gateway_url",
        {"help": "SGLang router/gateway in front of the engines"},
    ),
    (
        "--versioned-lora-gateway-retries-disabled",
        "gateway_retries_disabled",
        {"action": "store_true", "help": "assert that the gateway runs with --disable-retries"},
    ),
    (
        "--versioned-lora-gateway-id",
        "gateway_id",
        {"help": "this Session gateway's owner id (stable across its restarts; one per replica)"},
    ),
    (
        "--versioned-lora-session-name-ttl",
        "session_name_ttl",
        {"type": float, "help": "seconds a closed gateway Session id stays refused"},
    ),
    (
        "--versioned-lora-request-timeout",
        "request_timeout",
        {"type": float, "help": "generation timeout (s)"},
    ),
    (
        "--versioned-lora-probe-interval",
        "probe_interval",
        {"type": float, "help": "seconds between engine incarnation/health probes (default 2)"},
    ),
    (
        "--versioned-lora-http-transport",
        "http_transport",
        {"choices": ["aiohttp", "httpx"], "help": "HTTP transport under httpx"},
    ),
    (
        "--versioned-lora-resolve-backoff-initial",
        "resolve_backoff_initial",
        {"type": float, "help": "first wait (s) before retrying a blocked publication's cleanup"},
    ),
    (
        "--versioned-lora-resolve-backoff-max",
        "resolve_backoff_max",
        {"type": float, "help": "longest wait (s) between retries of a blocked publication"},
    ),
    (
        "--versioned-lora-lease-ttl",
        "lease_ttl",
        {"type": float, "help": "seconds a dead worker's Sessions stay held (default 60)"},
    ),
    (
        "--versioned-lora-lease-renew-interval",
        "lease_renew_interval",
        {"type": float, "help": "seconds between lease renewals (default: lease ttl / 3)"},
    ),
    (
        "--versioned-lora-owner-id",
        "owner_id",
        {"help": "this worker slot's stable id (default: <hostname>-<pid>, TTL-only recovery)"},
    ),
    (
        "--versioned-lora-max-version-lag",
        "max_version_lag",
        {
            "type": int,
            "help": "refuse a Session's next dispatch once its version is more than this many "
            "publications behind the default (default: no bound)",
        },
    ),
    (
        "--versioned-lora-gateway-max-body-bytes",
        "gateway_max_body_bytes",
        {"type": int, "help": "gateway: largest request body (default 4 MiB; 413 beyond)"},
    ),
    (
        "--versioned-lora-gateway-max-json-depth",
        "gateway_max_json_depth",
        {"type": int, "help": "gateway: deepest JSON nesting of a body (default 64)"},
    ),
    (
        "--versioned-lora-gateway-max-messages",
        "gateway_max_messages",
        {"type": int, "help": "gateway: most chat messages per request (default 1024)"},
    ),
    (
        "--versioned-lora-gateway-max-n",
        "gateway_max_n",
        {"type": int, "help": "gateway: largest n (samples per request, default 8)"},
    ),
    (
        "--versioned-lora-gateway-max-tokens",
        "gateway_max_tokens",
        {
            "type": int,
            "help": "gateway: largest max_tokens / max_new_tokens (default 32768, lowered to the "
            "engines' context length when they report it)",
        },
    ),
    (
        "--versioned-lora-gateway-max-sessions",
        "gateway_max_sessions",
        {"type": int, "help": "gateway: open Sessions at most (default 2048; 429 beyond)"},
    ),
    (
        "--versioned-lora-gateway-idle-timeout",
        "gateway_idle_timeout",
        {
            "type": float,
            "help": "gateway: close Sessions idle this many seconds (default 900; 0 off)",
        },
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--enable-versioned-lora-publication`` and its ``--versioned-lora-*`` options."""
    group = parser.add_argument_group(
        "versioned LoRA publication",
        "immutable adapter versions, Session binding at first generation, safe reclaim",
    )
    group.add_argument(
        "--enable-versioned-lora-publication",
        dest="enable_versioned_lora_publication",
        action="store_true",
        default=None,
        help="publish every adapter update as an immutable version (off: legacy fixed name)",
    )
    for flag, field, kwargs in _OPTIONS:
        opts = dict(kwargs)
        if opts.get("action") == "store_true":
            opts["default"] = None
        else:
            opts.setdefault("default", None)
        if field == "engine_kind":
            opts["choices"] = list(dialect_names())  # the installed dialects, read now
        group.add_argument(flag, dest=_PREFIX + field, **opts)
    return parser


def given_flags(namespace: argparse.Namespace) -> dict[str, Any]:
    """The settings fields the command line set (flags of :func:`add_arguments`), by field name."""
    values: dict[str, Any] = {}
    flag = getattr(namespace, "enable_versioned_lora_publication", None)
    if flag is not None:
        values["enable_versioned_lora_publication"] = flag
    for _, field, _ in _OPTIONS:
        v = getattr(namespace, _PREFIX + field, None)
        if v is not None:
            values[field] = v
    return values


def from_args(namespace: argparse.Namespace, **overrides: Any) -> AgenticLoRASettings:
    """Settings from parsed arguments: given flags win over ``AGENTIC_LORA_*`` env, then defaults."""
    return AgenticLoRASettings(**{**given_flags(namespace), **overrides})


def load_settings(**values: Any) -> AgenticLoRASettings:
    """Settings from keyword values over the environment (a typed error on any bad value)."""
    return AgenticLoRASettings(**values)
