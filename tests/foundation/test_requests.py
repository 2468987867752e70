"""Typed requests and replies: validation, pass-through of extra fields, exact bodies."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest

from agentic_lora.errors import InvalidRequestError
from agentic_lora.foundation.requests import ChatCompletionRequest
from agentic_lora.foundation.requests import CompletionRequest
from agentic_lora.foundation.requests import GenerateRequest
from agentic_lora.foundation.requests import GenerateResponse
from agentic_lora.foundation.requests import Route
from agentic_lora.foundation.requests import SamplingParams
from agentic_lora.foundation.requests import check_shape
from agentic_lora.foundation.requests import new_rid
from agentic_lora.foundation.requests import parse_request
from agentic_lora.foundation.requests import request_body


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


@pytest.mark.parametrize(
    ("route", "body", "problem"),
    [
        (Route.GENERATE, {}, "exactly one of"),
        (Route.GENERATE, {"text": "a", "input_ids": [1]}, "exactly one of"),
        (Route.GENERATE, {"text": ["a", "b"]}, "text"),
        (Route.GENERATE, {"input_ids": [[1], [2]]}, "input_ids"),
        (Route.GENERATE, {"input_ids": "1 2"}, "input_ids"),
        (Route.GENERATE, {"text": "a", "rid": ["r1", "r2"]}, "rid"),
        (Route.GENERATE, {"text": "a", "stream": [True]}, "stream"),
        (Route.GENERATE, {"text": "a", "lora_path": ["x"]}, "lora_path"),
        (Route.CHAT_COMPLETIONS, {"messages": []}, "messages"),
        (Route.CHAT_COMPLETIONS, {"messages": "hi"}, "messages"),
        (Route.CHAT_COMPLETIONS, {"messages": [{}], "model": 3}, "model"),
        (Route.COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),
        (Route.COMPLETIONS, {}, "prompt"),
    ],
)
def test_the_shape_check_refuses_batches_and_mistyped_fields_a_session_reads(
    route: Route, body: dict[str, Any], problem: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        check_shape(route, body)
    assert err.value.code == "INVALID_REQUEST"
    assert err.value.details["route"] == route.value
    assert any(p.startswith(problem) or problem in p for p in err.value.details["problems"])
    # Whatever the shape check refuses, the full model refuses too.
    with pytest.raises(InvalidRequestError):
        parse_request(route, body)


def test_the_shape_check_leaves_values_to_the_engine() -> None:
    # Ranges and extra fields are the engine's to judge (it answers 4xx: refused, sent once).
    for route, body in (
        (Route.GENERATE, {"text": "a", "sampling_params": {"temperature": -1}, "rid": "r"}),
        (Route.GENERATE, {"input_ids": [1, 2], "stream": False, "custom": {"x": 1}}),
        (Route.GENERATE, {"input_embeds": [[0.1, 0.2]], "lora_path": None}),
        (Route.CHAT_COMPLETIONS, {"messages": [{"role": "user"}], "model": "m", "n": 0}),
        (Route.COMPLETIONS, {"prompt": [1, 2], "max_tokens": -3}),
        (Route.COMPLETIONS, {"prompt": "x", "model": None}),
    ):
        check_shape(route, body)


def test_request_ids_are_unique_and_a_forked_child_mints_its_own() -> None:
    ids = {new_rid() for _ in range(10_000)}
    assert len(ids) == 10_000
    prefix = new_rid().rsplit("-", 1)[0]
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns about forking a process that has threads; the child only writes.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write_end, new_rid().encode())
        os._exit(0)
    os.close(write_end)
    child = os.read(read_end, 200).decode()
    os.close(read_end)
    os.waitpid(pid, 0)
    # Without a fresh prefix the child would mint exactly the ids its parent mints next.
    assert child.rsplit("-", 1)[0] != prefix
    assert child != new_rid()
