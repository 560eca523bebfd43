"""What every checkpoint test shares (``test_checkpoint.py``, section ML; ``test_async_save.py``, section AS;
``async_support.py``, ``checkpoint_stacks_support.py``, ``eval_child.py``): the adapter's checkpoint ops
and the skip of an option it lacks, bit-exact comparison (:func:`exact`, :func:`assert_same_bits`),
DTensors built from a full value, memory measurement (ML-7, AS-5), the save faults of ML-13 and AS-4,
a small sharded state and the proof that it round-trips (ML-13, ML-15), the records of a saved checkpoint
and the damage done to them (ML-14, ML-20), the 2-D mesh (ML-3) and errors alike on every rank
(:func:`fails_alike`, ML-6 to ML-28). The set-up of each section is in a module of its own:
``checkpoint_values_support.py``, ``checkpoint_format_support.py``, ``checkpoint_models_support.py``,
``checkpoint_job_support.py``, ``checkpoint_failing_load_support.py``, ``checkpoint_kill_support.py``
and ``checkpoint_crafted_support.py``. Self-tests: ``tests/test_checkpoint_support.py``."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import pickle
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from conformance.adapters.base import Adapter, Unsupported
from conformance.adapters.checkpoint import CheckpointOps
from conformance.adapters.sharding import hybrid_mesh_shape
from conformance.asserts import (
    assert_local_shard,
    assert_same_error_on_every_rank,
    assert_same_state,
    clause,
    expect_error,
    expected_local_chunk,
    fail,
    raised,
    reraise,
)
from conformance.dcp_files import dcp_directory, read_metadata
from conformance.error_cases import EVERY_RANK, ONE_RANK
from conformance.faults import failing_fsync, failing_writes, is_data_file
from conformance.harness.context import RankContext, per_group_cache

__all__ = [
    "FAULT_ERRNO",
    "SAVE_FAULTS",
    "ExactFloat",
    "exact",
    "assert_same_bits",
    "call_or_skip",
    "dtensor_of",
    "checkpoint_ops",
    "group_of",
    "record_location",
    "in_checkpoint",
    "data_files_of",
    "file_read_by_one_rank",
    "damage",
    "injected_fault",
    "sharded_values",
    "rss_kib",
    "peak_bytes_during",
    "is_same_bits",
    "proves_round_trip",
    "mesh_2d_of",
    "fails_alike",
    "assert_local_shards",
    "assert_round_trips",
    "no_record",
]


#: Faults that make a save fail after planning succeeded: the disk fills up before any data, or after
#: a few bytes of it (ENOSPC), every fsync fails (EIO), or the file system is read-only (EROFS), on the last
#: rank only or on every rank.
SAVE_FAULTS = ("full-disk-before-data", "full-disk-mid-data", "fsync-fails", "read-only")
#: The operating system's error each save fault is: what an error that reports it carries (AS-4.f).
FAULT_ERRNO = {"full-disk-before-data": errno.ENOSPC, "full-disk-mid-data": errno.ENOSPC, "fsync-fails": errno.EIO,
               "read-only": errno.EROFS}
_T = TypeVar("_T")

#: Elements of the float32 tensor ``b`` of the bad-checkpoint tests: 16 KiB, a record larger than the few
#: KiB a reader may read of its start and of its end to parse it.
BIG_RECORD_ELEMENTS = 4096
#: The signatures of a zip central-directory entry and of a local file header (PKWARE APPNOTE 4.3.12,
#: 4.3.7), which the damaged-record cases zero.
ZIP_CENTRAL_ENTRY, ZIP_LOCAL_HEADER = b"PK\x01\x02", b"PK\x03\x04"
#: The bad-checkpoint cases of a tensor record damaged in place (:func:`damage`).
DAMAGED_RECORDS = ("damaged-directory", "damaged-header")


def checkpoint_ops(impl: Adapter) -> CheckpointOps:
    return impl.require("checkpoint")


def call_or_skip(fn: Callable[[], Any]) -> Any:
    """Run an ops call; an option the implementation lacks is a skip naming it."""
    try:
        return fn()
    except Unsupported as exc:
        pytest.skip(str(exc))


def group_of(dist: RankContext) -> Any:
    return dist.group


@dataclass(frozen=True)
class ExactFloat:
    """A Python float compared by its bits: ``-0.0`` is not ``0.0`` and a NaN's payload counts (``==``
    says otherwise, so :func:`assert_same_state` alone would miss a loader that canonicalises them)."""

    bits: int

    def __repr__(self) -> str:
        return f"{struct.unpack('<d', struct.pack('<Q', self.bits))[0]!r} (bits {self.bits:#018x})"


def exact(value: Any) -> Any:
    """``value`` with every Python float replaced by its :class:`ExactFloat` (containers rebuilt, tensors
    and other leaves as they are): compare the results with :func:`assert_same_state`."""
    if type(value) is float:
        return ExactFloat(struct.unpack("<Q", struct.pack("<d", value))[0])
    if isinstance(value, Mapping):
        return {k: exact(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(exact(v) for v in value)
    return value


def assert_same_bits(got: Any, expected: Any, *, what: str = "loaded state", check_order: bool = True) -> None:
    """Nested state equal bit for bit: tensors (DTensors by placements, global shape and local shard),
    non-tensor values of the same type, Python floats by their bits."""
    __tracebackhide__ = True
    assert_same_state(exact(got), exact(expected), what=what, check_order=check_order)


def dtensor_of(full: torch.Tensor, mesh: Any, placements: list[Any]) -> DTensor:
    """A DTensor of ``full`` on ``mesh``, built from this rank's documented piece without any
    collective (so every dtype works on gloo); ``full`` on meta gives a meta DTensor."""
    coordinate = mesh.get_coordinate()
    piece, _ = expected_local_chunk(full, placements, tuple(mesh.shape), tuple(coordinate))
    return DTensor.from_local(piece.clone(), mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _release_free_memory() -> None:
    """Return the C allocator's free pages to the system (glibc's ``malloc_trim``): memory an earlier test of
    this rank process freed but the allocator kept would otherwise serve ``fn``'s allocations without
    raising the RSS, so a loader that copies every record would seem to allocate nothing."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the measure is as good as the allocator lets it be
        pass


