"""The command table: every command ``main.COMMANDS`` declares is on the command line with its
help and every argument, and documented in docs/cli.md."""

from __future__ import annotations

import argparse
import io
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from agentic_lora.cli.common import Command
from agentic_lora.cli.main import COMMANDS
from agentic_lora.cli.main import build_parser

CLI_DOC = Path(__file__).parents[2] / "docs" / "cli.md"


def _help(*argv: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*argv, "--help"])
    assert exited.value.code == 0
    return " ".join(out.getvalue().split())  # argparse wraps to the terminal's width


def test_the_top_level_help_lists_every_command_with_its_help_in_table_order() -> None:
    listed = _help()
    positions = [listed.index(f"{c.name} {c.help}") for c in COMMANDS]
    assert positions == sorted(positions)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_a_command_s_help_shows_its_description_and_every_argument(command: Command) -> None:
    shown = _help(command.name)
    assert " ".join(command.description.split()) in shown
    for arg in command.arguments:
        # A whole word: --admin-token is also the start of --admin-token-file.
        word = re.compile(re.escape(arg.options.get("metavar", arg.names[0])) + r"(?![\w-])")
        hidden = arg.options.get("help") == argparse.SUPPRESS
        assert (word.search(shown) is None) == hidden, arg


def test_docs_cli_has_a_row_and_a_section_for_exactly_the_declared_commands() -> None:
    text = CLI_DOC.read_text(encoding="utf-8")
    rows = re.findall(r"^\| `agentic-lora (\w+)", text, flags=re.MULTILINE)
    sections = re.findall(r"^## (\w+)$", text, flags=re.MULTILINE)
    names = [c.name for c in COMMANDS]
    assert rows == names
    assert [s for s in sections if s.islower()] == names  # "## Configuration" is no command
