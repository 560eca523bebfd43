"""Self-tests of the mutation tool (tools/mutants.py, tools/mutation.py): operators, filters, keys,
sampling, the equivalents file, the report, the scratch copies, and that mutants reach the ranks."""

from __future__ import annotations

import ast
import hashlib
import json
import re
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tools import mutation
from tools.mutants import OPERATORS, Mutant, mutants_of_file, mutants_of_source
from tools.mutation import (
    Fingerprints,
    Result,
    Runner,
    Section,
    SectionSummary,
    checkout_files,
    load_equivalents,
    make_scratch,
    render_report,
    render_table,
    sample,
)
from tools.mutation_order import ordered
from tools.mutation_reach import import_graph, module_of, reaches


def edits(source: str) -> set[tuple[str, str, str]]:
    """(operator, original line, mutated line) of every mutant of ``source``."""
    return {(m.operator, m.original, m.mutated) for m in mutants_of_source("m.py", textwrap.dedent(source))}


def test_each_operator_makes_its_edit() -> None:
    got = edits(
        """
        def f(a, b, xs, strict=True):
            if a == b and a is not None:
                a += 1
            while a < b:
                break
            for x in xs:
                continue
            y = -a if not strict else a * 2
            self.seen = [x for x in xs if x in b]
            raise ValueError("bad")
            return y
        """
    )
    expected = {
        ("const", "def f(a, b, xs, strict=True):", "def f(a, b, xs, strict=False):"),
        ("cmp", "if a == b and a is not None:", "if a != b and a is not None:"),
        ("cmp", "if a == b and a is not None:", "if a == b and a is None:"),
        ("bool", "if a == b and a is not None:", "if a == b or a is not None:"),
        ("negate", "if a == b and a is not None:", "if not (a == b and a is not None):"),
        ("arith", "a += 1", "a -= 1"),
        ("const", "a += 1", "a += 2"),
        ("stmt", "a += 1", "pass"),
        ("cmp", "while a < b:", "while a <= b:"),
        ("negate", "while a < b:", "while not (a < b):"),
        ("jump", "break", "continue"),
        ("loop", "for x in xs:", "for x in ():"),
        ("jump", "continue", "break"),
        ("unary", "y = -a if not strict else a * 2", "y = a if not strict else a * 2"),
        ("not", "y = -a if not strict else a * 2", "y = -a if strict else a * 2"),
        ("arith", "y = -a if not strict else a * 2", "y = -a if not strict else a / 2"),
        ("const", "y = -a if not strict else a * 2", "y = -a if not strict else a * 3"),
        ("stmt", "self.seen = [x for x in xs if x in b]", "pass"),
        ("loop", "self.seen = [x for x in xs if x in b]", "self.seen = [x for x in () if x in b]"),
        ("cmp", "self.seen = [x for x in xs if x in b]", "self.seen = [x for x in xs if x not in b]"),
        ("raise", 'raise ValueError("bad")', "pass"),
        ("return", "return y", "return None"),
    }
    assert got == expected
    assert {op for op, _, _ in got} == set(OPERATORS)


def test_constants_and_rebinding() -> None:
    got = edits(
        """
        def g(state, n):
            key = "exp_avg"
            state = dict(state)
            fresh = n + 0.5
            return {key: b"\\x00"}
        """
    )
    assert ("const", 'key = "exp_avg"', "key = 'XXexp_avgXX'") in got
    assert ("const", "fresh = n + 0.5", "fresh = n + 1.5") in got
    assert ("const", 'return {key: b"\\x00"}', "return {key: b'XX\\x00XX'}") in got
    assert ("stmt", "state = dict(state)", "pass") in got  # a re-binding of a parameter: deleting keeps the input
    assert not any(op == "stmt" and orig.startswith(("key =", "fresh =")) for op, orig, _ in got)  # first bindings


