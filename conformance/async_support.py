"""Helpers of the AS section (``test_async_save.py``): the adapter's async ops, the state a training job
saves and what training does to it afterwards, waiting on a future without hanging, and the
process's threads, child processes and file descriptors."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_for_futures
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist
from torch.distributed.tensor import DTensor, Shard

from conformance.adapters.async_checkpoint import AsyncCheckpointOps, AsyncSave
from conformance.adapters.base import Adapter, Unsupported
from conformance.asserts import assert_same_error_on_every_rank, check_each, fail, raised
from conformance.checkpoint_support import FAULT_ERRNO, assert_same_bits, checkpoint_ops, dtensor_of
from conformance.harness.context import RankContext
from conformance.processes import child_processes, debugger_stop, process_state, still_running

__all__ = [
    "ASYNC_FAULT_ERRNO",
    "WRITER_FAULTS",
    "WRITER_FILE_LIMIT",
    "HANDOVER_WAIT_S",
    "handover_entries",
    "error_text",
    "SHUTDOWN_TIMEOUT_S",
    "settled_growth",
    "EXECUTORS",
    "OUTCOME_TIMEOUT_S",
    "async_ops",
    "async_save",
    "training_state",
    "full_training_state",
    "train_on",
    "outcome",
    "Resources",
    "signal_writer_processes",
    "writer_processes",
    "WRITER_STOPS",
    "stop_writers_and_shut_down",
    "isolated",
    "PUBLICATION_DELAY_S",
    "loaded_state",
    "save_and_wait",
    "assert_holds",
    "MAX_LOADS_DURING_WRITE",
    "on_every_rank",
    "RefusingStateful",
    "check_after_a_failure",
]

#: Where the background write runs. A process executor's case costs a writer process per rank (an
#: interpreter that imports torch) and runs the same code at every world size, so it runs at the
#: largest selected one (every world size under ``--hypothesis-profile thorough``); the thread
#: executor's runs at each.
EXECUTORS = ("thread", pytest.param("process", marks=pytest.mark.largest_world_size))
#: Seconds a future gets to resolve once its save should have ended (AS-4's "within seconds"); a
#: future still pending then is a hang, reported as such instead of stopping the run.
OUTCOME_TIMEOUT_S = 30.0
#: Seconds ``shutdown`` gets with a stopped writer process (the reference asks, then SIGTERM after 2 s, then
#: SIGKILL after 1 s more; torch's process executor waits 5 s for its writer to answer).
SHUTDOWN_TIMEOUT_S = 30.0
#: Seconds a staging future gets to resolve once the completion future of its save has.
STAGING_AFTER_COMPLETION_S = 5.0
#: Columns of the sharded matrix: 4 rows per rank of float32, 1 MiB per rank, so that the background
#: write takes longer than what the test does right after the call returns.
_COLUMNS = 1 << 16


def isolated(test: Callable[..., None]) -> Callable[..., None]:
    """A test that, when it fails, shuts its implementation's async saves down before the next test runs
    on the same ranks: a failed save may leave a dead writer process or a broken pipe behind, which
    would fail the next test for a requirement it does not check."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            test(*args, **kwargs)
        except BaseException:
            impl = kwargs.get("impl")
            if impl is not None and impl.unsupported_reason("async_checkpoint") is None:
                with contextlib.suppress(Exception):
                    impl.async_checkpoint().shutdown()
            raise

    return run


def async_ops(impl: Adapter, executor: str) -> AsyncCheckpointOps:
    """The adapter's async ops, or a skip naming the executor it lacks."""
    ops: AsyncCheckpointOps = impl.require("async_checkpoint")
    if executor not in ops.executors:
        pytest.skip(f"{impl.name} provides no {executor} executor for async saves (it provides {', '.join(ops.executors)})")
    return ops


def async_save(ops: AsyncCheckpointOps, state: dict[str, Any], path: Path, dist: RankContext | None, executor: str) -> AsyncSave:
    """``ops.async_save`` as a training job calls it: without a process group (the default one, which
    a test's ranks always are, :attr:`RankContext.group`), so that the path every trainer takes is the
    one judged; a capability the implementation lacks is a skip."""
    try:
        return ops.async_save(state, path, process_group=None, executor=executor)  # type: ignore[arg-type]
    except Unsupported as exc:
        pytest.skip(f"{ops.name}: {exc}")


