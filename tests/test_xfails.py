"""Unit tests of the expected-failures files (conformance/harness/xfails.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.harness.failures import Failure
from conformance.harness.xfails import Condition, Pin, as_run_by, matches, matches_at_any_world_size, parse_xfails


@pytest.mark.req("HX-10")
def test_entries_carry_pattern_reason_and_source(tmp_path: Path) -> None:
    path = tmp_path / "x.txt"
    path.write_text("# header\n\nt.py::a[torch]  # keys differ\nt.py::b\n")
    entries = parse_xfails(path, impl="torch")
    assert [(e.pattern, e.reason, e.impl) for e in entries] == [
        ("t.py::a[torch]", "keys differ", "torch"),
        ("t.py::b", "listed in x.txt", "torch"),
    ]
    assert entries[0].source == f"{path}:3"
    assert entries[0].matches("t.py::a[torch]") and not entries[0].matches("t.py::a[reference]")
    with pytest.raises(FileNotFoundError, match="does-not-exist.txt"):
        parse_xfails(tmp_path / "does-not-exist.txt")


@pytest.mark.req("HX-10")
@pytest.mark.parametrize(
    ("pattern", "nodeid", "expected"),
    [
        ("t.py::a[ws2-torch]", "t.py::a[ws2-torch]", True),  # exact
        ("t.py::a", "t.py::a[ws2-torch]", True),  # prefix
        ("t.py::a*-torch-dtype]", "t.py::a[ws2-torch-dtype]", True),  # glob
        ("t.py::a*-torch-dtype]", "t.py::a[ws2-torch-shape]", False),
        ("t.py::b", "t.py::a[ws2-torch]", False),
    ],
)
def test_matching(pattern: str, nodeid: str, expected: bool) -> None:
    assert matches(pattern, nodeid) is expected


@pytest.mark.req("HX-10")
def test_an_entry_for_an_unselected_world_size_is_not_stale() -> None:
    assert matches_at_any_world_size("t.py::a[ws4-torch]", "t.py::a[ws1-torch]")
    assert matches_at_any_world_size("t.py::a*ws[2-9]-torch-x]", "t.py::a[ws1-torch-x]")
    assert not matches_at_any_world_size("t.py::a[ws4-torch]", "t.py::a[ws1-reference]")


@pytest.mark.req("HX-15")
def test_flags_sit_between_pattern_and_reason(tmp_path: Path) -> None:
    path = tmp_path / "x.txt"
    path.write_text("t.py::a[ws2-torch]  hangs  # rank 0 waits in a broadcast\nt.py::b  # fails promptly\n")
    a, b = parse_xfails(path)
    assert (a.pattern, a.hangs, a.reason) == ("t.py::a[ws2-torch]", True, "rank 0 waits in a broadcast")
    assert (b.pattern, b.hangs) == ("t.py::b", False)


@pytest.mark.req("HX-15")
def test_an_unknown_flag_is_an_error_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "x.txt"
    path.write_text("t.py::a\nt.py::b  hang  # typo of hangs\n")
    with pytest.raises(ValueError, match=rf"{path}:2: unknown flag 'hang' \(known: hangs: "):
        parse_xfails(path)


@pytest.mark.req("HX-17")
@pytest.mark.parametrize(
    ("nodeid", "expected"),
    [
        ("t.py::a[ws2-myfork-dtype]", "t.py::a[ws2-torch-dtype]"),
        ("t.py::a[myfork]", "t.py::a[torch]"),
        ("t.py::a[ws1-ws2-myfork]", "t.py::a[ws1-ws2-torch]"),
        ("t.py::a[ws2-myfork-myfork]", "t.py::a[ws2-torch-myfork]"),  # the adapter's segment only: the first
        ("t.py::a[ws2-myforked]", "t.py::a[ws2-myforked]"),  # a longer name is another segment
        ("t.py::a", "t.py::a"),
    ],
)
def test_a_derived_adapters_test_id_is_read_as_the_base_adapters(nodeid: str, expected: str) -> None:
    assert as_run_by(nodeid, "myfork", "torch") == expected


def _failure(rank: int | None, exc: BaseException) -> Failure:
    return Failure.of(exc, rank)


@pytest.mark.req("HX-18")
def test_a_pin_names_what_differs() -> None:
    pin = Pin(raises="LookupError", match=r"key '\w+\.weight'", ranks="last")
    assert pin.mismatch([_failure(1, KeyError("key 'net.weight' is missing"))], world_size=2) is None  # KeyError is a LookupError
    assert pin.mismatch([], world_size=2) is None  # passed: XPASS, not a mismatch
    assert pin.mismatch([_failure(0, KeyError("key 'net.weight'"))], world_size=2) == "expected failing ranks [1] (last), got [0]"
    wrong_type = pin.mismatch([_failure(1, TypeError("key 'net.weight'"))], world_size=2)
    assert wrong_type == "expected LookupError, got rank 1: TypeError: key 'net.weight'"
    wrong_text = pin.mismatch([_failure(1, KeyError("no key"))], world_size=2)
    assert wrong_text == "expected a message matching \"key '\\\\w+\\\\.weight'\", got rank 1: KeyError: 'no key'"
    assert Pin(ranks="not-last").expected_ranks(3) == [0, 1] and Pin(ranks="2,0").expected_ranks(3) == [0, 2]
    assert Pin(ranks="all").mismatch([_failure(None, ValueError("x"))], world_size=None) == (
        "expected ranks=all, but the test ran on the controller"
    )


@pytest.mark.req("HX-19")
@pytest.mark.parametrize(
    ("version", "spec", "expected"),
    [
        ("2.11.0+cu130", "<2.13", True),
        ("2.13.0+cpu", "<2.13", False),
        ("2.13.0", ">=2.11,<2.14", True),
        ("2.14.0a0+gitabc", ">=2.14", True),  # a nightly of 2.14 counts as 2.14
        ("2.14.0a0+gitabc", "<2.14", False),
    ],
)
def test_torch_conditions(version: str, spec: str, expected: bool) -> None:
    assert Condition(torch=spec).holds(version, None) is expected


@pytest.mark.req("HX-19")
def test_backend_and_device_conditions() -> None:
    nccl, cuda = Condition(backend="nccl"), Condition(device="cuda")
    assert nccl.holds("2.13.0", "nccl") and not nccl.holds("2.13.0", "gloo") and not nccl.holds("2.13.0", None)
    assert cuda.holds("2.13.0", "nccl") and not cuda.holds("2.13.0", "gloo")
    assert Condition(device="cpu").holds("2.13.0", "gloo") and not Condition(device="cpu").holds("2.13.0", None)


@pytest.mark.req("HX-18", "HX-19")
def test_pins_and_conditions_parse_with_shell_quoting(tmp_path: Path) -> None:
    path = tmp_path / "x.txt"
    path.write_text(
        "t.py::a[ws2-torch]  raises=ValueError match='names no # key' ranks=all torch<2.13 backend=nccl  # reason # with hashes\n"
        "!t.py::b  device=cuda  # fixed on GPUs\n"
    )
    a, b = parse_xfails(path, impl="torch", depth=2)
    assert (a.pin, a.when, a.reason) == (Pin("ValueError", "names no # key", "all"), Condition("<2.13", "nccl"), "reason # with hashes")
    assert (b.pattern, b.removes, b.when, b.depth) == ("t.py::b", True, Condition(device="cuda"), 2)
