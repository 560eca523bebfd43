"""conformance.faults: the injected read fault hits exactly the bytes it names, in this process only
while it is active, and nothing else."""

from __future__ import annotations

import builtins
import errno
import io
from pathlib import Path

import pytest

from conformance.faults import before_first_read, unreadable_bytes


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


# -- kill_at: the steps of publication ----------------------------------------------------------------------------------

_PUBLICATION = """
import os, sys
from pathlib import Path
from conformance.faults import kill_at
d = Path(sys.argv[1]); op = sys.argv[2]
(d / "__old.distcp").write_bytes(b"old")
kill_at(d, op, 1)
with open(d / ".metadata.tmp", "wb") as f:
    f.write(b"0123456789")
os.replace(d / ".metadata.tmp", d / ".metadata")
os.unlink(d / "__old.distcp")
(d / "done").write_bytes(b"")
"""


@pytest.mark.parametrize(("op", "left"), [
    ("open-metadata", {"__old.distcp": b"old", ".metadata.tmp": b""}),
    ("write-metadata", {"__old.distcp": b"old", ".metadata.tmp": b"01234"}),
    ("renamed", {"__old.distcp": b"old", ".metadata": b"0123456789"}),
    ("removed", {".metadata": b"0123456789"}),
])
def test_a_kill_at_a_step_of_publication_leaves_what_that_step_left(op: str, left: dict[str, bytes], tmp_path: Path) -> None:
    """The child is killed right after the metadata file is opened, in the middle of its write (half
    of it written), right after the rename, right after the removal: exactly that is on disk."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, "-c", _PUBLICATION, str(tmp_path), op], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == left


def test_the_action_runs_once_before_the_first_data_read_only(tmp_path: Path) -> None:
    """Writes, the metadata and files elsewhere pass; the first data file read (in a folder below too)
    runs the action first, once; later reads do not."""
    (tmp_path / "step-1").mkdir()
    for name in (".metadata", "step-1/__0_0.distcp", "__1_0.distcp"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path.parent / "elsewhere").write_bytes(b"y")
    ran: list[str] = []
    real_open = builtins.open
    with before_first_read(tmp_path, lambda: ran.append("action")):
        (tmp_path / "__0_0.new").write_bytes(b"w")
        assert (tmp_path / ".metadata").read_bytes() == b"x" and not ran
        assert (tmp_path.parent / "elsewhere").read_bytes() == b"y" and not ran
        assert (tmp_path / "step-1" / "__0_0.distcp").read_bytes() == b"x" and ran == ["action"]
        assert (tmp_path / "__1_0.distcp").read_bytes() == b"x" and ran == ["action"]
    assert builtins.open is real_open
