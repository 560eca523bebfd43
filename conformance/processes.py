"""The child processes of the calling process, read from ``/proc`` (Linux): what the checks that an
implementation leaves no process behind (ML-32, AS-7) and the faults that stop or kill a writer process
(AS-4, AS-7) look at."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["child_processes", "kill_with_children", "process_state", "still_running"]


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
