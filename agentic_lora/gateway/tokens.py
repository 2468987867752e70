"""Token ids and logprobs of a gateway turn, for a trainer that learns from gateway rollouts.

The gateway forwards the OpenAI ``logprobs`` / ``top_logprobs`` fields and SGLang's token-id
extras to the engine as given, and returns the engine's reply unchanged (plus its ``agentic_lora``
provenance field). Ask with :data:`CHAT_TOKEN_FIELDS` on ``/v1/chat/completions`` or
:data:`COMPLETION_TOKEN_FIELDS` on ``/v1/completions`` (with the OpenAI SDK: ``extra_body``), and
read the answer with :func:`turn_tokens`. SGLang (0.5.x) answers, per choice:

* chat: ``prompt_token_ids`` and ``response_token_ids`` (``return_token_ids``), and
  ``logprobs.content[i].logprob`` (``logprobs: true``);
* completions: ``prompt_token_ids`` and ``token_ids`` (``return_token_ids``), and
  ``logprobs.token_logprobs`` (``logprobs: <n>``).

Token ids are not available on a streamed reply (SGLang refuses ``return_token_ids`` with
``stream``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CHAT_TOKEN_FIELDS", "COMPLETION_TOKEN_FIELDS", "TurnTokens", "turn_tokens"]

#: Request fields that make a chat completion carry its token ids and logprobs.
CHAT_TOKEN_FIELDS: Mapping[str, Any] = {"logprobs": True, "return_token_ids": True}
#: The same for a completion (``logprobs`` is a count of top alternatives there; 0 is none).
COMPLETION_TOKEN_FIELDS: Mapping[str, Any] = {"logprobs": 0, "return_token_ids": True}


@dataclass(frozen=True, slots=True)
class TurnTokens:
    """One turn as a trainer sees it: ``prompt_ids``, ``completion_ids``, one logprob per
    completion token, and the version that generated it (None: no provenance in the reply)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    version_id: str | None


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise ValueError(f"the reply has no {what} (ask with return_token_ids)")
    return list(value)


def turn_tokens(reply: Mapping[str, Any], choice: int = 0) -> TurnTokens:
    """The token ids and logprobs of choice ``choice`` of a gateway chat or completion reply
    (the JSON object). Raises ValueError naming the missing field when it was not asked for."""
    picked = reply["choices"][choice]
    completion_ids = _ints(
        picked.get("response_token_ids", picked.get("token_ids")), "completion token ids"
    )
    prompt_ids = _ints(picked.get("prompt_token_ids"), "prompt token ids")
    logprobs = picked.get("logprobs") or {}
    if isinstance(logprobs.get("content"), list):
        values = [entry.get("logprob") for entry in logprobs["content"]]
    else:
        values = logprobs.get("token_logprobs") or []
    if len(values) != len(completion_ids) or not all(isinstance(v, int | float) for v in values):
        raise ValueError("the reply has no logprob per completion token (ask with logprobs)")
    provenance = reply.get("agentic_lora")
    version = provenance.get("version_id") if isinstance(provenance, Mapping) else None
    return TurnTokens(prompt_ids, completion_ids, [float(v) for v in values], version)
