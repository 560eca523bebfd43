"""The suite's own reading of a checkpoint's files: an oracle independent of the implementations under
test and of ``reference/`` (as :mod:`conformance.fqn` is for names), so that a fork's failure can never
come from the reference's reader.

A checkpoint in DCP's layout (SPEC ML-25) is a directory with ``.metadata`` and data files; the
metadata maps each chunk to ``(file, offset, length)`` of a record, and each tensor record is a
``torch.save`` archive (a zip file) whose storage bytes are one stored member. The metadata is read
with upstream's public ``FileSystemReader``; records are read with :mod:`zipfile`.
"""

from __future__ import annotations

import io
import struct
import zipfile
from os import PathLike
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["dcp_directory", "member_data_start", "read_metadata", "storage_bytes_range"]

#: Size of a zip local file header before its name and extra field (APPNOTE 4.3.7).
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")


def dcp_directory(path: str | PathLike[str]) -> Path:
    """The directory that holds the DCP files (``.metadata`` and data files) of the checkpoint saved to
    ``path``: ``path`` itself, or, for a stack that keeps each save in a folder of its own under the
    checkpoint directory (torchtitan's ``step-<N>``), the folder below ``path`` with a ``.metadata``
    written last. ``path`` itself when none holds one (the caller's read then fails naming it)."""
    root = Path(path)
    if (root / ".metadata").exists() or not root.is_dir():
        return root
    found = [meta.parent for meta in root.rglob(".metadata") if meta.is_file()]
    if not found:
        return root
    return max(found, key=lambda folder: ((folder / ".metadata").stat().st_mtime_ns, str(folder)))


def read_metadata(path: str | PathLike[str]) -> Metadata:
    """The checkpoint's metadata, as upstream's ``FileSystemReader`` reads it (from :func:`dcp_directory`)."""
    return FileSystemReader(dcp_directory(path)).read_metadata()


def storage_bytes_range(file: Any, offset: int, length: int) -> tuple[int, int]:
    """``(start, end)`` file positions of the stored bytes of the tensor record at ``[offset, offset +
    length)`` of the open binary ``file``: its one storage member (``<archive>/data/<key>``), which is
    stored uncompressed. Raises ValueError when the record is not such an archive."""
    file.seek(offset)
    blob = file.read(length)
    try:
        archive = zipfile.ZipFile(io.BytesIO(blob))
    except zipfile.BadZipFile as exc:
        raise ValueError(f"the record at {offset} (+{length}) is not a torch.save archive: {exc}") from None
    storages = [info for info in archive.infolist() if "/data/" in info.filename and not info.filename.endswith("/")]
    if len(storages) != 1 or storages[0].compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"the record at {offset} (+{length}) does not hold one uncompressed storage: {[i.filename for i in storages]}")
    info = storages[0]
    start = offset + member_data_start(blob, info)
    return start, start + info.file_size


def member_data_start(archive: bytes, info: zipfile.ZipInfo) -> int:
    """Where the stored bytes of member ``info`` of the zip ``archive`` begin: after its local header,
    whose name and extra field may differ from the central directory's (``zipfile`` reads the member
    only after checking a CRC-32 that records may not carry). Raises ValueError without a local header."""
    fields = _LOCAL_HEADER.unpack_from(archive, info.header_offset)
    if fields[0] != b"PK\x03\x04":
        raise ValueError(f"no local header of {info.filename!r} at {info.header_offset}")
    name_length, extra_length = fields[9], fields[10]
    return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
