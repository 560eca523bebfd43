"""The rank bodies of a torchrun job, run in lockstep: :class:`TorchrunRunner` is the
:class:`~conformance.harness.runner.Runner` of torchrun mode. Rank 0 posts the task, the members
(ranks ``0 .. world_size-1``) run it under a :class:`~conformance.harness.torchrun.watchdog.Watchdog`
and post their outcomes, and every rank of the job reads them all into the same
:class:`~conformance.harness.runner.RankRun` (:func:`run_member`, :func:`collect_outcomes`,
:func:`fill_lost` for a run the end of the job cut short).
"""

from __future__ import annotations

import pickle
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conformance.harness.runner import RankRun
from conformance.harness.torchrun.control import JobAborted
from conformance.harness.torchrun.job import BodyCut, BodyTerminated, Job
from conformance.harness.torchrun.watchdog import Capture, Watchdog, unstick_s
from conformance.harness.worker import RankOutcome, Task, make_task, run_task

__all__ = ["TorchrunRunner", "skip_at_test", "fill_lost", "run_member", "collect_outcomes"]


def skip_at_test(reason: str) -> None:
    """Skip the test in progress, reported at the test rather than at this line."""
    # pytest's own (private) switch to report the skip at the test, not at this line.
    raise pytest.skip.Exception(reason, _use_item_location=True)


class TorchrunRunner:
    """Runs a rank body on the job's ranks ``0 .. world_size-1`` and returns what every member did, as
    the :class:`RankRun` a pool would return; every rank of the job calls :meth:`run` in the same
    order with the same world size (they run the same test) and gets the same RankRun."""

    #: A dead rank ends the job (torchrun stops the others): nothing runs after it to rerun a crash.
    contains_crashes = False

    def __init__(self, job: Job) -> None:
        self.job = job

    def after_unhealthy_run(self) -> str:
        return self.job.stopping or "the hung rank(s) were freed; the process group is made anew for the next test"

    def stop(self) -> None:
        """Nothing to stop: the default group is dropped when the session ends."""

    def run(
        self,
        world_size: int,
        backend: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        tmp_dir: str,
        timeout_s: float,
    ) -> RankRun:
        job = self.job
        if world_size > job.world_size:
            skip_at_test(f"world size {world_size} needs {world_size} ranks; the torchrun job has {job.world_size}")
        job.runs += 1
        k = job.runs
        start = time.monotonic()
        member = job.rank < world_size
        if job.stopping is not None:
            run = RankRun(world_size=world_size)
            fill_lost(job, run)
            return run
        if job.rank == 0:
            # Every member runs rank 0's task (the pool's controller is rank 0 here): one tmp_dir, one
            # set of arguments, each rank its own unpickled copy.
            task = make_task(fn, args, kwargs, tmp_dir=tmp_dir)
            job.control.put_bytes(f"run{k}/task", pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL))
        else:
            make_task(fn, args, kwargs, tmp_dir=tmp_dir)  # the same check of fn on every rank
        if job.group.current not in (None, (world_size, backend)):
            # Every rank, member or not, leaves a group of another size: the members all make the new
            # one together (a rank left holding an old group would skip joining it).
            job.group.drop()
        run = RankRun(world_size=world_size)
        try:
            if member:
                run_member(job, k, world_size, backend, timeout_s)
            collect_outcomes(job, k, run, timeout_s, start)
        except JobAborted as exc:
            job.stop(exc)
            fill_lost(job, run, exc)
        return run


def fill_lost(job: Job, run: RankRun, exc: JobAborted | None = None) -> None:
    """Complete the run of a test that the end of the job cut short: each member that did not answer
    is reported by what happened to it (died, terminated, hung); one whose fate is unknown is hung if
    it is still alive, else died."""
    kinds = exc.kinds if exc is not None else {}
    for rank in range(run.world_size):
        if rank in run.outcomes or rank in run.died or rank in run.hung:
            continue
        kind = kinds.get(rank) or ("died" if job.control.gone(rank) is not None else "hung")
        if kind == "hung":
            run.hung.append(rank)
        else:
            run.died[rank] = -int(signal.SIGTERM) if kind == "terminated" else None
        run.output.setdefault(rank, f"(no answer: {job.stopping})")
    run.hung.sort()


