"""The async-save workload: how long training is stalled by a save, and how fast it steps meanwhile.

What async saving exists for is measured in one run, for every way of saving, on the model + Adam state
of :mod:`bench.workloads.checkpoint` (same sizes, layouts and ranks):

- **stall**: seconds from the call until training may change the state (the staging future resolved;
  for a synchronous save, the whole save), on the slowest rank;
- **write**: seconds from the call until the checkpoint is complete (the completion future), and its
  throughput beside raw's write of the same bytes (:func:`bench.workloads.checkpoint.save_once`);
- **step ratio**: training steps per second while the background write runs, over steps per second of
  the same loop with no save (measured just before, as long), on the slowest rank.

A training step is a fixed piece of work (matmuls on one intra-op thread, which release the GIL, and a
little Python, which holds it) that also changes one tensor of the saved state in place, as an
optimizer step does. Ways of saving (``SAVERS``): an adapter's async save on an executor
(``reference/thread``, ``torch/process``, ...), an adapter's synchronous save (``reference/sync``), and
torch's ``async_save`` with a ``DefaultStager`` staging asynchronously (``torch/stager``, pinned and
non-blocking copies where CUDA is). Adapters of ``BENCH_IMPL`` are measured too, through their
``AsyncCheckpointOps``.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bench import config
from bench import impls as _impls
from bench.ranks import timed
from bench.workloads import checkpoint as ck

__all__ = ["SAVERS", "savers", "available", "AsyncFigures", "measure_once", "measure"]

CAPABILITY = "async_checkpoint"
#: torch's DefaultStager with async staging: not an adapter's executor, measured beside them.
TORCH_STAGER = "torch/stager"
#: The limit of an async save on this machine: the tensors copied (the stall), then written with plain
#: file I/O and fsynced on one background thread, while the same training loop runs.
RAW_ASYNC = "raw/thread"
#: Matmul size of a training step: a step short against a save's write, so that a stall shows
#: (docs/benchmark-results.md, "Why the benchmarks are shaped so").
_STEP_WIDTH = 192
#: Steps of the no-save loop at least, and the shortest time it runs.
_MIN_IDLE_STEPS, _MIN_IDLE_S = 20, 0.2
#: Quick mode's pause after each step of the loop during a write (see measure_once).
_QUICK_STEP_PAUSE_S = 0.01


def savers() -> list[str]:
    """Every way of saving measured: the reference's and torch's executors and synchronous saves,
    torch's DefaultStager, and the adapters of ``BENCH_IMPL`` (thread and process)."""
    names = [RAW_ASYNC, "reference/thread", "reference/process", "reference/sync", "torch/thread", "torch/process", TORCH_STAGER,
             "torch/sync"]
    for spec in _impls.under_test():
        names += [f"{spec}/thread", f"{spec}/process", f"{spec}/sync"]
    return list(dict.fromkeys(names))


SAVERS: list[str] = savers()


def _split(saver: str) -> tuple[str, str]:
    impl, _, how = saver.rpartition("/")
    return impl, how


def available(saver: str) -> str | None:
    """None if ``saver`` can run here, else why not."""
    if saver == RAW_ASYNC:
        return None
    if saver == TORCH_STAGER:
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
        except ImportError as exc:
            return f"this torch has no DefaultStager: {exc}"
        return None
    impl, how = _split(saver)
    if how == "sync":
        return ck.available(impl)
    reason = _impls.unavailable(impl, CAPABILITY)
    if reason is not None:
        return reason
    ops = _impls.ops(impl, CAPABILITY)
    return None if how in ops.executors else f"{impl} provides no {how} executor (only {', '.join(ops.executors)})"


@dataclass
class AsyncFigures:
    """One save's figures on the slowest rank."""

    stall_s: float
    write_s: float
    steps_during: int
    step_ratio: float  #: steps/s during the write over steps/s without a save


# -- rank-side ------------------------------------------------------------------------------------------

_STEP: dict[str, torch.Tensor] = {}


def _train_step(state_tensor: torch.Tensor) -> None:
    if "w" not in _STEP:
        generator = torch.Generator().manual_seed(0)
        _STEP["w"] = torch.randn(_STEP_WIDTH, _STEP_WIDTH, generator=generator) / _STEP_WIDTH**0.5
        _STEP["x"] = torch.randn(_STEP_WIDTH, _STEP_WIDTH, generator=generator)
    x = _STEP["x"]
    for _ in range(4):
        x = torch.tanh(x @ _STEP["w"])
    _ = [float(i) * 0.5 for i in range(200)]  # the Python side of a step (hooks, logging, schedulers)
    state_tensor.view(-1)[:4096].add_(1e-3)  # an optimizer step changes the state


def _first_tensor(sd: dict[str, Any]) -> torch.Tensor:
    for _, tensor in ck.tensors_of(sd):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.numel() >= 4096 and local.device.type == "cpu":
            return local
    return torch.zeros(4096)


