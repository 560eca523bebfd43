"""The layout of ``reference/`` (docs/design.md's package table and ``reference/__init__.py``'s index): imports
go one way, and no module reads another module's private names. Checked on the source (AST), with
function-local and ``TYPE_CHECKING`` imports counted like module-level ones. The suite's package of
generated cases (``conformance/generated/``) keeps the same private-name rule; import cycles of every
package are checked by ``tests/test_layout.py``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.layout_rules import ROOT, find_cycle, import_graph, modules_of

PACKAGE = ROOT / "reference"
#: Other packages held to the private-name rule (no private names read across their modules).
OTHER_PACKAGES = ("conformance.generated",)

#: nn.Module (and standard-library) internals with no public equivalent, each used where a comment says why.
TORCH_PRIVATE_ATTRIBUTES = {
    "_inverted_registry",  # copyreg's extension codes: how a refused record's EXT1/2/4 opcodes are named
    "_parameters",  # put a plain tensor (a view) under a parameter's name; register None placeholders
    "_modules",  # walk children in registration order, None entries included
    "_orig_mod",  # torch.compile's OptimizedModule holds the module there (no public accessor)
    "_make_subclass",  # how nn.Parameter builds a subclass instance around existing data
    "_spec",  # an async save's staged DTensor keeps a GPU mesh's shard on the host (from_local moves it)
    "_get_default_store",  # async saves' background groups meet in the default group's store (no public accessor)
}
#: Private names that are part of the public API on purpose.
PUBLIC_PRIVATE_NAMES = {"_OptimStateKey"}  # mirrors torch's private class name (SPEC OS)


def _modules() -> dict[str, Path]:
    return modules_of("reference")


def _other_modules() -> dict[str, tuple[str, Path]]:
    """Module -> (its package among OTHER_PACKAGES, its file)."""
    out = {}
    for package in OTHER_PACKAGES:
        for name, path in modules_of(package.split(".")[0]).items():
            if name == package or name.startswith(package + "."):
                out[name] = (package, path)
    return out


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


def _private_reads(package: str, path: Path) -> list[str]:
    """``from <package>.x import _name`` and ``obj._name`` for a ``_name`` that the module at ``path``
    does not define itself (besides the nn.Module internals listed above)."""
    tree = ast.parse(path.read_text())
    own = _defined_private_names(tree)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package):
            bad += [f"line {node.lineno}: imports {a.name} from {node.module}" for a in node.names
                    if a.name.startswith("_") and a.name not in PUBLIC_PRIVATE_NAMES]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr not in own and node.attr not in TORCH_PRIVATE_ATTRIBUTES:
                bad.append(f"line {node.lineno}: reads .{node.attr}")
    return bad


@pytest.mark.parametrize("module", list(_modules()))
def test_no_module_reads_another_modules_private_names(module: str) -> None:
    """No ``from reference.x import _name`` and no ``obj._name`` for a ``_name`` this module does not
    define itself (besides the nn.Module internals listed above)."""
    bad = _private_reads("reference", _modules()[module])
    assert not bad, f"{module}: " + "; ".join(bad)


@pytest.mark.parametrize("module", list(_other_modules()))
def test_no_module_of_other_packages_reads_private_names(module: str) -> None:
    """The same rule for the modules of :data:`OTHER_PACKAGES`: shared helpers have public names."""
    package, path = _other_modules()[module]
    bad = _private_reads(package, path)
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
