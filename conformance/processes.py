"""The child processes of the calling process, read from ``/proc`` (Linux): what the checks that an
implementation leaves no process behind (ML-32, AS-7) and the faults that stop or kill a writer process
(AS-4, AS-7) look at; and the calling process's own threads, for the moment a fault is placed at."""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import resource
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

__all__ = ["child_processes", "debugger_stop", "file_size_limit", "kill_with_children", "process_state", "still_running",
           "thread_blocked_writing"]


def process_state(pid: int) -> str | None:
    """The one-letter state of process ``pid`` (``R``, ``S``, ``T`` stopped, ``Z`` ended but not
    reaped, ...), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def kill_with_children(pid: int) -> None:
    """SIGKILL process ``pid`` and, first, its children (an implementation's writer or server processes a
    killed rank would leave orphaned: they get no signal when their parent dies)."""
    for child in child_processes(zombies=True, parent=pid):
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:  # ended meanwhile
            pass
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def child_processes(*, zombies: bool = False, parent: int | None = None) -> dict[int, str]:
    """This process's (or ``parent``'s) child processes (pid -> command line), leaving out Python's multiprocessing
    resource tracker (one per process, started by the first ``spawn`` of anything and never stopped, it
    belongs to the interpreter, not to the implementation under test) and, unless ``zombies``, those that
    ended and are not yet reaped (a process that outlives its call; an unreaped one is a leak of another
    kind, which AS-7 counts)."""
    me = os.getpid() if parent is None else parent
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != me or (fields[0] == "Z" and not zombies):
                continue
            command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
        if "resource_tracker" not in command:
            found[int(entry)] = command
    return found


def still_running(pids: Callable[[], Iterable[int]], grace_s: float = 5.0) -> list[int]:
    """The processes ``pids()`` names that still run (neither gone nor a zombie) once they have had up
    to ``grace_s`` seconds to end: a process asked to end (SIGTERM, a request on its pipe) takes a
    moment to go."""
    deadline = time.monotonic() + grace_s
    while True:
        running = [pid for pid in pids() if process_state(pid) not in (None, "Z")]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


# ptrace(2) requests and the wait flag for a traced child (<linux/ptrace.h>, <linux/wait.h>): the stdlib
# names neither.
_PTRACE_SEIZE = 0x4206
_PTRACE_INTERRUPT = 0x4207
_WALL = 0x40000000


def debugger_stop(pid: int, timeout_s: float = 10.0) -> None:
    """Stop process ``pid`` as a debugger attaching to it does (``gdb -p``: each of its threads seized,
    then interrupted), and return once it is stopped. Unlike SIGSTOP's stop, SIGCONT does not end this one
    and SIGTERM only waits in its queue: SIGKILL alone ends the process. As a debugger does, a thread of
    this process stays the tracer until the process ends and takes the ends of its threads (a killed
    process whose traced threads nobody waits for never ends). Raises OSError where the kernel refuses to
    trace it."""
    stopped = threading.Event()
    errors: list[BaseException] = []

    def trace() -> None:
        try:
            threads = _seize_and_interrupt(pid, timeout_s)
        except BaseException as error:  # noqa: B036 - handed to the caller
            errors.append(error)
            return
        finally:
            stopped.set()
        # A tracer that ends lets its tracees go on: this thread lasts until the process has ended. Its
        # threads' ends come here, to the tracer, before the process's end can reach its parent; the main
        # thread's end is the parent's to take (the implementation's wait for its writer), so it is only
        # looked at, not taken.
        with contextlib.suppress(ChildProcessError):
            for tid in threads - {pid}:
                while not _ended(os.waitpid(tid, _WALL)[1]):
                    pass
            while not _has_ended(pid):
                os.waitpid(pid, _WALL | os.WNOHANG)  # a stop, reported to the tracer: taken, not left

    threading.Thread(target=trace, name=f"debugger-of-{pid}", daemon=True).start()
    stopped.wait()
    if errors:
        raise errors[0]


def _has_ended(pid: int) -> bool:
    """Wait for process ``pid``'s next report and say whether it ended, leaving its end to be taken."""
    report = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | _WALL)
    return report is not None and report.si_code in (os.CLD_EXITED, os.CLD_KILLED, os.CLD_DUMPED)


def _ended(status: int) -> bool:
    return os.WIFEXITED(status) or os.WIFSIGNALED(status)


