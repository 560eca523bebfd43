"""ML-27 and ML-28, crafted checkpoints: pickles written opcode by opcode that run code by each route an
unpickler may let through (:data:`CODE_ROUTES`, :func:`crafted_pickle`), zip records whose member
names lie (:data:`NAME_LIES`, :func:`crafted_record`), a checkpoint's record replaced by one of them
(:func:`replace_record`), and the ``copyreg`` extension codes the ``ext`` routes need
(:func:`extension_for_exec`). Self-tests: ``tests/test_checkpoint_support.py``; also used by
``tests/reference/test_fast_paths.py``."""

from __future__ import annotations

import contextlib
import pickle
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from conformance.checkpoint_support import in_checkpoint, no_record
from conformance.dcp_files import dcp_directory, member_data_start, read_metadata

__all__ = [
    "extension_for_exec",
    "CODE_ROUTES",
    "LAYOUT_ROUTE",
    "reverse_chunks",
    "NAME_LIES",
    "EXT_CODES",
    "crafted_pickle",
    "crafted_record",
    "replace_record",
    "repacked_record",
    "RAN_ENV",
]


#: The pickle opcode routes by which a record reaches code, each asking for ``builtins.exec``:
#: ``global`` (GLOBAL then REDUCE), ``stack-global`` (STACK_GLOBAL, protocol 4), ``pickled`` (what
#: ``pickle.dumps`` writes for a dict holding the object: STACK_GLOBAL after other strings, its module
#: name fetched from the memo where a key put it), ``memo-put`` (STACK_GLOBAL of names stored and
#: fetched by protocol 0's text ``PUT``/``GET``), ``build`` (BUILD sets ``__setstate__`` of an
#: ``OrderedDict``, an allow-listed class, and a second BUILD calls it), ``persistent-id`` (the
#: persistent id's tuple is built by a call), ``ext1``/``ext2``/``ext4`` (an extension code that the
#: loading process's ``copyreg`` registry resolves: :data:`EXT_CODES`). An error must name the global
#: asked for whichever opcodes pushed its names.
CODE_ROUTES = ("global", "stack-global", "pickled", "memo-put", "build", "persistent-id", "ext1", "ext2", "ext4")
#: A route of the metadata alone: ``torch.serialization._get_layout``, the allowed global by which torch
#: pickles a tensor's layout, asked for ``"torch.save"``, no layout; a loader that resolves any torch
#: attribute by that name hands out ``torch.save``, which the pickle then calls to write a file (the
#: marker: a file written where the checkpoint says is code run, the next login's shell profile).
LAYOUT_ROUTE = "layout-name"
#: Zip containers whose member names lie: a second ``data.pkl`` (the first a harmless value), a
#: ``data.pkl`` of another archive folder, a ``..`` name; the extra member holds the ``global`` route.
NAME_LIES = ("duplicate-data-pkl", "other-folder", "dot-dot")
#: The extension code each ``ext`` route uses, registered as ``builtins.exec`` around the load.
EXT_CODES = {"ext1": 0xF1, "ext2": 0x1F2, "ext4": 0x10003}
#: The environment variable the crafted code sets (besides creating its marker file) where it runs.
RAN_ENV = "CONFORMANCE_CRAFTED_CODE_RAN"


@contextlib.contextmanager
def extension_for_exec(route: str) -> Iterator[None]:
    """Inside, this process's ``copyreg`` registry resolves the ``route``'s extension code (an ``ext``
    route) to ``builtins.exec``, as a library that registers extension codes would leave it."""
    import copyreg

    code = EXT_CODES.get(route)
    if code is None:
        yield
        return
    copyreg.add_extension("builtins", "exec", code)
    try:
        yield
    finally:
        copyreg.remove_extension("builtins", "exec", code)


