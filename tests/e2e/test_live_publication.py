"""Rules 3.4-5 and 7.2-1 on two real engines: Sessions keep their version across a live publication.

The sequence of rule 3.4-5, on E0 and on E1 at once:

1. A is the default. ``S_old`` binds A at its first generation.
2. B is published. E0 reports READY; E1 has loaded and probed B but its READY is held (an
   asyncio.Event inside :class:`~tests.e2e.support.GatedBackend`). In that window ``S_mid`` binds,
   and gets A: B is physically on both engines, but the registry has not committed it.
3. E1's READY is released, B is committed. ``S_new`` binds B.
4. After the commit, concurrently: ``S_old`` takes a tool turn, ``S_mid`` takes a tool turn,
   ``S_new`` takes a tool turn. Then ``S_old`` takes a turn that the engine edge refuses (HTTP
   429 from the recording proxy; the engine never sees it) and the caller retries it; then a long
   turn that is aborted mid-decode and resumed from its partial output.

Every generation is scored (``logprob_start_len=0``: every prompt and output token's logprob)
and compared with a baseline: the same full prefix, the same greedy sampling, sent straight to
the same engine under a separately loaded copy of the fixture adapter it should have used (its
own lora id, loaded from the fixture directory, not the middleware's store). The A-baseline and
the B-baseline of every prefix differ, so equality with one of them identifies the version.

Tolerance. A generation that ran alone on its engine matches its baseline exactly (0): the CPU
path is deterministic for a fixed batch. A generation that shared decode batches with other
Sessions' generations (the concurrent tool turns, where A and B requests are batched together)
matches its output tokens exactly and its logprobs within ``BATCHED_TOLERANCE``: the batch shape
changes the float summation order of a decode step (measured: at most 6e-5 on one token). The
A-baseline and the B-baseline of every prefix are at least ``SEPARATION`` apart, far beyond
both, so equality with one of them identifies the version.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import pytest

from agentic_lora.errors import RequestRefusedError
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.registry.types import VersionState
from agentic_lora.session import Session
from tests.e2e.conftest import Stack
from tests.e2e.recording_proxy import Rule
from tests.e2e.support import Scored
from tests.e2e.support import baseline_adapter
from tests.e2e.support import fresh_id
from tests.e2e.support import replay
from tests.e2e.support import rid_is
from tests.e2e.support import scored
from tests.e2e.support import scored_request

pytestmark = [pytest.mark.engine, pytest.mark.slow]

logger = logging.getLogger(__name__)

TOKENS_PER_TURN = 8
#: Largest allowed |logprob - baseline| for a generation that was batched with others.
BATCHED_TOLERANCE = 1e-3
#: Smallest allowed max |logprob(A) - logprob(B)| over a prefix: the versions are told apart.
SEPARATION = 0.1
#: Far more than the test lets it produce (prompt + this stays inside the model's 4096 context):
#: the long turn ends by abort, never by length.
LONG_TURN_TOKENS = 3000


@dataclass
class Turn:
    """One generation of one Session, and what its baseline must reproduce."""

    label: str
    engine: str
    expected: str  # the fixture adapter ("A" or "B") this Session must have used
    rid: str
    baseline_request: dict[str, Any]
    result: Scored
    batched: bool = False  # ran concurrently with other Sessions' generations on its engine


class Episode:
    """Runs the Sessions' turns and keeps every one for the baseline comparison."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.turns: list[Turn] = []
        #: The latest turn of each Session, by ``<role>-<engine>``.
        self.last: dict[str, Turn] = {}

    async def turn(
        self,
        session: Session,
        engine: str,
        label: str,
        expected: str,
        input_ids: list[int],
        *,
        batched: bool = False,
    ) -> Turn:
        rid = fresh_id(label)
        request = scored_request(input_ids, max_new_tokens=TOKENS_PER_TURN, rid=rid)
        reply = await session.generate(request)
        assert reply.engine == engine, f"{label} was routed to {reply.engine}"
        turn = Turn(label, engine, expected, rid, request, scored(reply.body), batched)
        self.turns.append(turn)
        return turn

    async def first_turns(self, role: str, expected: str, question: str) -> dict[str, Session]:
        """One Session per engine, opened and given its first turn; each must bind ``expected``.

        ``question`` names its engine as ``{engine}``.
        """
        sessions: dict[str, Session] = {}
        for engine in self.stack.engine_names:
            session = sessions[engine] = await self.stack.open_on(engine, f"s-{role}-{engine}")
            prompt = self.stack.chat.first_turn(question.format(engine=engine))
            self.last[f"{role}-{engine}"] = await self.turn(
                session, engine, f"{role}-1-{engine}", expected, prompt
            )
            assert session.binding is not None
            assert session.binding.version_id == self.stack.versions[expected]
        return sessions

    def next_prefix(self, turn: Turn, observation: str) -> list[int]:
        prompt = list(turn.baseline_request["input_ids"])
        return self.stack.chat.tool_turn(prompt, turn.result.output_ids, observation)


