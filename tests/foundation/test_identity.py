"""Version identity: names, canonical JSON, the manifest and the digest definition."""

from __future__ import annotations

import copy
import enum
import hashlib
import json
import pickle
import string
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentic_lora.adapters.safetensors_io import TensorRecord
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import InvalidAdapterError
from agentic_lora.errors import InvalidIdentityError
from agentic_lora.errors import error_from_code
from agentic_lora.foundation.identity import MANIFEST_FORMAT
from agentic_lora.foundation.identity import LoraName
from agentic_lora.foundation.identity import Manifest
from agentic_lora.foundation.identity import ManifestEntry
from agentic_lora.foundation.identity import canonical_json
from agentic_lora.foundation.identity import compute_digest
from agentic_lora.foundation.identity import freeze_json
from agentic_lora.foundation.identity import make_lora_name
from agentic_lora.foundation.identity import parse_lora_name
from agentic_lora.foundation.identity import tensor_sha256
from agentic_lora.foundation.identity import thaw_json
from agentic_lora.foundation.identity import validate_deployment_epoch
from agentic_lora.foundation.identity import validate_digest
from agentic_lora.foundation.identity import validate_prefix
from agentic_lora.foundation.identity import validate_version_id

TOKEN_CHARS = string.ascii_letters + string.digits + "._-"
tokens = st.text(alphabet=TOKEN_CHARS, min_size=1, max_size=64)
digests = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
epochs = st.integers(min_value=0, max_value=2**63 - 1)
D = "0123456789abcdef" * 4


def identity_error(exc_info: pytest.ExceptionInfo[InvalidIdentityError], field: str) -> None:
    assert exc_info.value.code == "INVALID_IDENTITY"
    assert exc_info.value.details["field"] == field


# --- version ids, prefixes, epochs, digests -----------------------------------------------------


@given(tokens)
def test_any_token_from_the_charset_is_a_valid_version_id_and_prefix(value: str) -> None:
    assert validate_version_id(value) == value
    assert validate_prefix(value) == value


@given(st.text(min_size=1, max_size=64).filter(lambda s: any(c not in TOKEN_CHARS for c in s)))
def test_a_character_outside_the_charset_is_refused(value: str) -> None:
    with pytest.raises(InvalidIdentityError) as exc_info:
        validate_version_id(value)
    identity_error(exc_info, "version_id")


@pytest.mark.parametrize(
    "value", ["", "x" * 65, "a b", "a@b", "a/b", "a:b", "ü", "v1\n", 7, None, b"v1"]
)
def test_bad_version_ids_and_prefixes_raise_typed_errors(value: object) -> None:
    with pytest.raises(InvalidIdentityError) as exc_info:
        validate_version_id(value)
    identity_error(exc_info, "version_id")
    with pytest.raises(InvalidIdentityError) as exc_info:
        validate_prefix(value)
    identity_error(exc_info, "prefix")


def test_limits_are_inclusive() -> None:
    assert validate_version_id("x" * 64) == "x" * 64
    assert validate_deployment_epoch(0) == 0
    assert validate_deployment_epoch(2**63 - 1) == 2**63 - 1


@pytest.mark.parametrize("value", [-1, 2**63, True, 1.0, "1", None])
def test_bad_epochs_are_refused(value: object) -> None:
    with pytest.raises(InvalidIdentityError) as exc_info:
        validate_deployment_epoch(value)
    identity_error(exc_info, "deployment_epoch")


@pytest.mark.parametrize("value", ["", D[:63], D + "0", D.upper(), "g" * 64, None, 64])
def test_bad_digests_are_refused(value: object) -> None:
    with pytest.raises(InvalidIdentityError) as exc_info:
        validate_digest(value)
    identity_error(exc_info, "digest")
    assert validate_digest(D) == D


def test_identity_errors_survive_pickling_and_the_wire_form() -> None:
    with pytest.raises(InvalidIdentityError) as exc_info:
        validate_version_id("no spaces")
    err = exc_info.value
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is InvalidIdentityError
    assert again.details == err.details
    wire = err.to_dict()
    rebuilt = error_from_code(wire["code"], wire["message"], **wire["details"])
    assert type(rebuilt) is InvalidIdentityError
    assert isinstance(rebuilt, AgenticLoRAError)


# --- lora names ---------------------------------------------------------------------------------


