"""``async_save``: a checkpoint written in the background while training goes on (SPEC.md AS-*).

Shaped like ``torch.distributed.checkpoint.async_save`` with an ``AsyncSaveResponse``, so that a
trainer swaps one for the other::

    response = reference.checkpoint.async_save(state, checkpoint_id=path)
    response.staging_completion.result()   # the state may change from here on (already done on the CPU)
    ...                                      # training steps
    response.upload_completion.result()    # the checkpoint is published and durable; raises its error

A save has two parts:

1. **Staging**, in the caller: ``Stateful`` values are expanded and every value is copied
   (:mod:`reference.checkpoint.staging`). The checkpoint is this copy: whatever training does to the
   state after staging has completed is not in it. On the CPU staging is complete when the call
   returns; copies from a GPU are queued on the current stream, and ``staging_completion`` resolves
   once they have ended (work queued on that stream after the call is ordered after them).
2. **The background write**, on one thread of this process: the steps of a synchronous save (plan,
   write, publish; :func:`reference.checkpoint.api.run_save`) on the staged copy. The thread executor
   writes the data files on that thread; the process executor hands them to the rank's writer process
   (:mod:`reference.checkpoint.writer_process`). Its collectives run on a gloo group of the same ranks
   made for async saves (one per group of ranks, on the first async save), never on the caller's: the
   training thread's collectives and the save's would interleave differently on different ranks
   (KempnerForge #104).

What the caller can rely on, and why:

- ``upload_completion`` resolves only after the coordinator has published the checkpoint (its metadata
  fsynced and renamed into place, the directory fsynced), so a trainer that announces it then, or
  removes the previous one, never points at a checkpoint that does not load (KempnerForge #102,
  Megatron-Bridge PR #4678). Until then the directory holds the previous checkpoint whole: the new
  save's data files have names no earlier save used, so a load in that window, in this process or
  another, reads the previous checkpoint.
- A failure anywhere (staging on one rank, a full disk, a dead writer process) resolves every rank's
  ``upload_completion`` with one error naming the failing ranks, through the save's collective steps;
  nothing is raised on a thread nobody waits for (google/orbax #605). The next save starts afresh.
- A second ``async_save`` while one is in flight waits for it to end before staging: one staged copy
  per rank at a time, and staging buffers are never refilled while a write still reads them
  (Megatron-LM PR #2288). Its outcome stays in its own future.
- :func:`async_shutdown` waits for the save in flight and releases the thread, the writer process and
  the staging arenas. The async group, made once per group of ranks by those ranks alone, stays for the
  process's life (a default group made again gets groups of its own).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from reference.checkpoint.api import expand_stateful, run_save
from reference.checkpoint.collective import Collective
from reference.checkpoint.planner import ReferenceSavePlanner
from reference.checkpoint.staging import Arena, StagedState, Stager
from reference.checkpoint.storage import FileSystemWriter, background_write_threads
from reference.checkpoint.writer_process import WriterProcess

__all__ = ["AsyncCheckpointerType", "AsyncSaveResponse", "async_save", "async_shutdown", "async_writer_pids", "ASYNC_GROUP_TIMEOUT"]

#: How long a collective of the background write waits for the other ranks (a rank whose training
#: process died never arrives).
ASYNC_GROUP_TIMEOUT = timedelta(minutes=10)


class AsyncCheckpointerType(enum.Enum):
    """Where the data files of an async save are written (the names of DCP's enum)."""

    THREAD = "thread"  #: on the background thread of the training process
    PROCESS = "process"  #: in a long-lived writer process per rank


@dataclasses.dataclass(frozen=True)
class AsyncSaveResponse:
    """The futures of one async save, as DCP's ``AsyncSaveResponse``.

    ``staging_completion`` resolves once the state has been copied (the caller may change it from
    then on); ``upload_completion`` resolves with the checkpoint's metadata once it is published and
    durable, or with the error every rank saw."""

    staging_completion: Future[None]
    upload_completion: Future[Metadata]

    def result(self, timeout: float | None = None) -> Metadata:
        """``upload_completion.result``: code written for DCP's plain future works unchanged."""
        return self.upload_completion.result(timeout)

    def done(self) -> bool:
        return self.upload_completion.done()


class _AsyncSaver:
    """This process's async-save machinery, made on first use: the background thread, a stager per
    executor, the writer process, the async groups, and the save in flight."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # one async_save call at a time in this process
        self.thread: ThreadPoolExecutor | None = None
        self.stagers: dict[AsyncCheckpointerType, Stager] = {}
        self.writer: WriterProcess | None = None
        self.groups: dict[tuple[dist.ProcessGroup | None, tuple[int, ...]], dist.ProcessGroup] = {}
        self.in_flight: Future[Metadata] | None = None

    def background_group(self, process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        """The gloo group of ``process_group``'s ranks for the background write (made by those ranks on
        their first async save, and only by them); None without ``torch.distributed``."""
        if process_group is None and not (dist.is_available() and dist.is_initialized()):
            return None
        ranks = tuple(dist.get_process_group_ranks(process_group if process_group is not None else dist.group.WORLD))
        # Keyed by the default group itself (kept alive by the key, so never mistaken for a later one):
        # a default group made again has another store, and groups of its own.
        key = (dist.group.WORLD, ranks)
        group = self.groups.get(key)
        if group is None:
            group = _unregistered_gloo_group(ranks)
            self.groups[key] = group
        return group

    def stager(self, kind: AsyncCheckpointerType) -> Stager:
        stager = self.stagers.get(kind)
        if stager is None:
            stager = self.stagers[kind] = Stager(shared=kind is AsyncCheckpointerType.PROCESS)
        return stager

    def writer_process(self) -> WriterProcess:
        if self.writer is None or not self.writer.alive:
            if self.writer is not None:
                self.writer.close(timeout=0)
            self.writer = WriterProcess()
        return self.writer

    def wait_in_flight(self) -> None:
        """Block until the save in flight (if any) has ended; its outcome stays in its future."""
        if self.in_flight is not None:
            try:
                self.in_flight.exception()
            finally:
                self.in_flight = None

    def submit(self, work: Any) -> Future[Any]:
        if self.thread is None:
            self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-async")
        return self.thread.submit(work)

    def shutdown(self) -> None:
        self.wait_in_flight()
        if self.thread is not None:
            self.thread.shutdown(wait=True)
            self.thread = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        for stager in self.stagers.values():
            stager.release()
        self.stagers.clear()
        # The async groups stay: a group of the same ranks made again would meet under the same name,
        # and its rendezvous would find the first one's addresses in the store.


def _unregistered_gloo_group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """A gloo group of ``ranks`` (global ranks, this one among them), made by those ranks alone and never
    registered with ``torch.distributed``.

    Not ``new_group``: torch names a group that some ranks make alone after its ranks and a count kept
    by each rank (the groups it has registered in torch 2.13; in 2.14 a counter that also names the
    groups every rank makes), so a group of {0, 1} puts its ranks' count ahead of rank 2's, and a later
    group of {1, 2}, or in 2.14 the job's next ``new_group``, gets another name on each side and never
    forms. This group is met in the default group's store under a name of the reference's own, the same
    on every one of its ranks whatever each has made before, and changes no count of torch's."""
    # torch.distributed has no public accessor for the default group's store, which every rank of the
    # job reaches (torchrun's or init_process_group's); _get_default_store is it.
    store = dist.PrefixStore(f"statedict-conformance/async/{'_'.join(map(str, ranks))}/", dist.distributed_c10d._get_default_store())
    group = dist.ProcessGroupGloo(store, ranks.index(dist.get_rank()), len(ranks), ASYNC_GROUP_TIMEOUT)
    return cast(dist.ProcessGroup, group)  # a backend, used as comm uses groups (see reference.comm)


