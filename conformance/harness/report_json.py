"""The JSON result of a session (``--report-json``): every test's outcome, reason, requirement IDs,
adapter, per-rank failures and known-deviation entry, gathered from the reports as they come
(:func:`record_report`), and the document written at the end (:func:`report_payload`).
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance.adapters.base import load_adapter
from conformance.harness.axes import impl_specs, selected_world_sizes
from conformance.harness.requirements import load_spec
from conformance.harness.xfails import XfailEntry

__all__ = ["SESSION_RESULTS", "record_report", "report_payload"]

#: nodeid -> outcome, reason, reqs, impl; written by --report-json at the end of the session.
SESSION_RESULTS: dict[str, dict[str, Any]] = {}


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
        return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
    return str(longrepr) if longrepr else ""


def _failure_line(report: pytest.TestReport) -> str:
    text = (report.longreprtext or "").strip()
    if text.startswith(("known deviation failed differently", "known deviation no longer deviates")):
        return text.splitlines()[0][:600]
    error_lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    first = error_lines[0] if error_lines else (text.splitlines()[0] if text else "")
    return first[:300]


def record_report(report: pytest.TestReport) -> None:
    """Fold one phase's report of a test into its entry of :data:`SESSION_RESULTS` (keyed by its
    ``test_id`` user property, else its node id): the outcome and reason of the phase that decides it,
    its requirement IDs and adapter, the per-rank failures and the known-deviation entry that marked it."""
    props = dict(report.user_properties)
    entry = SESSION_RESULTS.setdefault(
        str(props.get("test_id", report.nodeid)), {"outcome": None, "reason": "", "reqs": props.get("reqs", []), "impl": props.get("impl")}
    )
    if "failures" in props:
        entry["failures"] = props["failures"]
    if "entry" in props:
        entry["entry"] = props["entry"]
    if "crashes" in props:
        entry["crashes"] = props["crashes"]
    xfail_reason = getattr(report, "wasxfail", None)
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if "strict" in props:  # a known deviation that passed: a failure of the run unless its entry is flaky
            entry["outcome"], entry["strict"] = "xpassed", props["strict"]
            entry["reason"] = _failure_line(report) if report.failed else str(xfail_reason or "")
        elif xfail_reason is not None:
            entry["outcome"] = "xfailed" if report.skipped else "xpassed"
            entry["reason"] = xfail_reason
        elif report.skipped:
            entry["outcome"], entry["reason"] = "skipped", _skip_reason(report)
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["reason"] = _failure_line(report)
        else:
            entry["outcome"] = "passed"
    elif report.when == "teardown" and report.failed:
        entry["outcome"], entry["reason"] = "error", "teardown: " + _failure_line(report)




def report_payload(config: pytest.Config, entries: list[XfailEntry]) -> dict[str, Any]:
    """The ``--report-json`` document: the run's torch, world sizes, backend, adapters, SPEC
    requirements and known-deviation ``entries``, and :data:`SESSION_RESULTS` as its tests."""
    import torch

    return {
        "torch": torch.__version__,
        "world_sizes": selected_world_sizes(config),
        "backend": config.getoption("--backend"),
        "impls": [load_adapter(s).name for s in impl_specs(config)],
        "spec": load_spec(),
        "known_deviations": [
            {
                "source": e.source,
                "pattern": ("!" if e.removes else "") + e.pattern,
                "impl": e.impl,
                "reason": e.reason,
                "pin": e.pin.describe(),
                "flags": [flag for flag, on in (("hangs", e.hangs), ("flaky", e.flaky)) if on],
                "exclude": e.exclude,
                "when": e.when.describe(),
                "active": e.when.holds_for_torch(torch.__version__),
            }
            for e in entries
        ],
        "tests": SESSION_RESULTS,
    }
