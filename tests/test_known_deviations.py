"""Self-tests of the fork workflow's known-deviations files (HX-16 to HX-19): each runs a small suite
against adapters defined in a package outside this checkout, in a subprocess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, run_suite

#: A base adapter (like the shipped torch one) and a fork derived from it, in a package of their own,
#: each with its known deviations next to its module.
BASE_ADAPTER = '''
from conformance.adapters.base import Adapter


class BaseStack(Adapter):
    name = "basestack"
    xfails_file = "base_deviations.txt"
'''

FORK_ADAPTER = '''
from mystack.base import BaseStack


class MyFork(BaseStack):
    name = "myfork"
    xfails_file = "fork_deviations.txt"


class Plain(BaseStack):
    name = "plainfork"
'''

TESTS = '''
import pytest


def test_wrong_keys(impl):
    assert False, "keys differ: 'a.b'"


def test_fixed_in_the_fork(impl):
    if impl.name == "basestack":
        assert False, "the base stack still has this bug"


def test_other_reason(impl):
    assert False, "the fork breaks this differently"


def test_passes(impl):
    pass
'''


def _package(suite: pytest.Pytester, base_entries: str, fork_entries: str | None = None) -> None:
    package = suite.path / "mystack"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "base.py").write_text(BASE_ADAPTER)
    (package / "fork.py").write_text(FORK_ADAPTER)
    (package / "base_deviations.txt").write_text(base_entries)
    if fork_entries is not None:
        (package / "fork_deviations.txt").write_text(fork_entries)
    suite.makepyfile(test_stack=TESTS)


def _outcomes(result: pytest.RunResult) -> dict[str, str]:
    """test id -> PASSED/FAILED/XFAIL/... from the verbose lines."""
    outcomes = {}
    for line in result.stdout.lines:
        parts = line.split()
        if len(parts) >= 2 and "::" in parts[0] and parts[1] in ("PASSED", "FAILED", "XFAIL", "XPASS", "SKIPPED", "ERROR"):
            outcomes[parts[0]] = parts[1]
    return outcomes


BASE_ENTRIES = (
    "test_stack.py::test_wrong_keys[basestack]  # the base stack copies keys\n"
    "test_stack.py::test_fixed_in_the_fork[basestack]  # the base stack has this bug\n"
    "test_stack.py::test_other_reason[basestack]  # the base's reason\n"
)


@pytest.mark.req("HX-16")
def test_relative_xfails_file_is_found_next_to_the_adapter_module(suite: pytest.Pytester, tmp_path: Path) -> None:
    """``xfails_file = "base_deviations.txt"`` in a package outside this checkout is read from the
    package's directory, whatever the working directory."""
    _package(suite, BASE_ENTRIES)
    result = run_suite(suite, "--impl", "mystack.base:BaseStack", "-W", "error::UserWarning")
    assert _outcomes(result) == {
        "test_stack.py::test_wrong_keys[basestack]": "XFAIL",
        "test_stack.py::test_fixed_in_the_fork[basestack]": "XFAIL",
        "test_stack.py::test_other_reason[basestack]": "XFAIL",
        "test_stack.py::test_passes[basestack]": "PASSED",
    }, result.stdout.str()
    assert "the base stack copies keys" in result.stdout.str()


@pytest.mark.req("HX-16")
@pytest.mark.parametrize("how", ["adapter", "option"])
def test_missing_xfails_file_is_a_usage_error_naming_it(suite: pytest.Pytester, how: str) -> None:
    _package(suite, BASE_ENTRIES)
    if how == "adapter":
        (suite.path / "mystack" / "base_deviations.txt").unlink()
        result = run_suite(suite, "--impl", "mystack.base:BaseStack")
        path = suite.path / "mystack" / "base_deviations.txt"
    else:
        result = run_suite(suite, "--impl", "mystack.base:BaseStack", "--xfails", "missing.txt")
        path = suite.path / "missing.txt"
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out
    assert f"expected-failures file {path} " in out and "does not exist" in out, out
    assert "INTERNALERROR" not in out and "Traceback" not in out, out
    if how == "adapter":
        assert "mystack.base.BaseStack.xfails_file = 'base_deviations.txt'" in out, out


