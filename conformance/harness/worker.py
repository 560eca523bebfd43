"""The loop each rank process runs: join the process group once, then run test bodies on request.

Messages on the pipe from the controller are :class:`Task` (run a function) or ``None`` (exit).
Each task is answered with exactly one :class:`RankOutcome`. Everything the rank writes to fd 1/2
(Python and C++ alike) goes to its log file, which the controller slices per test; SIGUSR1 dumps every
thread's Python stack there (how the controller shows where a hung rank is).
"""

from __future__ import annotations

import ast
import faulthandler
import importlib
import importlib.abc
import importlib.util
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from conformance.adapters.unsupported import Unsupported, skip_reason
from conformance.child_process import adopt_environment
from conformance.harness.failures import Failure

__all__ = ["Task", "RankOutcome", "DistArg", "DIST_ARG", "make_task", "rank_main", "run_task", "send_message", "recv_message"]


def send_message(conn: Any, obj: Any) -> None:
    """Send ``obj`` as plain pickle bytes.

    ``Connection.send`` pickles with multiprocessing's ForkingPickler, for which torch registers
    reductions that move tensors into shared memory: every rank would then get the *same* storage for
    a tensor argument, and one rank's in-place update (an optimizer's ``step``) would show on the
    others. Plain pickle gives each rank its own copy, as separate hosts would have.
    """
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv_message(conn: Any) -> Any:
    """Receive what :func:`send_message` sent."""
    return pickle.loads(conn.recv_bytes())

class DistArg:
    """Stands for the rank's RankContext among a task's arguments; replaced on each rank."""

    def __repr__(self) -> str:
        return "<dist>"


DIST_ARG = DistArg()


@dataclass(frozen=True)
class Task:
    """Run ``module:qualname(*args, **kwargs)`` with every ``DIST_ARG`` replaced by the rank's context."""

    module: str
    qualname: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    tmp_dir: str
    sys_path: tuple[str, ...]
    seed: int = 0


def make_task(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, tmp_dir: str, seed: int = 0) -> Task:
    """The task that runs ``fn(*args, **kwargs)`` on each rank; ``fn`` must be importable by name."""
    task = Task(
        module=fn.__module__,
        qualname=fn.__qualname__,
        args=args,
        kwargs=kwargs,
        tmp_dir=tmp_dir,
        sys_path=tuple(sys.path),
        seed=seed,
    )
    if "<locals>" in task.qualname or "<lambda>" in task.qualname:
        raise ValueError(
            f"{fn.__module__}.{task.qualname} cannot run on the ranks: the function must be defined at "
            "module level so that every rank can import it"
        )
    return task


@dataclass
class RankOutcome:
    """How a task ended on one rank. ``status`` is ok, fail, skip or xfail."""

    rank: int
    status: str
    value: Any = None
    error: str = ""  # the formatted traceback for fail; the reason for skip/xfail
    failures: list[Failure] = field(default_factory=list)  # for fail: what failed, as data (one per property)


def _die_with_parent(parent_pid: int) -> None:
    # Belt and braces for HX-7: PR_SET_PDEATHSIG kills us when the controller dies, even by SIGKILL;
    # the polling thread covers platforms without prctl.
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 == PR_SET_PDEATHSIG
    except OSError:
        pass

    # A rank forked from a server (conformance.child_process) is the server's child, and the server ends
    # when the controller does: watch both the parent the rank started with and the controller.
    started_with = os.getppid()

    def controller_alive() -> bool:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def watch() -> None:
        while True:
            if os.getppid() != started_with or not controller_alive():
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


#: The suite's modules that hold tests' checks besides the test files (``conformance/*_support.py``):
#: pytest rewrites their asserts too (the plugin registers them; :class:`_RewritingFinder` on the ranks).
SUPPORT_MODULES = tuple(
    f"conformance.{path.stem}" for path in sorted(Path(__file__).resolve().parent.parent.glob("*_support.py"))
)


def _rewritten(origin: str) -> bool:
    name = os.path.basename(origin)
    return origin.endswith(".py") and (name.startswith("test_") or name.endswith("_support.py"))


