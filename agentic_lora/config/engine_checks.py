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
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

from agentic_lora.config.settings import AgenticLoRASettings
from agentic_lora.engines.dialect import SlotSettings
from agentic_lora.engines.dialect import load_dialect
from agentic_lora.engines.pd import Role
from agentic_lora.engines.pd import check_disaggregation_mode

if TYPE_CHECKING:
    from agentic_lora.engines.backends import EngineRef
    from agentic_lora.engines.transport import EngineTransport

__all__ = ["check_engine_server_info", "slot_settings", "verify_fleet"]

logger = logging.getLogger(__name__)


def slot_settings(settings: AgenticLoRASettings, role: Role = Role.PLAIN) -> SlotSettings:
    """What ``settings`` say about the LoRA slots of a server in ``role`` (PD decode servers
    may declare their own)."""
    if role is Role.DECODE:
        return SlotSettings(settings.capacity, *settings.decode_slots())
    return SlotSettings(
        settings.capacity, settings.engine_max_loaded_loras, settings.engine_max_loras_per_batch
    )


def check_engine_server_info(
    settings: AgenticLoRASettings, engine: str, info: Mapping[str, Any]
) -> None:
    """Check one engine's server info against the settings (LoRA on, enough slots, and a PD role
    server's role), the way the settings' engine dialect reads it."""
    role = dict((ref.name, r) for ref, r in settings.fleet.servers()).get(engine, Role.PLAIN)
    check_disaggregation_mode(info, engine=engine, role=role)
    load_dialect(settings.engine_kind).check_server_info(
        info, engine=engine, slots=slot_settings(settings, role)
    )


async def verify_fleet(settings: AgenticLoRASettings, transport: EngineTransport) -> None:
    """Start-up check against the live engines (versioned mode only): LoRA on, enough slots,
    and every PD role server in its role.

    Server info is read and checked by the settings' engine dialect: through ``transport`` for
    the servers it knows (plain engines), through a transport of their own for PD role servers
    (the Sessions' transport reaches a PD group only at its router). Every role server counts:
    a decode server needs ``capacity + 1`` slots as much as a prefill server does. A dialect
    whose engines publish none (vLLM, outside its development mode) reads nothing: then the
    first publication's load and probe prove runtime LoRA on every engine before anything binds
    to it.
    """
    if not settings.enable_versioned_lora_publication:
        return
    known = {e.name for e in transport.engines}
    servers = settings.publication_engines
    plain = [ref for ref in servers if ref.name in known]
    roles = [ref for ref in servers if ref.name not in known]
    if not await _verify_servers(settings, transport, plain) or not roles:
        return
    from agentic_lora.engines.transport import EngineTransport

    async with EngineTransport(
        roles,
        request_timeout=settings.request_timeout,
        connect_timeout=settings.connect_timeout,
        http_transport=transport.http_transport,
        dialect=transport.dialect,
    ) as role_transport:
        await _verify_servers(settings, role_transport, roles)


async def _verify_servers(
    settings: AgenticLoRASettings, transport: EngineTransport, servers: Sequence[EngineRef]
) -> bool:
    """Check ``servers``; False when the dialect's engines publish no server info."""
    dialect = load_dialect(settings.engine_kind)
    for ref in servers:
        info = await dialect.read_server_info(transport.engine_http(ref.name))
        if info is None:
            logger.info(
                "the engines publish no server info; LoRA support is proven by the first "
                "publication",
                extra={"engine_kind": settings.engine_kind},
            )
            return False
        check_engine_server_info(settings, ref.name, info)
    return True
