"""Storage: DCP's filesystem layout, written and read through DCP's StorageWriter/StorageReader.

A checkpoint is a directory: one or more data files per writing rank, ``__<rank>_<save>_<k>.distcp``
(``<save>`` names the save that wrote it, ``<k>`` counts the rank's writer threads), each holding a run
of that rank's records one after another, every record at a multiple of :data:`RECORD_ALIGNMENT` bytes
(see :mod:`reference.checkpoint.records`), and ``.metadata``, the pickled
:class:`~torch.distributed.checkpoint.metadata.Metadata` whose ``storage_data`` maps every chunk and
object to ``(file, offset, length)``. Upstream's reader follows those file names, so each side reads
what the other writes.

Crash safety: ``.metadata`` is the commit point, and it is replaced atomically. A save writes its data
into files no earlier save used, so until its metadata replaces the old one the directory still holds
the previous checkpoint whole; the coordinator publishes (``os.replace`` of a fsynced temporary, then a
fsync of the directory) only after every rank's data is written and fsynced, and only then removes
the data files the new metadata does not name. Killed at any moment, on any rank, a save leaves the
previous checkpoint or the new one, never a mix, and a fresh directory holds nothing that loads.

Concurrent saves to one directory are refused: the coordinator holds an exclusive ``flock`` on
``.lock`` in it from planning to publication. All of this needs the ranks' files on one file system
the coordinator sees (a local one at one node; a shared one, with working ``rename`` and ``flock``,
across nodes).

Removing the files of the earlier save is cleanup, not part of the save: it comes after publication.
Which files to remove is decided at publication, while the save still holds the directory: only
names the new metadata does not reference, all written by earlier saves (every save's names are its
own), so a later save's files are never among them.

The plain path, the classes' methods as they come first, reads and writes on the calling thread, each
file's records one after another, with :func:`reference.checkpoint.records.write_record` and
:func:`~reference.checkpoint.records.load_tensor_record` / :func:`~reference.checkpoint.records.read_tensor_record`
(``torch.save`` and ``torch.load``), and
removes the earlier save's files before the save returns. The fast paths, after it in this module and
run while :func:`reference.checkpoint.fast_paths.enabled` (the default), exist for speed only (why
each: docs/benchmark-results.md, "Why the fast paths"): the data files of a rank written and read
on threads of pools kept between calls, the next chunk on a GPU copied to the host while the current
one is written, records parsed and read in place (:func:`~reference.checkpoint.records.read_region`),
and the removals on a thread of the coordinator, so that no rank waits for them. Both write the
same files: how a rank's items are cut into data files (:func:`_split_by_bytes`) and the records'
alignment are the format, not a fast path.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
import math
import os
import threading
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from reference.checkpoint import fast_paths
from reference.checkpoint.errors import CheckpointError, CheckpointFormatError
from reference.checkpoint.metadata_io import (
    CURRENT_VERSION,
    METADATA_FILE,
    StorageInfo,
    dump_metadata,
    read_metadata_file,
)
from reference.checkpoint.records import (
    ReadableFile,
    TensorLayout,
    load_tensor_record,
    parse_tensor_record,
    read_region,
    read_tensor_record,
    write_record,
)

__all__ = ["FileSystemWriter", "FileSystemReader", "DATA_SUFFIX", "wait_for_removals", "background_write_threads"]

DATA_SUFFIX = ".distcp"
#: The file whose ``flock`` a save holds from planning to publication (see the module docstring).
LOCK_FILE = ".lock"


#: Every record starts at a multiple of this many bytes of its data file (zero bytes between records),
#: whichever path writes it: it is the format. torch.save puts a tensor's bytes at a multiple of 64
#: bytes from the record's start, so they are 64-byte aligned in the file as they are in memory, and
#: the kernel copies them from the page cache into a tensor at full speed; a misaligned read is
#: measurably slower (figures: docs/benchmark-results.md, "Why the fast paths"; DCP's own writer packs
#: records end to end). Readers, DCP's included, read each record at its (offset, length) in the
#: metadata and never see the padding.
RECORD_ALIGNMENT = 64

#: Reader threads of a load, and writer threads (data files per rank) of a save, when none are asked for
#: (bounded by the CPUs per rank of the node): reads from the page cache and writes to it are memory
#: copies, which two or more threads run faster than one (the fast path); more than a few gain nothing.
DEFAULT_READ_THREADS = 4
DEFAULT_WRITE_THREADS = 4
#: A run of records read or written by one thread holds at least this many bytes: below it a thread
#: costs more than it saves.
MIN_RUN_BYTES = 4 << 20


def _cpus_per_local_rank() -> int:
    """The CPUs this process may run on, divided among the ranks of its node (torchrun's
    ``LOCAL_WORLD_SIZE``; 1 when unset): ranks that each start as many readers as the node has CPUs
    slow each other down (figures: docs/benchmark-results.md, "Why the fast paths")."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    return max(1, cpus // local_ranks)


