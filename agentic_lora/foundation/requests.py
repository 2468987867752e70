"""Typed requests and replies for the engine routes a Session dispatches to.

Three routes are covered: SGLang's native ``/generate`` and the OpenAI-compatible
``/v1/chat/completions`` and ``/v1/completions``. Every model allows extra fields, so a framework
can send engine options this module does not name and they reach the engine unchanged.

A Session generation is one prompt (``n`` samples of it are fine): batched ``/generate`` inputs
and per-item ``rid`` lists are refused, because one Session must map to exactly one policy
version and one abortable request id.
"""

from __future__ import annotations

import enum
import itertools
import os
import secrets
from collections.abc import Mapping
from typing import Any
from typing import ClassVar

from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import ValidationError
from pydantic import model_validator

from agentic_lora.errors import InvalidRequestError

__all__ = [
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "CompletionRequest",
    "CompletionResponse",
    "EngineRequest",
    "GenerateRequest",
    "GenerateResponse",
    "MetaInfo",
    "RequestLike",
    "Route",
    "SamplingParams",
    "check_shape",
    "new_rid",
    "parse_request",
    "request_body",
]


class Route(enum.StrEnum):
    """An engine HTTP route a Session can dispatch to."""

    GENERATE = "/generate"
    CHAT_COMPLETIONS = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"

    @property
    def is_openai(self) -> bool:
        """OpenAI routes name the adapter in ``model`` (``"<base>:<adapter>"``)."""
        return self is not Route.GENERATE


class SamplingParams(BaseModel):
    """SGLang sampling parameters (the common ones typed; any other passes through)."""

    model_config = ConfigDict(extra="allow")

    max_new_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = Field(default=None, ge=1)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None


class EngineRequest(BaseModel):
    """Base of the typed requests: extra fields pass through, ``to_body`` gives the JSON body."""

    model_config = ConfigDict(extra="allow")

    route: ClassVar[Route]

    rid: str | None = None
    stream: bool = False

    def to_body(self) -> dict[str, Any]:
        """The JSON body: only the fields that were set, extras included, in a fresh dict."""
        return self.model_dump(mode="json", exclude_unset=True, by_alias=True)


class GenerateRequest(EngineRequest):
    """SGLang ``/generate``: exactly one of ``text`` or ``input_ids``."""

    route: ClassVar[Route] = Route.GENERATE

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = Field(default=None, ge=0)
    return_text_in_logprobs: bool | None = None
    lora_path: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        given = [
            n for n in ("text", "input_ids", "input_embeds") if getattr(self, n, None) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of text, input_ids or input_embeds (got {given or 'none'})"
            )
        return self


class ChatCompletionRequest(EngineRequest):
    """OpenAI chat completions (SGLang's ``/v1/chat/completions``)."""

    route: ClassVar[Route] = Route.CHAT_COMPLETIONS

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    lora_path: str | None = None


class CompletionRequest(EngineRequest):
    """OpenAI completions (SGLang's ``/v1/completions``): one prompt, text or token ids."""

    route: ClassVar[Route] = Route.COMPLETIONS

    model: str | None = None
    prompt: str | list[int]
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool | None = None
    lora_path: str | None = None


#: What a Session accepts as a request: a typed model or a plain JSON mapping.
RequestLike = EngineRequest | Mapping[str, Any]

_MODELS: dict[Route, type[EngineRequest]] = {
    Route.GENERATE: GenerateRequest,
    Route.CHAT_COMPLETIONS: ChatCompletionRequest,
    Route.COMPLETIONS: CompletionRequest,
}


def _describe(exc: ValidationError) -> list[str]:
    return [
        f"{'.'.join(str(p) for p in err['loc']) or '<body>'}: {err['msg']}" for err in exc.errors()
    ]


def parse_request(route: Route, request: RequestLike) -> EngineRequest:
    """Validate ``request`` as ``route``'s model; a malformed one raises InvalidRequestError."""
    model = _MODELS[route]
    if isinstance(request, EngineRequest):
        if not isinstance(request, model):
            raise InvalidRequestError(
                f"{type(request).__name__} cannot be sent to {route.value}",
                route=route.value,
            )
        return request
    if not isinstance(request, Mapping):
        raise InvalidRequestError(
            f"a request is a {model.__name__} or a JSON object, not {type(request).__name__}",
            route=route.value,
        )
    try:
        return model.model_validate(dict(request))
    except ValidationError as exc:
        problems = _describe(exc)
        raise InvalidRequestError(
            f"malformed {route.value} request: {'; '.join(problems)}",
            route=route.value,
            problems=problems,
        ) from exc