def peak_bytes_during(device: torch.device, fn: Callable[[], Any]) -> tuple[int, str]:
    """Bytes by which ``fn`` raised the peak memory of ``device`` above what was in use before it,
    and what was measured: the CUDA caching allocator's peak on a GPU (host memory does not grow when
    tensors are built there), the process's peak RSS (VmHWM, reset first) on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - baseline, f"peak CUDA memory of {device}"
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("peak RSS is measured through Linux's /proc/self/clear_refs and VmHWM")
    gc.collect()
    _release_free_memory()
    baseline = rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    fn()
    return (rss_kib("VmHWM") - baseline) * 1024, "peak RSS"


def injected_fault(dist: RankContext, path: Path, fault: str, where: str) -> contextlib.AbstractContextManager[None]:
    """The save fault ``fault`` (:data:`SAVE_FAULTS`) where ``where`` puts it: on every rank, or on the
    last rank only (``"one-rank"``, and ``"last-rank"`` as test_async_save.py spells it)."""
    if where in (ONE_RANK, "last-rank") and dist.rank != dist.world_size - 1:
        return contextlib.nullcontext()
    code = FAULT_ERRNO[fault]
    if fault == "fsync-fails":
        return failing_fsync(code)
    if fault == "read-only":  # every file of the directory, metadata too (root ignores chmod, so it is injected)
        return failing_writes(path, code=code, which=lambda name: True, at_open=True)
    return failing_writes(path, after_bytes=0 if fault == "full-disk-before-data" else 64, code=code)


def sharded_values(dist: RankContext, fill: float) -> dict[str, Any]:
    """A state dict every rank writes a part of (a sharded DTensor, 4 rows per rank) and a replicated value."""
    full = torch.arange(4 * dist.world_size * 3, dtype=torch.float32).reshape(-1, 3) + fill
    return {"w": dtensor_of(full, dist.mesh(), [Shard(0)]), "step": int(fill)}


def proves_round_trip(dist: RankContext, impl: Adapter) -> None:
    """:func:`sharded_values` saved and loaded back whole, on every rank: run first by a test whose
    verdict is about how a save or load *fails* (errors alike on every rank, nothing changed), so that
    an implementation whose every call fails fails that test too instead of passing it."""
    __tracebackhide__ = True
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "unharmed"
    ops.save(sharded_values(dist, 8.0), path, process_group=group_of(dist))
    target = sharded_values(dist, -1.0)
    ops.load(target, path, process_group=group_of(dist))
    assert_same_bits(target, sharded_values(dist, 8.0), what=f"a save and load with nothing wrong (rank {dist.rank})")


def no_record(path: Path, fqn: str, offset: tuple[int, ...] | None = None) -> NoReturn:
    """A test that places a fault in the record of ``fqn`` finds none in DCP's metadata: a skip, since
    the stack keeps that value elsewhere (megatron-core: non-tensor values in its common state), so the
    fault this test is about cannot be placed; the stack's own format would need its own test."""
    # The checkpoint is named, not its temporary directory: reports group skips by their reason.
    pytest.skip(f"the checkpoint {path.name!r} has no DCP record of {fqn!r}" + (f" at {offset}" if offset else "")
                + " to place the fault in (the stack keeps it outside DCP's records)")


