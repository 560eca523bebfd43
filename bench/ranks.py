"""Rank processes for the multi-rank benchmarks.

asv runs each benchmark in one process, so a figure measured at world size 2 starts its own ranks.
:class:`RankGroup` starts ``world_size`` fresh Python processes joined by a gloo process group
(rendezvous through a ``FileStore`` in a private temp dir, so concurrent runs never collide) and runs
module-level functions on all of them, as many times as asked, until it is closed.

Why not ``torch.multiprocessing.spawn``: under asv the ``bench`` package is importable only through
asv's own import hook, and putting the repository root on ``sys.path`` would import the working
tree's ``reference`` instead of the commit asv installed. The worker therefore loads ``bench`` from
its directory by file location and leaves ``sys.path`` alone; ``reference`` and ``torch`` resolve to
whatever the interpreter has installed (under pytest, the repository root is the working directory,
so that is the working tree).

This is the repository's second launcher of ranks, beside the suite's
:class:`conformance.harness.pool.RankPool`, for the same reason: the pool's ranks find a task's function
by importing its module by name, which a fresh process under asv cannot do for ``bench``.

Timing is done by the ranks themselves (see :func:`timed`), between barriers, so the figures do not
include the controller's messaging.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import pickle
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Client, Connection, Listener
from types import TracebackType
from typing import Any

__all__ = ["RankGroup", "RankError", "close_shared_groups", "measuring_group", "shared_group", "timed", "peak_rss_reset",
           "peak_rss_bytes", "rss_bytes"]

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))

# The worker's entry point: load the ``bench`` package from its directory (argv[1]) without touching
# sys.path, then serve calls. Kept tiny; everything else is in _worker_main.
_BOOTSTRAP = """
import importlib.util, os, sys
bench_dir = sys.argv[1]
spec = importlib.util.spec_from_file_location(
    "bench", os.path.join(bench_dir, "__init__.py"), submodule_search_locations=[bench_dir])
module = importlib.util.module_from_spec(spec)
sys.modules["bench"] = module
spec.loader.exec_module(module)
from bench.ranks import _worker_main
_worker_main(sys.argv[2:])
"""


class RankError(RuntimeError):
    """A function raised on one or more ranks; the message holds each failing rank's traceback."""


