"""Config files, environment and flags: how ``serve``'s options are resolved, and every way
a file, a flag or a token file can be wrong (one exact error line, exit 1, before anything is
served or any engine is contacted).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agentic_lora import cli
from agentic_lora.config import AgenticLoRASettings
from agentic_lora.errors import ConfigurationError
from tests.cli.support import assert_one_error_line
from tests.cli.support import fleet_config
from tests.cli.support import only_line
from tests.cli.support import run_cli
from tests.cli.support import run_script
from tests.cli.support import write_config


def test_a_bad_config_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('engines = ["e0=http://127.0.0.1:1"\ncapacity = 2\n')
    line = assert_one_error_line(
        run_script("serve", "--config", str(bad), cwd=tmp_path), "CONFIG_ERROR"
    )
    assert "is not valid TOML" in line
    missing = run_script("doctor", "--config", str(tmp_path / "nope.json"), cwd=tmp_path)
    assert "cannot be read" in assert_one_error_line(missing, "CONFIG_ERROR")
    invalid = write_config(
        tmp_path / "invalid.toml", ["e0=http://127.0.0.1:1"], settings={"capacity": 1}
    )
    line = assert_one_error_line(
        run_script("serve", "--config", str(invalid), cwd=tmp_path), "CONFIG_ERROR"
    )
    assert "capacity 1 < 2" in line


def test_flags_beat_environment_beat_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("AGENTIC_LORA_"):
            monkeypatch.delenv(name)
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    config = write_config(
        tmp_path / "c.toml",
        ["e0=http://127.0.0.1:30000"],
        settings={"capacity": 3, "lora_name_prefix": "from_file", "journal_path": "j.sqlite"},
        backend_options={"store_root": "store"},
        gateway={"port": 9001, "admin_token_file": "token", "idle_timeout": 60},
    )
    monkeypatch.setenv("AGENTIC_LORA_CAPACITY", "4")
    monkeypatch.setenv("AGENTIC_LORA_LORA_NAME_PREFIX", "from_env")
    options = cli.serve_options(
        ["--config", str(config), "--versioned-lora-capacity", "5", "--backend-option", "x=1"]
    )
    assert options.settings.capacity == 5  # flag
    assert options.settings.lora_name_prefix == "from_env"  # env over file
    assert options.settings.enable_versioned_lora_publication is True  # serve turns it on
    assert options.settings.journal_path == tmp_path / "j.sqlite"  # relative to the file
    assert options.backend_options == {"store_root": str(tmp_path / "store"), "x": "1"}
    assert (options.port, options.idle_timeout, options.admin_token) == (9001, 60.0, "from-file")
    monkeypatch.setenv("AGENTIC_LORA_ADMIN_TOKEN", "from-env")
    assert cli.serve_options(["--config", str(config)]).admin_token == "from-env"
    # A token on the command line is refused: every user of the host sees it (ps).
    with pytest.raises(ConfigurationError) as refused:
        cli.serve_options(["--config", str(config), "--admin-token", "t"])
    assert refused.value.details["check"] == "admin_token"
    assert "t" not in refused.value.details.values()


def test_unknown_gateway_keys_are_refused(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", ["e0=http://127.0.0.1:1"], gateway={"prot": 1})
    with pytest.raises(Exception, match=r"unknown \[gateway\] key\(s\) \['prot'\]"):
        cli.read_config_file(config)


@pytest.mark.asyncio
async def test_every_unreadable_config_file_is_one_exact_line(tmp_path: Path, no_env: None) -> None:
    cases: dict[str, tuple[str, str]] = {
        "c.yaml": ("engines: []\n", "must end in .toml or .json"),
        "c.json": (
            '{"engines": [',
            "is not valid JSON: Expecting value: line 1 column 14 (char 13)",
        ),
        "list.json": ("[1, 2]", "must hold a table/object at the top level"),
        "gw.toml": ('engines = []\ngateway = "0.0.0.0"\n', "`gateway` must be a table/object"),
        "opts.json": ('{"backend_options": [1]}', "`backend_options` must be a table/object"),
    }
    for name, (text, problem) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        code, out, err = await run_cli("serve", "--config", str(path))
        assert (code, out) == (cli.EXIT_ERROR, ""), name
        assert only_line(err) == f"error: CONFIG_ERROR: config file {path}: {problem}", name


@pytest.mark.asyncio
async def test_bad_gateway_options_and_token_files_are_one_exact_line(
    tmp_path: Path, no_env: None
) -> None:
    config = fleet_config(tmp_path / "c.toml")
    (tmp_path / "empty-token").write_text("  \n")
    cases: list[tuple[list[str], str]] = [
        (["--port", "70000"], "port 70000 is not a TCP port"),
        (["--idle-timeout", "0"], "idle_timeout 0.0 must be positive"),
        (["--backend-option", "store_root"], "--backend-option 'store_root' is not KEY=VALUE"),
        (["--backend-option", " =x"], "--backend-option ' =x' is not KEY=VALUE"),
        (
            ["--admin-token-file", str(tmp_path / "missing-token")],
            f"admin token file {tmp_path / 'missing-token'} cannot be read "
            "(No such file or directory)",
        ),
        (
            ["--admin-token-file", str(tmp_path / "empty-token")],
            f"admin token file {tmp_path / 'empty-token'} is empty",
        ),
        (["--log-level", "LOUD"], "unknown log level 'LOUD'"),
    ]
    for flags, message in cases:
        code, out, err = await run_cli("serve", "--config", str(config), *flags)
        assert (code, out) == (cli.EXIT_ERROR, ""), flags
        assert only_line(err) == f"error: CONFIG_ERROR: {message}", flags
    # The same checks hold for values from the file.
    for gateway, message in (
        ({"port": "8000"}, "port '8000' is not a TCP port"),
        ({"port": -1}, "port -1 is not a TCP port"),
        ({"idle_timeout": -5}, "idle_timeout -5 must be positive"),
        ({"idle_timeout": "soon"}, "idle_timeout 'soon' must be positive"),
    ):
        bad = fleet_config(tmp_path / "bad.toml", gateway=gateway)
        code, _, err = await run_cli("serve", "--config", str(bad))
        assert code == cli.EXIT_ERROR
        assert only_line(err) == f"error: CONFIG_ERROR: {message}", gateway


def test_a_json_config_resolves_like_a_toml_one(tmp_path: Path, no_env: None) -> None:
    (tmp_path / "token").write_text("file-token\n")
    (tmp_path / "state").mkdir()
    document = {
        "engines": ["e0=http://127.0.0.1:30000", "e1=http://127.0.0.1:30001"],
        "capacity": 3,
        "base_model_name": "base-model",
        "journal_path": "state/registry.sqlite",
        "backend_options": {"store_root": "store", "other": 1},
        "gateway": {
            "host": "0.0.0.0",
            "port": 0,
            "admin_token_file": "token",
            "reuse_closed_ids": True,
            "access_log": True,
        },
    }
    config = tmp_path / "agentic-lora.json"
    config.write_text(json.dumps(document))
    options = cli.serve_options(["--config", str(config), "--skip-engine-check"])
    assert [e.name for e in options.settings.engines] == ["e0", "e1"]
    assert options.settings.capacity == 3
    assert options.settings.journal_path == tmp_path / "state" / "registry.sqlite"
    assert options.backend_options == {"store_root": str(tmp_path / "store"), "other": 1}
    assert (options.host, options.port, options.admin_token) == ("0.0.0.0", 0, "file-token")
    assert (options.reuse_closed_ids, options.access_log, options.verify_engines) == (
        True,
        True,
        False,
    )
    assert options.idle_timeout is None


def test_without_a_config_file_flags_alone_make_the_settings(no_env: None) -> None:
    assert cli.read_config_file(None) == cli.ConfigFile()
    options = cli.serve_options(
        [
            "--versioned-lora-engine",
            "e0=http://127.0.0.1:30000",
            "--versioned-lora-engine",
            "e1=http://127.0.0.1:30001",
            "--versioned-lora-base-model",
            "base-model",
            "--idle-timeout",
            "2.5",
        ]
    )
    assert [(e.name, e.base_url) for e in options.settings.engines] == [
        ("e0", "http://127.0.0.1:30000"),
        ("e1", "http://127.0.0.1:30001"),
    ]
    assert options.settings.enable_versioned_lora_publication is True
    assert (options.host, options.port) == (cli.DEFAULT_HOST, cli.DEFAULT_PORT)
    assert (options.admin_token, options.idle_timeout) == (None, 2.5)
    assert options.backend_options == {}


@pytest.mark.asyncio
async def test_a_missing_or_binary_config_file_is_one_line(tmp_path: Path, no_env: None) -> None:
    missing = tmp_path / "missing.toml"
    code, out, err = await run_cli("serve", "--config", str(missing))
    assert (code, out) == (cli.EXIT_ERROR, "")
    assert only_line(err) == (
        f"error: CONFIG_ERROR: config file {missing}: cannot be read (No such file or directory)"
    )
    for name in ("latin1.toml", "latin1.json"):
        binary = tmp_path / name
        binary.write_bytes(b'base_model_name = "caf\xe9"\n')
        code, out, err = await run_cli("serve", "--config", str(binary))
        assert (code, out) == (cli.EXIT_ERROR, ""), name
        assert only_line(err).startswith(
            f"error: CONFIG_ERROR: config file {binary}: is not UTF-8 text: "
        ), name


def test_the_environment_is_read_the_way_the_settings_read_it(
    tmp_path: Path, no_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A JSON list in the environment beats the file's list; the file still gives the rest.
    config = write_config(tmp_path / "c.toml", ["f0=http://127.0.0.1:30000"])
    monkeypatch.setenv("AGENTIC_LORA_ENGINES", '["v0=http://127.0.0.1:31000"]')
    settings = cli.layered_settings(
        cli.build_parser().parse_args(["doctor", "--config", str(config)]),
        cli.read_config_file(config),
    )
    assert [e.name for e in settings.engines] == ["v0"]
    assert settings.base_model_name == "base-model"
    # Nothing set the feature flag and no fallback was asked for: the default (off) holds.
    assert settings.enable_versioned_lora_publication is False
    assert type(settings) is AgenticLoRASettings