def test_filtered_places_make_no_mutants() -> None:
    source = """
        '''Module docstring with 1 and True.'''
        from __future__ import annotations
        from typing import TYPE_CHECKING
        import warnings
        __all__ = ["f"]
        if TYPE_CHECKING:
            X = 1 + 2
        class C:
            '''Docstring.'''
            def __repr__(self) -> str:
                return "C(" + str(1) + ")"
            @dataclass(frozen=True)
            def f(self, x: int | None = None) -> list[int] | None:
                assert x != 0, "never"
                warnings.warn(f"x is {x + 1}", UserWarning, stacklevel=2)
                message = "two words"
                raise ValueError(f"bad {x + 1}", "k" + "v")
    """
    mutants = mutants_of_source("m.py", textwrap.dedent(source))
    assert [(m.operator, m.original) for m in mutants] == [
        ("stmt", 'warnings.warn(f"x is {x + 1}", UserWarning, stacklevel=2)'),
        ("raise", 'raise ValueError(f"bad {x + 1}", "k" + "v")'),
    ]


@pytest.mark.parametrize(
    "line, description, intended",
    [
        ("r = a - b + c", "`-` -> `+`", "(a + b) + c"),
        ("r = a - b + c", "`+` -> `-`", "(a - b) - c"),
        ("r = a & b ^ c", "`&` -> `|`", "(a | b) ^ c"),
        ("r = a & b ^ c", "`^` -> `|`", "(a & b) | c"),
        ("r = a | b ^ c", "`|` -> `&`", "a & (b ^ c)"),
        ("r = a / b ** c", "`**` -> `*`", "a / (b * c)"),
        ("r = -(a + b) * c", "`-x` -> `x`", "(a + b) * c"),
        ("r = x or a and b", "`and` -> `or`", "x or (a or b)"),
        ("r = x or a and b", "`or` -> `and`", "x and (a and b)"),
        ("r = not (x or a) and b", "`not x` -> `x`", "(x or a) and b"),
        ("r = a < b < c", "`<` -> `<=`", "a <= b < c"),
        ("r = (a  # a comment with == in it\n     == b)", "`==` -> `!=`", "a != b"),
    ],
)
def test_a_mutant_means_what_it_says(line: str, description: str, intended: str) -> None:
    """The edited source evaluates like the intended expression (operator precedence is kept)."""
    mutant = [m for m in mutants_of_source("m.py", line + "\n") if m.description == description and m.operator != "negate"][0]
    mutated = mutant.apply((line + "\n").encode()).decode()
    for a, b, c, x in [(6, 3, 5, 0), (2, 7, 1, 0), (1, 2, 3, 0), (0, 5, 2, 4)]:
        env = {"a": a, "b": b, "c": c, "x": x}
        exec(mutated, env)
        assert env["r"] == eval(intended, {"a": a, "b": b, "c": c, "x": x}), (mutated, intended)


def test_every_operator_on_reference_yields_valid_changed_code() -> None:
    """On the real reference/ files: each mutant parses and changes the AST (a sample per operator)."""
    files = sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "reference").rglob("*.py"))
    mutants = [m for f in files for m in mutants_of_file(REPO_ROOT, f)]
    by_op: dict[str, list[Mutant]] = {}
    for m in mutants:
        by_op.setdefault(m.operator, []).append(m)
    assert set(by_op) == set(OPERATORS)
    assert len({m.key for m in mutants}) == len(mutants), "keys must be unique"
    sources = {f: (REPO_ROOT / f).read_bytes() for f in files}
    originals = {f: ast.dump(ast.parse(s)) for f, s in sources.items()}
    for ms in by_op.values():
        for m in sample(ms, 10, "self-test"):
            mutated = ast.parse(m.apply(sources[m.path]))
            assert ast.dump(mutated) != originals[m.path], f"{m.key} changes nothing"


def test_keys_survive_edits_elsewhere_and_tell_twins_apart() -> None:
    before = mutants_of_source("m.py", "x = a == b\nx = a == b\n")
    after = mutants_of_source("m.py", "import os\n\nx = a == b\nx = a == b\n")
    assert [m.key for m in before] == [m.key for m in after]
    digest = hashlib.sha1(b"x = a == b").hexdigest()[:8]
    assert [m.key for m in before if m.operator == "cmp"] == [f"m.py::cmp:{digest}:0", f"m.py::cmp:{digest}:1"]


