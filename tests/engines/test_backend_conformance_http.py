"""Both HTTP backends pass the backend conformance suite, each against its scripted engines:
HTTP push against SGLang, the vLLM backend against vLLM (no drain needed: nothing runs)."""

from __future__ import annotations

from agentic_lora_http import HttpPushBackend
from agentic_lora_vllm import VllmBackend

from agentic_lora.testing.backend_conformance import BackendConformance
from agentic_lora.testing.scripted_harness import ScriptedHarness
from agentic_lora.testing.scripted_harness import sglang_engines
from agentic_lora.testing.scripted_harness import vllm_engines


async def drained_at_once(lora_name: str) -> None:
    """The vLLM drain hook where no request is ever in flight."""


class HttpPushConformance(BackendConformance):
    async def make_harness(self) -> ScriptedHarness:
        return ScriptedHarness(HttpPushBackend, sglang_engines())


class VllmConformance(BackendConformance):
    async def make_harness(self) -> ScriptedHarness:
        return ScriptedHarness(
            lambda store: VllmBackend(store, wait_drained=drained_at_once), vllm_engines()
        )


TestHttpPushConformance = HttpPushConformance.test_case(max_examples=40)
TestVllmConformance = VllmConformance.test_case(max_examples=40)
