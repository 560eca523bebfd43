"""No false pass (issue 46): the whole suite against an implementation that provides nothing.

:mod:`tests.null_adapters` has two: every op of every capability raises ``Unsupported`` (each test must be
a skip naming the op), or ``RuntimeError`` (each test must fail, or skip where the test cannot reach an op).
A test of either that passes checks nothing: it only asks whether errors are alike, or allows "nothing
loads" as an outcome without first proving that something does. Each runs the whole suite at world
sizes 1 and 2 in a pytest process of its own (under a minute each here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.adapters.base import Adapter
from tests.conftest import REPO_ROOT
from tests.null_adapters import FailingEverywhere, UnsupportedEverywhere


def outcomes_of(adapter: type[Adapter], tmp_path: Path) -> dict[str, list[str]]:
    """outcome -> the ids of ``adapter``'s tests with that outcome, from a run of the whole suite against it
    at world sizes 1 and 2. Tests of no implementation (the zoo's own checks) are left out."""
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance", "--impl", f"tests.null_adapters:{adapter.__name__}", "--world-size", "1,2",
         "-q", "--tb=no", "-p", "no:cacheprovider", "--report-json", str(report)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
    )
    if not report.exists():
        pytest.fail(f"the run wrote no report (exit status {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    outcomes: dict[str, list[str]] = {}
    for test_id, entry in json.loads(report.read_text())["tests"].items():
        if entry.get("impl") == adapter.name:
            outcomes.setdefault(entry["outcome"], []).append(test_id)
    return outcomes


@pytest.mark.req("HX-36")
def test_an_implementation_of_unsupported_ops_only_passes_nothing_and_fails_nothing(tmp_path: Path) -> None:
    """Every op raises ``Unsupported``: every test of it is a skip (naming the op), none passes, none
    fails (an ``Unsupported`` the suite took for an error, or a failure, would show here)."""
    got = outcomes_of(UnsupportedEverywhere, tmp_path)
    assert got.get("skipped"), "no test of the adapter ran at all"
    assert not got.get("passed"), f"{len(got['passed'])} tests passed an adapter that provides nothing: {got['passed'][:20]}"
    assert not got.get("failed"), f"{len(got['failed'])} tests failed on Unsupported instead of skipping: {got['failed'][:20]}"


@pytest.mark.req("HX-36")
def test_an_implementation_whose_every_op_fails_passes_nothing(tmp_path: Path) -> None:
    """Every op raises ``RuntimeError``: no test of it passes."""
    got = outcomes_of(FailingEverywhere, tmp_path)
    assert got.get("failed"), "no test of the adapter failed"
    assert not got.get("passed"), f"{len(got['passed'])} tests passed an adapter whose every op fails: {got['passed'][:20]}"
