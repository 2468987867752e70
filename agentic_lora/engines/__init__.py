"""Engines: what differs between engine software (dialects) and how an engine is reached (wire).

* :mod:`agentic_lora.engines.wire`: the one outcome vocabulary (refused / indeterminate), the one
  exception-translation table and the engine HTTP client factory, shared by the generation
  transport and the admin clients.
* :mod:`agentic_lora.engines.dialect`: the :class:`EngineDialect` contract and its plugin loader
  (entry-point group ``agentic_lora.engines``, picked by the ``engine_kind`` setting).
* :mod:`agentic_lora.engines.sglang`: the SGLang dialect (the vLLM one ships with the vLLM plugin,
  :mod:`agentic_lora_vllm.dialect`).
"""

from agentic_lora.engines.dialect import DIALECTS_GROUP
from agentic_lora.engines.dialect import DRAIN_OPTION
from agentic_lora.engines.dialect import EngineDialect
from agentic_lora.engines.dialect import SlotSettings
from agentic_lora.engines.dialect import dialect_names
from agentic_lora.engines.dialect import load_dialect
from agentic_lora.engines.sglang import SGLANG
from agentic_lora.engines.sglang import SGLangDialect
from agentic_lora.engines.wire import EngineHttp
from agentic_lora.engines.wire import HttpAnswer
from agentic_lora.engines.wire import Outcome

__all__ = [
    "DIALECTS_GROUP",
    "DRAIN_OPTION",
    "SGLANG",
    "EngineDialect",
    "EngineHttp",
    "HttpAnswer",
    "Outcome",
    "SGLangDialect",
    "SlotSettings",
    "dialect_names",
    "load_dialect",
]