@pytest.mark.req("HX-17")
@pytest.mark.parametrize("written_with", ["myfork", "basestack"])
def test_a_derived_adapter_inherits_overrides_and_removes_entries(suite: pytest.Pytester, written_with: str) -> None:
    """``MyFork(BaseStack)`` gets the base's entries (written with ``[basestack]``) for its own test
    ids (``[myfork]``); its own file overrides one (its reason shows) and removes one (``!``: that test
    must pass, and fails if it does not), written with its own name or, copied from the base's file,
    with the base's; an adapter without a file of its own inherits all (and fails where an inherited
    deviation passes: strict). No entry is reported stale."""
    _package(
        suite,
        BASE_ENTRIES,
        f"!test_stack.py::test_fixed_in_the_fork[{written_with}]  # fixed in the fork\n"
        f"test_stack.py::test_other_reason[{written_with}]  # the fork's own reason\n",
    )
    result = run_suite(
        suite, "--impl", "mystack.base:BaseStack,mystack.fork:MyFork,mystack.fork:Plain", "-rx", "-W", "error::UserWarning"
    )
    out = result.stdout.str()
    assert _outcomes(result) == {
        **{f"test_stack.py::test_{name}[{impl}]": "XFAIL" for name in ("wrong_keys", "other_reason")
           for impl in ("basestack", "plainfork")},
        "test_stack.py::test_fixed_in_the_fork[basestack]": "XFAIL",
        "test_stack.py::test_fixed_in_the_fork[plainfork]": "FAILED",  # inherited, and it passes there: strict
        "test_stack.py::test_wrong_keys[myfork]": "XFAIL",
        "test_stack.py::test_fixed_in_the_fork[myfork]": "PASSED",
        "test_stack.py::test_other_reason[myfork]": "XFAIL",
        **{f"test_stack.py::test_passes[{impl}]": "PASSED" for impl in ("basestack", "myfork", "plainfork")},
    }, out
    assert "the fork's own reason" in out and "fork_deviations.txt:2" in out, out
    assert "StaleXfailWarning" not in out, out


@pytest.mark.req("HX-17")
def test_an_xfails_line_written_with_the_base_name_is_warned_about(suite: pytest.Pytester) -> None:
    """A ``--xfails`` file applies to every test as written: a line with the base's name in the test id
    matches nothing of the fork, and the warning says so, names the line, and what to write instead."""
    _package(suite, BASE_ENTRIES, "")
    xfails = suite.path / "ci.txt"
    xfails.write_text("# mine\n!test_stack.py::test_fixed_in_the_fork[basestack]  # fixed in the fork\n")
    result = run_suite(suite, "--impl", "mystack.fork:MyFork", "--xfails", str(xfails), "-W", "default")
    out = result.stdout.str()
    assert _outcomes(result)["test_stack.py::test_fixed_in_the_fork[myfork]"] == "FAILED", out
    assert f"expected-failures entry 'test_stack.py::test_fixed_in_the_fork[basestack]' ({xfails}:2) matches no collected test" in out, out
    assert "it is written with the name 'basestack', but these tests run against 'myfork'" in out, out
    assert "mystack.fork.MyFork (its xfails_file)" in out, out


STRICT_TESTS = '''
def test_passes(impl):
    pass


def test_still_fails(impl):
    assert False, "keys differ"


def test_race(impl):
    pass


def test_known_hang(dist, impl):
    pass
'''