async def _abort_and_resume(
    episode: Episode, session: Session, engine: str, prefix: list[int]
) -> None:
    """S_old's long turn: aborted once the engine is decoding it, then resumed."""
    stack = episode.stack
    rid = fresh_id(f"old-long-{engine}")
    request = scored_request(prefix, max_new_tokens=LONG_TURN_TOKENS, rid=rid, ignore_eos=True)
    since = stack.logs[engine].offset()
    long_turn = asyncio.create_task(session.generate(request))
    # Nothing else runs on this engine now: a decode line written after the request went out
    # is this request decoding.
    decoding = asyncio.create_task(
        stack.logs[engine].wait_for_line("Decode batch", since=since, what=f"{engine} decoding")
    )
    await asyncio.wait({decoding, long_turn}, return_when=asyncio.FIRST_COMPLETED)
    if long_turn.done():
        decoding.cancel()
        raise AssertionError(f"the long turn ended before it was aborted: {long_turn.result()}")
    await decoding
    assert await session.abort(rid) is True
    reply = await long_turn
    assert reply.aborted
    partial = scored(reply.body)
    assert 0 < len(partial.output_ids) < LONG_TURN_TOKENS
    # The baseline of an aborted turn: the same prefix, greedy, exactly as many tokens.
    baseline_request = scored_request(
        prefix, max_new_tokens=len(partial.output_ids), ignore_eos=True
    )
    episode.turns.append(Turn(f"old-aborted-{engine}", engine, "A", rid, baseline_request, partial))
    # Resume: the partial answer becomes part of the prefix; same Session, same version.
    await episode.turn(session, engine, f"old-resume-{engine}", "A", [*prefix, *partial.output_ids])


