"""Records: how one saved value sits in a data file.

A data file is a sequence of records, one per saved chunk or object, each addressed by
``(file, offset, length)`` in the metadata. As in DCP's filesystem layout, a record is exactly the
bytes ``torch.save`` writes for the value (a small zip archive: ``data.pkl`` describing the tensor,
``data/<key>`` holding the raw storage bytes, uncompressed), so upstream's reader, which calls
``torch.load`` on each record, reads ours.

Reading goes around ``torch.load`` on the hot path: :func:`parse_tensor_record` finds, from the
record's zip directory and its small ``data.pkl`` (parsed with ``struct``: two small reads per
record), where the raw bytes start and how they are laid out, and :func:`read_region` reads the bytes of a wanted region straight into the destination tensor
(no intermediate tensor, no second copy) when both sides are contiguous. Everything else (a layout
not understood, a big-endian file, a strided region) falls back to ``torch.load(weights_only=True)``
or to one temporary of the record's size: slower, never wrong. ``data.pkl`` is parsed by an
allow-list unpickler that accepts only the tensor-rebuild call, so reading never runs code from the file.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import math
import os
import pickle
import struct
import sys
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import torch

__all__ = ["TensorLayout", "write_record", "parse_tensor_record", "read_region", "FileWindow"]


class ReadableFile(Protocol):
    """What the readers here need of an open data file (``open(path, "rb", buffering=0)`` has it)."""

    def seek(self, offset: int, whence: int = ..., /) -> int: ...
    def read(self, size: int = ..., /) -> bytes: ...
    def readinto(self, buffer: Any, /) -> int | None: ...


class FileWindow(io.RawIOBase):
    """A read-only, seekable view of bytes ``[offset, offset + length)`` of an open file."""

    def __init__(self, file: ReadableFile, offset: int, length: int) -> None:
        super().__init__()
        self._file, self._start, self._length, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        if n == 0:
            return 0
        self._file.seek(self._start + self._pos)
        got = self._file.readinto(view[:n]) or 0
        self._pos += got
        return got


@contextlib.contextmanager
def _without_crc32() -> Iterator[None]:
    # torch.save computes a CRC32 of every member by default, which costs more than writing the bytes
    # (measured here: 445 vs 1,050 MB/s for a 64 MB tensor). Nothing reads it back: this reader parses
    # the zip structure with struct, and torch's reader does not verify it. What catches a damaged
    # record instead: the structure checks of parse_tensor_record and the record's geometry checked
    # against the checkpoint metadata (FileSystemReader).
    set_crc32 = getattr(torch.serialization, "set_crc32_options", None)  # torch >= 2.5
    if set_crc32 is None:
        yield
        return
    before = torch.serialization.get_crc32_options()
    set_crc32(False)
    try:
        yield
    finally:
        set_crc32(before)


def write_record(stream: BinaryIO, value: torch.Tensor | bytes | memoryview) -> int:
    """Append one record at the stream's position and return its length in bytes.

    ``value`` is the CPU tensor to save (it must own exactly its bytes: ``torch.save`` writes a view's
    whole storage) or the already serialized bytes of an object. Tensor records carry no CRC32s
    (``torch.load`` reads them; see :func:`_without_crc32`)."""
    start = stream.tell()
    if isinstance(value, torch.Tensor):
        with _without_crc32():
            torch.save(value, stream)
    else:
        stream.write(value)
    return stream.tell() - start


@dataclass(frozen=True)
class TensorLayout:
    """Where the raw bytes of a saved tensor are, and how its elements map onto them."""

    data_offset: int  #: absolute byte offset, in the data file, of element 0 of the storage
    dtype: torch.dtype
    storage_numel: int  #: elements in the saved storage
    storage_offset: int  #: elements between the storage start and the tensor's first element
    size: tuple[int, ...]
    stride: tuple[int, ...]  #: in elements


# -- data.pkl: the allow-list unpickler ---------------------------------------------------------


class _NotUnderstood(Exception):
    """The record is not a plain tensor in the layout parsed here; use torch.load instead."""


@dataclass(frozen=True)
class _StorageRef:
    dtype: torch.dtype
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorHeader:
    storage: _StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


_STORAGE_DTYPES: dict[str, torch.dtype] = {}


def _storage_dtype(name: str) -> torch.dtype | None:
    if not _STORAGE_DTYPES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TypedStorage.dtype warns that TypedStorage is deprecated
            for attr in dir(torch):
                cls = getattr(torch, attr)
                if attr.endswith("Storage") and isinstance(cls, type) and issubclass(cls, torch.TypedStorage):
                    try:
                        _STORAGE_DTYPES[attr] = cls.dtype
                    except Exception:  # the generic TypedStorage has no dtype
                        pass
    return _STORAGE_DTYPES.get(name)


def _rebuild_tensor(storage: Any, storage_offset: int, size: Any, stride: Any, *_: Any) -> _TensorHeader:
    if not isinstance(storage, _StorageRef):
        raise _NotUnderstood("tensor storage is not a persistent storage reference")
    return _TensorHeader(storage, int(storage_offset), tuple(size), tuple(stride))


class _HeaderUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and _storage_dtype(name) is not None:
            return name
        raise _NotUnderstood(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _NotUnderstood(f"persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        dtype = _storage_dtype(storage_type) if isinstance(storage_type, str) else None
        if dtype is None:
            raise _NotUnderstood(f"storage type {storage_type!r}")
        return _StorageRef(dtype, str(key), int(numel))


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles values built from pickle's own types only (numbers, strings, None, bools, lists,
    tuples, dicts): it refuses every global and persistent id, so it can construct nothing else and
    run no code."""

    def find_class(self, module: str, name: str) -> Any:
        raise _NotUnderstood(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _NotUnderstood(f"persistent id {pid!r}")


# -- the record's zip structure, parsed with struct ------------------------------------------------
#
# A record is a whole zip archive (written by torch.save through miniz). Planning a load needs, per
# record, the central directory (where each member is), data.pkl (the tensor's geometry) and the
# local header of the storage member (where its bytes start). Those sit in the record's first and
# last few hundred bytes, so two reads per record suffice; Python's zipfile would read and verify
# more, and it refuses records saved without CRC32s (see write_record), which torch itself reads.

_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory record
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_ZIP64_EOCD = struct.Struct("<4sQHHIIQQQQ")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory file header
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # local file header
_TAIL_READ = 4096  # bytes read from a record's end: EOCD + central directory of a tensor record
_HEAD_READ = 4096  # bytes read from its start: data.pkl and the small members before the storage


@dataclass(frozen=True)
class _Member:
    name: str  #: without the archive's top-level folder ("data.pkl", "data/0")
    method: int  #: 0: stored (uncompressed)
    size: int  #: uncompressed bytes
    compressed_size: int
    header_offset: int  #: of its local header, from the record's start


def _read_at(file: ReadableFile, position: int, n: int) -> bytes:
    """Up to ``n`` bytes at ``position`` (fewer at the end of the file)."""
    try:
        fd = file.fileno()  # type: ignore[attr-defined]  # files have one; ReadableFile does not promise it
    except (AttributeError, OSError):  # io.UnsupportedOperation is an OSError: an in-memory file
        file.seek(position)
        return file.read(n)
    return os.pread(fd, n, position)  # one system call instead of a seek and a read


def _zip64_extra(extra: bytes, size: int, csize: int, offset: int) -> tuple[int, int, int]:
    """Replace the 0xFFFFFFFF fields of a central header by the values of its zip64 extra field."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:
            values = iter(struct.unpack_from(f"<{n // 8}Q", extra, pos + 4))
            size = next(values) if size == 0xFFFFFFFF else size
            csize = next(values) if csize == 0xFFFFFFFF else csize
            offset = next(values) if offset == 0xFFFFFFFF else offset
            break
        pos += 4 + n
    return size, csize, offset


# Records of one shape and dtype end in the same bytes (member offsets are relative to the record's
# start; torch.save writes no names or times of its own), so the parse of a tail and of a data.pkl is
# kept for the next record that has the same bytes: a checkpoint of a model has a handful of distinct
# ones among hundreds of records. Only successful parses are kept (an error is raised again from the
# bytes), and the parse depends on nothing but the bytes and the record's length.
_PARSE_CACHE_LIMIT = 256
_MEMBERS_CACHE: dict[tuple[bytes, int], dict[str, _Member]] = {}
_HEADER_CACHE: dict[bytes, Any] = {}


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= _PARSE_CACHE_LIMIT:
        cache.clear()
    cache[key] = value


def _members(file: ReadableFile, offset: int, length: int) -> dict[str, _Member]:
    """The record's members by name (the archive folder stripped); ValueError if it is not a zip."""
    tail_start = max(0, length - _TAIL_READ)
    tail = _read_at(file, offset + tail_start, length - tail_start)
    directory, count, key_start = _directory(file, offset, length, tail, tail_start)
    if key_start is None:  # bytes outside the tail were read: the tail's bytes are not the whole key
        return _parse_directory(directory, count)
    key = (tail[key_start:], length)
    members = _MEMBERS_CACHE.get(key)
    if members is None:
        members = _parse_directory(directory, count)
        _remember(_MEMBERS_CACHE, key, members)
    return members


def _directory(file: ReadableFile, offset: int, length: int, tail: bytes, tail_start: int) -> tuple[bytes, int, int | None]:
    """(the central directory's bytes, its entry count, where in ``tail`` the bytes it was found from
    start, or None when some were read from outside ``tail``)."""
    eocd_at = tail.rfind(b"PK\x05\x06")
    if eocd_at < 0 or eocd_at + _EOCD.size > len(tail):
        raise ValueError("not a torch.save record (no zip end-of-directory record)")
    _, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, eocd_at)
    key_start: int | None = eocd_at
    if 0xFFFFFFFF in (cd_size, cd_offset) or count == 0xFFFF:
        locator_at = eocd_at - _ZIP64_LOCATOR.size
        if locator_at < 0 or tail[locator_at:locator_at + 4] != b"PK\x06\x07":
            raise ValueError("corrupt torch.save record (no zip64 locator)")
        z64_offset = _ZIP64_LOCATOR.unpack_from(tail, locator_at)[2]
        if tail_start <= z64_offset <= length - _ZIP64_EOCD.size:
            z64 = tail[z64_offset - tail_start:z64_offset - tail_start + _ZIP64_EOCD.size]
            key_start = z64_offset - tail_start
        else:
            z64 = _read_at(file, offset + z64_offset, _ZIP64_EOCD.size)
            key_start = None
        if len(z64) != _ZIP64_EOCD.size or z64[:4] != b"PK\x06\x06":
            raise ValueError("corrupt torch.save record (bad zip64 end-of-directory record)")
        _, _, _, _, _, _, _, count, cd_size, cd_offset = _ZIP64_EOCD.unpack(z64)
    if cd_offset + cd_size > length:
        raise ValueError("truncated torch.save record (central directory beyond its end)")
    if cd_offset >= tail_start:
        directory = tail[cd_offset - tail_start:cd_offset - tail_start + cd_size]
        if key_start is not None:
            key_start = min(key_start, cd_offset - tail_start)
    else:
        directory = _read_at(file, offset + cd_offset, cd_size)
        key_start = None
    return directory, count, key_start


