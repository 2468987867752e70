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
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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


def request_body(route: Route, request: RequestLike, *, validate: bool = True) -> dict[str, Any]:
    """The JSON body to send for ``request`` (a fresh dict the caller may change).

    A mapping keeps its own keys, values and order (validation only checks its shape), so
    nothing the caller sent is rewritten. With ``validate=False`` a mapping is copied as is.
    """
    if isinstance(request, EngineRequest):
        return parse_request(route, request).to_body()
    if validate:
        parse_request(route, request)
    elif not isinstance(request, Mapping):
        raise InvalidRequestError(
            f"a request body is a JSON object, not {type(request).__name__}", route=route.value
        )
    return dict(request)


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


class ChatCompletionResponse(BaseModel):
    """One OpenAI chat completion reply."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    model: str | None = None
    choices: list[dict[str, Any]] = Field(default_factory=list)
    usage: dict[str, Any] | None = None


class CompletionResponse(BaseModel):
    """One OpenAI completion reply."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    model: str | None = None
    choices: list[dict[str, Any]] = Field(default_factory=list)
    usage: dict[str, Any] | None = None
