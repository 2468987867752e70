"""What the publisher, reclaimer and resolver tests read off the real registry (no tests here)."""

from __future__ import annotations

from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import new_request_id


class RegistryReads:
    """Reads and Session verbs on ``registry``, for a test world dataclass that has one."""

    registry: LocalRegistry

    async def close(self, key: str) -> None:
        """Close a Session the registry way: begin_close, then release."""
        await self.registry.begin_close(request_id=new_request_id(), session_key=key)
        await self.registry.release(request_id=new_request_id(), session_key=key)

    async def default(self) -> str | None:
        return (await self.registry.status()).default_version

    async def slots(self) -> int:
        return (await self.registry.status()).slots_in_use

    def state(self, version_id: str) -> VersionState:
        status = self.registry.peek_version(version_id)
        assert status is not None
        return status.state

    def name(self, version_id: str) -> str:
        status = self.registry.peek_version(version_id)
        assert status is not None
        return status.lora_name
