"""The framework flag and its settings, validated before anything starts.

One settings model, :class:`AgenticLoRASettings` (environment prefix ``AGENTIC_LORA_``, e.g.
``AGENTIC_LORA_ENGINES='["e0=http://127.0.0.1:30000", "e1=http://127.0.0.1:30001"]'``), and
:func:`add_arguments`, which adds ``--enable-versioned-lora-publication`` and its
``--versioned-lora-*`` options to a framework's argparse parser; :func:`from_args` reads them back
(command line over environment over defaults).

Validation is fail-fast and each failure is a :class:`~agentic_lora.errors.ConfigurationError`
whose ``details["check"]`` names the rule: ``empty_fleet``, ``duplicate_engine``, ``capacity``,
``engine_lora_slots``, ``pinned_slots`` (also for PD decode servers), ``router_retries``,
``base_model_name``, ``lora_name_prefix``, ``router``, ``backend``, ``engine_kind`` (a built-in
backend for another engine kind), ``journal_path``, ``gateway_id``, ``session_name_ttl``,
``resolve_backoff``, ``lease``, ``owner_id``, ``probe_interval``, ``max_version_lag``,
``gateway_limits``, ``settings`` (a value of the wrong type) and, at start-up against live
engines (:func:`verify_fleet`), ``engine_lora`` and ``pd_role`` (a server whose
``disaggregation_mode`` is not its configured role).

``engine_kind`` says what software the engines run: the name of an installed engine dialect
(entry-point group ``agentic_lora.engines``, see :mod:`agentic_lora.engines.dialect`), which
decides how a Session names its adapter: ``"sglang"`` (the default) or ``"vllm"``. A vLLM fleet needs
the ``vllm`` backend (and that backend a vLLM fleet): vLLM's unload does not wait for in-flight
requests, so its backend waits for the Sessions' own count first
(:meth:`agentic_lora.assembly.deployment.Deployment.from_settings` wires that).

Why the gateway rule is an operator assertion: an SGLang router/gateway in front of the engines
retries failed requests by default (``--retry-max-retries``, on 408/429/5xx), which could run a
generation twice. It exposes no endpoint that reports its retry policy (its ``/get_server_info``
is a worker's), so start-up cannot query it. Set ``gateway_url`` whenever requests pass through
such a gateway (for instance when an entry of ``engines`` points at it); the operator must then
assert ``gateway_retries_disabled`` (the gateway runs with ``--disable-retries``), otherwise
start-up refuses.

The package is split by job: :mod:`~agentic_lora.config.settings` (the settings model and its
fail-fast validation), :mod:`~agentic_lora.config.flags` (the argparse flag layer) and
:mod:`~agentic_lora.config.engine_checks` (the engines' server info and LoRA slots checked against
the settings, at start-up and by ``doctor``).
"""

from agentic_lora.config.engine_checks import check_engine_server_info
from agentic_lora.config.engine_checks import slot_settings
from agentic_lora.config.engine_checks import verify_fleet
from agentic_lora.config.flags import add_arguments
from agentic_lora.config.flags import from_args
from agentic_lora.config.flags import given_flags
from agentic_lora.config.settings import BUILTIN_BACKEND_ENGINE_KINDS
from agentic_lora.config.settings import AgenticLoRASettings
from agentic_lora.config.settings import load_settings

__all__ = [
    "BUILTIN_BACKEND_ENGINE_KINDS",
    "AgenticLoRASettings",
    "add_arguments",
    "check_engine_server_info",
    "from_args",
    "given_flags",
    "load_settings",
    "slot_settings",
    "verify_fleet",
]
