"""No false pass (issue 46): the whole suite against an implementation that provides nothing.

:mod:`tests.null_adapters` has two: every op of every capability raises ``Unsupported`` (each test must be
a skip naming the op), or ``RuntimeError`` (each test must fail, or skip where the test cannot reach an op).
A test of either that passes checks nothing: it only asks whether errors are alike, or allows "nothing
loads" as an outcome without first proving that something does. The whole suite runs against both at world
sizes 1 and 2, both in one pytest process (about a minute here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.adapters.base import Adapter
from tests.conftest import REPO_ROOT
from tests.null_adapters import FailingEverywhere, UnsupportedEverywhere


def outcomes_of(adapters: tuple[type[Adapter], ...], tmp_path: Path) -> dict[str, dict[str, list[str]]]:
    """adapter name -> outcome -> the ids of that adapter's tests with that outcome, from one run of the
    whole suite against ``adapters`` at world sizes 1 and 2 (one process: the pools and the collection
    are paid once). Tests of no implementation (the zoo's own checks) are left out."""
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance", "--impl", ",".join(f"tests.null_adapters:{a.__name__}" for a in adapters),
         "--world-size", "1,2", "-q", "--tb=no", "-p", "no:cacheprovider", "-p", "no:logging", "--report-json", str(report)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
    )
    if not report.exists():
        pytest.fail(f"the run wrote no report (exit status {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    outcomes: dict[str, dict[str, list[str]]] = {a.name: {} for a in adapters}
    for test_id, entry in json.loads(report.read_text())["tests"].items():
        if entry.get("impl") in outcomes:
            outcomes[entry["impl"]].setdefault(entry["outcome"], []).append(test_id)
    return outcomes


@pytest.mark.req("HX-36")
def test_implementations_that_provide_nothing_pass_nothing(tmp_path: Path) -> None:
    """Every op raises ``Unsupported``: every test of it is a skip (naming the op), none passes, none
    fails (an ``Unsupported`` the suite took for an error, or a failure, would show here). Every op raises
    ``RuntimeError``: no test of it passes. One test, so that a run in parts never runs the suite twice."""
    got = outcomes_of((UnsupportedEverywhere, FailingEverywhere), tmp_path)
    unsupported, failing = got[UnsupportedEverywhere.name], got[FailingEverywhere.name]
    assert unsupported.get("skipped"), "no test of the Unsupported-everywhere adapter ran at all"
    assert not unsupported.get("passed"), f"{len(unsupported['passed'])} tests passed an adapter that provides nothing: {unsupported['passed'][:20]}"
    assert not unsupported.get("failed"), f"{len(unsupported['failed'])} tests failed on Unsupported instead of skipping: {unsupported['failed'][:20]}"
    assert failing.get("failed"), "no test of the failing-everywhere adapter failed"
    assert not failing.get("passed"), f"{len(failing['passed'])} tests passed an adapter whose every op fails: {failing['passed'][:20]}"
