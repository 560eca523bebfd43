"""The requirement IDs of ``conformance/SPEC.md`` and the tests that name them."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

__all__ = ["SPEC_PATH", "REQ_ID", "CLAUSE_ID", "load_spec", "clause_letters", "load_clauses", "ids_named_by_tests", "clauses_named_in"]

SPEC_PATH = Path(__file__).resolve().parent.parent / "SPEC.md"
#: A requirement ID: two capital letters, a dash, a number.
REQ_ID = re.compile(r"^[A-Z]{2}-\d+$")
_BULLET = re.compile(r"^- \*\*([A-Z]{2}-\d+)\*\*\s+(.*)$")
#: A lettered clause's ID: a requirement ID, a dot, the clause's letter (``ML-13.b``).
CLAUSE_ID = re.compile(r"^[A-Z]{2}-\d+\.[a-z]$")
#: A clause's letter in a statement: ``(a)`` after a space or at the start.
_LETTER = re.compile(r"(?:^|(?<=\s))\(([a-z])\)(?=\s)")


def load_spec(path: Path = SPEC_PATH) -> dict[str, str]:
    """Requirement ID -> statement, in the order SPEC.md lists them. A repeated ID is an error."""
    spec: dict[str, str] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = _BULLET.match(line.strip())
        if not match:
            continue
        req_id, text = match.groups()
        if req_id in spec:
            raise ValueError(f"{path}:{lineno}: requirement {req_id} is listed twice")
        spec[req_id] = text.strip()
    return spec


def clause_letters(statement: str) -> list[str]:
    """The letters of the clauses a statement marks, ``(a) ... (b) ...``, in order (none: the statement
    is one clause). They must run a, b, c, ... without a gap or a repeat."""
    letters = _LETTER.findall(statement)
    expected = [chr(ord("a") + i) for i in range(len(letters))]
    if letters != expected:
        raise ValueError(f"clause letters {letters} are not {expected}")
    return letters


def load_clauses(path: Path = SPEC_PATH) -> dict[str, list[str]]:
    """Requirement ID -> the IDs of its lettered clauses (``["ML-13.a", ...]``; empty: one clause, the
    requirement itself)."""
    clauses = {}
    for req_id, statement in load_spec(path).items():
        try:
            clauses[req_id] = [f"{req_id}.{letter}" for letter in clause_letters(statement)]
        except ValueError as exc:
            raise ValueError(f"{path}: {req_id}: {exc}") from None
    return clauses


def clauses_named_in(files: Iterable[Path]) -> dict[str, list[str]]:
    """Lettered clause ID -> the files that name it: every string constant that is exactly one
    (``check_each``'s keys, ``clause(...)``'s argument, tables of cases that carry a clause)."""
    named: dict[str, list[str]] = {}
    for path in files:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=str(path))
        found = {node.value for node in ast.walk(tree)
                 if isinstance(node, ast.Constant) and isinstance(node.value, str) and CLAUSE_ID.fullmatch(node.value)}
        for clause_id in sorted(found):
            named.setdefault(clause_id, []).append(str(path))
    return named


def _req_calls(tree: ast.AST) -> Iterable[ast.Call]:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "req"
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "mark"
        ):
            yield node


def ids_named_by_tests(test_files: Iterable[Path]) -> dict[str, list[str]]:
    """Requirement ID -> the test files that name it (read, not imported): every argument of a
    ``pytest.mark.req(...)`` call, and every string constant that is exactly an ID (tables of cases whose
    marks are built from a field, ``marks=pytest.mark.req(case.req)``, name their IDs that way; the
    plugin checks at collection that every ID a mark names is in SPEC.md)."""
    named: dict[str, list[str]] = {}
    for path in test_files:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=str(path))
        found = {arg.value for call in _req_calls(tree) for arg in call.args
                 if isinstance(arg, ast.Constant) and isinstance(arg.value, str)}
        found |= {node.value for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and REQ_ID.fullmatch(node.value)}
        for req in sorted(found):
            named.setdefault(req, []).append(str(path))
    return named
