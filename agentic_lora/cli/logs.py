"""Logging of ``agentic-lora serve``: text, or one JSON object per line.

The project logs with stable ``extra=`` keys (``session``, ``version``, ``engine``, ``attempt``,
...); the JSON lines carry every one of them as a field, so they can be filtered without
parsing the message.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

__all__ = ["JsonLogFormatter", "configure_logging"]


class JsonLogFormatter(JsonFormatter):
    """One JSON object per record: ``ts``, ``level``, ``logger``, ``message``, every ``extra=``
    key and, for a failure, ``exc`` (the traceback, escaped into the one line)."""

    def __init__(self) -> None:
        super().__init__(
            "{created}{levelname}{name}{message}",
            style="{",
            rename_fields={
                "created": "ts",
                "levelname": "level",
                "name": "logger",
                "exc_info": "exc",
            },
            # uvicorn adds a terminal-coloured copy of its message to every record.
            reserved_attrs=[*RESERVED_ATTRS, "color_message"],
            json_ensure_ascii=False,
        )


def configure_logging(level: int, fmt: Literal["text", "json"]) -> None:
    """One stderr handler on the root logger, replacing any other."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonLogFormatter()
        if fmt == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
