"""Records: how one saved value sits in a data file.

A data file is a sequence of records, one per saved chunk or object, each addressed by
``(file, offset, length)`` in the metadata. As in DCP's filesystem layout, a record is exactly the
bytes ``torch.save`` writes for the value (a small zip archive: ``data.pkl`` describing the value,
``data/<key>`` holding a tensor's raw storage bytes, uncompressed), so upstream's reader, which calls
``torch.load`` on each record, reads ours. A tensor's record carries no CRC32s (see
:func:`write_record`): ``torch.load`` does not check them.

The plain path, first in this module, is that definition in code: :func:`write_record` calls
``torch.save``; :func:`load_tensor_record` and :func:`read_object_record` call
``torch.load(weights_only=True)`` once the archive's member names are checked. What a record may ask
for (SPEC ML-27, ML-28): the globals ``torch.load(weights_only=True)`` allows, with ``io.BytesIO``
and an empty ``bytes`` value (:data:`_ALSO_ALLOWED`), and nothing wider; a refusal names the globals
the record asked for (:func:`asked_globals`). A record whose zip member names are ambiguous (a second
``data.pkl``, another folder, a ``..`` name) is refused before anything reads it: two readers would
read different members of it.

The fast paths, after it, run while :func:`reference.checkpoint.fast_paths.enabled` (the default). They
exist for speed only, write the same bytes, read the same values and refuse the same records: a
tensor's record written from a template around its storage bytes (:func:`_template`); a record's zip
directory and ``data.pkl`` parsed with ``struct`` and an allow-list unpickler that accepts only the
tensor-rebuild call, two small reads per record (:func:`parse_tensor_record`, parses kept for records
equal where the parse looks), and the bytes of a wanted region read straight into the destination
tensor (:func:`read_region`); a non-tensor value of pickle's own types unpickled without
``torch.load``. Whatever they do not understand goes to ``torch.load(weights_only=True)``: slower,
never wrong. Why each exists: docs/benchmark-results.md, "Why the fast paths".
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import struct
import sys
import threading
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol, TypeVar, cast

import torch

from reference.checkpoint import fast_paths
from reference.host_bytes import element_bytes, storage_bytes

__all__ = [
    "TensorLayout",
    "write_record",
    "load_tensor_record",
    "read_tensor_record",
    "read_object_record",
    "asked_globals",
    "parse_tensor_record",
    "read_region",
    "FileWindow",
]


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


# == The plain path: what a record is ===============================================================

#: Held while a plain writer has torch's CRC32 option switched off (see :func:`write_record`).
_CRC32_SWITCH = threading.Lock()


class _RecordingWrites:
    """``stream`` for ``torch.save``, keeping the first ``OSError`` a write raised."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._stream.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self._stream.flush()


def write_record(stream: BinaryIO, value: torch.Tensor | bytes | memoryview) -> int:
    """Append one record at the stream's position and return its length in bytes.

    ``value`` is the CPU tensor to save (it must own exactly its bytes: ``torch.save`` writes a view's
    whole storage) or the already serialized bytes of an object. A tensor's record is what
    ``torch.save`` writes for it with CRC32s off, whichever path writes it (the fast one makes the same
    bytes from a template: :func:`_write_record_fast`)."""
    if fast_paths.enabled():
        return _write_record_fast(stream, value)
    start = stream.tell()
    if isinstance(value, torch.Tensor):
        # No CRC32s: that is the records' format, whichever path writes them (why: the fast paths'
        # table in docs/benchmark-results.md). torch keeps the option per thread or, in older
        # releases, per process: one plain writer at a time switches it, and puts back what it found.
        with _CRC32_SWITCH:
            before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
            recording = _RecordingWrites(stream)
            try:
                torch.save(value, cast(BinaryIO, recording))  # a buffer: torch.save calls its write and flush
            except RuntimeError:
                # torch.save's archive writer swallows the OSError of a refused write (a full disk)
                # and reports only that its file position no longer matches ("unexpected pos"): the
                # operating system's error is what the caller must see (SPEC AS-4.f).
                if recording.error is not None:
                    raise recording.error  # noqa: B904 - the RuntimeError stays as its context
                raise
            finally:
                torch.serialization.set_crc32_options(before)
    else:
        stream.write(value)
    return stream.tell() - start


def load_tensor_record(file: ReadableFile, offset: int, length: int, *, map_location: str = "cpu") -> torch.Tensor:
    """The tensor of the record at ``[offset, offset + length)`` of ``file``, as
    ``torch.load(record, weights_only=True, map_location=map_location)`` returns it; with
    ``map_location="meta"``, its dtype and geometry without reading its bytes, every member's local
    header checked as a read of it would check it (a check made before a load reads anything must
    find a damaged storage header then, not once other keys are written: ML-14).

    Raises ValueError for a record that is not one ``torch.save`` archive every reader reads alike (not
    a zip archive, ambiguous member names) or holds no tensor, ``pickle.UnpicklingError`` naming the
    globals it asked for when ``torch.load`` refuses it, and whatever ``torch.load`` raises for a
    damaged one."""
    window = FileWindow(file, offset, length)
    archive = _archive(window)
    value = _load(window, archive, map_location=map_location)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"not a tensor record: it holds a {type(value).__name__}")
    if map_location == "meta":  # torch.load read no storage member: open each (its header only)
        for info in archive.infolist():
            _open_member(archive, info).close()
    return value


