"""The rollout hook: one agentic-lora Session per trajectory, for ``GRPOTrainer(rollout_func=...)``.

::

    rollout = SessionRollout(thread, environment=my_tools, max_turns=4)
    trainer = GRPOTrainer(..., rollout_func=rollout, callbacks=[PublishCallback(thread)])

What TRL passes: the prompts of one generation batch, **each already repeated
``num_generations`` times** (its ``RepeatSampler`` repeats the indices), and the trainer. So the
rollout returns exactly one trajectory per entry, in order, and the GRPO groups are the runs of
equal entries, as TRL expects.

One trajectory:

* its prompt is tokenized the way TRL tokenizes it (chat template with the trainer's tools and
  template options for conversational prompts, the tokenizer for text), on the training thread;
* one Session is opened for it; every turn is SGLang ``/generate`` on token ids with
  ``return_logprob`` (:mod:`agentic_lora_trl.tokens`), so ``completion_ids`` and ``logprobs`` are
  the engine's own tokens and logprobs, and every turn carries the Session's one bound version;
* with an ``environment`` (multi-turn tool use), after each model turn it is called with a
  :class:`Turn` and returns the token ids to append (a tool's output, the next user turn) or
  None to end the trajectory. Those tokens get ``env_mask`` 0 and logprob 0.0, model tokens 1.
  The trajectory ends at ``max_turns`` model turns, or when it reaches the trainer's
  ``max_completion_length`` (environment tokens past it are cut);
* the Session's :meth:`~agentic_lora.Session.provenance` comes back with it.

**A trajectory refused as too stale** (``VERSION_TOO_STALE``, with ``max_version_lag`` set) is
restarted from its prompt in a fresh Session, which binds the current default; the refused
attempt is recorded in the provenance's ``restarts`` (its version, lag and turns), and its tokens
are dropped. It is never continued on another version, and never dropped (TRL needs one
completion per entry). After ``max_restarts`` restarts the rollout raises
:class:`~agentic_lora_trl.errors.RolloutTooStaleError`. Any other failure of a turn (an engine
that refused or may have run the request) is raised as the core classifies it: nothing is sent
twice behind the trainer's back. Either way the other trajectories of the batch are cancelled and
every Session is closed.

Returned keys: ``prompt_ids``, ``completion_ids``, ``logprobs``, ``env_mask`` and, one value per
trajectory, ``agentic_lora`` (the whole provenance), ``agentic_lora_version``,
``agentic_lora_digest`` and ``agentic_lora_lag`` (the largest lag of its turns). TRL hands the
extra keys to every reward function as keyword arguments. The rollout also logs, through the
trainer's metrics, ``agentic_lora/rollout_lag_max``, ``agentic_lora/rollout_lag_mean``,
``agentic_lora/rollout_restarts`` and ``agentic_lora/rollout_turns_mean``, and adds the version
of each completion to TRL's completions table (column ``agentic_lora_version``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentic_lora import Session
from agentic_lora.errors import VersionTooStaleError
from agentic_lora_trl.bridge import DeploymentThread
from agentic_lora_trl.errors import RolloutTooStaleError
from agentic_lora_trl.tokens import sampling_params
from agentic_lora_trl.tokens import token_request
from agentic_lora_trl.tokens import token_turn

__all__ = [
    "Environment",
    "GenerationPlan",
    "SessionRollout",
    "Trajectory",
    "Turn",
    "encode_prompts",
    "rollout_output",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Turn:
    """What the environment sees after one model turn of a trajectory."""

    #: The trajectory's position in the batch (the prompt entry's index).
    index: int
    #: TRL's prompt entry (text or messages), as the dataset holds it.
    prompt: Any
    #: 0 for the first model turn, then 1, 2, ...
    turn: int
    prompt_ids: tuple[int, ...]
    #: Every completion token so far: model turns and earlier environment tokens.
    completion_ids: tuple[int, ...]
    #: This turn's model tokens.
    output_ids: tuple[int, ...]
    #: SGLang's ``finish_reason.type`` of this turn (``"stop"``, ``"length"``, ...).
    finish_reason: str | None
    #: How many more tokens the trajectory may hold (the trainer's ``max_completion_length``).
    remaining: int


#: Called after each model turn; returns the token ids to append (env_mask 0), or None to stop.
Environment = Callable[[Turn], Awaitable[Sequence[int] | None]]


@dataclass(frozen=True)
class GenerationPlan:
    """How every trajectory of one batch generates (fixed before any Session opens)."""

    sampling: Mapping[str, Any]
    max_completion_length: int
    stop_token_ids: tuple[int, ...] = ()
    #: Part of every Session id of the batch (e.g. the trainer's step), for logs.
    label: str = ""


@dataclass(frozen=True)
class Trajectory:
    """One finished trajectory: what TRL trains on, and where it came from."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    env_mask: list[int]
    provenance: dict[str, Any]

    @property
    def version_id(self) -> str | None:
        version = self.provenance.get("version_id")
        return version if isinstance(version, str) else None

    @property
    def max_lag(self) -> int | None:
        """The largest lag of its turns (None when the registry client cannot say)."""
        known = [lag for lag in self.provenance.get("lags", ()) if lag is not None]
        return max(known) if known else None


