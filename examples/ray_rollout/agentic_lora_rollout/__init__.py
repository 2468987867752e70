"""Rollout workers on Ray: the trainer publishes, worker actors run agent Sessions.

See ``examples/ray_rollout/README.md``. The parts:

* :class:`RolloutWorker` (``worker.py``): the worker actor body; one ``Versioning`` on the shared
  registry actor, an owner lease under a stable ``owner`` id, ``agents`` example-agent loops;
* ``driver.py``: the fleet's settings (:func:`fleet_settings`, validated once, in the driver)
  and each worker's (:func:`worker_settings`), the registry actor, the trainer's ``Deployment``
  (publisher, reclaimer) and :func:`spawn_worker`;
* :func:`rollout` (``rollout.py``): the whole example on a running fleet;
* ``__main__.py``: ``python -m agentic_lora_rollout`` starts two SGLang engines on the tiny fixture
  model (the test harness) and runs :func:`rollout` on them.
"""

from .driver import REGISTRY_NAMESPACE
from .driver import fleet_settings
from .driver import reclaim_until_settled
from .driver import registry_actor
from .driver import settled
from .driver import spawn_worker
from .driver import trainer_deployment
from .driver import worker_runtime_env
from .driver import worker_settings
from .rollout import RolloutReport
from .rollout import publish_when_free
from .rollout import rollout
from .worker import EpisodeLoop
from .worker import RolloutWorker
from .worker import WorkerConfig

__all__ = [
    "REGISTRY_NAMESPACE",
    "EpisodeLoop",
    "RolloutReport",
    "RolloutWorker",
    "WorkerConfig",
    "fleet_settings",
    "publish_when_free",
    "reclaim_until_settled",
    "registry_actor",
    "rollout",
    "settled",
    "spawn_worker",
    "trainer_deployment",
    "worker_runtime_env",
    "worker_settings",
]
