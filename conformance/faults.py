"""Faults injected under any implementation's file I/O: a disk that fills up, an ``fsync`` that fails,
bytes of a data file that cannot be read, a process killed at the n-th step of a save.

Implementations write checkpoints through Python's file objects (``open``/``io.open``, which
``pathlib`` uses too), ``os.fsync`` and ``os.replace``/``os.rename``; the context managers here patch
those names for the files below one directory, so a test breaks the save of any adapter at the same
point without knowing its code. Everything is restored on exit. A process killed by :func:`kill_at`
stays killed: use it in a child process (``conformance/crash_child.py``).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["is_data_file", "failing_writes", "failing_fsync", "failing_reads", "before_first_read", "unreadable_bytes", "kill_at", "KILL_OPS",
           "slowed_publication"]


def is_data_file(name: str) -> bool:
    """A data file of a checkpoint, whatever the implementation calls it: not its metadata or lock."""
    return not name.startswith(".metadata") and name != ".lock"


def _under(directory: Path, file: Any) -> Path | None:
    """``file`` (what ``open`` was given) as a path if it lies in ``directory`` or a folder below it (a
    stack may keep each save in a folder of the checkpoint directory: torchtitan's ``step-<N>``), else None."""
    if isinstance(file, int):
        return None
    try:
        path = Path(os.fsdecode(file)).resolve()
    except (TypeError, ValueError):
        return None
    return path if directory.resolve() in path.parents else None


def _writing(mode: str) -> bool:
    return any(flag in mode for flag in "wax+")


#: ``(real open, file, mode, args, kwargs) -> file object``: what a patched ``open`` does instead.
OpenHook = Callable[[Callable[..., Any], Any, str, tuple[Any, ...], dict[str, Any]], Any]


@contextlib.contextmanager
def _opening(hook: OpenHook) -> Iterator[None]:
    """Inside, ``open`` and ``io.open`` (which ``pathlib`` uses) go through ``hook``; restored on exit."""
    real_open, real_io_open = builtins.open, io.open

    def patched(real: Callable[..., Any]) -> Callable[..., Any]:
        def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            return hook(real, file, mode, args, kwargs)

        return open_

    builtins.open = patched(real_open)
    io.open = patched(real_io_open)
    try:
        yield
    finally:
        builtins.open, io.open = real_open, real_io_open


class _FileProxy:
    """A file object that forwards everything to the real one; subclasses override what they break.
    Closing it (``with`` included) closes the real file."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def __enter__(self) -> _FileProxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._raw.close()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._raw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class _Budget:
    """Bytes the injected disk still takes; None: unlimited."""

    def __init__(self, left: int) -> None:
        self.left = left


class _FailingFile(_FileProxy):
    """A writable file whose writes fail with ``OSError(code)`` once the shared budget is spent."""

    def __init__(self, raw: Any, path: Path, budget: _Budget, code: int) -> None:
        super().__init__(raw)
        self._path, self._budget, self._code = path, budget, code

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size > self._budget.left:
            raise OSError(self._code, os.strerror(self._code), str(self._path))
        self._budget.left -= size
        written: int = self._raw.write(data)
        return written

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)


@contextlib.contextmanager
def failing_writes(directory: Path, *, after_bytes: int = 0, code: int = errno.ENOSPC,
                   which: Callable[[str], bool] = is_data_file, at_open: bool = False) -> Iterator[None]:
    """Inside, writes to files of ``directory`` whose name ``which`` accepts fail with ``OSError(code)``
    (ENOSPC: the disk is full) once ``after_bytes`` bytes have gone to them in all; with ``at_open``
    opening them for writing fails already, before any file is created or truncated (EROFS: a
    read-only file system)."""
    budget = _Budget(after_bytes)

    def hook(real: Callable[..., Any], file: Any, mode: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        path = _under(directory, file)
        if path is None or not _writing(mode) or not which(path.name):
            return real(file, mode, *args, **kwargs)
        if at_open:
            raise OSError(code, os.strerror(code), str(path))
        return _FailingFile(real(file, mode, *args, **kwargs), path, budget, code)

    with _opening(hook):
        yield


@contextlib.contextmanager
def failing_fsync(code: int = errno.EIO) -> Iterator[None]:
    """Inside, every ``os.fsync`` fails with ``OSError(code)`` (a disk that reports a write error late)."""
    real = os.fsync

    def fsync(fd: Any) -> None:
        raise OSError(code, os.strerror(code))

    os.fsync = fsync
    try:
        yield
    finally:
        os.fsync = real


class _ShortFile(_FileProxy):
    """A readable file that ends after ``limit`` bytes (truncated while it was being read)."""

    def __init__(self, raw: Any, limit: int) -> None:
        super().__init__(raw)
        self._left = limit

    def read(self, size: int = -1) -> bytes:
        size = self._left if size is None or size < 0 else min(size, self._left)
        data: bytes = self._raw.read(size)
        self._left -= len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[: self._left]
        got: int = self._raw.readinto(view)
        self._left -= got
        return got


@contextlib.contextmanager
def failing_reads(directory: Path, how: str, *, which: Callable[[str], bool] = is_data_file) -> Iterator[None]:
    """Inside, data files of ``directory`` opened for reading have vanished (``how="vanish"``: the open
    raises FileNotFoundError naming the file) or end after their first 16 bytes (``"truncate"``), as
    if another process removed or truncated them after the load had planned its reads."""
    if how not in ("vanish", "truncate"):
        raise ValueError(f"failing_reads: how must be 'vanish' or 'truncate', got {how!r}")

    def hook(real: Callable[..., Any], file: Any, mode: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        path = _under(directory, file)
        if path is None or _writing(mode) or not which(path.name):
            return real(file, mode, *args, **kwargs)
        if how == "vanish":
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        return _ShortFile(real(file, mode, *args, **kwargs), 16)

    with _opening(hook):
        yield


@contextlib.contextmanager
def before_first_read(directory: Path, action: Callable[[], Any], *, which: Callable[[str], bool] = is_data_file) -> Iterator[None]:
    """Inside, the first open of a data file of ``directory`` for reading (on any thread of this process)
    runs ``action`` first, once; opens for reading that come while it runs wait for it. A load has then
    read its metadata and planned, and not yet read data, when ``action`` runs: the point where another
    job's save publishing over the checkpoint overtakes it, made deterministic instead of a race."""
    import threading

    lock = threading.Lock()
    done = [False]

    def hook(real: Callable[..., Any], file: Any, mode: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        path = _under(directory, file)
        if path is not None and not _writing(mode) and which(path.name):
            with lock:
                if not done[0]:
                    done[0] = True
                    action()
        return real(file, mode, *args, **kwargs)

    with _opening(hook):
        yield


class _BadSectors(_FileProxy):
    """A readable file whose reads that touch any of ``regions`` (``[start, end)`` byte ranges) fail
    with ``OSError(code)`` before reading anything; every other read works."""

    def __init__(self, raw: Any, path: Path, regions: list[tuple[int, int]], code: int) -> None:
        super().__init__(raw)
        self._path, self._regions, self._code = path, regions, code

    def _check(self, size: int | None) -> None:
        start = self._raw.tell()
        end = start + size if size is not None and size >= 0 else None  # None: to the end of the file
        for low, high in self._regions:
            if start < high and (end is None or low < end):
                raise OSError(self._code, os.strerror(self._code), str(self._path))

    def read(self, size: int | None = -1) -> bytes:
        self._check(size)
        data: bytes = self._raw.read(size)
        return data

    def read1(self, size: int = -1) -> bytes:
        self._check(size)
        data: bytes = self._raw.read1(size)
        return data

    def readinto(self, buffer: Any) -> int:
        self._check(memoryview(buffer).nbytes)
        got: int = self._raw.readinto(buffer)
        return got

    def readinto1(self, buffer: Any) -> int:
        self._check(memoryview(buffer).nbytes)
        got: int = self._raw.readinto1(buffer)
        return got

    def readall(self) -> bytes:
        self._check(None)
        data: bytes = self._raw.readall()
        return data


@contextlib.contextmanager
def unreadable_bytes(directory: Path, regions: dict[str, list[tuple[int, int]]], *, code: int = errno.EIO) -> Iterator[None]:
    """Inside, in this process only, reading the bytes ``regions[name]`` (``[start, end)`` ranges) of the
    file ``name`` of ``directory`` fails with ``OSError(code)`` naming the file (EIO: a bad sector, a
    storage node that stops answering); the rest of every file, and opening it, works. A read that
    overlaps a region fails whole, before it reads anything.

    Given the byte range of one saved value's data (not its record's headers), an implementation that
    checks files and record headers while planning a load still plans it successfully and fails while
    reading, and the fault hits only the rank that enters it, even where other ranks read the same file."""
    wanted = {name: list(spans) for name, spans in regions.items() if spans}

    def hook(real: Callable[..., Any], file: Any, mode: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        path = _under(directory, file)
        if path is None or _writing(mode) or path.name not in wanted:
            return real(file, mode, *args, **kwargs)
        return _BadSectors(real(file, mode, *args, **kwargs), path, wanted[path.name], code)

    with _opening(hook):
        yield


#: The steps of a save a child can be killed at. Before the op: a file opened for writing below the
#: checkpoint directory, a write to one, an fsync, a rename into it. The steps of publication, after
#: the op (whatever an implementation names its files, its metadata's start with ``.metadata``):
#: ``open-metadata``, right after a metadata file (final or temporary) was opened for writing (created
#: or truncated, nothing written); ``write-metadata``, in the middle of a write to one (the first half
#: of the bytes written and flushed to the OS, the rest never); ``renamed``, right after a rename into
#: the directory; ``removed``, right after a file of the directory was removed (``os.unlink``,
#: ``os.remove``, ``Path.unlink``): the old files' removal after publication, or a removal before it.
KILL_OPS = ("open", "write", "fsync", "rename", "open-metadata", "write-metadata", "renamed", "removed")


def _is_metadata(path: Path | None) -> bool:
    return path is not None and path.name.startswith(".metadata")


def kill_at(directory: Path, op: str, nth: int) -> None:
    """From now on, this process kills itself (SIGKILL: no cleanup, no ``finally``) at the ``nth``
    (1-based) ``op`` of :data:`KILL_OPS` touching ``directory``. For a child process only."""
    if op not in KILL_OPS:
        raise ValueError(f"kill_at: op must be one of {KILL_OPS}, got {op!r}")
    seen = [0]

    def hit(before: Callable[[], Any] | None = None) -> None:
        seen[0] += 1
        if seen[0] == nth:
            if before is not None:
                before()
            os.kill(os.getpid(), signal.SIGKILL)

    real_open, real_io_open, real_fsync = builtins.open, io.open, os.fsync
    real_replace, real_rename, real_unlink, real_remove = os.replace, os.rename, os.unlink, os.remove

    class _Counted(_FileProxy):
        def __init__(self, raw: Any, metadata: bool) -> None:
            super().__init__(raw)
            self._metadata = metadata

        def write(self, data: Any) -> int:
            if op == "write":
                hit()
            if op == "write-metadata" and self._metadata:
                hit(before=lambda: self._torn(data))
            written: int = self._raw.write(data)
            return written

        def _torn(self, data: Any) -> None:
            """Half of ``data`` written and flushed to the OS: what a kill in the middle of the write leaves."""
            view = memoryview(data).cast("B")
            self._raw.write(view[: len(view) // 2])
            self._raw.flush()

    def patched(real: Callable[..., Any]) -> Callable[..., Any]:
        def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            path = _under(directory, file)
            inside = path is not None and _writing(mode)
            if inside and op == "open":
                hit()
            handle = real(file, mode, *args, **kwargs)
            if inside and op == "open-metadata" and _is_metadata(path):
                hit()
            return _Counted(handle, _is_metadata(path)) if inside else handle

        return open_

    def fsync(fd: Any) -> None:
        if op == "fsync":
            hit()
        real_fsync(fd)

    def rename(real: Callable[..., Any]) -> Callable[..., Any]:
        def move(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            inside = _under(directory, dst) is not None
            if op == "rename" and inside:
                hit()
            moved = real(src, dst, *args, **kwargs)
            if op == "renamed" and inside:
                hit()
            return moved

        return move

    def remove(real: Callable[..., Any]) -> Callable[..., Any]:
        def unlink(path: Any, *args: Any, **kwargs: Any) -> Any:
            inside = _under(directory, path) is not None
            removed = real(path, *args, **kwargs)
            if op == "removed" and inside:
                hit()
            return removed

        return unlink

    builtins.open = patched(real_open)
    io.open = patched(real_io_open)
    os.fsync = fsync
    os.replace = rename(real_replace)
    os.rename = rename(real_rename)
    os.unlink = remove(real_unlink)
    os.remove = remove(real_remove)


@contextlib.contextmanager
def slowed_publication(directory: Path, seconds: float) -> Iterator[None]:
    """Inside, a rename (``os.replace``/``os.rename``) of a file into ``directory`` whose name starts with
    ``.metadata`` (a save's publication) waits ``seconds`` first, on whichever thread makes it: the window
    between a save's data and its publication is then long enough to be seen from another thread."""
    import time

    real_replace, real_rename = os.replace, os.rename

    def slowed(real: Callable[..., Any]) -> Callable[..., Any]:
        def move(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            target = _under(directory, dst)
            if target is not None and target.name.startswith(".metadata"):
                time.sleep(seconds)
            return real(src, dst, *args, **kwargs)

        return move

    os.replace, os.rename = slowed(real_replace), slowed(real_rename)
    try:
        yield
    finally:
        os.replace, os.rename = real_replace, real_rename