class RankGroup:
    """``world_size`` rank processes in one process group, reused by every :meth:`run`.

    ``backend`` is ``gloo`` (CPU) or ``nccl``, where rank ``r`` uses ``cuda:r`` (one GPU per rank).
    Use as a context manager; :meth:`close` is idempotent and kills ranks that do not exit.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        start_timeout: float = 120.0,
        env: dict[str, str] | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        self.world_size = world_size
        self.backend = backend
        self._tmp = tempfile.mkdtemp(prefix="bench-ranks-")
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        authkey = secrets.token_bytes(16)
        listener = Listener(os.path.join(self._tmp, "ctl.sock"), family="AF_UNIX", authkey=authkey)
        try:
            store = os.path.join(self._tmp, "store")
            for rank in range(world_size):
                args = [sys.executable, "-c", _BOOTSTRAP, _BENCH_DIR, listener.address, authkey.hex(),
                        str(rank), str(world_size), store, backend]
                # The ranks share this host, as torchrun's ranks of one node do: say so as torchrun
                # does, so that what sizes itself by the CPUs per rank (the reference's reader
                # threads) sees the ranks beside it.
                rank_env = {**os.environ, "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size), **(env or {})}
                self._procs.append(subprocess.Popen(args, env=rank_env))
            deadline = time.monotonic() + start_timeout
            conns: dict[int, Connection] = {}
            listener._listener._socket.settimeout(start_timeout)  # type: ignore[attr-defined]  # no public accept timeout
            while len(conns) < world_size:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"RankGroup({world_size}): ranks did not connect within {start_timeout} s")
                conn = listener.accept()
                conns[conn.recv()] = conn
            self._conns = [conns[r] for r in range(world_size)]
            # Each rank reports once its process group is up.
            self._collect("start-up", start_timeout)
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()

    @property
    def closed(self) -> bool:
        """Whether the ranks are gone: closed, or killed after one did not answer or died."""
        return not self._conns

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 1800.0, **kwargs: Any) -> list[Any]:
        """Run the module-level ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        All ranks call ``fn`` concurrently; it may use ``torch.distributed`` collectives. Raises
        :class:`RankError` with every failing rank's traceback."""
        if not self._conns:
            raise RuntimeError("RankGroup is closed")
        if fn.__module__ == "__main__" or "<locals>" in fn.__qualname__ or "<lambda>" in fn.__qualname__:
            raise ValueError(
                f"{fn.__module__}.{fn.__qualname__} cannot run on the ranks: it must be defined at module level "
                "in an importable module (not __main__)"
            )
        message = pickle.dumps((fn.__module__, fn.__qualname__, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(message)
        return self._collect(f"{fn.__module__}.{fn.__qualname__}", timeout)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        results: list[Any] = []
        failures: list[str] = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(timeout):
                self.close()
                raise RankError(f"{what}: rank {rank} did not answer within {timeout} s (ranks killed)")
            try:
                status, value = pickle.loads(conn.recv_bytes())
            except EOFError:
                self.close()
                raise RankError(f"{what}: rank {rank} died (exit code {self._procs[rank].poll()})") from None
            if status == "ok":
                results.append(value)
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
        if failures:
            raise RankError(f"{what} failed on {len(failures)} of {self.world_size} ranks:\n" + "\n".join(failures))
        return results

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
                conn.close()
            except OSError:
                pass
        self._conns = []
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs = []
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


#: This process's shared groups (:func:`shared_group`): (world size, backend) -> group.
_SHARED: dict[tuple[int, str], RankGroup] = {}


def shared_group(world_size: int, *, backend: str = "gloo") -> RankGroup:
    """This process's group of ``world_size`` ranks on ``backend``: started on first use and reused by
    every later caller until :func:`close_shared_groups` (or the process's exit) closes it. A group whose
    ranks are gone (one did not answer or died) is replaced by a fresh one."""
    group = _SHARED.get((world_size, backend))
    if group is None or group.closed:
        group = _SHARED[world_size, backend] = RankGroup(world_size, backend=backend)
    return group


def close_shared_groups() -> None:
    """Close every shared group (idempotent)."""
    while _SHARED:
        _SHARED.popitem()[1].close()


atexit.register(close_shared_groups)


@contextlib.contextmanager
def measuring_group(world_size: int, *, backend: str = "gloo") -> Iterator[RankGroup]:
    """The ranks an asv grid is measured on: ranks of its own, closed at the end, so that what another
    grid left on them (memory, writer processes, warm caches) is in none of its figures. In quick mode
    (``BENCH_QUICK``: a run that checks each benchmark works, not its figures) the process's shared group
    instead: in ``make test`` every grid and the pytest benchmarks then share one group per world size,
    where each would start its own ranks (an interpreter importing torch apiece)."""
    from bench import config

    if config.QUICK:
        yield shared_group(world_size, backend=backend)
        return
    with RankGroup(world_size, backend=backend) as group:
        yield group


def _worker_main(argv: list[str]) -> None:
    address, authkey_hex, rank_s, world_size_s, store_path, backend = argv
    rank, world_size = int(rank_s), int(world_size_s)
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(authkey_hex))
    conn.send(rank)

    # Plain pickle both ways: Connection.send would use torch's ForkingPickler reductions, which pass
    # tensors as shared-memory handles that the controller cannot always open.
    def send(status: str, value: Any) -> None:
        conn.send_bytes(pickle.dumps((status, value)))

    import warnings

    # torch's DCP warns on every call about its own internal helpers; the benchmark output is not
    # the place for it.
    warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*")
    warnings.filterwarnings("ignore", message="Multiple backends are registered.*")
    try:
        import torch.distributed as dist

        device = None
        if backend == "nccl":  # one GPU per rank, bound to the group (its communicator made for it now)
            import torch

            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, device_id=device)
        send("ok", None)
    except BaseException:
        send("error", traceback.format_exc())
        return
    try:
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except EOFError:
                break
            if message is None:
                break
            module_name, qualname, args, kwargs = message
            try:
                fn: Any = importlib.import_module(module_name)
                for part in qualname.split("."):
                    fn = getattr(fn, part)
                result = fn(*args, **kwargs)
                payload = pickle.dumps(("ok", result))  # fails here, with a traceback, if it cannot pickle
                conn.send_bytes(payload)
            except BaseException:
                send("error", traceback.format_exc())
    finally:
        dist.destroy_process_group()


#: Idle time before each timed call (see :func:`timed`): longer than libgomp's spin-wait.
SETTLE_SECONDS = 0.02


def timed(fn: Callable[[], Any]) -> float:
    """Seconds of ``fn()`` as the slowest rank sees it: barrier, run, (wait for this rank's GPU work),
    barrier. Call on every rank."""
    import torch
    import torch.distributed as dist

    # The untimed work just before (zeroing the destination, checking the last load) ran on torch's
    # intra-op threads, which spin for a few ms after a parallel region (libgomp's wait policy). On a
    # machine with few cores they take the CPU from the other rank's collectives, slowing the first
    # all-reduce several times over (docs/benchmark-results.md, "Why the benchmarks are shaped so"), a
    # cost charged to whichever implementation communicates first. Let them go idle before the clock starts.
    time.sleep(SETTLE_SECONDS)
    dist.barrier()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_initialized():  # a copy to the device may still be in flight
        torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - start


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return _status_kb("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since start or the last :func:`peak_rss_reset`."""
    return _status_kb("VmHWM") * 1024


def peak_rss_reset() -> bool:
    """Reset the peak RSS to the current RSS (Linux >= 4.0, ``/proc/self/clear_refs``); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
