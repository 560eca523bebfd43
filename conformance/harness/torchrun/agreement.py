"""The agreement of the ranks of a torchrun job on every phase of every test (SPEC HX-31): each rank's
report summarised (:class:`Summary`), exchanged through the job's store (:func:`exchange`) and made one
(:func:`agree`): a failure on any rank fails the test on every rank, with that rank's message.
:class:`Agreement` is the pytest plugin object that does this for every report.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import pytest

from conformance.harness.failures import DIED, HUNG, Failure
from conformance.harness.torchrun.control import JobAborted
from conformance.harness.torchrun.job import Job

__all__ = ["Summary", "Agreement", "lost_failures", "exchange", "agree", "fail_report"]


@dataclass(frozen=True)
class Summary:
    """One rank's report of one phase of one test."""

    outcome: str
    xfail: bool
    text: str
    failures: tuple[tuple[Any, str, str], ...]

    @classmethod
    def of(cls, report: pytest.TestReport) -> Summary:
        failures: list[dict[str, Any]] = list(dict(report.user_properties).get("failures") or [])  # type: ignore[call-overload]
        return cls(
            outcome=report.outcome,
            xfail=getattr(report, "wasxfail", None) is not None,
            text=report.longreprtext if report.outcome != "passed" else "",
            failures=tuple((f.get("rank"), str(f.get("type")), str(f.get("message"))) for f in failures),
        )

    def label(self) -> str:
        if self.xfail:
            return "xfailed" if self.outcome == "skipped" else "xpassed"
        return self.outcome


class Agreement:
    """The ranks agree on every phase of every test (HX-31). Registered after the suite's plugin: its
    ``tryfirst`` wrapper is then the outermost one and sees each report as the plugin left it (pinned
    deviations judged)."""

    def __init__(self, job: Job) -> None:
        self.job = job

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        job = self.job
        if job.stopping is None:
            try:
                summaries = exchange(job, Summary.of(report))
            except JobAborted as exc:
                job.stop(exc)
                if not report.failed:
                    fail_report(report, str(job.stopping), lost_failures(exc))
            else:
                agree(report, summaries)
        if job.stopping is not None:
            item.session.shouldstop = job.stopping
        return report


def lost_failures(exc: JobAborted) -> list[dict[str, Any]]:
    """One failure per rank the end of the job is about (``--report-json`` names them)."""
    return [
        Failure(rank=rank, type=HUNG if kind == "hung" else DIED, message=f"{kind}: {exc.reason}").to_json()
        for rank, kind in sorted(exc.kinds.items())
    ]


#: How many different failure texts a test's agreed report shows (the JSON has every rank's).
_MAX_SECTIONS = 4


def exchange(job: Job, mine: Summary) -> dict[int, Summary]:
    """Every rank's summary of the phase that just ended (the ranks run the same phases in order)."""
    control = job.control
    job.exchanges += 1
    key = f"rep/{job.exchanges}"
    control.put(f"{key}/{job.rank}", mine)
    control.wait_keys(
        {r: [f"{key}/{r}"] for r in range(job.world_size) if r != job.rank},
        deadline=time.monotonic() + job.skew_s(),
        what=f"waiting for every rank to finish {job.test_label()}",
    )
    summaries = {r: (mine if r == job.rank else control.take(f"{key}/{r}")) for r in range(job.world_size)}
    # Every rank posted this key after reading all it needed of this rank's earlier keys.
    control.forget(keep=f"{key}/{job.rank}")
    return summaries


def agree(report: pytest.TestReport, summaries: dict[int, Summary]) -> None:
    """Make ``report`` what the ranks' reports say together: unchanged when they agree; else failed,
    with each failing (or disagreeing) rank's message and failures labelled by rank."""
    labels = {r: s.label() for r, s in summaries.items()}
    failing = [r for r, s in summaries.items() if s.outcome == "failed"]
    texts = {summaries[r].text for r in failing}
    if len(set(labels.values())) == 1 and len(texts) <= 1:
        return
    if failing:
        others = ", ".join(f"rank {r} {labels[r]}" for r in sorted(summaries) if r not in failing)
        head = f"failed on rank(s) {failing} of the torchrun job" + (f" ({others})" if others else "")
        by_text: dict[str, list[int]] = {}
        for r in failing:
            by_text.setdefault(summaries[r].text.rstrip(), []).append(r)
        parts = [f"---------- rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} ----------\n{text}"
                 for text, ranks in list(by_text.items())[:_MAX_SECTIONS]]
        if len(by_text) > _MAX_SECTIONS:
            parts.append(f"(and {len(by_text) - _MAX_SECTIONS} more different messages: every failing rank's is in --report-json)")
    else:
        head = "the ranks of the torchrun job disagree: " + "; ".join(
            f"rank {r} {labels[r]}" + (f" ({summaries[r].text.strip().splitlines()[-1]})" if summaries[r].text.strip() else "")
            for r in sorted(summaries)
        )
        parts = []
    failures = [
        {"rank": rank if rank is not None else r, "type": type_, "message": message}
        for r in (failing or sorted(summaries))
        for rank, type_, message in summaries[r].failures
    ]
    fail_report(report, "\n\n".join([head, *parts]), failures)


def fail_report(report: pytest.TestReport, text: str, failures: list[dict[str, Any]]) -> None:
    """Make ``report`` a failure with ``text`` as its message and ``failures`` (if any) as its per-rank failures."""
    report.outcome = "failed"
    report.longrepr = text
    if hasattr(report, "wasxfail"):
        del report.wasxfail
    if failures:
        report.user_properties = [(k, v) for k, v in report.user_properties if k != "failures"] + [("failures", failures)]