@pytest.mark.asyncio
async def test_sessions_keep_their_version_across_a_live_publication(stack: Stack) -> None:
    engines = stack.engine_names
    assert engines == ["E0", "E1"]
    episode = Episode(stack)

    first = await stack.publish("A")
    assert first.outcome is PublicationOutcome.PUBLISHED
    last = episode.last

    # 1. S_old binds A.
    old = await episode.first_turns(
        "old", "A", "check the weather in city {engine} with the weather tool"
    )

    # 2. B is being published: E0 READY, E1's READY held.
    e1_ready = asyncio.Event()
    stack.backend.ready_gates["E1"] = e1_ready
    b = stack.version_id("B")
    publishing = asyncio.create_task(stack.publish("B"))
    await stack.watch.wait_for(
        "record_ready",
        lambda s: s.version_id == b and s.ready_engines == ("E0",),
        what="E0 READY for B",
    )
    await stack.backend.held.wait_for(
        lambda h: h.op == "prepare" and h.engine == "E1", what="E1's READY for B held"
    )
    b_loading = stack.status("B")
    assert b_loading.state is VersionState.LOADING
    assert b_loading.ready_engines == ("E0",)
    assert (await stack.registry.status()).default_version == stack.versions["A"]
    name_a, name_b = stack.lora_name("A"), stack.lora_name("B")
    for engine in engines:
        listed = await stack.raw.get(f"{stack.engine_url(engine)}/v1/models")
        assert name_b in {card["id"] for card in listed.json()["data"]}, engine
    mid = await episode.first_turns(
        "mid", "A", "look up the answer for session {engine} and then compute a sum"
    )
    assert not publishing.done()

    # 3. E1 READY -> commit -> B is the default; S_new binds B.
    e1_ready.set()
    second = await publishing
    assert second.outcome is PublicationOutcome.PUBLISHED
    assert second.commit is not None
    assert second.commit.previous_default == stack.versions["A"]
    assert stack.status("A").state is VersionState.RETIRED
    assert stack.status("A").session_refs == 4
    new = await episode.first_turns("new", "B", "what is the weather in city {engine} now")

    # 4a. Tool turns of all three Sessions on both engines at once (A and B share batches).
    tool_turns = []
    for engine in engines:
        for role, sessions, letter in (("old", old, "A"), ("mid", mid, "A"), ("new", new, "B")):
            key = f"{role}-{engine}"
            prefix = episode.next_prefix(last[key], f'{{"temperature": 21, "city": "{engine}"}}')
            tool_turns.append((key, sessions[engine], engine, f"{role}-2-{engine}", letter, prefix))
    results = await asyncio.gather(
        *(
            episode.turn(s, engine, label, letter, prefix, batched=True)
            for _, s, engine, label, letter, prefix in tool_turns
        )
    )
    for (key, *_), turn in zip(tool_turns, results, strict=True):
        last[key] = turn

    # 4b. S_old: a refused turn and the caller's retry; 4c. an abort and a resume.
    for engine in engines:
        prefix = episode.next_prefix(last[f"old-{engine}"], '{"sum": 42}')
        refused_rid = fresh_id(f"old-refused-{engine}")
        stack.proxies[engine].add_rule(
            Rule(
                f"refuse {refused_rid}",
                rid_is(refused_rid),
                answer=(429, {"error": {"message": "engine busy (scripted at the edge)"}}),
            )
        )
        with pytest.raises(RequestRefusedError) as refused:
            await old[engine].generate(
                scored_request(prefix, max_new_tokens=TOKENS_PER_TURN, rid=refused_rid)
            )
        assert refused.value.details["status"] == 429
        (attempt,) = stack.traffic.select(rid=refused_rid)
        assert attempt.forwarded is False
        assert attempt.lora == name_a
        retry = await episode.turn(old[engine], engine, f"old-retry-{engine}", "A", prefix)
        resume_prefix = episode.next_prefix(retry, '{"done": "yes"}')
        await _abort_and_resume(episode, old[engine], engine, resume_prefix)

    # Every generation of every Session reached its engine once, naming its Session's version.
    names = {"A": name_a, "B": name_b}
    for turn in episode.turns:
        (sent,) = stack.traffic.select(path="/generate", rid=turn.rid)
        assert (sent.engine, sent.lora, sent.forwarded) == (turn.engine, names[turn.expected], True)
    for engine in engines:
        for role, sessions, letter in (("old", old, "A"), ("mid", mid, "A"), ("new", new, "B")):
            binding = sessions[engine].binding
            assert binding is not None, role
            assert binding.lora_name == names[letter], role

    # The baselines: every full prefix, straight to the same engine, under A-only and B-only.
    baselines: dict[tuple[str, str], Scored] = {}
    for engine in engines:
        url = stack.engine_url(engine)
        for letter in ("A", "B"):
            adapter_dir = stack.fleet.fixture.adapter(letter)
            async with baseline_adapter(stack.raw, url, adapter_dir, letter) as baseline:
                for turn in episode.turns:
                    if turn.engine == engine:
                        baselines[turn.label, letter] = await replay(
                            stack.raw, url, baseline, turn.baseline_request
                        )
    mismatches = []
    for turn in episode.turns:
        other = "B" if turn.expected == "A" else "A"
        expected, wrong = baselines[turn.label, turn.expected], baselines[turn.label, other]
        # The comparison can tell the versions apart on this very prefix...
        assert _deviation(expected.logprobs, wrong.logprobs) > SEPARATION, turn.label
        # ...and the Session reproduces its own version's baseline.
        tolerance = BATCHED_TOLERANCE if turn.batched else 0.0
        if (
            turn.result.output_ids != expected.output_ids
            or _deviation(turn.result.logprobs, expected.logprobs) > tolerance
        ):
            mismatches.append(turn.label)
    measured = {
        "turns": len(episode.turns),
        "max_alone_deviation": max(
            _deviation(t.result.logprobs, baselines[t.label, t.expected].logprobs)
            for t in episode.turns
            if not t.batched
        ),
        "max_batched_deviation": max(
            _deviation(t.result.logprobs, baselines[t.label, t.expected].logprobs)
            for t in episode.turns
            if t.batched
        ),
        "min_separation": min(
            _deviation(baselines[t.label, "A"].logprobs, baselines[t.label, "B"].logprobs)
            for t in episode.turns
        ),
    }
    logger.info("session logprobs against baselines: %s", measured, extra={"measured": measured})
    assert mismatches == []
    assert len(episode.turns) == 2 * 9
    assert {t.engine for t in episode.turns} == {"E0", "E1"}


def _deviation(left: tuple[float, ...], right: tuple[float, ...]) -> float:
    """Largest per-token difference of two logprob sequences (inf if their lengths differ)."""
    if len(left) != len(right):
        return float("inf")
    return max(abs(a - b) for a, b in zip(left, right, strict=True))
