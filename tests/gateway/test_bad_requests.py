"""Requests the gateway refuses: malformed bodies and ids, incomplete publish requests,
non-finite numbers, and an engine's 4xx passed through. None of them reaches an engine or is
retried.

The gateway runs for real over scripted engines (``gateway_stack`` from ``test_gateway.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentic_lora.gateway.security import MAX_SESSION_ID_LENGTH
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault
from agentic_lora.testing.sglang_engine import FaultKind
from tests.gateway.test_gateway import ADMIN_TOKEN
from tests.gateway.test_gateway import gateway_stack

pytestmark = pytest.mark.asyncio

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


async def test_malformed_bodies_and_ids_are_400s_that_never_reach_an_engine(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        http = stack.http()
        generations = stack.fleet.calls(EngineOp.GENERATE)

        listed = await http.post("/generate", json=[1, 2], headers={"x-agentic-session": "s1"})
        assert listed.status_code == 400
        assert listed.json()["error"] == {
            "code": "INVALID_REQUEST",
            "message": "the body must be a JSON object",
            "details": {"route": "/generate", "reason": "not_object"},
        }
        assert listed.headers["x-agentic-outcome"] == "refused"

        too_long = "s" * (MAX_SESSION_ID_LENGTH + 1)
        long_id = await http.post(
            "/v1/completions", json={"prompt": "x"}, headers={"x-agentic-session": too_long}
        )
        assert long_id.status_code == 400
        error = long_id.json()["error"]
        assert error["details"] == {"reason": "bad_session_id"}
        assert f"longer than {MAX_SESSION_ID_LENGTH} characters" in error["message"]
        # The longest allowed id is a Session like any other.
        longest = "s" * MAX_SESSION_ID_LENGTH
        ok = await http.post(
            "/generate", json={"text": "x"}, headers={"x-agentic-session": longest}
        )
        assert ok.status_code == 200
        assert ok.headers["x-agentic-version"] == "A"

        assert stack.fleet.calls(EngineOp.GENERATE) == generations + 1
        assert stack.gateway.versioning.get(too_long) is None


async def test_publish_requests_without_both_fields_are_refused_before_any_transfer(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path) as stack:
        http = stack.http()
        adapter = stack.adapter(1)
        for payload, field in (
            ({"adapter_dir": adapter}, "version_id"),
            ({"adapter_dir": adapter, "version_id": "  "}, "version_id"),
            ({"adapter_dir": 7, "version_id": "A"}, "adapter_dir"),
        ):
            response = await http.post("/admin/publish", json=payload, headers=ADMIN)
            assert response.status_code == 400
            assert response.json()["error"] == {
                "code": "INVALID_REQUEST",
                "message": f"`{field}` must be a non-empty string",
                "details": {"field": field},
            }
        not_object = await http.post("/admin/publish", json=["A"], headers=ADMIN)
        assert not_object.status_code == 400
        assert not_object.json()["error"]["message"] == "the body must be a JSON object"
        assert stack.fleet.calls(EngineOp.LOAD) == 0
        assert (await stack.admin().status())["registry"]["versions"] == []


@pytest.mark.parametrize("value", [b"Infinity", b"NaN"])
async def test_a_body_with_a_non_finite_number_is_refused_as_invalid(
    tmp_path: Path, value: bytes
) -> None:
    # Python's JSON reader takes NaN; JSON cannot carry it to an engine: refused before sending.
    async with gateway_stack(tmp_path, published="A") as stack:
        generations = stack.fleet.calls(EngineOp.GENERATE)
        response = await stack.http().post(
            "/generate",
            content=b'{"text": "x", "extra": ' + value + b"}",
            headers={"x-agentic-session": "inf", "content-type": "application/json"},
        )
        assert stack.fleet.calls(EngineOp.GENERATE) == generations  # it never left
        assert response.headers["x-agentic-outcome"] == "refused"
        assert (response.status_code, response.json()["error"]["code"]) == (
            400,
            "INVALID_REQUEST",
        )


async def test_an_engine_4xx_passes_through_and_is_not_retryable(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        for engine in stack.fleet.engines.values():
            engine.script(EngineOp.GENERATE, Fault(FaultKind.REFUSE, "prompt too long"))
        response = await stack.http().post(
            "/generate", json={"text": "x"}, headers={"x-agentic-session": "long"}
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "REQUEST_REFUSED"
        assert error["details"]["status"] == 400
        assert error["details"]["body"] == {"error": {"message": "prompt too long"}}
        assert response.headers["x-agentic-outcome"] == "refused"
        # The engine judged the request itself: the same request would be refused again.
        assert response.headers["x-should-retry"] == "false"
