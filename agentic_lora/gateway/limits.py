"""Input limits of the gateway, checked before any Session exists.

A request body is read in chunks and refused with 413 ``REQUEST_TOO_LARGE`` the moment it passes
``max_body_bytes`` (a ``Content-Length`` over the limit is refused before a byte is read), so a
huge body costs at most the limit in memory. It is then parsed as JSON with a nesting bound
(``max_json_depth``) and refused unless it can be sent on as strict JSON (no NaN or infinities,
no lone surrogates). Only then does the route's model (:mod:`agentic_lora.gateway.schema`) judge
it, and only a request that passed all of this may open a Session.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import fields
from dataclasses import replace
from typing import Any

from agentic_lora.config import AgenticLoRASettings
from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import RequestTooLargeError

__all__ = ["GatewayLimits", "parse_json", "read_body"]


def _setting_default(name: str) -> int:
    # One source for each default: the setting ``gateway_<name>``.
    return int(AgenticLoRASettings.model_fields[f"gateway_{name}"].default)


@dataclass(frozen=True, slots=True)
class GatewayLimits:
    """The gateway's input limits and Session bound (defaults: the settings' defaults).

    ``max_tokens`` bounds ``max_tokens`` / ``max_completion_tokens`` / ``max_new_tokens``;
    :meth:`with_context_length` lowers it to what the engines can generate at all.
    """

    max_body_bytes: int = _setting_default("max_body_bytes")
    max_json_depth: int = _setting_default("max_json_depth")
    max_messages: int = _setting_default("max_messages")
    max_n: int = _setting_default("max_n")
    max_tokens: int = _setting_default("max_tokens")
    max_sessions: int = _setting_default("max_sessions")

    @classmethod
    def from_settings(cls, settings: AgenticLoRASettings) -> GatewayLimits:
        """The limits the settings give: each limit ``<name>`` is the setting ``gateway_<name>``."""
        return cls(**{f.name: getattr(settings, f"gateway_{f.name}") for f in fields(cls)})

    def with_context_length(self, context_length: int | None) -> GatewayLimits:
        """These limits with ``max_tokens`` at most ``context_length`` (None, or not a positive
        int: unchanged)."""
        if not isinstance(context_length, int) or isinstance(context_length, bool):
            return self
        if context_length < 1 or context_length >= self.max_tokens:
            return self
        return replace(self, max_tokens=context_length)


async def read_body(
    headers: Mapping[str, str], chunks: AsyncIterator[bytes], limit: int, *, route: str
) -> bytes:
    """The whole body, or REQUEST_TOO_LARGE as soon as it passes ``limit`` bytes."""
    declared = headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise _too_large(limit, route)
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            # The rest is never read: the server closes the connection after the answer.
            raise _too_large(limit, route)
        parts.append(chunk)
    return b"".join(parts)


def _too_large(limit: int, route: str) -> RequestTooLargeError:
    return RequestTooLargeError(
        f"the request body is larger than {limit} bytes; nothing was sent",
        limit=limit,
        route=route,
        reason="body_too_large",
    )


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    # 1e999 is valid JSON that Python reads as infinity, which no strict encoder sends on.
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:50]} is out of range for a float")
    return value


# json.loads with hooks builds a decoder per call; this is the same decoder, built once.
_STRICT_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)


def parse_json(raw: bytes, *, max_depth: int, route: str) -> Any:
    """``raw`` parsed as strict JSON at most ``max_depth`` levels deep, or INVALID_REQUEST."""
    try:
        # What json.loads does with bytes (UTF-8, -16 or -32, lone surrogates let through).
        encoding = json.detect_encoding(raw)
        value = _STRICT_DECODER.decode(raw.decode(encoding, "surrogatepass"))
    except RecursionError as exc:
        # The C decoder stops at the interpreter's recursion limit: far deeper than any limit.
        raise _bad(f"the body is nested deeper than {max_depth} levels", route, "too_deep") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too many integer digits
        raise _bad(f"the body is not valid JSON: {str(exc)[:200]}", route, "not_json") from exc
    # Every level opens with a bracket, and a bracket's byte is in it in every encoding: a body
    # with no more bracket bytes than the limit cannot be nested deeper (no walk needed).
    if raw.count(b"[") + raw.count(b"{") > max_depth and _depth_exceeds(value, max_depth):
        raise _bad(f"the body is nested deeper than {max_depth} levels", route, "too_deep")
    if encoding == "utf-8" and raw.isascii() and b"\\u" not in raw:
        # Only a \u escape can put a lone surrogate into ASCII text, and NaN and the
        # infinities (written, or a float out of range) were refused by the decoder: this
        # value can be sent on as JSON as it is.
        return value
    try:
        # What the engine client will do with it: a string JSON cannot carry in UTF-8 (a lone
        # surrogate) must fail here, before a Session exists, not after the bind.
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode()
    except (ValueError, RecursionError) as exc:
        raise _bad(
            f"the body cannot be sent on as JSON: {str(exc)[:200]}", route, "not_json"
        ) from exc
    return value


def _depth_exceeds(value: Any, max_depth: int) -> bool:
    # Iterative: a deep value must not cost the stack that the check protects.
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def _bad(message: str, route: str, reason: str) -> InvalidRequestError:
    return InvalidRequestError(message, route=route, reason=reason)