def _one_prompt_problem(route: Route, body: Mapping[str, Any]) -> str | None:
    # Only what makes a request one prompt: a batch would run under one version but come back
    # as several generations behind one request id (one abort, one provenance).
    if route is Route.GENERATE:
        given = [k for k in ("text", "input_ids", "input_embeds") if body.get(k) is not None]
        if len(given) != 1:
            return f"give exactly one of text, input_ids or input_embeds (got {given or 'none'})"
        text, ids = body.get("text"), body.get("input_ids")
        if text is not None and not isinstance(text, str):
            return "text: one prompt is a string"
        if ids is not None and (not isinstance(ids, list) or (ids and isinstance(ids[0], list))):
            return "input_ids: one prompt is a list of token ids"
    elif route is Route.CHAT_COMPLETIONS:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "messages: a non-empty list"
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) and not (
            isinstance(prompt, list) and (not prompt or type(prompt[0]) is int)
        ):
            return "prompt: one prompt is a string or a list of token ids"
    return None


def check_shape(route: Route, body: Mapping[str, Any]) -> None:
    """Check only what a Session reads or relies on in a JSON body, without building a model.

    The request id, ``stream`` and the adapter fields (``lora_path``, ``model``) have their
    types, and the body is one prompt. Everything else (sampling values, ranges, extra fields)
    is the engine's to judge: it answers a bad value with a 4xx, a refusal that sends nothing
    twice. :func:`parse_request` is the full check (about ten times the cost, measured in
    ``bench/dispatch.py``). Raises InvalidRequestError with the same details.
    """
    problems = []
    for name, kind in _SHAPE_TYPES:
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            problems.append(f"{name}: must be a {kind.__name__}, not {type(value).__name__}")
    prompt = _one_prompt_problem(route, body)
    if prompt is not None:
        problems.append(prompt)
    if problems:
        raise InvalidRequestError(
            f"malformed {route.value} request: {'; '.join(problems)}",
            route=route.value,
            problems=problems,
        )


#: The fields a Session reads, with their types (None is always allowed: "not given").
_SHAPE_TYPES: tuple[tuple[str, type], ...] = (
    ("rid", str),
    ("stream", bool),
    ("lora_path", str),
    ("model", str),
)


def request_body(route: Route, request: RequestLike, *, validate: bool = True) -> dict[str, Any]:
    """The JSON body to send for ``request`` (a fresh dict the caller may change).

    A mapping keeps its own keys, values and order (validation only checks its shape), so
    nothing the caller sent is rewritten. With ``validate=False`` a mapping is copied as is.
    """
    if not validate and type(request) is dict:
        # The common case, decided before the two isinstance checks below: both classes are
        # ABCs (pydantic's metaclass is one), whose checks cost more than the copy itself.
        return request.copy()
    if isinstance(request, EngineRequest):
        return parse_request(route, request).to_body()
    if validate:
        parse_request(route, request)
    elif not isinstance(request, Mapping):
        raise InvalidRequestError(
            f"a request body is a JSON object, not {type(request).__name__}", route=route.value
        )
    return dict(request)


# --- request ids --------------------------------------------------------------------------------

_rid_prefix = secrets.token_hex(12)
_rid_counter = itertools.count()


def _new_rid_space() -> None:
    global _rid_prefix, _rid_counter
    _rid_prefix = secrets.token_hex(12)
    _rid_counter = itertools.count()


# A forked child inherits the prefix and the counter: without a fresh prefix it would mint the
# very ids its parent mints next, and two requests (or two registry calls) would share one id.
os.register_at_fork(after_in_child=_new_rid_space)


def new_rid() -> str:
    """A request id unique across processes: a random per-process prefix (96 bits) and a counter.

    Used for engine request ids (what an abort names) and registry idempotency keys. Minting one
    is a counter step and a format, about a tenth of ``uuid4().hex``.
    """
    return f"{_rid_prefix}-{next(_rid_counter):x}"


# --- replies ------------------------------------------------------------------------------------


class MetaInfo(BaseModel):
    """SGLang's ``meta_info`` of a ``/generate`` reply (common fields typed, the rest kept)."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


class GenerateResponse(BaseModel):
    """One ``/generate`` reply."""

    model_config = ConfigDict(extra="allow")

    text: str | None = None
    output_ids: list[int] | None = None
    meta_info: MetaInfo = Field(default_factory=MetaInfo)

    @property
    def aborted(self) -> bool:
        """True when the engine ended the request by abort (``finish_reason.type == "abort"``)."""
        reason = self.meta_info.finish_reason
        return reason is not None and reason.get("type") == "abort"


class _ChoicesReply(BaseModel):
    """The fields OpenAI's completion and chat completion replies share."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    model: str | None = None
    choices: list[dict[str, Any]] = Field(default_factory=list)
    usage: dict[str, Any] | None = None


class ChatCompletionResponse(_ChoicesReply):
    """One OpenAI chat completion reply."""


class CompletionResponse(_ChoicesReply):
    """One OpenAI completion reply."""
