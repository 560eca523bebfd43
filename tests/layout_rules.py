"""The import rules every package of this repository keeps, read from the source (AST): imports go one
way (no cycles), and no module imports another module's private names. Function-local and
``TYPE_CHECKING`` imports count like module-level ones. And what a conformance test file may define at
top level (:func:`non_test_definitions`). Used by ``tests/reference/test_layout.py`` and
``tests/test_layout.py``; self-tested there."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

__all__ = ["ROOT", "modules_of", "imports_of", "import_graph", "find_cycle", "private_imports", "non_test_definitions"]

ROOT = Path(__file__).resolve().parents[1]


def modules_of(*packages: str) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the given top-level packages."""
    out: dict[str, Path] = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules among ``known`` that ``module`` imports, at any depth of its code."""
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


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules among ``modules`` it imports."""
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
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


def private_imports(path: Path, prefixes: Iterable[str], allowed: Iterable[str] = ()) -> list[str]:
    """``from <a module under prefixes> import _name`` lines of ``path`` (besides ``allowed`` names)."""
    prefixes, allowed = tuple(prefixes), set(allowed)
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(prefixes):
            bad += [f"line {node.lineno}: imports {a.name} from {node.module}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__") and a.name not in allowed]
    return bad


def _is_fixture(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated with ``pytest.fixture`` (``@pytest.fixture``, ``@pytest.fixture(...)``, ``@fixture``)."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target) in ("pytest.fixture", "fixture"):
            return True
    return False


def _read(nodes: Iterable[ast.AST]) -> set[str]:
    return {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def non_test_definitions(path: Path) -> list[str]:
    """What a conformance test file defines at top level besides its tests (``test_*`` functions), its
    pytest fixtures and the constants its tests' and fixtures' decorators read (parametrize lists and
    ids, a constant such a constant is built from, ``pytestmark``), as ``line N: what``. Imports, the
    module docstring and ``if TYPE_CHECKING:`` imports are allowed. A constant that a test or fixture
    reads in its body is reported too: what tests use at run time belongs in a support module."""
    tree = ast.parse(path.read_text())
    body = list(tree.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]
    functions = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    in_decorators = _read(d for f in functions for d in f.decorator_list)
    in_bodies = _read(part for f in functions for part in [*f.body, f.args])
    constants: dict[str, ast.stmt] = {}
    bad = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING") and not node.orelse \
                and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in node.body):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not (node.name.startswith("test_") or _is_fixture(node)):
                bad.append(f"line {node.lineno}: function {node.name} (neither a test nor a fixture)")
            continue
        if isinstance(node, ast.ClassDef):
            bad.append(f"line {node.lineno}: class {node.name}")
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        flat = [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
        names = [t.id for t in flat if isinstance(t, ast.Name)]
        if not names or len(names) != len(flat):
            bad.append(f"line {node.lineno}: {ast.unparse(node).splitlines()[0][:80]}")
            continue
        for name in names:
            constants[name] = node
    # Allowed: read by a test's or fixture's decorator, or by the value of an allowed constant.
    allowed = {name for name in constants if name in in_decorators or name == "pytestmark"}
    grown = True
    while grown:
        read_by_allowed = _read(constants[name] for name in allowed)
        grown = bool((set(constants) - allowed) & read_by_allowed)
        allowed |= set(constants) & read_by_allowed
    for name, node in constants.items():
        if name not in allowed:
            bad.append(f"line {node.lineno}: constant {name} (no test's decorator reads it)")
        elif name in in_bodies:
            bad.append(f"line {node.lineno}: constant {name} (read in a test's or fixture's body)")
    return sorted(bad, key=lambda line: int(line.split()[1].rstrip(":")))