def test_sample_is_deterministic_and_stable() -> None:
    mutants = mutants_of_source("m.py", "".join(f"v{i} = a{i} + {i}\n" for i in range(60)))
    first = sample(mutants, 10, "0:FP")
    assert len(first) == 10
    assert first == sample(mutants, 10, "0:FP")
    assert first != sample(mutants, 10, "1:FP")
    assert [m.start for m in first] == sorted(m.start for m in first)  # file order
    assert sample(mutants, None) == mutants == sample(mutants, 10_000)
    # One mutant gone: the sample changes by at most that one (and its replacement).
    dropped = [m for m in mutants if m is not first[3]]
    assert len(set(m.key for m in first) - set(m.key for m in sample(dropped, 10, "0:FP"))) == 1


def test_equivalents_file(tmp_path: Path) -> None:
    path = tmp_path / "eq.txt"
    path.write_text(
        "# comment\n\n"
        "reference/a.py::cmp:0123abcd:0   world size 1 takes both branches alike\n"
        "reference/a.py::const:0123abcd:1\n"
        "not-a-key  reason\n"
        "reference/a.py::cmp:0123abcd:0  again\n"
    )
    eq = load_equivalents(path)
    assert eq.reasons == {"reference/a.py::cmp:0123abcd:0": "world size 1 takes both branches alike"}
    assert [e.split(": ", 1)[1] for e in eq.errors] == [
        "reference/a.py::const:0123abcd:1 has no reason; say in one line why it is equivalent",
        "'not-a-key' is not a mutant key (path::operator:hash:index)",
        "reference/a.py::cmp:0123abcd:0 is listed twice",
    ]
    assert eq.stale(["reference/a.py::cmp:0123abcd:0"]) == []
    assert eq.stale([]) == ["reference/a.py::cmp:0123abcd:0"]
    assert load_equivalents(REPO_ROOT / "tools" / "mutation_equivalent.txt").errors == []


def test_report_table_and_survivors() -> None:
    fp = SectionSummary("FP", total=600, counts=Counter(killed=30, survived=3, timeout=1, equivalent=2),
                        with_self_tests=Counter(killed=32, survived=1, timeout=1, equivalent=2))  # fmt: skip
    ml = SectionSummary("ML", total=900, counts=Counter(equivalent=1))
    assert render_table([fp, ml]) == "\n".join(
        [
            "| section | mutants | killed | survived | timed out | equivalent | kill rate |",
            "|---|---|---|---|---|---|---|",
            "| FP | 36 | 30 | 3 | 1 | 2 | 91.2% |",
            "| ML | 1 | 0 | 0 | 0 | 1 | n/a |",
            "| **all** | 37 | 30 | 3 | 1 | 3 | 91.2% |",
        ]
    )
    assert render_table([fp], "self-tests").splitlines()[-1] == "| FP | 36 | 32 | 1 | 1 | 2 | 97.1% |"
    survivor = Result("reference/f.py::cmp:1:0", "FP", "reference/f.py", 7, "cmp", "`==` -> `!=`", "if a == b:", "if a != b:", "survived",
                      with_self_tests="survived")  # fmt: skip
    caught = Result("reference/f.py::cmp:3:0", "FP", "reference/f.py", 8, "cmp", "`>` -> `>=`", "a > b", "a >= b", "survived",
                    with_self_tests="killed", self_killed_by="FAILED tests/reference/test_f.py::test_gt")  # fmt: skip
    killed = Result("reference/f.py::cmp:2:0", "FP", "reference/f.py", 9, "cmp", "`<` -> `<=`", "a < b", "a <= b", "killed")
    report = render_report([fp, ml], [survivor, caught, killed], "# title", ["a note"])
    assert "- a note" in report
    assert report.index("## Judged by conformance/ alone") < report.index("## With the self-tests") < report.index("## Survivors")
    assert "## Survivors of the conformance tests (2)" in report
    assert "- `reference/f.py:7` cmp: `==` -> `!=`; the self-tests miss it too  \n  key `reference/f.py::cmp:1:0`" in report
    assert "`>` -> `>=`; a self-test kills it: FAILED tests/reference/test_f.py::test_gt" in report
    assert "  - if a == b:\n  + if a != b:" in report
    assert "a <= b" not in report


