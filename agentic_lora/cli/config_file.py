"""The config file and how it layers with the environment and the command line.

One file, TOML (``.toml``) or JSON (``.json``): top-level keys are
:class:`~agentic_lora.config.AgenticLoRASettings` fields; ``[gateway]`` holds the server's own
options and ``[backend_options]`` is passed to the backend plugin. The layering, strongest
first, is pydantic-settings' own: command-line flags (init values), ``AGENTIC_LORA_*``
environment variables, the file, then the fallbacks a command asks for, then defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings
from pydantic_settings import InitSettingsSource
from pydantic_settings import JsonConfigSettingsSource
from pydantic_settings import PydanticBaseSettingsSource
from pydantic_settings import TomlConfigSettingsSource

from agentic_lora.config import AgenticLoRASettings
from agentic_lora.config import given_flags
from agentic_lora.errors import ConfigurationError

__all__ = ["GATEWAY_KEYS", "ConfigFile", "layered_settings", "read_config_file"]

#: The keys of the ``[gateway]`` table.
GATEWAY_KEYS = frozenset(
    {"host", "port", "admin_token_file", "idle_timeout", "reuse_closed_ids", "access_log"}
)
# Paths in the file are relative to the file, not to wherever the command runs.
_PATH_SETTINGS = frozenset({"journal_path"})
_PATH_BACKEND_OPTIONS = frozenset({"store_root"})
_PATH_GATEWAY = frozenset({"admin_token_file"})
_TABLES = ("gateway", "backend_options")


@dataclass(frozen=True)
class ConfigFile:
    """A parsed config file: settings at the top level, plus two tables.

    ``[gateway]`` holds ``host``, ``port``, ``admin_token_file``, ``idle_timeout``,
    ``reuse_closed_ids`` and ``access_log``; ``[backend_options]`` is passed to the backend
    plugin (``store_root`` for HTTP push). Every other key is an
    :class:`~agentic_lora.config.AgenticLoRASettings` field.
    """

    settings: Mapping[str, Any] = field(default_factory=dict)
    gateway: Mapping[str, Any] = field(default_factory=dict)
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    path: Path | None = None


def _config_error(path: Path, message: str) -> ConfigurationError:
    return ConfigurationError(f"config file {path}: {message}", check="config_file", path=str(path))


def _source(path: Path) -> PydanticBaseSettingsSource:
    if path.suffix == ".toml":
        return TomlConfigSettingsSource(AgenticLoRASettings, toml_file=path)
    if path.suffix == ".json":
        return JsonConfigSettingsSource(AgenticLoRASettings, json_file=path)
    raise _config_error(path, "must end in .toml or .json")


def _document(path: Path) -> dict[str, Any]:
    try:
        path.open("rb").close()  # the sources read a missing file as empty: that is an error here
    except OSError as exc:
        raise _config_error(path, f"cannot be read ({exc.strerror or exc})") from exc
    try:
        document = _source(path)()
    except tomllib.TOMLDecodeError as exc:
        raise _config_error(path, f"is not valid TOML: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise _config_error(path, f"is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise _config_error(path, f"is not UTF-8 text: {exc}") from exc
    except (TypeError, ValueError) as exc:
        # The JSON source turns the document into a dict: a list or a scalar does not fit.
        raise _config_error(path, "must hold a table/object at the top level") from exc
    return dict(document)


def _table(path: Path, raw: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, Mapping):
        raise _config_error(path, f"`{key}` must be a table/object")
    return dict(value)


def _relative_to(base: Path, values: dict[str, Any], keys: frozenset[str]) -> None:
    for key in keys & values.keys():
        if isinstance(values[key], str) and not Path(values[key]).is_absolute():
            values[key] = str(base / values[key])


def read_config_file(path: str | os.PathLike[str] | None) -> ConfigFile:
    """Read a TOML (``.toml``) or JSON (``.json``) config file; None gives an empty one."""
    if path is None:
        return ConfigFile()
    p = Path(path)
    raw = _document(p)
    gateway = _table(p, raw, "gateway")
    unknown = sorted(gateway.keys() - GATEWAY_KEYS)
    if unknown:
        raise _config_error(p, f"unknown [gateway] key(s) {unknown}; known: {sorted(GATEWAY_KEYS)}")
    backend_options = _table(p, raw, "backend_options")
    settings = {k: v for k, v in raw.items() if k not in _TABLES}
    base = p.resolve().parent
    _relative_to(base, settings, _PATH_SETTINGS)
    _relative_to(base, backend_options, _PATH_BACKEND_OPTIONS)
    _relative_to(base, gateway, _PATH_GATEWAY)
    return ConfigFile(settings, gateway, backend_options, p)


def layered_settings(
    args: argparse.Namespace,
    config: ConfigFile,
    *,
    fallback: Mapping[str, Any] | None = None,
    force: Mapping[str, Any] | None = None,
) -> AgenticLoRASettings:
    """Flags over environment over file over ``fallback`` over defaults; ``force`` over all.

    ``fallback`` holds what a command wants where none of the three says anything (``serve``
    turns the feature flag on); ``force`` what it needs whatever they say (``doctor``'s
    relaxed load turns it off, so only the fleet list must validate).
    """
    below_env = (InitSettingsSource, dict(config.settings), dict(fallback or {}))

    class _Layered(AgenticLoRASettings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            source, file_values, fallback_values = below_env
            return (
                init_settings,
                env_settings,
                source(settings_cls, file_values),
                source(settings_cls, fallback_values),
            )

    layered = _Layered(**{**given_flags(args), **dict(force or {})})
    # Validated above; handed out as the plain settings class, so it compares equal to any
    # other AgenticLoRASettings with the same values.
    return AgenticLoRASettings.model_construct(
        _fields_set=layered.model_fields_set, **dict(layered)
    )
