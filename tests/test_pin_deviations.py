"""Self-tests of conformance/cli/pin_deviations.py: the pins it proposes hold for the failures they come from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.cli.pin_deviations import common_text, main, propose
from conformance.harness.failures import Failure
from conformance.harness.xfails import parse_xfails


@pytest.mark.req("HX-18")
def test_common_text_is_whole_words_every_message_holds() -> None:
    messages = [
        "unknown-fqn (full) on every-rank: ranks did not raise the same error",
        "unknown-fqn (sharded) on one-rank: ranks did not raise the same error\n  got: ...",
    ]
    assert common_text(messages) == "ranks did not raise the same error"
    assert common_text(["error message does not name the key 'net.0.weight' whole", "error message does not name the key 'net.2.bias' whole"]) == (
        "error message does not name the key"
    )
    assert common_text(["abc", "xyz"]) == ""


def _test(*failures: tuple[int | None, str, str]) -> dict:
    return {"outcome": "xfailed", "failures": [{"rank": r, "type": t, "message": m} for r, t, m in failures]}


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
    assert (pin.raises, pin.ranks) == ("Failed", "last")
    for test_id, test in tests.items():
        failures = [Failure(f["rank"], f["type"], f["message"]) for f in test["failures"]]
        assert pin.mismatch(failures, int(test_id.split("[ws")[1][0])) is None
    mixed = {"t.py::b[c]": _test((None, "KeyError", "'w' is missing here")), "t.py::b[d]": _test((None, "ValueError", "'w' is missing there"))}
    assert propose(entry, mixed).raises is None and propose(entry, mixed).ranks is None  # nothing shared but the text
    assert propose(entry, {"t.py::c": {"outcome": "xfailed"}}) is None


@pytest.mark.req("HX-18")
def test_write_puts_pins_between_pattern_and_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    xfails = tmp_path / "x.txt"
    xfails.write_text("# header\nt.py::a  # keys differ\nt.py::b  hangs  # never ends\nt.py::c  # marked nothing\n")
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"tests": {
        "t.py::a[torch]": {**_test((None, "Failed", "keys differ: missing 'net.0.weight'")), "reason": f"keys differ [{xfails}:2]"},
    }}))
    assert main([str(results), str(xfails), "--write"]) == 0
    lines = xfails.read_text().splitlines()
    assert lines[1] == "t.py::a  raises=Failed match=\"keys differ: missing 'net\\.0\\.weight'\"  # keys differ"
    assert lines[2:] == ["t.py::b  hangs  # never ends", "t.py::c  # marked nothing"]
    (a, _, _) = parse_xfails(xfails)
    assert a.pin.match == "keys differ: missing 'net\\.0\\.weight'" and a.reason == "keys differ"
    out = capsys.readouterr().out
    assert f"{xfails}:3: left as it is: flagged hangs (not run: --run-known-hangs runs it)" in out and f"{xfails}:4: no pin: it marked no test" in out