@pytest.mark.req("HX-22")
def test_a_known_deviation_that_passes_fails_the_run(suite: pytest.Pytester) -> None:
    """An entry whose test passes fails the run, naming the entry (file:line, line) and what to do: for
    the adapter's own or a ``--xfails`` entry, remove it; for an inherited one, the ``!`` line to add to
    the derived adapter's own file (named). ``flaky`` lets it pass (XPASS, run green); a ``hangs``
    entry run with --run-known-hangs is strict too. The JSON result records the XPASS as strict or not."""
    package = suite.path / "mystack"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "base.py").write_text(BASE_ADAPTER)
    (package / "fork.py").write_text(FORK_ADAPTER)
    (package / "base_deviations.txt").write_text(
        "test_strict.py::test_passes  raises=Failed  # the base fails here\n"
        "test_strict.py::test_still_fails  raises=AssertionError  # still fails\n"
        "test_strict.py::test_race  flaky raises=Failed  # a race: passes in some runs\n"
        "test_strict.py::test_known_hang  hangs  # waits forever\n"
    )
    (package / "fork_deviations.txt").write_text("# the fork's own\n")
    suite.makepyfile(test_strict=STRICT_TESTS)
    report = suite.path / "out.json"
    result = run_suite(suite, "--impl", "mystack.base:BaseStack,mystack.fork:MyFork", "--world-size", "1", "--report-json", str(report))
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED, out
    base_file = package / "base_deviations.txt"
    outcomes = _outcomes(result)
    for impl in ("basestack", "myfork"):
        assert outcomes[f"test_strict.py::test_passes[{impl}]"] == "FAILED", out
        assert outcomes[f"test_strict.py::test_still_fails[{impl}]"] == "XFAIL", out
        assert outcomes[f"test_strict.py::test_race[{impl}]"] == "XPASS", out
        assert outcomes[f"test_strict.py::test_known_hang[ws1-{impl}]"] == "XFAIL", out
    assert (
        f"known deviation no longer deviates: test_strict.py::test_passes[basestack] passed, but {base_file}:1 expects it to fail:\n"
        f"    test_strict.py::test_passes raises=Failed  # the base fails here\n"
        f"If this is a fix, remove that entry from {base_file}"
    ) in out, out
    assert "cancel the entry with the line `!test_strict.py::test_passes[basestack]` in a file given with --xfails" in out, out
    assert (
        f"known deviation no longer deviates: test_strict.py::test_passes[myfork] passed, but {base_file}:1 expects it to fail:" in out
        and f"The entry is inherited from the 'basestack' adapter: if 'myfork' fixed it, cancel it in its own expected-failures file, "
        f"{package / 'fork_deviations.txt'} with the line\n    !test_strict.py::test_passes[myfork]  # fixed in myfork" in out
    ), out
    data = json.loads(report.read_text())["tests"]
    passed = data["test_strict.py::test_passes[myfork]"]
    assert (passed["outcome"], passed["strict"], passed["entry"]["source"]) == ("xpassed", True, f"{base_file}:1"), passed
    assert passed["reason"].startswith("known deviation no longer deviates: test_strict.py::test_passes[myfork] passed"), passed
    race = data["test_strict.py::test_race[myfork]"]
    assert (race["outcome"], race["strict"]) == ("xpassed", False), race

    hangs = run_suite(suite, "--impl", "mystack.base:BaseStack", "--world-size", "1", "--run-known-hangs", "-k", "known_hang")
    assert _outcomes(hangs) == {"test_strict.py::test_known_hang[ws1-basestack]": "FAILED"}, hangs.stdout.str()
    assert f"but {base_file}:4 expects it to fail" in hangs.stdout.str(), hangs.stdout.str()

    # Only flaky and still-failing entries: the run is green.
    green = run_suite(suite, "--impl", "mystack.base:BaseStack", "--world-size", "1", "-k", "race or still_fails")
    assert green.ret == pytest.ExitCode.OK, green.stdout.str()


PINNED_TESTS = '''
import pytest


def test_names_no_key(impl):
    raise ValueError("Missing key(s) in state_dict")


def test_raises_another_type(impl):
    raise TypeError("Missing key(s) in state_dict")


def test_message_changed(impl):
    raise ValueError("size mismatch for net.0.weight")


def test_one_rank_fails(dist, impl):
    if dist.rank == dist.world_size - 1:
        raise ValueError("bad on the last rank")


def test_other_rank_fails(dist, impl):
    if dist.rank == 0:
        raise ValueError("bad on the last rank")


def test_passes_now(impl):
    pass
'''