def _parse_directory(directory: bytes, count: int) -> dict[str, _Member]:
    members: dict[str, _Member] = {}
    pos = 0
    for _ in range(count):
        if pos + _CENTRAL.size > len(directory) or directory[pos:pos + 4] != b"PK\x01\x02":
            raise ValueError("corrupt torch.save record (bad central directory)")
        fields = _CENTRAL.unpack_from(directory, pos)
        method, csize, size, name_len, extra_len, comment_len, header_offset = (
            fields[4], fields[8], fields[9], fields[10], fields[11], fields[12], fields[16])
        name_end = pos + _CENTRAL.size + name_len
        name = directory[pos + _CENTRAL.size:name_end].decode("utf-8", "replace")
        size, csize, header_offset = _zip64_extra(directory[name_end:name_end + extra_len], size, csize, header_offset)
        short = name.split("/", 1)[-1]
        members[short] = _Member(short, method, size, csize, header_offset)
        pos = name_end + extra_len + comment_len
    return members


def _member_data_start(file: ReadableFile, offset: int, length: int, member: _Member, head: bytes) -> int:
    """Where the member's bytes start, from the record's start, checked against its local header."""
    local = head[member.header_offset:member.header_offset + _LOCAL.size]
    if len(local) != _LOCAL.size:
        local = _read_at(file, offset + member.header_offset, _LOCAL.size)
    if len(local) != _LOCAL.size or local[:4] != b"PK\x03\x04":
        raise ValueError(f"corrupt torch.save record (bad local header of {member.name})")
    name_len, extra_len = _LOCAL.unpack(local)[9:11]
    start: int = member.header_offset + _LOCAL.size + name_len + extra_len
    if start + member.compressed_size > length:
        raise ValueError(f"truncated torch.save record ({member.name} runs past its end)")
    return start