def training_state(dist: RankContext, fill: float) -> dict[str, Any]:
    """What a training job hands an async save: a sharded parameter (a DTensor, every rank a part), a
    replicated one, optimizer state keyed by FQN with a tensor step and hyperparameters, a bfloat16 and
    an int64 buffer, non-tensor progress (an int step, nested lists and dicts) and a tuple holding a
    tensor (a data sampler's generator state, as trainers keep it). Every value derives
    from ``fill``: two fills differ everywhere."""
    mesh = dist.mesh()
    return full_training_state(dist.world_size, fill, shard=lambda full: dtensor_of(full, mesh, [Shard(0)]))


def full_training_state(world_size: int, fill: float, shard: Callable[[torch.Tensor], Any] = lambda full: full) -> dict[str, Any]:
    """:func:`training_state` of ``world_size`` ranks with the sharded values whole (``shard`` makes
    them DTensors): what an evaluation job, one process without a group, loads."""
    rows = 4 * world_size
    full = torch.arange(rows * _COLUMNS, dtype=torch.float32).reshape(rows, _COLUMNS) + fill
    return {
        "model": {
            "w": shard(full),
            "bias": torch.linspace(-1, 1, 4096, dtype=torch.float64) * fill,
            "scale": torch.full((33,), fill, dtype=torch.bfloat16),
            "tokens_seen": torch.arange(17, dtype=torch.int64) * int(fill),
        },
        "optim": {
            "state": {"w": {"exp_avg": shard(full * 0.5), "step": torch.tensor(fill)}},
            "param_groups": [{"lr": fill / 10, "betas": [0.9, 0.99 + fill / 1000], "params": ["w"]}],
        },
        "step": int(fill),
        "progress": {"epoch": int(fill) % 7, "losses": [fill, fill / 2], "data": {"shard": f"part-{fill}"},
                     "sampler": (torch.arange(5, dtype=torch.int64) + int(fill), int(fill))},
    }


def handover_entries(count: int = 4096) -> dict[str, torch.Tensor]:
    """``count`` one-element tensors, the same on every rank: a save whose plan alone (an item for each
    entry a rank writes) is far larger than a socket's buffer, so that handing it to a writer process
    that does not read blocks the rank, whatever the implementation sends."""
    return {str(i): torch.full((1,), float(i)) for i in range(count)}


def train_on(state: dict[str, Any]) -> None:
    """What training does to the state after staging: every tensor changed in place (DTensor shards
    through their local tensor), a value replaced in the state dict, hyperparameters changed, the step
    counter advanced, nested non-tensor values changed, appended to and replaced, the tensor in a tuple
    changed in place."""
    def bump(value: torch.Tensor) -> None:
        local = value.to_local() if isinstance(value, DTensor) else value
        local.add_(1000 if local.dtype != torch.bool else 1)

    model, optim, progress = state["model"], state["optim"], state["progress"]
    for key in ("w", "scale", "tokens_seen"):
        bump(model[key])
    model["bias"] = torch.zeros_like(model["bias"])  # replaced, as `param.data = ...` does
    bump(optim["state"]["w"]["exp_avg"])
    bump(progress["sampler"][0])
    optim["state"]["w"]["step"].add_(1)
    optim["param_groups"][0]["lr"] = 123.0
    optim["param_groups"][0]["betas"][1] = 0.5
    state["step"] += 1
    progress["epoch"] += 1
    progress["losses"].append(-1.0)
    progress["data"]["shard"] = "later"


def outcome(future: Future[Any], what: str, where: str, timeout: float = OUTCOME_TIMEOUT_S) -> BaseException | None:
    """What ``future`` resolved with (None: success), waiting at most ``timeout`` seconds. A future still
    pending then is a hang: its save still holds threads and collectives of this rank, which the next
    test must not meet, so the rank says so on its output and waits to be cut by the test's rank
    timeout, which reports the test as hung and restarts the pool."""
    try:
        return future.exception(timeout=timeout)
    except FutureTimeout:
        print(f"{what}: still pending after {timeout:.0f} s ({where}); waiting to be cut as hung, so that the pool "
              "is restarted without the pending save", file=sys.stderr, flush=True)
        threading.Event().wait()
        raise AssertionError("unreachable") from None


class Resources:
    """The threads, child processes and open file descriptors of this process, counted."""

    def __init__(self) -> None:
        self.threads = len(os.listdir("/proc/self/task"))
        self.children = child_processes(zombies=True)
        self.fds = len(os.listdir("/proc/self/fd"))

    def grown_since(self, before: Resources) -> list[str]:
        grown = []
        if self.threads > before.threads:
            grown.append(f"threads {before.threads} -> {self.threads} ({', '.join(sorted(t.name for t in threading.enumerate()))})")
        new_children = set(self.children) - set(before.children)
        if new_children:
            grown.append(f"child processes {sorted(self.children[p] for p in new_children)}")
        if self.fds > before.fds:
            grown.append(f"file descriptors {before.fds} -> {self.fds}")
        return grown