PINS = (
    "test_pins.py::test_names_no_key  raises=ValueError match='^Missing key'  # torch names no key\n"
    "test_pins.py::test_raises_another_type  raises=ValueError  # pinned to ValueError\n"
    "test_pins.py::test_message_changed  raises=Exception match='Missing key\\(s\\)'  # pinned to another message\n"
    "test_pins.py::test_one_rank_fails  ranks=last raises=ValueError  # only the bad rank raises\n"
    "test_pins.py::test_other_rank_fails  ranks=last  # only the bad rank raises\n"
    "test_pins.py::test_passes_now  raises=ValueError  # fixed since\n"
)


@pytest.mark.req("HX-18")
def test_a_pinned_deviation_that_fails_differently_is_a_failure(suite: pytest.Pytester) -> None:
    """An entry pins the exception type (a base class counts), a regex on the message and the failing
    ranks; a test that fails as pinned is an expected failure, one that fails otherwise is a failure
    saying what was expected and what happened, per rank; one that passes fails too (HX-22)."""
    suite.makepyfile(test_pins=PINNED_TESTS)
    xfails = suite.path / "pins.txt"
    xfails.write_text(PINS)
    result = run_suite(suite, "--impl", "reference", "--world-size", "2", "--xfails", str(xfails))
    out = result.stdout.str()
    assert _outcomes(result) == {
        "test_pins.py::test_names_no_key[reference]": "XFAIL",
        "test_pins.py::test_raises_another_type[reference]": "FAILED",
        "test_pins.py::test_message_changed[reference]": "FAILED",
        "test_pins.py::test_one_rank_fails[ws2-reference]": "XFAIL",
        "test_pins.py::test_other_rank_fails[ws2-reference]": "FAILED",
        "test_pins.py::test_passes_now[reference]": "FAILED",  # strict: a known deviation that passes fails the run
    }, out
    assert f"known deviation failed differently ({xfails}:2: pinned to ValueError): expected ValueError, got controller: TypeError: Missing key(s)" in out, out
    assert "expected a message matching 'Missing key\\\\(s\\\\)', got controller: ValueError: size mismatch for net.0.weight" in out, out
    assert "expected failing ranks [1] (last), got [0]" in out, out


@pytest.mark.req("HX-18")
@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("t.py::a  raises=  # x", "'raises=' has no value"),
        ("t.py::a  match='(unclosed'  # x", "is not a regex"),
        ("t.py::a  ranks=first  # x", "ranks='first': expected all, last, not-last or a list like 0,2"),
        ("t.py::a  clauses=ML-4.b,ml-4  # x", "'ml-4' is not a clause ID like ML-13.b, ML-5 or ML-2+ML-8"),
        ("t.py::a  colour=red  # x", "unknown key 'colour'"),
        ("!t.py::a  hangs  # x", "a removal (!t.py::a) takes no flags or pins"),
    ],
)
def test_a_malformed_pin_is_a_usage_error_naming_the_line(suite: pytest.Pytester, line: str, error: str) -> None:
    suite.makepyfile(test_x="def test_x(impl):\n    pass\n")
    xfails = suite.path / "xfails.txt"
    xfails.write_text("# header\n" + line + "\n")
    result = run_suite(suite, "--impl", "reference", "--xfails", str(xfails))
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out
    assert f"{xfails}:2: " in out and error in out and "INTERNALERROR" not in out, out


CONDITION_TESTS = '''
def test_old_torch_only(impl):
    assert False, "fails on old torch only"


def test_this_torch(impl):
    assert False, "fails on this torch"


def test_on_nccl_only(dist, impl):
    assert False, "fails on gloo too, so the nccl entry must not hide it"


def test_on_gloo_cpu(dist, impl):
    assert False, "fails on gloo"
'''

