"""The request bodies the gateway accepts, as pydantic models, and its OpenAPI document.

The models are the OpenAI (and SGLang ``/generate``) subset a Session serves, checked strictly
(no string-for-number coercion, no NaN) with the gateway's limits (:class:`GatewayLimits`) as
bounds: ``messages`` count, ``n``, ``max_tokens`` / ``max_completion_tokens`` /
``max_new_tokens``. Fields they do not name pass through to the engine unchanged, as before;
the models only refuse. A body that passed is forwarded exactly as the client sent it.

:func:`request_models` builds the three models for one set of limits; :func:`openapi_document`
puts them, and the error shape, into the app's OpenAPI document (``GET /openapi.json``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from typing import Literal

from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import ValidationError
from pydantic import create_model
from pydantic import model_validator

from agentic_lora.errors import InvalidRequestError
from agentic_lora.foundation.requests import Route
from agentic_lora.foundation.requests import parse_request
from agentic_lora.gateway.limits import GatewayLimits

__all__ = [
    "ChatMessage",
    "ContentPart",
    "ErrorBody",
    "ErrorDetail",
    "RequestModels",
    "add_request_bodies",
    "request_models",
    "validate_body",
]

# Extra fields pass through (engine options this subset does not name); named ones are strict.
_STRICT = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
_ID = Field(default=None, min_length=1, max_length=256)


class ContentPart(BaseModel):
    """One part of a multi-part message ``content`` (``{"type": "text", "text": ...}``, ...)."""

    model_config = _STRICT

    type: str = Field(min_length=1, max_length=64)
    text: str | None = None


class ChatMessage(BaseModel):
    """One chat message."""

    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_call_id: str | None = Field(default=None, max_length=256)
    tool_calls: list[dict[str, Any]] | None = None


class ErrorDetail(BaseModel):
    """``error`` of every error answer: the stable code, a message and structured details."""

    code: str
    message: str
    details: dict[str, Any]


class ErrorBody(BaseModel):
    """Every error answer of the gateway."""

    error: ErrorDetail


class _OnePrompt(BaseModel):
    model_config = _STRICT

    @model_validator(mode="after")
    def _one_prompt(self) -> _OnePrompt:
        given = [n for n in ("text", "input_ids") if getattr(self, n, None) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of text or input_ids (got {given or 'none'})")
        return self


#: The body model of each generation route, for one set of limits.
RequestModels = Mapping[Route, type[BaseModel]]


def request_models(limits: GatewayLimits) -> RequestModels:
    """The models of the three generation routes with ``limits`` as their bounds."""
    tokens: Any = (int | None, Field(default=None, ge=1, le=limits.max_tokens))
    n: Any = (int | None, Field(default=None, ge=1, le=limits.max_n))
    # OpenAI's documented ranges; an engine given values outside them may fail on its side.
    sampling: dict[str, Any] = {
        "temperature": (float | None, Field(default=None, ge=0, le=2)),
        "top_p": (float | None, Field(default=None, gt=0, le=1)),
        "presence_penalty": (float | None, Field(default=None, ge=-2, le=2)),
        "frequency_penalty": (float | None, Field(default=None, ge=-2, le=2)),
        "seed": (int | None, Field(default=None, ge=0, le=2**63 - 1)),
        "stop": (str | list[str] | None, Field(default=None, max_length=64)),
        "n": n,
    }
    common: dict[str, Any] = {
        "model": (str | None, Field(default=None, min_length=1, max_length=512)),
        "stream": (bool | None, None),
        "rid": (str | None, _ID),
        "lora_path": (str | None, _ID),
        "max_tokens": tokens,
        **sampling,
    }
    chat = create_model(
        "ChatCompletionRequest",
        __config__=_STRICT,
        messages=(list[ChatMessage], Field(min_length=1, max_length=limits.max_messages)),
        max_completion_tokens=tokens,
        logprobs=(bool | None, None),
        top_logprobs=(int | None, Field(default=None, ge=0, le=20)),
        **common,
    )
    completion = create_model(
        "CompletionRequest",
        __config__=_STRICT,
        prompt=(str | list[int], Field(min_length=1)),
        logprobs=(int | None, Field(default=None, ge=0, le=20)),
        echo=(bool | None, None),
        **common,
    )
    sampling_params = create_model(
        "SamplingParams",
        __config__=_STRICT,
        max_new_tokens=tokens,
        top_k=(int | None, Field(default=None, ge=-1)),
        min_p=(float | None, Field(default=None, ge=0, le=1)),
        **sampling,
    )
    generate = create_model(
        "GenerateRequest",
        __base__=_OnePrompt,
        text=(str | None, Field(default=None, min_length=1)),
        input_ids=(list[int] | None, Field(default=None, min_length=1)),
        sampling_params=(sampling_params | None, None),
        stream=(bool | None, None),
        rid=(str | None, _ID),
        lora_path=(str | None, _ID),
    )
    return {
        Route.CHAT_COMPLETIONS: chat,
        Route.COMPLETIONS: completion,
        Route.GENERATE: generate,
    }


def validate_body(models: RequestModels, route: Route, body: Any) -> dict[str, Any]:
    """``body`` itself once ``route``'s model accepts it; INVALID_REQUEST otherwise.

    The message names each failing field and why, never the value (it may be huge, or a
    credential pasted into the wrong field).
    """
    if not isinstance(body, dict):
        raise InvalidRequestError(
            "the body must be a JSON object", route=route.value, reason="not_object"
        )
    try:
        models[route].model_validate(body)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(str(p) for p in err['loc']) or '<body>'}: {err['msg']}"[:200]
            for err in exc.errors(include_input=False, include_url=False)[:10]
        ]
        raise InvalidRequestError(
            f"malformed {route.value} request: {'; '.join(problems)}",
            route=route.value,
            reason="schema",
            problems=problems,
        ) from exc
    # What the Session will check after the bind must hold now, before a Session is opened
    # (``stream`` aside: a streamed request goes to Session.stream, which asks for the stream).
    streamed = body.get("stream") is True
    parse_request(route, {k: v for k, v in body.items() if k != "stream"} if streamed else body)
    return body


def add_request_bodies(document: dict[str, Any], models: RequestModels) -> dict[str, Any]:
    """``document`` (an OpenAPI document) with each generation route's request body set to its
    model, the models' schemas added to ``components.schemas``."""
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for route, model in models.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        operation = document.get("paths", {}).get(route.value, {}).get("post")
        if operation is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}
                    }
                },
            }
    return document
