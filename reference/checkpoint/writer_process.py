"""The writer process of an async save's process executor: one long-lived process per rank.

A background thread of the training process that serializes and writes a checkpoint competes with
training for the GIL (pytorch/pytorch PR #147039, InternLM/InternEvo PR #65). The process executor
moves the writing of a rank's data files into a process of its own, started on the rank's first
process-executor save and reused by every later one (starting one costs about as much as importing
torch). The rank keeps everything collective (planning, agreeing, publishing): the writer process
only writes the files of the rank's finished plan and returns the write results.

The staged tensors reach it without a copy: they live in the stager's shared arena
(:class:`~reference.checkpoint.staging.Arena`, a memory file), whose descriptor is passed once over the
pipe (``SCM_RIGHTS``) and mapped once; a write job then names each tensor by its place in the arena.
Each job also lists the arenas still in use, and the process unmaps the others.

A writer process that dies (killed, out of memory) is noticed at once: the rank waits for the reply
and for the process's end together, and raises a :class:`~reference.checkpoint.errors.CheckpointError`
naming the process, its exit status and the directory, which the save's collective step then reports
on every rank (SkyRL PR #1960: a dead writer hung the job). The next save starts a new process.

The process is started with ``spawn`` (like DCP's process executor), so a script that saves with it
needs the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from reference.checkpoint import fast_paths
from reference.checkpoint.errors import CheckpointError
from reference.checkpoint.staging import Arena, tensor_in
from reference.host_bytes import element_bytes

__all__ = ["WriterProcess"]

#: How a tensor travels to the writer process: ("arena", arena id, byte offset, dtype, shape, stride),
#: or, for one outside the arena, ("bytes", its bytes, dtype, shape).
_TensorRef = tuple[Any, ...]


class WriterProcess:
    """One writer process and the pipe to it. Not thread-safe: one save at a time uses it."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._connection, child_end = context.Pipe()
        self.process = context.Process(target=_serve, args=(child_end,), name="checkpoint-writer", daemon=True)
        self.process.start()
        child_end.close()
        self._mapped: set[int] = set()  # arenas the process has been given

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def write(self, path: Path, plan: SavePlan, planner: SavePlanner, arena: Arena | None, *, sync_files: bool,
              thread_count: int) -> list[WriteResult]:
        """Write ``plan``'s items (resolved here, through ``planner``; tensors in ``arena`` by reference)
        to data files of ``path`` in the writer process, as ``FileSystemWriter.write_data`` would;
        return their write results."""
        items = [(item, _reference(planner.resolve_data(item), arena)) for item in plan.items]
        live = [arena.id] if arena is not None else []
        try:
            if arena is not None and arena.id not in self._mapped:
                assert arena.fd is not None, "a process executor stages into a shared arena"
                self._connection.send(("arena", arena.id, arena.bytes.numel()))
                multiprocessing.reduction.send_handle(self._connection, arena.fd, self.process.pid)
                self._mapped.add(arena.id)
            self._mapped &= set(live)
            job = ("write", str(path), plan.storage_data, items, sync_files, thread_count, live, fast_paths.enabled())
            self._connection.send(job)
            ready = multiprocessing.connection.wait([self._connection, self.process.sentinel])
            reply = self._connection.recv() if self._connection in ready else None
        except (EOFError, OSError):
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

    def close(self, timeout: float = 2.0) -> None:
        """Stop the process: asked to end, terminated if it has not within ``timeout`` seconds, and killed
        if it has not a second after that (a stopped process acts on no other signal)."""
        # close() runs after the last save: the writer is idle, and one that can act on the request ends
        # within a fraction of a second (its interpreter's exit). Two seconds leave a loaded machine room;
        # a writer that takes longer is not answering, and ending it loses nothing.
        # A writer stopped by SIGSTOP or Ctrl-Z (not a debugger's stop) is continued first, so that it
        # reads the request to end now instead of waiting out both timeouts frozen.
        if self.process.pid is not None:
            try:
                os.kill(self.process.pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):  # gone already
                pass
        try:
            self._connection.send(None)
        except OSError:
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            # The writer sets no SIGTERM handler: a writer able to act on it ends at once.
            self.process.join(min(timeout, 1.0))
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._connection.close()
        self.process.close()


def _reference(data: Any, arena: Arena | None) -> Any:
    """What travels for one item's data: a tensor as its place in the arena (or its bytes), the rest as is."""
    if not isinstance(data, torch.Tensor):
        return data
    if arena is not None and data.numel() > 0:
        start = arena.bytes.data_ptr()
        offset = data.data_ptr() - start
        if 0 <= offset < arena.bytes.numel():
            return ("arena", arena.id, offset, data.dtype, tuple(data.shape), tuple(data.stride()))
    return ("bytes", bytes(element_bytes(data.detach().cpu().contiguous())), data.dtype, tuple(data.shape))


def _resolve(ref: Any, arenas: dict[int, torch.Tensor]) -> Any:
    """The writer process's side of :func:`_reference`."""
    if not (isinstance(ref, tuple) and ref and ref[0] in ("arena", "bytes")):
        return ref
    if ref[0] == "bytes":
        _, raw, dtype, shape = ref
        tensor = torch.empty(shape, dtype=dtype)
        element_bytes(tensor)[:] = raw
        return tensor
    _, arena_id, offset, dtype, shape, stride = ref
    span = 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if math.prod(shape) else 0
    return tensor_in(arenas[arena_id], offset, dtype, (span,)).as_strided(shape, stride)


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

    arenas: dict[int, torch.Tensor] = {}
    while True:
        try:
            job = connection.recv()
            if job is not None and job[0] == "arena":
                _, arena_id, size = job
                fd = multiprocessing.reduction.recv_handle(connection)
                try:
                    arenas[arena_id] = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)
                finally:
                    os.close(fd)  # the mapping stays
                continue
        except (EOFError, OSError):  # the rank is gone: nothing more to write
            return
        if job is None:
            return
        _, path, prefix, items, sync_files, thread_count, live, fast = job
        for arena_id in set(arenas) - set(live):
            del arenas[arena_id]
        try:
            writer = FileSystemWriter(path, sync_files=sync_files, thread_count=thread_count)
            plan = SavePlan(items=[item for item, _ in items], storage_data=prefix)
            data = {item.index: _resolve(ref, arenas) for item, ref in items}
            with fast_paths.set_enabled(fast):  # the rank's switch, as it was when the rank sent the job
                reply: tuple[str, Any] = ("ok", writer.write_data(plan, _Resolved(data)).value())
        except Exception as exc:
            reply = ("error", (type(exc).__name__, f"{exc} (writer process {os.getpid()})"))
        connection.send(reply)