CONDITIONS = (
    "test_cond.py::test_old_torch_only  torch<1.0  # only before torch 1.0\n"
    "test_cond.py::test_this_torch  torch>=1.0,<99  # from torch 1.0 on\n"
    "test_cond.py::test_on_nccl_only  backend=nccl  # nccl only\n"
    "test_cond.py::test_on_gloo_cpu  backend=gloo device=cpu  # gloo on cpu\n"
    "test_cond.py::test_renamed_long_ago  torch<1.0  # inactive: not stale either\n"
)


@pytest.mark.req("HX-19")
def test_conditions_say_where_an_entry_holds(suite: pytest.Pytester) -> None:
    """An entry holds only for the torch versions, backends and devices it names; an inactive entry
    marks nothing and is not stale; the header says which entries are active."""
    suite.makepyfile(test_cond=CONDITION_TESTS)
    xfails = suite.path / "cond.txt"
    xfails.write_text(CONDITIONS)
    result = run_suite(suite, "--impl", "reference", "--world-size", "1", "--backend", "gloo", "--xfails", str(xfails), "-W", "default")
    out = result.stdout.str()
    assert _outcomes(result) == {
        "test_cond.py::test_old_torch_only[reference]": "FAILED",
        "test_cond.py::test_this_torch[reference]": "XFAIL",
        "test_cond.py::test_on_nccl_only[ws1-reference]": "FAILED",
        "test_cond.py::test_on_gloo_cpu[ws1-reference]": "XFAIL",
    }, out
    assert "StaleXfailWarning" not in out, out
    assert f"known deviations {xfails}: 5 entries, 3 active for torch" in out, out
    assert "(2 of them only on some backends/devices)" in out and "inactive: 2 x torch<1.0" in out, out
    assert f"inactive (torch<1.0): {xfails}:1 test_cond.py::test_old_torch_only" in out, out
    assert f"only where backend=nccl: {xfails}:3 test_cond.py::test_on_nccl_only" in out, out


FAILING_RANKS = '''
def test_ranks_fail_differently(dist, impl):
    if dist.rank == 0:
        raise KeyError("net.0.weight")
    raise AssertionError(f"rank {dist.rank} disagrees")


def test_known(dist, impl):
    raise ValueError(f"known on rank {dist.rank}")


def test_on_controller(impl):
    raise RuntimeError("controller failure")
'''


@pytest.mark.req("HX-20")
def test_report_json_records_each_failed_rank(suite: pytest.Pytester) -> None:
    """``--report-json`` keeps, for a failed or expected-to-fail test, each failing rank's exception
    type and message (rank null on the controller), and the entries of the run with their pins."""
    suite.makepyfile(test_ranks=FAILING_RANKS)
    xfails = suite.path / "x.txt"
    xfails.write_text("test_ranks.py::test_known  raises=ValueError ranks=all  # known\n")
    report = suite.path / "out.json"
    run_suite(suite, "--impl", "reference", "--world-size", "2", "--xfails", str(xfails), "--report-json", str(report))
    data = json.loads(report.read_text())
    tests = data["tests"]
    assert tests["test_ranks.py::test_ranks_fail_differently[ws2-reference]"]["failures"] == [
        {"rank": 0, "type": "KeyError", "message": "'net.0.weight'", "clause": None},
        {"rank": 1, "type": "AssertionError", "message": "rank 1 disagrees", "clause": None},
    ]
    assert tests["test_ranks.py::test_known[ws2-reference]"]["outcome"] == "xfailed"
    assert [f["message"] for f in tests["test_ranks.py::test_known[ws2-reference]"]["failures"]] == ["known on rank 0", "known on rank 1"]
    assert tests["test_ranks.py::test_on_controller[reference]"]["failures"] == [
        {"rank": None, "type": "RuntimeError", "message": "controller failure", "clause": None}
    ]
    assert data["known_deviations"] == [
        {"source": f"{xfails}:1", "pattern": "test_ranks.py::test_known", "impl": None, "reason": "known",
         "pin": "raises=ValueError ranks=all", "flags": [], "exclude": None, "when": "", "active": True}
    ]


