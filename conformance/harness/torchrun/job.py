"""This rank's view of a torchrun job (:class:`Job`), the process-wide handle to it, and the constants
the parts of the torchrun mode share.

The job is made once per pytest session by :func:`conformance.harness.torchrun.startup.join_job` and
handed to what needs it (the runner, the hooks, the agreement, the signal and exit handlers, the
watchdog). :func:`current_job` is for tests that want their rank in the job. This module imports none
of the other torchrun modules.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conformance.harness.torchrun.control import ControlStore, DefaultGroup, JobAborted, Peer
from conformance.harness.torchrun.launch_env import LaunchEnv

__all__ = [
    "UNSTICK_MIN_S", "UNSTICK_MAX_S", "REPORT_WAIT_S", "EXIT_HUNG", "CUT_SIGNAL", "SKEW_FACTOR", "SKEW_MIN_S",
    "BodyCut", "BodyTerminated", "Job", "current_job", "set_current_job", "say",
]

#: After a cut, how long the body gets to give the thread back before the rank ends the job: its rank
#: timeout, within these bounds (a gloo collective of the default group times out 5 s after the cut).
UNSTICK_MIN_S, UNSTICK_MAX_S = 10.0, 30.0
#: How long the other ranks wait, at exit, for rank 0 to have written the report.
REPORT_WAIT_S = 60.0
#: Exit status of a rank that hung and could not be freed.
EXIT_HUNG = 124
#: The signal the watchdog sends the main thread to end a test body in Python code.
CUT_SIGNAL = signal.SIGUSR2
#: Seconds a rank may fall behind the others at the end of a test phase: this multiple of --rank-timeout,
#: at least SKEW_MIN_S (a rank that is gone is noticed at once; this bounds one that is stuck).
SKEW_FACTOR, SKEW_MIN_S = 2.0, 60.0

class BodyCut(BaseException):
    """Raised in the main thread when the watchdog cuts the test body on this rank."""


class BodyTerminated(BaseException):
    """Raised in a test body when the launcher terminates this rank (SIGTERM)."""


@dataclass
class Job:
    """This rank's view of the launched job, for one pytest session."""

    env: LaunchEnv
    control: ControlStore
    group: DefaultGroup
    device_type: str
    base: Path
    peers: dict[int, Peer]
    #: how many of ranks 0, 1, ... (in order) have a GPU of their own: nccl runs up to this world size
    cuda_ranks: int
    #: (job world size, ranks per node) when every node runs as many ranks; None otherwise
    layout: tuple[int, int] | None
    report_json: str | None
    config: pytest.Config
    terminal_fd: int
    #: ``--rank-timeout``
    rank_timeout_s: float
    #: writes the session's ``--report-json`` (the plugin's): the watchdog's report of a reporting rank
    #: that cannot be freed ends the session through it
    write_report: Callable[[pytest.Session, int], None]
    log_path: Path | None = None
    thread_store: ControlStore | None = None
    #: manager runs and report exchanges so far (every rank counts the same ones)
    runs: int = 0
    exchanges: int = 0
    #: the test in progress (index, id, item)
    current: tuple[int, str, pytest.Item] | None = None
    #: why the job is ending, once it is
    stopping: str | None = None
    abort_info: dict[str, Any] = field(default_factory=dict)
    reporter: int = 0
    in_body: bool = False
    cut_pending: bool = False
    session_finished: bool = False
    #: the finished session, whose ``exitstatus`` (final once pytest unconfigures) this rank exits with
    session: pytest.Session | None = None

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_reporter(self) -> bool:
        return self.rank == self.reporter

    def skew_s(self) -> float:
        return max(SKEW_MIN_S, SKEW_FACTOR * self.rank_timeout_s)

    def test_label(self) -> str:
        return self.current[1] if self.current is not None else "(between tests)"

    def stop(self, exc: JobAborted) -> None:
        """The job ends: remember why, and take over the report if rank 0 is among the lost ranks."""
        if self.stopping is None:
            self.stopping = f"the torchrun job is ending during {self.test_label()}: {exc.reason}"
            self.abort_info = {"test": self.current[1] if self.current else None, "reason": exc.reason, "ranks": exc.kinds}
        # The reporter passes only when it is gone for sure (its process ended here, or its heartbeat
        # stopped): a rank the launcher terminates, or one that is late, still reports.
        if self.reporter != self.rank and self.control.gone(self.reporter) is not None:
            lost = {r for r, kind in exc.kinds.items() if kind in ("died", "hung", "ended", "error")} | {self.reporter}
            alive = [r for r in range(self.world_size) if r not in lost and self.control.gone(r) is None]
            if alive and alive[0] != self.reporter:
                self.reporter = alive[0]
                if self.is_reporter:
                    self.config.option.report_json = self.report_json
                    say(self, f"conformance: rank {self.rank} writes the report: rank(s) {sorted(lost)} are gone ({exc.reason})")


_JOB: Job | None = None


def current_job() -> Job | None:
    """The job this process is a rank of, while a pytest session runs in torchrun mode."""
    return _JOB


def set_current_job(job: Job | None) -> None:
    """Make ``job`` the job of this process (at configure), or none (at exit)."""
    global _JOB
    _JOB = job


def say(job: Job, text: str) -> None:
    """A line on this rank's original stdout (the terminal), whatever captures fd 1 now."""
    try:
        os.write(job.terminal_fd, (text.rstrip("\n") + "\n").encode("utf-8", errors="replace"))
    except OSError:
        pass