def test_lora_name_format() -> None:
    assert make_lora_name("policy_lora", 0, "v1", D) == "policy_lora@0-v1-0123456789abcdef"
    assert make_lora_name("p", 12, "step-00042", "f" * 64) == "p@12-step-00042-ffffffffffffffff"


@given(tokens, epochs, tokens, digests)
def test_parse_is_the_exact_inverse_of_make(
    prefix: str, epoch: int, version_id: str, digest: str
) -> None:
    name = make_lora_name(prefix, epoch, version_id, digest)
    parts = parse_lora_name(name)
    assert parts == LoraName(prefix, epoch, version_id, digest[:16])
    assert str(parts) == name
    assert parts.names_digest(digest)


def test_names_digest_compares_the_prefix() -> None:
    parts = parse_lora_name(make_lora_name("p", 0, "v", D))
    assert parts.names_digest(D)
    assert not parts.names_digest("f" * 64)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("bad prefix", 0, "v", D), "prefix"),
        (("p@q", 0, "v", D), "prefix"),
        (("p", -1, "v", D), "deployment_epoch"),
        (("p", 0, "v/1", D), "version_id"),
        (("p", 0, "v", D[:16]), "digest"),
    ],
)
def test_make_lora_name_validates_every_part(args: tuple[Any, ...], field: str) -> None:
    with pytest.raises(InvalidIdentityError) as exc_info:
        make_lora_name(*args)
    identity_error(exc_info, field)


@pytest.mark.parametrize(
    "name",
    [
        "policy_lora",  # no @
        "policy_lora@0-v1",  # no digest
        "policy_lora@01-v1-0123456789abcdef",  # leading zero: not the canonical epoch
        "policy_lora@0-v1-0123456789ABCDEF",  # upper-case digest
        "policy_lora@0-v1-0123456789abcde",  # 15 digest chars
        "policy_lora@0--0123456789abcdef",  # empty version id
        "@0-v1-0123456789abcdef",  # empty prefix
        "a@b@0-v1-0123456789abcdef",  # @ in prefix
        "p@9223372036854775808-v1-0123456789abcdef",  # epoch 2**63
        "p@0-v1-0123456789abcdef ",  # trailing space
        "p@-1-v1-0123456789abcdef",  # negative epoch
        42,
        None,
    ],
)
def test_parse_refuses_anything_make_cannot_produce(name: object) -> None:
    with pytest.raises(InvalidIdentityError) as exc_info:
        parse_lora_name(name)
    identity_error(exc_info, "lora_name")


def test_parse_splits_a_version_id_that_contains_dashes() -> None:
    parts = parse_lora_name("p@3-run-7-step-9-0123456789abcdef")
    assert (parts.deployment_epoch, parts.version_id) == (3, "run-7-step-9")


# --- canonical JSON -----------------------------------------------------------------------------


class Kind(enum.StrEnum):
    LORA = "LORA"


class Legacy(str, enum.Enum):  # noqa: UP042 - str() of this older kind gives "Legacy.LORA"
    LORA = "LORA"


class Level(enum.IntEnum):
    TWO = 2


def test_canonical_json_byte_form() -> None:
    value = {"b": [1.0, 2.5, -0.0, "é"], "a": None, "c": {"y": True, "x": False}}
    assert canonical_json(value) == b'{"a":null,"b":[1,2.5,0,"\xc3\xa9"],"c":{"x":false,"y":true}}'


def test_canonical_json_normalises_equal_values() -> None:
    # Tuples are arrays; str/int enums are their values; integral floats are integers.
    assert canonical_json({"k": (1, 2)}) == canonical_json({"k": [1, 2]})
    assert canonical_json([Kind.LORA, Legacy.LORA, Level.TWO]) == b'["LORA","LORA",2]'
    assert canonical_json(16.0) == canonical_json(16) == b"16"
    assert canonical_json(MappingProxyType({"a": 1})) == b'{"a":1}'
    # Beyond 2**53 a float is not an exact integer: it keeps the float form.
    assert canonical_json(1e300) == b"1e+300"
    assert canonical_json(0.1) == b"0.1"


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        {"x": float("inf")},
        [float("-inf")],
        {1: "int key"},
        {"s": {1, 2}},
        b"bytes",
        object(),
        {"x": "\ud800"},  # lone surrogate: not encodable as UTF-8
    ],
)
def test_canonical_json_refuses_non_json(value: object) -> None:
    with pytest.raises(InvalidIdentityError) as exc_info:
        canonical_json(value)
    identity_error(exc_info, "json")


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