CLAUSE_TESTS = '''
import pytest

from conformance.asserts import check_each, clause, fail


@pytest.mark.req("ML-4")
def test_names_the_key_but_changes_the_model(impl):
    check_each({"ML-4.a": lambda: None, "ML-4.b": lambda: fail("model changed", "other values", "the same values")})


@pytest.mark.req("ML-4")
def test_names_no_key_and_changes_the_model(impl):
    check_each({"ML-4.a": lambda: fail("error names no key", "'w'", "'net.w'"),
                "ML-4.b": lambda: fail("model changed", "other values", "the same values")})


@pytest.mark.req("ML-4")
def test_reworded(impl):
    with clause("ML-4.b"):
        fail("the model was changed by the load (new wording)", "other values", "the same values")


@pytest.mark.req("ML-4")
def test_implementation_raises_inside_a_clause(dist, impl):
    with clause("ML-4.a"):
        raise KeyError("net.w")


@pytest.mark.req("ML-4")
def test_untagged(impl):
    fail("something of ML-4 as a whole", "x", "y")


@pytest.mark.req("ML-4", "ML-9")
def test_of_two_requirements_untagged(impl):
    raise KeyError("w")
'''


@pytest.mark.req("HX-18")
def test_a_deviation_in_one_clause_does_not_hide_another(suite: pytest.Pytester) -> None:
    """A pin names the SPEC clauses a test fails: check_each's keys and ``clause()`` say which clause an
    assertion (or an implementation's own exception) is; a failure of a clause the pin does not name is a
    failure naming it, and rewording an assertion changes nothing. An untagged failure is the test's
    requirement, several joined by ``+``."""
    suite.makepyfile(test_clauses=CLAUSE_TESTS)
    xfails = suite.path / "x.txt"
    xfails.write_text(
        "test_clauses.py::test_names_the_key_but_changes_the_model  clauses=ML-4.b  # changes the model\n"
        "test_clauses.py::test_names_no_key_and_changes_the_model  clauses=ML-4.a  # names no key\n"
        "test_clauses.py::test_reworded  clauses=ML-4.b raises=Failed  # changes the model\n"
        "test_clauses.py::test_implementation_raises_inside_a_clause  clauses=ML-4.a raises=KeyError ranks=all  # a bare KeyError\n"
        "test_clauses.py::test_untagged  clauses=ML-4.a  # names a clause the failure is not\n"
        "test_clauses.py::test_of_two_requirements_untagged  clauses=ML-4+ML-9 raises=KeyError  # a bare KeyError\n"
    )
    report = suite.path / "out.json"
    result = run_suite(suite, "--impl", "reference", "--world-size", "2", "--xfails", str(xfails), "--report-json", str(report))
    out = result.stdout.str()
    assert _outcomes(result) == {
        "test_clauses.py::test_names_the_key_but_changes_the_model[reference]": "XFAIL",
        "test_clauses.py::test_names_no_key_and_changes_the_model[reference]": "FAILED",
        "test_clauses.py::test_reworded[reference]": "XFAIL",
        "test_clauses.py::test_implementation_raises_inside_a_clause[ws2-reference]": "XFAIL",
        "test_clauses.py::test_untagged[reference]": "FAILED",
        "test_clauses.py::test_of_two_requirements_untagged[reference]": "XFAIL",
    }, out
    assert "expected a failure of ML-4.a, got controller [ML-4.b]: Failed: [ML-4.b] model changed" in out, out
    assert "expected a failure of ML-4.a, got controller [ML-4]: Failed: something of ML-4 as a whole" in out, out
    tests = json.loads(report.read_text())["tests"]
    assert [(f["rank"], f["type"], f["clause"]) for f in tests["test_clauses.py::test_implementation_raises_inside_a_clause[ws2-reference]"]["failures"]] == [
        (0, "KeyError", "ML-4.a"), (1, "KeyError", "ML-4.a")]
    assert [(f["clause"], f["message"]) for f in tests["test_clauses.py::test_names_no_key_and_changes_the_model[reference]"]["failures"]] == [
        ("ML-4.a", "[ML-4.a] error names no key\n  got:      'w'\n  expected: 'net.w'"),
        ("ML-4.b", "[ML-4.b] model changed\n  got:      other values\n  expected: the same values")]