#: The tiny checkout's runs do without the suite's plugin (installed in this environment, it would import
#: torch into each of them): its tests need none, and its conftest declares the options the runner passes.
#: Such a run takes about a second, so the end-to-end test's time limits add 8 s: on a loaded machine a
#: run that should pass must not be judged timed out.
WITHOUT_THE_SUITE = ("--pytest-args", "-p no:conformance.harness.plugin")

TINY_CONFTEST = """
def pytest_addoption(parser):
    for name in ("--impl", "--world-size", "--rank-timeout"):
        try:
            parser.addoption(name)
        except ValueError:  # the suite's plugin, installed in this environment, defines it already
            pass
"""


def tiny_checkout(root: Path) -> Section:
    """A checkout with one module and its tests; the conftest accepts the suite's options."""
    (root / "reference").mkdir(parents=True)
    (root / "reference" / "__init__.py").write_text("")
    (root / "reference" / "calc.py").write_text(
        "def double(x):\n    return x * 2\n\n\ndef unused(x):\n    return x - 1\n\n\n"
        "def spin(n):\n    while n > 0:\n        n -= 1\n    return n\n"
    )
    (root / "tests").mkdir()
    (root / "tests" / "conftest.py").write_text(TINY_CONFTEST)
    (root / "tests" / "test_calc.py").write_text(
        "from reference.calc import double, spin\n\n\ndef test_double():\n    assert double(3) == 6\n\n\n"
        "def test_spin():\n    assert spin(3) == 0\n"
    )
    return Section("XX", ("reference/calc.py",), ("tests/test_calc.py",))


