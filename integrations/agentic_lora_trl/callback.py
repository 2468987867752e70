"""The trainer hook: publish the trained LoRA adapter every ``publish_every`` optimizer steps.

::

    trainer = GRPOTrainer(..., peft_config=LoraConfig(...),
                          callbacks=[PublishCallback(thread, publish_every=1)])

* ``on_train_begin``: the starting weights are published as ``<prefix>-<global_step>`` and the
  callback waits until they are the default (rollouts cannot bind before a version exists). A
  failure here is raised at once: :class:`~agentic_lora_trl.errors.PublicationFailedError`.
* ``on_step_end`` (after the optimizer step, every ``publish_every`` steps): the step's weights
  are copied on the training thread and handed to the :class:`AdapterPublisher`; it returns
  without waiting for any engine. Publication runs on the bridge, coalesced (latest wins).
* ``on_log``: the publisher's counters join the trainer's log record
  (``agentic_lora/publications``, ``agentic_lora/published_step``, ...; see
  :meth:`PublicationStats.as_logs`). Callbacks that run before this one (the ``report_to``
  integrations are registered first) do not see them; :attr:`PublishCallback.stats` always has
  them.
* ``on_train_end``: the final weights are submitted if the last step was not a publishing step,
  the callback waits until nothing is pending, then raises PublicationFailedError if any
  publication failed or the final weights are not the default.

Only the main process (``state.is_world_process_zero``) publishes.
"""

from __future__ import annotations

import logging
from typing import Any

from tenacity.wait import wait_base
from transformers import TrainerCallback
from transformers import TrainerState

from agentic_lora_trl.bridge import DeploymentThread
from agentic_lora_trl.publishing import DEFAULT_CAPACITY_RETRIES
from agentic_lora_trl.publishing import AdapterPublisher
from agentic_lora_trl.publishing import PublicationStats
from agentic_lora_trl.weights import AdapterWeights

__all__ = ["PublishCallback"]

logger = logging.getLogger(__name__)


class PublishCallback(TrainerCallback):
    """Publishes the trainer's PEFT adapter through ``thread``'s Deployment (module docstring).

    ``version_prefix``: versions are ``<prefix>-<step>``; a version id names one content for the
    life of a registry, so a new run on the same (journaled) registry needs a new prefix.
    ``adapter_name``: the PEFT adapter to publish. ``capacity_retries`` / ``capacity_wait``: see
    :class:`AdapterPublisher`.
    """

    def __init__(
        self,
        thread: DeploymentThread,
        *,
        publish_every: int = 1,
        version_prefix: str = "step",
        adapter_name: str = "default",
        capacity_retries: int = DEFAULT_CAPACITY_RETRIES,
        capacity_wait: wait_base | None = None,
    ) -> None:
        if publish_every < 1:
            raise ValueError("publish_every must be >= 1")
        self.publish_every = publish_every
        self.version_prefix = version_prefix
        self.adapter_name = adapter_name
        self.publisher = AdapterPublisher(
            thread, capacity_retries=capacity_retries, capacity_wait=capacity_wait
        )

    @property
    def stats(self) -> PublicationStats:
        """The publisher's counters now."""
        return self.publisher.stats

    def version_id(self, step: int) -> str:
        """The version id the weights of ``step`` are published under."""
        return f"{self.version_prefix}-{step}"

    def _submit(self, model: object, step: int) -> None:
        weights = AdapterWeights.capture(
            model, step=step, version_id=self.version_id(step), adapter_name=self.adapter_name
        )
        self.publisher.submit(weights)

    def _settle(self, model: object, step: int, *, when: str) -> None:
        """Make sure ``step``'s weights were submitted, wait for the publisher to finish, and
        raise PublicationFailedError unless they are the default and nothing failed."""
        if self.publisher.stats.last_submitted_step != step:
            self._submit(model, step)
        self.publisher.flush()
        self.publisher.raise_for(step, when=when)

    # --- trainer events ------------------------------------------------------------------------
    # transformers calls each with (args, state, control, model=..., ...); only state and the
    # model (or the logs) are read here.

    def on_train_begin(self, args: Any, state: TrainerState, control: Any, **kw: Any) -> None:
        if state.is_world_process_zero:
            self._settle(kw.get("model"), state.global_step, when="train begin")

    def on_step_end(self, args: Any, state: TrainerState, control: Any, **kw: Any) -> None:
        if state.is_world_process_zero and state.global_step % self.publish_every == 0:
            self._submit(kw.get("model"), state.global_step)

    def on_log(self, args: Any, state: TrainerState, control: Any, **kw: Any) -> None:
        logs = kw.get("logs")
        if isinstance(logs, dict) and state.is_world_process_zero:
            logs.update(self.publisher.stats.as_logs())

    def on_train_end(self, args: Any, state: TrainerState, control: Any, **kw: Any) -> None:
        if state.is_world_process_zero:
            self._settle(kw.get("model"), state.global_step, when="train end")