class _RewritingFinder:
    """Imports every ``test_*.py`` and ``*_support.py`` module with pytest's assertion rewriting, as on the controller, so
    that a failing ``assert a == b`` on a rank shows both values. A meta path finder, not a rewrite of
    the module a task names: a test module imported by another one (``from conformance.test_x
    import ...``) is rewritten too, whichever a rank happens to import first."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is None or not spec.origin or not _rewritten(spec.origin):
            return None
        return importlib.util.spec_from_file_location(name, spec.origin, loader=_RewritingLoader(spec.origin))


class _RewritingLoader(importlib.abc.Loader):
    def __init__(self, origin: str) -> None:
        self.origin = origin

    def create_module(self, spec: Any) -> None:
        return None  # the default module

    def exec_module(self, module: Any) -> None:
        # Private: pytest offers no public way to rewrite a module outside a pytest session.
        from _pytest.assertion.rewrite import rewrite_asserts

        source = Path(self.origin).read_bytes()
        tree = ast.parse(source, filename=self.origin)
        rewrite_asserts(tree, source, self.origin, None)
        exec(compile(tree, self.origin, "exec", dont_inherit=True), module.__dict__)


def _import_test_module(name: str) -> Any:
    """Import ``name``, with every test module it imports rewritten (:class:`_RewritingFinder`)."""
    if not any(isinstance(finder, _RewritingFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RewritingFinder())
    return importlib.import_module(name)


def _resolve(task: Task) -> Any:
    for entry in reversed(task.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    obj: Any = _import_test_module(task.module)
    for part in task.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def run_task(task: Task, rank: int, world_size: int, backend: str, device: Any = None, ranks_per_node: int | None = None) -> RankOutcome:
    """Run ``task`` as ``rank`` (on ``device``; default :func:`device_for_rank`), as one outcome.
    ``ranks_per_node``: a launched job's layout (:attr:`RankContext.ranks_per_node`); None for a pool."""
    import pytest
    import torch

    from conformance.rank_context import RankContext, device_for_rank

    ctx = RankContext(
        rank=rank,
        world_size=world_size,
        backend=backend,
        device=device if device is not None else device_for_rank(backend, rank),
        tmp_dir=Path(task.tmp_dir),
        ranks_per_node=ranks_per_node,
    )
    failures: list[Failure] = []
    try:
        fn = _resolve(task)
        args = tuple(ctx if isinstance(a, DistArg) else a for a in task.args)
        kwargs = {k: (ctx if isinstance(v, DistArg) else v) for k, v in task.kwargs.items()}
        torch.manual_seed(task.seed)
        with ctx.running():
            value = fn(*args, **kwargs)
        status, error = "ok", ""
    except pytest.skip.Exception as exc:
        status, error, value = "skip", str(exc.msg), None
    except Unsupported as exc:  # an op the adapter lacks, wherever the test called it: a skip, never a pass
        status, error, value = "skip", skip_reason(exc), None
    except pytest.xfail.Exception as exc:
        status, error, value = "xfail", str(exc.msg), None
    except BaseException as exc:  # a test body's SystemExit or BaseException-derived error is a failure too
        status, error, value = "fail", traceback.format_exc(), None
        failures = Failure.all_of(exc, rank)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    outcome = RankOutcome(rank=rank, status=status, value=value, error=error, failures=failures)
    return outcome


def rank_main(
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    log_path: str,
    conn: Any,
    parent_pid: int,
    pg_timeout_s: float,
    env: dict[str, str] | None = None,
) -> None:
    """Entry point of a rank process (a multiprocessing target). ``env``: the controller's environment
    when it started the rank, which a rank forked from a server would not otherwise see."""
    if env is not None:
        adopt_environment(env)
    # Ctrl-C in a terminal reaches the whole foreground process group: the controller handles it and
    # tears the pools down; a rank interrupted mid-collective would only leave its peers hanging.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    # A rank is a training process: its async saves (the reference's and DCP's process executors) start
    # writer processes, which multiprocessing refuses to a daemonic process. The controller still ends
    # the rank (``stop()``, the parent-death signal above); only the rank's own view of itself changes.
    multiprocessing.current_process().daemon = False

    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # The handler runs in the main thread, which is the one running the test body.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=False, chain=False)

    import torch
    import torch.distributed as dist

    try:
        device = None
        if backend == "nccl":  # one GPU per rank, bound to the group (its communicator made for it now)
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s),
            device_id=device,
        )
        send_message(conn, RankOutcome(rank=rank, status="ok", value="ready"))
    except BaseException:  # reported to the controller, which fails the pool start
        send_message(conn, RankOutcome(rank=rank, status="fail", error=traceback.format_exc()))
        return

    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            break
        try:
            task = pickle.loads(data)
        except Exception:  # e.g. an argument whose class this rank cannot import
            send_message(conn, RankOutcome(rank=rank, status="fail", error=f"could not unpickle the task:\n{traceback.format_exc()}"))
            continue
        if task is None:
            break
        outcome = run_task(task, rank, world_size, backend)
        try:
            send_message(conn, outcome)
        except Exception:  # the value did not pickle: say so instead of dying
            send_message(
                conn,
                RankOutcome(
                    rank=rank,
                    status="fail",
                    error=f"the test body's return value could not be sent to the controller:\n{traceback.format_exc()}",
                ),
            )
    try:
        dist.destroy_process_group()
    except Exception:  # exiting anyway
        pass
    _end_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _end_children() -> None:
    """Kill what the implementations under test left running in this rank (a writer process, a
    ``multiprocessing`` manager): ``os._exit`` skips the interpreter's exit handlers that would have
    stopped some of them, and nothing else would (ML-32 reports them while the test runs)."""
    from conformance.processes import child_processes

    for pid in child_processes():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # ended meanwhile
            pass