def test_end_to_end_on_a_tiny_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Killed, survived, timed out and equivalent mutants; the checkout is never written."""
    root = tmp_path / "checkout"
    tiny_checkout(root)
    # A self-test the conformance tests lack: it kills what they let survive in unused().
    (root / "tests" / "test_self.py").write_text("from reference.calc import unused\n\n\ndef test_unused():\n    assert unused(3) == 2\n")
    section = Section("XX", ("reference/calc.py",), ("tests/test_calc.py",), ("tests/test_self.py",))
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    monkeypatch.setattr(mutation, "SECTIONS", {"XX": section})
    survivor = next(m for m in mutants_of_file(root, "reference/calc.py") if m.original == "return x - 1" and m.operator == "arith")
    equivalents = tmp_path / "eq.txt"
    equivalents.write_text(f"{survivor.key}  nobody calls unused()\n")
    out = tmp_path / "out"
    mutants = {(m.original, m.description): m.key for m in mutants_of_file(root, "reference/calc.py")}
    wanted = [("return x * 2", "`*` -> `/`"), ("return x - 1", "`-` -> `+`"), ("return x - 1", "return None"), ("n -= 1", "`-=` -> `+=`")]
    argv = ["--root", str(root), "--out", str(out), "--sections", "XX", "--equivalents", str(equivalents),
            "--rank-timeout", "1", "--timeout-factor", "2", "--timeout-extra", "8", *WITHOUT_THE_SUITE,
            *(arg for w in wanted for arg in ("--mutant", mutants[w]))]  # fmt: skip
    assert mutation.main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    # (conformance verdict, with the self-tests, seconds of the self-tests' run)
    verdicts = {(m["original"], m["description"]): (m["status"], m["with_self_tests"], m["self_seconds"]) for m in report["mutants"]}
    assert verdicts[("return x * 2", "`*` -> `/`")] == ("killed", "killed", 0.0)  # caught: no self-test run
    assert verdicts[("return x - 1", "`-` -> `+`")][:2] == ("equivalent", "equivalent")
    assert verdicts[("return x - 1", "return None")][:2] == ("survived", "killed")  # the self-test kills it
    assert verdicts[("n -= 1", "`-=` -> `+=`")][:2] == ("timeout", "timeout")  # spin() never ends
    sections = report["sections"]["XX"]
    assert (sections["equivalent"], sections["kill_rate"], sections["kill_rate_with_self_tests"]) == (1, 200 / 3, 100.0)
    assert "| XX |" in capsys.readouterr().out
    text = (out / "report.md").read_text()
    assert text.count("```diff") == sections["survived"] and "a self-test kills it: FAILED tests/test_self.py::test_unused" in text
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before

    # Only a self-test changes: a resumed run reuses every conformance verdict and runs the self-tests
    # (alone) again for the one survivor, which they now miss.
    (root / "tests" / "test_self.py").write_text("def test_nothing():\n    pass\n")
    assert mutation.main([*argv, "--resume"]) == 0
    resumed = json.loads((out / "report.json").read_text())["mutants"]
    again = {(m["original"], m["description"]): (m["status"], m["with_self_tests"], m["seconds"]) for m in resumed}
    first = {(m["original"], m["description"]): m["seconds"] for m in report["mutants"]}
    assert again[("return x - 1", "return None")] == ("survived", "survived", first[("return x - 1", "return None")])
    assert again[("return x * 2", "`*` -> `/`")] == ("killed", "killed", first[("return x * 2", "`*` -> `/`")])
    assert "unmutated run of the conformance" not in capsys.readouterr().err
    scratch = out / "work" / "job0" / "reference" / "calc.py"
    assert scratch.read_bytes() == before[root / "reference" / "calc.py"]  # restored after the last mutant


def test_a_section_with_a_plain_path_judges_its_survivors_on_it_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mutant of code that runs only with the reference's fast paths off survives the default run;
    a section that declares the plain path runs its conformance tests once more with it and kills it."""
    root = tmp_path / "checkout"
    tiny_checkout(root)
    (root / "reference" / "calc.py").write_text(
        "import os\n\n\ndef double(x):\n    if os.environ.get('SDC_REFERENCE_FAST_PATHS') == '0':\n"
        "        return x + x\n    return x * 2\n"
    )
    (root / "tests" / "test_calc.py").write_text("from reference.calc import double\n\n\ndef test_double():\n    assert double(3) == 6\n")
    plain = next(m for m in mutants_of_file(root, "reference/calc.py") if m.original == "return x + x" and m.operator == "arith")
    verdicts = {}
    for declared in (False, True):
        section = Section("XX", ("reference/calc.py",), ("tests/test_calc.py",), plain_path=declared)
        monkeypatch.setattr(mutation, "SECTIONS", {"XX": section})
        out = tmp_path / f"out-{declared}"
        assert mutation.main(["--root", str(root), "--out", str(out), "--sections", "XX", "--mutant", plain.key, "--rank-timeout", "1",
                              *WITHOUT_THE_SUITE]) == 0
        (mutant,) = json.loads((out / "report.json").read_text())["mutants"]
        verdicts[declared] = (mutant["status"], mutant["killed_by"].split(":")[0])
    assert verdicts == {False: ("survived", ""), True: ("killed", "plain path")}