def encode_prompts(prompts: Sequence[Any], trainer: Any) -> list[list[int]]:
    """Tokenize ``prompts`` as ``GRPOTrainer`` does for its own generation: conversational
    prompts through the chat template (the trainer's tools, template and template options,
    with the generation prompt), text prompts through the tokenizer."""
    from trl.data_utils import is_conversational

    processor = trainer.processing_class
    if prompts and is_conversational({"prompt": prompts[0]}):
        tokenized = processor.apply_chat_template(
            conversation=list(prompts),
            tools=trainer.tools or None,
            chat_template=trainer.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **trainer.chat_template_kwargs,
        )
    else:
        tokenized = processor(text=list(prompts))
    return [[int(t) for t in ids] for ids in tokenized["input_ids"]]


def rollout_output(trajectories: Sequence[Trajectory]) -> dict[str, list[Any]]:
    """The dict ``rollout_func`` returns to TRL (see module docstring)."""
    return {
        "prompt_ids": [t.prompt_ids for t in trajectories],
        "completion_ids": [t.completion_ids for t in trajectories],
        "logprobs": [t.logprobs for t in trajectories],
        "env_mask": [t.env_mask for t in trajectories],
        "agentic_lora": [t.provenance for t in trajectories],
        "agentic_lora_version": [t.version_id for t in trajectories],
        "agentic_lora_digest": [t.provenance.get("digest") for t in trajectories],
        "agentic_lora_lag": [t.max_lag for t in trajectories],
    }


