"""The chain's end: one send through the engine transport, to the engine the router chose."""

from __future__ import annotations

from collections.abc import Awaitable

from agentic_lora.engines.transport import EngineReply
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.errors import ConfigurationError
from agentic_lora.session.middleware.chain import EngineCall

__all__ = ["TransportEndpoint"]


class TransportEndpoint:
    """The end of the chain: one send through the engine transport."""

    def __init__(self, transport: EngineTransport) -> None:
        self._transport = transport

    # Not a coroutine function, like the adapter pin: the send's own coroutine is the step.
    def __call__(self, call: EngineCall) -> Awaitable[EngineReply]:
        if call.engine is None:
            raise ConfigurationError(
                "the chain reached the transport without choosing an engine (no router?)",
                check="router",
            )
        return self._transport.send(call.engine, call.route.value, call.body)
