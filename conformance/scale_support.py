"""What conformance/test_scale.py's tests use (ML-34 to ML-37 at the world sizes the suite runs): who
wrote which record of a checkpoint, and how often a rank opened a file.

Growth with the world size is measured on the reference's internals by simulation (tests/reference/
test_scale.py, bench.scale); these checks are the parts any implementation shows through its adapter."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.metadata import Metadata

from conformance.asserts import fail
from conformance.dcp_files import read_metadata
from conformance.harness.context import RankContext

__all__ = ["bytes_by_writer", "check_written_in_turn", "counting_opens"]

#: DCP's filesystem writers (torch's and the reference's) name a rank's data files ``__<rank>_...``.
_WRITER = re.compile(r"^__(\d+)_")


def bytes_by_writer(metadata: Metadata, keys: set[str]) -> dict[int, int] | None:
    """Bytes of ``keys``' records per writing rank, from the data files' names in ``metadata``; None when
    a record's file is not named as DCP's filesystem writers name them (the writer is then unknown)."""
    written: dict[int, int] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn not in keys:
            continue
        match = _WRITER.match(os.path.basename(str(getattr(info, "relative_path", ""))))
        if match is None:
            return None
        rank = int(match.group(1))
        written[rank] = written.get(rank, 0) + int(info.length)
    return written


def check_written_in_turn(dist: RankContext, path: Path, keys: set[str]) -> None:
    """On rank 0: fail unless every rank wrote some of the bytes of ``keys``' records in the checkpoint
    at ``path`` and none more than 1.1 x the mean."""
    if dist.rank != 0:
        return
    written = bytes_by_writer(read_metadata(path), keys)
    if written is None:
        pytest.skip("the data files are not named __<rank>_...: which rank wrote a record is unknown")
    writers = {rank: written.get(rank, 0) for rank in range(dist.world_size)}
    mean = sum(writers.values()) / dist.world_size
    if min(writers.values()) == 0 or max(writers.values()) > 1.1 * mean:
        fail("bytes of replicated records each rank wrote", writers,
             f"every rank some, none over 1.1 x the mean {mean:.0f}", str(path))


_OPENS: list[list[str]] = []  # the paths opened while counting_opens() runs (a stack: one list per call)
_HOOKED: list[bool] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _OPENS and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENS[-1].append(os.fsdecode(args[0]))


@contextmanager
def counting_opens() -> Iterator[Callable[[str | Callable[[str], bool]], int]]:
    """Within the block, every file this process opens (Python's ``open`` audit event) is recorded;
    yields ``count(name)``: how many opened paths end in ``name`` (or, given a predicate, how many
    opened paths' file names it accepts). An audit hook cannot be removed: it is added once per
    process and records only inside this block."""
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED.append(True)
    opened: list[str] = []
    _OPENS.append(opened)
    try:
        def count(name: str | Callable[[str], bool]) -> int:
            accepts = name if callable(name) else name.__eq__
            return sum(1 for path in opened if accepts(os.path.basename(path)))

        yield count
    finally:
        _OPENS.pop()