def in_checkpoint(path: Path, name: str, base: Path | None = None) -> str:
    """The data file ``name`` of DCP's metadata as a path relative to the checkpoint directory ``path``
    (the two differ where the stack keeps each save in a folder of its own); ``base``: the
    :func:`dcp_directory` of ``path``, when the caller has it already (finding it may walk the directory)."""
    return str(((base or dcp_directory(path)) / name).relative_to(path))


def data_files_of(path: Path) -> Callable[[str], bool]:
    """Which file names of the checkpoint at ``path`` are its data files: those DCP's metadata points
    records at, where it has DCP's files (a stack's own metadata, megatron-core's ``metadata.json``, is
    not data), else every file but DCP's metadata and lock (:func:`conformance.faults.is_data_file`)."""
    try:
        names = {Path(info.relative_path).name for info in read_metadata(path).storage_data.values()}
    except Exception:  # noqa: BLE001 - no DCP metadata to read: the stack's own format
        return is_data_file
    return names.__contains__


def record_location(path: Path, fqn: str, offset: tuple[int, ...] | None = None) -> tuple[str, int, int]:
    """(file relative to ``path``, byte offset, length) of the stored record of ``fqn`` (the chunk at ``offset``)."""
    for index, info in read_metadata(path).storage_data.items():
        if index.fqn == fqn and (offset is None or tuple(index.offset) == offset):
            return in_checkpoint(path, info.relative_path), info.offset, info.length
    no_record(path, fqn, offset)


def file_read_by_one_rank(dist: RankContext, path: Path) -> tuple[str, int, int]:
    """(file, byte offset, length) of the record of one rank's shard of ``w`` in a data file that holds
    nothing else: with ``w`` loaded into the same layout, only that rank reads the file. The last
    such rank's (where replicated ``b`` went depends on the implementation's deduplication)."""

    records, base = read_metadata(path).storage_data, dcp_directory(path)
    files = {index: in_checkpoint(path, info.relative_path, base) for index, info in records.items()}
    for rank in reversed(range(dist.world_size)):
        name, offset, length = record_location(path, "w", (4 * rank, 0))
        if [(i.fqn, tuple(i.offset or ())) for i in records if files[i] == name] == [("w", (4 * rank, 0))]:
            return name, offset, length
    listing = sorted((info.relative_path, i.fqn, tuple(i.offset or ())) for i, info in records.items())
    fail("test set-up: no data file holds one rank's shard alone", listing, "a file holding only one shard of 'w'", str(path))
    raise AssertionError  # unreachable: fail() raises