def read_tensor_record(
    file: ReadableFile,
    offset: int,
    length: int,
    saved_offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    dest: torch.Tensor,
) -> None:
    """Copy the box ``saved_offsets``/``lengths`` of the tensor of the record at ``[offset, offset +
    length)`` of ``file`` into ``dest`` (a tensor of shape ``lengths``, any device and layout): the
    values ``torch.load(record, weights_only=True)`` gives, narrowed to the box.

    ``torch.load`` reads the record into a temporary, except where that would double the memory of a
    load into meta values (SPEC ML-7: at most the local shards, once): a whole tensor read into a
    contiguous CPU tensor of its dtype gets its storage's bytes from the archive into it, once
    ``torch.load`` has read its dtype and geometry (onto the meta device: no bytes read).
    Raises as :func:`load_tensor_record`."""
    window = FileWindow(file, offset, length)
    archive = _archive(window)
    geometry = _load(window, archive, map_location="meta")
    if not isinstance(geometry, torch.Tensor):
        raise ValueError(f"not a tensor record: it holds a {type(geometry).__name__}")
    member = _storage_member(archive, geometry)
    if (
        member is not None
        and not any(saved_offsets)
        and tuple(lengths) == tuple(geometry.shape)
        and dest.device.type == "cpu"
        and dest.dtype == geometry.dtype
        and dest.is_contiguous()
    ):
        _read_member_into(archive, member, dest)
        return
    saved = _load(window, archive, map_location="cpu")
    dest.copy_(_narrow(saved, saved_offsets, lengths))


