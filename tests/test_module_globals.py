"""No code configures another module by writing its variables: runtime choices are arguments,
constructor parameters or the kernel policy (mode.kernels.use_kernels), never module globals
assigned from outside (`primitives.SWITCH = ...`, `monkeypatch.setattr(loss, "CHUNK", ...)`)."""
from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("mode", "bench", "launch", "tests")
SETTERS = ("setattr",)  # setattr(m, ...), monkeypatch.setattr(m, ...), mp.setattr(m, ...)


def _is_project_module(name: str) -> bool:
    if name.split(".")[0] not in PROJECT:
        return False
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _package_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])


def _module_names(tree: ast.Module, path: Path) -> dict[str, str]:
    """Local name -> the project module it is bound to by an import anywhere in the file."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    names[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = _package_of(path).split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(p for p in (*parts, base) if p)
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                if _is_project_module(full):
                    names[alias.asname or alias.name] = full
    return {local: full for local, full in names.items() if _is_project_module(full)}


def _module_of(node: ast.expr, modules: dict[str, str]) -> str | None:
    """The project module an expression (`primitives`, `mode.routing.primitives`) names, if any."""
    if isinstance(node, ast.Name):
        return modules.get(node.id)
    if isinstance(node, ast.Attribute):
        parent = _module_of(node.value, modules)
        if parent is not None and _is_project_module(f"{parent}.{node.attr}"):
            return f"{parent}.{node.attr}"
    return None


def _is_variable(module: str, name: str) -> bool:
    """A module's variable (not a function or class a test may stand in for)."""
    try:
        value = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return True  # a name the module does not define: assigning it is configuration too
    return not callable(value)


def module_writes(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    modules = _module_names(tree, path)
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and (module := _module_of(target.value, modules)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {module}.{target.attr} assigned")
        if isinstance(node, ast.Call) and len(node.args) >= 2:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            name = node.args[1]
            if called in SETTERS and isinstance(name, ast.Constant) and isinstance(name.value, str):
                module = _module_of(node.args[0], modules)
                if module and _is_variable(module, name.value):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {module}.{name.value} set by {called}")
    return found


def _sources() -> list[Path]:
    return sorted(p for top in PROJECT for p in (ROOT / top).rglob("*.py"))


def test_no_module_variable_is_assigned_from_outside_its_module() -> None:
    found = [hit for path in _sources() for hit in module_writes(path)]
    assert not found, "module variables assigned from outside their module:\n" + "\n".join(found)


@pytest.mark.parametrize("source, hits", [
    ("from mode.routing import primitives\nprimitives.SWITCH = False\n", 1),
    ("import mode.layers.loss as loss_module\nloss_module.CHUNK_ELEMENTS += 1\n", 1),
    ("import mode.routing.primitives\nmode.routing.primitives.SWITCH = 1\n", 1),
    ("import mode.kernels as kernels\ndef t(monkeypatch):\n    monkeypatch.setattr(kernels, 'ENABLED', False)\n", 1),
    ("import mode.kernels as kernels\ndef t(monkeypatch):\n    monkeypatch.setattr(kernels, 'use_triton', None)\n", 0),
    ("from mode.routing import DepthRouter\nrouter = DepthRouter(8, 0.5, 'sigmoid', False)\nrouter.random = True\n", 0),
    ("import torch\ntorch.backends.cuda.matmul.allow_tf32 = True\n", 0),
], ids=["a switch", "an augmented constant", "a dotted module", "monkeypatch of a variable", "a stand-in function",
        "an object's attribute", "another library's setting"])
def test_the_scan_finds_module_writes(tmp_path: Path, source: str, hits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ROOT / "tests" / "_module_writes_probe.py"  # under the root: paths are reported relative to it
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source)
    assert len(module_writes(path)) == hits
