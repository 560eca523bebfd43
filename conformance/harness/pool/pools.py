"""Pools of rank processes, started once per (world size, backend) and reused by every test: the
runner of the suite's own ranks (:class:`PoolRunner`).

The controller (the pytest process) sends one :class:`~conformance.harness.worker.Task` to every rank
and waits for every rank's answer, a rank dying, or the deadline, whichever comes first. A pool that
hung or lost a rank is killed; the next ``run`` starts a fresh one in a fresh rendezvous directory.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Collection
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from conformance.child_process import process_context
from conformance.harness.runner import FAILURE_GRACE_S, RankRun, RanksNotStarted
from conformance.harness.worker import RankOutcome, Task, make_task, rank_main, recv_message, send_message
from conformance.processes import kill_with_children

__all__ = ["RankPool", "PoolRunner"]

#: How long SIGUSR1's stack dump gets before the logs are read.
STACK_DUMP_WAIT_S = 1.0


class RankPool:
    """``world_size`` rank processes joined in one process group over ``backend``."""

    def __init__(self, world_size: int, backend: str, *, pg_timeout_s: float = 1800.0) -> None:
        self.world_size = world_size
        self.backend = backend
        self.pg_timeout_s = pg_timeout_s
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._dir: Path | None = None

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def log_path(self, rank: int) -> Path:
        assert self._dir is not None
        return self._dir / f"rank{rank}.log"

    def start(self, timeout_s: float = 120.0) -> None:
        """Spawn the ranks and wait until each has joined the process group."""
        self.stop()
        self._dir = Path(tempfile.mkdtemp(prefix=f"sdc-pool-ws{self.world_size}-"))
        ctx = process_context()
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main,
                name=f"sdc-rank{rank}-of-{self.world_size}",
                args=(
                    rank,
                    self.world_size,
                    self.backend,
                    str(self._dir / "store"),
                    str(self.log_path(rank)),
                    child_conn,
                    os.getpid(),
                    self.pg_timeout_s,
                    dict(os.environ),
                ),
                daemon=True,
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        run = self._collect(time.monotonic() + timeout_s, offsets={r: 0 for r in range(self.world_size)})
        failed = {r: o for r, o in run.outcomes.items() if o.status != "ok"}
        if failed or not run.healthy or len(run.outcomes) != self.world_size:
            self.stop()
            details = "\n".join(f"[rank {r}] {o.error}" for r, o in failed.items())
            details += "".join(f"\n[rank {r}] died with exit code {c}" for r, c in run.died.items())
            details += "".join(f"\n[rank {r}] did not join within {timeout_s:.0f}s" for r in run.hung)
            details += "".join(f"\n[rank {r} output]\n{out}" for r, out in run.output.items() if out.strip())
            raise RanksNotStarted(
                f"could not start a {self.backend} pool of world size {self.world_size}:\n{details}"
            )

    def run(self, task: Task, timeout_s: float) -> RankRun:
        """Run ``task`` on every rank. The pool is stopped (to be restarted) if the run was not healthy."""
        if not self.alive:
            self.start()
        offsets = {r: self._log_size(r) for r in range(self.world_size)}
        payload = pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL)  # once for all ranks; see send_message
        for conn in self._conns:
            conn.send_bytes(payload)
        run = self._collect(time.monotonic() + timeout_s, offsets)
        if not run.healthy:
            self.stop(hung=run.hung)
        return run

    def stop(self, hung: Collection[int] = ()) -> None:
        """Ask the ranks to exit, kill what does not, and remove the rendezvous directory. The ``hung``
        ranks (their stacks already read) are killed at once: a rank stuck in a test body never reads
        the request, and waiting for it would only delay the next test."""
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns)):
            if rank in hung and proc.is_alive() and proc.pid is not None:
                kill_with_children(proc.pid)
            elif proc.is_alive():
                try:
                    send_message(conn, None)
                except (OSError, BrokenPipeError):
                    pass
        deadline = time.monotonic() + 3.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive() and proc.pid is not None:
                kill_with_children(proc.pid)
                proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # -- internals -----------------------------------------------------------------------------

    def _log_size(self, rank: int) -> int:
        try:
            return self.log_path(rank).stat().st_size
        except FileNotFoundError:
            return 0

    def _read_log(self, rank: int, offset: int) -> str:
        try:
            with open(self.log_path(rank), "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def _try_recv(self, rank: int) -> RankOutcome | None:
        """The rank's answer if one is waiting on its pipe; None at EOF (the rank died) or if none."""
        conn = self._conns[rank]
        try:
            return recv_message(conn) if conn.poll() else None
        except (EOFError, OSError):
            return None

    def _collect(self, deadline: float, offsets: dict[int, int]) -> RankRun:
        run = RankRun(world_size=self.world_size)
        pending = set(range(self.world_size))
        first_failure_at: float | None = None
        while pending:
            now = time.monotonic()
            limit = deadline if first_failure_at is None else min(deadline, first_failure_at + FAILURE_GRACE_S)
            if now >= limit:
                break
            waitables = {self._conns[r]: r for r in pending}
            sentinels = {self._procs[r].sentinel: r for r in pending}
            ready = wait(list(waitables) + list(sentinels), timeout=limit - now)
            for rank in sorted({waitables[obj] if obj in waitables else sentinels[obj] for obj in ready}):
                if rank not in pending:
                    continue
                outcome = self._try_recv(rank)
                if outcome is not None:
                    run.outcomes[rank] = outcome
                    failed = outcome.status == "fail"
                else:
                    # Readable without a message (EOF) or its sentinel fired: the rank is gone.
                    self._procs[rank].join(timeout=5.0)
                    run.died[rank] = self._procs[rank].exitcode
                    failed = True
                pending.discard(rank)
                if failed and first_failure_at is None:
                    first_failure_at = time.monotonic()
        run.hung = sorted(pending)
        if run.hung:
            # Ask the hung ranks where they are before the pool is killed.
            for rank in run.hung:
                try:
                    os.kill(self._procs[rank].pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            time.sleep(STACK_DUMP_WAIT_S)
        for rank in range(self.world_size):
            run.output[rank] = self._read_log(rank, offsets.get(rank, 0))
        return run


class PoolRunner:
    """The :class:`~conformance.harness.runner.Runner` of the suite's own ranks: one
    :class:`RankPool` per (world size, backend), started at its first test and reused; a pool that hung
    or lost a rank is killed and the next test starts a fresh one."""

    #: A rank is a child of the pytest process: its crash ends its pool, not the run.
    contains_crashes = True

    def __init__(self, *, pg_timeout_s: float = 1800.0) -> None:
        self._pools: dict[tuple[int, str], RankPool] = {}
        self.pg_timeout_s = pg_timeout_s

    def pool(self, world_size: int, backend: str) -> RankPool:
        """The pool of ``(world_size, backend)`` (made, not yet started, at the first call)."""
        key = (world_size, backend)
        if key not in self._pools:
            self._pools[key] = RankPool(world_size, backend, pg_timeout_s=self.pg_timeout_s)
        return self._pools[key]

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
        return self.pool(world_size, backend).run(make_task(fn, args, kwargs, tmp_dir=tmp_dir), timeout_s)

    def after_unhealthy_run(self) -> str:
        return "the pool was killed and is restarted for the next test"

    def stop(self) -> None:
        for pool in self._pools.values():
            pool.stop()
        self._pools.clear()
