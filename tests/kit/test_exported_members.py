"""The public surface: what ``agentic_lora`` exports, and what importing it costs."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys

import agentic_lora
import agentic_lora.errors
import agentic_lora.session.in_flight
import agentic_lora.session.middleware


def test_all_lists_exactly_the_public_names() -> None:
    public = {name for name in dir(agentic_lora) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(agentic_lora, name)).__name__ == "module"}
    assert set(agentic_lora.__all__) - {"__version__"} == public - modules
    for name in agentic_lora.__all__:
        assert hasattr(agentic_lora, name), name


def test_every_error_class_is_exported_and_has_a_unique_stable_code() -> None:
    errors = [
        obj
        for obj in vars(agentic_lora.errors).values()
        if isinstance(obj, type) and issubclass(obj, agentic_lora.AgenticLoRAError)
    ]
    codes = [e.code for e in errors]
    assert len(codes) == len(set(codes))
    assert {e.__name__ for e in errors} == set(agentic_lora.errors.__all__) - {
        "error_code",
        "error_from_code",
    }
    for e in errors:
        assert e.code.isupper()
        if not e.__subclasses__():  # every concrete error is named in the tree drawn at the top
            assert f"{e.__name__} " in agentic_lora.errors.__doc__, e
            assert f" {e.code} " in agentic_lora.errors.__doc__, e


def test_the_middleware_package_exports_what_its_modules_declare() -> None:
    package = agentic_lora.session.middleware
    declared: dict[str, object] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        declared |= {name: getattr(module, name) for name in module.__all__}
        # A module importing a sibling through the package, while the package's __init__ is
        # still running, gets a partly built package: every sibling is imported by its own path.
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.ImportFrom):
                assert node.module != package.__name__, (module.__name__, node.lineno)
    in_flight = agentic_lora.session.in_flight
    declared |= {name: getattr(in_flight, name) for name in in_flight.__all__}
    assert {name: getattr(package, name) for name in package.__all__} == declared


def test_importing_the_core_pulls_neither_torch_nor_ray() -> None:
    code = (
        "import sys, agentic_lora, agentic_lora_http, agentic_lora_routers; "
        "bad = [m for m in ('torch', 'ray', 'fastapi', 'prometheus_client') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
