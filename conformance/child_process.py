"""Processes of their own that the suite starts: the harness's ranks, and the processes tests start: a save
to be killed (``crash_child``), a second job saving into the same directory, an evaluation job loading
during a save (``eval_child``).

Each is a real process (its own address space, killed with SIGKILL, no cleanup), but it is forked from a
server process that imported torch once (multiprocessing's ``forkserver``), not started from scratch:
importing torch costs seconds of CPU, the kill tests start a hundred such processes, and every pool
(re)start and every self-test's inner run starts ranks. What a fresh
interpreter would give a child and a fork must give it too is handed over explicitly: the environment
(the server's is the one it started with) and where its output goes.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Child", "ChildTimeout", "adopt_environment", "process_context", "start_child", "run_child"]

#: What the server imports before it forks: torch and the parts of it every adapter's checkpoint uses.
#: A module missing here only costs time (the child imports it). ``torch._dynamo`` is private, but torch
#: imports it lazily on a process's first ``distribute_tensor``, optimizer or ``fully_shard`` call (their
#: ``_disable_dynamo`` wrappers): half a second of CPU in every rank and every child that makes one.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor", "torch._dynamo")


class ChildTimeout(Exception):
    """A child did not end in time; it was killed."""


def process_context() -> Any:
    """The multiprocessing context whose processes are forked from the torch-preloaded server. A
    process's environment is the server's, not its starter's: pass the starter's along and apply it.

    One server serves a whole tree of processes: a process forked from it (an inner pytest session of
    the self-tests, a rank that starts a child) forks its own processes from the same server instead of
    starting another, which would import torch again (seconds of CPU each, for every inner session)."""
    context = multiprocessing.get_context("forkserver")
    # Only the first call before the server starts counts; later ones change nothing.
    context.set_forkserver_preload(list(PRELOAD))
    _share_server()
    return context


def _share_server() -> None:
    # multiprocessing has no public way to adopt a running server: a process the server forked knows
    # the server's address (forkserver.main sets it before forking) and holds its "alive" pipe end and
    # resource tracker (forkserver._serve_one sets them), but not its pid, so its ensure_running()
    # starts a second server. The private attributes are multiprocessing.forkserver's client state
    # (CPython 3.9-3.13). The server outlives this process: it ends once every holder of the "alive"
    # pipe has, this one included.
    from multiprocessing import forkserver

    client: Any = forkserver._forkserver
    if client._forkserver_pid is None and client._forkserver_address is not None and client._forkserver_alive_fd is not None:
        client.ensure_running = lambda: None  # the server that forked this process; its own parent reaps it


def adopt_environment(env: Mapping[str, str]) -> None:
    """Make ``env`` (the starter's environment) this forked process's, as a fresh interpreter started
    with it would have it: also torch's intra-op threads, which the server fixed when it imported torch
    under its own environment, follow ``env``'s ``OMP_NUM_THREADS``. Where ``env`` does not set it, the
    process and those it starts get one, as torchrun gives each of several processes on one machine:
    the suite's processes (both world sizes' ranks, the children tests start, the parts of ``make
    test``) share the cores, and with torch's default of a thread per core each process's idle OpenMP
    threads spin on cores another one needs, while the suite's tensors are too small to gain from more."""
    import torch  # the server's, already imported

    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        threads = int(os.environ["OMP_NUM_THREADS"])
    except ValueError:  # torch ignores a value that is not a number, and so does this
        return
    if threads > 0:
        torch.set_num_threads(threads)


def _entry(main: Callable[[list[str]], int], argv: list[str], env: dict[str, str], output: str) -> None:
    """The child: the caller's environment, stdout and stderr into ``output``, then ``main(argv)`` as
    its exit status."""
    adopt_environment(env)
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    sys.exit(main(argv))


class Child:
    """One started child: its exit status once it ended, and what it wrote to stdout and stderr."""

    def __init__(self, process: Any, output: Path, description: str) -> None:
        self._process = process
        self._output = output
        self.description = description

    def poll(self) -> int | None:
        """The exit status if the child ended (a negative signal number if a signal ended it), else None."""
        return None if self._process.is_alive() else self._process.exitcode

    def wait(self, timeout: float) -> int:
        """Wait for the child to end; :class:`ChildTimeout` (after killing it) if it has not within ``timeout``."""
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
            raise ChildTimeout(f"{self.description} did not end within {timeout:g} s; killed. Its output:\n{self.output[-800:]}")
        return int(self._process.exitcode)

    def close(self) -> None:
        """Remove the file its output went to (the child must have ended)."""
        self._output.unlink(missing_ok=True)

    @property
    def output(self) -> str:
        """Its stdout and stderr so far."""
        try:
            return self._output.read_text(errors="replace")
        except FileNotFoundError:
            return ""


def start_child(main: Callable[[list[str]], int], argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                description: str = "a child process") -> Child:
    """Start ``main(argv)`` (a module-level function) in a process of its own, with ``env`` (default: this
    process's environment) as its environment."""
    fd, output = tempfile.mkstemp(prefix="sdc-child-", suffix=".log")
    os.close(fd)
    process = process_context().Process(target=_entry, args=(main, list(argv), dict(os.environ if env is None else env), output),
                                 name=description, daemon=False)
    process.start()
    return Child(process, Path(output), description)


def run_child(main: Callable[[list[str]], int], argv: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
              description: str = "a child process") -> tuple[int, str]:
    """:func:`start_child`, waited for: (exit status, its stdout and stderr)."""
    child = start_child(main, argv, env=env, description=description)
    try:
        return child.wait(timeout), child.output
    finally:
        child.close()
