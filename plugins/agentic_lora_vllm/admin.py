"""A small typed async client for vLLM's runtime LoRA endpoints (one HTTP attempt per call).

Shapes follow vLLM 0.32.0 (``vllm/entrypoints/serve/lora/api_router.py`` and
``vllm/entrypoints/openai/models/serving.py``), with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``:

* ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path}`` answers HTTP 200 with the plain text
  ``Success: LoRA adapter '<name>' added successfully.``; a refusal is a JSON error object
  ``{"error": {message, type, param, code}}`` whose ``code`` is the HTTP status: 400
  ``InvalidUserInput`` (name already loaded, missing field, clashes with the base model), 404
  ``NotFoundError`` (nothing loadable at ``lora_path``), 500 (the engine failed to add it).
  ``load_inplace`` is never sent: it swaps weights under a live name, which is exactly what
  immutable versions exist to prevent.
* ``POST /v1/unload_lora_adapter`` ``{lora_name}`` forgets the name in the API server and answers
  at once (200, ``Success: ... removed successfully.``). It does **not** wait for in-flight
  requests: those keep their adapter and finish on the old weights. An unknown name answers 404
  ``NotFoundError`` "The lora adapter '<name>' cannot be found."
* ``GET /v1/models`` lists the base model and one card per adapter (``id`` = name, ``root`` =
  path, ``parent`` = base model).
* ``POST /v1/completions`` with ``model=<lora name>`` generates through that adapter; a name the
  server does not know answers 404 "The model `<name>` does not exist."
* ``GET /metrics`` (Prometheus text) carries ``process_start_time_seconds`` of the API server
  process, and ``vllm:lora_requests_info`` (see :mod:`agentic_lora_vllm.metrics`).

When runtime LoRA updating is off, the two adapter routes do not exist: FastAPI answers 404
``{"detail": "Not Found"}``, which is a refusal, never "adapter absent".

The HTTP plumbing (one attempt per call, transport failures classified) is shared with the SGLang
client (:class:`agentic_lora.engines.admin.AdminHttpClient`); only the answers read differently.
Failures are :class:`~agentic_lora.errors.BackendRefusedError` when the engine provably did not
act (never connected, or it answered with an error) and
:class:`~agentic_lora.errors.BackendAmbiguousError` when it may have (reply lost, 5xx, an answer
that does not parse). A 200 whose body is an error object is an error: bodies are checked, not
only status codes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from agentic_lora.engines.admin import LIST_MODELS
from agentic_lora.engines.admin import AdminHttpClient
from agentic_lora.engines.admin import UnloadOutcome
from agentic_lora_vllm.dialect import read_metrics
from agentic_lora_vllm.metrics import EngineMetrics

__all__ = ["ProbeResult", "UnloadOutcome", "VllmAdminClient"]

#: The start of vLLM's plain-text success answers to load and unload.
SUCCESS_PREFIX = "Success:"
#: What vLLM's unload says about a name it does not hold (with error type ``NotFoundError``).
ABSENT_MARKER = "cannot be found"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """A one-token completion the engine answered under exactly ``lora_name``."""

    lora_name: str
    text: str
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int
    text: str
    json: Any


class VllmAdminClient(AdminHttpClient[_Answer]):
    """Typed access to one vLLM engine's LoRA control surface (one attempt per call).

    Construction and client sharing as for :class:`~agentic_lora.engines.admin.AdminHttpClient`.
    """

    # --- adapters --------------------------------------------------------------------------

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Register ``lora_path`` under ``lora_name``; returns only on vLLM's success answer.

        The caller still confirms with :meth:`list_lora_adapters`: a success message proves the
        engine read the adapter, the listing proves under which name and path it serves it.
        """
        op = "load_lora_adapter"
        answer = await self._post(
            op,
            "/v1/load_lora_adapter",
            {"lora_name": lora_name, "lora_path": lora_path},
            limit=self.timeouts.load,
            lora_name=lora_name,
        )
        if answer.status == 200 and answer.text.startswith(SUCCESS_PREFIX):
            return
        raise self._not_a_success(op, answer, lora_name)

    async def unload_lora_adapter(self, lora_name: str) -> UnloadOutcome:
        """Forget ``lora_name`` (returns at once; in-flight requests keep running on it)."""
        op = "unload_lora_adapter"
        answer = await self._post_unload(op, "/v1/unload_lora_adapter", lora_name)
        if answer.status == 200 and answer.text.startswith(SUCCESS_PREFIX):
            return UnloadOutcome.UNLOADED
        error = _error_object(answer.json)
        if (
            answer.status == 404
            and error is not None
            and error.get("type") == "NotFoundError"
            and ABSENT_MARKER in str(error.get("message"))
        ):
            return UnloadOutcome.ABSENT
        raise self._not_a_success(op, answer, lora_name)

    async def probe_completion(
        self, lora_name: str, *, prompt_ids: Sequence[int] = (0,)
    ) -> ProbeResult:
        """Complete one token (greedy) through exactly ``lora_name``, proving it serves."""
        op = "probe_completion"
        payload = {
            "model": lora_name,
            "prompt": list(prompt_ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "stream": False,
        }
        answer = await self._post_probe(op, "/v1/completions", payload, lora_name)
        body = answer.json
        if answer.status != 200 or not isinstance(body, dict) or "error" in body:
            raise self._not_a_success(op, answer, lora_name)
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise self._ambiguous(op, "completion has no choices", lora_name=lora_name)
        if body.get("model") != lora_name:
            raise self._ambiguous(
                op,
                f"completion answered as model {body.get('model')!r}, not {lora_name!r}",
                lora_name=lora_name,
            )
        finish = choices[0].get("finish_reason")
        return ProbeResult(
            lora_name, str(choices[0].get("text") or ""), None if finish is None else str(finish)
        )

    # --- process -----------------------------------------------------------------------------

    async def metrics(self) -> EngineMetrics:
        """The parts of ``GET /metrics`` this project reads (the dialect's reader)."""
        return await read_metrics(self)

    # --- plumbing ----------------------------------------------------------------------------

    def _read(self, op: str, response: httpx.Response, lora_name: str | None) -> _Answer:
        if response.status_code >= 500:
            raise self._ambiguous(
                op,
                f"HTTP {response.status_code}: {_error_message(_json_or_none(response))}",
                lora_name=lora_name,
                status=response.status_code,
            )
        return _Answer(response.status_code, response.text, _json_or_none(response))

    def _model_cards(self, answer: _Answer) -> list[Any]:
        data = answer.json.get("data") if isinstance(answer.json, dict) else None
        if answer.status != 200 or not isinstance(data, list):
            raise self._not_a_success(LIST_MODELS, answer, None)
        return data

    def _not_a_success(self, op: str, answer: _Answer, lora_name: str | None) -> Exception:
        """A 2xx-4xx answer that is not the success the call needs, classified."""
        if answer.status >= 400 or _error_object(answer.json) is not None:
            # The engine answered with an error: it did not act on the request.
            return self._refused(
                op,
                f"HTTP {answer.status}: {_error_message(answer.json)}",
                lora_name=lora_name,
                status=answer.status,
            )
        return self._ambiguous(
            op,
            f"HTTP {answer.status} with an answer that is neither success nor error: "
            f"{answer.text[:200]!r}",
            lora_name=lora_name,
            status=answer.status,
        )


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _error_object(body: Any) -> dict[str, Any] | None:
    """vLLM's ``{"error": {...}}`` or FastAPI's ``{"detail": ...}``, as one dict; else None."""
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, dict):
        return error
    if isinstance(error, str):
        return {"message": error}
    if "detail" in body:
        return {"message": body["detail"], "type": "detail"}
    return None


def _error_message(body: Any) -> str:
    error = _error_object(body)
    if error is not None and error.get("message"):
        return str(error["message"])
    return "no detail"
