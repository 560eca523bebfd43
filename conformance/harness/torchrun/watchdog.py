"""A test body under watch on one rank of a torchrun job: its output captured (:class:`Capture`), the
body cut when it runs too long (:class:`Watchdog`), and what a rank that cannot be freed does before it
ends the job (:func:`give_up`: the emergency report on the reporting rank, a bounded wait for it on the
others). :func:`add_launch_info` adds the job's layout to the reporting rank's ``--report-json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from conformance.harness.failures import HUNG, Failure
from conformance.harness.runner import FAILURE_GRACE_S
from conformance.harness.torchrun.control import ControlStore, JobAborted
from conformance.harness.torchrun.job import CUT_SIGNAL, EXIT_HUNG, REPORT_WAIT_S, UNSTICK_MAX_S, UNSTICK_MIN_S, Job, say
from conformance.harness.worker import run_task

__all__ = ["Capture", "Watchdog", "unstick_s", "give_up", "emergency_report", "wait_for_report", "add_launch_info"]


class Capture:
    """fd 1 and 2 and ``sys.stdout``/``sys.stderr`` of this process into ``path`` while a body runs
    (what a pool's rank writes to its log), nested inside pytest's own capture."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1
        self._saved: tuple[int, int] = (-1, -1)
        self._streams: tuple[Any, Any] = (None, None)

    def __enter__(self) -> Capture:
        sys.stdout.flush()
        sys.stderr.flush()
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._saved = (os.dup(1), os.dup(2))
        os.dup2(self.fd, 1)
        os.dup2(self.fd, 2)
        self._streams = (sys.stdout, sys.stderr)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        return self

    def write(self, text: str) -> None:
        """Append ``text`` (from any thread). Appends through the path, not this object's descriptor: the
        watchdog may write after the main thread has left the capture and closed it."""
        with open(self.path, "ab") as out:
            out.write(text.encode("utf-8", errors="replace"))

    def text(self) -> str:
        """What the file holds now, from any thread ("" once it is gone: the main thread removes it after the body)."""
        try:
            return self.path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def read(self) -> str:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        return self.path.read_bytes().decode("utf-8", errors="replace")

    def __exit__(self, *exc: object) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        sys.stdout, sys.stderr = self._streams
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in (*self._saved, self.fd):
            os.close(fd)


class Watchdog:
    """Cuts this member's body of run ``k`` when it runs past ``timeout_s``, or past the pool's grace
    (:data:`~conformance.harness.runner.FAILURE_GRACE_S`) after another member failed or died, or when
    the job ends: posts ``hung`` with the body's output and Python stack, then gets the main thread
    free (:data:`CUT_SIGNAL`; nccl: the group's abort; gloo: the peers drop the group). A body that is
    not free after its rank timeout (10 to 30 s) ends the job."""

    def __init__(self, job: Job, k: int, world_size: int, timeout_s: float, capture: Capture) -> None:
        self.job, self.k, self.world_size, self.timeout_s, self.capture = job, k, world_size, timeout_s, capture
        self._lock = threading.Lock()
        self._finished = False
        self._cut = False
        self._back = threading.Event()
        self._main = threading.main_thread().ident or 0
        self._thread = threading.Thread(target=self._loop, name=f"sdc-watchdog-run{k}", daemon=True)
        self._thread.start()

    def finish(self) -> bool:
        """Called by the main thread when the body returned: True if it had been cut."""
        with self._lock:
            self._finished = True
            cut = self._cut
        self._back.set()
        return cut

    def _loop(self) -> None:
        job = self.job
        store = job.thread_store
        assert store is not None
        start = time.monotonic()
        first_failure: float | None = None
        next_check = start
        peers = [r for r in range(self.world_size) if r != job.rank]
        reason = ""
        while not self._back.wait(0.05):
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.5
                try:
                    if store.terminated.is_set() or store.counter("aborts") > 0:
                        reason = "the job is ending"
                        break
                    if first_failure is None and any(self._failed(store, r) for r in peers):
                        first_failure = now
                except Exception:  # the store is gone: the job is ending
                    reason = "the job's store is gone"
                    break
            limit = start + self.timeout_s if first_failure is None else min(start + self.timeout_s, first_failure + FAILURE_GRACE_S)
            if now >= limit:
                reason = f"no answer within {self.timeout_s:.0f}s" if first_failure is None or limit == start + self.timeout_s else (
                    f"still running {FAILURE_GRACE_S:.0f}s after another rank failed"
                )
                break
        else:
            return
        if not self._cut_body(store, reason):
            return
        unstick = unstick_s(self.timeout_s)
        give_up_at = time.monotonic() + unstick
        while not self._back.wait(1.0):
            if time.monotonic() >= give_up_at:
                detail = f"hung in {job.test_label()} ({reason}) and could not be freed within {unstick:.0f}s"
                give_up(job, store, detail, self.capture.text())
            try:
                signal.pthread_kill(self._main, CUT_SIGNAL)  # again: a body may have caught the first
            except (ProcessLookupError, OSError):
                pass

    def _failed(self, store: ControlStore, rank: int) -> bool:
        if store.has(f"run{self.k}/st/{rank}") and store.take(f"run{self.k}/st/{rank}") == "fail":
            return True
        return store.gone(rank) is not None

    def _cut_body(self, store: ControlStore, reason: str) -> bool:
        job = self.job
        with self._lock:
            if self._finished:
                return False
            self._cut = True
        stack = _body_stack(sys._current_frames().get(self._main))
        self.capture.write(f"\n---------- rank {job.rank} cut: {reason}; its Python stack (most recent call last) ----------\n{stack}")
        store.put(f"run{self.k}/hung/{job.rank}", self.capture.text())
        job.cut_pending = True
        job.group.abort()
        try:
            signal.pthread_kill(self._main, CUT_SIGNAL)
        except (ProcessLookupError, OSError):
            pass
        return True


def unstick_s(timeout_s: float) -> float:
    """How long a cut body at rank timeout ``timeout_s`` gets to give the main thread back."""
    return min(UNSTICK_MAX_S, max(UNSTICK_MIN_S, timeout_s))


def _body_stack(frame: FrameType | None) -> str:
    """The main thread's Python stack from the test body down (the harness frames above it left out)."""
    frames: list[tuple[FrameType, int]] = []
    while frame is not None and frame.f_code is not run_task.__code__:
        frames.append((frame, frame.f_lineno))
        frame = frame.f_back
    if not frames:
        return "(no Python stack)\n"
    return "".join(traceback.StackSummary.extract(reversed(frames)).format())


def give_up(job: Job, store: ControlStore, detail: str, output: str) -> None:
    """From the watchdog: this rank cannot be freed (``detail`` says how it hung, ``output`` is what the
    body wrote and where it is stuck). End the job with a report, then this process."""
    store.post_abort("hung", detail, job.test_label())
    reason = f"rank {job.rank} {detail}"
    if job.stopping is None:
        job.stopping = f"the torchrun job is ending during {job.test_label()}: {reason}"
        job.abort_info = {"test": job.current[1] if job.current else None, "reason": reason, "ranks": {job.rank: "hung"}}
    if job.is_reporter:
        emergency_report(job, store, reason, output)
    else:
        wait_for_report(job, store)
    os._exit(EXIT_HUNG)


def emergency_report(job: Job, store: ControlStore, reason: str, output: str) -> None:
    """The report of a reporting rank whose main thread is stuck: the test in progress as failed (HUNG
    on this rank), ``--report-json`` as the session would write it, a summary on the terminal."""
    config = job.config
    text = f"{reason}\n(the job ended: this rank could not be freed)\n\n---------- rank {job.rank} output ----------\n{output.rstrip()}"
    if job.current is not None:
        _, test_id, item = job.current
        failure = Failure(rank=job.rank, type=HUNG, message=reason)
        report = pytest.TestReport(
            item.nodeid,
            item.location,
            {},
            "failed",
            text,
            "call",
            user_properties=[*item.user_properties, ("failures", [failure.to_json()])],
        )
        try:
            config.hook.pytest_runtest_logreport(report=report)
        except Exception:  # the report is written below whatever a reporter plugin thinks of it
            pass
    session = getattr(job.current[2], "session", None) if job.current is not None else None
    if session is not None:
        job.write_report(session, int(pytest.ExitCode.INTERRUPTED))
        add_launch_info(job)
    written = f"; report written to {job.report_json}" if job.report_json else ""
    reporter = config.pluginmanager.getplugin("terminalreporter")
    stats = getattr(reporter, "stats", {})
    counts = ", ".join(f"{len(reports)} {kind}" for kind, reports in stats.items() if kind and reports)
    failed = [getattr(r, "nodeid", "?") for r in stats.get("failed", [])]
    say(job, f"\n{'=' * 30} the job ended: {job.test_label()} {'=' * 30}\n{text}")
    say(job, "\n".join([f"FAILED {nodeid}" for nodeid in failed] + [f"!!!!! conformance: {job.stopping}{written} !!!!!", f"({counts})"]))
    try:
        store.put("reported", job.rank)
    except Exception:  # the store is gone: nobody is left waiting
        pass


def wait_for_report(job: Job, store: ControlStore) -> None:
    """Wait (bounded) until the reporting rank has written the report, so the launcher does not end
    it early because this rank exited."""
    try:
        store.wait_keys({job.reporter: ["reported"]}, deadline=time.monotonic() + REPORT_WAIT_S, what="waiting for the report", check_liveness=True)
    except JobAborted:
        pass
    except Exception:  # the store is gone with the reporter: nothing to wait for
        pass




def add_launch_info(job: Job) -> None:
    """Add the job's layout (and why it ended early, if it did) to rank 0's ``--report-json``."""
    path = job.report_json
    if not path or not Path(path).is_file():
        return
    payload = json.loads(Path(path).read_text(encoding="utf-8"))
    payload["launch"] = {
        "launcher": job.env.launcher,
        "world_size": job.world_size,
        "local_world_size": job.env.local_world_size,
        "hosts": {str(r): p.host for r, p in sorted(job.peers.items())},
        "gpu_ranks": job.cuda_ranks,
        "reported_by": job.rank,
        "aborted": job.abort_info or None,
    }
    Path(path).write_text(json.dumps(payload, indent=1), encoding="utf-8")