def settled_growth(before: Resources, settle_s: float = 2.0) -> list[str]:
    """What grew since ``before``, once threads and processes that are ending have had ``settle_s`` to
    end (a thread joined by a shutdown may still be leaving the kernel's list)."""
    deadline = time.monotonic() + settle_s
    while True:
        grown = Resources().grown_since(before)
        if not grown or time.monotonic() >= deadline:
            return grown
        time.sleep(0.1)


#: The operating system's error each fault of AS-4 is, where it is one (AS-4.f): ML-13's I/O faults, and a
#: full disk in a process executor's writer process (a file size limit on it: ``EFBIG``).
ASYNC_FAULT_ERRNO: dict[str, int] = {**FAULT_ERRNO, "writer-disk-full": errno.EFBIG}
#: AS-4's faults of a process executor's writer process: killed, or its disk full.
WRITER_FAULTS = ("writer-dies", "writer-disk-full")
#: Seconds the background steps get to reach the hand-over to a frozen writer before it is killed anyway.
HANDOVER_WAIT_S = 3.0
#: The file size limit of ``writer-disk-full``: far below a rank's 1 MiB of data, far above nothing.
WRITER_FILE_LIMIT = 64 << 10


#: Errors of an implementation's own code, not of what it was asked to do: one that surfaces from inside a
#: failed save (a writer's error reply read as write results, a reply never assigned) hides the failure.
_INTERNAL_ERROR = re.compile(r"\b(AssertionError|AttributeError|IndexError|KeyError|NameError|TypeError|UnboundLocalError)\b")


