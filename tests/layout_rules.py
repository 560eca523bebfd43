"""The import rules every package of this repository keeps, read from the source (AST): imports go one
way (no cycles), and no module imports another module's private names. Function-local and
``TYPE_CHECKING`` imports count like module-level ones. Used by ``tests/reference/test_layout.py``
and ``tests/test_layout.py``; self-tested there."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

__all__ = ["ROOT", "modules_of", "imports_of", "import_graph", "find_cycle", "private_imports"]

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
