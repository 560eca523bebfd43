"""Unit tests of the expected-failures files (conformance/harness/xfails.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.harness.xfails import matches, matches_at_any_world_size, parse_xfails


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