def _narrow(tensor: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    """The box of ``tensor`` that starts at ``offsets`` and has ``lengths`` elements along each dim."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


def _storage_member(archive: zipfile.ZipFile, geometry: torch.Tensor) -> zipfile.ZipInfo | None:
    """The archive's member that holds exactly the elements of the tensor ``geometry`` (as torch.load
    read it onto meta), in order and in this machine's byte order; None if there is no such member
    (a view of a larger storage, a strided or conjugated tensor, another byte order, a compressed
    member): then only ``torch.load`` reads it."""
    storages = [info for info in archive.infolist() if info.filename.partition("/")[2].startswith("data/")]
    names = {info.filename.partition("/")[2]: info for info in archive.infolist()}
    byteorder = names.get("byteorder")
    if byteorder is not None and _member_bytes_or_none(archive, byteorder) != sys.byteorder.encode():
        return None
    if (
        len(storages) != 1
        or storages[0].compress_type != zipfile.ZIP_STORED
        or storages[0].file_size != geometry.numel() * geometry.element_size()
        or geometry.untyped_storage().nbytes() != storages[0].file_size
        or geometry.storage_offset() != 0
        or not geometry.is_contiguous()
        or geometry.is_conj()
        or geometry.is_neg()
    ):
        return None
    return storages[0]


def _read_member_into(archive: zipfile.ZipFile, info: zipfile.ZipInfo, dest: torch.Tensor) -> None:
    """Read the stored member ``info`` into the memory of the contiguous CPU tensor ``dest``, whose
    bytes it holds, :data:`_READ_CHUNK` bytes at a time."""
    view = element_bytes(dest)  # refuses a tensor whose elements are not exactly its bytes
    with _open_member(archive, info) as member:
        done = 0
        while done < len(view):
            got = member.readinto(view[done:done + _READ_CHUNK])
            if not got:
                raise EOFError(f"the record's {info.filename} ends after {done} of its {len(view)} bytes")
            done += got


#: Bytes a plain read of a record's storage copies at a time (its only temporary memory): small enough
#: that zipfile's copies of a chunk stay in the CPU's cache (a few MiB at a time was slower than
#: torch.load and a copy).
_READ_CHUNK = 256 << 10


def _open_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> io.BufferedIOBase:
    # Records carry no CRC32s (see write_record), which zipfile would take for damage when it reads a
    # member to its end; torch.load does not check them, and neither does this.
    with contextlib.suppress(AttributeError):  # opened before
        del info.CRC
    return cast(io.BufferedIOBase, archive.open(info))  # a ZipExtFile, which is one


def _member_bytes_or_none(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes | None:
    try:
        with _open_member(archive, info) as member:
            return member.read()
    except Exception:  # a damaged member: treated as absent
        return None


def read_object_record(data: bytes | memoryview) -> Any:
    """The value of a non-tensor record (``torch.save`` of an object, DCP's encoding of non-tensor
    values): ``torch.load(data, weights_only=True)`` once the archive's member names are checked.

    Raises ValueError for a record that is not one ``torch.save`` archive every reader reads alike,
    ``pickle.UnpicklingError`` naming the globals it asked for when ``torch.load`` refuses it."""
    if fast_paths.enabled():
        return _read_object_record_fast(data)
    stream = io.BytesIO(data)
    return _load(stream, _archive(stream))


def _archive(stream: BinaryIO | FileWindow) -> zipfile.ZipFile:
    """The record in ``stream`` as a zip archive (its directory read, no member), its member names
    checked (:func:`_short_name`); ValueError if it is not a zip archive or its names are ambiguous."""
    try:
        archive = zipfile.ZipFile(stream)
    except zipfile.BadZipFile as exc:
        raise ValueError(f"not a torch.save record ({exc})") from None
    folder: str | None = None
    seen: set[str] = set()
    for info in archive.infolist():
        folder = folder if folder is not None else info.filename.partition("/")[0]
        seen.add(_short_name(info.filename, folder, seen))
    return archive


def _short_name(name: str, folder: str, seen: Collection[str]) -> str:
    """A member's name without the archive's folder ``folder`` (the first member's), or ValueError if
    it lies: a record is one folder of uniquely named members (torch.save's archive), and member names
    that lie (a second data.pkl, a member of another folder, a ``..`` segment) would let two readers of
    one record, this one and torch.load, read different members. Refused, never resolved (ML-28)."""
    top, _, short = name.partition("/")
    if not short or top != folder or short in seen or any(part in ("", ".", "..") for part in short.split("/")) or "\\" in name:
        raise ValueError(
            f"refused torch.save record: its member names are ambiguous ({name!r}"
            f"{' again' if short in seen else ''} in an archive of folder {folder!r}), so it is not "
            "one record that every reader reads alike"
        )
    return short


def _bytes_called_empty(*args: Any) -> bytes:
    """``bytes`` as ``torch.load`` may call it: with no argument only, which is how pickle protocol 2
    (``torch.save``'s) spells an empty ``bytes`` value. torch's own allow-list has ``_codecs.encode``,
    protocol 2's spelling of every other ``bytes`` value (pytorch/pytorch#133163), but not this one, so
    ``torch.load(weights_only=True)`` refuses ``torch.save(b"")``. With an argument, ``bytes`` could
    allocate any size: refused."""
    if args:
        raise ValueError("the record calls bytes() with an argument; only an empty bytes value is written so")
    return b""


#: What ``torch.load`` may build beyond its own ``weights_only`` allow-list, as the fast path's
#: unpickler (:class:`_PlainUnpickler`) does, so that both paths load the same records: an
#: ``io.BytesIO`` (bytes and a position; its ``__setstate__`` runs no code of the record's: a module's
#: extra state may be one, SD-29, and torch's DCP loads it) and an empty ``bytes`` value (ML-1).
_ALSO_ALLOWED: list[Any] = [io.BytesIO, (_bytes_called_empty, "builtins.bytes")]
#: ``safe_globals`` edits torch's process-wide list and, on leaving, puts back the list it found: two
#: blocks overlapping in two threads (the fast path's readers) would take the allowance away from one
#: load, or leave it in torch's list for good. One block at a time.
_ALSO_ALLOWED_LOCK = threading.Lock()


def _load(stream: BinaryIO | FileWindow, archive: zipfile.ZipFile, **kwargs: Any) -> Any:
    """``torch.load(stream, weights_only=True, **kwargs)`` of the record ``archive`` was read from; a
    refusal names the globals its ``data.pkl`` asks for (:func:`_refused`)."""
    stream.seek(0)
    return _weights_only_load(stream, lambda: _data_pkl(archive), **kwargs)


def _weights_only_load(stream: BinaryIO | FileWindow, pickled: Callable[[], bytes | None], **kwargs: Any) -> Any:
    """``torch.load(stream, weights_only=True, **kwargs)`` with :data:`_ALSO_ALLOWED`; a refusal names
    the globals that ``pickled()`` (the record's ``data.pkl``, read only then) asks for."""
    try:
        with _ALSO_ALLOWED_LOCK, torch.serialization.safe_globals(_ALSO_ALLOWED):
            return torch.load(stream, weights_only=True, **kwargs)  # type: ignore[arg-type]  # a RawIOBase is a binary file; torch's stub lists IO[bytes] only
    except pickle.UnpicklingError as exc:
        refusal = _refused(exc, pickled())
        if refusal is exc:
            raise
        raise refusal from exc


def _data_pkl(archive: zipfile.ZipFile) -> bytes | None:
    """The bytes of the record's ``data.pkl``, or None if it has none or they cannot be read."""
    for info in archive.infolist():
        if info.filename.partition("/")[2] == "data.pkl":
            return _member_bytes_or_none(archive, info)
    return None


def _refused(exc: pickle.UnpicklingError, pickled: bytes | None) -> pickle.UnpicklingError:
    """``torch.load(weights_only=True)``'s refusal ``exc`` of the record whose ``data.pkl`` is
    ``pickled``, as an error that names the globals it asks for, by whichever opcode (torch's message
    names a ``GLOBAL`` by its bare name, a ``STACK_GLOBAL`` or extension code not at all); ``exc``
    itself if it asks for none."""
    asked = asked_globals(pickled) if pickled is not None else []
    if not asked:
        return exc
    return pickle.UnpicklingError(
        f"refused by torch.load(weights_only=True), whose allow-list is the one applied: the record asks "
        f"for {', '.join(asked)}"
    )


def asked_globals(pickled: bytes) -> list[str]:
    """Every global (``module.name``) that the pickle ``pickled`` names, in order, each once: by
    ``GLOBAL``, by ``STACK_GLOBAL`` (its two strings, pushed or fetched from the memo) or by an
    extension code (``EXT1/2/4``, as the ``copyreg`` registry of this process resolves it); read
    with :mod:`pickletools`, so nothing is built or run. A pickle that cannot be read to its end
    names what was read before."""
    import copyreg
    import pickletools

    asked: list[str] = []
    strings: list[Any] = []  #: the values pushed, as far as they are strings (else None)
    memo: dict[Any, Any] = {}
    try:
        for opcode, arg, _ in pickletools.genops(pickled):
            name = opcode.name
            if name == "GLOBAL":
                asked.append(str(arg).replace(" ", "."))
            elif name == "STACK_GLOBAL":
                module, attr = (strings[-2:] + [None, None])[:2] if len(strings) >= 2 else (None, None)
                asked.append(f"{module}.{attr}" if isinstance(module, str) and isinstance(attr, str) else "a global built on the stack")
            elif name in ("EXT1", "EXT2", "EXT4"):
                # Private, unavoidable: copyreg has no public lookup of an extension code; the
                # unpickler resolves the code through this same table.
                found = copyreg._inverted_registry.get(arg)  # type: ignore[attr-defined]
                asked.append(f"{found[0]}.{found[1]} (extension code {arg})" if found else f"extension code {arg}")
            elif name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8", "SHORT_BINSTRING", "BINSTRING", "STRING"):
                strings.append(arg)
            elif name == "MEMOIZE":
                memo[len(memo)] = strings[-1] if strings else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = strings[-1] if strings else None
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                strings.append(memo.get(arg))
            elif name in ("BINPERSID", "PERSID"):
                asked.append("a persistent id")
    except Exception:  # a damaged or cut pickle: what was read so far
        pass
    return list(dict.fromkeys(asked))


# == Fast paths =====================================================================================
#
# Everything below exists for speed only (the figures: docs/benchmark-results.md, "Why the fast
# paths") and runs only while fast_paths.enabled(). Each writes the bytes the plain path writes, reads
# the values it reads and refuses the records it refuses; tests/reference/test_fast_paths.py compares
# the two.


@dataclass
class _Crc32Writers:
    """The writers inside :func:`_without_crc32`, for a torch that keeps one CRC32 option per process."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    per_thread: bool | None = None  #: whether torch keeps the option per thread; found out on first use
    inside: int = 0  #: writers inside, when the option is per process
    before: bool = True  #: the option before the first of them switched it off


_CRC32 = _Crc32Writers()


def _crc32_option_is_per_thread() -> bool:
    """Whether a thread's ``set_crc32_options`` leaves other threads' option alone: another thread
    switches it, this one looks (and puts its value back if it moved)."""
    mine = torch.serialization.get_crc32_options()
    other = threading.Thread(target=torch.serialization.set_crc32_options, args=(not mine,), name="crc32-probe")
    other.start()
    other.join()
    if torch.serialization.get_crc32_options() == mine:
        return True
    torch.serialization.set_crc32_options(mine)
    return False


@contextlib.contextmanager
def _without_crc32() -> Iterator[None]:
    # torch.save computes a CRC32 of every member by default, which costs more than writing the bytes
    # (figures: docs/benchmark-results.md, "Why the fast paths"). Nothing reads it back: the fast reader
    # parses the zip structure with struct, the plain one skips it, and torch's reader does not verify it. What catches a damaged
    # record instead: the structure checks of parse_tensor_record and the record's geometry checked
    # against the checkpoint metadata (FileSystemReader).
    #
    # Writer threads overlap, so who switches the option back matters. Recent torch keeps it per
    # thread (its serialization config is thread-local): each thread switches its own. Older torch
    # keeps one per process (torch 2.11 does): there a thread putting back what it found would
    # switch CRC32s on under a writer still inside torch.save, and the last one out would leave them
    # off for the whole process. So the first writer in switches it off, the last one out puts back
    # what the first found; meanwhile other threads' torch.save writes no CRC32s either.
    set_crc32 = getattr(torch.serialization, "set_crc32_options", None)  # torch >= 2.5
    if set_crc32 is None:
        yield
        return
    get_crc32 = torch.serialization.get_crc32_options
    if _CRC32.per_thread is None:
        with _CRC32.lock:
            if _CRC32.per_thread is None:
                _CRC32.per_thread = _crc32_option_is_per_thread()
    if _CRC32.per_thread:
        before = get_crc32()
        set_crc32(False)
        try:
            yield
        finally:
            set_crc32(before)
        return
    with _CRC32.lock:
        if _CRC32.inside == 0:
            _CRC32.before = get_crc32()
            set_crc32(False)
        _CRC32.inside += 1
    try:
        yield
    finally:
        with _CRC32.lock:
            _CRC32.inside -= 1
            if _CRC32.inside == 0:
                set_crc32(_CRC32.before)


def _write_record_fast(stream: BinaryIO, value: torch.Tensor | bytes | memoryview) -> int:
    """:func:`write_record`, a tensor's record written from a template where one can be made (see
    :func:`_template`), else by ``torch.save`` with CRC32s off (see :func:`_without_crc32`)."""
    start = stream.tell()
    if isinstance(value, torch.Tensor):
        template = _template(value)
        if template is None:
            with _without_crc32():
                torch.save(value, stream)
        else:
            # No torch.save here, so no CRC32 option to switch: switching it (a get and two sets of
            # torch's thread-local config) was a large part of a small record's time.
            stream.write(template.head)
            stream.write(storage_bytes(value))
            stream.write(template.tail)
    else:
        stream.write(value)
    return stream.tell() - start


# -- record templates -------------------------------------------------------------------------------
#
# torch.save costs a fixed time per tensor beyond writing its bytes (pickling data.pkl, setting up a
# zip writer, some 35 small writes), a tenth of a save of a few hundred records a rank
# (figures: docs/benchmark-results.md, "Why the fast paths"). Yet every byte of a record but the storage's is fixed
# by the tensor's geometry: CRC32s are off, the serialization id is a hash of the member names and
# their (zero) CRC32s, and nothing records a time or a process. So the record is written as a
# template around the storage bytes. The template is torch.save's own output under
# torch.serialization.skip_data, which writes everything but the storage bytes and seeks over them:
# torch stays the author of the format (of whatever version is installed), and a record written from
# a template is the record torch.save writes (tests compare them byte for byte).

_TEMPLATE_LIMIT = 1024  #: templates kept; all are dropped when one more is needed (a model has a handful)
#: the template key (see _template_key) -> the template, or None: torch.save writes it every time
_TEMPLATES: dict[tuple[Any, ...], _Template | None] = {}
_CAN_TEMPLATE = hasattr(torch.serialization, "skip_data") and hasattr(torch.serialization, "set_crc32_options")


@dataclass(frozen=True)
class _Template:
    head: bytes  #: torch.save's bytes before the storage's: the members before it and its local header
    tail: bytes  #: after: the members after it, the central directory, the end records


def _storage_alignment() -> int:
    """torch.save's alignment of storage bytes (configurable since torch 2.6; 64 before)."""
    config = getattr(getattr(torch.utils, "serialization", None), "config", None)
    return int(config.save.storage_alignment) if config is not None else 64


def _template_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """Everything torch.save's record of ``tensor`` depends on but the storage bytes, or None for a
    tensor whose record is not templated (torch.save writes it: a subclass or a tensor with Python
    attributes, pickled with them; not a dense CPU tensor; an empty storage, which has no bytes to skip)."""
    if (
        not _CAN_TEMPLATE
        or type(tensor) is not torch.Tensor
        or tensor.__dict__
        or tensor.layout is not torch.strided
        or tensor.device.type != "cpu"
        or tensor.is_quantized
        or tensor.is_nested
    ):
        return None
    nbytes = tensor.untyped_storage().nbytes()
    if nbytes == 0:
        return None
    # data.pkl holds the storage's dtype and element count, the tensor's offset, size and stride, its
    # requires_grad and its conj and neg bits (torch._utils.get_tensor_metadata); the zip layout
    # follows from those and the storage alignment.
    return (
        tensor.dtype, nbytes, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.requires_grad,
        tensor.is_conj(), tensor.is_neg(), _storage_alignment(),
    )


def _template(tensor: torch.Tensor) -> _Template | None:
    """The template of ``tensor``'s record (made on first use, by torch.save with CRC32s off, as
    :func:`write_record` writes records), or None: write it with torch.save."""
    key = _template_key(tensor)
    if key is None:
        return None
    try:
        return _TEMPLATES[key]
    except KeyError:
        pass
    template = _make_template(tensor, key[1])
    if len(_TEMPLATES) >= _TEMPLATE_LIMIT:
        _TEMPLATES.clear()
    _TEMPLATES[key] = template  # concurrent writer threads may both make it: the same bytes
    return template


class _SkipRecorder:
    """The stream torch.save writes a template to: keeps what is written, and where it seeks over bytes."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.skips: list[tuple[int, int]] = []  #: (position in ``written``, bytes skipped)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.written += view
        return view.nbytes

    def tell(self) -> int:
        return len(self.written) + sum(n for _, n in self.skips)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence != io.SEEK_CUR or offset < 0:
            raise io.UnsupportedOperation("a template records forward skips only")
        self.skips.append((len(self.written), offset))
        return self.tell()

    def flush(self) -> None:
        pass


class _TemplateFile(io.RawIOBase):
    """The record a template stands for, with zeros for the storage bytes, as a file to parse."""

    def __init__(self, template: _Template, nbytes: int) -> None:
        super().__init__()
        self._template, self._nbytes, self._pos = template, nbytes, 0
        self.length = len(template.head) + nbytes + len(template.tail)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        if whence != io.SEEK_SET:
            raise io.UnsupportedOperation("absolute positions only")
        self._pos = pos
        return pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        head, tail = self._template.head, self._template.tail
        gap_end = len(head) + self._nbytes
        start, end = self._pos, min(self.length, self._pos + len(view))
        chunk = bytearray(head[start:end])
        if end > len(head) and start < gap_end:
            chunk += bytes(min(end, gap_end) - max(start, len(head)))
        if end > gap_end:
            chunk += tail[max(start, gap_end) - gap_end:end - gap_end]
        view[:len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


def _make_template(tensor: torch.Tensor, nbytes: int) -> _Template | None:
    """torch.save's record of ``tensor`` without the storage bytes, or None if it is not exactly that:
    one skip of the storage's ``nbytes``, where the reader here finds the storage of a tensor of
    ``tensor``'s geometry."""
    recorder = _SkipRecorder()
    try:
        with _without_crc32(), torch.serialization.skip_data():
            torch.save(tensor, recorder)  # type: ignore[arg-type]  # the methods torch.save calls
    except Exception:  # a torch whose writer needs more of its stream: torch.save writes every record
        return None
    if len(recorder.skips) != 1 or recorder.skips[0][1] != nbytes:
        return None
    at = recorder.skips[0][0]
    template = _Template(bytes(recorder.written[:at]), bytes(recorder.written[at:]))
    record = _TemplateFile(template, nbytes)
    try:
        layout = parse_tensor_record(record, 0, record.length)
    except ValueError:
        return None
    if layout is None or (layout.data_offset, layout.dtype, layout.storage_numel * tensor.element_size()) != (
        at, tensor.dtype, nbytes
    ) or (layout.storage_offset, layout.size, layout.stride) != (tensor.storage_offset(), tuple(tensor.shape), tensor.stride()):
        return None
    return template


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


def _rebuild_tensor(storage: Any, storage_offset: int, size: Any, stride: Any, requires_grad: Any = False,
                    backward_hooks: Any = None, metadata: Any = None, *_: Any) -> _TensorHeader:
    if not isinstance(storage, _StorageRef):
        raise _NotUnderstood("tensor storage is not a persistent storage reference")
    if metadata:
        # The tensor's conj or neg bit (torch._utils.get_tensor_metadata): its values are not its
        # storage's bytes as they are. torch.load applies the bits; reading the bytes would not.
        raise _NotUnderstood(f"tensor metadata {sorted(metadata)}")
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


def _latin1_bytes(text: str, encoding: str) -> bytes:
    """``_codecs.encode`` as pickle protocol 2 calls it for a ``bytes`` value, and for nothing else."""
    if encoding != "latin1" or not isinstance(text, str):
        raise _NotUnderstood(f"_codecs.encode with {encoding!r}")
    return text.encode("latin1")


def _empty_bytes(*args: Any) -> bytes:
    """``bytes()`` as pickle protocol 2 calls it for an empty ``bytes`` value, and for nothing else."""
    if args:
        raise _NotUnderstood("bytes() with arguments")
    return b""


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles values built from pickle's own types only (numbers, strings, None, bools, lists,
    tuples, dicts) and ``io.BytesIO``: it refuses every other global and every persistent id, so it can
    construct nothing else and run no code."""

    def find_class(self, module: str, name: str) -> Any:
        # A BytesIO is bytes and a position (its __setstate__ runs no code of the record's): a module's
        # extra state may be one (Transformer Engine keeps its FP8 metadata so), and torch's DCP loads it.
        if (module, name) == ("_io", "BytesIO"):
            return io.BytesIO
        if (module, name) == ("_codecs", "encode"):  # how protocol 2 spells bytes (a BytesIO's too)
            return _latin1_bytes
        if name == "bytes" and module in ("__builtin__", "builtins"):  # and empty bytes
            return _empty_bytes
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


class _RecordBytes:
    """The bytes of one record that parsing consults.

    Its first and last few KiB (``head``, ``tail``) are read once, in one read for a record that
    small; bytes outside them are read from the file when asked for. Which bytes were consulted is
    noted (a prefix of ``head``, a suffix of ``tail``, or something else), because a parse depends on
    nothing but those bytes and the record's length (see :data:`_PARSED`)."""

    def __init__(self, file: ReadableFile, offset: int, length: int) -> None:
        self.file, self.offset, self.length = file, offset, length
        self.head = _read_at(file, offset, min(length, _HEAD_READ))
        if len(self.head) == length:
            self.tail_start, self.tail = 0, self.head
        else:
            self.tail_start = max(0, length - _TAIL_READ)
            self.tail = _read_at(file, offset + self.tail_start, length - self.tail_start)
        #: Both reads returned all they asked for (the file is not cut short inside them).
        self.whole = len(self.head) == min(length, _HEAD_READ) and len(self.tail) == length - self.tail_start
        self.head_used = 0  #: head[:head_used] was consulted
        self.tail_used = len(self.tail)  #: tail[tail_used:] was consulted
        self.elsewhere = False  #: bytes outside head and tail were consulted

    def at(self, position: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``position`` of the record (fewer where the file ends)."""
        end = position + n
        in_head = end <= len(self.head)
        in_tail = self.tail_start <= position and end <= self.tail_start + len(self.tail)
        if in_head and in_tail:
            # A record read whole (head and tail overlap): the bytes count as the head's or the tail's,
            # whichever that grows less, so that the tensor's bytes between the members before them and
            # the directory after them stay unconsulted, as in a big record (else every small record
            # of other values would be a parse of its own).
            in_head = end - self.head_used <= self.tail_used - (position - self.tail_start)
        if in_head:
            self.head_used = max(self.head_used, end)
            return self.head[position:end]
        if in_tail:
            self.tail_used = min(self.tail_used, position - self.tail_start)
            return self.tail[position - self.tail_start:end - self.tail_start]
        self.elsewhere = True
        return _read_at(self.file, self.offset + position, n)

    def end_of_directory(self) -> int:
        """Where the record's zip end-of-directory record starts (the last one in its tail)."""
        found = self.tail.rfind(b"PK\x05\x06")
        if found < 0 or found + _EOCD.size > len(self.tail):
            raise ValueError("not a torch.save record (no zip end-of-directory record)")
        # From here to the tail's end: another record equal in these bytes finds the same last one.
        self.tail_used = min(self.tail_used, found)
        return self.tail_start + found


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


def _members(record: _RecordBytes) -> dict[str, _Member]:
    """The record's members by name (the archive folder stripped); ValueError if it is not a zip."""
    eocd_at = record.end_of_directory()
    _, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack(record.at(eocd_at, _EOCD.size))
    if 0xFFFFFFFF in (cd_size, cd_offset) or count == 0xFFFF:
        locator = record.at(eocd_at - _ZIP64_LOCATOR.size, _ZIP64_LOCATOR.size) if eocd_at >= _ZIP64_LOCATOR.size else b""
        if len(locator) != _ZIP64_LOCATOR.size or locator[:4] != b"PK\x06\x07":
            raise ValueError("corrupt torch.save record (no zip64 locator)")
        z64_offset = _ZIP64_LOCATOR.unpack(locator)[2]
        z64 = record.at(z64_offset, _ZIP64_EOCD.size) if z64_offset <= record.length - _ZIP64_EOCD.size else b""
        if len(z64) != _ZIP64_EOCD.size or z64[:4] != b"PK\x06\x06":
            raise ValueError("corrupt torch.save record (bad zip64 end-of-directory record)")
        _, _, _, _, _, _, _, count, cd_size, cd_offset = _ZIP64_EOCD.unpack(z64)
    if cd_offset + cd_size > record.length:
        raise ValueError("truncated torch.save record (central directory beyond its end)")
    directory = record.at(cd_offset, cd_size)
    members: dict[str, _Member] = {}
    folder: str | None = None
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
        if folder is None:
            folder = name.partition("/")[0]
        short = _short_name(name, folder, members)  # ValueError if the names are ambiguous (ML-28)
        members[short] = _Member(short, method, size, csize, header_offset)
        pos = name_end + extra_len + comment_len
    return members


def _member_data_start(record: _RecordBytes, member: _Member) -> int:
    """Where the member's bytes start, from the record's start, checked against its local header."""
    local = record.at(member.header_offset, _LOCAL.size)
    if len(local) != _LOCAL.size or local[:4] != b"PK\x03\x04":
        raise ValueError(f"corrupt torch.save record (bad local header of {member.name})")
    name_len, extra_len = _LOCAL.unpack(local)[9:11]
    start: int = member.header_offset + _LOCAL.size + name_len + extra_len
    if start + member.compressed_size > record.length:
        raise ValueError(f"truncated torch.save record ({member.name} runs past its end)")
    return start


def _member_bytes(record: _RecordBytes, member: _Member) -> bytes:
    if member.method != zipfile.ZIP_STORED:
        raise _NotUnderstood(f"{member.name} is compressed")
    data = record.at(_member_data_start(record, member), member.size)
    if len(data) != member.size:
        raise ValueError(f"truncated torch.save record ({member.name})")
    return data


def _parse(record: _RecordBytes) -> TensorLayout | None:
    """:func:`parse_tensor_record` of ``record``, with ``data_offset`` from the record's start."""
    members = _members(record)
    if "data.pkl" not in members:
        raise ValueError("not a torch.save record (no data.pkl)")
    try:
        if "byteorder" in members and _member_bytes(record, members["byteorder"]).decode() != sys.byteorder:
            return None
        header = _HeaderUnpickler(io.BytesIO(_member_bytes(record, members["data.pkl"]))).load()
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
    return TensorLayout(
        data_offset=_member_data_start(record, member),
        dtype=header.storage.dtype,
        storage_numel=header.storage.numel,
        storage_offset=header.storage_offset,
        size=header.size,
        stride=header.stride,
    )


# The parse of a record depends on nothing but the bytes it consulted and the record's length (member
# offsets are relative to the record's start, and torch.save writes no names or times of its own), so
# it is kept for the next record whose consulted bytes are the same: the records of a model's
# checkpoint have a handful of distinct shapes among hundreds of records, and a kept parse costs the
# two reads and two comparisons instead of parsing the zip directory and data.pkl again. The bytes
# consulted are a prefix of the record's first read (the members before the storage, data.pkl) and a
# suffix of its last (from the central directory on): never the tensor's own bytes. Only successful
# parses of records read whole, with nothing consulted outside the two reads, are kept; a record that
# does not parse is parsed (and raises) again every time.
_PARSED_LIMIT = 256  #: record lengths with kept parses
_KEPT_PER_LENGTH = 8  #: kept parses per record length
#: (parse function, record length) -> [(consulted prefix of head, consulted suffix of tail, the parse)]
_PARSED: dict[tuple[Callable[[_RecordBytes], Any], int], list[tuple[bytes, bytes, Any]]] = {}

_Parsed = TypeVar("_Parsed")


def _parsed(record: _RecordBytes, parse: Callable[[_RecordBytes], _Parsed]) -> _Parsed:
    """``parse(record)``, or what it returned for a record equal in every byte it consulted."""
    key = (parse, record.length)
    if record.whole:
        for prefix, suffix, parsed in _PARSED.get(key, ()):
            if record.head.startswith(prefix) and record.tail.endswith(suffix):
                return cast(_Parsed, parsed)
    parsed = parse(record)
    if record.whole and not record.elsewhere:
        if len(_PARSED) >= _PARSED_LIMIT and key not in _PARSED:
            _PARSED.clear()
        kept = _PARSED.setdefault(key, [])
        if len(kept) >= _KEPT_PER_LENGTH:  # the oldest goes; the other lengths' parses stay
            del kept[0]
        kept.append((record.head[:record.head_used], record.tail[record.tail_used:], parsed))
    return parsed


def parse_tensor_record(file: ReadableFile, offset: int, length: int) -> TensorLayout | None:
    """The layout of the tensor record at ``[offset, offset + length)`` of ``file``, or None when the
    record is not a little-endian plain tensor with one uncompressed storage (read it with torch.load).

    Raises ValueError if the record is not a zip archive at all (a corrupt or overwritten file), or its
    zip structure is damaged or runs past ``length`` (a truncated record)."""
    parsed = _parsed(_RecordBytes(file, offset, length), _parse)
    if parsed is None:
        return None
    return TensorLayout(
        offset + parsed.data_offset, parsed.dtype, parsed.storage_numel, parsed.storage_offset, parsed.size, parsed.stride
    )


def _record_pickle(file: ReadableFile, offset: int, length: int) -> bytes | None:
    """The ``data.pkl`` bytes of the record at ``[offset, offset + length)``, or None if not found."""
    record = _RecordBytes(file, offset, length)
    try:
        start, size = _parsed(record, _pickle_span)
    except Exception:
        return None
    return record.at(start, size)


def _pickle_span(record: _RecordBytes) -> tuple[int, int]:
    """Where the record's ``data.pkl`` is: (start from the record's start, bytes)."""
    member = _members(record)["data.pkl"]
    if member.method != zipfile.ZIP_STORED:
        raise _NotUnderstood("data.pkl is compressed")
    return _member_data_start(record, member), member.size


def _read_object_record_fast(data: bytes | memoryview) -> Any:
    """:func:`read_object_record`, a value made of pickle's own types (a learning rate, ``betas``, a
    step count, a string) unpickled straight from the record's ``data.pkl`` by
    :class:`_PlainUnpickler`: a checkpoint holds one record per such value (every ``param_groups``
    entry is one), and ``torch.load`` costs a fixed time each, mostly in setting up its zip reader.
    Anything else (tensors, ``torch.Size``, a set, a damaged record) goes to
    ``torch.load(weights_only=True)``: its allow-list, and nothing wider, decides which globals a
    record may ask for. A record whose member names are ambiguous is refused (ValueError) before either
    reads it; a refused one names the globals it asked for."""
    record = _RecordBytes(io.BytesIO(data), 0, len(data))
    try:
        start, size = _parsed(record, _pickle_span)
    except ValueError as exc:
        if "member names are ambiguous" in str(exc):
            raise
        return _torch_load(data, None)
    except Exception:  # no data.pkl, or compressed: torch.load decides
        return _torch_load(data, None)
    pickled = bytes(data[start:start + size])
    try:
        return _PlainUnpickler(io.BytesIO(pickled)).load()
    except Exception:  # not a plain value: torch.load decides
        return _torch_load(data, pickled)


def _torch_load(data: bytes | memoryview | FileWindow, pickled: bytes | None, **kwargs: Any) -> Any:
    """``torch.load(data, weights_only=True)``; a refusal names the globals that ``pickled`` (the
    record's ``data.pkl``) asks for (:func:`_refused`)."""
    stream = io.BytesIO(data) if isinstance(data, (bytes, memoryview)) else data
    return _weights_only_load(stream, lambda: pickled, **kwargs)


# -- reading ----------------------------------------------------------------------------------


def _readinto(file: ReadableFile, position: int, tensor: torch.Tensor) -> None:
    """Fill the contiguous CPU ``tensor`` with the bytes at ``position`` of ``file``."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    # element_bytes refuses a tensor whose elements are not exactly the bytes read into (a raw write
    # there would be memory corruption, not an error).
    view = element_bytes(tensor)
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
        saved = _torch_load(FileWindow(file, offset, length), _record_pickle(file, offset, length), map_location="cpu")
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

