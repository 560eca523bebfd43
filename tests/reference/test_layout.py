"""The layout of ``reference/`` (README's module table and ``reference/__init__.py``'s index): imports
go one way, and no module reads another module's private names. Checked on the source (AST), with
function-local and ``TYPE_CHECKING`` imports counted like module-level ones. The suite's package of
generated cases (``conformance/generated/``) keeps the same two rules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "reference"
#: Other packages held to the same rules (no import cycles, no private names read across modules).
OTHER_PACKAGES = ("conformance.generated",)

#: nn.Module internals with no public equivalent, each used where a comment says why.
TORCH_PRIVATE_ATTRIBUTES = {
    "_parameters",  # put a plain tensor (a view) under a parameter's name; register None placeholders
    "_modules",  # walk children in registration order, None entries included
    "_orig_mod",  # torch.compile's OptimizedModule holds the module there (no public accessor)
    "_make_subclass",  # how nn.Parameter builds a subclass instance around existing data
}
#: Private names that are part of the public API on purpose.
PUBLIC_PRIVATE_NAMES = {"_OptimStateKey"}  # mirrors torch's private class name (SPEC OS)
#: reference/checkpoint/ is checked for cycles with the rest, not for private access (another
#: package's owner; see the report of issue 12).
PRIVATE_ACCESS_EXEMPT = ("reference.checkpoint",)


def _modules(package: str = "reference") -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.joinpath(*package.split(".")).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` (one package's) that ``module`` imports, at any depth of its code."""
    out: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                if candidate in known:
                    out.add(candidate)
                elif base in known:
                    out.add(base)
    out.discard(module)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _import_cycle(package: str) -> list[str] | None:
    modules = _modules(package)
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    # A package's __init__ re-exports its submodules; a submodule importing its own package back would
    # be a cycle through the __init__, and is one here.
    return _cycle(graph)


def test_no_import_cycles() -> None:
    cycle = _import_cycle("reference")
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("package", OTHER_PACKAGES)
def test_no_import_cycles_in_other_packages(package: str) -> None:
    assert len(_modules(package)) > 1, f"{package}: no modules found"
    cycle = _import_cycle(package)
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


def _private_reads(package: str, module: str) -> list[str]:
    """``from <package>.x import _name`` and ``obj._name`` for a ``_name`` that ``module`` does not
    define itself (besides the nn.Module internals listed above)."""
    tree = ast.parse(_modules(package)[module].read_text())
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


@pytest.mark.parametrize("module", [m for m in _modules() if not m.startswith(PRIVATE_ACCESS_EXEMPT)])
def test_no_module_reads_another_modules_private_names(module: str) -> None:
    """No ``from reference.x import _name`` and no ``obj._name`` for a ``_name`` this module does not
    define itself (besides the nn.Module internals listed above)."""
    bad = _private_reads("reference", module)
    assert not bad, f"{module}: " + "; ".join(bad)


@pytest.mark.parametrize("module", [m for package in OTHER_PACKAGES for m in _modules(package)])
def test_no_module_of_other_packages_reads_private_names(module: str) -> None:
    """The same rule for the modules of :data:`OTHER_PACKAGES`: shared helpers have public names."""
    package = next(p for p in OTHER_PACKAGES if module == p or module.startswith(p + "."))
    bad = _private_reads(package, module)
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