@given(json_values, st.randoms(use_true_random=False))
def test_canonical_json_ignores_key_order_and_round_trips(value: Any, rnd: Any) -> None:
    def shuffled(v: Any) -> Any:
        if isinstance(v, dict):
            items = list(v.items())
            rnd.shuffle(items)
            return {k: shuffled(x) for k, x in items}
        if isinstance(v, list):
            return [shuffled(x) for x in v]
        return v

    encoded = canonical_json(value)
    assert canonical_json(shuffled(value)) == encoded
    assert canonical_json(json.loads(encoded)) == encoded
    assert json.loads(encoded) == thaw_json(freeze_json(value))


def test_frozen_objects_refuse_every_mutation_but_serialise_and_pickle() -> None:
    frozen = freeze_json({"a": [1, {"b": 2}], "c": "d"})
    assert frozen == {"a": (1, {"b": 2}), "c": "d"}
    assert isinstance(frozen["a"], tuple)
    mutations: list[Callable[[Any], object]] = [
        lambda d: d.__setitem__("x", 1),
        lambda d: d.__delitem__("c"),
        lambda d: d.update(x=1),
        lambda d: d.pop("c"),
        lambda d: d.popitem(),
        lambda d: d.clear(),
        lambda d: d.setdefault("x", 1),
        lambda d: d.__ior__({"x": 1}),
    ]
    for mutate in mutations:
        with pytest.raises(TypeError, match="cannot be modified"):
            mutate(frozen)
        with pytest.raises(TypeError, match="cannot be modified"):
            mutate(frozen["a"][1])
    assert frozen == {"a": (1, {"b": 2}), "c": "d"}
    assert json.loads(json.dumps(frozen)) == {"a": [1, {"b": 2}], "c": "d"}
    for clone in (pickle.loads(pickle.dumps(frozen)), copy.deepcopy(frozen), copy.copy(frozen)):
        assert clone == frozen
        with pytest.raises(TypeError):
            clone["x"] = 1
    thawed = thaw_json(frozen)
    thawed["a"][1]["b"] = 3  # a plain, independent copy
    assert frozen["a"][1]["b"] == 2


# --- manifest and digest ------------------------------------------------------------------------


CONFIG = {"peft_type": "LORA", "r": 1, "lora_alpha": 2, "target_modules": ["q_proj"]}
A = TensorRecord("m.lora_A.weight", "F32", (1, 2), b"\x00\x00\x00\x3f\x00\x00\x80\xbf")
B = TensorRecord("m.lora_B.weight", "F32", (2, 1), b"\x00\x00\x80\x3e\x00\x00\x00\x40")

# The manifest of CONFIG + (A, B), written out by hand from the definition in identity.py.
# If this stops matching, the digest definition changed: every published version, journal and
# engine-side checksum would disagree with the new code. Bump MANIFEST_FORMAT instead.
EXPECTED_CANONICAL = (
    b'{"config":{"lora_alpha":2,"peft_type":"LORA","r":1,"target_modules":["q_proj"]},'
    b'"format":"agentic-lora-manifest/1","tensors":['
    b'{"dtype":"F32","name":"m.lora_A.weight","sha256":"'
    + hashlib.sha256(A.data).hexdigest().encode()
    + b'","shape":[1,2]},'
    b'{"dtype":"F32","name":"m.lora_B.weight","sha256":"'
    + hashlib.sha256(B.data).hexdigest().encode()
    + b'","shape":[2,1]}]}'
)
GOLDEN_DIGEST = "e4f0b5ce99f7fd2bf22524fce19e4c094e85b0ab23b09d4b82bd67bc739422ad"


def test_manifest_canonical_bytes_follow_the_written_definition() -> None:
    manifest = Manifest.build(CONFIG, [B, A])  # any input order
    assert manifest.format == MANIFEST_FORMAT
    assert [e.name for e in manifest.tensors] == [A.name, B.name]
    assert manifest.canonical == EXPECTED_CANONICAL
    assert manifest.digest == hashlib.sha256(EXPECTED_CANONICAL).hexdigest()
    assert compute_digest(CONFIG, [A, B]) == manifest.digest