def _seize_and_interrupt(pid: int, timeout_s: float) -> set[int]:
    """Trace every thread of process ``pid`` from the calling thread and stop each; the thread ids."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long

    def request(number: int, name: str, tid: int) -> None:
        if libc.ptrace(number, tid, None, None) == -1:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{name} of thread {tid} of process {pid}: {os.strerror(errno)}")

    # Every thread, as a debugger stops them: a thread left running takes a SIGTERM for the whole process
    # and ends it. A thread a running one started meanwhile shows in the next listing; once all are
    # stopped, none starts another.
    traced: set[int] = set()
    while True:
        try:
            threads = {int(tid) for tid in os.listdir(f"/proc/{pid}/task")} - traced
        except FileNotFoundError:
            raise ProcessLookupError(f"process {pid} is gone") from None
        if not threads:
            break
        for tid in sorted(threads):
            request(_PTRACE_SEIZE, "PTRACE_SEIZE", tid)
            request(_PTRACE_INTERRUPT, "PTRACE_INTERRUPT", tid)
            traced.add(tid)
    # Each stop is reported to the tracer's process, which is the writer's parent too: taken here, no
    # report reaches the implementation's own wait for its writer, which would read a stop where it
    # expects an exit status (multiprocessing's join raises on one).
    deadline = time.monotonic() + timeout_s
    for tid in sorted(traced):
        while os.waitpid(tid, _WALL | os.WNOHANG)[0] != tid:
            if time.monotonic() > deadline:
                raise OSError(f"thread {tid} of process {pid} did not stop within {timeout_s:.0f} s of "
                              f"PTRACE_INTERRUPT (state {process_state(tid)})")
            time.sleep(0.01)
    return traced


@contextlib.contextmanager
def file_size_limit(pids: Iterable[int], limit_bytes: int) -> Iterator[list[int]]:
    """Within the block, processes ``pids`` cannot grow a file past ``limit_bytes`` (``RLIMIT_FSIZE``,
    set from outside with ``prlimit``): a write past it fails with ``EFBIG`` ("File too large"), as a
    write to a full disk fails with ``ENOSPC``, in that process alone and whatever it writes with. Python
    ignores ``SIGXFSZ`` (the kernel's signal for it), so a Python writer gets the error; a process that
    does not is ended by the signal. Yields the pids limited (a process that ended is left out); on
    leaving, those still running get their limit back."""
    limited: dict[int, tuple[int, int]] = {}
    try:
        for pid in pids:
            try:
                soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
                # The soft limit only: lowering it needs no privilege, and it can be raised back.
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit_bytes, hard))
            except ProcessLookupError:
                continue
            limited[pid] = (soft, hard)
        yield list(limited)
    finally:
        for pid, previous in limited.items():
            with contextlib.suppress(ProcessLookupError):
                resource.prlimit(pid, resource.RLIMIT_FSIZE, previous)


#: The system calls that write to a descriptor (write, writev, sendto, sendmsg), by machine: the number
#: the kernel shows first in ``/proc/<pid>/task/<tid>/syscall`` for a thread blocked in one.
_WRITE_CALLS = {"x86_64": {1, 20, 44, 46}, "aarch64": {64, 66, 206, 211}}


def thread_blocked_writing(timeout_s: float, poll_s: float = 0.05) -> bool:
    """Whether a thread of this process is seen, within ``timeout_s``, in the same write to a socket or a
    pipe at two looks ``poll_s`` apart: blocked, since whatever reads the other end does not (a process
    that was stopped, whose buffer filled). False where the kernel does not say (another machine, no
    ``/proc``) or no thread got there in time."""
    calls = _WRITE_CALLS.get(platform.machine())
    if calls is None:
        return False
    deadline = time.monotonic() + timeout_s
    before: set[tuple[int, int]] = set()
    while True:
        now = _threads_writing(calls)
        if now & before:
            return True
        if time.monotonic() > deadline:
            return False
        before = now
        time.sleep(poll_s)


def _threads_writing(calls: set[int]) -> set[tuple[int, int]]:
    """(thread id, descriptor) of each thread of this process inside one of ``calls`` on a socket or pipe."""
    found: set[tuple[int, int]] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "syscall").read_text().split()
            if len(fields) < 2 or not fields[0].isdigit() or int(fields[0]) not in calls:
                continue  # "running", or another call
            fd = int(fields[1], 16)
            if os.readlink(f"/proc/self/fd/{fd}").startswith(("socket:", "pipe:")):
                found.add((int(task.name), fd))
        except (OSError, ValueError):  # the thread ended, or the descriptor closed, meanwhile
            continue
    return found
