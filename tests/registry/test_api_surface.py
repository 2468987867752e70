"""The registry surface: every verb declared once on ``RegistryAPI``, and the optional
capabilities (peek, change feed, in-process core, refusal feed) found only through the typed
Protocol checks of ``agentic_lora.registry.api``."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.api import change_feed
from agentic_lora.registry.api import in_process_core
from agentic_lora.registry.api import peeker
from agentic_lora.registry.api import refusal_feed
from agentic_lora.registry.core import MUTATING_VERBS
from agentic_lora.registry.core import RegistryCore
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.ray_actor import RayRegistryClient
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import VersionStatus
from agentic_lora.registry.verbs import RegistryVerbs


class Recording(RegistryAPI):
    """The smallest registry: it implements only what RegistryAPI leaves abstract."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    async def _call(self, verb: str, request_id: str, args: dict[str, Any]) -> Any:
        self.calls.append((verb, request_id, args))
        if verb.endswith("_engine"):
            return "ACTIVE"  # a membership verb answers a state (its wire form, remotely)
        return () if verb == "close_lease" else None

    async def status(self) -> RegistryStatus:
        raise NotImplementedError

    async def version(self, version_id: str) -> VersionStatus:
        raise NotImplementedError


def _arguments(method: Any) -> dict[str, Any]:
    """A value for every keyword-only parameter (the verbs' only kind) except request_id."""
    params = inspect.signature(method).parameters
    return {
        name: f"<{name}>"
        for name, p in params.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "request_id"
    }


@pytest.mark.asyncio
@pytest.mark.parametrize("verb", sorted(MUTATING_VERBS))
async def test_every_mutating_verb_of_the_core_is_one_call_of_the_same_name(verb: str) -> None:
    registry = Recording()
    method = getattr(registry, verb)
    args = _arguments(method)
    await method(request_id="rid-1", **args)
    [(called, request_id, sent)] = registry.calls
    assert (called, request_id) == (verb, "rid-1")
    # Every argument reaches the front end, under its own name (session_keys as a list).
    assert {k: (tuple(v) if isinstance(v, list) else v) for k, v in sent.items()} == {
        k: (tuple(v) if k == "session_keys" else v) for k, v in args.items()
    }
    assert callable(getattr(RegistryCore, verb))


def test_the_declared_verbs_are_exactly_the_cores_mutating_verbs() -> None:
    declared = {
        name
        for name, member in vars(RegistryAPI).items()
        if inspect.iscoroutinefunction(member) and not name.startswith("_")
    }
    assert declared - {"status", "version"} == MUTATING_VERBS


def test_the_old_name_of_the_declaration_is_the_same_class() -> None:
    assert RegistryVerbs is RegistryAPI


@pytest.mark.asyncio
async def test_an_in_process_registry_offers_peek_changes_and_its_core() -> None:
    registry = LocalRegistry(engines=["e0"], capacity=2, sweep_interval=None)
    try:
        assert peeker(registry) is registry
        assert change_feed(registry) is registry
        assert in_process_core(registry) is registry.core
        assert refusal_feed(registry) is None
    finally:
        await registry.aclose()


def test_a_ray_client_offers_peek_and_refusals_but_no_core_or_change_feed() -> None:
    client = RayRegistryClient(actor=object())
    assert peeker(client) is client
    assert refusal_feed(client) is client
    assert change_feed(client) is None
    assert in_process_core(client) is None


def test_a_registry_without_optional_capabilities_offers_none() -> None:
    registry = Recording()
    assert (peeker(registry), change_feed(registry), in_process_core(registry)) == (
        None,
        None,
        None,
    )
    assert refusal_feed(registry) is None