def test_golden_digest() -> None:
    # Pinned on purpose: the digest is stored in journals, lora names and engine-side
    # checksums, so a silent change of its definition must fail here first.
    assert compute_digest(CONFIG, [A, B]) == GOLDEN_DIGEST


@pytest.mark.parametrize(
    "change",
    [
        lambda c, a, b: (c, a._replace(name="n.lora_A.weight"), b),
        lambda c, a, b: (c, a._replace(dtype="I32"), b),
        lambda c, a, b: (c, a._replace(shape=(2, 1)), b),
        lambda c, a, b: (c, a._replace(data=a.data[:-1] + b"\xc0"), b),
        lambda c, a, b: ({**c, "lora_alpha": 3}, a, b),
        lambda c, a, b: ({**c, "extra": None}, a, b),
        lambda c, a, b: (c, a, None),
    ],
)
def test_every_manifest_field_is_part_of_the_digest(change: Any) -> None:
    config, a, b = change(CONFIG, A, B)
    changed = compute_digest(config, [t for t in (a, b) if t is not None])
    assert changed != compute_digest(CONFIG, [A, B])


def test_manifest_round_trips_through_dict_and_json() -> None:
    manifest = Manifest.build(CONFIG, [A, B])
    assert Manifest.from_dict(manifest.to_dict()) == manifest
    assert Manifest.from_json(manifest.canonical) == manifest
    assert Manifest.from_json(manifest.canonical.decode()).digest == manifest.digest
    assert manifest.entry(A.name) == ManifestEntry.of(A)
    assert manifest.entry("absent") is None
    assert ManifestEntry.of(A).sha256 == tensor_sha256(A.data)
    assert pickle.loads(pickle.dumps(manifest)) == manifest
    assert len({manifest, Manifest.from_dict(manifest.to_dict())}) == 1


def test_manifest_config_is_frozen() -> None:
    config: dict[str, Any] = {"peft_type": "LORA", "target_modules": ["q"]}
    manifest = Manifest.build(config, [A])
    config["target_modules"].append("k")  # the caller's dict is not the manifest's
    assert manifest.config["target_modules"] == ("q",)
    with pytest.raises(TypeError):
        manifest.config["r"] = 2  # type: ignore[index]


def test_duplicate_tensor_names_are_an_invalid_adapter() -> None:
    with pytest.raises(InvalidAdapterError) as exc_info:
        Manifest.build(CONFIG, [A, B, A])
    assert exc_info.value.details == {"reason": "duplicate_tensor", "tensor": A.name}
    entry = ManifestEntry.of(A)
    with pytest.raises(InvalidAdapterError):
        Manifest(CONFIG, (entry, entry))


def _good() -> dict[str, Any]:
    return Manifest.build(CONFIG, [A, B]).to_dict()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: m.update(format="agentic-lora-manifest/2"),
        lambda m: m.pop("config"),
        lambda m: m.update(extra=1),
        lambda m: m.update(config=[1]),
        lambda m: m.update(tensors={"a": 1}),
        lambda m: m["tensors"].reverse(),
        lambda m: m["tensors"][0].pop("sha256"),
        lambda m: m["tensors"][0].update(sha256="X" * 64),
        lambda m: m["tensors"][0].update(name=""),
        lambda m: m["tensors"][0].update(dtype=None),
        lambda m: m["tensors"][0].update(shape=[1, -2]),
        lambda m: m["tensors"][0].update(shape="1x2"),
        lambda m: m["tensors"][0].update(shape=[True]),
        lambda m: m["tensors"].append("not an object"),
        lambda m: m["config"].update(bad=float("nan")),
    ],
)
def test_malformed_manifests_are_refused(mutate: Any) -> None:
    raw = _good()
    mutate(raw)
    with pytest.raises(InvalidIdentityError) as exc_info:
        Manifest.from_dict(raw)
    assert exc_info.value.details["field"] in ("manifest", "json")


@pytest.mark.parametrize("text", [b"not json", b'{"format": NaN}', b"[]"])
def test_manifest_from_json_refuses_bad_text(text: bytes) -> None:
    with pytest.raises(InvalidIdentityError) as exc_info:
        Manifest.from_json(text)
    identity_error(exc_info, "manifest")


def test_manifest_entries_must_be_entries() -> None:
    with pytest.raises(InvalidIdentityError):
        Manifest(CONFIG, ({"name": "x"},))  # type: ignore[arg-type]