def error_text(error: BaseException) -> str:
    """All an error tells its reader: its type and message, then those of the exceptions it was raised
    from or while handling (torch's ``CheckpointException`` prints each failing rank's error itself)."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts.append(f"{type(current).__name__}: {current}")
        current = current.__cause__ or current.__context__
    return "\n".join(parts)


#: How a writer process is stopped so that it does not answer: SIGSTOP's stop (Ctrl-Z, ``kill -STOP``),
#: which SIGCONT ends, and a debugger's (``gdb -p``, ``py-spy dump``'s pause), which only SIGKILL ends. A
#: shutdown that continues its writers first ends the first kind without a kill; only the second shows
#: that it kills the writer that still does not answer.
WRITER_STOPS: dict[str, Callable[[int], None]] = {
    "SIGSTOP": lambda pid: os.kill(pid, signal.SIGSTOP),
    "debugger": debugger_stop,
}


def writer_processes(ops: Any = None, *, among: Collection[int] | None = None) -> list[int]:
    """The processes writing this process's async saves in the background. They are what
    ``ops.writer_processes()`` names where the adapter's ops declare it (a stack whose other helper
    processes, megatron-core's ``multiprocessing`` manager, are not writers), else every child process of
    this one that multiprocessing started (an async save's writer process, whatever the implementation),
    of ``among`` only where given (the processes a save started: another adapter's writer kept in this
    rank is not this one's)."""
    declared = getattr(ops, "writer_processes", None)
    if declared is not None:
        return list(declared())
    return [pid for pid, command in child_processes().items()
            if ("multiprocessing" in command or "spawn_main" in command) and (among is None or pid in among)]


def signal_writer_processes(signum: int, ops: Any = None, *, among: Collection[int] | None = None) -> list[int]:
    """Send ``signum`` to the :func:`writer_processes`; the pids it reached. SIGSTOP first, then the save,
    then SIGKILL: the writer dies with the save's write surely not done."""
    reached = []
    for pid in writer_processes(ops, among=among):
        error = raised(lambda pid=pid: os.kill(pid, signum))  # type: ignore[misc]
        if error is None:
            reached.append(pid)
    return reached


#: Seconds the publication of a save is held back where the test can (the thread executor publishes in
#: the training process), so that a window before it is long enough to be seen.
PUBLICATION_DELAY_S = 0.5


def loaded_state(dist: RankContext, impl: Adapter, path: Path) -> dict[str, Any]:
    """The checkpoint at ``path`` loaded by the adapter's synchronous load into a state of other values."""
    target = training_state(dist, -7.0)
    checkpoint_ops(impl).load(target, path, process_group=dist.group)
    return target


def save_and_wait(dist: RankContext, impl: Adapter, executor: str, path: Path, fill: float) -> None:
    ops = async_ops(impl, executor)
    response = async_save(ops, training_state(dist, fill), path, dist, executor)
    error = outcome(response.upload_completion, f"async save of fill {fill}", f"rank {dist.rank}")
    if error is not None:
        fail(f"async save of fill {fill} to {path}", f"{type(error).__name__}: {error}"[:600], "success", f"rank {dist.rank}")


def stop_writers_and_shut_down(dist: RankContext, impl: Adapter, ops: Any, stop: str, path: Path) -> list[str]:
    """One round of AS-7's stopped writer: a save, its writers stopped by ``stop``, a shutdown that must
    return within seconds and leave none of them. Returns this rank's refusals of a debugger's stop (the
    writer then stopped by SIGSTOP instead)."""
    # What this implementation kept from earlier tests ends here, so that the processes that appear with
    # the save below are its own (another adapter's writer left in this rank is not its to end).
    ops.shutdown()
    before = set(child_processes())
    save_and_wait(dist, impl, "process", path, 1.0)
    spawned = {pid: command for pid, command in child_processes().items() if pid not in before}
    writers: dict[int, str] = {}
    refused: list[str] = []
    for pid in writer_processes(ops, among=spawned):
        error = raised(lambda pid=pid: WRITER_STOPS[stop](pid))  # type: ignore[misc]
        if error is not None and process_state(pid) not in (None, "Z"):  # a writer that ended meanwhile was not refused
            refused.append(f"rank {dist.rank}: {error}")
            error = raised(lambda pid=pid: WRITER_STOPS["SIGSTOP"](pid))  # type: ignore[misc]
        if error is None:
            writers[pid] = spawned.get(pid, "")
    if not any(dist.all_gather_object(bool(writers))):
        pytest.skip(f"{impl.name}'s process executor keeps no writer process after a save: none to stop")
    returned = threading.Event()
    errors: list[BaseException] = []

    def shut_down() -> None:
        try:
            ops.shutdown()
        except BaseException as exc:  # noqa: B036 - reported below
            errors.append(exc)
        finally:
            returned.set()

    threading.Thread(target=shut_down, daemon=True).start()
    in_time = returned.wait(SHUTDOWN_TIMEOUT_S)
    left = {pid: f"{writers[pid]} (state {process_state(pid)})" for pid in still_running(lambda: writers)}
    for pid in left:  # leave no frozen process to the tests after this one
        os.kill(pid, signal.SIGKILL)
    what = f"shutdown with a writer process stopped by {stop}"
    if not in_time:
        fail(what, f"still running after {SHUTDOWN_TIMEOUT_S:.0f} s", "returns within seconds", f"rank {dist.rank}")
    if errors:
        fail(what, f"{type(errors[0]).__name__}: {errors[0]}"[:600], "a normal return", f"rank {dist.rank}")
    if left:
        fail(f"processes left after {what}", left, "none: the stopped writer ended", f"rank {dist.rank}")
    return refused


def assert_holds(dist: RankContext, impl: Adapter, path: Path, fill: float, *, what: str) -> None:
    loaded = raised(lambda: loaded_state(dist, impl, path))
    if isinstance(loaded, BaseException):
        fail(what, f"the load raised {type(loaded).__name__}: {loaded}"[:600], f"the checkpoint of fill {fill}, whole", f"rank {dist.rank}")
    assert_same_bits(loaded_state(dist, impl, path), training_state(dist, fill), what=what)


#: Loads at most during one background write (each a fraction of a second here).
MAX_LOADS_DURING_WRITE = 50


def on_every_rank(dist: RankContext, flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (collective)."""
    value = torch.tensor([1 if flag else 0], device=dist.device)
    torch_dist.all_reduce(value, op=torch_dist.ReduceOp.MIN, group=dist.group)
    return bool(value.item())


class RefusingStateful:
    """A ``Stateful`` whose ``state_dict`` refuses, as an object that cannot be saved mid-step does."""

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("refusing: the dataloader is mid-epoch")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise AssertionError("never loaded")


def check_after_a_failure(dist: RankContext, impl: Adapter, executor: str, path: Path, fault: str, where: str,
                     error: BaseException | None, staging: Future[Any] | None) -> None:
    """AS-4's checks once an async save met ``fault``, each clause checked even when another failed: one
    error everywhere (a), naming the path (b); the previous checkpoint whole (c); the next async save
    succeeds (d); ``staging`` (the failed save's staging future, None when the call raised) resolved (e)."""

    def staging_resolved() -> None:
        # The completion future has resolved, and staging comes before the write: a staging future
        # still pending now stays so, and a trainer waiting on it before its next step hangs.
        if staging is not None and not wait_for_futures([staging], timeout=STAGING_AFTER_COMPLETION_S).done:
            fail(f"the staging future of an async save with {fault} ({executor})", "still pending after the completion future resolved",
                 "resolved (with the staging error where staging failed)", f"rank {dist.rank}")
        # A refusing Stateful's state_dict is part of what staging copies (AS-1: the checkpoint is the
        # state when staging completed, so it cannot be asked for later): where it refused, staging failed,
        # and a staging future that resolved as a success tells the trainer it may go on.
        refused_here = fault == "refusing-stateful" and (where == "every-rank" or dist.rank == dist.world_size - 1)
        if staging is not None and refused_here and staging.done() and staging.exception() is None:
            fail(f"the staging future of an async save whose Stateful refused its state_dict on this rank ({executor})",
                 "a success", "the staging error (this rank's snapshot was never taken)", f"rank {dist.rank}")

    def names() -> None:
        if error is not None and str(path) not in str(error) and path.name not in str(error):
            fail(f"the error of an async save with {fault}", f"{type(error).__name__}: {error}"[:400], f"a message naming {str(path)!r}", f"rank {dist.rank}")

    def says_what_failed() -> None:
        if error is None:
            return
        text, code = error_text(error), ASYNC_FAULT_ERRNO.get(fault)
        if code is not None and os.strerror(code) not in text:
            fail(f"the error of an async save with {fault}", text[:600],
                 f"the operating system's error in its message or its causes: {os.strerror(code)!r} (errno {code})", f"rank {dist.rank}")
        internal = _INTERNAL_ERROR.search(text)
        if internal:
            fail(f"the error of an async save with {fault}", text[:600],
                 f"what failed, not an error of the implementation's own code ({internal.group(0)})", f"rank {dist.rank}")

    def previous_whole() -> None:
        dist.barrier()
        assert_holds(dist, impl, path, 1.0, what=f"the previous checkpoint after an async save failed with {fault}")

    def next_save() -> None:
        dist.barrier()
        save_and_wait(dist, impl, executor, path, 3.0)
        dist.barrier()
        assert_holds(dist, impl, path, 3.0, what=f"the async save after one that failed with {fault}")

    check_each({
        "AS-4.a": lambda: assert_same_error_on_every_rank(dist, error, what=f"an async save with {fault} on {where} ({executor})"),
        "AS-4.b": names,
        "AS-4.c": previous_whole,
        "AS-4.d": next_save,
        "AS-4.e": staging_resolved,
        "AS-4.f": says_what_failed,
    })


def subgroup_save(dist: RankContext, impl: Adapter, executor: str, group: Any, savers: list[int], path: Path,
                  fill: float) -> dict[int, str]:
    """On the ranks ``savers`` only, an async save of a state of their own (replicated among them) over
    ``group`` (those ranks), waited for; the other ranks call nothing of the implementation, and every
    rank then meets the others in a collective of the job. Returns each failed saver's error by rank, on
    every rank (so that every rank fails, none waiting for one that did). An implementation that cannot
    save over a group it is given is a skip on every rank."""
    ops = async_ops(impl, executor)
    error: BaseException | None = None
    unsupported: str | None = None
    if dist.rank in savers:
        try:
            response = ops.async_save(full_training_state(len(savers), fill), path, process_group=group, executor=executor)  # type: ignore[arg-type]
        except Unsupported as exc:
            unsupported = f"{ops.name}: {exc}"
        except Exception as exc:  # the call's error is the save's
            error = exc
        else:
            error = outcome(response.upload_completion, "the completion future of a subgroup's save", f"rank {dist.rank}")
    every = dist.all_gather_object((unsupported, None if error is None else f"{type(error).__name__}: {error}"[:600]))
    reasons = [reason for reason, _ in every if reason]
    if reasons:
        pytest.skip(reasons[0])
    return {rank: failed for rank, (_, failed) in enumerate(every) if failed}


def check_next_group_of_the_job(dist: RankContext, when: str) -> None:
    """A group every rank of the job makes now works: an all-reduce over it sums every rank's value."""
    group = torch_dist.new_group(list(range(dist.world_size)))
    value = torch.tensor([float(dist.rank + 1)], device=dist.device)
    torch_dist.all_reduce(value, group=group)
    expected = dist.world_size * (dist.world_size + 1) / 2
    if value.item() != expected:
        fail(f"an all-reduce over a group of the whole job made {when}", value.item(), expected, f"rank {dist.rank}")
