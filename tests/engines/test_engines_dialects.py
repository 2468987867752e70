"""Engine dialects: the shipped ones keep the contract, the contract catches broken ones, and
the two engine clients translate the wire through one table."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

import httpx
import pytest
import respx
from agentic_lora_vllm.dialect import VllmDialect

from agentic_lora.config import AgenticLoRASettings
from agentic_lora.config import add_arguments
from agentic_lora.engines import SGLANG
from agentic_lora.engines import load_dialect
from agentic_lora.engines.admin import EngineAdminClient
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.dialect import DialectBase
from agentic_lora.engines.dialect import EngineDialect
from agentic_lora.engines.sglang import SGLangDialect
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.engines.wire import HttpAnswer
from agentic_lora.engines.wire import Outcome
from agentic_lora.engines.wire import classify_exception
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendRefusedError
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.foundation.requests import Route
from agentic_lora.testing.dialect_contract import EngineAnswers
from agentic_lora.testing.dialect_contract import ScriptedHttp
from agentic_lora.testing.dialect_contract import check_dialect

URL = "http://127.0.0.1:30000"


def _info(seed: int) -> HttpAnswer:
    body = {"version": "0.5.23", "port": 30000, "random_seed": seed, "enable_lora": True}
    return HttpAnswer(200, body, "")


def _metrics(start: float) -> HttpAnswer:
    text = f"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {start}\n"
    return HttpAnswer(200, text, text)


ANSWERS: Mapping[str, EngineAnswers] = {
    "sglang": EngineAnswers({"/server_info": _info(1)}, {"/server_info": _info(2)}),
    "vllm": EngineAnswers({"/metrics": _metrics(100.0)}, {"/metrics": _metrics(200.0)}),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["sglang", "vllm"])
async def test_the_shipped_dialects_keep_the_contract(name: str) -> None:
    dialect = load_dialect(name)
    assert dialect.name == name
    await check_dialect(dialect, ANSWERS[name])


class _EditsTheCallersBody(SGLangDialect):
    def pin(
        self, route: Route, body: Mapping[str, Any], lora_name: str, base_model: str | None
    ) -> dict[str, Any]:
        out = super().pin(route, body, lora_name, base_model)
        body["lora_path"] = lora_name  # type: ignore[index]
        return out


class _ServesEveryRoute(VllmDialect):
    def check_route(self, route: Route) -> None:
        return None


class _TrustsTheCaller(SGLangDialect):
    def pin(
        self, route: Route, body: Mapping[str, Any], lora_name: str, base_model: str | None
    ) -> dict[str, Any]:
        return {**body, "lora_path": body.get("lora_path", lora_name)}


class _AbortsNothing(SGLangDialect):
    can_abort = False


class _ForgetsRestarts(SGLangDialect):
    async def fingerprint(self, http: Any, base_url: str) -> str:
        await self.read_server_info(http)
        return "same"


class _SilentWithoutServerInfo(SGLangDialect):
    async def read_server_info(self, http: Any) -> Mapping[str, Any]:
        try:
            return await super().read_server_info(http)
        except Exception:
            return {}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("broken", "rule"),
    [
        (_EditsTheCallersBody, "edited the caller"),
        (_ServesEveryRoute, "not served"),
        (_TrustsTheCaller, "pin accepted"),
        (_AbortsNothing, "abort_request"),
        (_ForgetsRestarts, "restart"),
        (_SilentWithoutServerInfo, "404"),
    ],
)
async def test_the_contract_catches_a_broken_dialect(
    broken: type[DialectBase], rule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dialect = broken()
    # Registered under its own name, so only the broken rule can fail.
    monkeypatch.setattr("agentic_lora.testing.dialect_contract.load_dialect", lambda _: dialect)
    answers = ANSWERS["vllm" if isinstance(dialect, VllmDialect) else "sglang"]
    with pytest.raises(AssertionError, match=rule):
        await check_dialect(dialect, answers)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_the_contract_refuses_a_dialect_registered_under_another_class() -> None:
    @dataclasses.dataclass
    class Impostor(SGLangDialect):
        pass

    with pytest.raises(AssertionError, match="not registered"):
        await check_dialect(Impostor(), ANSWERS["sglang"])


def test_a_dialect_plugin_without_the_protocol_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("agentic_lora.engines.dialect.load_plugin", lambda group, name: object)
    with pytest.raises(ConfigurationError) as broken:
        load_dialect("sglang")
    assert broken.value.details["check"] == "engine_kind"
    assert "EngineDialect" in broken.value.message


def test_engine_kind_names_an_installed_dialect_in_settings_and_flags() -> None:
    engines = ["e0=http://127.0.0.1:30000"]
    with pytest.raises(ConfigurationError) as err:
        AgenticLoRASettings(engines=engines, engine_kind="trt")
    assert "no engine dialect named 'trt'" in err.value.message
    parser = add_arguments(argparse.ArgumentParser())
    (kind,) = [a for a in parser._actions if a.dest == "versioned_lora_engine_kind"]
    assert kind.choices is not None
    assert sorted(kind.choices) == ["sglang", "vllm"]


@pytest.mark.asyncio
async def test_the_transport_aborts_and_reads_server_info_the_dialects_way() -> None:
    vllm = EngineTransport([EngineRef("e0", URL)], http_transport="httpx", dialect=VllmDialect())
    sglang = EngineTransport([EngineRef("e0", URL)], http_transport="httpx")
    try:
        with respx.mock(using="httpx") as mock:
            abort = mock.post(URL + "/abort_request").respond(200, json={})
            assert await vllm.server_info("e0") is None
            with pytest.raises(InvalidRequestError) as err:
                await vllm.abort("e0", "r1")
            assert err.value.details["reason"] == "abort_unsupported"
            assert mock.calls.call_count == 0  # neither read nor abort reached the engine
            await sglang.abort("e0", "r1")
            assert abort.calls.last.request.content == b'{"rid":"r1"}'
            assert sglang.dialect is SGLANG
    finally:
        await vllm.aclose()
        await sglang.aclose()


# What went wrong on the wire, and what both clients must make of it.
WIRE: list[tuple[Exception, Outcome]] = [
    (httpx.ConnectError("refused"), Outcome.REFUSED),
    (httpx.ConnectTimeout("slow"), Outcome.REFUSED),
    (httpx.ReadTimeout("lost"), Outcome.INDETERMINATE),
    (httpx.RemoteProtocolError("reset"), Outcome.INDETERMINATE),
    (httpx.WriteError("half"), Outcome.INDETERMINATE),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("exc", "outcome"), WIRE, ids=lambda v: type(v).__name__)
async def test_generation_and_admin_calls_translate_the_wire_through_one_table(
    exc: Exception, outcome: Outcome
) -> None:
    assert classify_exception(exc) is outcome
    transport = EngineTransport([EngineRef("e0", URL)], http_transport="httpx")
    admin = EngineAdminClient(URL, engine="e0")
    try:
        with respx.mock(using="httpx") as mock:
            mock.post(URL + "/generate").mock(side_effect=exc)
            mock.get(URL + "/v1/models").mock(side_effect=exc)
            generation = (
                RequestRefusedError if outcome is Outcome.REFUSED else RequestIndeterminateError
            )
            with pytest.raises(generation) as sent:
                await transport.send("e0", "/generate", {"text": "x"})
            assert sent.value.details["outcome"] == outcome.value
            control = BackendRefusedError if outcome is Outcome.REFUSED else BackendAmbiguousError
            with pytest.raises(control):
                await admin.list_lora_adapters()
    finally:
        await transport.aclose()
        await admin.aclose()


@pytest.mark.asyncio
async def test_one_server_info_reader_serves_the_transport_and_the_admin_client() -> None:
    transport = EngineTransport([EngineRef("e0", URL)], http_transport="httpx")
    admin = EngineAdminClient(URL, engine="e0")
    info = {"version": "0.5.23", "port": 30000, "random_seed": 3, "enable_lora": True}
    try:
        with respx.mock(using="httpx") as mock:
            mock.get(URL + "/server_info").respond(404, json={"detail": "Not Found"})
            legacy = mock.get(URL + "/get_server_info").respond(200, json=info)
            assert await transport.server_info("e0") == info
            read = await admin.server_info()
            assert read.raw == info
            assert read.fingerprint == await SGLANG.fingerprint(
                ScriptedHttp({"/server_info": HttpAnswer(200, info, "")}), URL
            )
            assert legacy.call_count == 2
            mock.get(URL + "/server_info").respond(503)
            with pytest.raises(BackendAmbiguousError):
                await admin.server_info()
    finally:
        await transport.aclose()
        await admin.aclose()


def test_the_dialects_are_engine_dialects() -> None:
    for dialect in (SGLANG, VllmDialect()):
        assert isinstance(dialect, EngineDialect)
        assert repr(dialect) == f"{type(dialect).__name__}()"
    assert SGLANG.unload_waits_for_requests is True
    assert VllmDialect().unload_waits_for_requests is False
