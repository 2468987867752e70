"""Policy mixing: in-place swap, drain before swap, and versioned pinning, on two real SGLang engines.

Multi-turn agents run on two harness SGLang engines while a trainer publishes a new adapter
version every ``--cadence`` seconds of training. Three strategies take turns on the same engines
(segments in ABBA order, ``--repeats`` rounds; every strategy of a round replays the same seeded
trajectories), and for each the run measures how many trajectories mixed versions, how long the
trainer waited for a publication, when new trajectories saw the new version, the rollout
throughput and the longest interval in which no turn completed anywhere.

Strategies (every turn is an SGLang ``/generate`` of ``--tokens`` greedy tokens):

* ``inplace``: what a trainer does when it keeps one fixed ``lora_name`` (``policy``) and swaps
  its weights: it writes the version's directory, repoints the one fixed adapter path at it
  (an atomic symlink rename), then on every engine at once ``/unload_lora_adapter`` and
  ``/load_lora_adapter`` under the same name. Requests keep naming ``policy``. SGLang 0.5.23's
  unload unregisters the name, waits for the requests running on it, then unloads; a request
  that names it meanwhile silently reloads it from the path the name was last loaded from
  (``TokenizerManager.lora_ref_cache``), so the trainer's own load can find it "already
  loaded". With the fixed path that reload reads the new weights, and the trainer counts it
  (``engine_reloaded``) instead of failing. ``--inplace-source version-dir`` loads each version
  from its own directory instead: then the silent reload brings back the old weights and the
  trainer retries unload+load (``--swap-retries``).
* ``drain``: the same swap, but no new trajectory starts once a publication is called; the
  swap runs when the trajectories in flight have ended ("pause the fleet"); then new ones start.
* ``pinned``: agentic-lora: one :class:`~agentic_lora.assembly.deployment.Deployment`, the
  trainer calls ``publish`` (two-phase, HTTP push), every trajectory is a Session that binds at
  its first generation; retired versions are reclaimed in the background. Version slots are
  sized as an operator would (:func:`mixing_analysis.operator_capacity` over the workload's
  p99 trajectory duration) unless ``--capacity`` says otherwise.

Version attribution (written down in docs/benchmarks.md): every prompt starts with a fixed
prefix, and every request asks for the input-token logprobs (``logprob_start_len=0``, which
also keeps the prefix cache out of the way). A causal LM's logprob of a prefix token depends on
the prefix and the weights only, so the prefix's logprobs identify the adapter a turn ran on,
against references taken on idle engines (every version's content is distinct). The swap
timeline (in-place and drain) and the Session's binding (pinned) give a second attribution;
the two are cross-checked.

Prints a table and writes ``bench/out/policy_mixing.json`` and ``bench/out/policy_mixing.png``.

Usage: python bench/policy_mixing.py [--smoke] [--repeats 3] [--agents 16] [--window 48]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import tempfile
import time
import uuid
import zlib
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import httpx
from common import OUT_DIR
from common import direct_client
from common import engine_log_dir
from common import fleet_settings
from common import interleaved_order
from common import machine
from common import max_gap
from common import print_table
from common import summarize
from common import write_result
from mixing_analysis import AT_RISK
from mixing_analysis import Publication
from mixing_analysis import SwapWindow
from mixing_analysis import Turn
from mixing_analysis import WorkloadSpec
from mixing_analysis import count_mixing
from mixing_analysis import duration_quantile
from mixing_analysis import first_completion_on
from mixing_analysis import identify
from mixing_analysis import operator_capacity
from mixing_analysis import plan_trajectory
from mixing_analysis import throughput
from mixing_analysis import timeline_version
from mixing_analysis import version_lags

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.assembly.deployment import Deployment

__all__ = ["main"]

STRATEGIES = ("inplace", "drain", "pinned")
FIXED_NAME = "policy"
# The fixed prompt prefix; "<|im_start|>" is a special token, so the prefix tokenizes alike in
# the reference probe and in every turn's prompt.
PROBE = "the agent reads the tool result and answers the question<|im_start|>"
GOALS = {"throughput_ratio": 0.97, "barrier_ratio": 0.1}


# --- adapter contents and references -----------------------------------------------------------


def derive_contents(
    base: AdapterSnapshot, count: int, seed: int, scale: float
) -> list[AdapterSnapshot]:
    """``count`` distinct adapters: ``base`` with seeded noise of std ``scale`` added to lora_B
    (a stand-in for ``count`` training steps; distinct so that each one can be recognised)."""
    import torch

    state = base.to_torch_state_dict()
    out = []
    for k in range(count):
        g = torch.Generator().manual_seed(seed * 1000 + k)
        new = {
            n: t + (scale * torch.randn(t.shape, generator=g)).to(t.dtype) if "lora_B" in n else t
            for n, t in state.items()
        }
        out.append(AdapterSnapshot.from_state_dict(new, base.config))
    return out


def _fingerprint(body: Any, length: int | None) -> tuple[float, ...] | None:
    try:
        logprobs = body["meta_info"]["input_token_logprobs"]
    except (KeyError, TypeError):
        return None
    values = [float(x[0]) for x in logprobs[1:] if x and x[0] is not None]
    return tuple(values[:length] if length is not None else values)


async def _lora_call(
    client: httpx.AsyncClient, url: str, route: str, payload: dict[str, Any]
) -> tuple[bool, str]:
    r = await client.post(f"{url}/{route}", json=payload)
    try:
        body = r.json()
    except ValueError:
        return False, r.text[:300]
    return bool(body.get("success")) and r.status_code == 200, str(body.get("error_message", ""))


async def _probe(client: httpx.AsyncClient, url: str, lora: str) -> tuple[float, ...]:
    r = await client.post(f"{url}/generate", json=_body(PROBE, lora, tokens=1))
    r.raise_for_status()
    fp = _fingerprint(r.json(), None)
    if not fp:
        raise RuntimeError("the engine returned no input logprobs")
    return fp


async def take_references(
    client: httpx.AsyncClient, engines: Sequence[tuple[str, str]], dirs: Sequence[Path]
) -> tuple[dict[int, tuple[float, ...]], dict[str, Any]]:
    """Fingerprint every content on every idle engine under a name of its own; the first
    engine's are the references, the others must agree with them."""
    refs: dict[str, dict[int, tuple[float, ...]]] = {}
    for name, url in engines:
        refs[name] = {}
        for k, d in enumerate(dirs):
            ok, err = await _lora_call(
                client, url, "load_lora_adapter", {"lora_name": f"ref-{k}", "lora_path": str(d)}
            )
            if not ok:
                raise RuntimeError(f"reference load on {name}: {err}")
            refs[name][k] = await _probe(client, url, f"ref-{k}")
            ok, err = await _lora_call(
                client, url, "unload_lora_adapter", {"lora_name": f"ref-{k}"}
            )
            if not ok:
                raise RuntimeError(f"reference unload on {name}: {err}")
    first = refs[engines[0][0]]
    check = {
        "prefix_tokens": len(first[0]),
        "engines_agree": all(identify(refs[n][k], first) == k for n, _ in engines for k in first),
        "min_pairwise_distance": min(
            (sum(abs(a - b) for a, b in zip(first[i], first[j], strict=True)) / len(first[i]))
            for i in first
            for j in first
            if i < j
        ),
    }
    if not check["engines_agree"] or any(identify(first[k], first) != k for k in first):
        raise RuntimeError(f"version fingerprints are not distinct or not reproducible: {check}")
    return first, check


