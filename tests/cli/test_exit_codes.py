"""The console script: installed, one ``error: CODE: message`` line per failure with its exit
code (1 error, 2 bad command line), ``--debug`` adds the traceback.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from agentic_lora import cli
from tests.cli.support import CONSOLE_SCRIPT
from tests.cli.support import assert_one_error_line
from tests.cli.support import clean_env
from tests.cli.support import only_line
from tests.cli.support import run_cli
from tests.cli.support import run_script
from tests.cli.support import sqlite_file


def test_the_console_script_is_installed() -> None:
    assert CONSOLE_SCRIPT.is_file(), "pip install -e . installs the agentic-lora script"


def test_a_bad_command_line_is_one_line_with_exit_2(tmp_path: Path) -> None:
    proc = run_script("publish", "some-dir", cwd=tmp_path)
    line = assert_one_error_line(proc, "CONFIG_ERROR")
    assert "--version-id" in line
    assert proc.returncode == cli.EXIT_USAGE
    assert run_script("--help", cwd=tmp_path).returncode == 0


@pytest.mark.asyncio
async def test_an_unexpected_failure_is_one_generic_line_and_debug_adds_the_traceback(
    tmp_path: Path,
) -> None:
    # An identity with every key but a capacity that is no number: not a typed refusal.
    journal = sqlite_file(
        tmp_path / "odd.sqlite",
        "CREATE TABLE meta (key TEXT, value TEXT)",
        "INSERT INTO meta VALUES ('magic', 'agentic-lora/registry-journal')",
        "INSERT INTO meta VALUES ('format', '1')",
        """INSERT INTO meta VALUES ('identity', '{"engines": ["e0", "e1"], "capacity": "two",
        "deployment_epoch": 0, "prefix": "p"}')""",
    )
    code, _, err = await run_cli("status", "--journal", str(journal))
    assert code == cli.EXIT_ERROR
    assert only_line(err) == (
        "error: AGENTIC_LORA_ERROR: unexpected ValueError: invalid literal for int() with base "
        "10: 'two' (--debug shows the traceback)"
    )
    code, _, err = await run_cli("--debug", "status", "--journal", str(tmp_path / "none"))
    assert code == cli.EXIT_ERROR
    lines = err.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert "ConfigurationError" in err
    assert lines[-1] == f"error: CONFIG_ERROR: no registry journal at {tmp_path / 'none'}"


def test_main_returns_the_exit_code_of_the_command(tmp_path: Path) -> None:
    assert cli.main(["status", "--journal", str(tmp_path / "none")]) == cli.EXIT_ERROR
    assert cli.main(["status", "--bogus"]) == cli.EXIT_USAGE


def test_python_dash_m_runs_the_same_command(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agentic_lora.cli", "status", "--bogus"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_env(),
        timeout=120,
        check=False,
    )
    assert proc.returncode == cli.EXIT_USAGE
    assert proc.stderr.startswith("error: CONFIG_ERROR: agentic-lora: unrecognized arguments")


def test_an_interrupt_is_exit_130_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(coroutine: Coroutine[Any, Any, int]) -> int:
        coroutine.close()  # never started: Ctrl-C arrived first
        raise KeyboardInterrupt

    # The module, not the function of the same name that the package exports.
    cli_main = importlib.import_module("agentic_lora.cli.main")
    monkeypatch.setattr(cli_main.asyncio, "run", interrupted)
    assert cli.main(["status"]) == 130
    assert capsys.readouterr().err == "error: interrupted\n"
