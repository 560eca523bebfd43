"""Which modules of ``reference/`` reach which: the import graph :mod:`tools.mutation` uses to judge a
mutant by every conformance test that can run its code, not only its own section's.

A section's mutant is judged first by its section's conformance tests. Its code may also run under
another section's tests: ``reference/flat_param/wrapper.py`` (FP) registers its wrapper's path segment
with the canonical-FQN rule, which only SD's submodule selection reads, so a fork with that wrong
fails an SD test although FP's pass. A fork runs all of ``conformance/``; a mutant any of it catches
is caught for the fork. The graph is read from the ``import`` statements (``ast``: nothing is
imported), so it over-approximates: an import under ``TYPE_CHECKING`` counts, and a module imported
but never called only costs the time of tests that will pass.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

__all__ = ["module_of", "import_graph", "reaches"]


def module_of(path: str) -> str:
    """``reference/flat_param/wrapper.py`` -> ``reference.flat_param.wrapper``; a package's
    ``__init__.py`` is the package."""
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``source`` (the text of ``module``) imports directly."""
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            # ``from P import name``: P itself, and P.name where that is a module.
            names = [stem, *(f"{stem}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            # ``import a.b.c`` runs a, a.b and a.b.c.
            pieces = name.split(".")
            out.update(m for m in (".".join(pieces[:i]) for i in range(1, len(pieces) + 1)) if m in known)
    out.discard(module)
    return out


def import_graph(root: Path, top: str = "reference") -> dict[str, set[str]]:
    """Module -> the modules under ``top`` it imports directly, for every module under ``root/top``."""
    files = {module_of(p.relative_to(root).as_posix()): p for p in sorted((root / top).rglob("*.py"))}
    known = set(files)
    return {m: _imports(p.read_text(encoding="utf-8"), m, p.name == "__init__.py", known) for m, p in files.items()}


def reaches(graph: dict[str, set[str]], modules: Iterable[str], target: str) -> bool:
    """Whether any of ``modules`` imports ``target``, directly or through other modules."""
    seen: set[str] = set()
    stack = [m for m in modules if m != target]
    while stack:
        module = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        deps = graph.get(module, set())
        if target in deps:
            return True
        stack.extend(deps - seen)
    return False
