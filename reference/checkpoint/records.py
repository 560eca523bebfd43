"""Records: how one saved value sits in a data file.

A data file is a sequence of records, one per saved chunk or object, each addressed by
``(file, offset, length)`` in the metadata. As in DCP's filesystem layout, a record is exactly the
bytes ``torch.save`` writes for the value (a small zip archive: ``data.pkl`` describing the tensor,
``data/<key>`` holding the raw storage bytes, uncompressed), so upstream's reader, which calls
``torch.load`` on each record, reads ours.

Reading goes around ``torch.load`` on the hot path: :func:`parse_tensor_record` finds, from the
record's zip directory and its small ``data.pkl``, where the raw bytes start and how they are laid
out, and :func:`read_region` reads the bytes of a wanted region straight into the destination tensor
(no intermediate tensor, no second copy) when both sides are contiguous. Everything else (a layout
not understood, a big-endian file, a strided region) falls back to ``torch.load(weights_only=True)``
or to one temporary of the record's size: slower, never wrong. ``data.pkl`` is parsed by an
allow-list unpickler that accepts only the tensor-rebuild call, so reading never runs code from the file.
"""

from __future__ import annotations

import ctypes
import io
import math
import pickle
import struct
import sys
import warnings
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

__all__ = ["TensorLayout", "write_record", "parse_tensor_record", "read_region", "FileWindow"]


class FileWindow(io.RawIOBase):
    """A read-only, seekable view of bytes ``[offset, offset + length)`` of an open file."""

    def __init__(self, file: BinaryIO, offset: int, length: int) -> None:
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


def write_record(stream: BinaryIO, value: torch.Tensor | bytes | memoryview) -> int:
    """Append one record at the stream's position and return its length in bytes.

    ``value`` is the CPU tensor to save (it must own exactly its bytes: ``torch.save`` writes a view's
    whole storage) or the already serialized bytes of an object."""
    start = stream.tell()
    if isinstance(value, torch.Tensor):
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


def parse_tensor_record(file: BinaryIO, offset: int, length: int) -> TensorLayout | None:
    """The layout of the tensor record at ``[offset, offset + length)`` of ``file``, or None when the
    record is not a little-endian plain tensor with one uncompressed storage (read it with torch.load).

    Raises ValueError if the record is not a zip archive at all (a corrupt or overwritten file)."""
    window = FileWindow(file, offset, length)
    try:
        archive = zipfile.ZipFile(window)
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ValueError(f"not a torch.save record ({exc})") from None
    with archive:
        names = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
        if "data.pkl" not in names:
            raise ValueError("not a torch.save record (no data.pkl)")
        if "byteorder" in names and archive.read(names["byteorder"]).decode() != sys.byteorder:
            return None
        try:
            header = _HeaderUnpickler(io.BytesIO(archive.read(names["data.pkl"]))).load()
        except _NotUnderstood:
            return None
        if not isinstance(header, _TensorHeader):
            return None
        info = names.get(f"data/{header.storage.key}")
        itemsize = torch.empty((), dtype=header.storage.dtype).element_size()
        if (
            info is None
            or info.compress_type != zipfile.ZIP_STORED
            or info.file_size != header.storage.numel * itemsize
        ):
            return None
        # The zip's local header precedes the bytes; its name and extra field (alignment padding) vary.
        window.seek(info.header_offset)
        local = window.read(30)
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            raise ValueError("corrupt torch.save record (bad local file header)")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        data_start = info.header_offset + 30 + name_len + extra_len
        if data_start + info.file_size > length:
            raise ValueError("truncated torch.save record")
        return TensorLayout(
            data_offset=offset + data_start,
            dtype=header.storage.dtype,
            storage_numel=header.storage.numel,
            storage_offset=header.storage_offset,
            size=header.size,
            stride=header.stride,
        )


# -- reading ----------------------------------------------------------------------------------


def _readinto(file: BinaryIO, position: int, tensor: torch.Tensor) -> None:
    """Fill the contiguous CPU ``tensor`` with the bytes at ``position`` of ``file``."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    # A writable buffer over the tensor's memory without numpy (not a dependency): ctypes from data_ptr.
    view = memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")
    file.seek(position)
    done = 0
    while done < nbytes:  # one read(2) returns at most ~2 GiB on Linux
        got = file.readinto(view[done:])
        if not got:
            raise EOFError(f"data file ends at byte {position + done}, expected {nbytes - done} more bytes")
        done += got


def _narrow(tensor: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


def read_region(
    file: BinaryIO,
    offset: int,
    length: int,
    layout: TensorLayout | None,
    saved_offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    dest: torch.Tensor,
) -> None:
    """Copy the box ``saved_offsets``/``lengths`` of the tensor record at ``[offset, offset + length)``
    into ``dest`` (a tensor of shape ``lengths``, any device and layout).

    Reads straight into ``dest`` when the box is contiguous in the file and ``dest`` is a contiguous
    CPU tensor of the saved dtype; otherwise through one temporary of the box's (or record's) size."""
    if math.prod(lengths) == 0:
        return
    if layout is None:
        saved = torch.load(FileWindow(file, offset, length), map_location="cpu", weights_only=True)
        dest.copy_(_narrow(saved, saved_offsets, lengths))
        return
    # Work out the box's place in the file on a meta tensor: same geometry, no memory.
    geometry = torch.empty(layout.storage_numel, dtype=layout.dtype, device="meta").as_strided(
        layout.size, layout.stride, layout.storage_offset
    )
    box = _narrow(geometry, saved_offsets, lengths)
    itemsize = geometry.element_size()
    if box.is_contiguous():
        position = layout.data_offset + box.storage_offset() * itemsize
        if dest.device.type == "cpu" and dest.dtype == layout.dtype and dest.is_contiguous():
            _readinto(file, position, dest)
        else:
            staging = torch.empty(lengths, dtype=layout.dtype)
            _readinto(file, position, staging)
            dest.copy_(staging)
        return
    storage = torch.empty(layout.storage_numel, dtype=layout.dtype)
    _readinto(file, layout.data_offset, storage)
    saved = storage.as_strided(layout.size, layout.stride, layout.storage_offset)
    dest.copy_(_narrow(saved, saved_offsets, lengths))

