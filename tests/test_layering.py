"""The package's layering, read from its source with `ast` (nothing is imported or run):
privacy by module name, each facade's one `_engine`, and torch's private names in one place.

- No flatgrad module imports an underscore name from another flatgrad module (importing an
  internal module, ``from flatgrad import _norms``, is how internals are used).
- No flatgrad module reads or writes a private attribute that another flatgrad module
  defines (assigns as ``self._x`` or defines as ``def _x``/``class _X``), except `_engine`,
  the one attribute each facade exposes to the rest of the package.
- Private torch names (``torch._C``, ``Variable._execution_engine``, DDP's class-level
  helpers, ``torch.utils._pytree``, ...) are used in `flatgrad/_torch_compat.py` only. The
  benchmark package (`flatgrad/bench`) measures torch's internals and is not held to this;
  ``torch._foreach_*`` are the multi-tensor ops torch.optim itself is built on, used as API.
"""

from __future__ import annotations

import ast
import collections
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flatgrad"
MODULES = {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.glob("*.py"))}
FACADE_ATTRIBUTE = "_engine"
COMPAT = PACKAGE / "_torch_compat.py"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_privates() -> dict[str, set[Path]]:
    """Private names each module defines: ``self._x = ...``, ``def _x``, ``class _X``."""
    defined: dict[str, set[Path]] = collections.defaultdict(set)
    for path, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and _private(node.name):
                defined[node.name].add(path)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and _private(node.attr)
            ):
                defined[node.attr].add(path)
    return defined


def _cross_module_private_accesses() -> list[str]:
    defined = _defined_privates()
    found = []
    for path, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flatgrad"):
                found += [
                    f"{path.name}:{node.lineno} from {node.module} import {alias.name}"
                    for alias in node.names
                    if _private(alias.name) and not (PACKAGE / f"{alias.name}.py").exists()
                ]
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            owners = defined.get(node.attr, set())
            if node.attr != FACADE_ATTRIBUTE and owners and path not in owners:
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def _torch_private_uses() -> list[str]:
    found = []
    for path, tree in MODULES.items():
        if path == COMPAT:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                parts = node.module.split(".") + [alias.name for alias in node.names]  # type: ignore[union-attr]
                if any(_private(part) for part in parts):
                    found.append(f"{path.name}:{node.lineno} from {node.module} import ...")
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and not node.attr.startswith("_foreach_")
            ):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in ("torch", "dist", "DDP", "Variable"):
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_module_reaches_into_another_modules_privates():
    assert _cross_module_private_accesses() == []


def test_private_torch_names_are_used_in_torch_compat_only():
    assert _torch_private_uses() == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from flatgrad.comm import _check\n", "from flatgrad.comm import _check"),
        ("def f(flat):\n    return flat._store\n", "flat._store"),
    ],
)
def test_the_scan_finds_what_it_forbids(source, expected, monkeypatch):
    """The scan itself: a module that imports another's private name, or reads a private
    attribute another module defines (`_store` is one), is reported."""
    modules = dict(MODULES)
    modules[PACKAGE / "_probe.py"] = ast.parse(source)
    monkeypatch.setattr(sys.modules[__name__], "MODULES", modules)
    modules[PACKAGE / "_owner.py"] = ast.parse("class A:\n    def __init__(self):\n        self._store = 1\n")
    assert any(expected in line for line in _cross_module_private_accesses())


def test_the_torch_scan_finds_a_private_torch_name(monkeypatch):
    modules = dict(MODULES)
    modules[PACKAGE / "_probe.py"] = ast.parse("import torch\nx = torch._C._current_graph_task_id()\n")
    monkeypatch.setattr(sys.modules[__name__], "MODULES", modules)
    assert any("torch._C" in line for line in _torch_private_uses())


# Functions only: "size follows the job" (STYLE.md) for modules and classes, whose caps cut
# files to fit a number rather than a job (REDESIGN.md); a function over 60 lines still does
# more than one thing.
MAX_FUNCTION_LINES = 60


def _oversized() -> list[str]:
    """Functions over 60 lines (AST spans, docstrings included), in the package outside
    `flatgrad/bench`."""
    found = []
    for path, tree in MODULES.items():
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            span = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            if span > MAX_FUNCTION_LINES:
                found.append(f"{path.name}:{node.lineno} {node.name}: {span} lines")
    return found


def test_no_function_is_oversized():
    """One job per function, as a size: a function over 60 lines has more than one and is
    cut before it lands."""
    assert _oversized() == []


def test_the_size_scan_finds_a_long_function(monkeypatch, tmp_path):
    """The size scan itself: a 61-line function is reported."""
    probe = tmp_path / "_probe.py"
    probe.write_text("def f():\n" + "    x = 1\n" * 59 + "    return x\n")
    monkeypatch.setattr(sys.modules[__name__], "MODULES", {probe: ast.parse(probe.read_text())})
    assert _oversized() == ["_probe.py:1 f: 61 lines"]
