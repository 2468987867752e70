"""agentic-lora for TRL: ``GRPOTrainer`` generates through Sessions and publishes through versions.

Install with ``pip install "agentic-lora[trl]"`` (a pinned TRL). Three parts, all on agentic-lora's
public API:

* :class:`DeploymentThread`: an event loop on its own thread that owns the
  :class:`~agentic_lora.Deployment`; the trainer's thread hands it coroutines.
* :class:`SessionRollout`: a ``rollout_func`` that runs one Session per trajectory on SGLang's
  ``/generate`` with token ids and logprobs, multi-turn with an environment, and returns each
  trajectory's provenance with it.
* :class:`PublishCallback`: a ``TrainerCallback`` that publishes the PEFT adapter every
  ``publish_every`` optimizer steps off the training thread, coalesced (latest wins), and raises
  publication failures at the end of training.

::

    with DeploymentThread.from_settings(settings, backend_options={"store_root": "/adapters"}) as thread:
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward, args=config, train_dataset=dataset,
            peft_config=LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
            rollout_func=SessionRollout(thread),
            callbacks=[PublishCallback(thread, publish_every=1)],
        )
        trainer.train()

See ``docs/trl.md``.
"""

from agentic_lora_trl.bridge import BridgeState
from agentic_lora_trl.bridge import DeploymentThread
from agentic_lora_trl.callback import PublishCallback
from agentic_lora_trl.errors import BridgeClosedError
from agentic_lora_trl.errors import PublicationFailedError
from agentic_lora_trl.errors import RolloutTooStaleError
from agentic_lora_trl.publishing import AdapterPublisher
from agentic_lora_trl.publishing import PublicationFailure
from agentic_lora_trl.publishing import PublicationStats
from agentic_lora_trl.rollout import Environment
from agentic_lora_trl.rollout import GenerationPlan
from agentic_lora_trl.rollout import SessionRollout
from agentic_lora_trl.rollout import Trajectory
from agentic_lora_trl.rollout import Turn
from agentic_lora_trl.rollout import encode_prompts
from agentic_lora_trl.weights import AdapterWeights

__all__ = [
    "AdapterPublisher",
    "AdapterWeights",
    "BridgeClosedError",
    "BridgeState",
    "DeploymentThread",
    "Environment",
    "GenerationPlan",
    "PublicationFailedError",
    "PublicationFailure",
    "PublicationStats",
    "PublishCallback",
    "RolloutTooStaleError",
    "SessionRollout",
    "Trajectory",
    "Turn",
    "encode_prompts",
]