EXCLUSION_TESTS = '''
import json
from pathlib import Path

import pytest


@pytest.mark.case_families("hybrid", "split", "ties")
def test_drawn(impl, excluded_cases):
    Path(f"excluded-{impl.name}.json").write_text(json.dumps(sorted((e.exclude, Path(e.source).name) for e in excluded_cases)))


def test_plain(impl):
    pass
'''

OTHER_ADAPTER = '''
from mystack.base import BaseStack


class Cleared(BaseStack):
    name = "cleared"
    xfails_file = "cleared.txt"
'''


def _exclusion_package(suite: pytest.Pytester, base_entries: str) -> None:
    _package(suite, base_entries, "!test_excl.py::test_drawn[basestack]  exclude=hybrid  # the fork fixed it (a line copied from the base)\n")
    (suite.path / "mystack" / "other.py").write_text(OTHER_ADAPTER)
    (suite.path / "mystack" / "cleared.txt").write_text("!test_excl.py::test_drawn[cleared]  # every inherited entry\n")
    suite.makepyfile(test_excl=EXCLUSION_TESTS)


@pytest.mark.req("HX-24")
def test_exclusions_of_generated_cases_are_inherited_and_cancelled(suite: pytest.Pytester) -> None:
    """Every ``exclude=`` entry that matches a test reaches it through ``excluded_cases`` (not only the
    first), with its source; a derived adapter inherits them (``plainfork``), cancels one with
    ``!pattern exclude=NAME`` (``myfork``) or all with ``!pattern`` (``cleared``); an expected-failure
    entry of the same test is independent of them."""
    _exclusion_package(
        suite,
        "test_excl.py::test_drawn[basestack]  exclude=hybrid  # h\n"
        "test_excl.py::test_drawn  exclude=split  # any adapter's: a prefix\n"
        "test_excl.py::test_drawn[basestack]  exclude=ties  # t\n"
        "test_excl.py::test_drawn[basestack]  raises=AssertionError  # an expected failure beside them\n",
    )
    impls = "mystack.base:BaseStack,mystack.fork:MyFork,mystack.fork:Plain,mystack.other:Cleared"
    result = run_suite(suite, "--impl", impls, "-W", "error::UserWarning", "test_excl.py")
    out = result.stdout.str()
    seen = {name: json.loads((suite.path / f"excluded-{name}.json").read_text()) for name in ("basestack", "myfork", "plainfork", "cleared")}
    every = [["hybrid", "base_deviations.txt:1"], ["split", "base_deviations.txt:2"], ["ties", "base_deviations.txt:3"]]
    assert seen == {"basestack": every, "plainfork": every, "myfork": every[1:], "cleared": []}, (seen, out)
    # The expected failure applies beside the exclusions (strict: the test passes, so it fails), is not
    # cancelled by a removal of one exclusion (myfork), and is by a plain removal (cleared).
    assert {k: v for k, v in _outcomes(result).items() if "test_drawn" in k} == {
        "test_excl.py::test_drawn[basestack]": "FAILED", "test_excl.py::test_drawn[myfork]": "FAILED",
        "test_excl.py::test_drawn[plainfork]": "FAILED", "test_excl.py::test_drawn[cleared]": "PASSED",
    }, out
    assert "StaleXfailWarning" not in out, out


@pytest.mark.req("HX-24")
@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("test_excl.py::test_drawn  exclude=nope  # x", "base_deviations.txt:1: exclude=nope: test_excl.py::test_drawn[basestack] draws no family "
         "of that name (it draws: hybrid, split, ties)"),
        ("test_excl.py::test_plain  exclude=split  # x", "base_deviations.txt:1: exclude=split matches test_excl.py::test_plain[basestack], "
         "which draws no generated cases"),
        ("test_excl.py::test_drawn  exclude=split raises=Failed  # x", "base_deviations.txt:1: an exclusion (exclude=split) takes no flags or pins"),
        ("test_excl.py::test_drawn  exclude=Not_A_Name  # x", "base_deviations.txt:1: exclude='Not_A_Name': expected the name of a family"),
    ],
)
def test_a_wrong_exclusion_is_a_usage_error_naming_the_line(suite: pytest.Pytester, line: str, error: str) -> None:
    _exclusion_package(suite, line + "\n")
    result = run_suite(suite, "--impl", "mystack.base:BaseStack")
    out = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, out
    assert error in out and "INTERNALERROR" not in out, out