class _Exec:
    """Pickled as a call of ``exec(code)``, as ``pickle.dumps`` writes any object that reduces to a call."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (self.code,)


def _unicode(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def _short(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def crafted_pickle(route: str, code: str, marker: str = "") -> bytes:
    """A pickle that runs ``exec(code)`` when loaded by an unpickler that lets ``route`` through (see
    :data:`CODE_ROUTES`); for :data:`LAYOUT_ROUTE`, one that calls ``torch.save`` to write the file
    ``marker``. Written opcode by opcode, as an attacker would."""
    call = _unicode(code) + b"\x85R"  # (code,) then REDUCE
    if route == LAYOUT_ROUTE:
        if not marker:
            raise ValueError(f"route {route!r} writes a marker file: give its path")
        # _get_layout("torch.save"), then that called with ("ran", marker): TUPLE2 and REDUCE.
        return (b"\x80\x02ctorch.serialization\n_get_layout\n" + _unicode("torch.save") + b"\x85R"
                + _unicode("ran") + _unicode(marker) + b"\x86R.")
    if route == "global":
        return b"\x80\x02cbuiltins\nexec\n" + call + b"."
    if route == "stack-global":
        return b"\x80\x04" + _short("builtins") + _short("exec") + b"\x93" + call + b"."
    if route == "pickled":
        # The key is the very string the pickler takes the module name from: memoized as the key, it
        # is fetched from the memo (BINGET) for the global.
        return pickle.dumps({exec.__module__: "a key", "value": _Exec(code)}, protocol=4)
    if route == "memo-put":
        return (b"\x80\x02" + _unicode("builtins") + b"p0\n0" + _unicode("exec") + b"p1\n0" + _unicode("a string between")
                + b"0g0\ng1\n\x93" + call + b".")
    if route == "build":
        return (b"\x80\x02ccollections\nOrderedDict\n)R" + b"N}" + _unicode("__setstate__") + b"cbuiltins\nexec\ns\x86b"
                + _unicode(code) + b"b.")
    if route == "persistent-id":
        return b"\x80\x02(" + _unicode("storage") + b"cbuiltins\nexec\n" + call + b"tQ."
    if route in EXT_CODES:
        size = {"ext1": 1, "ext2": 2, "ext4": 4}[route]
        opcode = {"ext1": b"\x82", "ext2": b"\x83", "ext4": b"\x84"}[route]
        return b"\x80\x02" + opcode + EXT_CODES[route].to_bytes(size, "little") + call + b"."
    raise ValueError(f"unknown route {route!r}")


def crafted_record(route: str, code: str) -> bytes:
    """A record (a ``torch.save`` archive, as DCP stores a value) whose ``data.pkl`` is
    :func:`crafted_pickle` of ``route``, or, for a route of :data:`NAME_LIES`, a harmless ``data.pkl``
    beside a lying member that holds the ``global`` route."""
    import io
    import warnings
    import zipfile

    buffer = io.BytesIO()
    torch.save("harmless", buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    lies = route in NAME_LIES
    payload = crafted_pickle("global" if lies else route, code)
    out = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name, which is the point
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
            folder = source.namelist()[0].split("/", 1)[0]
            for info in source.infolist():
                archive.writestr(info.filename, source.read(info) if lies or not info.filename.endswith("/data.pkl") else payload)
            if lies:
                name = {"duplicate-data-pkl": f"{folder}/data.pkl", "other-folder": "other/data.pkl",
                        "dot-dot": f"{folder}/../data.pkl"}[route]
                archive.writestr(name, payload)
    return out.getvalue()


def repacked_record(path: Path, fqn: str, offset: tuple[int, ...] | None = None, *, zip64: bool = False) -> bytes:
    """The record of ``fqn`` (the chunk at ``offset``) in the checkpoint at ``path``, written again as
    zip tools write an archive: every entry with an extra field (Info-ZIP's extended timestamp, which
    ``zip`` adds; a zip64 record of 4 GiB and more carries one too) in its local header and in the
    central directory, and a comment. The same members and bytes: ``torch.load`` reads it alike.

    ``zip64``: in the zip64 form a record of 4 GiB or more has (torch.save writes it so for an embedding
    or optimizer state of that size): each entry's sizes and offset in a zip64 extra field, with
    0xFFFFFFFF in their usual fields, and the directory found through a zip64 end record and locator."""
    import io
    import zipfile
    from unittest import mock

    for index, info in read_metadata(path).storage_data.items():
        if index.fqn == fqn and (offset is None or tuple(index.offset) == offset):
            with open(dcp_directory(path) / info.relative_path, "rb") as f:
                f.seek(info.offset)
                record = f.read(info.length)
            break
    else:
        no_record(path, fqn, offset)
    source = zipfile.ZipFile(io.BytesIO(record))
    out = io.BytesIO()
    # zipfile writes the zip64 form only for sizes and offsets past ZIP64_LIMIT, which it reads at write
    # time: below every value, it writes that form for a record of any size.
    with mock.patch.object(zipfile, "ZIP64_LIMIT", -1 if zip64 else zipfile.ZIP64_LIMIT):
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
            for number, info in enumerate(source.infolist()):
                entry = zipfile.ZipInfo(info.filename, date_time=(2026, 1, 1, 0, 0, 0))
                entry.extra = struct.pack("<HHBI", 0x5455, 5, 1, 1767225600 + number)  # "UT": flags, mtime
                entry.comment = f"entry {number}".encode()
                archive.writestr(entry, _member_bytes(record, info))
    repacked = bytearray(out.getvalue())
    if zip64:
        if repacked.rfind(b"PK\x06\x06") < 0:
            raise AssertionError("test set-up: zipfile wrote no zip64 end record")
        # In the classic end record, a record of 4 GiB has its entry count and directory size (they fit)
        # and 0xFFFFFFFF for the directory's offset (it does not: look in the zip64 record), as
        # torch.save's writer (miniz) writes them.
        end = repacked.rfind(b"PK\x05\x06")
        repacked[end + 16:end + 20] = struct.pack("<I", 0xFFFFFFFF)
    return bytes(repacked)


def _member_bytes(record: bytes, info: Any) -> bytes:
    """The stored bytes of zip member ``info`` of ``record``, read from its local header on: records
    may carry no CRC-32 (``zipfile``'s reader would refuse them), and every record member is stored."""
    start = member_data_start(record, info)
    return record[start : start + info.compress_size]


def replace_record(path: Path, fqn: str, data: bytes, offset: tuple[int, ...] | None = None) -> str:
    """Make the checkpoint at ``path`` store ``data`` as the record of ``fqn`` (the chunk at
    ``offset``): appended to the data file that holds it, and the metadata (our own file, written a
    moment ago) pointed at it. Returns the data file's path relative to ``path``."""
    import dataclasses

    meta = dcp_directory(path) / ".metadata"
    with open(meta, "rb") as f:
        metadata = pickle.load(f)  # our own file, written by the save a moment ago
    for index, info in metadata.storage_data.items():
        if index.fqn == fqn and (offset is None or tuple(index.offset) == offset):
            with open(meta.parent / info.relative_path, "ab") as f:
                start = f.tell()
                f.write(data)
            metadata.storage_data[index] = dataclasses.replace(info, offset=start, length=len(data))
            with open(meta, "wb") as f:
                pickle.dump(metadata, f)
            return in_checkpoint(path, info.relative_path)
    no_record(path, fqn, offset)


def reverse_chunks(path: Path) -> None:
    """Make the ``.metadata`` of the checkpoint at ``path`` (our own file, written a moment ago) list
    each tensor's chunks in reverse. DCP's format does not order them: a writer that lists them by rank
    lists a 2-D mesh's column-major shards out of offset order."""
    import dataclasses

    meta = dcp_directory(path) / ".metadata"
    with open(meta, "rb") as f:
        metadata = pickle.load(f)  # our own file, written by the save a moment ago
    for key, entry in metadata.state_dict_metadata.items():
        if hasattr(entry, "chunks"):
            metadata.state_dict_metadata[key] = dataclasses.replace(entry, chunks=entry.chunks[::-1])
    with open(meta, "wb") as f:
        pickle.dump(metadata, f)
