"""A short schemathesis run against the gateway in front of one real SGLang engine.

The same checks as the scripted run (``tests/gateway/test_gateway_fuzz.py``): never a 5xx, answers as
documented, and no Session left by a request the gateway refused; here the requests that pass
the gateway really run on the engine (small ``max_tokens``: the run stays short on CPU). The
engine is left as found: the published version is unloaded in teardown.
"""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import response_schema_conformance
from schemathesis.specs.openapi.checks import status_code_conformance

from agentic_lora.config import load_settings
from agentic_lora.config import verify_fleet
from agentic_lora.engines.admin import EngineAdminClient
from agentic_lora.gateway.app import Gateway
from agentic_lora.gateway.client import AdminClient
from tests.direct_http import engine_client

FUZZED = ("/v1/chat/completions", "/generate")


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first user of the shared fleet may pay for starting it
@pytest.mark.asyncio
async def test_a_short_fuzz_run_against_one_real_engine(engine_fleet: Any, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    name, url = engine_fleet.engines[0]
    settings_ = load_settings(
        enable_versioned_lora_publication=True,
        engines=[f"{name}={url}"],
        capacity=2,
        base_model_name=engine_fleet.served_model_name,
        gateway_max_tokens=8,  # what a fuzzed request may generate on a CPU engine
    )
    gateway = await Gateway.from_settings(
        settings_, backend_options={"store_root": str(tmp_path / "store")}, admin_token="t"
    )
    published: list[str] = []
    ids = itertools.count()
    async with engine_client() as raw:
        try:
            async with gateway:
                await verify_fleet(settings_, gateway.versioning.transport)
                transport = httpx.ASGITransport(app=gateway.app)
                http = httpx.AsyncClient(transport=transport, base_url="http://gateway")
                admin = AdminClient("http://gateway", token="t", transport=transport)
                try:
                    a = await admin.publish(str(engine_fleet.fixture.adapter("A")), f"{tag}-A")
                    published.append(a["lora_name"])
                    document = (await http.get("/openapi.json")).json()
                    schema = schemathesis.openapi.from_dict(document)
                    operations = [
                        r.ok()
                        for r in schema.get_all_operations()
                        if isinstance(r, Ok)
                        and r.ok().path in FUZZED
                        and r.ok().method.upper() == "POST"
                    ]
                    strategy = st.one_of([op.as_strategy() for op in operations])
                    cases: list[Any] = []

                    # Drawn first, sent after: hypothesis runs synchronously, the gateway not.
                    @settings(
                        max_examples=40,
                        derandomize=True,
                        database=None,
                        suppress_health_check=list(HealthCheck),
                    )
                    @given(case=strategy)
                    def draw(case: Any) -> None:
                        cases.append(case)

                    draw()
                    served = 0
                    for case in cases:
                        headers = {"authorization": f"Bearer {tag}-{next(ids)}"}
                        kwargs = case.as_transport_kwargs(
                            base_url="http://gateway", headers=headers
                        )
                        before = gateway.sessions.live()
                        response = await http.request(
                            kwargs["method"],
                            kwargs["url"],
                            headers=kwargs.get("headers"),
                            content=kwargs.get("content"),
                            json=kwargs.get("json") if "content" not in kwargs else None,
                        )
                        case.validate_response(
                            response,
                            checks=[
                                not_a_server_error,
                                status_code_conformance,
                                response_schema_conformance,
                            ],
                        )
                        assert response.status_code < 500, response.text
                        if response.status_code == 200:
                            served += 1
                        elif response.json()["error"]["code"] != "REQUEST_REFUSED":
                            assert gateway.sessions.live() <= before, response.text
                    for session_id in list(range(next(ids))):
                        await http.post(
                            "/v1/sessions/close",
                            headers={"authorization": f"Bearer {tag}-{session_id}"},
                        )
                    assert gateway.sessions.live() == 0
                finally:
                    await http.aclose()
                    await admin.aclose()
        finally:
            async with EngineAdminClient(url, client=raw) as engine:
                for lora in published:
                    await engine.unload_lora_adapter(lora)
