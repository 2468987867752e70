"""Test support that ships with the library.

* :mod:`agentic_lora.testing.backend_conformance`: a hypothesis state machine every backend
  plugin can run to prove it keeps the :class:`~agentic_lora.engines.backends.Backend` contract.
* :mod:`agentic_lora.testing.sglang_engine` and :mod:`agentic_lora.testing.vllm_engine`:
  scripted SGLang and vLLM engines served through ``respx``, on one base
  (:mod:`agentic_lora.testing.scripted_engine`: scripted faults, the call record, model cards).
* :mod:`agentic_lora.testing.fleet`: a fleet of scripted SGLang engines mounted at once.
* :mod:`agentic_lora.testing.scripted_harness`: a backend plus scripted engines as the
  conformance suite's harness, for any backend that talks to SGLang or vLLM over HTTP.
* :mod:`agentic_lora.testing.publish`: publish (or stage) a version by registry verbs alone.

These modules need the test extras (``hypothesis``, ``respx``); the library itself never imports
them.
"""

__all__: list[str] = []
