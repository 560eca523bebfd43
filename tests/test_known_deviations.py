"""Self-tests of the fork workflow's known-deviations files (HX-16 to HX-19): each runs a small suite
against adapters defined in a package outside this checkout, in a subprocess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_suite

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
def test_a_derived_adapter_inherits_overrides_and_removes_entries(suite: pytest.Pytester) -> None:
    """``MyFork(BaseStack)`` gets the base's entries (written with ``[basestack]``) for its own test
    ids (``[myfork]``); its own file overrides one (its reason shows) and removes one (``!``: that test
    must pass, and fails if it does not); an adapter without a file of its own inherits all. No entry
    is reported stale."""
    _package(
        suite,
        BASE_ENTRIES,
        "!test_stack.py::test_fixed_in_the_fork  # fixed in the fork\n"
        "test_stack.py::test_other_reason[myfork]  # the fork's own reason\n",
    )
    result = run_suite(
        suite, "--impl", "mystack.base:BaseStack,mystack.fork:MyFork,mystack.fork:Plain", "-rx", "-W", "error::UserWarning"
    )
    out = result.stdout.str()
    assert _outcomes(result) == {
        **{f"test_stack.py::test_{name}[{impl}]": "XFAIL" for name in ("wrong_keys", "other_reason")
           for impl in ("basestack", "plainfork")},
        "test_stack.py::test_fixed_in_the_fork[basestack]": "XFAIL",
        "test_stack.py::test_fixed_in_the_fork[plainfork]": "XPASS",  # inherited, and it passes there
        "test_stack.py::test_wrong_keys[myfork]": "XFAIL",
        "test_stack.py::test_fixed_in_the_fork[myfork]": "PASSED",
        "test_stack.py::test_other_reason[myfork]": "XFAIL",
        **{f"test_stack.py::test_passes[{impl}]": "PASSED" for impl in ("basestack", "myfork", "plainfork")},
    }, out
    assert "the fork's own reason" in out and "fork_deviations.txt:2" in out, out
    assert "StaleXfailWarning" not in out, out


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
    saying what was expected and what happened, per rank; one that passes is an XPASS as before."""
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
        "test_pins.py::test_passes_now[reference]": "XPASS",
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
        {"rank": 0, "type": "KeyError", "message": "'net.0.weight'"},
        {"rank": 1, "type": "AssertionError", "message": "rank 1 disagrees"},
    ]
    assert tests["test_ranks.py::test_known[ws2-reference]"]["outcome"] == "xfailed"
    assert [f["message"] for f in tests["test_ranks.py::test_known[ws2-reference]"]["failures"]] == ["known on rank 0", "known on rank 1"]
    assert tests["test_ranks.py::test_on_controller[reference]"]["failures"] == [
        {"rank": None, "type": "RuntimeError", "message": "controller failure"}
    ]
    assert data["known_deviations"] == [
        {"source": f"{xfails}:1", "pattern": "test_ranks.py::test_known", "impl": None, "reason": "known",
         "pin": "raises=ValueError ranks=all", "when": "", "active": True}
    ]


PROPERTY_TESTS = '''
from conformance.asserts import check_each, fail


def test_names_the_key_but_changes_the_model(impl):
    check_each(raises=lambda: None, unchanged=lambda: fail("model changed", "other values", "the same values"))


def test_names_no_key_and_changes_the_model(impl):
    check_each(raises=lambda: fail("error names no key", "'w'", "'net.w'"),
               unchanged=lambda: fail("model changed", "other values", "the same values"))
'''


@pytest.mark.req("HX-18")
def test_a_deviation_in_one_property_does_not_hide_another(suite: pytest.Pytester) -> None:
    """Tests check their properties with check_each: a pin on one property (the error names no key)
    does not cover a failure of another (the model changed), which is a failure naming it."""
    suite.makepyfile(test_props=PROPERTY_TESTS)
    xfails = suite.path / "x.txt"
    xfails.write_text(
        "test_props.py::test_names_the_key_but_changes_the_model  raises=Failed match='^\\[unchanged\\] model changed'  # changes the model\n"
        "test_props.py::test_names_no_key_and_changes_the_model  raises=Failed match='^\\[raises\\] error names no key'  # names no key\n"
    )
    result = run_suite(suite, "--impl", "reference", "--xfails", str(xfails))
    out = result.stdout.str()
    assert _outcomes(result) == {
        "test_props.py::test_names_the_key_but_changes_the_model[reference]": "XFAIL",
        "test_props.py::test_names_no_key_and_changes_the_model[reference]": "FAILED",
    }, out
    assert "expected a message matching '^\\\\[raises\\\\] error names no key', got controller: Failed: [unchanged] model changed" in out, out
