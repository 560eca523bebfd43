"""Ops for async checkpoints (SPEC.md AS-*): the protocol and the shipped implementations.

An async save stages the state and writes it in the background; it answers with two futures shaped
like DCP's ``AsyncSaveResponse``. The checkpoint it writes is read back with the adapter's synchronous
``checkpoint()`` ops (its ``load``), so an adapter that provides this capability provides that one too.
Every method is called by every rank of the process group.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from conformance.adapters.unsupported import Unsupported

__all__ = ["AsyncSave", "AsyncCheckpointOps", "ReferenceAsyncCheckpointOps", "TorchAsyncCheckpointOps"]

#: Where the background write runs: a thread of the training process, or a writer process per rank.
Executor = Literal["thread", "process"]


@runtime_checkable
class AsyncSave(Protocol):
    """One async save in flight (DCP's ``AsyncSaveResponse``)."""

    @property
    def staging_completion(self) -> Future[Any]:
        """Resolves once the state has been copied: the caller may change it from then on."""

    @property
    def upload_completion(self) -> Future[Any]:
        """Resolves once the checkpoint is published (loads whole), or with the save's error."""


@runtime_checkable
class AsyncCheckpointOps(Protocol):
    """What the AS section needs from an implementation."""

    name: str
    #: The executors provided; a test of another is a skip naming it.
    executors: tuple[str, ...]
    #: What a second async save does while one is in flight (AS-5): waits for it, or is refused.
    concurrent_saves: Literal["wait", "refuse"]

    def async_save(
        self, state_dict: dict[str, Any], checkpoint_id: str | os.PathLike[str], *, process_group: Any = None,
        executor: Executor = "thread",
    ) -> AsyncSave:
        """Stage ``state_dict`` and write it to ``checkpoint_id`` in DCP's format in the background."""

    def shutdown(self) -> None:
        """Wait for the save in flight and release what async saves hold in this process (threads,
        writer processes, staging buffers); a later ``async_save`` starts afresh."""

    # Optional: ``writer_processes(self) -> list[int]``, the pids of the processes that write this
    # process's async saves in the background now. The AS tests that stop or kill a writer (AS-4's
    # writer-dies, AS-7's stopped writer) signal those; without it, every child process that
    # multiprocessing started, which is wrong for a stack with helper processes that are not writers.


@dataclass(frozen=True)
class _Response:
    staging_completion: Future[Any]
    upload_completion: Future[Any]


class _BothExecutors:
    """The shipped ops' declarations: both executors, and a second save waits for the one in flight."""

    executors: tuple[str, ...] = ("thread", "process")
    concurrent_saves: Literal["wait", "refuse"] = "wait"

    def _require_executor(self, executor: str) -> None:
        if executor not in self.executors:
            raise Unsupported(f"no {executor} executor for async saves (provided: {', '.join(self.executors)})")


class ReferenceAsyncCheckpointOps(_BothExecutors):
    """``reference.checkpoint.async_save`` (thread and process executors; a second save waits)."""

    name = "reference"

    def async_save(
        self, state_dict: dict[str, Any], checkpoint_id: str | os.PathLike[str], *, process_group: Any = None,
        executor: Executor = "thread",
    ) -> AsyncSave:
        from reference import checkpoint

        self._require_executor(executor)
        return checkpoint.async_save(
            state_dict, checkpoint_id=checkpoint_id, process_group=process_group,
            async_checkpointer_type=checkpoint.AsyncCheckpointerType(executor),
        )

    def shutdown(self) -> None:
        from reference import checkpoint

        checkpoint.async_shutdown()

    def writer_processes(self) -> list[int]:
        from reference import checkpoint

        return checkpoint.async_writer_pids()


class TorchAsyncCheckpointOps(_BothExecutors):
    """``torch.distributed.checkpoint.async_save`` with its default stager, thread or process executor.

    Without an async stager upstream stages before returning and answers with one future, the upload's;
    the staging future here is then already resolved. Upstream declares no policy for a second save in
    flight (each call starts its own executor); ``wait`` is what its callers are told to do, and what
    AS-5 holds it to."""

    name = "torch"

    def async_save(
        self, state_dict: dict[str, Any], checkpoint_id: str | os.PathLike[str], *, process_group: Any = None,
        executor: Executor = "thread",
    ) -> AsyncSave:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self._require_executor(executor)
        if executor == "process" and not (dist.is_available() and dist.is_initialized()):
            raise Unsupported("torch's process executor needs an initialized default process group (it hands the "
                              "group's rendezvous to its writer process)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            answer = dcp.async_save(
                state_dict, checkpoint_id=checkpoint_id, process_group=process_group,
                async_checkpointer_type=AsyncCheckpointerType(executor),
            )
        if isinstance(answer, Future):
            staged: Future[Any] = Future()
            staged.set_result(None)
            return _Response(staged, answer)
        return answer

    def shutdown(self) -> None:
        # Upstream keeps one writer process per training process for the process executor and stops it
        # only when the process ends (its object's __del__); there is no public call to stop it sooner,
        # so this does what that __del__ does. The thread executor makes a thread per save.
        from torch.distributed.checkpoint import _async_process_executor as executors

        process = getattr(executors, "_CHECKPOINT_PROCESS", None)
        if process is None:
            return
        executors._CHECKPOINT_PROCESS = None
        child = process._save_process
        if child.is_alive():
            try:
                process._send(executors._CheckpointSaveProcessControlOpts.TERMINATE)
            except OSError:
                pass
            child.join(timeout=5)
            if child.is_alive():
                child.terminate()
                child.join(timeout=2)  # SIGTERM's default action ends a writer able to act on it at once
