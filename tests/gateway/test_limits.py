"""parse_json's shortcuts (one decoder, no walk or re-encode when the bytes rule them out) refuse
and accept exactly what the plain check does: decode, walk every level, re-encode strictly."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from agentic_lora.errors import InvalidRequestError
from agentic_lora.gateway.limits import parse_json

MAX_DEPTH = 4


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _reference(raw: bytes) -> tuple[str, Any]:
    """The check without shortcuts: ("ok", value), or ("refused", every reason that applies)."""

    def no_constant(name: str) -> Any:
        raise ValueError(name)

    try:
        value = json.loads(raw, parse_constant=no_constant)
    except RecursionError:
        return "refused", {"too_deep"}
    except ValueError:
        return "refused", {"not_json"}
    reasons = set()
    if _depth(value) > MAX_DEPTH:
        reasons.add("too_deep")
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode()
    except ValueError:
        reasons.add("not_json")
    return ("refused", reasons) if reasons else ("ok", value)


def _agrees(raw: bytes) -> None:
    verdict, detail = _verdict(raw)
    expected, expected_detail = _reference(raw)
    assert verdict == expected
    if verdict == "ok":
        assert detail == expected_detail
    else:  # a body refused for two reasons may name either
        assert detail in expected_detail


def _verdict(raw: bytes) -> tuple[str, Any]:
    try:
        return "ok", parse_json(raw, max_depth=MAX_DEPTH, route="/generate")
    except InvalidRequestError as exc:
        return "refused", exc.details["reason"]


_texts = st.text(alphabet=st.characters(codec=None), max_size=6) | st.sampled_from(
    ["\ud800", "a\udc00b", "\u00e9", "[", "{{", "\\u"]
)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | _texts
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_texts, inner, max_size=3),
    max_leaves=12,
)
# Numbers and constants JSON cannot carry on, spliced in as raw text.
_raw_tokens = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e400", "1.5e3", "0"])


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    value = draw(_values)
    text = json.dumps(value, ensure_ascii=draw(st.booleans()))
    if draw(st.booleans()):
        text = f'{{"a": {text}, "b": {draw(_raw_tokens)}}}'
    encoding = draw(st.sampled_from(["utf-8", "utf-16", "utf-32", "utf-16-le"]))
    return text.encode(encoding, "surrogatepass")


@settings(max_examples=400, deadline=None)
@given(_bodies())
def test_parse_json_decides_as_the_plain_check(raw: bytes) -> None:
    _agrees(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": [[[1]]]}',  # exactly the limit
        b'{"a": [[[[1]]]]}',  # one past it
        b'{"a": "[[[[[[[[", "b": 1}',  # brackets in a string count for nothing
        b'{"a": 1e999}',
        b'{"a": "\xed\xa0\x80"}',  # a lone surrogate in raw UTF-8 bytes
        '{"a": "\u00e9\\ud800"}'.encode(),  # escaped, in a body that is not ASCII
        b'{"a": "\\ud83d\\ude00"}',  # a surrogate pair: one character, accepted
    ],
)
def test_parse_json_edge_cases(raw: bytes) -> None:
    _agrees(raw)
