"""Test support that ships with the library.

* :mod:`agentic_lora.testing.backend_conformance`: a hypothesis state machine every backend
  plugin can run to prove it keeps the :class:`~agentic_lora.backends.Backend` contract.
* :mod:`agentic_lora.testing.sglang_engine`: a scripted SGLang engine served through ``respx``.

These modules need the test extras (``hypothesis``, ``respx``); the library itself never imports
them.
"""

__all__: list[str] = []
