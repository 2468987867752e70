"""TRL's ``GRPOTrainer`` through agentic-lora (see ``examples/trl_grpo/README.md``).

* :func:`train` (``train.py``): the whole example on a running fleet;
* ``__main__.py``: ``python -m agentic_lora_grpo`` starts two SGLang engines on the tiny fixture
  model (the test harness) and runs :func:`train` on them.
"""

from .train import PROMPTS
from .train import RolloutBatch
from .train import ToolResponse
from .train import TrainReport
from .train import train

__all__ = ["PROMPTS", "RolloutBatch", "ToolResponse", "TrainReport", "train"]
