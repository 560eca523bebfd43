"""conformance.faults: the injected read fault hits exactly the bytes it names, in this process only
while it is active, and nothing else."""

from __future__ import annotations

import builtins
import errno
import io
from pathlib import Path

import pytest

from conformance.faults import unreadable_bytes


def _data(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)  # 1024 bytes
    (directory / "__1_0.distcp").write_bytes(b"x" * 1024)
    return directory


def test_reads_that_touch_the_region_fail_with_eio_naming_the_file(tmp_path: Path) -> None:
    directory = _data(tmp_path)
    path = directory / "__0_0.distcp"
    with unreadable_bytes(directory, {"__0_0.distcp": [(500, 564)]}):
        with open(path, "rb", buffering=0) as raw:  # as records.py reads
            raw.seek(0)
            assert raw.read(500) == (bytes(range(256)) * 4)[:500]  # ends right before the region
            raw.seek(564)
            assert len(raw.read()) == 1024 - 564  # starts right after it
            raw.seek(499)
            with pytest.raises(OSError) as info:
                raw.read(2)
            assert info.value.errno == errno.EIO and str(path) in str(info.value)
            raw.seek(0)
            with pytest.raises(OSError):
                raw.readinto(bytearray(1024))
        with path.open("rb") as buffered:  # as upstream's FileSystemReader opens (pathlib, buffered)
            buffered.seek(520)
            with pytest.raises(OSError):
                buffered.read(1)
            with pytest.raises(OSError):
                buffered.read()
        assert (directory / "__1_0.distcp").read_bytes() == b"x" * 1024  # another file of the directory
        with open(path, "r+b") as writable:  # writing is not reading: untouched
            writable.seek(520)
            writable.write(b"\0")


def test_outside_the_context_everything_reads(tmp_path: Path) -> None:
    directory = _data(tmp_path)
    real_open, real_io_open = builtins.open, io.open
    with unreadable_bytes(directory, {"__0_0.distcp": [(0, 1024)]}):
        pass
    assert builtins.open is real_open and io.open is real_io_open
    assert len((directory / "__0_0.distcp").read_bytes()) == 1024