def run_member(job: Job, k: int, world_size: int, backend: str, timeout_s: float) -> None:
    """This rank's part of run ``k``: join the group, run rank 0's task under the watchdog, post the outcome."""
    control = job.control
    deadline = time.monotonic() + job.skew_s()
    control.wait_keys({0: [f"run{k}/task"]}, deadline=deadline, what=f"waiting for rank 0's task (run {k})")
    task: Task = pickle.loads(control.take_bytes(f"run{k}/task"))
    if job.group.current != (world_size, backend):
        # Every member checks in first, so that the group's own rendezvous (C++, not interruptible)
        # only starts once every member is there.
        control.put(f"run{k}/in/{job.rank}", True)
        control.wait_keys({r: [f"run{k}/in/{r}"] for r in range(world_size)}, deadline=deadline, what=f"forming the group of world size {world_size}")
        job.group.ensure(world_size, backend, tag=f"run{k}")
    job.group.set_op_timeout(timeout_s + 5.0)
    Path(task.tmp_dir).mkdir(parents=True, exist_ok=True)
    capture_path = job.base / f"rank{job.rank}" / f"run{k}.out"
    capture_path.parent.mkdir(parents=True, exist_ok=True)
    with Capture(capture_path) as capture:
        watch = Watchdog(job, k, world_size, timeout_s, capture)
        outcome: RankOutcome | None = None
        job.in_body, job.cut_pending = True, False
        try:
            per_node = job.layout[1] if job.layout is not None else None
            outcome = run_task(task, job.rank, world_size, backend, device=job.group.device, ranks_per_node=per_node)
        except (BodyCut, BodyTerminated):
            outcome = None
        finally:
            job.in_body = False
        cut = watch.finish()
        output = capture.read()
    capture_path.unlink(missing_ok=True)
    if not cut and outcome is not None and outcome.status == "fail" and any(
        control.has(f"run{k}/hung/{r}") for r in range(world_size) if r != job.rank
    ):
        # This body failed once another member had been cut (freeing it closes the group under this
        # one): it had no answer at that rank's deadline either, and a pool would call it hung.
        control.put(f"run{k}/hung/{job.rank}", output + f"\n---------- rank {job.rank}: still running when another rank was cut ----------\n")
        cut = True
    if cut:
        job.group.drop()
        control.put(f"run{k}/back/{job.rank}", True)
        return
    if outcome is None:
        outcome = RankOutcome(rank=job.rank, status="fail", error=f"rank {job.rank} was terminated by the launcher during the test body")
    try:
        payload = pickle.dumps((outcome, output), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # the value did not pickle: say so, as a pool's rank does
        failed = RankOutcome(
            rank=job.rank,
            status="fail",
            error=f"the test body's return value could not be sent to the other ranks:\n{traceback.format_exc()}",
        )
        payload = pickle.dumps((failed, output), protocol=pickle.HIGHEST_PROTOCOL)
        outcome = failed
    control.put_bytes(f"run{k}/out/{job.rank}", payload)
    control.put(f"run{k}/st/{job.rank}", outcome.status)


def collect_outcomes(job: Job, k: int, run: RankRun, timeout_s: float, start: float) -> None:
    """Every member's outcome of run ``k`` into ``run``, on every rank of the job (its own included)."""
    control = job.control
    world_size = run.world_size
    member = job.rank < world_size
    pending = set(range(world_size))
    # A member that hangs with the GIL held cannot post: the others call it hung once its watchdog's
    # deadline and the time it gets to come back have passed.
    hard_deadline = start + job.skew_s() + timeout_s + unstick_s(timeout_s) + 10.0
    what = f"waiting for the outcome of {job.test_label()} at world size {world_size}"
    pause = 0.005
    while pending:
        for rank in sorted(pending):
            if control.has(f"run{k}/st/{rank}"):
                outcome, text = pickle.loads(control.take_bytes(f"run{k}/out/{rank}"))
                run.outcomes[rank], run.output[rank] = outcome, text
                pending.discard(rank)
            elif control.has(f"run{k}/hung/{rank}"):
                run.hung.append(rank)
                run.output[rank] = control.take(f"run{k}/hung/{rank}")
                pending.discard(rank)
        if run.hung and member and job.group.current is not None:
            job.group.drop()  # frees a hung member blocked on this rank in a collective
        if pending:
            control.watch(pending, deadline=hard_deadline, what=what)
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
    run.hung.sort()
    if run.hung:
        control.wait_keys(
            {r: [f"run{k}/back/{r}"] for r in run.hung},
            deadline=time.monotonic() + unstick_s(timeout_s) + 10.0,
            what=f"waiting for hung rank(s) {run.hung} to get free",
        )
    if member and (not run.healthy or any(o.status == "fail" for o in run.outcomes.values())):
        job.group.drop()  # a group that saw a failure is not reused