def background_write_threads() -> int:
    """Writer threads of a save written in the background while training goes on: the CPUs per rank of
    this node less one, which the training loop keeps (at least one)."""
    return max(1, min(DEFAULT_WRITE_THREADS, _cpus_per_local_rank() - 1))


def _thread_count(requested: int | None, default: int) -> int:
    if requested is None:
        return min(default, _cpus_per_local_rank())
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"thread_count must be a positive int or None, got {requested!r}")
    return requested


_Entry = TypeVar("_Entry")


def _split_by_bytes(entries: list[_Entry], parts: int, nbytes: Callable[[_Entry], int]) -> list[list[_Entry]]:
    """``entries`` (in order) cut into at most ``parts`` runs of consecutive entries of about equal
    bytes (``nbytes`` of each), each of at least :data:`MIN_RUN_BYTES` unless there is only one; no
    empty run."""
    sizes = [nbytes(entry) for entry in entries]
    total = sum(sizes)
    parts = max(1, min(parts, len(entries), total // MIN_RUN_BYTES))
    if parts == 1:
        return [entries] if entries else []
    runs: list[list[_Entry]] = [[]]
    done = 0
    for entry, size in zip(entries, sizes):
        # Start the next run once this one holds its share (the last run takes what is left).
        if runs[-1] and len(runs) < parts and done >= total * len(runs) / parts:
            runs.append([])
        runs[-1].append(entry)
        done += size
    return runs


def _record_bytes(entry: tuple[ReadItem, StorageInfo]) -> int:
    return entry[1].length


def _write_bytes(item: WriteItem) -> int:
    """The data bytes of a tensor item (0 for a non-tensor value, a few bytes)."""
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every platform opens directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _to_host(value: Any) -> Any:
    """``value``, a tensor on another device copied to a new host tensor that owns exactly its bytes
    (contiguous on CUDA, as the fast path's copies are); anything else as it is."""
    if not isinstance(value, torch.Tensor) or value.device.type == "cpu":
        return value
    if value.device.type != "cuda":
        return value.cpu()
    return torch.empty(value.shape, dtype=value.dtype).copy_(value)


def _remove_files(paths: list[Path]) -> None:
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            warnings.warn(f"{path}: could not remove this file of an earlier save ({exc}); a later save to "
                          f"{path.parent} removes it", RuntimeWarning, stacklevel=1)


def wait_for_removals() -> None:
    """Return once this process has removed the files of every earlier save that its saves replaced
    (the fast path removes them in the background, after each save has returned; the plain path
    before it returns)."""
    _REMOVALS.wait()


class FileSystemWriter(StorageWriter):
    """Writes a checkpoint directory (see the module docstring).

    Calls, as DCP makes them: ``reset`` (all ranks) -> ``set_up_storage_writer`` (all) ->
    ``prepare_local_plan`` (all) -> ``prepare_global_plan`` (coordinator) -> ``write_data`` (all) ->
    ``finish`` (coordinator, after every rank's ``write_data`` succeeded).
    """

    def __init__(
        self, path: str | os.PathLike[str] | None = None, *, sync_files: bool = True, thread_count: int | None = None
    ) -> None:
        super().__init__()
        self._lock_fd: int | None = None  # first: __del__ closes it, also after a failed __init__
        self.path = Path(path) if path is not None else None
        self.sync_files = sync_files
        #: Writer threads per save, each writing its own data file (``None``: up to
        #: :data:`DEFAULT_WRITE_THREADS`, at most the CPUs per rank of this node).
        self.thread_count = _thread_count(thread_count, DEFAULT_WRITE_THREADS)
        self.save_id = str(uuid.uuid4())

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.close()
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def close(self) -> None:
        """Release the save lock if this writer holds it (after ``finish``, or a failed save)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases its flock
            self._lock_fd = None

    def __del__(self) -> None:
        self.close()

    @property
    def _tag(self) -> str:
        """The part of data file names that says which save wrote them."""
        return self.save_id.replace("-", "")[:12]

    def _lock(self) -> None:
        """Take the directory's save lock (coordinator), or raise: one save to a directory at a time."""
        import fcntl

        assert self.path is not None
        lock = self.path / LOCK_FILE
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointError(f"{self.path}: another save to this checkpoint is in progress ({lock} is locked); nothing was written") from None
        self._lock_fd = fd

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.path is None:
            raise ValueError("no checkpoint directory: pass checkpoint_id or a path")
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        assert self.path is not None
        if self.path.exists() and not self.path.is_dir():
            raise CheckpointError(f"{self.path}: exists and is not a directory")
        self.path.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        assert self.path is not None
        # Before any rank writes: this save owns the directory until it publishes or fails. The old
        # metadata stays: it names the old files, which no rank of this save touches.
        self._lock()
        return [dataclasses.replace(plan, storage_data=f"__{rank}_{self._tag}_") for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items as large sequential writes, objects first: the items are cut into up to
        ``thread_count`` runs of consecutive items of about equal bytes (at least :data:`MIN_RUN_BYTES`
        each), and each run is written to a data file of its own, then fsynced. The plain path writes the
        files one after another and raises the first failure; the fast path writes each on a thread of
        its own (writes release the GIL, so they overlap) and raises the error of the first failing run
        once every run has ended."""
        assert self.path is not None
        if not plan.items:
            return _done([])
        ordered = sorted(plan.items, key=lambda item: item.type != WriteItemType.BYTE_IO)
        runs = _split_by_bytes(ordered, self.thread_count, _write_bytes)
        results: list[list[WriteResult]] = [[] for _ in runs]
        calls: list[Callable[[], None]] = [
            functools.partial(self._write_file, f"{plan.storage_data}{k}{DATA_SUFFIX}", run, planner, results[k])
            for k, run in enumerate(runs)
        ]
        if fast_paths.enabled():
            _run_all(calls, self.thread_count)
        else:
            for call in calls:
                call()
        return _done([result for run_results in results for result in run_results])

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner, results: list[WriteResult]) -> None:
        """Write ``items`` to the new data file ``name``, in order, and fsync it; append a result per item.

        Each chunk is resolved only when the one before it has been written (the fast path: while it is
        being written, a chunk on a GPU copied to pinned host memory meanwhile, see
        :func:`_on_host_one_ahead`), so at most two per file are staged at a time."""
        assert self.path is not None
        resolved = (planner.resolve_data(item) for item in items)
        on_host = _on_host_one_ahead(resolved) if fast_paths.enabled() else map(_to_host, resolved)
        with open(self.path / name, "wb") as stream:
            for item, data in zip(items, on_host):
                offset = stream.tell()
                if offset % RECORD_ALIGNMENT:
                    stream.write(bytes(RECORD_ALIGNMENT - offset % RECORD_ALIGNMENT))
                    offset = stream.tell()
                length = write_record(stream, data.getbuffer() if isinstance(data, io.BytesIO) else data)
                results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=StorageInfo(name, offset, length)))
            stream.flush()
            if self.sync_files:
                os.fsync(stream.fileno())

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self.path is not None
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        metadata.storage_meta = self.storage_meta()
        metadata.version = CURRENT_VERSION
        tmp = self.path / f"{METADATA_FILE}.{self._tag}.tmp"
        try:
            with open(tmp, "wb") as stream:
                dump_metadata(metadata, stream)
                stream.flush()
                if self.sync_files:
                    os.fsync(stream.fileno())
            # The commit point: before it the previous checkpoint is whole, after it the new one is.
            os.replace(tmp, self.path / METADATA_FILE)
            if self.sync_files:
                _fsync_dir(self.path)
            stale = self._unreferenced({info.relative_path for info in metadata.storage_data.values()})
            if fast_paths.enabled():
                _REMOVALS.submit(stale)  # on a thread, after the save has returned
            else:
                _remove_files(stale)
        finally:
            self.close()

    def _unreferenced(self, referenced: set[str]) -> list[Path]:
        """The data files and temporary metadata of earlier or failed saves: names of this writer's
        layout that ``referenced`` does not hold (other files in the directory are the user's)."""
        assert self.path is not None
        stale: list[Path] = []
        for entry in self.path.iterdir():
            name = entry.name
            ours = (name.startswith("__") and name.endswith(DATA_SUFFIX)) or (name.startswith(METADATA_FILE + ".") and name.endswith(".tmp"))
            if ours and name not in referenced and entry.is_file():
                stale.append(entry)
        return stale

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return "://" not in str(checkpoint_id)


class FileSystemReader(StorageReader):
    """Reads a checkpoint directory written by this module or by upstream's ``FileSystemWriter``.

    Calls, as DCP makes them: ``reset`` (all ranks) -> ``read_metadata`` (all) ->
    ``set_up_storage_reader`` (all) -> ``prepare_local_plan`` (all) -> ``prepare_global_plan``
    (coordinator) -> ``read_data`` (all).

    ``prepare_local_plan`` checks everything this rank will read before anything is read: every item
    has a storage entry, every file exists and is long enough, every tensor record parses and holds
    the dtype and shape the metadata says. So a missing or truncated file fails the load before the
    state dict is touched.

    The fast path reads the tensor records on ``thread_count`` threads (default: up to 4, at most the
    CPUs this process may use divided by the ranks of its node, torchrun's ``LOCAL_WORLD_SIZE``); a
    file's records are cut into runs of consecutive records, one per thread (see :meth:`read_data`).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, thread_count: int | None = None) -> None:
        super().__init__()
        self.path = Path(path) if path is not None else None
        #: Reader threads per load (``None``: up to :data:`DEFAULT_READ_THREADS`, at most the CPUs per
        #: rank of this node).
        self.thread_count = _thread_count(thread_count, DEFAULT_READ_THREADS)
        self.storage_data: dict[MetadataIndex, Any] = {}
        self._metadata: Metadata | None = None
        self._layouts: dict[MetadataIndex, TensorLayout | None] = {}
        self._cuda_devices: set[torch.device] = set()  #: GPUs that reads of the current read_data copy to

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.storage_data, self._layouts, self._metadata = {}, {}, None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.path is None:
            raise ValueError("no checkpoint directory: pass checkpoint_id or a path")
        return read_metadata_file(self.path)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self._metadata = metadata

    def _geometry_problem(self, index: MetadataIndex, dtype: torch.dtype, size: tuple[int, ...]) -> str | None:
        """What the record's own header says against what the metadata says of that chunk, if they
        disagree. Records carry no CRC32 (see ``records.write_record``): this is what catches a record
        overwritten by another tensor's, or a damaged header that still parses."""
        saved = self._metadata.state_dict_metadata.get(index.fqn) if self._metadata is not None else None
        if not isinstance(saved, TensorStorageMetadata):
            return None
        chunks = saved.chunks
        hinted = chunks[index.index] if index.index is not None and 0 <= index.index < len(chunks) else None
        chunk = hinted if hinted is not None and tuple(hinted.offsets) == tuple(index.offset or ()) else next(
            (c for c in chunks if tuple(c.offsets) == tuple(index.offset or ())), None
        )
        if chunk is None:
            return None
        if tuple(chunk.sizes) != tuple(size) or saved.properties.dtype != dtype:
            return (
                f"the record holds a {dtype} tensor of shape {list(size)}, but the metadata says "
                f"{saved.properties.dtype} of shape {list(chunk.sizes)}"
            )
        return None

    def _info(self, item: ReadItem) -> StorageInfo:
        info = self.storage_data.get(item.storage_index)
        if type(info) is not StorageInfo and (info is None or not all(hasattr(info, f) for f in ("relative_path", "offset", "length"))):
            where = "" if item.storage_index.offset is None else f" (chunk at {list(item.storage_index.offset)})"
            metadata_file = METADATA_FILE if self.path is None else self.path / METADATA_FILE
            raise CheckpointFormatError(
                f"{metadata_file}: key {item.storage_index.fqn!r}{where}: the metadata has no storage record for it"
            )
        return cast(StorageInfo, info)

    def _by_file(self, items: Iterable[ReadItem]) -> dict[str, list[tuple[ReadItem, StorageInfo]]]:
        per_file: dict[str, list[tuple[ReadItem, StorageInfo]]] = {}
        for item in items:
            info = self._info(item)
            if getattr(info, "transform_descriptors", None):
                raise CheckpointFormatError(
                    f"{self.path}/{info.relative_path}: key {item.storage_index.fqn!r} was written with stream "
                    f"transforms {info.transform_descriptors}, which this reader does not support"
                )
            per_file.setdefault(info.relative_path, []).append((item, info))
        for entries in per_file.values():
            entries.sort(key=lambda entry: entry[1].offset)  # sequential reads
        return per_file

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        assert self.path is not None
        for relative_path, entries in self._by_file(plan.items).items():
            path = self.path / relative_path
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise CheckpointFormatError(
                    f"{path}: data file is missing (it holds key {entries[0][0].storage_index.fqn!r}"
                    f"{' and others' if len(entries) > 1 else ''})"
                ) from None
            last_item, last = max(entries, key=lambda entry: entry[1].offset + entry[1].length)
            if size < last.offset + last.length:
                raise CheckpointFormatError(
                    f"{path}: data file is truncated: it has {size} bytes, but key "
                    f"{last_item.storage_index.fqn!r} is stored at bytes {last.offset}..{last.offset + last.length}"
                )
            with open(path, "rb", buffering=0) as file:
                for item, info in entries:
                    if item.type != LoadItemType.TENSOR or item.storage_index in self._layouts:
                        continue
                    where = f"{path}: key {item.storage_index.fqn!r} at bytes {info.offset}..{info.offset + info.length}"
                    if fast_paths.enabled():
                        self._layouts[item.storage_index] = self._check_record_fast(where, file, item, info)
                    else:
                        self._check_record(where, file, item, info)
                        self._layouts[item.storage_index] = None
        return plan

    def _check_record(self, where: str, file: ReadableFile, item: ReadItem, info: StorageInfo) -> None:
        """Check the tensor record of ``item`` before anything is read: ``torch.load(weights_only=True)``
        reads the dtype and geometry of its tensor (onto the meta device: no data bytes are read), which
        must be the metadata's for that chunk. Errors name the file, the key and the record's bytes
        (``where``), worded as :meth:`_read_entries` words a failed read."""
        try:
            saved = load_tensor_record(file, info.offset, info.length, map_location="meta")
        except ValueError as exc:
            raise CheckpointFormatError(f"{where}: {exc}") from None
        except Exception as exc:
            raise CheckpointFormatError(f"{where}: {type(exc).__name__}: {exc}") from exc
        problem = self._geometry_problem(item.storage_index, saved.dtype, tuple(saved.shape))
        if problem is not None:
            raise CheckpointFormatError(f"{where}: corrupt record: {problem}")

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into ``planner``'s targets: each file's items in file order (its
        non-tensor values first, as they were written); a failure raises naming the file and the key.
        The fast path: :meth:`_read_data_fast`."""
        assert self.path is not None
        if fast_paths.enabled():
            return self._read_data_fast(plan, planner)
        for relative_path, entries in self._by_file(plan.items).items():
            self._read_entries(self.path / relative_path, entries, planner)
        return _done(None)

    def _read_entries(self, path: Path, entries: list[tuple[ReadItem, StorageInfo]], planner: LoadPlanner) -> None:
        """Read ``entries`` (in file order) of the file at ``path``; an error names the file and the key."""
        with open(path, "rb", buffering=0) as file:
            for item, info in entries:
                try:
                    self._read_item(file, item, info, planner)
                except CheckpointError as exc:
                    if str(path) in str(exc):
                        raise
                    raise type(exc)(f"{path}: {exc}", failures=exc.failures) from exc
                except Exception as exc:
                    raise CheckpointFormatError(
                        f"{path}: key {item.storage_index.fqn!r} at bytes {info.offset}..{info.offset + info.length}: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc

    def _read_item(self, file: ReadableFile, item: ReadItem, info: StorageInfo, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            file.seek(info.offset)
            data = file.read(info.length)
            if len(data) != info.length:
                raise EOFError(f"expected {info.length} bytes, got {len(data)}")
            planner.load_bytes(item, io.BytesIO(data))
            return
        dest = planner.resolve_tensor(item).detach()
        if tuple(dest.shape) != tuple(item.lengths):  # internal invariant of the planner
            raise AssertionError(f"destination shape {list(dest.shape)} != read lengths {list(item.lengths)}")
        if fast_paths.enabled():
            self._read_region_fast(file, item, info, dest)
        else:
            read_tensor_record(file, info.offset, info.length, tuple(item.storage_offsets), tuple(item.lengths), dest)
        planner.commit_tensor(item, dest)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return "://" not in str(checkpoint_id)

    # -- the reader's fast paths (see the module docstring) --------------------------------------

    def _check_record_fast(self, where: str, file: ReadableFile, item: ReadItem, info: StorageInfo) -> TensorLayout | None:
        """:meth:`_check_record` by :func:`~reference.checkpoint.records.parse_tensor_record` (its zip
        directory and ``data.pkl`` parsed in two small reads); the layout found, for
        :meth:`_read_region_fast`, or None for a record it leaves to ``torch.load`` (checked as it is read)."""
        try:
            layout = parse_tensor_record(file, info.offset, info.length)
            problem = None if layout is None else self._geometry_problem(item.storage_index, layout.dtype, layout.size)
            if problem is not None:
                raise ValueError(f"corrupt record: {problem}")
        except ValueError as exc:
            raise CheckpointFormatError(f"{where}: {exc}") from None
        return layout

    def _read_data_fast(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """:meth:`read_data`, each file's tensor records split into up to ``thread_count`` runs of
        consecutive records of about equal bytes, read by that many threads at once (``readinto``
        releases the GIL, so reads of one file overlap); non-tensor values are read and unpickled on the
        calling thread first. A failure raises the error of the first failing run in file order, after
        every run has ended."""
        assert self.path is not None
        runs: list[tuple[Path, list[tuple[ReadItem, StorageInfo]]]] = []
        for relative_path, entries in self._by_file(plan.items).items():
            path = self.path / relative_path
            objects = [entry for entry in entries if entry[0].type == LoadItemType.BYTE_IO]
            if objects:
                self._read_entries(path, objects, planner)
            tensors = [entry for entry in entries if entry[0].type != LoadItemType.BYTE_IO]
            runs += [(path, run) for run in _split_by_bytes(tensors, self.thread_count, _record_bytes)]
        self._cuda_devices = set()
        try:
            _run_all([functools.partial(self._read_entries, path, run, planner) for path, run in runs], self.thread_count)
        finally:
            # Copies to GPUs that read_region left running, on each device read into (the calling
            # thread's current device need not be the one the rank's tensors are on).
            for device in self._cuda_devices:
                torch.cuda.synchronize(device)
        return _done(None)

    def _read_region_fast(self, file: ReadableFile, item: ReadItem, info: StorageInfo, dest: torch.Tensor) -> None:
        """The read of :meth:`_read_item` by :func:`~reference.checkpoint.records.read_region`: straight
        into ``dest`` where the record's layout allows; a copy to a GPU is left running, and
        :meth:`_read_data_fast` waits for it."""
        if dest.device.type == "cuda":
            self._cuda_devices.add(dest.device)  # set.add is one step under the GIL: safe from reader threads
        read_region(
            file,
            info.offset,
            info.length,
            self._layouts.get(item.storage_index),
            tuple(item.storage_offsets),
            tuple(item.lengths),
            dest,
        )


# == Fast paths =====================================================================================
#
# Everything below exists for speed only (the figures: docs/benchmark-results.md, "Why the fast
# paths") and runs only while fast_paths.enabled(); the classes' methods above call it. Each writes
# the files the plain path writes and reads the values it reads (tests/reference/test_fast_paths.py).


# Reader and writer threads outlive a load or save: starting a thread costs about as much as reading a
# few MB from the page cache (the new thread must be scheduled before ``start`` returns), so a small
# load that started its threads each time would spend a good part of its time on that (figures:
# docs/benchmark-results.md, "Why the fast paths"). One pool per thread count, made on first use. A
# forked child inherits the pools' objects but not their threads, and would wait forever on work no
# thread takes: the child starts with no pools.
_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _forget_pools() -> None:
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def _pool(workers: int) -> ThreadPoolExecutor:
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-io")
        return pool


def _run_all(calls: list[Callable[[], None]], threads: int) -> None:
    """Run ``calls`` on up to ``threads`` threads, the calling thread one of them; return when every
    call has ended, raising the exception of the first that failed in list order.

    Each thread takes the next call not yet taken until none is left, so the calling thread never
    waits while work remains, and concurrent loads sharing a pool cannot starve each other."""
    workers = min(threads, len(calls))
    if workers <= 1:
        for call in calls:
            call()
        return
    failures: list[BaseException | None] = [None] * len(calls)
    taken = itertools.count()  # next() on it is atomic (one C call under the GIL): each index once

    def take_calls() -> None:
        while (index := next(taken)) < len(calls):
            try:
                calls[index]()
            except BaseException as exc:  # re-raised below, in list order, once every call has ended
                failures[index] = exc

    helpers = [_pool(threads - 1).submit(take_calls) for _ in range(workers - 1)]
    take_calls()
    wait(helpers)
    for helper in helpers:
        helper.result()
    for failure in failures:
        if failure is not None:
            raise failure


def _to_host_async(value: Any) -> tuple[Any, Any]:
    """Start copying a device tensor to a new host tensor that owns exactly its bytes; (host value,
    an event to wait for, or None). Anything else is returned as it is."""
    if not isinstance(value, torch.Tensor) or value.device.type == "cpu":
        return value, None
    if value.device.type != "cuda":  # no pinned memory or events of ours for other devices
        return value.cpu(), None
    # On the tensor's own device: a writer thread's current device is cuda:0 whatever the rank's, and
    # the event must be recorded on the stream that runs the copy (that device's current stream).
    with torch.cuda.device(value.device):
        # Pinned, so that the copy is asynchronous; torch's caching host allocator reuses the blocks.
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value, non_blocking=True)
        done = torch.cuda.Event()
        done.record()  # on the current stream of value's device, after the copy
    return host, done


def _on_host_one_ahead(values: Iterable[Any]) -> Iterator[Any]:
    """``values`` with every GPU tensor replaced by a host copy. The copy of the next value is started
    before the current one is handed out, so it runs while the caller writes the current one."""
    upcoming = None
    for value in values:
        started = _to_host_async(value)
        if upcoming is not None:
            yield _wait(upcoming)
        upcoming = started
    if upcoming is not None:
        yield _wait(upcoming)


def _wait(started: tuple[Any, Any]) -> Any:
    value, done = started
    if done is not None:
        done.synchronize()
    return value


class _Removals:
    """Removes the files of earlier saves on one background thread of this process, in the order the
    saves published: freeing an fsynced file's blocks is slow (figures: docs/benchmark-results.md, "Why
    the fast paths"), and every rank would otherwise wait for it at the end of a save over an earlier
    checkpoint. A file already gone is not an error; one that cannot be removed is warned about
    (the save it belonged to was replaced whole, so the checkpoint is unaffected: only space is lost)
    and stays until a later save to the directory removes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[ThreadFuture[None]] = []
        # A child made by fork() has no copy of the thread: it starts with none of its own.
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._executor, self._pending = None, []

    def submit(self, paths: list[Path]) -> None:
        if not paths:
            return
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-removals")
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._executor.submit(_remove_files, paths))

    def wait(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        wait(pending)


_REMOVALS = _Removals()