_SAVER = _AsyncSaver()


def _forget_saver() -> None:
    # A child made by fork() has none of the parent's threads or writer process.
    global _SAVER
    _SAVER = _AsyncSaver()


os.register_at_fork(after_in_child=_forget_saver)


def async_save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    process_group: dist.ProcessGroup | None = None,
    storage_writer: StorageWriter | None = None,
    planner: ReferenceSavePlanner | None = None,
    async_checkpointer_type: AsyncCheckpointerType = AsyncCheckpointerType.THREAD,
) -> AsyncSaveResponse:
    """Stage ``state_dict`` and save it to ``checkpoint_id`` in the background (see the module docstring).

    Called by every rank of ``process_group`` (default: the default group, if initialized), in the same
    order as their other async saves. The checkpoint is :func:`reference.checkpoint.save`'s of the
    state at staging: the same files, format and publication. Blocks only to stage, and first, while a
    previous async save of this process is still in flight, until it has ended.

    Errors are not raised here (a rank that raised while the others went on would leave them waiting
    in the background write): they resolve ``upload_completion`` on every rank alike, and a staging
    error resolves this rank's ``staging_completion`` too. The one exception is a ``ValueError`` for
    an argument no rank can use (no checkpoint directory, an unknown executor), raised on every rank.
    """
    if checkpoint_id is None and storage_writer is None:
        raise ValueError("async_save: no checkpoint directory: pass checkpoint_id or a storage_writer with a path")
    kind = AsyncCheckpointerType(async_checkpointer_type)
    # The default writer leaves a core to training: its threads would otherwise take every core.
    writer = storage_writer if storage_writer is not None else FileSystemWriter(thread_count=background_write_threads())
    if kind is AsyncCheckpointerType.PROCESS and not isinstance(writer, FileSystemWriter):
        # The writer process writes through the reference's FileSystemWriter, from the rank's plan.
        raise ValueError(f"async_save: the process executor writes through the reference's FileSystemWriter, got {type(writer).__name__}")
    saver = _SAVER
    with saver.lock:
        saver.wait_in_flight()
        group = saver.background_group(process_group)
        staging: Future[None] = Future()
        upload: Future[Metadata] = Future()
        staged: StagedState | None = None
        staging_error: Exception | None = None
        try:
            staged = saver.stager(kind).stage(expand_stateful(state_dict))
        except Exception as exc:  # reported on every rank by the background write's planning step
            staging_error = exc
            staging.set_exception(exc)
        if staged is not None and staged.copies_done is None:
            staging.set_result(None)
        collective = Collective(group, action=f"save to {str(checkpoint_id)!r}")
        write_data = None
        if isinstance(writer, FileSystemWriter) and kind is AsyncCheckpointerType.PROCESS:
            write_data = _in_writer_process(saver, writer, staged.arena if staged is not None else None)

        def background() -> Metadata:
            if staged is not None and not staging.done():
                try:
                    staged.wait()
                except Exception as exc:
                    staging.set_exception(exc)
                    raise
                staging.set_result(None)
            state = staged.state_dict if staged is not None else {}
            return run_save(state, checkpoint_id, collective, writer, planner, local_error=staging_error, write_data=write_data)

        done = saver.submit(background)
        done.add_done_callback(lambda finished: _copy_outcome(finished, upload))
        saver.in_flight = upload
        return AsyncSaveResponse(staging_completion=staging, upload_completion=upload)


def async_shutdown() -> None:
    """Wait for this process's async save in flight, then release what async saves hold: the
    background thread, the writer process and the staging arenas (the async groups stay, see the
    module docstring). A later ``async_save`` makes them again."""
    with _SAVER.lock:
        _SAVER.shutdown()


def async_writer_pids() -> list[int]:
    """The pids of the processes writing this process's async saves now: its writer process, where a
    process-executor save has started one and it has not been shut down (it may have died since). A
    test or a supervisor that must signal the writer names it by this, not by guessing among children."""
    writer = _SAVER.writer
    return [writer.process.pid] if writer is not None and writer.process.pid is not None else []


def _in_writer_process(saver: _AsyncSaver, writer: FileSystemWriter, arena: Arena | None) -> Any:
    def write_data(plan: SavePlan, planner: ReferenceSavePlanner) -> list[WriteResult]:
        assert writer.path is not None
        return saver.writer_process().write(
            Path(writer.path), plan, planner, arena, sync_files=writer.sync_files, thread_count=writer.thread_count
        )

    return write_data


def _copy_outcome(finished: Future[Metadata], into: Future[Metadata]) -> None:
    error = finished.exception()
    if error is not None:
        into.set_exception(error)
    else:
        into.set_result(finished.result())
