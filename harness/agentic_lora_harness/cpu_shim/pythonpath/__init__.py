"""Test-harness compatibility shim, CPU only: the directory put on an engine's ``PYTHONPATH``.

Its modules are imported there as top-level modules (``sitecustomize``, ``agentic_lora_cpu_shim``);
this file only makes the directory ship with the package.
"""
