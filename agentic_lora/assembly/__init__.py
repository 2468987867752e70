"""Assembly: one :class:`~agentic_lora.assembly.deployment.Deployment` built from settings (registry,
engines, backend, router, Sessions, publisher, reclaimer), and the Prometheus metrics wired to it.
"""