def damage(dist: RankContext, path: Path, case: str, where: str) -> str:
    """Damage the checkpoint at ``path`` (call on rank 0); returns what the error must name.

    Data files: for ``every-rank`` the file holding ``b``, which every rank reads; for ``one-rank`` a
    file holding one rank's shard of ``w`` and nothing else, which only that rank reads.
    A truncation cuts that record in half. A damaged record keeps its length and every byte but one:
    the signature of its last zip central-directory entry (``damaged-directory``) or of its storage
    member's local header (``damaged-header``) is zeroed (torch.save's archive; DCP writes each tensor
    so), so the record no longer is the archive it was, while the load read the intact record, of the
    same length, before (a parse kept for such a record must not stand for this one)."""
    meta = dcp_directory(path) / ".metadata"
    if case in ("missing-data-file", "truncated-data-file", *DAMAGED_RECORDS):
        if where == EVERY_RANK:
            name, offset, length = record_location(path, "b")
        else:
            name, offset, length = file_read_by_one_rank(dist, path)
        data = path / name
        if case == "missing-data-file":
            data.unlink()
        elif case == "truncated-data-file":
            with open(data, "r+b") as f:
                f.truncate(offset + length // 2)
        else:
            with open(data, "r+b") as f:
                f.seek(offset)
                record = f.read(length)
                at = _signature_to_damage(record, case)
                if at is None:
                    pytest.skip(f"the record at {name}:{offset} is not a torch.save archive (no zip entry of its storage): "
                                "its in-place damage is defined for DCP's tensor records")
                f.seek(offset + at)
                f.write(b"\0")
        return name
    if case == "swapped-records":
        return _swap_b_with_a_shard(path)
    if case == "record-not-in-metadata":
        # A metadata that lists b's chunk but not where its bytes are (one rank's write results lost
        # between the writes and the publication, a metadata edited by hand): nothing says where to read.
        def drop_b(metadata: Any) -> None:
            metadata.storage_data = {index: info for index, info in metadata.storage_data.items() if index.fqn != "b"}

        _edit_metadata(meta, drop_b)
        return ".metadata"
    if case == "missing-metadata":
        meta.unlink()
        return ".metadata"
    if case == "corrupt-metadata":
        meta.write_bytes(meta.read_bytes()[:40] + b"\x00garbage")
        return ".metadata"
    if case == "not-metadata":
        # A readable pickle of something else (a file copied over it, another tool's index): only a
        # check of what was unpickled tells it from the checkpoint's metadata.
        meta.write_bytes(pickle.dumps({"version": "1.0.0", "state_dict_metadata": {}}))
        return ".metadata"
    if case == "unknown-version":
        _edit_metadata(meta, lambda metadata: setattr(metadata, "version", "99.0.0"))
        return "99.0.0"
    if case == "no-storage-data":
        # DCP's Metadata as a writer that never set where the data lies leaves it: storage_data=None.
        _edit_metadata(meta, lambda metadata: setattr(metadata, "storage_data", None))
        return ".metadata"
    raise ValueError(case)


def bad_checkpoint_b(case: str, where: str) -> torch.Tensor:
    """The replicated tensor ``b`` of the bad-checkpoint test of ``case``: 16 KiB where a record damaged in
    place is ``b``'s (a reader that reads a big record's first and last bytes apart meets it; a shard of
    ``w`` is a small record, read whole), a 3 x 4 tensor where ``b``'s record is swapped with a 4 x 3
    shard's (the same bytes, another shape), and small otherwise (where a stack balances replicated
    records by size, a big ``b`` moves)."""
    if case in DAMAGED_RECORDS and where == EVERY_RANK:
        return torch.arange(BIG_RECORD_ELEMENTS, dtype=torch.float32)
    if case == "swapped-records":
        return torch.arange(12, dtype=torch.float32).reshape(3, 4) - 5.5
    return torch.arange(5, dtype=torch.float32)


def _swap_b_with_a_shard(path: Path) -> str:
    """Point the metadata's record of ``b`` at the record of the shard of ``w`` in the same data file, and
    that shard's at ``b``'s: each record parses, but holds the other tensor (a metadata written for
    another save, a record overwritten by another's). Returns the data file."""
    def swap(metadata: Any) -> str:
        records = metadata.storage_data
        b = next((index for index in records if index.fqn == "b"), None)
        shard = next((index for index in records if b is not None and index.fqn == "w"
                      and records[index].relative_path == records[b].relative_path), None)
        if b is None or shard is None or records[b].length != records[shard].length:
            pytest.skip("the implementation stored b and a shard of w in different files, or in records of "
                        "different lengths: no two records to swap")
        records[b], records[shard] = records[shard], records[b]
        return str(records[shard].relative_path)

    return in_checkpoint(path, _edit_metadata(dcp_directory(path) / ".metadata", swap))


def _edit_metadata(meta: Path, edit: Callable[[Any], _T]) -> _T:
    """Rewrite the checkpoint metadata file ``meta`` as ``edit`` changes its unpickled ``Metadata`` (our
    own file, written a moment ago); ``edit``'s value. A skip or error in ``edit`` leaves the file as it was."""
    with open(meta, "rb") as f:
        metadata = pickle.load(f)
    result = edit(metadata)
    with open(meta, "wb") as f:
        pickle.dump(metadata, f)
    return result


def _signature_to_damage(record: bytes, case: str) -> int | None:
    """Where in ``record`` the signature that ``case`` zeroes starts: its last central-directory entry's,
    or the local header's of its storage member (``.../data/<key>``); None if it has none."""
    if case == "damaged-directory":
        at = record.rfind(ZIP_CENTRAL_ENTRY)
        return at if at >= 0 else None
    at = record.find(ZIP_LOCAL_HEADER)
    while at >= 0:
        name_length = struct.unpack_from("<H", record, at + 26)[0] if at + 30 <= len(record) else 0
        if b"/data/" in record[at + 30:at + 30 + name_length]:
            return at
        at = record.find(ZIP_LOCAL_HEADER, at + 1)
    return None


def is_same_bits(got: Any, expected: Any) -> bool:
    """Whether :func:`assert_same_bits` holds (for trying several candidates)."""
    try:
        assert_same_bits(got, expected)
    except pytest.fail.Exception:
        return False
    return True


# -- meshes, and errors alike on every rank -------------------------------------------------------------------


#: 2-D meshes by world size: building one creates process groups (collectively), so each rank builds
#: it once per default group and its tests reuse it.
_MESHES_2D: dict[int, Any] = per_group_cache()


def mesh_2d_of(dist: RankContext) -> Any:
    """The 2-D mesh of HYBRID_SHARD's shape: (2, world_size / 2), (1, world_size) at odd world sizes,
    and under torchrun (nodes, ranks per node) when the world fills whole nodes."""
    if dist.world_size not in _MESHES_2D:
        _MESHES_2D[dist.world_size] = dist.mesh(*hybrid_mesh_shape(dist.world_size))
    return _MESHES_2D[dist.world_size]


def fails_alike(dist: RankContext, fn: Callable[[], Any], *, keys: tuple[str, ...] = (), needles: tuple[str, ...] = (),
                 what: str, agreed: str | None = None, named: str | None = None) -> BaseException:
    """``fn()`` raises on this rank (any type: ML-15 checks the type), naming every key of ``keys``
    whole and containing every string of ``needles``; then every rank compares what it raised: the
    same type and message everywhere (a rank that returned fails the test on every rank). ``agreed``
    and ``named`` are the SPEC clauses of the two checks, where a requirement letters them apart."""
    exc = raised(lambda: call_or_skip(fn))
    with clause(agreed) if agreed else contextlib.nullcontext():
        assert_same_error_on_every_rank(dist, exc, what=what)
    assert exc is not None  # assert_same_error_on_every_rank fails when any rank returned
    with clause(named) if named else contextlib.nullcontext():
        return expect_error(lambda: reraise(exc), BaseException, keys=keys, needles=needles, what=what,
                            where=f"rank {dist.rank} of {dist.world_size}")


def _at(state: Any, path: tuple[Any, ...]) -> Any:
    for item in path:
        state = state[item]
    return state


def assert_local_shards(dist: RankContext, got: Any, fulls: dict[tuple[Any, ...], torch.Tensor], *, what: str) -> None:
    """Per-rank truth: every DTensor of ``got`` at a path of ``fulls`` holds, on this rank, exactly the
    piece of that full value that the documented layout (``torch.chunk`` per sharded mesh dim) gives
    this rank, empty shards included; no rank gathers anything."""
    __tracebackhide__ = True
    for path, full in fulls.items():
        assert_local_shard(_at(got, path), full, what=f"{what} {'.'.join(map(str, path))}",
                           where=f"rank {dist.rank} of {dist.world_size}")


def assert_round_trips(dist: RankContext, impl: Adapter, state: Callable[[float], tuple[Any, dict[tuple[Any, ...], torch.Tensor]]],
                       saved: float, target: float, *, what: str) -> None:
    """``state(saved)`` (a state dict and the full value of each DTensor in it, by path) saved, then
    loaded into ``state(target)``, whose every value differs: each DTensor's local shard is its
    documented piece on this rank, and the whole is ``state(saved)`` bit for bit."""
    __tracebackhide__ = True
    ops, path = checkpoint_ops(impl), dist.tmp_dir / "ckpt"
    values, fulls = state(saved)
    ops.save(values, path, process_group=group_of(dist))
    loaded, _ = state(target)
    call_or_skip(lambda: ops.load(loaded, path, process_group=group_of(dist)))
    assert_local_shards(dist, loaded, fulls, what=what)
    assert_same_bits(loaded, state(saved)[0], what=f"{what} (rank {dist.rank})")