def _steps_per_second(seconds: float, tensor: torch.Tensor) -> float:
    start = time.perf_counter()
    steps = 0
    while steps < _MIN_IDLE_STEPS or time.perf_counter() - start < seconds:
        _train_step(tensor)
        steps += 1
    return steps / (time.perf_counter() - start)


_TORCH_STAGER: list[Any] = []


def _torch_stager_save(sd: dict[str, Any], directory: str) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    if not _TORCH_STAGER:  # one stager for every save, as a trainer keeps it (it caches its buffers)
        cuda = torch.cuda.is_available()
        _TORCH_STAGER.append(DefaultStager(StagingOptions(cuda, False, True, cuda)))
    return dcp.async_save(sd, checkpoint_id=directory, async_stager=_TORCH_STAGER[0])


class _RawAsync:
    """:data:`RAW_ASYNC`'s save: a copy of every local tensor, then one thread writing them to this rank's
    file and fsyncing it. ``done()`` and ``result()`` as a future's."""

    def __init__(self, sd: dict[str, Any], directory: str) -> None:
        import threading

        import torch.distributed as dist

        copies = [(tensor.to_local() if hasattr(tensor, "to_local") else tensor).clone() for _, tensor in ck.tensors_of(sd)]
        path = os.path.join(directory, f"raw-async-{dist.get_rank()}.bin")

        def write() -> None:
            with open(path, "wb") as stream:
                for copy in copies:
                    stream.write(copy.numpy().data)
                stream.flush()
                os.fsync(stream.fileno())

        self._thread = threading.Thread(target=write, name="raw-async-write")
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> None:
        self._thread.join()


def measure_once(saver: str, directory: str) -> dict[str, float]:
    """One save of the prepared source state with ``saver`` into an emptied ``directory``, training
    going on meanwhile; this rank's figures (call on every rank; the controller takes the slowest)."""
    import torch.distributed as dist

    source = ck.source_state()
    tensor = _first_tensor(source)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # training takes one core; the writer may take the others
    try:
        ck.fresh_dir(directory)
        impl, how = _split(saver)
        if how == "sync":
            save, _ = ck.dcp_ops(impl)
            seconds = timed(lambda: save(source, directory))
            return asdict(AsyncFigures(stall_s=seconds, write_s=seconds, steps_during=0, step_ratio=0.0))
        idle_rate = _steps_per_second(_MIN_IDLE_S, tensor)
        dist.barrier()
        start = time.perf_counter()
        if saver == RAW_ASYNC:
            answer: Any = _RawAsync(source, directory)
        elif saver == TORCH_STAGER:
            answer = _torch_stager_save(source, directory)
        else:
            answer = _impls.ops(impl, CAPABILITY).async_save(source, directory, executor=how)
        staging = getattr(answer, "staging_completion", None)
        upload = getattr(answer, "upload_completion", answer)
        if staging is not None:
            staging.result()
        stall = time.perf_counter() - start
        steps = 0
        stepping = time.perf_counter()
        while not upload.done():
            _train_step(tensor)
            steps += 1
            if config.QUICK:
                # Quick mode (make test) checks that the benchmark runs, not its figures: a step loop
                # at full speed would only take the core the writer it waits for needs (a writer
                # process's start is an import of torch).
                time.sleep(_QUICK_STEP_PAUSE_S)
        during = time.perf_counter() - stepping
        upload.result()
        write = time.perf_counter() - start
        rate = steps / during if during > 0 and steps else idle_rate
        return asdict(AsyncFigures(stall_s=stall, write_s=write, steps_during=steps, step_ratio=rate / idle_rate))
    finally:
        torch.set_num_threads(threads)


def release() -> None:
    """Drop the state and what savers keep between saves (writer processes, staging buffers)."""
    for impl in {_split(s)[0] for s in SAVERS if _split(s)[1] != "sync"} - {"raw"}:
        if _impls.unavailable(impl, CAPABILITY) is None:
            _impls.ops(impl, CAPABILITY).shutdown()
    while _TORCH_STAGER:
        _TORCH_STAGER.pop().close()
    ck.release()


def measure(group: Any, saver: str, nbytes: int, layout: str, directory: str, *, repeats: int = 3,
            warm_up: bool = True) -> AsyncFigures:
    """Best of ``repeats`` (the smallest stall; its write and step ratio) on the slowest rank. With
    ``warm_up``, a first save of each saver (a writer process's start, the staging buffers' allocation)
    is made and not counted; without, the figures include it (a run that checks the benchmark works)."""
    group.run(ck.prepare, nbytes, layout, os.environ.get("BENCH_DEVICE", "") or "cpu")
    if warm_up:
        group.run(measure_once, saver, directory)
    best: AsyncFigures | None = None
    for _ in range(repeats):
        ranks = group.run(measure_once, saver, directory)
        figures = AsyncFigures(
            stall_s=max(r["stall_s"] for r in ranks),
            write_s=max(r["write_s"] for r in ranks),
            steps_during=min(int(r["steps_during"]) for r in ranks),
            step_ratio=min(r["step_ratio"] for r in ranks),
        )
        if best is None or figures.stall_s < best.stall_s:
            best = figures
    assert best is not None
    return best