class SessionRollout:
    """A ``rollout_func`` for ``GRPOTrainer``: one Session per trajectory (module docstring).

    ``thread`` is the bridge whose Deployment's Sessions generate. ``max_turn_tokens`` bounds one
    model turn (None: whatever is left of ``max_completion_length``). ``encode`` replaces
    :func:`encode_prompts`; ``sampling_overrides`` are laid over the SGLang sampling parameters
    taken from the trainer's config; ``max_concurrency`` bounds the trajectories generating at
    once (None: the whole batch). Every request's ``rid`` is ``<session id>-turn<n>``, so an
    engine's log names the trajectory and turn of each request.
    """

    def __init__(
        self,
        thread: DeploymentThread,
        *,
        environment: Environment | None = None,
        max_turns: int = 1,
        max_turn_tokens: int | None = None,
        max_restarts: int = 2,
        encode: Callable[[Sequence[Any], Any], list[list[int]]] = encode_prompts,
        sampling_overrides: Mapping[str, Any] | None = None,
        max_concurrency: int | None = None,
        session_prefix: str = "trl",
    ) -> None:
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        if max_turn_tokens is not None and max_turn_tokens < 1:
            raise ValueError("max_turn_tokens must be >= 1")
        if max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        self._thread = thread
        self.environment = environment
        self.max_turns = max_turns
        self.max_turn_tokens = max_turn_tokens
        self.max_restarts = max_restarts
        self.encode = encode
        self.sampling_overrides = dict(sampling_overrides or {})
        self.max_concurrency = max_concurrency
        # Session ids stay unique across runs sharing one registry, and readable in its logs.
        self.session_prefix = f"{session_prefix}-{uuid.uuid4().hex[:8]}"

    # --- what TRL calls ------------------------------------------------------------------------

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """Generate one trajectory per prompt entry (on the bridge), log their provenance into
        the trainer's metrics and return them in TRL's ``rollout_func`` form."""
        args = trainer.args
        plan = GenerationPlan(
            sampling=sampling_params(args, self.sampling_overrides),
            max_completion_length=int(args.max_completion_length),
            stop_token_ids=tuple(int(t) for t in getattr(trainer, "eos_token_ids", ()) or ()),
            label=f"step{trainer.state.global_step}",
        )
        prompt_ids = self.encode(prompts, trainer)
        trajectories = self._thread.run(self.generate(prompts, prompt_ids, plan))
        _log_to_trainer(trainer, trajectories)
        return rollout_output(trajectories)

    # --- on the bridge's loop --------------------------------------------------------------------

    async def generate(
        self, prompts: Sequence[Any], prompt_ids: Sequence[Sequence[int]], plan: GenerationPlan
    ) -> list[Trajectory]:
        """One trajectory per prompt entry, concurrently, in the prompts' order. The first
        failure cancels the others (each closes its Session) and is raised."""
        if len(prompts) != len(prompt_ids):
            raise ValueError(f"{len(prompts)} prompts but {len(prompt_ids)} encoded prompts")
        limit = asyncio.Semaphore(self.max_concurrency or max(1, len(prompts)))
        tasks: list[asyncio.Task[Trajectory]] = []
        try:
            async with asyncio.TaskGroup() as group:
                for index, (prompt, ids) in enumerate(zip(prompts, prompt_ids, strict=True)):
                    tasks.append(
                        group.create_task(self._trajectory(index, prompt, list(ids), plan, limit))
                    )
        except BaseExceptionGroup as group_error:
            # The first trajectory's error, as it was raised; the rest were cancelled because of
            # it, or failed at the same time (logged, so none is lost).
            first, *others = group_error.exceptions
            for other in others:
                logger.error("another trajectory of the batch failed too: %s", other)
            raise first from None
        return [task.result() for task in tasks]

    async def _trajectory(
        self,
        index: int,
        prompt: Any,
        prompt_ids: list[int],
        plan: GenerationPlan,
        limit: asyncio.Semaphore,
    ) -> Trajectory:
        versioning = self._thread.deployment.versioning
        restarts: list[dict[str, Any]] = []
        async with limit:
            for attempt in range(self.max_restarts + 1):
                session_id = f"{self.session_prefix}-{plan.label}-{index}-{attempt}"
                async with versioning.session(session_id) as session:
                    try:
                        tokens = await self._episode(session, index, prompt, prompt_ids, plan)
                    except VersionTooStaleError as exc:
                        restarts.append(_refused_attempt(session, exc))
                        logger.info(
                            "trajectory %d refused as too stale on %s (lag %s); restarting it "
                            "from its prompt in a fresh Session",
                            index,
                            exc.details.get("version"),
                            exc.details.get("lag"),
                            extra={"session": session.key, "prompt_index": index},
                        )
                        continue
                    provenance = session.provenance()
                provenance["restarts"] = restarts
                completion, logprobs, env_mask = tokens
                return Trajectory(prompt_ids, completion, logprobs, env_mask, provenance)
        raise RolloutTooStaleError(
            f"trajectory {index} was refused as too stale {len(restarts)} times "
            f"(max_restarts={self.max_restarts})",
            prompt_index=index,
            restarts=restarts,
        )

    async def _episode(
        self, session: Session, index: int, prompt: Any, prompt_ids: list[int], plan: GenerationPlan
    ) -> tuple[list[int], list[float], list[int]]:
        budget = plan.max_completion_length
        completion: list[int] = []
        logprobs: list[float] = []
        env_mask: list[int] = []
        for turn_number in range(self.max_turns):
            remaining = budget - len(completion)
            body = token_request(
                prompt_ids + completion,
                plan.sampling,
                max_new_tokens=min(remaining, self.max_turn_tokens or remaining),
                stop_token_ids=plan.stop_token_ids,
            )
            body["rid"] = f"{session.session_id}-turn{turn_number}"
            turn = token_turn((await session.generate(body)).body)
            completion.extend(turn.output_ids)
            logprobs.extend(turn.logprobs)
            env_mask.extend([1] * len(turn.output_ids))
            if self.environment is None or len(completion) >= budget:
                break
            if turn_number + 1 == self.max_turns:
                break
            extra = await self.environment(
                Turn(
                    index=index,
                    prompt=prompt,
                    turn=turn_number,
                    prompt_ids=tuple(prompt_ids),
                    completion_ids=tuple(completion),
                    output_ids=turn.output_ids,
                    finish_reason=turn.finish_reason,
                    remaining=budget - len(completion),
                )
            )
            if not extra:
                break
            added = [int(t) for t in extra][: budget - len(completion)]
            completion.extend(added)
            logprobs.extend([0.0] * len(added))
            env_mask.extend([0] * len(added))
            if len(completion) >= budget:
                break
        return completion, logprobs, env_mask


def _refused_attempt(session: Session, exc: VersionTooStaleError) -> dict[str, Any]:
    """What the provenance keeps of an attempt refused as too stale."""
    record = session.provenance()
    return {
        "version_id": record.get("version_id"),
        "digest": record.get("digest"),
        "lag": exc.details.get("lag"),
        "turns": record.get("turns"),
    }


def _log_to_trainer(trainer: Any, trajectories: Sequence[Trajectory]) -> None:
    """Rollout metrics into the trainer's log (TRL's ``log_metric`` path for reward functions)
    and each completion's version into its completions table."""
    log_metric = getattr(trainer, "_log_metric", None)
    log_extra = getattr(trainer, "_log_completion_extra", None)
    if callable(log_metric) and trajectories:
        lags = [t.max_lag for t in trajectories if t.max_lag is not None]
        if lags:
            log_metric("agentic_lora/rollout_lag_max", float(max(lags)))
            log_metric("agentic_lora/rollout_lag_mean", sum(lags) / len(lags))
        log_metric(
            "agentic_lora/rollout_restarts",
            float(sum(len(t.provenance.get("restarts", ())) for t in trajectories)),
        )
        turns = [int(t.provenance.get("turns") or 0) for t in trajectories]
        log_metric("agentic_lora/rollout_turns_mean", sum(turns) / len(turns))
    if callable(log_extra):
        log_extra("agentic_lora_version", [t.version_id for t in trajectories])
