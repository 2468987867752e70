"""Rule 5.2-2 on real engines: C is refused before any engine call while A is held, accepted after.

Capacity is 2 managed versions. With A retired but still bound by a Session and B the default,
publishing C is refused by the registry's reserve: the recording proxies show that not a single
request (not even a read) reached an engine, and the run goes on with B as the default. Once
the last A Session closes, the background reclaimer unloads A on both engines; the same
publication of C is then accepted, and new Sessions bind C. At no point does either engine hold
more than two managed versions.
"""

from __future__ import annotations

import pytest

from agentic_lora.errors import CapacityError
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.registry.types import VersionState
from tests.e2e.conftest import Stack
from tests.e2e.recording_proxy import Exchange
from tests.e2e.support import fresh_id
from tests.e2e.support import scored_request
from tests.e2e.support import stored_names

pytestmark = [pytest.mark.engine, pytest.mark.slow]

CAPACITY = 2


def _most_managed_versions_loaded(exchanges: list[Exchange], engine: str, prefix: str) -> int:
    """The most managed adapters ``engine`` held at once, replaying its load/unload traffic.

    A load counts from the moment the engine confirmed it, an unload from the moment it was
    sent: the count can only be over-estimated, never under-estimated.
    """
    events: list[tuple[int, int]] = []
    for e in exchanges:
        if e.engine != engine or not (e.lora or "").startswith(prefix):
            continue
        if e.path == "/load_lora_adapter" and e.status == 200 and e.seq_done is not None:
            events.append((e.seq_done, +1))
        elif e.path == "/unload_lora_adapter" and e.status == 200:
            events.append((e.seq_sent, -1))
    held = most = 0
    for _, delta in sorted(events):
        held += delta
        most = max(most, held)
    return most


@pytest.mark.asyncio
async def test_c_is_refused_before_any_engine_call_until_a_is_reclaimed(stack: Stack) -> None:
    assert (await stack.publish("A")).outcome is PublicationOutcome.PUBLISHED
    holder = await stack.open_on("E0", "holds-A")
    await holder.generate(scored_request(stack.chat.first_turn("hi"), max_new_tokens=4))
    assert (await stack.publish("B")).outcome is PublicationOutcome.PUBLISHED
    status = await stack.registry.status()
    assert (status.slots_in_use, status.capacity) == (CAPACITY, CAPACITY)

    quiet = stack.traffic.mark("publishing C while A is held")
    refused = await stack.publish("C")
    assert refused.outcome is PublicationOutcome.SKIPPED
    assert refused.reason == CapacityError.code
    assert stack.traffic.since(quiet) == []  # no engine call of any kind
    assert stack.registry.peek_version(stack.versions["C"]) is None
    status = await stack.registry.status()
    assert status.default_version == stack.versions["B"]
    assert status.slots_in_use == CAPACITY
    for engine in stack.engine_names:
        assert stored_names(stack.store_root, engine) == {
            stack.lora_name("A"),
            stack.lora_name("B"),
        }

    # The last A Session closes; the reclaimer (poked by the release) unloads A everywhere.
    await holder.close()
    await stack.watch.wait_for(
        "confirm_reclaim",
        lambda s: s.version_id == stack.versions["A"] and s.state is VersionState.RECLAIMED,
        what="A RECLAIMED",
    )
    accepted = await stack.publish("C")
    assert accepted.outcome is PublicationOutcome.PUBLISHED
    assert accepted.commit is not None
    assert accepted.commit.previous_default == stack.versions["B"]
    name_c = stack.lora_name("C")
    for engine in stack.engine_names:
        session = await stack.open_on(engine, f"new-{engine}")
        rid = fresh_id(f"new-{engine}")
        reply = await session.generate(
            scored_request(stack.chat.first_turn("and now?"), max_new_tokens=4, rid=rid)
        )
        assert reply.engine == engine
        binding = session.binding
        assert binding is not None
        assert binding.lora_name == name_c
        (sent,) = stack.traffic.select(path="/generate", rid=rid)
        assert sent.lora == name_c

    name_a = stack.lora_name("A")
    for engine in stack.engine_names:
        assert (
            len(stack.traffic.select(engine=engine, path="/unload_lora_adapter", lora=name_a)) == 1
        )
        (load_c,) = stack.traffic.select(engine=engine, path="/load_lora_adapter", lora=name_c)
        (unload_a,) = stack.traffic.select(engine=engine, path="/unload_lora_adapter", lora=name_a)
        assert unload_a.seq_done is not None
        assert load_c.seq_sent > unload_a.seq_done
        most = _most_managed_versions_loaded(stack.traffic.exchanges, engine, "policy_lora@")
        assert most == CAPACITY, engine
