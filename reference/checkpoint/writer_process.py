"""The writer process of an async save's process executor: one long-lived process per rank.

A background thread of the training process that pickles, serializes and writes a checkpoint competes
with training for the GIL (pytorch/pytorch PR #147039, InternLM/InternEvo PR #65). The process
executor moves the writing of a rank's data files into a process of its own, started on the rank's
first process-executor save and reused by every later one (starting one costs about as much as
importing torch). The rank keeps everything collective (planning, agreeing, publishing): the writer
process only writes the files of the rank's finished plan and returns the write results.

The staged tensors reach it without a copy: they live in shared memory (see
:class:`~reference.checkpoint.staging.Stager` with ``shared=True``) and travel as handles.

A writer process that dies (killed, out of memory) is noticed at once: the rank waits for the reply
and for the process's end together, and raises a :class:`~reference.checkpoint.errors.CheckpointError`
naming the process, its exit status and the directory, which the save's collective step then reports
on every rank (SkyRL PR #1960: a dead writer hung the job). The next save starts a new process.

The process is started with ``spawn`` (like DCP's process executor), so a script that saves with it
needs the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from reference.checkpoint.errors import CheckpointError

__all__ = ["WriterProcess"]


class WriterProcess:
    """One writer process and the pipe to it. Not thread-safe: one save at a time uses it."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._connection, child_end = context.Pipe()
        self.process = context.Process(target=_serve, args=(child_end,), name="checkpoint-writer", daemon=True)
        self.process.start()
        child_end.close()

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def write(self, path: Path, plan: SavePlan, planner: SavePlanner, *, sync_files: bool, thread_count: int) -> list[WriteResult]:
        """Write ``plan``'s items (resolved here, through ``planner``) to data files of ``path`` in the
        writer process, as ``FileSystemWriter.write_data`` would; return their write results."""
        items = [(item, planner.resolve_data(item)) for item in plan.items]
        try:
            # torch's reductions send a shared-memory tensor as a handle to its storage, not its bytes.
            self._connection.send((str(path), plan.storage_data, items, sync_files, thread_count))
            ready = multiprocessing.connection.wait([self._connection, self.process.sentinel])
            reply = self._connection.recv() if self._connection in ready else None
        except (EOFError, BrokenPipeError, ConnectionResetError):
            reply = None
        if reply is None:
            self.process.join(timeout=1)
            raise CheckpointError(
                f"{path}: the checkpoint writer process (pid {self.process.pid}) died while writing this rank's "
                f"files (exit status {self.process.exitcode}); the checkpoint there is the previous one"
            )
        status, payload = reply
        if status == "error":
            kind, message = payload
            if kind == CheckpointError.__name__:
                raise CheckpointError(message)
            raise CheckpointError(f"{kind}: {message}")
        results: list[WriteResult] = payload
        return results

    def close(self, timeout: float = 5.0) -> None:
        """Stop the process: asked to end, then terminated if it has not within ``timeout`` seconds."""
        try:
            self._connection.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
        self._connection.close()


class _Resolved(SavePlanner):
    """The planner side of ``write_data`` in the writer process: each item's data, resolved by the rank."""

    def __init__(self, data: dict[Any, Any]) -> None:
        self._data = data

    def resolve_data(self, write_item: WriteItem) -> Any:
        return self._data[write_item.index]

    # The writer process only resolves; the rank plans.
    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def create_local_plan(self) -> SavePlan:
        raise NotImplementedError

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        raise NotImplementedError

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        raise NotImplementedError


def _serve(connection: multiprocessing.connection.Connection) -> None:
    """The writer process: one job at a time until told to stop or the rank goes away."""
    # Ctrl-C reaches the whole process group: the rank decides what an interrupted save does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from reference.checkpoint.storage import FileSystemWriter

    while True:
        try:
            job = connection.recv()
        except (EOFError, OSError):  # the rank is gone: nothing more to write
            return
        if job is None:
            return
        path, prefix, items, sync_files, thread_count = job
        try:
            writer = FileSystemWriter(path, sync_files=sync_files, thread_count=thread_count)
            plan = SavePlan(items=[item for item, _ in items], storage_data=prefix)
            future = writer.write_data(plan, _Resolved({item.index: data for item, data in items}))
            reply: tuple[str, Any] = ("ok", future.value())
        except Exception as exc:
            reply = ("error", (type(exc).__name__, f"{exc} (writer process {os.getpid()})"))
        del items, job  # the staged tensors' handles go before the reply: the rank may reuse the buffers
        connection.send(reply)
