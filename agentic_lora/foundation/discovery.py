"""Entry-point discovery shared by the plugin groups (routers, backends and engine dialects).

A plugin is any installed distribution that declares an entry point in one of the groups below;
the built-in ones are declared in this project's ``pyproject.toml``. Lookups are by name, and a
missing or broken plugin is a :class:`~agentic_lora.errors.ConfigurationError` naming what is
available, found at start-up rather than on the first request.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import EntryPoint
from importlib.metadata import entry_points
from typing import Any

from agentic_lora.errors import ConfigurationError

__all__ = [
    "BACKENDS_GROUP",
    "DIALECTS_GROUP",
    "ROUTERS_GROUP",
    "build_plugin",
    "load_plugin",
    "plugin_names",
]

ROUTERS_GROUP = "agentic_lora.routers"
BACKENDS_GROUP = "agentic_lora.backends"
DIALECTS_GROUP = "agentic_lora.engines"

# The settings field each group's plugin is named by (the ConfigurationError's ``check``).
_CHECKS = {ROUTERS_GROUP: "router", BACKENDS_GROUP: "backend", DIALECTS_GROUP: "engine_kind"}


def _entry_points(group: str) -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=group)}


def plugin_names(group: str) -> tuple[str, ...]:
    """The names registered in ``group``, sorted."""
    return tuple(sorted(_entry_points(group)))


def load_plugin(group: str, name: str) -> Any:
    """Load the object registered as ``name`` in ``group`` (usually a class)."""
    check = _CHECKS.get(group, "plugin")
    found = _entry_points(group)
    ep = found.get(name)
    if ep is None:
        raise ConfigurationError(
            f"no {check} plugin named {name!r}; installed: {sorted(found) or 'none'}",
            check=check,
            group=group,
            name=name,
        )
    try:
        return ep.load()
    except Exception as exc:
        raise ConfigurationError(
            f"{check} plugin {name!r} ({ep.value}) failed to load: {exc!r}",
            check=check,
            group=group,
            name=name,
        ) from exc


def build_plugin(group: str, name: str, protocol: type[Any], options: Mapping[str, Any]) -> Any:
    """Load ``name`` from ``group``, build it with ``options`` and check it implements
    ``protocol`` (a runtime-checkable Protocol). Every failure is a CONFIG_ERROR naming the plugin,
    so a typo in a plugin option fails start-up, not the first publication or dispatch."""
    check = _CHECKS.get(group, "plugin")
    factory = load_plugin(group, name)
    try:
        plugin = factory(**options)
    except TypeError as exc:
        raise ConfigurationError(
            f"{check} {name!r} does not take options {sorted(options)}: {exc}", check=check
        ) from exc
    if not isinstance(plugin, protocol):
        raise ConfigurationError(
            f"{check} plugin {name!r} does not implement the {protocol.__name__} protocol",
            check=check,
        )
    return plugin
