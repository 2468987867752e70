"""The argparse flag layer: ``--enable-versioned-lora-publication`` and ``--versioned-lora-*``.

:func:`add_arguments` adds the flags to a framework's parser, :func:`given_flags` reads back the
ones the command line set (by settings field name) and :func:`from_args` builds the settings from
them: command line over environment over defaults. Every flag defaults to None, so a flag left out
never hides an ``AGENTIC_LORA_*`` environment value.
"""

from __future__ import annotations

import argparse
from typing import Any

from agentic_lora.config.settings import AgenticLoRASettings
from agentic_lora.engines.dialect import dialect_names

__all__ = ["add_arguments", "from_args", "given_flags"]

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
        "--versioned-lora-pd-group",
        "pd_groups",
        {
            "action": "append",
            "metavar": "NAME=prefill=URL,decode=URL,router=URL",
            "help": "a prefill/decode-disaggregated engine group, one fleet member reached at "
            "its SGLang PD router (repeat per group; decode may repeat)",
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
        "--versioned-lora-pd-decode-max-loaded-loras",
        "pd_decode_max_loaded_loras",
        {"type": int, "help": "the PD decode servers' --max-loaded-loras (>= capacity + 1)"},
    ),
    (
        "--versioned-lora-pd-decode-max-loras-per-batch",
        "pd_decode_max_loras_per_batch",
        {"type": int, "help": "the PD decode servers' --max-loras-per-batch (>= capacity + 1)"},
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
        "--versioned-lora-probe-timeout",
        "probe_timeout",
        {"type": float, "help": "seconds one engine health probe may take (default 5)"},
    ),
    (
        "--versioned-lora-eject-after",
        "eject_after",
        {
            "type": float,
            "help": "seconds of failed probes before an engine is ejected (default 10)",
        },
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
