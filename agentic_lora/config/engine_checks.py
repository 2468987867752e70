"""The engines checked against the settings: server info and LoRA slots.

:func:`verify_fleet` runs at start-up against the live engines (versioned mode only);
:func:`check_engine_server_info` checks one engine's server info (``agentic-lora doctor`` uses
it). Both read and judge server info the way the settings' engine dialect does
(:mod:`agentic_lora.engines.dialect`); a failure is a
:class:`~agentic_lora.errors.ConfigurationError` with check ``engine_lora``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agentic_lora.config.settings import AgenticLoRASettings
from agentic_lora.engines.dialect import SlotSettings, load_dialect

if TYPE_CHECKING:
    from agentic_lora.transport import EngineTransport

__all__ = ["check_engine_server_info", "slot_settings", "verify_fleet"]

logger = logging.getLogger(__name__)


def slot_settings(settings: AgenticLoRASettings) -> SlotSettings:
    """What ``settings`` say about the engines' LoRA slots."""
    return SlotSettings(
        settings.capacity, settings.engine_max_loaded_loras, settings.engine_max_loras_per_batch
    )


def check_engine_server_info(
    settings: AgenticLoRASettings, engine: str, info: Mapping[str, Any]
) -> None:
    """Check one engine's server info against the settings (LoRA on, enough slots), the way the
    settings' engine dialect reads it."""
    load_dialect(settings.engine_kind).check_server_info(
        info, engine=engine, slots=slot_settings(settings)
    )


async def verify_fleet(settings: AgenticLoRASettings, transport: EngineTransport) -> None:
    """Start-up check against the live engines (versioned mode only): LoRA on, enough slots.

    Server info is read and checked by the settings' engine dialect through ``transport``. A
    dialect whose engines publish none (vLLM, outside its development mode) reads nothing: then
    the first publication's load and probe prove runtime LoRA on every engine before anything
    binds to it.
    """
    if not settings.enable_versioned_lora_publication:
        return
    dialect = load_dialect(settings.engine_kind)
    slots = slot_settings(settings)
    for ref in settings.engines:
        info = await dialect.read_server_info(transport.engine_http(ref.name))
        if info is None:
            logger.info(
                "the engines publish no server info; LoRA support is proven by the first "
                "publication",
                extra={"engine_kind": settings.engine_kind},
            )
            return
        dialect.check_server_info(info, engine=ref.name, slots=slots)
