"""Self-tests of conformance/cli/pin_deviations.py: the pins it proposes hold for the failures they come from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.cli.pin_deviations import main, propose
from conformance.harness.failures import Failure
from conformance.harness.xfails import Pin, parse_xfails


def _test(*failures: tuple[int | None, str, str], clause: str | None = "ML-4.b") -> dict:
    return {"outcome": "xfailed", "failures": [{"rank": r, "type": t, "message": m, "clause": clause} for r, t, m in failures]}


@pytest.mark.req("HX-18")
def test_a_proposed_pin_holds_for_every_failure_it_comes_from(tmp_path: Path) -> None:
    tests = {
        "t.py::a[ws2-torch-x]": _test((1, "Failed", "x on one-rank: ranks did not raise the same error")),
        "t.py::a[ws1-torch-x]": _test((0, "Failed", "y on one-rank: ranks did not raise the same error")),
    }
    path = tmp_path / "x.txt"
    path.write_text("t.py::a  # reason\n")
    (entry,) = parse_xfails(path)
    pin = propose(entry, tests)
    assert (pin.clauses, pin.raises, pin.ranks, pin.match) == (("ML-4.b",), "Failed", "last", None)
    for test_id, test in tests.items():
        failures = [Failure(f["rank"], f["type"], f["message"], clause=f["clause"]) for f in test["failures"]]
        assert pin.mismatch(failures, int(test_id.split("[ws")[1][0])) is None
        other_clause = [Failure(f["rank"], f["type"], f["message"], clause="ML-4.a") for f in test["failures"]]
        assert pin.mismatch(other_clause, int(test_id.split("[ws")[1][0])) is not None
    mixed = {"t.py::b[c]": _test((None, "KeyError", "'w' is missing here")), "t.py::b[d]": _test((None, "ValueError", "'w' is missing there"), clause="ML-4.c")}
    pin = propose(entry, mixed)
    assert (pin.clauses, pin.raises, pin.ranks, pin.match) == (("ML-4.b", "ML-4.c"), None, None, None)  # never the text
    hung = {"t.py::h[ws2-torch]": _test((0, "HUNG", "no answer within 60s"), (1, "HUNG", "no answer within 60s"), clause=None)}
    assert propose(entry, hung) == Pin(raises="HUNG", ranks="all")  # a hang fails no clause
    assert propose(entry, {"t.py::c": {"outcome": "xfailed"}}) is None


@pytest.mark.req("HX-18")
def test_write_puts_pins_between_pattern_and_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    xfails = tmp_path / "x.txt"
    xfails.write_text("# header\nt.py::a  # keys differ\nt.py::b  hangs  # never ends\nt.py::c  # marked nothing\n")
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"tests": {
        "t.py::a[torch]": {**_test((None, "Failed", "keys differ: missing 'net.0.weight'")), "reason": f"keys differ [{xfails}:2]"},
    }, "known_deviations": [{"source": f"{xfails}:{n}", "pattern": p} for n, p in ((2, "t.py::a"), (3, "t.py::b"), (4, "t.py::c"))]}))
    assert main([str(results), str(xfails), "--write"]) == 0
    lines = xfails.read_text().splitlines()
    assert lines[1] == "t.py::a  clauses=ML-4.b raises=Failed  # keys differ"
    assert lines[2:] == ["t.py::b  hangs  # never ends", "t.py::c  # marked nothing"]
    (a, _, _) = parse_xfails(xfails)
    assert a.pin.clauses == ("ML-4.b",) and a.reason == "keys differ"
    out = capsys.readouterr().out
    assert f"{xfails}:3: left as it is: flagged hangs (not run: --run-known-hangs runs it)" in out and f"{xfails}:4: no pin: it marked no test" in out


def _run_of(read: Path, entries: dict[int, str], marked: dict[str, int]) -> dict:
    """A --report-json result of a run that read ``read``: its entries (line -> pattern) and, for each
    test id, the line of the entry that marked it (recorded as the run does: the entry's source)."""
    return {
        "known_deviations": [{"source": f"{read}:{n}", "pattern": p, "impl": "torch"} for n, p in entries.items()],
        "tests": {
            test_id: {**_test((None, "Failed", f"keys differ: missing 'w' in {test_id}")), "reason": f"keys differ [{read}:{line}]",
                      "entry": {"source": f"{read}:{line}", "pattern": entries[line], "impl": "torch", "reason": "keys differ"}}
            for test_id, line in marked.items()
        },
    }


@pytest.mark.req("HX-26")
def test_a_copy_of_the_file_the_run_read_is_matched_by_content(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The run read ``site/torch.txt``; the file given is a copy elsewhere, with a line added above (so
    its line numbers differ too): its entries are found by pattern, and pinned from the tests they marked."""
    read = tmp_path / "site" / "torch.txt"
    read.parent.mkdir()
    read.write_text("t.py::a  # keys differ\nt.py::b  # keys differ\n")
    copy = tmp_path / "fork" / "torch.txt"
    copy.parent.mkdir()
    copy.write_text("# my copy\nt.py::a  # keys differ\nt.py::b  # keys differ\nt.py::new  # mine only\n")
    results = tmp_path / "r.json"
    results.write_text(json.dumps(_run_of(read, {1: "t.py::a", 2: "t.py::b"}, {"t.py::a[torch]": 1, "t.py::b[x-torch]": 2})))
    assert main([str(results), str(copy), "--write"]) == 0
    out = capsys.readouterr().out
    lines = copy.read_text().splitlines()
    assert lines[1] == "t.py::a  clauses=ML-4.b raises=Failed  # keys differ", (lines, out)
    assert lines[2] == "t.py::b  clauses=ML-4.b raises=Failed  # keys differ", (lines, out)
    assert lines[3] == "t.py::new  # mine only" and f"{copy}:4: no pin: not an entry of this run" in out, out
    assert read.read_text() == "t.py::a  # keys differ\nt.py::b  # keys differ\n"  # the file the run read is left alone


@pytest.mark.req("HX-26")
def test_a_file_the_run_did_not_read_is_an_error_naming_what_it_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    read = tmp_path / "torch.txt"
    read.write_text("t.py::a  # keys differ\n")
    other = tmp_path / "other.txt"
    other.write_text("t.py::zzz  # not in the run\n")
    results = tmp_path / "r.json"
    results.write_text(json.dumps(_run_of(read, {1: "t.py::a"}, {"t.py::a[torch]": 1})))
    assert main([str(results), str(other)]) == 2
    err = capsys.readouterr().err
    assert f"none of the entries of {other} is an entry of the run {results}" in err and f"the run read: {read}" in err, err


@pytest.mark.req("HX-26")
def test_a_pattern_two_files_of_the_run_hold_is_matched_by_line_or_called_ambiguous(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The run read the base file and the fork's own file, both with ``t.py::a``: a copy is matched to
    the one at its own line, and called ambiguous when the line tells nothing."""
    base, fork = tmp_path / "base.txt", tmp_path / "fork.txt"
    base.write_text("t.py::a  # base\n")
    fork.write_text("# header\nt.py::a  # fork\n")
    payload = _run_of(base, {1: "t.py::a"}, {"t.py::a[torch]": 1})
    payload["known_deviations"].append({"source": f"{fork}:2", "pattern": "t.py::a", "impl": "myfork"})
    payload["tests"]["t.py::a[myfork]"] = {**_test((None, "ValueError", "the fork's own failure here")), "reason": f"fork [{fork}:2]"}
    results = tmp_path / "r.json"
    results.write_text(json.dumps(payload))
    copy = tmp_path / "copy.txt"
    copy.write_text("# header\nt.py::a  # fork\n")
    assert main([str(results), str(copy)]) == 0
    assert "raises=ValueError" in capsys.readouterr().out
    copy.write_text("# header\n\n\nt.py::a  # fork\n")  # line 4: in neither file
    assert main([str(results), str(copy)]) == 2
    captured = capsys.readouterr()
    assert f"{copy}:4: ambiguous: the run read this pattern at {base}:1, {fork}:2" in captured.out, captured


@pytest.mark.req("HX-18")
def test_repin_turns_an_older_files_match_pins_into_clauses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The migration README shows for a fork's file: its ``match=`` pins become the clauses its tests
    failed in the run, flags, conditions and reasons kept."""
    xfails = tmp_path / "fork.txt"
    xfails.write_text("t.py::a  flaky torch<2.14 raises=Failed match='^\\[raises\\] old wording'  # keys differ\n")
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"tests": {
        "t.py::a[ws2-torch]": {**_test((0, "Failed", "[ML-4.b] new wording"), (1, "Failed", "[ML-4.b] new wording")), "reason": f"keys differ [{xfails}:1]"},
    }, "known_deviations": [{"source": f"{xfails}:1", "pattern": "t.py::a"}]}))
    assert main([str(results), str(xfails), "--write"]) == 0
    assert "pinned already" in capsys.readouterr().out and "match=" in xfails.read_text()  # without --repin: left as it is
    assert main([str(results), str(xfails), "--repin", "--write"]) == 0
    assert xfails.read_text() == "t.py::a  flaky torch<2.14 clauses=ML-4.b raises=Failed ranks=all  # keys differ\n"
