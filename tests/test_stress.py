"""tools.stress: a failure in any run is reported with the runs it failed in, and fails the loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import stress


def test_failures_of_reads_failures_and_errors(tmp_path: Path) -> None:
    xml = tmp_path / "run.xml"
    xml.write_text(
        '<testsuites><testsuite tests="3">'
        '<testcase classname="conformance.test_checkpoint" name="test_a[ws2-reference]"/>'
        '<testcase classname="conformance.test_checkpoint" name="test_b"><failure message="rank 1 died (signal 6)">trace</failure></testcase>'
        '<testcase classname="tests.test_x" name="test_c"><error message="">setup broke\nmore</error></testcase>'
        "</testsuite></testsuites>"
    )
    assert stress.failures_of(xml) == {
        "conformance/test_checkpoint.py::test_b": "rank 1 died (signal 6)",
        "tests/test_x.py::test_c": "setup broke",
    }


def test_a_failure_in_one_run_fails_the_loop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A test that fails in every run: the loop reports it with the runs it failed in and its message,
    and exits 1."""
    test = tmp_path / "test_flaky_here.py"
    test.write_text("def test_fails():\n    assert False, 'boom'\n")
    # The suite registers the profile in its conftest; this lone test file brings its own.
    (tmp_path / "conftest.py").write_text("from hypothesis import settings\nsettings.register_profile('stress')\n")
    code = stress.main(["--runs", "2", "--seed", "3", "--out", str(tmp_path / "out"), "--", str(test)])
    out = capsys.readouterr().out
    assert code == 1
    assert "failed in runs [1, 2] of 2" in out and "boom" in out