def _member_bytes(file: ReadableFile, offset: int, length: int, member: _Member, head: bytes) -> bytes:
    if member.method != zipfile.ZIP_STORED:
        raise _NotUnderstood(f"{member.name} is compressed")
    start = _member_data_start(file, offset, length, member, head)
    data = head[start:start + member.size]
    if len(data) != member.size:
        data = _read_at(file, offset + start, member.size)
    if len(data) != member.size:
        raise ValueError(f"truncated torch.save record ({member.name})")
    return data


def parse_tensor_record(file: ReadableFile, offset: int, length: int) -> TensorLayout | None:
    """The layout of the tensor record at ``[offset, offset + length)`` of ``file``, or None when the
    record is not a little-endian plain tensor with one uncompressed storage (read it with torch.load).

    Raises ValueError if the record is not a zip archive at all (a corrupt or overwritten file), or its
    zip structure is damaged or runs past ``length`` (a truncated record)."""
    head = _read_at(file, offset, min(length, _HEAD_READ))
    # A small record (a scalar, a bias) is whole in hand: parse it from memory, not with more reads.
    source, at = (io.BytesIO(head), 0) if len(head) == length else (file, offset)
    members = _members(source, at, length)
    if "data.pkl" not in members:
        raise ValueError("not a torch.save record (no data.pkl)")
    try:
        if "byteorder" in members and _member_bytes(source, at, length, members["byteorder"], head).decode() != sys.byteorder:
            return None
        pickled = _member_bytes(source, at, length, members["data.pkl"], head)
        header = _HEADER_CACHE.get(pickled)
        if header is None:
            header = _HeaderUnpickler(io.BytesIO(pickled)).load()
            _remember(_HEADER_CACHE, pickled, header)
    except _NotUnderstood:
        return None
    except ValueError:
        raise
    except Exception as exc:  # whatever a damaged pickle makes the unpickler raise
        raise ValueError(f"corrupt torch.save record (data.pkl: {type(exc).__name__}: {exc})") from None
    if not isinstance(header, _TensorHeader):
        return None
    member = members.get(f"data/{header.storage.key}")
    itemsize = header.storage.dtype.itemsize
    if member is None or member.method != zipfile.ZIP_STORED or member.size != header.storage.numel * itemsize:
        return None
    data_start = _member_data_start(source, at, length, member, head)
    return TensorLayout(
        data_offset=offset + data_start,
        dtype=header.storage.dtype,
        storage_numel=header.storage.numel,
        storage_offset=header.storage_offset,
        size=header.size,
        stride=header.stride,
    )


