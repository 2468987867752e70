"""One generation turn on token ids through SGLang's native ``/generate``.

The request (SGLang 0.5's ``GenerateReqInput``)::

    {"input_ids": [...], "sampling_params": {"max_new_tokens": n, "temperature": t, ...},
     "return_logprob": true}

and the fields read back from the reply::

    {"output_ids": [...],                                   # the engine's own token ids
     "meta_info": {"output_token_logprobs": [[logprob, token_id, null], ...],
                   "finish_reason": {"type": "stop" | "length" | "abort", ...}}}

The logprobs are the engine's, of the sampled tokens, after the sampling transforms it applies
(temperature, top-p/top-k/min-p): with ``temperature`` 1 and no truncation they are the model's
own. Every logprob's token id must equal the output id at its position, so a reply whose two
lists disagree is refused rather than trained on.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentic_lora.errors import DispatchError

__all__ = ["TokenTurn", "sampling_params", "token_request", "token_turn"]


@dataclass(frozen=True)
class TokenTurn:
    """The model tokens one ``/generate`` call produced, with the engine's logprob of each."""

    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None


def sampling_params(args: Any, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """SGLang sampling parameters from a ``GRPOConfig``'s generation fields, then ``overrides``.

    TRL's ``top_k=0`` (no top-k) is SGLang's ``-1``; ``min_p`` is sent only when set.
    """
    params: dict[str, Any] = {
        "temperature": float(args.temperature),
        "top_p": float(args.top_p),
        "top_k": int(args.top_k) if args.top_k else -1,
        "repetition_penalty": float(args.repetition_penalty),
    }
    if getattr(args, "min_p", None) is not None:
        params["min_p"] = float(args.min_p)
    params.update(overrides or {})
    return params


def token_request(
    input_ids: Sequence[int],
    sampling: Mapping[str, Any],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
) -> dict[str, Any]:
    """The ``/generate`` body of one turn continuing ``input_ids``."""
    params = dict(sampling)
    params["max_new_tokens"] = max_new_tokens
    if stop_token_ids:
        params["stop_token_ids"] = sorted(
            set(stop_token_ids) | set(params.get("stop_token_ids", ()))
        )
    return {"input_ids": list(input_ids), "sampling_params": params, "return_logprob": True}


def token_turn(body: Any) -> TokenTurn:
    """Read one ``/generate`` reply (see module docstring); a reply without the engine's token
    ids and matching logprobs raises DispatchError (``reason="reply_without_logprobs"`` or
    ``"logprob_token_mismatch"``)."""
    if not isinstance(body, Mapping):
        raise _bad(f"a /generate reply is a JSON object, not {type(body).__name__}")
    meta = body.get("meta_info")
    output_ids = body.get("output_ids")
    pairs = meta.get("output_token_logprobs") if isinstance(meta, Mapping) else None
    if not isinstance(output_ids, list) or not isinstance(pairs, list):
        raise _bad(
            "the reply has no output_ids or no meta_info.output_token_logprobs "
            "(was the request sent with return_logprob?)"
        )
    logprobs: list[float] = []
    for position, (token, entry) in enumerate(zip(output_ids, pairs, strict=False)):
        if (
            not isinstance(entry, Sequence)
            or len(entry) < 2
            or entry[1] != token
            or not isinstance(entry[0], int | float)
        ):
            raise _bad(
                f"logprob entry {position} ({entry!r}) is not for output token {token}",
                reason="logprob_token_mismatch",
            )
        logprobs.append(float(entry[0]))
    if len(pairs) != len(output_ids):
        raise _bad(
            f"{len(output_ids)} output ids but {len(pairs)} logprobs",
            reason="logprob_token_mismatch",
        )
    reason = meta.get("finish_reason") if isinstance(meta, Mapping) else None
    finish = reason.get("type") if isinstance(reason, Mapping) else None
    return TokenTurn(
        tuple(int(t) for t in output_ids),
        tuple(logprobs),
        finish if isinstance(finish, str) else None,
    )


def _bad(message: str, *, reason: str = "reply_without_logprobs") -> DispatchError:
    return DispatchError(message, reason=reason)
