"""The framework flag and its fail-fast validation: one test per rule, plus argparse and env."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import respx

from agentic_lora.config import AgenticLoRASettings
from agentic_lora.config import add_arguments
from agentic_lora.config import check_engine_server_info
from agentic_lora.config import from_args
from agentic_lora.config import load_settings
from agentic_lora.config import verify_fleet
from agentic_lora.engines.backends import EngineRef
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import JournalForeignError
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.session import Versioning
from tests.session_support import ENGINES
from tests.session_support import make_transport

FLEET = [f"{n}={u}" for n, u in ENGINES.items()]


def on(**values: Any) -> dict[str, Any]:
    """A valid versioned configuration, with ``values`` changed."""
    return {
        "enable_versioned_lora_publication": True,
        "engines": FLEET,
        "capacity": 2,
        "base_model_name": "Qwen/Qwen3-0.6B",
        "engine_max_loaded_loras": 3,
        "engine_max_loras_per_batch": 3,
        **values,
    }


def check_of(**values: Any) -> str:
    with pytest.raises(ConfigurationError) as err:
        AgenticLoRASettings(**values)
    assert err.value.code == "CONFIG_ERROR"
    return str(err.value.details["check"])


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("AGENTIC_LORA_"):
            monkeypatch.delenv(key)


def test_a_valid_configuration_parses_engines() -> None:
    s = AgenticLoRASettings(
        **on(engines=[*FLEET[:1], {"name": "e1", "base_url": ENGINES["e1"] + "/"}])
    )
    assert s.engines == (EngineRef("e0", ENGINES["e0"]), EngineRef("e1", ENGINES["e1"]))
    assert s.enable_versioned_lora_publication
    assert s.capacity == 2
    unnamed = AgenticLoRASettings(engines=[ENGINES["e0"]])
    assert unnamed.engines == (EngineRef("e0", ENGINES["e0"]),)


@pytest.mark.parametrize(
    ("values", "check"),
    [
        (on(engines=[]), "empty_fleet"),
        ({"engines": []}, "empty_fleet"),  # the pass-through needs engines too
        (on(engines=[FLEET[0], FLEET[0].replace("e0", "e9")]), "duplicate_engine"),
        (on(engines=[FLEET[0], FLEET[1].replace("e1", "e0")]), "duplicate_engine"),
        (on(capacity=1), "capacity"),
        (on(engine_max_loaded_loras=2), "engine_lora_slots"),
        (on(engine_max_loras_per_batch=2), "pinned_slots"),
        (on(capacity=3, engine_max_loaded_loras=4, engine_max_loras_per_batch=3), "pinned_slots"),
        (on(gateway_url="http://127.0.0.1:29000"), "router_retries"),
        (on(base_model_name=None), "base_model_name"),
        (on(base_model_name="org/model:rev"), "base_model_name"),
        (on(lora_name_prefix="policy lora"), "lora_name_prefix"),
        (on(lora_name_prefix="policy@lora"), "lora_name_prefix"),
        (on(router="round-robin"), "router"),
        (on(backend="carrier-pigeon"), "backend"),
        (on(engine_kind="vllm"), "engine_kind"),  # http-push loads through SGLang's routes
        (on(engine_kind="vllm", backend="dcs"), "engine_kind"),
        (on(backend="vllm"), "engine_kind"),  # the vLLM backend on an SGLang fleet
        (on(engine_kind="trt"), "settings"),
        (on(journal_path="/nonexistent-dir/registry.db"), "journal_path"),
        (on(capacity="two"), "settings"),
        (on(engines=["e0=ftp://127.0.0.1:1"]), "settings"),
        (on(engines=["=http://127.0.0.1:1"]), "settings"),
        (on(unknown_option=1), "settings"),
        (on(request_timeout=0), "settings"),
        (on(resolve_backoff_initial=0), "resolve_backoff"),
        (on(resolve_backoff_initial=10, resolve_backoff_max=5), "resolve_backoff"),
        (on(resolve_backoff_max=float("nan")), "resolve_backoff"),
        (on(lease_ttl=0), "lease"),
        (on(lease_ttl=-5), "lease"),
        (on(lease_ttl=float("inf")), "lease"),
        (on(lease_renew_interval=60), "lease"),  # not below the default ttl
        (on(lease_ttl=10, lease_renew_interval=0), "lease"),
        (on(owner_id="rollout worker 3"), "owner_id"),
        (on(owner_id=""), "owner_id"),
        (on(lease_ttl="a minute"), "settings"),
        (on(max_version_lag=-1), "max_version_lag"),
        (on(max_version_lag="two"), "settings"),
        (on(gateway_id="gateway 1"), "gateway_id"),
        (on(gateway_id=""), "gateway_id"),
        (on(gateway_id="g" * 201), "gateway_id"),
        (on(session_name_ttl=0), "session_name_ttl"),
    ],
)
def test_every_validation_rule_fails_fast_with_its_own_check(
    values: dict[str, Any], check: str
) -> None:
    assert check_of(**values) == check


def test_flag_off_skips_the_versioned_rules_and_an_asserted_gateway_passes() -> None:
    off = AgenticLoRASettings(engines=FLEET, capacity=1, router="round-robin")
    assert not off.enable_versioned_lora_publication
    gw = AgenticLoRASettings(
        **on(gateway_url="http://127.0.0.1:29000", gateway_retries_disabled=True)
    )
    assert gw.gateway_retries_disabled


def test_engine_kind_defaults_to_sglang_and_vllm_needs_the_vllm_backend() -> None:
    assert AgenticLoRASettings(**on()).engine_kind == "sglang"
    vllm = AgenticLoRASettings(
        **on(
            engine_kind="vllm",
            backend="vllm",
            engine_max_loaded_loras=None,
            engine_max_loras_per_batch=None,
        )
    )
    assert (vllm.engine_kind, vllm.backend) == ("vllm", "vllm")


def test_environment_prefix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTIC_LORA_ENABLE_VERSIONED_LORA_PUBLICATION", "true")
    monkeypatch.setenv(
        "AGENTIC_LORA_ENGINES", '["e0=http://127.0.0.1:30000", "e1=http://127.0.0.1:30001"]'
    )
    monkeypatch.setenv("AGENTIC_LORA_BASE_MODEL_NAME", "base")
    monkeypatch.setenv("AGENTIC_LORA_CAPACITY", "3")
    monkeypatch.setenv("AGENTIC_LORA_JOURNAL_PATH", str(tmp_path / "j.db"))
    s = load_settings()
    assert s.enable_versioned_lora_publication
    assert s.capacity == 3
    assert [e.name for e in s.engines] == ["e0", "e1"]
    assert s.journal_path == tmp_path / "j.db"
    monkeypatch.setenv("AGENTIC_LORA_ENGINE_KIND", "vllm")
    monkeypatch.setenv("AGENTIC_LORA_BACKEND", "vllm")
    assert load_settings().engine_kind == "vllm"
    monkeypatch.setenv("AGENTIC_LORA_CAPACITY", "1")
    assert check_of() == "capacity"


def test_argparse_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = add_arguments(argparse.ArgumentParser())
    parser.add_argument("--framework-own-flag", default="kept")
    monkeypatch.setenv("AGENTIC_LORA_BASE_MODEL_NAME", "from-env")
    monkeypatch.setenv("AGENTIC_LORA_CAPACITY", "4")
    ns = parser.parse_args(
        [
            "--enable-versioned-lora-publication",
            "--versioned-lora-engine", FLEET[0],
            "--versioned-lora-engine", FLEET[1],
            "--versioned-lora-capacity", "2",
            "--versioned-lora-router", "least-in-flight",
            "--versioned-lora-engine-max-loaded-loras", "3",
            "--versioned-lora-engine-max-loras-per-batch", "3",
            "--versioned-lora-name-prefix", "relax_policy_lora",
        ]
    )  # fmt: skip
    s = from_args(ns)
    assert (s.capacity, s.router, s.lora_name_prefix, s.base_model_name) == (
        2,
        "least-in-flight",
        "relax_policy_lora",
        "from-env",
    )
    assert ns.framework_own_flag == "kept"
    plain = from_args(parser.parse_args(["--versioned-lora-engine", FLEET[0]]))
    assert not plain.enable_versioned_lora_publication
    env_capacity = from_args(
        parser.parse_args(
            ["--enable-versioned-lora-publication", "--versioned-lora-engine", FLEET[0]]
        )
    )
    assert env_capacity.capacity == 4  # not given on the command line: the environment's
    with pytest.raises(ConfigurationError) as err:
        from_args(
            parser.parse_args(
                [
                    "--enable-versioned-lora-publication",
                    "--versioned-lora-engine",
                    FLEET[0],
                    "--versioned-lora-capacity",
                    "1",
                ]
            )
        )
    assert err.value.details["check"] == "capacity"
    flags = ["--enable-versioned-lora-publication", "--versioned-lora-engine", FLEET[0]]
    kind = ["--versioned-lora-engine-kind", "vllm", "--versioned-lora-backend", "vllm"]
    vllm = from_args(parser.parse_args([*flags, *kind]))
    assert (vllm.engine_kind, vllm.backend) == ("vllm", "vllm")
    with pytest.raises(SystemExit):
        parser.parse_args(["--versioned-lora-engine-kind", "trt"])


def test_engine_server_info_is_checked_against_the_settings() -> None:
    s = AgenticLoRASettings(**on())
    check_engine_server_info(
        s, "e0", {"enable_lora": True, "max_loaded_loras": 3, "max_loras_per_batch": 3}
    )
    cases: list[tuple[dict[str, Any], str]] = [
        ({"enable_lora": False}, "engine_lora"),
        ({"enable_lora": True, "max_loaded_loras": 2}, "engine_lora_slots"),
        ({"enable_lora": True, "max_loras_per_batch": 2}, "pinned_slots"),
        (
            {"enable_lora": True, "max_loaded_loras": 4, "max_loras_per_batch": 3},
            "engine_lora_slots",
        ),
    ]
    for info, check in cases:
        with pytest.raises(ConfigurationError) as err:
            check_engine_server_info(s, "e0", info)
        assert err.value.details["check"] == check


@pytest.mark.asyncio
async def test_verify_fleet_reads_every_engine() -> None:
    s = AgenticLoRASettings(**on(engine_max_loaded_loras=None, engine_max_loras_per_batch=None))
    t = make_transport()
    try:
        with respx.mock(using="httpx") as mock:
            good = {"enable_lora": True, "max_loaded_loras": 3, "max_loras_per_batch": 3}
            mock.get(ENGINES["e0"] + "/server_info").respond(200, json=good)
            e1 = mock.get(ENGINES["e1"] + "/server_info").respond(
                200, json={**good, "max_loaded_loras": 2}
            )
            with pytest.raises(ConfigurationError, match="engine e1") as err:
                await verify_fleet(s, t)
            assert err.value.details["check"] == "engine_lora_slots"
            e1.respond(200, json=good)
            await verify_fleet(s, t)
            await verify_fleet(AgenticLoRASettings(engines=FLEET), t)  # flag off: nothing to check
            calls = mock.calls.call_count
            # vLLM publishes no server info: nothing is read (the first publication proves LoRA).
            await verify_fleet(AgenticLoRASettings(**on(engine_kind="vllm", backend="vllm")), t)
            assert mock.calls.call_count == calls
    finally:
        await t.aclose()


@pytest.mark.asyncio
async def test_versioning_from_settings_with_the_flag_on_and_off(tmp_path: Path) -> None:
    s = AgenticLoRASettings(**on(journal_path=tmp_path / "registry.db", router="least-in-flight"))
    v = Versioning.from_settings(s)
    assert v.enabled
    assert isinstance(v.registry, LocalRegistry)
    assert type(v.router).__name__ == "LeastInFlightRouter"
    assert [e.name for e in v.engines] == ["e0", "e1"]
    await v.aclose()
    off = Versioning.from_settings(AgenticLoRASettings(engines=FLEET))
    assert not off.enabled
    assert off.registry is None
    await off.aclose()
    vllm = Versioning.from_settings(AgenticLoRASettings(**on(engine_kind="vllm", backend="vllm")))
    assert vllm.dialect.name == "vllm"
    await vllm.aclose()


@pytest.mark.asyncio
async def test_the_registry_identity_of_settings_is_the_one_their_journal_keeps(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "registry.db"
    s = AgenticLoRASettings(
        **on(journal_path=journal, deployment_epoch=3, lora_name_prefix="team_lora")
    )
    assert s.registry_identity == {
        "engines": ["e0", "e1"],
        "capacity": 2,
        "deployment_epoch": 3,
        "prefix": "team_lora",
    }
    v = Versioning.from_settings(s)
    await v.aclose()
    # Another process given the same settings opens the same journal (the Ray example's registry
    # actor takes the same identity); a registry of other settings is refused it.
    same = LocalRegistry(**s.registry_identity, journal_path=journal)
    await same.aclose()
    other = AgenticLoRASettings(**on(journal_path=journal, deployment_epoch=4))
    with pytest.raises(JournalForeignError):
        LocalRegistry(**other.registry_identity, journal_path=journal)


def test_lease_settings_defaults_environment_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    s = AgenticLoRASettings(**on())
    assert (s.lease_ttl, s.lease_renew_interval, s.owner_id) == (60.0, None, None)
    monkeypatch.setenv("AGENTIC_LORA_LEASE_TTL", "30")
    monkeypatch.setenv("AGENTIC_LORA_OWNER_ID", "rollout-worker-3")
    env = AgenticLoRASettings(**on())
    assert (env.lease_ttl, env.owner_id) == (30.0, "rollout-worker-3")
    parser = add_arguments(argparse.ArgumentParser())
    given = [
        "--enable-versioned-lora-publication",
        "--versioned-lora-engine", FLEET[0],
        "--versioned-lora-base-model", "base",
        "--versioned-lora-lease-renew-interval", "15",
        "--versioned-lora-owner-id", "rollout-worker-7",
    ]  # fmt: skip
    flags = from_args(parser.parse_args([*given, "--versioned-lora-lease-ttl", "90"]))
    assert (flags.lease_ttl, flags.lease_renew_interval, flags.owner_id) == (
        90.0,
        15.0,
        "rollout-worker-7",
    )
    with pytest.raises(ConfigurationError) as err:
        from_args(parser.parse_args([*given, "--versioned-lora-lease-ttl", "10"]))
    assert err.value.details["check"] == "lease"  # the renew interval 15 is not below 10


def test_max_version_lag_defaults_environment_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert AgenticLoRASettings(**on()).max_version_lag is None  # off by default
    assert AgenticLoRASettings(**on(max_version_lag=0)).max_version_lag == 0
    monkeypatch.setenv("AGENTIC_LORA_MAX_VERSION_LAG", "4")
    assert AgenticLoRASettings(**on()).max_version_lag == 4
    parser = add_arguments(argparse.ArgumentParser())
    given = [
        "--enable-versioned-lora-publication",
        "--versioned-lora-engine", FLEET[0],
        "--versioned-lora-base-model", "base",
    ]  # fmt: skip
    assert from_args(parser.parse_args(given)).max_version_lag == 4  # env under no flag
    flags = parser.parse_args([*given, "--versioned-lora-max-version-lag", "2"])
    assert from_args(flags).max_version_lag == 2  # the flag wins over the environment
    with pytest.raises(ConfigurationError) as err:
        from_args(parser.parse_args([*given, "--versioned-lora-max-version-lag", "-1"]))
    assert err.value.details["check"] == "max_version_lag"


def test_max_version_lag_in_the_serve_config_file(tmp_path: Path) -> None:
    from agentic_lora.cli import serve_options

    config = tmp_path / "serve.toml"
    config.write_text(
        "enable_versioned_lora_publication = true\n"
        f"engines = [{FLEET[0]!r}]\n"
        'base_model_name = "base"\n'
        "max_version_lag = 3\n"
    )
    options = serve_options(["--config", str(config)])
    assert options.settings.max_version_lag == 3
    flagged = serve_options(["--config", str(config), "--versioned-lora-max-version-lag", "1"])
    assert flagged.settings.max_version_lag == 1


@pytest.mark.asyncio
async def test_versioning_from_settings_passes_the_version_lag_bound() -> None:
    bounded = Versioning.from_settings(AgenticLoRASettings(**on(max_version_lag=3)))
    assert bounded.max_version_lag == 3
    await bounded.aclose()
    unbounded = Versioning.from_settings(AgenticLoRASettings(**on()))
    assert unbounded.max_version_lag is None
    await unbounded.aclose()


@pytest.mark.asyncio
async def test_versioning_from_settings_builds_the_owner_lease() -> None:
    s = AgenticLoRASettings(**on(owner_id="rollout-worker-3", lease_ttl=30))
    v = Versioning.from_settings(s)
    assert v.lease is not None
    assert (v.lease.owner, v.lease.ttl, v.lease.renew_interval) == ("rollout-worker-3", 30.0, 10.0)
    assert v.lease.owner_configured
    assert v.lease.on_restart == "release"
    await v.aclose()
    gateway = Versioning.from_settings(s, lease_owner="gateway-0", lease_on_restart="adopt")
    assert gateway.lease is not None
    assert (gateway.lease.owner, gateway.lease.on_restart) == ("gateway-0", "adopt")
    await gateway.aclose()
    default = Versioning.from_settings(AgenticLoRASettings(**on()))
    assert default.lease is not None
    assert not default.lease.owner_configured  # hostname-pid: only the TTL frees its Sessions
    await default.aclose()
    off = Versioning.from_settings(AgenticLoRASettings(engines=FLEET))
    assert off.lease is None
    await off.aclose()


def test_resolve_backoff_defaults_and_flags() -> None:
    s = AgenticLoRASettings(**on())
    assert (s.resolve_backoff_initial, s.resolve_backoff_max) == (1.0, 30.0)
    parser = add_arguments(argparse.ArgumentParser())
    flags = from_args(
        parser.parse_args(
            [
                "--enable-versioned-lora-publication",
                "--versioned-lora-engine", FLEET[0],
                "--versioned-lora-base-model", "base",
                "--versioned-lora-resolve-backoff-initial", "0.5",
                "--versioned-lora-resolve-backoff-max", "8",
            ]
        )
    )  # fmt: skip
    assert (flags.resolve_backoff_initial, flags.resolve_backoff_max) == (0.5, 8.0)