def read_object_record(data: bytes | memoryview) -> Any:
    """The value of a non-tensor record (``torch.save`` of an object, DCP's encoding of non-tensor
    values), as ``torch.load(data, weights_only=True)`` returns it.

    A value made of pickle's own types (a learning rate, ``betas``, a step count, a string) is
    unpickled straight from the record's ``data.pkl`` by :class:`_PlainUnpickler`: a checkpoint holds
    one record per such value (every ``param_groups`` entry is one), and ``torch.load`` costs about
    80 us each, mostly in setting up its zip reader. Anything else (tensors, ``torch.Size``, a set, a
    damaged record) goes to ``torch.load(weights_only=True)``, whose result or error is the answer."""
    try:
        file = io.BytesIO(data)
        members = _members(file, 0, len(data))
        pickled = _member_bytes(file, 0, len(data), members["data.pkl"], bytes(data[:_HEAD_READ]))
        return _PlainUnpickler(io.BytesIO(pickled)).load()
    except Exception:  # not a plain value, or not readable here: torch.load decides
        return torch.load(io.BytesIO(data), weights_only=True)


# -- reading ----------------------------------------------------------------------------------


def _readinto(file: ReadableFile, position: int, tensor: torch.Tensor) -> None:
    """Fill the contiguous CPU ``tensor`` with the bytes at ``position`` of ``file``."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    # Invariant, checked because the write below goes through a raw address: the bytes written are the
    # tensor's own elements, inside its storage. A non-contiguous or non-CPU tensor, or one whose
    # storage is shorter than its elements reach, would be memory corruption, not an error.
    storage = tensor.untyped_storage()
    start = tensor.storage_offset() * tensor.element_size()
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or start + nbytes > storage.nbytes():
        raise RuntimeError(
            f"_readinto: refusing a raw read into a {tensor.device.type} tensor of shape {tuple(tensor.shape)}, stride {tensor.stride()}, "
            f"bytes [{start}, {start + nbytes}) of a storage of {storage.nbytes()}"
        )
    # A writable buffer over the tensor's memory without numpy (not a dependency): ctypes from data_ptr.
    view = memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")
    file.seek(position)
    done = 0
    while done < nbytes:  # one read(2) returns at most ~2 GiB on Linux
        got = file.readinto(view[done:])
        if not got:
            raise EOFError(f"data file ends at byte {position + done}, expected {nbytes - done} more bytes")
        done += got


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``size`` (as torch gives them, 1 for dimensions of size <= 1)."""
    strides = [1] * len(size)
    for dim in range(len(size) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * max(size[dim + 1], 1)
    return tuple(strides)


def _narrow(tensor: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


def read_region(
    file: ReadableFile,
    offset: int,
    length: int,
    layout: TensorLayout | None,
    saved_offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    dest: torch.Tensor,
) -> None:
    """Copy the box ``saved_offsets``/``lengths`` of the tensor record at ``[offset, offset + length)``
    into ``dest`` (a tensor of shape ``lengths``, any device and layout). A copy to a CUDA ``dest`` may
    still be running on return (the current stream orders it before later work on that device).

    Reads straight into ``dest`` when the box is contiguous in the file and ``dest`` is a contiguous
    CPU tensor of the saved dtype; otherwise through one temporary of the box's (or record's) size."""
    if math.prod(lengths) == 0:
        return
    if layout is None:
        saved = torch.load(FileWindow(file, offset, length), map_location="cpu", weights_only=True)  # type: ignore[arg-type]  # a RawIOBase is a binary file; torch's stub lists IO[bytes] only
        dest.copy_(_narrow(saved, saved_offsets, lengths))
        return
    if (
        layout.storage_offset == 0
        and tuple(lengths) == layout.size
        and not any(saved_offsets)
        and layout.stride == _contiguous_strides(layout.size)
        and math.prod(layout.size) <= layout.storage_numel
        and dest.device.type == "cpu"
        and dest.dtype == layout.dtype
        and dest.is_contiguous()
    ):
        # The common case, the whole of a contiguous saved tensor into a CPU tensor of its dtype: its
        # bytes start the storage (same result as the general path below, without its tensor calls).
        _readinto(file, layout.data_offset, dest)
        return
    # Work out the box's place in the file on a meta tensor: same geometry, no memory.
    geometry = torch.empty(layout.storage_numel, dtype=layout.dtype, device="meta").as_strided(
        layout.size, layout.stride, layout.storage_offset
    )
    box = _narrow(geometry, saved_offsets, lengths)
    itemsize = geometry.element_size()
    if box.is_contiguous():
        position = layout.data_offset + int(box.storage_offset()) * itemsize
        if dest.device.type == "cpu" and dest.dtype == layout.dtype and dest.is_contiguous():
            _readinto(file, position, dest)
        elif dest.device.type == "cuda":
            # Pinned, and the copy to the GPU left running while the caller reads the next region:
            # torch's caching host allocator keeps this block until the copy is done. The caller
            # synchronizes before the load returns (FileSystemReader.read_data).
            staging = torch.empty(lengths, dtype=layout.dtype, pin_memory=True)
            _readinto(file, position, staging)
            dest.copy_(staging, non_blocking=True)
        else:
            staging = torch.empty(lengths, dtype=layout.dtype)
            _readinto(file, position, staging)
            dest.copy_(staging)
        return
    storage = torch.empty(layout.storage_numel, dtype=layout.dtype)
    _readinto(file, layout.data_offset, storage)
    saved = storage.as_strided(layout.size, layout.stride, layout.storage_offset)
    dest.copy_(_narrow(saved, saved_offsets, lengths))