def test_the_import_graph_follows_absolute_relative_and_package_imports(tmp_path: Path) -> None:
    files = {
        "reference/__init__.py": "",
        "reference/a/__init__.py": "from .core import helper\n",
        "reference/a/core.py": "import os\n",
        "reference/b/__init__.py": "",
        "reference/b/user.py": "from reference.a import helper\nfrom ..c import leaf\n",
        "reference/c.py": "import reference.a.core as core\n",
        "reference/d.py": "from . import c\n",
        "reference/lone.py": "import json\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert module_of("reference/a/__init__.py") == "reference.a" and module_of("reference/b/user.py") == "reference.b.user"
    assert graph["reference.a"] == {"reference", "reference.a.core"}
    assert graph["reference.b.user"] == {"reference", "reference.a", "reference.c"}
    assert graph["reference.d"] == {"reference", "reference.c"}
    assert graph["reference.lone"] == set()
    # user -> a (the package) -> core; d -> c -> core; nothing reaches user; a module does not reach itself.
    assert reaches(graph, ["reference.b.user"], "reference.a.core") and reaches(graph, ["reference.d"], "reference.a.core")
    assert not reaches(graph, ["reference.a.core", "reference.lone"], "reference.b.user")
    assert not reaches(graph, ["reference.c"], "reference.c")


def test_a_survivor_is_judged_by_the_other_sections_tests_that_run_its_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper of one section that only another section's code calls: its own tests let the mutant
    survive, the other section's conformance tests kill it, and that is the conformance verdict."""
    root = tmp_path / "checkout"
    tiny_checkout(root)
    (root / "reference" / "user.py").write_text("from reference.calc import unused\n\n\ndef pred(x):\n    return unused(x)\n")
    (root / "reference" / "other.py").write_text("def same(x):\n    return x\n")
    (root / "tests" / "test_user.py").write_text("from reference.user import pred\n\n\ndef test_pred():\n    assert pred(3) == 2\n")
    (root / "tests" / "test_other.py").write_text("def test_nothing():\n    pass\n")
    own = Section("XX", ("reference/calc.py",), ("tests/test_calc.py",))
    user = Section("YY", ("reference/user.py",), ("tests/test_user.py",))
    unrelated = Section("ZZ", ("reference/other.py",), ("tests/test_other.py",))
    monkeypatch.setattr(mutation, "SECTIONS", {s.name: s for s in (own, user, unrelated)})
    assert mutation.reaching_tests(root, own, "reference/calc.py") == ["tests/test_user.py"]
    assert mutation.reaching_tests(root, user, "reference/user.py") == []
    mutant = next(m for m in mutants_of_file(root, "reference/calc.py") if m.original == "return x - 1" and m.operator == "arith")
    out = tmp_path / "out"
    assert mutation.main(["--root", str(root), "--out", str(out), "--sections", "XX", "--mutant", mutant.key, "--rank-timeout", "1",
                          "--timeout-extra", "8", *WITHOUT_THE_SUITE]) == 0  # fmt: skip
    (result,) = json.loads((out / "report.json").read_text())["mutants"]
    assert (result["status"], result["killed_by"]) == ("killed", "other sections' tests: FAILED tests/test_user.py::test_pred")


def test_a_verdict_is_reused_only_for_the_tree_it_judged(tmp_path: Path) -> None:
    """The conformance verdict depends on reference/ and conformance/; the self-tests' on tests/ too."""
    root = tmp_path / "checkout"
    tiny_checkout(root)
    (root / "conformance").mkdir()
    (root / "conformance" / "support.py").write_text("X = 1\n")

    def prints() -> Fingerprints:
        return Fingerprints.of(root, checkout_files(root), ["--rank-timeout", "5"])

    first = prints()
    (root / "tests" / "test_calc.py").write_text((root / "tests" / "test_calc.py").read_text() + "\n")
    after_a_self_test = prints()
    assert after_a_self_test.conformance == first.conformance and after_a_self_test.self_tests != first.self_tests
    for changed in ("conformance/support.py", "reference/calc.py"):
        (root / changed).write_text((root / changed).read_text() + "\n")
        now = prints()
        assert now.conformance != first.conformance and now.self_tests != after_a_self_test.self_tests, changed
    assert Fingerprints.of(root, checkout_files(root), ["-k", "x"]) != prints()  # other pytest arguments


def test_the_tests_that_killed_mutants_run_first(tmp_path: Path) -> None:
    assert ordered(["a", "b", "c", "d"], ["c", "gone", "a"]) == [2, 0, 1, 3]
    assert ordered(["a", "b"], []) == [0, 1]
    runner = Runner(["-vv"])  # with the suite's -q: one line per test
    section = Section("XX", ("reference/calc.py",), ("tests/test_calc.py",))
    for test in ("tests/test_calc.py::test_spin", "tests/test_calc.py::test_double", "tests/test_calc.py::test_spin"):
        runner.learn(Result("k", "XX", "reference/calc.py", 1, "cmp", "", "", "", "killed", killed_by=f"FAILED {test}"))
    runner.learn(Result("k", "XX", "reference/calc.py", 1, "cmp", "", "", "", "survived"))
    runner.learn(Result("k", "XX", "reference/calc.py", 1, "cmp", "", "", "", "killed", killed_by="no result in 3s"))
    root = tmp_path / "checkout"
    tiny_checkout(root)
    scratch = tmp_path / "scratch"
    make_scratch(REPO_ROOT, scratch, checkout_files(REPO_ROOT))  # with tools/: the order plugin is used
    for rel in ("tests/conftest.py", "tests/test_calc.py", "reference/calc.py"):
        (scratch / rel).write_text((root / rel).read_text())
    rc, output, _ = runner.pytest(section, scratch, timeout=120)
    assert rc == 0, output
    ran = [line.split()[0] for line in output.splitlines() if line.startswith("tests/test_calc.py::")]
    assert ran == ["tests/test_calc.py::test_spin", "tests/test_calc.py::test_double"], output


def test_an_interrupted_mutant_leaves_the_scratch_restored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "checkout"
    section = tiny_checkout(root)
    scratch = tmp_path / "scratch"
    make_scratch(root, scratch, checkout_files(root))
    mutant = mutants_of_file(root, "reference/calc.py")[0]

    def interrupted(*args: object, **kwargs: object) -> None:
        assert (scratch / mutant.path).read_bytes() != (root / mutant.path).read_bytes()  # the mutant is in place
        raise KeyboardInterrupt

    monkeypatch.setattr(Runner, "pytest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Runner([]).run_mutant(mutant, section, scratch, 10, "")
    assert (scratch / mutant.path).read_bytes() == (root / mutant.path).read_bytes()


CANARY = """
from pathlib import Path

import pytest
import torch
import torch.distributed as c10d

from reference import comm as C


@pytest.mark.req("OS-1")
def test_gather_on_ranks(dist, impl):  # impl: a capability test runs against an adapter (the runner selects the reference)
    assert Path(C.__file__).resolve().is_relative_to(Path.cwd().resolve()), C.__file__
    shard = torch.full((2,), float(dist.rank))
    out = torch.empty(2 * dist.world_size)
    C.all_gather_flat(out, shard, c10d.group.WORLD)
    assert out.tolist() == [float(r) for r in range(dist.world_size) for _ in range(2)]
"""


def test_mutants_reach_the_rank_processes(tmp_path: Path) -> None:
    """A mutant of code that only the ranks run (all_gather_flat at world size 2) is killed, and the
    ranks import ``reference`` from the scratch copy."""
    scratch = tmp_path / "scratch"
    make_scratch(REPO_ROOT, scratch, checkout_files(REPO_ROOT))
    (scratch / "conformance" / "test_mutation_canary.py").write_text(CANARY)
    section = Section("XX", ("reference/comm.py",), ("conformance/test_mutation_canary.py",))
    source = (scratch / "reference" / "comm.py").read_text()
    gather = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "all_gather_flat")
    assert gather.end_lineno is not None
    [mutant] = [
        m
        for m in mutants_of_file(scratch, "reference/comm.py")
        if m.original == "if world == 1:" and m.operator == "cmp" and gather.lineno <= m.line <= gather.end_lineno
    ]
    runner = Runner(["--rank-timeout", "30", "--world-size", "2"])  # the last --world-size wins: one pool
    rc, output, _ = runner.pytest(section, scratch, timeout=300)
    assert rc == 0, output
    result = runner.run_mutant(mutant, section, scratch, 300, "")
    assert result.status == "killed", result
    assert "ws2" in result.killed_by


def test_each_section_is_judged_by_every_conformance_file_that_names_its_ids() -> None:
    """A fork runs all of ``conformance/``: a mutant any test of a section's IDs kills is killed for it.
    A file left out of the section's list would make its mutants look like survivors."""
    named: dict[str, set[str]] = {}
    for path in sorted((REPO_ROOT / "conformance").glob("test_*.py")):
        for marker in re.findall(r"req\(([^)]*)\)", path.read_text()):
            for section in re.findall(r'"([A-Z]+)-\d+', marker):
                named.setdefault(section, set()).add(f"conformance/{path.name}")
    for name, section in mutation.SECTIONS.items():
        missing = named.get(name, set()) - set(section.conformance)
        assert not missing, f"section {name} is not judged by {sorted(missing)}, whose tests name its IDs"
