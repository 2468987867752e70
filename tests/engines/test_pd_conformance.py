"""The backend conformance suite with a PD group: the HTTP push backend drives a prefill and a
decode server (scripted SGLang engines in their ``disaggregation_mode``, named as the fleet names
role servers) exactly as it drives plain engines."""

from __future__ import annotations

from agentic_lora_http import HttpPushBackend

from agentic_lora.engines.pd import PDGroup
from agentic_lora.testing.backend_conformance import BackendConformance
from agentic_lora.testing.scripted_harness import ScriptedHarness
from agentic_lora.testing.sglang_engine import ScriptedSGLangEngine

GROUP = PDGroup("g1", "http://127.0.0.1:34000", ("http://127.0.0.1:34001",), "http://r:1")


def role_servers() -> list[ScriptedSGLangEngine]:
    """The group's prefill and decode server as scripted engines, under their fleet names."""
    return [
        ScriptedSGLangEngine(ref.name, ref.base_url, disaggregation_mode=role.value)
        for ref, role in GROUP.role_servers()
    ]


class PDHttpPushConformance(BackendConformance):
    async def make_harness(self) -> ScriptedHarness:
        return ScriptedHarness(HttpPushBackend, role_servers())


def test_the_harness_drives_the_role_servers() -> None:
    assert [e.name for e in role_servers()] == ["g1.prefill", "g1.decode0"]
    assert [e.disaggregation_mode for e in role_servers()] == ["prefill", "decode"]


TestPDHttpPushConformance = PDHttpPushConformance.test_case(max_examples=20)
