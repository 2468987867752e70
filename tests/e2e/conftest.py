"""The stack every end-to-end test runs: real engines, recording proxies, the real product.

Per test: one :class:`~tests.e2e.recording_proxy.RecordingProxy` per engine, a
:class:`~agentic_lora.assembly.deployment.Deployment` (LocalRegistry, Sessions, publisher, background
reclaimer) whose engines are the proxies, and the real HTTP push backend behind
:class:`~tests.e2e.support.GatedBackend`. The engines are the session's shared fleet, so each
test leaves them as it found them: every adapter it caused to be loaded (published, baseline or
implicitly reloaded) is unloaded in teardown, and the engines must list exactly what they listed
before. Version ids are fresh per test, so no two tests ever name the same adapter.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from agentic_lora_harness.engines import EngineFleet
from agentic_lora_http import HttpPushBackend

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import load_settings
from agentic_lora.publication.publisher import PublicationResult
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import VersionStatus
from agentic_lora.session import Session
from tests.direct_http import engine_client
from tests.e2e.recording_proxy import RecordingProxy
from tests.e2e.recording_proxy import TrafficLog
from tests.e2e.recording_proxy import forbidden_exchanges
from tests.e2e.support import ChatTokens
from tests.e2e.support import EngineLog
from tests.e2e.support import GatedBackend
from tests.e2e.support import RegistryWatch
from tests.e2e.support import fleet_config
from tests.e2e.support import fresh_id
from tests.e2e.support import open_on

# The fleet fixtures (engine_env, model_fixture, engine_fleet) come from tests/conftest.py.

#: The first test to ask for the fleet may pay for creating the engine venv and starting both
#: engines (minutes on a fresh machine); the ini timeout is for the test, not for that.
_FLEET_SETUP_TIMEOUT_SECONDS = 1800

ADAPTERS = ("A", "B", "C")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents and "engine_fleet" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(_FLEET_SETUP_TIMEOUT_SECONDS))


async def _adapter_names(client: httpx.AsyncClient, base_url: str) -> set[str]:
    response = await client.get(f"{base_url}/v1/models")
    assert response.status_code == 200, response.text
    return {card["id"] for card in response.json()["data"] if card.get("parent") is not None}


@pytest_asyncio.fixture
async def raw_client() -> AsyncIterator[httpx.AsyncClient]:
    """A client straight to the engines (baselines, controls, clean-up): not via the proxies."""
    async with engine_client() as client:
        yield client


@pytest_asyncio.fixture
async def engines_restored(
    engine_fleet: EngineFleet, raw_client: httpx.AsyncClient
) -> AsyncIterator[EngineFleet]:
    """The shared fleet; on exit every adapter this test left on an engine is unloaded."""
    before = {name: await _adapter_names(raw_client, url) for name, url in engine_fleet.engines}
    yield engine_fleet
    for name, url in engine_fleet.engines:
        for leftover in sorted(await _adapter_names(raw_client, url) - before[name]):
            # Waits, like any unload, for requests still using it (none should be left).
            response = await raw_client.post(
                f"{url}/unload_lora_adapter", json={"lora_name": leftover}
            )
            assert response.json()["success"] is True, response.text
    after = {name: await _adapter_names(raw_client, url) for name, url in engine_fleet.engines}
    assert after == before


@dataclass
class Stack:
    """Everything one end-to-end test drives and observes."""

    fleet: EngineFleet
    traffic: TrafficLog
    proxies: dict[str, RecordingProxy]
    backend: GatedBackend
    deployment: Deployment
    watch: RegistryWatch
    logs: dict[str, EngineLog]
    chat: ChatTokens
    raw: httpx.AsyncClient
    store_root: Path
    snapshots: dict[str, AdapterSnapshot]
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def engine_names(self) -> list[str]:
        return self.fleet.names

    @property
    def registry(self) -> LocalRegistry:
        """The deployment's registry: a LocalRegistry in every end-to-end stack."""
        registry = self.deployment.registry
        assert isinstance(registry, LocalRegistry)
        return registry

    def engine_url(self, engine: str) -> str:
        """The engine itself (bypassing the proxy): for baselines and controls only."""
        return self.fleet.base_url(engine)

    def version_id(self, letter: str) -> str:
        """The version id fixture adapter ``letter`` is (or will be) published under."""
        return self.versions.setdefault(letter, fresh_id(letter))

    async def publish(self, letter: str) -> PublicationResult:
        """Publish fixture adapter ``letter`` under its fresh version id through the Deployment."""
        return await self.deployment.publish(self.version_id(letter), self.snapshots[letter])

    def status(self, letter: str) -> VersionStatus:
        """The registry's current view of ``letter``'s version (no I/O)."""
        status = self.registry.peek_version(self.versions[letter])
        assert status is not None, f"{letter} was never reserved"
        return status

    def lora_name(self, letter: str) -> str:
        """The immutable adapter name the registry gave ``letter``'s version."""
        return self.status(letter).lora_name

    async def open_on(self, engine: str, label: str) -> Session:
        """A Session the deployment's router places on ``engine`` (see support.open_on)."""
        return await open_on(self.deployment.versioning, engine, fresh_id(label))


def _open_all_gates(backend: GatedBackend) -> None:
    for gate in (*backend.ready_gates.values(), *backend.reclaim_gates.values()):
        gate.set()


@pytest_asyncio.fixture
async def stack(
    engines_restored: EngineFleet, raw_client: httpx.AsyncClient, tmp_path: Path
) -> AsyncIterator[Stack]:
    """A started Deployment on the shared engines, every engine call through a RecordingProxy."""
    fleet = engines_restored
    traffic = TrafficLog()
    logs = {name: EngineLog(fleet.log_path(name)) for name in fleet.names}
    async with contextlib.AsyncExitStack() as exits:
        proxies: dict[str, RecordingProxy] = {}
        for name, url in fleet.engines:
            proxies[name] = await exits.enter_async_context(RecordingProxy(name, url, traffic))
        settings = load_settings(
            **fleet_config(
                {name: proxy.base_url for name, proxy in proxies.items()}, fleet.served_model_name
            ),
            lora_name_prefix="policy_lora",
            # The repairer's periodic probe would put incarnation reads into the quiet windows
            # these tests assert on; the engine-restart test pokes the repairer itself.
            probe_interval=3600.0,
        )
        store_root = tmp_path / "adapter-store"
        backend = GatedBackend(HttpPushBackend(store_root))
        exits.push_async_callback(backend.aclose)
        deployment = Deployment.from_settings(settings, backend=backend)
        watch = RegistryWatch(deployment.registry)
        await exits.enter_async_context(deployment)
        # Runs first on the way out: a test that failed while holding a gate must not leave a
        # publication or a reclaim waiting forever inside the Deployment's shutdown.
        exits.callback(_open_all_gates, backend)
        yield Stack(
            fleet=fleet,
            traffic=traffic,
            proxies=proxies,
            backend=backend,
            deployment=deployment,
            watch=watch,
            logs=logs,
            chat=ChatTokens(fleet.fixture.model_dir / "tokenizer.json"),
            raw=raw_client,
            store_root=store_root,
            snapshots={
                letter: AdapterSnapshot.from_peft_dir(fleet.fixture.adapter(letter))
                for letter in ADAPTERS
            },
        )
    # Whatever a test did, nothing it ran may have paused, flushed or aborted an engine wholesale.
    assert forbidden_exchanges(traffic.exchanges) == []
