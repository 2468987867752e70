"""The Session gateway and its admin API.

* :mod:`agentic_lora.gateway.app`: :class:`~agentic_lora.gateway.app.Gateway`, the FastAPI app
  (needs the ``gateway`` extra: fastapi, uvicorn, prometheus-client).
* :mod:`agentic_lora.gateway.client`: :class:`~agentic_lora.gateway.client.AdminClient`, what the
  CLI uses to drive a running gateway (httpx only).
* :mod:`agentic_lora.gateway.sessions`, :mod:`agentic_lora.gateway.progress`,
  :mod:`agentic_lora.gateway.wire`: Session ids, progress fan-out, JSON forms and HTTP statuses;
  :mod:`agentic_lora.gateway.adoption` and :mod:`agentic_lora.gateway.closed_elsewhere`: the
  Sessions adopted at a restart, and those closed by another replica.

Importing this package imports none of the ASGI stack; only ``agentic_lora.gateway.app`` does.
"""

__all__: list[str] = []
