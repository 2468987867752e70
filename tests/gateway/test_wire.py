"""The wire helpers every error answer goes through: JSON-able details, HTTP status and retry
advice per error.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import NoPublishedVersionError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import VersionConflictError
from agentic_lora.gateway.wire import error_payload
from agentic_lora.gateway.wire import http_status
from agentic_lora.gateway.wire import jsonable
from agentic_lora.gateway.wire import should_retry


class Color(enum.Enum):
    RED = 1


class Opaque:
    def __repr__(self) -> str:
        return "<opaque>"


def test_jsonable_turns_any_detail_into_something_json_can_carry(tmp_path: Path) -> None:
    value = {
        "enum": Color.RED,
        "path": tmp_path / "x",
        "set": frozenset({3}),
        "tuple": (1, "a"),
        "nested": {1: [Opaque()]},
        "none": None,
    }
    converted = jsonable(value)
    assert converted == {
        "enum": 1,
        "path": str(tmp_path / "x"),
        "set": [3],
        "tuple": [1, "a"],
        "nested": {"1": ["<opaque>"]},
        "none": None,
    }
    assert json.loads(json.dumps(converted)) == converted
    # So an error whose details hold such values still answers with a JSON body.
    payload = error_payload(ConfigurationError("bad", path=tmp_path, thing=Opaque()))
    assert payload == {
        "error": {
            "code": "CONFIG_ERROR",
            "message": "bad",
            "details": {"path": str(tmp_path), "thing": "<opaque>"},
        }
    }


def test_http_status_and_retry_advice_per_error() -> None:
    assert http_status(ValueError("bug")) == 500
    assert should_retry(ValueError("bug")) is False
    assert error_payload(KeyError("k")) == {
        "error": {
            "code": "AGENTIC_LORA_ERROR",
            "message": "unexpected KeyError: 'k'",
            "details": {},
        }
    }
    # An engine's own 4xx passes through; a busy engine (429, 408) may take it next time.
    for status, retry in ((400, False), (404, False), (408, True), (429, True)):
        refused = RequestRefusedError("engine said no", status=status)
        assert (http_status(refused), should_retry(refused)) == (status, retry)
    # A refusal without an engine answer (unreachable) is a retryable 503.
    unreachable = RequestRefusedError("connect failed")
    assert (http_status(unreachable), should_retry(unreachable)) == (503, True)
    # A 5xx status detail never turns a refusal into a server error of the engine's choosing.
    assert http_status(RequestRefusedError("odd", status=502)) == 503
    maybe = RequestIndeterminateError("lost", status=200)
    assert (http_status(maybe), should_retry(maybe)) == (502, False)
    assert should_retry(NoPublishedVersionError("not yet")) is True
    assert http_status(VersionConflictError("conflict")) == 409
    assert http_status(AgenticLoRAError("base")) == 500
