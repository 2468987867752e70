"""The package's layers (scripts/layers.py): no import goes upward beyond the recorded number."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def layers() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "agentic_lora_layers", ROOT / "scripts" / "layers.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def test_every_module_has_a_layer_and_upward_imports_do_not_grow(layers: ModuleType) -> None:
    imports = layers.package_imports(ROOT)
    assert len(imports) > 100  # the walk really read the package
    up, unplaced = layers.upward(imports)
    assert unplaced == [], "place these modules in a layer of scripts/layers.py"
    running = [f"{i.importer}:{i.line} -> {i.imported}" for i in up if not i.typing_only]
    typing_only = [f"{i.importer}:{i.line} -> {i.imported}" for i in up if i.typing_only]
    assert len(running) <= layers.RECORDED_UPWARD, running
    assert len(typing_only) <= layers.RECORDED_UPWARD_TYPING, typing_only


def test_no_import_cycles(layers: ModuleType) -> None:
    """No two package modules import each other, not even inside a function or for typing."""
    cycles = layers.import_cycles(layers.package_imports(ROOT))
    assert len(cycles) <= layers.RECORDED_CYCLES, cycles


def test_folders_are_the_layers(layers: ModuleType) -> None:
    """Only the public names and the error tree sit at the top of the package; every other module
    lives in the folder of its layer, so the tree alone says where a thing belongs."""
    top_level = sorted(p.name for p in (ROOT / "agentic_lora").glob("*.py"))
    assert top_level == ["__init__.py", "errors.py"]
    folders = {name for name, _, prefixes in layers.LAYERS for name in prefixes}
    for path in (ROOT / "agentic_lora").glob("*/"):
        if (path / "__init__.py").exists():
            assert path.name in folders, f"{path.name}/ is in no layer of scripts/layers.py"


def test_no_module_is_over_500_lines() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
        for tree in ("agentic_lora", "plugins", "routers")
        for path in (ROOT / tree).rglob("*.py")
    }
    assert len(sizes) > 100
    assert {path: n for path, n in sizes.items() if n > 500} == {}


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_upward_imports_are_found_and_told_apart(layers: ModuleType, tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "agentic_lora/__init__.py": "from agentic_lora.gateway import app\n",
            "agentic_lora/errors.py": "import agentic_lora.gateway.app\n",
            "agentic_lora/adapters/store.py": "",
            "agentic_lora/adapters/snapshot.py": "from . import store\nfrom agentic_lora import errors\n",
            "agentic_lora/registry/__init__.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from agentic_lora.config import AgenticLoRASettings\n"
            ),
            "agentic_lora/config/__init__.py": "from ..registry import api\n",
            "agentic_lora/gateway/__init__.py": "",
            "agentic_lora/gateway/app.py": "def f() -> None:\n    from agentic_lora import cli\n",
            "agentic_lora/cli.py": "",
            "agentic_lora/engines/transport.py": "import agentic_lora_http\n",
            "agentic_lora/mystery.py": "from agentic_lora import errors\n",
            "plugins/agentic_lora_http/__init__.py": "import agentic_lora.gateway\n",
        },
    )
    up, unplaced = layers.upward(layers.package_imports(tmp_path))
    found = {(i.importer, i.imported, i.typing_only) for i in up}
    assert found == {
        ("agentic_lora.errors", "agentic_lora.gateway.app", False),
        ("agentic_lora.registry", "agentic_lora.config", True),
        ("agentic_lora.engines.transport", "agentic_lora_http", False),  # a plugin: never imported
    }
    assert unplaced == ["agentic_lora.mystery"]


def test_import_cycles_of_every_kind_and_length_are_found(
    layers: ModuleType, tmp_path: Path
) -> None:
    _write(
        tmp_path,
        {
            "agentic_lora/__init__.py": "",
            "agentic_lora/errors.py": "",
            # two modules, one import inside a function
            "agentic_lora/cli/main.py": "from agentic_lora.cli import serve\n",
            "agentic_lora/cli/serve.py": "def f() -> None:\n    from agentic_lora.cli.main import g\n",
            # two modules, one import for type checking only
            "agentic_lora/leases/keeper.py": "from agentic_lora.leases.term import T\n",
            "agentic_lora/leases/term.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from agentic_lora.leases.keeper import K\n"
            ),
            # three modules around a ring, and one module that only joins it from outside
            "agentic_lora/engines/a.py": "from agentic_lora.engines import b\n",
            "agentic_lora/engines/b.py": "from agentic_lora.engines import c\n",
            "agentic_lora/engines/c.py": "import agentic_lora.engines.a\n",
            "agentic_lora/engines/d.py": "from agentic_lora.engines import a\n",
            # a module that imports itself is no cycle between modules
            "agentic_lora/engines/e.py": "import agentic_lora.engines.e\n",
        },
    )
    assert layers.import_cycles(layers.package_imports(tmp_path)) == [
        ["agentic_lora.cli.main", "agentic_lora.cli.serve"],
        ["agentic_lora.engines.a", "agentic_lora.engines.b", "agentic_lora.engines.c"],
        ["agentic_lora.leases.keeper", "agentic_lora.leases.term"],
    ]
