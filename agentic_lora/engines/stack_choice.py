"""Which HTTP stack an engine transport runs on (the ``http_transport`` setting).

Apart from :mod:`~agentic_lora.engines.stacks` (the seam and the httpx stack) and
:mod:`~agentic_lora.engines.aiohttp_stack`, because it is the one place that knows both.
"""

from __future__ import annotations

import logging

import httpx

from agentic_lora.engines.stacks import HttpStack
from agentic_lora.engines.stacks import HttpxStack
from agentic_lora.engines.wire import HttpTransportKind

__all__ = ["make_stack"]

logger = logging.getLogger(__name__)


def make_stack(kind: HttpTransportKind, timeout: httpx.Timeout, limits: httpx.Limits) -> HttpStack:
    """The stack ``kind`` names; ``"aiohttp"`` falls back to ``"httpx"`` without aiohttp."""
    if kind == "aiohttp":
        try:
            from agentic_lora.engines.aiohttp_stack import AiohttpStack
        except ImportError:
            logger.warning("aiohttp is not installed; the engine transport uses httpx")
        else:
            return AiohttpStack(timeout, limits)
    return HttpxStack(timeout, limits)