TORCH_FORK = '''
from conformance.adapters.impls import TorchAdapter


class TorchFork(TorchAdapter):
    """A fork identical to torch, with no expected-failures file of its own."""

    name = "torchfork"
'''


@pytest.mark.req("HX-24")
def test_a_fork_identical_to_torch_passes_the_generated_tests_torch_passes(suite: pytest.Pytester) -> None:
    """The generated tests leave torch's known deviations out of the domain of a fork derived from the
    torch adapter too (torch's exclude= entries, inherited): a fork identical to torch passes them as
    torch does (the families cover cases both would fail at world size 1)."""
    (suite.path / "torchfork.py").write_text(TORCH_FORK)
    result = run_suite(
        suite, str(REPO_ROOT / "conformance" / "test_generated.py"), "--rootdir", str(suite.path), "--impl", "torchfork:TorchFork", "--world-size", "1",
        "-k", "test_generated_state_dict_round_trip or test_generated_optim_state_reload", timeout=600,
    )
    assert _outcomes(result) == {
        "conformance/test_generated.py::test_generated_state_dict_round_trip[torchfork]": "PASSED",
        "conformance/test_generated.py::test_generated_optim_state_reload[torchfork]": "PASSED",
    }, result.stdout.str()


def _fenced_blocks(text: str) -> list[str]:
    """The contents of the fenced code blocks of a markdown page, in order."""
    import re

    return [block for _, block in re.findall(r"```(\w*)\n(.*?)```", text, re.DOTALL)]


@pytest.mark.req("HX-17", "HX-18")
def test_the_readme_fork_file_works_as_written(suite: pytest.Pytester) -> None:
    """README's adapter and its known-deviations file, copied as they are (the adapter's checkpoint ops
    are torch's, as a fork that has not changed them yet): the entry pinned to a clause marks torch's
    tied-storage test, which fails that clause only (XFAIL), and the ``!`` line cancels torch's entry for
    the Exception test, which then runs and fails as torch does."""
    blocks = _fenced_blocks((REPO_ROOT / "README.md").read_text(encoding="utf-8"))
    adapter = next(b for b in blocks if "class MyStackAdapter(TorchAdapter)" in b)
    deviations = next(b for b in blocks if b.startswith("# mystack/known_deviations.txt"))
    package = suite.path / "mystack"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "conformance_adapter.py").write_text(adapter)
    (package / "known_deviations.txt").write_text(deviations)
    (package / "testing.py").write_text("from conformance.adapters.checkpoint import TorchCheckpointOps as MyCheckpointOps\n")
    result = run_suite(
        suite, str(REPO_ROOT / "conformance" / "test_checkpoint.py"), "--rootdir", str(suite.path),
        "--impl", "mystack.conformance_adapter:MyStackAdapter", "--world-size", "2", "-W", "error::UserWarning",
        "-k", "test_meta_load_keeps_tied_storage_shared or test_errors_are_exceptions_alike_on_every_rank and missing-key", timeout=600,
    )
    out = result.stdout.str()
    assert _outcomes(result) == {
        "conformance/test_checkpoint.py::test_meta_load_keeps_tied_storage_shared[ws2-mystack]": "XFAIL",
        "conformance/test_checkpoint.py::test_errors_are_exceptions_alike_on_every_rank[ws2-mystack-missing-key]": "FAILED",
    }, out
    assert "known_deviations.txt:2" in out and "clauses=ML-5.a" in out, out
    assert "[ML-15.a]" in out and "the error is not an Exception" in out, out
