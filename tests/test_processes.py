"""conformance.processes.debugger_stop: the stop AS-7 puts a writer process in is a debugger's. Every
thread stays stopped through SIGCONT and SIGTERM (a stop a shutdown without SIGKILL would end passes
that shutdown by accident), SIGKILL ends the process, and its parent still takes its exit status (a
stop the tracer left unreaped would hang a correct implementation's join).

conformance.processes.file_size_limit: AS-4's full disk in a writer process. The limited process's
writes past the limit fail with EFBIG and it lives on to report them; no other process is limited, and
the limit is lifted on leaving.

conformance.processes.thread_blocked_writing: the moment AS-4 kills a writer mid-hand-over. A thread
blocked sending to a socket nobody reads is seen; a thread that is not (asleep, or reading) is not."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conformance.processes import debugger_stop, file_size_limit, process_state, thread_blocked_writing

#: A child with three threads besides its main one, each asleep, as a writer process waits for work.
_THREADED_CHILD = (
    "import threading, time\n"
    "for _ in range(3): threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture
def child() -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen([sys.executable, "-c", _THREADED_CHILD], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    yield process
    if process.poll() is None:
        process.kill()
        process.wait(timeout=10)


def _thread_states(pid: int) -> dict[int, str | None]:
    return {int(tid): process_state(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_every_thread_stays_stopped_through_sigcont_and_sigterm(child: subprocess.Popen[str]) -> None:
    debugger_stop(child.pid)
    states = _thread_states(child.pid)
    assert len(states) == 4 and set(states.values()) == {"t"}, states
    os.kill(child.pid, signal.SIGCONT)
    os.kill(child.pid, signal.SIGTERM)
    time.sleep(1.0)
    assert child.poll() is None
    assert set(_thread_states(child.pid).values()) == {"t"}


def test_sigkill_ends_it_and_the_parent_takes_its_exit_status(child: subprocess.Popen[str]) -> None:
    debugger_stop(child.pid)
    tracers = {thread.name for thread in threading.enumerate()}
    assert f"debugger-of-{child.pid}" in tracers
    child.kill()
    assert child.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while f"debugger-of-{child.pid}" in {thread.name for thread in threading.enumerate()}:
        assert time.monotonic() < deadline, "the tracer thread outlived the process it traced"
        time.sleep(0.05)


def test_a_sigstop_stop_is_another_kind_that_sigcont_ends(child: subprocess.Popen[str]) -> None:
    os.kill(child.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while process_state(child.pid) != "T":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGCONT)
    os.kill(child.pid, signal.SIGTERM)
    assert child.wait(timeout=10) == -signal.SIGTERM


def test_a_process_that_is_gone_is_an_oserror_naming_it(child: subprocess.Popen[str]) -> None:
    child.kill()
    child.wait(timeout=10)
    with pytest.raises(OSError, match=str(child.pid)):
        debugger_stop(child.pid)


#: A child that writes ``size`` bytes to the file named on each line it reads, answering "ok" or the
#: errno of its failure, as a writer process reports a failed write.
_WRITING_CHILD = (
    "import sys\n"
    "for line in sys.stdin:\n"
    "    name, size = line.split()\n"
    "    try:\n"
    "        with open(name, 'wb') as f: f.write(b'x' * int(size))\n"
    "        print('ok', flush=True)\n"
    "    except OSError as e:\n"
    "        print(e.errno, flush=True)\n"
)


def test_a_file_size_limit_fails_that_process_s_writes_past_it_and_is_lifted_after(tmp_path: Path) -> None:
    writer = subprocess.Popen([sys.executable, "-c", _WRITING_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    requests, answers = writer.stdin, writer.stdout
    assert requests is not None and answers is not None

    def write(name: str, size: int) -> str:
        requests.write(f"{tmp_path / name} {size}\n")
        requests.flush()
        return answers.readline().strip()

    try:
        with file_size_limit([writer.pid], 4096) as limited:
            assert limited == [writer.pid]
            assert write("small", 1000) == "ok"
            assert write("big", 1 << 16) == str(errno.EFBIG)  # the process lives on: it answered
            (tmp_path / "mine").write_bytes(b"x" * (1 << 16))  # this process is not limited
        assert write("after", 1 << 16) == "ok"
    finally:
        writer.kill()
        writer.wait(timeout=10)


def test_a_file_size_limit_leaves_out_a_process_that_is_gone() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    with file_size_limit([gone.pid], 4096) as limited:
        assert limited == []


def test_a_thread_blocked_sending_to_a_socket_nobody_reads_is_seen() -> None:
    ours, theirs = socket.socketpair()
    sender = threading.Thread(target=lambda: _send_until_refused(ours, 64 << 20), daemon=True)
    try:
        assert not thread_blocked_writing(0.3)  # only a reading (this) thread so far
        sender.start()
        assert thread_blocked_writing(10.0)
        reader = threading.Thread(target=theirs.recv, args=(1,), daemon=True)
        reader.start()  # blocked too, but reading: not a write
    finally:
        theirs.close()  # the send fails now, and the sender ends
        sender.join(timeout=10)
        ours.close()
    assert not sender.is_alive()
    assert not thread_blocked_writing(0.3)


def _send_until_refused(connection: socket.socket, size: int) -> None:
    try:
        connection.sendall(b"x" * size)
    except OSError:  # the other end closed
        pass
