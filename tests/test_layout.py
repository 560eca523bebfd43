"""The layout rules of ``reference/`` (``tests/reference/test_layout.py``) hold for the suite, the
benchmarks and the tools as well: imports go one way (no cycle within or across ``conformance``,
``bench``, ``tools`` and ``reference``, and ``reference`` imports none of the others), and no module
imports another module's private names: what two modules share is public in one place. (Reading a
private attribute of torch's objects stays allowed here: the suite inspects upstream's internals on
purpose, where a comment says why.)"""

from __future__ import annotations

import pytest

from tests.layout_rules import find_cycle, import_graph, modules_of, private_imports

PACKAGES = ("conformance", "bench", "tools", "reference")
MODULES = modules_of(*PACKAGES)


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