def _body(prompt: str, lora: str | None, *, tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if lora is not None:
        body["lora_path"] = lora
    return body


async def adapter_batch_probe(
    client: httpx.AsyncClient,
    engines: Sequence[tuple[str, str]],
    dirs: Sequence[Path],
    seconds: float,
) -> dict[str, Any]:
    """What the engines' LoRA backend charges for a batch whose requests use several adapters.

    8 closed-loop request streams per engine (no think time), every request the same length,
    for ``seconds`` per block; blocks alternate between all streams on one adapter and the
    streams spread over four (ABBA, three rounds each). Turns per second per variant.
    """
    names = [f"mix-{k}" for k in range(4)]
    for _, url in engines:
        for k, name in enumerate(names):
            ok, err = await _lora_call(
                client, url, "load_lora_adapter", {"lora_name": name, "lora_path": str(dirs[k])}
            )
            if not ok:
                raise RuntimeError(f"batch probe load: {err}")
    prompt = PROBE + "<|im_start|>user\n" + " ".join(["tool result value"] * 20) + "<|im_end|>\n"
    rates: dict[str, list[float]] = {"1 adapter": [], "4 adapters": []}

    async def stream(url: str, lora: str, stop: float, done: list[int]) -> None:
        while time.perf_counter() < stop:
            r = await client.post(f"{url}/generate", json=_body(prompt, lora, tokens=16))
            r.raise_for_status()
            done[0] += 1

    try:
        for variant in interleaved_order(list(rates), 3):
            spread = 4 if variant == "4 adapters" else 1
            done = [0]
            start = time.perf_counter()
            await asyncio.gather(
                *(
                    stream(url, names[i % spread], start + seconds, done)
                    for _, url in engines
                    for i in range(8)
                )
            )
            rates[variant].append(done[0] / (time.perf_counter() - start))
    finally:
        for _, url in engines:
            for name in names:
                await _lora_call(client, url, "unload_lora_adapter", {"lora_name": name})
    one, four = (_median(v) for v in rates.values())
    return {
        "turns_per_s": rates,
        "summary": {"1 adapter": one, "4 adapters": four, "ratio": four / one},
    }


# --- the segment's moving parts ----------------------------------------------------------------


class Admission:
    """Who may start a trajectory: always (in-place, pinned), or not while a drain runs."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = 0

    async def enter(self) -> None:
        await self._open.wait()
        # No await between the check and the count: a drain that closes now sees this one.
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def drained(self) -> None:
        """Close admission and wait until no trajectory is in flight (call :meth:`reopen`)."""
        self._open.clear()
        await self._idle.wait()

    def reopen(self) -> None:
        self._open.set()


@dataclass
class Segment:
    """One strategy's run on its own clock (``t0``: agents start)."""

    strategy: str
    repeat: int
    t0: float = 0.0
    turns: list[Turn] = field(default_factory=list)
    windows: list[SwapWindow] = field(default_factory=list)
    publications: list[Publication] = field(default_factory=list)
    trajectories: list[str] = field(default_factory=list)
    version_of: dict[str, int] = field(default_factory=dict)  # lora name -> version (pinned)
    trainer: dict[str, int] = field(default_factory=lambda: {"engine_reloaded": 0, "retries": 0})
    errors: list[str] = field(default_factory=list)
    max_slots: int | None = None  # pinned: most version slots in use at once (sampled)
    cpu: dict[str, float] = field(default_factory=dict)  # cores used by this run / by others

    def now(self) -> float:
        return time.perf_counter() - self.t0


@dataclass(frozen=True)
class Params:
    agents: int
    spec: WorkloadSpec
    seed: int
    tokens: int
    cadence: float
    warmup: float
    window: float
    inplace_source: str
    swap_retries: int


class InPlaceSwap:
    """The trainer's side of the fixed-name swap (in-place and drain)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        engines: Sequence[tuple[str, str]],
        root: Path,
        params: Params,
    ) -> None:
        self.client = client
        self.engines = engines
        self.root = root
        self.link = root / "policy-adapter"
        self.params = params
        self.loaded = False

    async def swap(self, seg: Segment, version: int, snapshot: AdapterSnapshot) -> tuple[bool, str]:
        """Write the version, then unload+load the fixed name on every engine at once."""
        target = self.root / f"{seg.strategy}{seg.repeat}-v{version}-{uuid.uuid4().hex[:6]}"
        await asyncio.to_thread(snapshot.write_peft_dir, target)
        tmp = self.root / f".link-{uuid.uuid4().hex[:6]}"
        os.symlink(target, tmp)
        os.replace(tmp, self.link)  # atomic: any (re)load from now on reads this version
        path = str(self.link) if self.params.inplace_source == "link" else str(target)
        results = await asyncio.gather(
            *(self._swap_one(seg, e, u, version, path) for e, u in self.engines)
        )
        self.loaded = True
        bad = [msg for ok, msg in results if not ok]
        return not bad, "; ".join(bad)

    async def _swap_one(
        self, seg: Segment, engine: str, url: str, version: int, path: str
    ) -> tuple[bool, str]:
        start = seg.now()
        try:
            for _attempt in range(self.params.swap_retries + 1):
                if self.loaded:
                    ok, err = await _lora_call(
                        self.client, url, "unload_lora_adapter", {"lora_name": FIXED_NAME}
                    )
                    if not ok:
                        return False, f"{engine} unload: {err}"
                ok, err = await _lora_call(
                    self.client,
                    url,
                    "load_lora_adapter",
                    {"lora_name": FIXED_NAME, "lora_path": path},
                )
                if ok:
                    return True, ""
                if "already loaded" not in err:
                    return False, f"{engine} load: {err}"
                # A request's silent reload got the name back first, from the cached path.
                seg.trainer["engine_reloaded"] += 1
                if self.params.inplace_source == "link":
                    return True, ""  # it read the fixed path: the new version is what it loaded
                seg.trainer["retries"] += 1
            return (
                False,
                f"{engine}: still 'already loaded' after {self.params.swap_retries} retries",
            )
        finally:
            seg.windows.append(SwapWindow(engine, version, start, seg.now()))


@dataclass
class Context:
    params: Params
    client: httpx.AsyncClient
    engines: Sequence[tuple[str, str]]
    deployment: Deployment
    contents: Sequence[AdapterSnapshot]
    refs: dict[int, tuple[float, ...]]
    swapper: InPlaceSwap
    tag: str
    groups: Sequence[int] = ()  # process groups of this run and its engines (CPU accounting)


async def run_turns(
    ctx: Context,
    seg: Segment,
    agent: int,
    traj: str,
    plan: Any,
    send: Callable[[dict[str, Any]], Awaitable[tuple[str, Any, int | None]]],
) -> None:
    """One trajectory: its turns in order, a tool wait between them; a failed turn ends it."""
    history = f"<|im_start|>user\n{plan.task}<|im_end|>\n<|im_start|>assistant\n"
    n = len(next(iter(ctx.refs.values())))
    for i in range(plan.turns):
        start = seg.now()
        try:
            engine, body, named = await send(_body(PROBE + history, None, tokens=ctx.params.tokens))
            ok = True
        except Exception as exc:
            engine, body, named, ok = "?", None, None, False
            seg.errors.append(f"{traj} turn {i}: {type(exc).__name__}: {exc}"[:300])
        seg.turns.append(
            Turn(
                traj,
                agent,
                i,
                engine,
                start,
                seg.now(),
                ok,
                _fingerprint(body, n) if ok else None,
                named,
            )
        )
        if not ok:
            return
        if i < plan.turns - 1:
            history += f"{body.get('text', '')}<|im_end|>\n<|im_start|>user\n<tool_response>{plan.tool_outputs[i]}</tool_response><|im_end|>\n<|im_start|>assistant\n"
            await asyncio.sleep(plan.waits[i])


async def agent_loop(
    ctx: Context, seg: Segment, agent: int, admission: Admission, end: float
) -> None:
    p = ctx.params
    index = 0
    while True:
        await admission.enter()
        try:
            if seg.now() >= end:
                return
            plan = plan_trajectory(p.spec, seed=p.seed, repeat=seg.repeat, agent=agent, index=index)
            traj = f"{seg.strategy}{seg.repeat}-a{agent}-t{index}"
            seg.trajectories.append(traj)
            if seg.strategy == "pinned":
                async with ctx.deployment.session(traj) as session:

                    async def send(
                        body: dict[str, Any], s: Any = session
                    ) -> tuple[str, Any, int | None]:
                        reply = await s.generate(body)
                        return reply.engine, reply.body, seg.version_of.get(s.binding.lora_name)

                    await run_turns(ctx, seg, agent, traj, plan, send)
            else:
                name, url = ctx.engines[zlib.crc32(traj.encode()) % len(ctx.engines)]

                async def send(
                    body: dict[str, Any], name: str = name, url: str = url
                ) -> tuple[str, Any, int | None]:
                    body["lora_path"] = FIXED_NAME
                    r = await ctx.client.post(f"{url}/generate", json=body)
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                    return name, r.json(), None

                await run_turns(ctx, seg, agent, traj, plan, send)
        finally:
            admission.leave()
        index += 1


async def bootstrap(ctx: Context, seg: Segment) -> None:
    """Version 0 live and nothing else in use, before the agents start."""
    if seg.strategy == "pinned":
        vid = f"{seg.strategy}{seg.repeat}-v0-{ctx.tag}"
        result = await ctx.deployment.publish(vid, ctx.contents[0])
        if not result.ok or result.lora_name is None:
            raise RuntimeError(f"bootstrap publication failed: {result.outcome} {result.reason}")
        seg.version_of[result.lora_name] = 0
        deadline = time.perf_counter() + 120
        while (await ctx.deployment.status()).slots_in_use > 1:
            if time.perf_counter() > deadline:
                raise RuntimeError("the previous segment's versions were not reclaimed")
            await asyncio.sleep(0.1)
    else:
        ok, err = await ctx.swapper.swap(seg, 0, ctx.contents[0])
        seg.windows.clear()
        if not ok:
            raise RuntimeError(f"bootstrap swap failed: {err}")


async def trainer(ctx: Context, seg: Segment, admission: Admission, end: float) -> None:
    """Train ``cadence`` seconds, publish (and wait for it), again, until the window ends."""
    await asyncio.sleep(max(0.0, ctx.params.warmup - seg.now()))
    version = 0
    while True:
        await asyncio.sleep(ctx.params.cadence)
        if seg.now() >= end:
            return
        version += 1
        snapshot = ctx.contents[version]
        called = seg.now()
        if seg.strategy == "pinned":
            vid = f"{seg.strategy}{seg.repeat}-v{version}-{ctx.tag}"
            result = await ctx.deployment.publish(vid, snapshot)
            if result.lora_name is not None:
                seg.version_of[result.lora_name] = version
            ok, detail = result.ok, f"{result.outcome.value} {result.reason or ''}".strip()
        elif seg.strategy == "drain":
            await admission.drained()
            try:
                ok, detail = await ctx.swapper.swap(seg, version, snapshot)
            finally:
                admission.reopen()
        else:
            ok, detail = await ctx.swapper.swap(seg, version, snapshot)
        seg.publications.append(Publication(version, called, seg.now(), ok, detail))
        if not ok:
            version -= 1  # the engines still serve the previous version; retry this one next


def cpu_seconds(groups: Sequence[int]) -> tuple[float, float]:
    """(CPU seconds the machine has been busy, of which the processes in ``groups``: this run's
    process group and the engines'), from /proc. Their difference over a segment is what other
    work on the shared machine took from it."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
    ours = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[2]) in groups:  # pgrp
            ours += int(stat[11]) + int(stat[12])  # utime + stime
    return busy / tick, ours / tick


async def run_segment(ctx: Context, strategy: str, repeat: int) -> Segment:
    seg = Segment(strategy, repeat)
    seg.t0 = time.perf_counter()
    await bootstrap(ctx, seg)
    seg.t0 = time.perf_counter()
    busy0, ours0 = cpu_seconds(ctx.groups)
    end = ctx.params.warmup + ctx.params.window
    admission = Admission()
    agents = [
        asyncio.create_task(agent_loop(ctx, seg, a, admission, end))
        for a in range(ctx.params.agents)
    ]
    train = asyncio.create_task(trainer(ctx, seg, admission, end))
    sampler = asyncio.create_task(sample_slots(ctx, seg)) if strategy == "pinned" else None
    try:
        await asyncio.gather(train, *agents)
    finally:
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
    busy1, ours1 = cpu_seconds(ctx.groups)
    wall = seg.now()
    seg.cpu = {
        "wall_s": wall,
        "ours_cores": (ours1 - ours0) / wall,
        "foreign_cores": ((busy1 - busy0) - (ours1 - ours0)) / wall,
    }
    return seg


async def sample_slots(ctx: Context, seg: Segment) -> None:
    """The most version slots in use at once (pinned), sampled every 0.25 s."""
    while True:
        used = (await ctx.deployment.status()).slots_in_use
        seg.max_slots = max(seg.max_slots or 0, used)
        await asyncio.sleep(0.25)


# --- analysis ----------------------------------------------------------------------------------


def analyse(
    seg: Segment, refs: dict[int, tuple[float, ...]], start: float, end: float
) -> dict[str, Any]:
    """One segment's figures; throughput and the gap over the measured window ``[start, end]``."""
    ok = [t for t in seg.turns if t.ok]
    by_fp = {id(t): identify(t.fingerprint, refs) for t in ok}
    if seg.strategy == "pinned":
        by_tl: dict[int, int | None] = {id(t): t.named_version for t in ok}
    else:
        by_tl = {}
        for t in ok:
            v = timeline_version(t, seg.windows)
            by_tl[id(t)] = None if v == AT_RISK else int(v)

    def per_trajectory(source: dict[int, int | None]) -> dict[str, list[int | None]]:
        out: dict[str, list[int | None]] = {traj: [] for traj in seg.trajectories}
        for t in ok:
            out[t.trajectory].append(source[id(t)])
        return out

    fp_mix, tl_mix = count_mixing(per_trajectory(by_fp)), count_mixing(per_trajectory(by_tl))
    disagree = sum(
        1
        for t in ok
        if by_fp[id(t)] is not None and by_tl[id(t)] is not None and by_fp[id(t)] != by_tl[id(t)]
    )
    pubs = [p for p in seg.publications if p.ok]
    done = [(t.finished, by_fp[id(t)]) for t in ok]
    first = [first_completion_on(done, p.version, p.called) for p in pubs]
    lags = version_lags([(t.dispatched, by_fp[id(t)]) for t in ok], seg.publications)
    finished = [t.finished for t in ok]
    pub_s = summarize(p.seconds for p in seg.publications)
    first_call = seg.publications[0].called if seg.publications else end
    return {
        "strategy": seg.strategy,
        "repeat": seg.repeat,
        "trajectories": len(seg.trajectories),
        "turns": len(seg.turns),
        "failed_turns": len(seg.turns) - len(ok),
        "unidentified_turns": sum(1 for t in ok if by_fp[id(t)] is None),
        "mixed": fp_mix.mixed,
        "mixed_fraction": fp_mix.mixed_fraction,
        "at_risk": fp_mix.at_risk,
        "timeline": {
            "mixed": tl_mix.mixed,
            "at_risk": tl_mix.at_risk,
            "clean": tl_mix.clean,
            "at_risk_turns": sum(1 for t in ok if by_tl[id(t)] is None),
            "mixed_or_at_risk_fraction": tl_mix.mixed_or_at_risk_fraction,
        },
        "attribution_disagreements": disagree,
        "publications": len(seg.publications),
        "publications_ok": len(pubs),
        "publication_s": {"mean": pub_s.mean, "p50": pub_s.p50, "max": pub_s.maximum},
        "first_new_turn_s": summarize(x for x in first if not math.isnan(x)).p50,
        "first_new_turn_all_s": first,
        "throughput_turns_s": throughput(finished, start, end),
        # Until the first publication is called the strategies differ only in the client path
        # (drain and in-place not at all): the spread of this between them is the machine's noise.
        "throughput_before_publication": throughput(finished, 0.0, first_call),
        # Turns per CPU-second this run's processes (client and engines) got: on a shared machine
        # the CPU share moves throughput; this is what a turn costs, whatever the share was.
        "turns_per_cpu_s": (
            len(ok) / (seg.cpu["ours_cores"] * seg.cpu["wall_s"]) if seg.cpu else math.nan
        ),
        "max_gap_s": max_gap(finished, start, end),
        "stale_turn_fraction": (sum(1 for x in lags if x > 0) / len(lags)) if lags else math.nan,
        "mean_version_lag": (sum(lags) / len(lags)) if lags else math.nan,
        "trainer": seg.trainer,
        "max_slots_in_use": seg.max_slots,
        "cpu": seg.cpu,
        "errors": seg.errors[:5],
    }


def _median(xs: Sequence[float]) -> float:
    return summarize(x for x in xs if not math.isnan(x)).p50


def _spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of the values that are numbers (NaN for all three when none is)."""
    known = [v for v in values if not math.isnan(v)]
    if not known:
        return {"median": math.nan, "min": math.nan, "max": math.nan}
    return {"median": _median(known), "min": min(known), "max": max(known)}


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per strategy: median and range over repeats; ratios paired within each repeat."""
    keys = [
        "turns_per_cpu_s",
        "mixed_fraction",
        "throughput_turns_s",
        "max_gap_s",
        "first_new_turn_s",
        "stale_turn_fraction",
    ]
    out: dict[str, Any] = {}
    for s in STRATEGIES:
        mine = [r for r in rows if r["strategy"] == s]
        if not mine:
            continue
        stats = {k: _spread([r[k] for r in mine]) for k in keys}
        stats["publication_s"] = _spread([r["publication_s"]["mean"] for r in mine])
        stats["mixed"] = sum(r["mixed"] for r in mine)
        stats["trajectories"] = sum(r["trajectories"] for r in mine)
        stats["failed_turns"] = sum(r["failed_turns"] for r in mine)
        stats["unidentified_turns"] = sum(r["unidentified_turns"] for r in mine)
        stats["publications"] = sum(r["publications"] for r in mine)
        out[s] = stats
    by_repeat: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_repeat.setdefault(r["repeat"], {})[r["strategy"]] = r
    thr = [
        g["pinned"]["throughput_turns_s"] / g["inplace"]["throughput_turns_s"]
        for g in by_repeat.values()
        if {"pinned", "inplace"} <= g.keys()
    ]
    bar = [
        g["pinned"]["publication_s"]["mean"] / g["drain"]["publication_s"]["mean"]
        for g in by_repeat.values()
        if {"pinned", "drain"} <= g.keys()
    ]
    eff = [
        g["pinned"]["turns_per_cpu_s"] / g["inplace"]["turns_per_cpu_s"]
        for g in by_repeat.values()
        if {"pinned", "inplace"} <= g.keys()
    ]
    before = {
        other: [
            g[other]["throughput_before_publication"]
            / g["inplace"]["throughput_before_publication"]
            for g in by_repeat.values()
            if {other, "inplace"} <= g.keys()
        ]
        for other in ("drain", "pinned")
    }
    out["ratios"] = {
        "throughput_pinned_over_inplace": thr,
        "before_publication_pinned_over_inplace": before["pinned"],
        "before_publication_drain_over_inplace": before["drain"],
        "turns_per_cpu_s_pinned_over_inplace": eff,
        "barrier_pinned_over_drain": bar,
    }
    # A goal whose strategies did not run (``--strategies``) is left out, not reported missed.
    goals: dict[str, bool] = {}
    if "pinned" in out:
        goals["pinned: 0 mixed trajectories"] = out["pinned"]["mixed"] == 0
    if thr:
        goals[f"pinned throughput >= {GOALS['throughput_ratio']}x inplace (median of repeats)"] = (
            _median(thr) >= GOALS["throughput_ratio"]
        )
    if bar:
        goals[
            f"pinned publication barrier <= {GOALS['barrier_ratio']}x drain (median of repeats)"
        ] = _median(bar) <= GOALS["barrier_ratio"]
    out["goals"] = goals
    return out


def timeline(seg: Segment, refs: dict[int, tuple[float, ...]]) -> dict[str, Any]:
    """Everything :func:`segment_from` needs to analyse the segment again, and the plot."""
    return {
        "strategy": seg.strategy,
        "repeat": seg.repeat,
        "turns": [{**asdict(t), "version": identify(t.fingerprint, refs)} for t in seg.turns],
        "trajectories": seg.trajectories,
        "windows": [asdict(w) for w in seg.windows],
        "publications": [asdict(p) for p in seg.publications],
        "trainer": seg.trainer,
        "errors": seg.errors,
        "max_slots_in_use": seg.max_slots,
        "cpu": seg.cpu,
    }


def segment_from(tl: dict[str, Any]) -> Segment:
    """The segment a :func:`timeline` record describes (for ``--rescore``)."""
    turn_fields = set(Turn.__dataclass_fields__)
    turns = []
    for t in tl["turns"]:
        fp = t.get("fingerprint")
        turns.append(
            Turn(
                **{
                    **{k: v for k, v in t.items() if k in turn_fields},
                    "fingerprint": tuple(fp) if fp else None,
                }
            )
        )
    seg = Segment(tl["strategy"], tl["repeat"], turns=turns, trajectories=list(tl["trajectories"]))
    seg.windows = [SwapWindow(**w) for w in tl["windows"]]
    seg.publications = [Publication(**p) for p in tl["publications"]]
    seg.trainer, seg.errors, seg.max_slots = tl["trainer"], tl["errors"], tl["max_slots_in_use"]
    seg.cpu = tl.get("cpu", {})
    return seg


def rescore(path: Path) -> dict[str, Any]:
    """Analyse a recorded run again from its JSON (same references, same windows)."""
    import json

    result: dict[str, Any] = json.loads(path.read_text())
    refs = {int(k): tuple(v) for k, v in result["references"]["fingerprints"].items()}
    s = result["settings"]
    start, end = s["warmup"], s["warmup"] + s["window"]
    rows = [analyse(segment_from(tl), refs, start, end) for tl in result["timelines"]]
    result["segments"], result["summary"] = rows, aggregate(rows)
    return result


# --- the run -----------------------------------------------------------------------------------


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    from agentic_lora_harness.engine_env import ensure_engine_env
    from agentic_lora_harness.engines import CPU_FLAGS
    from agentic_lora_harness.engines import EngineFleet
    from agentic_lora_harness.engines import lora_flags
    from agentic_lora_harness.fixture import build_fixture

    started = machine()
    spec = WorkloadSpec(
        min_turns=a.min_turns,
        max_turns=a.max_turns,
        wait=a.wait,
        wait_median=a.wait_median,
        wait_sigma=a.wait_sigma,
        wait_alpha=a.wait_alpha,
    )
    params = Params(
        a.agents,
        spec,
        a.seed,
        a.tokens,
        a.cadence,
        a.warmup,
        a.window,
        a.inplace_source,
        a.swap_retries,
    )
    p99 = duration_quantile(spec, turn_seconds=a.turn_seconds, q=0.99, seed=a.seed)
    capacity = a.capacity or operator_capacity(p99, a.cadence)
    publications = math.ceil(a.window / a.cadence) + 1
    env = await asyncio.to_thread(ensure_engine_env)
    fixture = await asyncio.to_thread(build_fixture)
    contents = derive_contents(
        AdapterSnapshot.from_peft_dir(fixture.adapter("A")), publications + 1, a.seed, a.noise
    )
    # One batch slot more than the pinned versions (SGLang keeps one unpinned), one loaded slot
    # more for the fixed in-place name.
    flags = (
        *CPU_FLAGS,
        *lora_flags(max_loras_per_batch=capacity + 1, max_loaded_loras=capacity + 2),
    )
    order = interleaved_order(list(a.strategies), a.repeats)
    print(
        f"seed {a.seed}; capacity {capacity} (p99 trajectory {p99:.1f} s at {a.turn_seconds} s/turn, cadence {a.cadence} s); order {' '.join(order)}",
        flush=True,
    )
    rows, timelines = [], []
    batch_cost: dict[str, Any] | None = None
    async with EngineFleet(env, fixture, count=2, flags=flags, log_dir=engine_log_dir()) as fleet:
        settings = fleet_settings(
            fleet,
            capacity=capacity,
            engine_max_loaded_loras=capacity + 2,
            engine_max_loras_per_batch=capacity + 1,
        )
        with tempfile.TemporaryDirectory(prefix="bench-mixing-") as tmp:
            root = Path(tmp)
            dirs = [
                contents[k].write_peft_dir(root / "contents" / str(k)) for k in range(len(contents))
            ]
            async with (
                direct_client() as client,
                Deployment.from_settings(
                    settings, backend_options={"store_root": str(root / "store")}
                ) as deployment,
            ):
                refs, ref_check = await take_references(client, fleet.engines, dirs)
                print(f"references: {ref_check}", flush=True)
                ctx = Context(
                    params,
                    client,
                    fleet.engines,
                    deployment,
                    contents,
                    refs,
                    InPlaceSwap(client, fleet.engines, root, params),
                    uuid.uuid4().hex[:6],
                    (os.getpgid(0), *(fleet.pid(n) or -1 for n in fleet.names)),
                )
                if a.batch_probe > 0:
                    batch_cost = await adapter_batch_probe(
                        client, fleet.engines, dirs, a.batch_probe
                    )
                    print(f"adapter batch probe: {batch_cost['summary']}", flush=True)
                for i, strategy in enumerate(order):
                    repeat = i // len(a.strategies)
                    seg = await run_segment(ctx, strategy, repeat)
                    row = analyse(seg, refs, a.warmup, a.warmup + a.window)
                    rows.append(row)
                    timelines.append(timeline(seg, refs))
                    print(
                        f"[{i + 1}/{len(order)}] {strategy} r{repeat}: {row['trajectories']} trajectories, {row['mixed']} mixed, {row['turns']} turns, {row['publications_ok']}/{row['publications']} publications, {row['throughput_turns_s']:.2f} turns/s",
                        flush=True,
                    )
    started["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return {
        "machine": started,
        "settings": {
            **vars(a),
            "capacity": capacity,
            "p99_trajectory_s_estimate": p99,
            "order": order,
            "engines": 2,
            "contents": len(contents),
        },
        "references": {**ref_check, "fingerprints": refs},
        "adapter_batch_probe": batch_cost,
        "segments": rows,
        "summary": aggregate(rows),
        "timelines": timelines,
    }


def report(result: dict[str, Any]) -> None:
    rows = result["segments"]
    print("\n== segments ==")
    print_table(
        ["strategy", "rep", "traj", "mixed", "at risk (timeline)", "turns", "failed", "unident.", "pubs ok", "pub s (mean)", "first new turn s", "turns/s", "max gap s", "stale turns", "others' cores"],
        [[r["strategy"], r["repeat"], r["trajectories"], r["mixed"], r["timeline"]["at_risk"], r["turns"], r["failed_turns"], r["unidentified_turns"], f"{r['publications_ok']}/{r['publications']}", r["publication_s"]["mean"], r["first_new_turn_s"], r["throughput_turns_s"], r["max_gap_s"], r["stale_turn_fraction"], r.get("cpu", {}).get("foreign_cores", float("nan"))] for r in rows],
    )  # fmt: skip
    probe = result.get("adapter_batch_probe")
    if probe:
        print(f"\nadapter batch probe (turns/s): {probe['summary']}")
    s = result["summary"]
    print("\n== per strategy: median over repeats (min-max) ==")

    def cell(k: str, strat: str, fmt: str = "{:.3f}") -> str:
        x = s[strat][k]
        return f"{fmt.format(x['median'])} ({fmt.format(x['min'])}-{fmt.format(x['max'])})"

    print_table(
        ["strategy", "mixed trajectories", "publication s", "first new-version turn s", "turns/s", "turns per CPU-s", "max gap s", "stale turns"],
        [[k, f"{s[k]['mixed']}/{s[k]['trajectories']} ({cell('mixed_fraction', k)})", cell("publication_s", k), cell("first_new_turn_s", k), cell("throughput_turns_s", k), cell("turns_per_cpu_s", k), cell("max_gap_s", k), cell("stale_turn_fraction", k)] for k in STRATEGIES if k in s],
    )  # fmt: skip
    r = s["ratios"]
    print(
        f"\npinned/inplace throughput per repeat: {[round(x, 3) for x in r['throughput_pinned_over_inplace']]}"
    )
    print(
        "before the first publication (the control), per repeat: pinned/inplace "
        f"{[round(x, 3) for x in r['before_publication_pinned_over_inplace']]}, drain/inplace "
        f"{[round(x, 3) for x in r['before_publication_drain_over_inplace']]}"
    )
    print(
        "pinned/inplace turns per CPU-second per repeat: "
        f"{[round(x, 3) for x in r['turns_per_cpu_s_pinned_over_inplace']]}"
    )
    print(
        f"pinned/drain publication time per repeat: {[round(x, 4) for x in r['barrier_pinned_over_drain']]}"
    )
    for name, held in s["goals"].items():
        print(f"  {'HOLDS ' if held else 'MISSED'}  {name}")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--smoke", action="store_true", help="a quick run: 4 agents, 1 repeat, 12 s windows"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="rounds of the three strategies (ABBA order)"
    )
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--window", type=float, default=48.0, help="measured seconds per segment")
    p.add_argument("--warmup", type=float, default=8.0, help="seconds before the trainer starts")
    p.add_argument(
        "--cadence", type=float, default=6.0, help="training seconds between publications"
    )
    p.add_argument("--tokens", type=int, default=16, help="tokens per turn")
    p.add_argument("--min-turns", type=int, default=2)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--wait", choices=("lognormal", "pareto"), default="lognormal")
    p.add_argument(
        "--wait-median", type=float, default=0.4, help="lognormal median / Pareto scale (s)"
    )
    p.add_argument("--wait-sigma", type=float, default=1.2, help="lognormal shape")
    p.add_argument("--wait-alpha", type=float, default=1.5, help="Pareto tail index")
    p.add_argument("--seed", type=int, default=20260524)
    p.add_argument(
        "--capacity", type=int, default=0, help="version slots (0: size from the workload)"
    )
    p.add_argument(
        "--turn-seconds", type=float, default=0.4, help="turn latency assumed for sizing"
    )
    p.add_argument(
        "--noise", type=float, default=0.1, help="std of the noise that makes each version"
    )
    p.add_argument("--inplace-source", choices=("link", "version-dir"), default="link")
    p.add_argument("--swap-retries", type=int, default=10)
    p.add_argument(
        "--batch-probe",
        type=float,
        default=5.0,
        help="seconds per block of the adapter batch probe (0: skip)",
    )
    p.add_argument("--rescore", type=Path, help="analyse a recorded run's JSON again; no engines")
    a = p.parse_args(argv)
    if a.smoke:
        a.agents, a.repeats, a.window, a.warmup, a.cadence = 4, 1, 12.0, 4.0, 4.0
        a.batch_probe = min(a.batch_probe, 2.0)
    a.strategies = tuple(x for x in a.strategies.split(",") if x)
    if (
        not set(a.strategies) <= set(STRATEGIES)
        or a.repeats < 1
        or a.agents < 1
        or a.window <= 0
        or a.cadence <= 0
    ):
        p.error("bad --strategies, --repeats, --agents, --window or --cadence")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if a.rescore is not None:
        result = rescore(a.rescore)
        name = a.rescore.stem
    else:
        result = asyncio.run(main_async(a))
        name = "policy_mixing_smoke" if a.smoke else "policy_mixing"
    report(result)
    print(f"\nwritten: {write_result(name, result)}")
    with contextlib.suppress(ImportError):
        from plot_mixing import plot_policy_mixing

        print(f"written: {plot_policy_mixing(result, OUT_DIR / f'{name}.png')}")


if __name__ == "__main__":
    main()
