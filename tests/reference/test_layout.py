"""The layout of ``reference/`` (docs/design.md's package table and ``reference/__init__.py``'s index): imports
go one way, and no module reads another module's private names. Checked on the source (AST), with
function-local and ``TYPE_CHECKING`` imports counted like module-level ones."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.layout_rules import ROOT, find_cycle, import_graph, modules_of

PACKAGE = ROOT / "reference"

#: nn.Module internals with no public equivalent, each used where a comment says why.
TORCH_PRIVATE_ATTRIBUTES = {
    "_parameters",  # put a plain tensor (a view) under a parameter's name; register None placeholders
    "_modules",  # walk children in registration order, None entries included
    "_orig_mod",  # torch.compile's OptimizedModule holds the module there (no public accessor)
    "_make_subclass",  # how nn.Parameter builds a subclass instance around existing data
}
#: Private names that are part of the public API on purpose.
PUBLIC_PRIVATE_NAMES = {"_OptimStateKey"}  # mirrors torch's private class name (SPEC OS)


def _modules() -> dict[str, Path]:
    return modules_of("reference")


def test_no_import_cycles() -> None:
    # A package's __init__ re-exports its submodules; a submodule importing its own package back would
    # be a cycle through the __init__, and is one here. (The finder's self-test: tests/test_layout.py.)
    cycle = find_cycle(import_graph(_modules()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _defined_private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, module and class attributes, ``self._x``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.slice, ast.Constant):
            out.add(str(node.slice.value))  # self.__dict__["_x"] = ...
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


@pytest.mark.parametrize("module", list(_modules()))
def test_no_module_reads_another_modules_private_names(module: str) -> None:
    """No ``from reference.x import _name`` and no ``obj._name`` for a ``_name`` this module does not
    define itself (besides the nn.Module internals listed above)."""
    tree = ast.parse(_modules()[module].read_text())
    own = _defined_private_names(tree)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("reference"):
            bad += [f"line {node.lineno}: imports {a.name} from {node.module}" for a in node.names
                    if a.name.startswith("_") and a.name not in PUBLIC_PRIVATE_NAMES]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr not in own and node.attr not in TORCH_PRIVATE_ATTRIBUTES:
                bad.append(f"line {node.lineno}: reads .{node.attr}")
    assert not bad, f"{module}: " + "; ".join(bad)


def test_package_index_lists_every_public_module() -> None:
    index = (PACKAGE / "__init__.py").read_text()
    public = [m for m in _modules() if m != "reference" and not any(p.startswith("_") for p in m.split("."))]
    missing = [m for m in public if not m.startswith("reference.checkpoint.") and f":mod:`{m}`" not in index]
    assert not missing, f"reference/__init__.py does not list {missing}"


def test_every_package_init_states_its_exports() -> None:
    for init in PACKAGE.rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), f"{init} has no docstring"
        if init.parent != PACKAGE:
            assert any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets) for n in tree.body), (
                f"{init} has no __all__"
            )
