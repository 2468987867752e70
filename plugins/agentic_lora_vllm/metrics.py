"""The two facts this plugin reads from a vLLM engine's Prometheus ``/metrics`` page.

* ``process_start_time_seconds``: when the API server process started (the standard process
  collector, read from ``/proc``). vLLM publishes no process id or boot nonce anywhere else, and
  the API server is the process that holds the adapter names, so this is the restart witness.
* ``vllm:lora_requests_info``: a gauge whose *labels* carry the adapters with running and waiting
  requests (comma-separated names) and whose value is the time the scheduler reported them. A
  label set, once seen, stays on the page with its old time, so only the newest sample is the
  engine's current view. It is the closest thing vLLM has to a per-adapter request refcount.

Parsing uses ``prometheus_client``'s text parser (the format has escapes and comments that a
hand-written split would get wrong).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["EngineMetrics", "LoraActivity", "parse_metrics"]

PROCESS_START = "process_start_time_seconds"
LORA_INFO = "vllm:lora_requests_info"


@dataclass(frozen=True, slots=True)
class LoraActivity:
    """Adapters the engine's scheduler last reported with running or waiting requests."""

    reported_at: float
    running: frozenset[str]
    waiting: frozenset[str]

    def busy(self, lora_name: str) -> bool:
        """True when ``lora_name`` had a running or waiting request at the last report."""
        return lora_name in self.running or lora_name in self.waiting


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """``process_start_time`` (None if the page has none) and the newest LoRA activity report
    (None before the engine ever scheduled a request, or with stats logging off)."""

    process_start_time: float | None
    lora_activity: LoraActivity | None


def _names(label: str | None) -> frozenset[str]:
    return frozenset(n for n in (label or "").split(",") if n)


def parse_metrics(text: str) -> EngineMetrics:
    """Read :class:`EngineMetrics` from Prometheus text; ValueError if it does not parse."""
    start: float | None = None
    newest: LoraActivity | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == PROCESS_START:
                start = float(sample.value)
            elif sample.name == LORA_INFO and (newest is None or sample.value > newest.reported_at):
                newest = LoraActivity(
                    reported_at=float(sample.value),
                    running=_names(sample.labels.get("running_lora_adapters")),
                    waiting=_names(sample.labels.get("waiting_lora_adapters")),
                )
    return EngineMetrics(process_start_time=start, lora_activity=newest)
