"""One replay policy for every registry caller: a :class:`RegistryRetry`, passed as ``registry_retry``.

The publisher, reclaimer and repairer (``FleetOptions``), Versioning (its Sessions' closes), the
lease keeper (``open_lease``, ``close_lease`` and the wait between renewals) and the gateway's
Session table (``open_named``) all take the same value; a bad one is refused the same way
everywhere, and a passed one is the one used.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any
from typing import get_type_hints

import pytest
from tenacity import wait_exponential
from tenacity import wait_none

from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import SessionReleaseError
from agentic_lora.foundation.replay import RegistryRetry
from agentic_lora.gateway.sessions import GatewaySessions
from agentic_lora.leases import LeaseKeeper
from agentic_lora.publication.steps import FleetOptions
from agentic_lora.session import SessionPhase
from agentic_lora.session import Versioning
from tests.session_support import Harness
from tests.session_support import harness

CALLERS = [Versioning, LeaseKeeper, GatewaySessions]


@pytest.mark.parametrize("caller", CALLERS, ids=lambda c: c.__name__)
def test_every_registry_caller_takes_one_policy_and_no_loose_attempts_or_wait(
    caller: Callable[..., Any],
) -> None:
    parameters = inspect.signature(caller).parameters
    retry = parameters["registry_retry"]
    assert (retry.kind, retry.default) == (inspect.Parameter.KEYWORD_ONLY, None)
    assert [n for n in parameters if n.endswith(("_attempts", "_wait"))] == []


def test_the_publication_side_takes_the_same_policy_under_the_same_name() -> None:
    assert get_type_hints(FleetOptions)["registry_retry"] == RegistryRetry | None


# Each builds its caller as a user would, with a policy of ``attempts`` tries.
BUILDERS: dict[str, Callable[[Harness, int], object]] = {
    "Versioning": lambda h, n: Versioning(
        transport=h.transport, registry=h.inner, registry_retry=RegistryRetry(attempts=n)
    ),
    "LeaseKeeper": lambda h, n: LeaseKeeper(h.inner, registry_retry=RegistryRetry(attempts=n)),
    "GatewaySessions": lambda h, n: GatewaySessions(
        h.versioning, registry_retry=RegistryRetry(attempts=n)
    ),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("attempts", [0, -1])
@pytest.mark.parametrize("caller", sorted(BUILDERS))
async def test_every_registry_caller_refuses_no_attempts_with_one_check(
    caller: str, attempts: int
) -> None:
    # The policy refuses itself, so no caller ever holds one of no attempts (none clamps it to
    # one) and every caller's user sees the same check.
    async with harness() as h:
        with pytest.raises(ConfigurationError) as err:
            BUILDERS[caller](h, attempts)
    assert err.value.code == "CONFIG_ERROR"
    assert err.value.details["check"] == "registry_retry"


@pytest.mark.asyncio
@pytest.mark.parametrize("attempts", [1, 3])
async def test_versioning_replays_a_close_as_often_as_its_policy_says(attempts: int) -> None:
    policy = RegistryRetry(attempts=attempts, wait=wait_none())
    async with harness(registry_retry=policy, published="A") as h:
        assert h.versioning.registry_retry is policy
        session = h.versioning.open_session("s")
        await session.generate({"text": "x"})
        h.registry.fail_before["release"] = attempts
        with pytest.raises(SessionReleaseError):
            await session.close()
        assert h.registry.calls["release"] == attempts
        assert len(set(h.registry.request_ids("release"))) == 1
        assert (await session.close()) is not None  # the registry is back: the same call again
        assert h.refs("A") == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("attempts", [1, 3])
async def test_the_lease_keeper_replays_an_open_as_often_as_its_policy_says(
    attempts: int,
) -> None:
    policy = RegistryRetry(attempts=attempts, wait=wait_none())
    async with harness(lease={"owner": "w0", "registry_retry": policy}) as h:
        assert h.lease is not None
        assert h.lease.registry_retry is policy
        h.registry.fail_before["open_lease"] = attempts
        with pytest.raises(ConnectionError):
            await h.lease.acquire()
        assert h.registry.calls["open_lease"] == attempts
        assert len(set(h.registry.request_ids("open_lease"))) == 1
        await h.lease.acquire()  # nothing was bound: the next acquire opens it
        assert h.registry.calls["open_lease"] == attempts + 1


@pytest.mark.asyncio
@pytest.mark.parametrize("attempts", [1, 3])
async def test_the_gateway_replays_an_open_named_as_often_as_its_policy_says(
    attempts: int, caplog: pytest.LogCaptureFixture
) -> None:
    policy = RegistryRetry(attempts=attempts, wait=wait_none())
    async with harness() as h:
        sessions = GatewaySessions(h.versioning, registry_retry=policy)
        assert sessions.registry_retry is policy
        h.registry.fail_before["open_named"] = attempts
        with (
            caplog.at_level(logging.WARNING, logger="agentic_lora.foundation.replay"),
            pytest.raises(RequestRefusedError) as err,
        ):
            await sessions.open("agent-1")
        assert err.value.details["stage"] == "open_named"
        # Every replay is logged under the Session's tag (never its id), one record per replay.
        assert [(r.session, r.verb) for r in caplog.records] == [  # type: ignore[attr-defined]
            (sessions.tag("agent-1"), "open_named")
        ] * (attempts - 1)
        assert h.registry.calls["open_named"] == attempts
        assert len(set(h.registry.request_ids("open_named"))) == 1
        assert (await sessions.open("agent-1")).phase is SessionPhase.OPEN


@pytest.mark.asyncio
async def test_the_defaults_are_unchanged() -> None:
    async with harness(lease={"owner": "w0", "ttl": 3.0}) as h:
        # Versioning here is the harness's own (no wait); built bare, it gets its default.
        bare = Versioning(transport=h.transport, registry=h.registry)  # type: ignore[arg-type]
        defaults = [
            bare.registry_retry,
            h.lease.registry_retry,  # type: ignore[union-attr]
            GatewaySessions(h.versioning).registry_retry,
        ]
        await bare.aclose()
    assert [d.attempts for d in defaults] == [4, 4, 4]
    waits = [d.wait for d in defaults]
    assert all(isinstance(w, wait_exponential) for w in waits)
    # Up to 2 s for Sessions; the keeper's at most half a renew interval (ttl 3: 1 s, renew
    # every 1 s: 0.5 s); the gateway's up to 1 s.
    assert [(w.multiplier, w.max) for w in waits] == [(0.05, 2.0), (0.05, 0.5), (0.05, 1)]  # type: ignore[attr-defined]
