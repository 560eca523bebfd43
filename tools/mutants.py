"""The mutants of a Python source file: small, behaviour-changing edits, one per mutant.

Operators (the name is the second part of a mutant's key):

========  ==========================================================================================
cmp       a comparison operator swapped: ``==``/``!=``, ``<``/``<=``, ``>``/``>=``, ``is``/``is not``,
          ``in``/``not in`` (each way)
bool      ``and`` <-> ``or`` (the whole chain)
arith     a binary or augmented operator swapped: ``+``/``-``, ``*``/``/``, ``//`` -> ``*``,
          ``%`` -> ``//``, ``**`` -> ``*``, ``<<``/``>>``, ``&``/``|``, ``^`` -> ``|``
not       ``not x`` -> ``x``
unary     ``-x`` -> ``x``, ``~x`` -> ``x``
negate    the condition of ``if``/``elif``/``while``/``x if c else y``/a comprehension's ``if`` negated
          (not where ``cmp`` or ``not`` already gives the exact negation: ``==``, ``is``, ``in``, ``not x``)
const     ``True``/``False`` swapped, an int ``n`` -> ``n + 1``, a float ``x`` -> ``x + 1.0``, a string
          or bytes ``s`` -> ``"XX" s "XX"``
loop      a ``for`` loop or comprehension iterates over ``()`` (runs zero times)
jump      ``break`` <-> ``continue``
stmt      a statement with a side effect deleted (a call, an assignment to an attribute, item or an
          already bound name, an augmented assignment, ``del``)
raise     a ``raise`` deleted (the check that guarded it lets everything through)
return    ``return value`` -> ``return None``
========  ==========================================================================================

Not mutated, because no test could tell the difference or because it is text, not behaviour:
docstrings and bare string statements; type annotations (every ``reference/`` module has
``from __future__ import annotations``, so they are never evaluated) and ``if TYPE_CHECKING:``
blocks; decorators (``@dataclass(frozen=True)``-style flags); ``assert`` statements (internal
invariants: no input can break them, so removing one is equivalent and negating one is a crash);
``__repr__``/``__str__``/``extra_repr`` bodies (display only); ``__all__``/``__slots__``; message text: the exception expression
of a ``raise`` (the ``raise`` itself is mutated by deletion), the arguments of ``warnings.warn`` and
logging calls, f-strings, and string constants containing whitespace (prose, not keys).

A mutant is an edit of a byte range of the file (``start``/``end``, UTF-8 offsets as in the
``ast`` positions) to ``replacement``. Where the new operator binds like the old one only the
operator token is replaced, so the mutated line reads like the original; elsewhere the mutated
node is written out with parentheses. Its key, ``path::operator:linehash:index``, survives edits
to other lines: ``linehash`` is a hash of the stripped text of its first line, ``index`` counts the
mutants of that operator on lines with that text, in file order.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OPERATORS", "Mutant", "mutants_of_source", "mutants_of_file"]

OPERATORS = ("cmp", "bool", "arith", "not", "unary", "negate", "const", "loop", "jump", "stmt", "raise", "return")

_CMP_SWAP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_CMP_TEXT: dict[type[ast.cmpop], str] = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
}
# Comparisons whose `cmp` mutant is exactly their negation.
_EXACT_NEGATIONS = frozenset({ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.In, ast.NotIn})
_BIN_SWAP: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
    ast.BitXor: ast.BitOr,
}
_BIN_TEXT: dict[type[ast.operator], str] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.BitXor: "^",
}
# Operators that bind alike: swapping one for the other leaves the parse of the source unchanged.
_PRECEDENCE_CLASS: dict[type[ast.operator], int] = {
    ast.Add: 1,
    ast.Sub: 1,
    ast.Mult: 2,
    ast.Div: 2,
    ast.FloorDiv: 2,
    ast.Mod: 2,
    ast.LShift: 3,
    ast.RShift: 3,
}
_ATOMS = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant, ast.List, ast.Dict, ast.Set)
_SKIPPED_FUNCTIONS = frozenset({"__repr__", "__str__", "extra_repr"})
_SKIPPED_NAMES = frozenset({"__all__", "__slots__"})
_LOG_OBJECTS = frozenset({"log", "logger", "logging", "_log", "_logger", "LOG", "LOGGER"})
_LOG_METHODS = frozenset({"debug", "info", "warning", "warn", "error", "exception", "critical", "log"})
_STATEMENT_LISTS = ("body", "orelse", "finalbody", "handlers", "cases")
_NOT_EVALUATED_FIELDS = frozenset({"annotation", "returns", "decorator_list", "type_comment", "bases", "keywords"})


@dataclass(frozen=True)
class Mutant:
    """One edit of one file: bytes ``[start, end)`` of its UTF-8 source become ``replacement``."""

    path: str  # relative to the checkout, with forward slashes
    operator: str  # one of OPERATORS
    description: str  # what changed, e.g. "`==` -> `!=`"
    line: int  # 1-based line of the mutated code's start
    start: int
    end: int
    replacement: str
    line_hash: str
    index: int
    original: str  # the original line, stripped
    mutated: str  # the same line in the mutated file, stripped

    @property
    def key(self) -> str:
        """Stable identity: survives edits to other lines of the file."""
        return f"{self.path}::{self.operator}:{self.line_hash}:{self.index}"

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}"

    def apply(self, source: bytes) -> bytes:
        """The mutated file, from the original's bytes."""
        return source[: self.start] + self.replacement.encode("utf-8") + source[self.end :]


