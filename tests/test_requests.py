"""Typed requests and replies: validation, pass-through of extra fields, exact bodies."""

from __future__ import annotations

from typing import Any

import pytest

from agentic_lora.errors import InvalidRequestError
from agentic_lora.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    GenerateResponse,
    Route,
    SamplingParams,
    parse_request,
    request_body,
)


def test_generate_body_has_only_what_was_set_plus_extras() -> None:
    req = GenerateRequest.model_validate(
        {
            "input_ids": [1, 2, 3],
            "sampling_params": SamplingParams.model_validate(
                {"max_new_tokens": 8, "temperature": 0.0, "frequency_penalty": 0.5}
            ),
            "return_logprob": True,
            "custom_engine_flag": {"x": 1},
        }
    )
    assert req.to_body() == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "frequency_penalty": 0.5},
        "return_logprob": True,
        "custom_engine_flag": {"x": 1},
    }


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"text": "a", "input_ids": [1]},
        {"text": ["a", "b"]},
        {"input_ids": [[1], [2]]},
        {"text": "a", "rid": ["r1", "r2"]},
        {"text": "a", "sampling_params": {"temperature": -1}},
        {"text": "a", "sampling_params": {"n": 0}},
    ],
)
def test_malformed_generate_requests_are_typed_errors(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError) as err:
        parse_request(Route.GENERATE, body)
    assert err.value.code == "INVALID_REQUEST"
    assert err.value.details["problems"]


def test_openai_shapes() -> None:
    chat = parse_request(
        Route.CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": "hi"}], "tools": []}
    )
    assert isinstance(chat, ChatCompletionRequest)
    assert chat.to_body()["tools"] == []
    comp = parse_request(Route.COMPLETIONS, {"prompt": [1, 2], "max_tokens": 4})
    assert isinstance(comp, CompletionRequest)
    for route, bad in (
        (Route.CHAT_COMPLETIONS, {"messages": []}),
        (Route.COMPLETIONS, {"prompt": ["a", "b"]}),
        (Route.COMPLETIONS, {}),
    ):
        with pytest.raises(InvalidRequestError):
            parse_request(route, bad)


def test_a_model_of_another_route_or_a_non_object_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="cannot be sent"):
        parse_request(Route.GENERATE, CompletionRequest(prompt="x"))
    with pytest.raises(InvalidRequestError, match="JSON object"):
        parse_request(Route.GENERATE, ["text"])  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="JSON object"):
        request_body(Route.GENERATE, "text", validate=False)  # type: ignore[arg-type]


def test_a_mapping_keeps_its_keys_values_and_order() -> None:
    original = {"sampling_params": {"temperature": "0.5"}, "zzz": 1, "text": "x", "aaa": None}
    body = request_body(Route.GENERATE, original)
    assert body == original
    assert list(body) == list(original)
    assert body is not original
    body["rid"] = "added"
    assert "rid" not in original
    unchecked = request_body(Route.GENERATE, {"anything": "goes"}, validate=False)
    assert unchecked == {"anything": "goes"}


def test_generate_response_abort_flag_and_extras() -> None:
    done = GenerateResponse.model_validate(
        {
            "text": "t",
            "meta_info": {"id": "r", "finish_reason": {"type": "length"}, "e2e_latency": 0.1},
        }
    )
    assert not done.aborted
    assert done.meta_info.model_extra == {"e2e_latency": 0.1}
    aborted = GenerateResponse.model_validate(
        {"meta_info": {"finish_reason": {"type": "abort", "message": "x"}}}
    )
    assert aborted.aborted
    assert Route.CHAT_COMPLETIONS.is_openai
    assert not Route.GENERATE.is_openai
