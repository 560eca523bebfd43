"""The layout rules of ``reference/`` (``tests/reference/test_layout.py``) hold for the suite, the
benchmarks and the tools as well: imports go one way (no cycle within or across ``conformance``,
``bench``, ``tools`` and ``reference``, and ``reference`` imports none of the others), and no module
imports another module's private names: what two modules share is public in one place. (Reading a
private attribute of torch's objects stays allowed here: the suite inspects upstream's internals on
purpose, where a comment says why.) A conformance test file holds tests: its helpers live in support
modules (``conformance/*_support.py``, ``asserts``, ...)."""

from __future__ import annotations

import pytest

from tests.layout_rules import ROOT, find_cycle, import_graph, modules_of, non_test_definitions, private_imports

PACKAGES = ("conformance", "bench", "tools", "reference")
MODULES = modules_of(*PACKAGES)
CONFORMANCE_TEST_FILES = sorted((ROOT / "conformance").glob("test_*.py"))
#: Conformance test files that still define helpers, and why; each entry is removed once its file's
#: helpers have moved (test_exempt_test_files_still_define_helpers says when).
HELPERS_NOT_YET_MOVED: dict[str, str] = {}


def test_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph(MODULES))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_reference_imports_only_itself() -> None:
    graph = import_graph(MODULES)
    bad = {m: sorted(i for i in imported if not i.startswith("reference")) for m, imported in graph.items() if m.startswith("reference")}
    assert not {m: i for m, i in bad.items() if i}, bad


def test_adapters_import_nothing_of_the_harness() -> None:
    """A fork codes against ``conformance/adapters``: what an adapter needs of a rank (its process group,
    the mesh layout) reaches it through :mod:`conformance.rank_context`, never the harness's internals."""
    graph = import_graph(MODULES)
    bad = {m: sorted(i for i in imported if i.startswith("conformance.harness")) for m, imported in graph.items() if m.startswith("conformance.adapters")}
    assert not {m: i for m, i in bad.items() if i}, bad


def test_test_files_import_no_other_test_file() -> None:
    """What tests share lives in support modules (``conformance/*_support.py``, ``asserts``, ...): a test
    file importing another runs that file's module-level set-up, and couples two files' tests."""
    graph = import_graph(MODULES)
    def is_test(module: str) -> bool:
        return module.rpartition(".")[2].startswith("test_")
    bad = {m: sorted(i for i in imported if is_test(i)) for m, imported in graph.items() if m.startswith("conformance")}
    assert not {m: i for m, i in bad.items() if i}, bad


def test_the_private_import_finder_finds_one(tmp_path) -> None:
    source = tmp_path / "m.py"
    source.write_text("from conformance.asserts import _short, check_each\nfrom os import _exit\n")
    assert private_imports(source, PACKAGES) == ["line 1: imports _short from conformance.asserts"]


@pytest.mark.parametrize("module", [m for m in MODULES if not m.startswith("reference")])
def test_no_module_imports_another_modules_private_names(module: str) -> None:
    bad = private_imports(MODULES[module], PACKAGES)
    assert not bad, f"{module}: " + "; ".join(bad)


def test_the_test_file_rule_finds_helpers(tmp_path) -> None:
    """Only tests, fixtures and the constants decorators read: a helper function or class, a constant a
    test reads, a constant nothing reads and any other statement are each reported."""
    source = tmp_path / "test_m.py"
    source.write_text(
        '"""doc"""\n'
        "from typing import TYPE_CHECKING\n"
        "import pytest\n"
        "if TYPE_CHECKING:\n    from pathlib import Path\n"
        "pytestmark = pytest.mark.rank_timeout(5)\n"
        "BASE = (1, 2)\n"
        "CASES = [*BASE, 3]\n"
        "A, B = 'a', 'b'\n"
        "LIMIT = 4\n"
        "UNUSED = 5\n"
        "def helper():\n    return 1\n"
        "class Helper:\n    pass\n"
        "assert CASES\n"
        "@pytest.fixture\ndef ops():\n    return 1\n"
        "@pytest.mark.parametrize('case', CASES, ids=[A, B, 'c'])\ndef test_x(ops, case):\n    assert case < LIMIT\n"
        "@pytest.mark.parametrize('n', [LIMIT])\ndef test_y(n):\n    pass\n"
    )
    assert non_test_definitions(source) == [
        "line 10: constant LIMIT (read in a test's or fixture's body)",
        "line 11: constant UNUSED (no test's decorator reads it)",
        "line 12: function helper (neither a test nor a fixture)",
        "line 14: class Helper",
        "line 16: assert CASES",
    ]


@pytest.mark.parametrize("path", CONFORMANCE_TEST_FILES, ids=lambda p: p.name)
def test_conformance_test_files_hold_only_tests(path) -> None:
    """A test file defines its tests, its fixtures and the parametrization constants of its decorators;
    everything else (helpers, set-up classes, tables the tests read) is in a support module, so that a
    test file reads as its SPEC section (docs/design.md, "Writing a conformance test")."""
    if path.name in HELPERS_NOT_YET_MOVED:
        pytest.skip(f"{path.name}: {HELPERS_NOT_YET_MOVED[path.name]}")
    bad = non_test_definitions(path)
    assert not bad, f"conformance/{path.name} defines more than tests, fixtures and parametrization constants: " + "; ".join(bad)


def test_exempt_test_files_still_define_helpers() -> None:
    names = {p.name for p in CONFORMANCE_TEST_FILES}
    stale = [name for name in HELPERS_NOT_YET_MOVED if name not in names or not non_test_definitions(ROOT / "conformance" / name)]
    assert not stale, f"HELPERS_NOT_YET_MOVED lists files that hold only tests now (or are gone): {stale}"


#: A support module is read top to bottom by whoever adds a requirement (docs/design.md, "Adding a
#: requirement"); past this it holds more than one concern and is split by section or concern (issue 48).
MAX_SUPPORT_LINES = 600


def test_no_conformance_support_module_outgrows_one_concern() -> None:
    """Every module of ``conformance/`` but the test files (support modules, the harness, adapters) stays
    within :data:`MAX_SUPPORT_LINES` lines."""
    long = {
        path.relative_to(ROOT).as_posix(): lines
        for path in sorted((ROOT / "conformance").rglob("*.py"))
        if not path.name.startswith("test_") and (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_SUPPORT_LINES
    }
    assert not long, f"support modules over {MAX_SUPPORT_LINES} lines (split by section or concern): {long}"