def line_hash(text: str) -> str:
    """The hash of a line's stripped text that identifies a mutant's line."""
    return hashlib.sha1(text.strip().encode("utf-8")).hexdigest()[:8]


@dataclass(frozen=True)
class _Edit:
    operator: str
    description: str
    start: int
    end: int
    replacement: str


def _is_docstring(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _is_message_call(node: ast.AST) -> bool:
    """``warnings.warn(...)`` or a logging call: its arguments are text for people."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    owner = node.func.value
    name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
    if name == "warnings" and node.func.attr == "warn":
        return True
    return name in _LOG_OBJECTS and node.func.attr in _LOG_METHODS


def _is_log_call(node: ast.AST) -> bool:
    return _is_message_call(node) and not (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "warn"
    )


def _contains_yield(fn: ast.AST) -> bool:
    for node in ast.walk(fn):
        if node is not fn and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return True
    return False


def _first_bindings(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Module) -> dict[str, int]:
    """Name -> the first line binding it in ``fn`` (parameters: the ``def`` line), nested scopes aside."""
    first: dict[str, int] = {}
    if not isinstance(fn, ast.Module):
        args = fn.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if arg is not None:
                first[arg.arg] = fn.lineno
    stack: list[ast.AST] = list(fn.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first[node.name] = min(first.get(node.name, node.lineno), node.lineno)
            continue
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            first[node.id] = min(first.get(node.id, node.lineno), node.lineno)
        stack.extend(ast.iter_child_nodes(node))
    return first


class _Collector:
    """Walks one module and records every edit the operators make, minus the filtered places."""

    def __init__(self, source: str) -> None:
        self.data = source.encode("utf-8")
        self.line_starts = [0]
        for match in re.finditer(b"\n", self.data):
            self.line_starts.append(match.end())
        self.edits: list[_Edit] = []
        self.scopes: list[tuple[dict[str, int], bool]] = []  # (first bindings, is a generator)

    # -- positions -------------------------------------------------------------------------------

    def offset(self, lineno: int, col: int) -> int:
        return self.line_starts[lineno - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]

    def text(self, start: int, end: int) -> str:
        return self.data[start:end].decode("utf-8")

    def segment(self, node: ast.AST) -> str:
        return self.text(*self.span(node))

    def add(self, operator: str, description: str, node: ast.AST, replacement: str) -> None:
        start, end = self.span(node)
        self.edits.append(_Edit(operator, description, start, end, replacement))

    def add_token(self, operator: str, description: str, gaps: list[tuple[int, int]], pattern: str, new: str) -> None:
        """Replace the operator token found by ``pattern`` in each of ``gaps`` (the text between operands)."""
        pieces: list[tuple[int, int]] = []
        for start, end in gaps:
            gap = self.text(start, end)
            blanked = re.sub(r"#[^\n]*", lambda m: " " * len(m.group()), gap)
            match = re.search(pattern, blanked)
            if match is None:
                return  # not where it should be: no mutant rather than a wrong one
            pieces.append((start + len(gap[: match.start()].encode("utf-8")), start + len(gap[: match.end()].encode("utf-8"))))
        first, last = pieces[0][0], pieces[-1][1]
        out, pos = [], first
        for start, end in pieces:
            out.append(self.text(pos, start))
            out.append(new)
            pos = end
        out.append(self.text(pos, last))
        self.edits.append(_Edit(operator, description, first, last, "".join(out)))

    def parenthesized(self, node: ast.AST) -> str:
        text = ast.unparse(node)
        return text if isinstance(node, _ATOMS) else f"({text})"

    # -- statements ------------------------------------------------------------------------------

    def module(self, tree: ast.Module) -> None:
        self.scopes.append((_first_bindings(tree), False))
        self.body(tree.body)

    def body(self, stmts: list[ast.stmt]) -> None:
        for stmt in stmts:
            if _is_docstring(stmt):
                continue  # a docstring, or a bare string statement anywhere
            self.stmt(stmt)

    def stmt(self, s: ast.stmt) -> None:
        if isinstance(s, (ast.Assert, ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.Pass)):
            return
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if s.name in _SKIPPED_FUNCTIONS:
                return
            for default in [*s.args.defaults, *(d for d in s.args.kw_defaults if d is not None)]:
                self.expr(default)
            self.scopes.append((_first_bindings(s), _contains_yield(s)))
            self.body(s.body)
            self.scopes.pop()
            return
        if isinstance(s, ast.ClassDef):
            self.scopes.append(({}, False))  # class attributes: deleting one is a NameError or a missing attribute
            self.body(s.body)
            self.scopes.pop()
            return
        if isinstance(s, ast.If) and _is_type_checking(s.test):
            self.body(s.orelse)
            return
        targets = s.targets if isinstance(s, ast.Assign) else [s.target] if isinstance(s, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id in _SKIPPED_NAMES for t in targets):
            return
        if isinstance(s, ast.Raise):
            self.add("raise", "delete `raise`", s, "pass")
            return  # the exception expression is the message
        if isinstance(s, ast.Expr) and _is_log_call(s.value):
            return
        self.statement_operators(s)
        for field, value in ast.iter_fields(s):
            if field in _STATEMENT_LISTS:
                for child in value:
                    if isinstance(child, ast.ExceptHandler):
                        self.body(child.body)
                    elif isinstance(child, ast.match_case):
                        if child.guard is not None:
                            self.expr(child.guard)
                        self.body(child.body)
                    else:
                        self.stmt(child)
            elif field in _NOT_EVALUATED_FIELDS or field == "pattern":
                continue
            elif isinstance(value, list):
                for child in value:
                    if isinstance(child, ast.AST):
                        self.expr(child)
            elif isinstance(value, ast.AST):
                self.expr(value)

    def statement_operators(self, s: ast.stmt) -> None:
        bindings, generator = self.scopes[-1]
        if isinstance(s, (ast.If, ast.While)):
            self.negate(s.test)
        elif isinstance(s, (ast.For, ast.AsyncFor)):
            self.add("loop", "loop runs zero times", s.iter, "()")
        elif isinstance(s, ast.Break):
            self.add("jump", "`break` -> `continue`", s, "continue")
        elif isinstance(s, ast.Continue):
            self.add("jump", "`continue` -> `break`", s, "break")
        elif isinstance(s, ast.Return):
            if s.value is not None and not isinstance(s.value, ast.Constant) and not generator:
                self.add("return", "return None", s, "return None")
        elif isinstance(s, ast.AugAssign):
            self.binop("arith", s.op, [(self.span(s.target)[1], self.span(s.value)[0])], s, augmented=True)
        if self.deletable(s, bindings):
            self.add("stmt", "delete statement", s, "pass")

    def deletable(self, s: ast.stmt, bindings: dict[str, int]) -> bool:
        if isinstance(s, ast.Expr):
            return isinstance(s.value, (ast.Call, ast.Await)) and not _is_log_call(s.value)
        if isinstance(s, (ast.AugAssign, ast.Delete)):
            return True
        if isinstance(s, ast.Assign) or (isinstance(s, ast.AnnAssign) and s.value is not None):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            for target in targets:
                for node in ast.walk(target):
                    if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, ast.Store):
                        return True
                    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                        if bindings.get(node.id, s.lineno) < s.lineno:
                            return True  # a re-binding: deleting it keeps the old value
        return False

    # -- expressions -----------------------------------------------------------------------------

    def negate(self, test: ast.expr) -> None:
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return  # the `not` operator already yields `x`
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _EXACT_NEGATIONS:
            return  # the `cmp` operator already yields the negation
        src = self.segment(test)
        new = f"not {src}" if isinstance(test, _ATOMS) else f"not ({src})"
        self.add("negate", "condition negated", test, new)

    def binop(
        self, operator: str, op: ast.operator, gaps: list[tuple[int, int]], node: ast.AST, *, augmented: bool = False
    ) -> None:
        new = _BIN_SWAP.get(type(op))
        if new is None:
            return
        old_text, new_text = _BIN_TEXT[type(op)], _BIN_TEXT[new]
        description = f"`{old_text}{'=' if augmented else ''}` -> `{new_text}{'=' if augmented else ''}`"
        same_binding = _PRECEDENCE_CLASS.get(type(op)) is not None and _PRECEDENCE_CLASS.get(type(op)) == _PRECEDENCE_CLASS.get(new)
        if augmented or same_binding:
            suffix = "=" if augmented else ""
            self.add_token(operator, description, gaps, re.escape(old_text + suffix), new_text + suffix)
        else:
            mutated = copy.copy(node)
            mutated.op = new()  # type: ignore[attr-defined]
            self.add(operator, description, node, self.parenthesized(mutated))

    def expr(self, node: ast.AST) -> None:
        if isinstance(node, ast.JoinedStr):
            return  # f-strings are text
        if isinstance(node, ast.Call) and _is_message_call(node):
            return
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, op in enumerate(node.ops):
                new = _CMP_SWAP[type(op)]
                gap = (self.span(operands[i])[1], self.span(operands[i + 1])[0])
                old_text, new_text = _CMP_TEXT[type(op)], _CMP_TEXT[new]
                pattern = r"\s+".join(rf"\b{w}\b" if w.isalpha() else re.escape(w) for w in old_text.split())
                self.add_token("cmp", f"`{old_text}` -> `{new_text}`", [gap], pattern, new_text)
        elif isinstance(node, ast.BoolOp):
            old_word, new_word = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            gaps = [(self.span(a)[1], self.span(b)[0]) for a, b in zip(node.values, node.values[1:])]
            self.add_token("bool", f"`{old_word}` -> `{new_word}`", gaps, rf"\b{old_word}\b", new_word)
        elif isinstance(node, ast.BinOp):
            self.binop("arith", node.op, [(self.span(node.left)[1], self.span(node.right)[0])], node)
        elif isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.Not):
                self.add("not", "`not x` -> `x`", node, self.operand_text(node.operand))
            elif isinstance(node.op, (ast.USub, ast.Invert)):
                sign = "-" if isinstance(node.op, ast.USub) else "~"
                self.add("unary", f"`{sign}x` -> `x`", node, self.operand_text(node.operand))
        elif isinstance(node, ast.IfExp):
            self.negate(node.test)
        elif isinstance(node, ast.Constant):
            self.constant(node)
            return
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            for gen in node.generators:
                self.add("loop", "loop runs zero times", gen.iter, "()")
                for cond in gen.ifs:
                    if not (isinstance(cond, ast.UnaryOp) and isinstance(cond.op, ast.Not)):
                        self.negate(cond)
        elif isinstance(node, ast.Lambda):
            for default in [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]:
                self.expr(default)
            self.expr(node.body)
            return
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "cast" and node.args:
            for arg in node.args[1:]:
                self.expr(arg)
            return
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.expr_context, ast.operator, ast.boolop, ast.unaryop, ast.cmpop)):
                continue
            if isinstance(child, ast.arguments):
                continue
            if isinstance(child, ast.comprehension):
                for part in (child.target, child.iter, *child.ifs):
                    self.expr(part)
                continue
            self.expr(child)

    def operand_text(self, operand: ast.expr) -> str:
        src = self.segment(operand)
        return src if isinstance(operand, _ATOMS) else f"({src})"

    def constant(self, node: ast.Constant) -> None:
        value = node.value
        if isinstance(value, bool):
            self.add("const", f"`{value}` -> `{not value}`", node, repr(not value))
        elif isinstance(value, int):
            self.add("const", f"`{value}` -> `{value + 1}`", node, repr(value + 1))
        elif isinstance(value, float):
            self.add("const", f"`{value!r}` -> `{value + 1.0!r}`", node, repr(value + 1.0))
        elif isinstance(value, (str, bytes)):
            if re.search(rb"\s" if isinstance(value, bytes) else r"\s", value):  # type: ignore[arg-type]
                return  # prose: a message, not a key
            new = (b"XX" + value + b"XX") if isinstance(value, bytes) else f"XX{value}XX"
            self.add("const", f"`{value!r}` -> `{new!r}`", node, repr(new))


def mutants_of_source(path: str, source: str) -> list[Mutant]:
    """Every mutant of ``source`` (the text of the file ``path``), in file order."""
    tree = ast.parse(source, filename=path)
    collector = _Collector(source)
    collector.module(tree)
    data = collector.data
    lines = source.splitlines()
    # Sort by position; the index counts mutants of one operator on lines with the same text.
    edits = sorted(set(collector.edits), key=lambda e: (e.start, e.end, e.operator, e.description, e.replacement))
    counters: dict[tuple[str, str], int] = defaultdict(int)
    out: list[Mutant] = []
    for edit in edits:
        line = data.count(b"\n", 0, edit.start) + 1
        original = lines[line - 1].strip()
        digest = line_hash(original)
        index = counters[(edit.operator, digest)]
        counters[(edit.operator, digest)] += 1
        line_start = collector.line_starts[line - 1]
        mutated_data = data[: edit.start] + edit.replacement.encode("utf-8") + data[edit.end :]
        line_end = mutated_data.find(b"\n", line_start)
        mutated_line = mutated_data[line_start : None if line_end < 0 else line_end].decode("utf-8").strip()
        out.append(
            Mutant(
                path=path,
                operator=edit.operator,
                description=edit.description,
                line=line,
                start=edit.start,
                end=edit.end,
                replacement=edit.replacement,
                line_hash=digest,
                index=index,
                original=original,
                mutated=mutated_line,
            )
        )
    return out


def mutants_of_file(root: Path, path: str) -> list[Mutant]:
    """Every mutant of the file ``root / path``."""
    return mutants_of_source(path, (root / path).read_text(encoding="utf-8"))
