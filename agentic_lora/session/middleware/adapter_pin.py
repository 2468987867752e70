"""The adapter pin: the middleware that writes a Session's bound adapter into every request.

:class:`AdapterPinMiddleware` writes the Session's bound ``lora_name`` into the body the way the
engine dialect addresses an adapter
(:meth:`~agentic_lora.engines.dialect.EngineDialect.pin`), and refuses a caller that named another
adapter. SGLang: ``lora_path`` for ``/generate``, ``model="<base>:<lora_name>"`` for OpenAI
routes; vLLM: ``model=<lora_name>``. A route the engine does not serve was refused by the Session
before it bound (the one route check per request).
"""

from __future__ import annotations

from collections.abc import Awaitable
from collections.abc import Mapping
from typing import Any

from agentic_lora.engines.dialect import EngineDialect
from agentic_lora.engines.sglang import SGLANG
from agentic_lora.engines.transport import EngineReply
from agentic_lora.errors import SessionStateError
from agentic_lora.foundation.requests import Route
from agentic_lora.session.middleware.chain import Dispatch
from agentic_lora.session.middleware.chain import EngineCall

__all__ = ["AdapterPinMiddleware", "pin_adapter"]


def pin_adapter(
    route: Route,
    body: Mapping[str, Any],
    lora_name: str,
    base_model: str | None,
    *,
    dialect: EngineDialect = SGLANG,
) -> dict[str, Any]:
    """``body`` with the bound adapter written in the ``dialect``'s way; a different adapter
    named by the caller raises AdapterMismatchError (see
    :meth:`~agentic_lora.engines.dialect.EngineDialect.pin`)."""
    return dialect.pin(route, body, lora_name, base_model)


class AdapterPinMiddleware:
    """Writes the Session's bound adapter into every request (see :func:`pin_adapter`)."""

    def __init__(
        self,
        next_dispatch: Dispatch,
        *,
        base_model: str | None,
        dialect: EngineDialect = SGLANG,
    ) -> None:
        self._next = next_dispatch
        self._base_model = base_model
        self._pin = dialect.pin

    # Not a coroutine function: it hands back the next step's awaitable, one frame fewer per
    # dispatch (nothing of its own runs after the next step, so nothing needs awaiting here).
    # A refusal is raised when the call is made, which is also when the chain awaits it.
    def __call__(self, call: EngineCall) -> Awaitable[EngineReply]:
        binding = call.binding
        if binding is None:
            # Fail closed: a versioned request without a binding would run on the base model.
            raise SessionStateError(
                "a versioned dispatch reached the adapter pin without a binding",
                session=call.session_key,
            )
        body = self._pin(call.route, call.body, binding.lora_name, self._base_model)
        return self._next(call.with_body(body))
