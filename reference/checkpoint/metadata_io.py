"""Reading and writing the ``.metadata`` file of a DCP checkpoint without trusting it.

DCP stores :class:`~torch.distributed.checkpoint.metadata.Metadata` as a pickle, and a pickle can run
arbitrary code when loaded. :func:`read_metadata_file` unpickles with an allow-list: the DCP metadata
dataclasses, the filesystem storage record, ``torch.Size`` and the dtype/layout/memory-format
constants, ``pathlib`` paths and a few builtins. Anything else (``os.system``, ``builtins.eval``, a
class of the user's) is refused before it is imported, with :class:`UnsafeCheckpointError`.
The checkpoint inspector (``conformance/cli/ckpt_inspect.py``) reads metadata through this module too.
"""

from __future__ import annotations

import io
import os
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

# Private, unavoidable: upstream's FileSystemReader looks up every item's file, offset and length in
# this exact class inside Metadata.storage_data, so a checkpoint that torch can read must pickle it.
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

from reference.checkpoint.errors import CheckpointFormatError, UnsafeCheckpointError

__all__ = [
    "METADATA_FILE",
    "SUPPORTED_VERSIONS",
    "CURRENT_VERSION",
    "StorageInfo",
    "read_metadata_file",
    "load_metadata",
    "dump_metadata",
]

#: File name of the metadata, as DCP names it.
METADATA_FILE = ".metadata"
#: The format version written (DCP's ``CURRENT_DCP_VERSION``) and the versions this reader knows.
#: ``None`` is what writers before the version field (torch < 2.4) left.
CURRENT_VERSION = "1.0.0"
SUPPORTED_VERSIONS: frozenset[str | None] = frozenset({None, "1.0.0"})

StorageInfo = _StorageInfo

def _layout(name: str) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout``, how torch pickles a layout: name -> layout."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise UnsafeCheckpointError(f"{name!r} is not a torch layout")
    return value


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    )
}
_ALLOWED.update(
    {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _layout,
        ("collections", "OrderedDict"): OrderedDict,
        ("pathlib", "PosixPath"): Path,
        ("pathlib", "WindowsPath"): Path,
        ("pathlib", "PurePosixPath"): Path,
        ("pathlib", "PureWindowsPath"): Path,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the allow-listed globals; persistent ids are refused."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch":
            # torch.float32, torch.strided, torch.contiguous_format pickle as attributes of torch.
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise UnsafeCheckpointError(
            f"refusing to load {module}.{name}: the metadata may only hold DCP metadata classes, "
            "torch.Size, dtypes and builtins (was this file written by torch.distributed.checkpoint?)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"refusing persistent id {pid!r}: DCP metadata has none")


def load_metadata(stream: BinaryIO, *, source: str = "<stream>") -> Metadata:
    """Unpickle DCP metadata from ``stream`` with the allow-list, check its type and version.

    Raises :class:`UnsafeCheckpointError` for a forbidden global and :class:`CheckpointFormatError`
    for a corrupt or truncated pickle, a wrong object type or an unknown format version."""
    try:
        metadata = _MetadataUnpickler(stream).load()
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{source}: {exc}") from None
    except Exception as exc:  # a corrupt pickle raises any of a dozen types
        raise CheckpointFormatError(
            f"{source}: corrupt checkpoint metadata ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointFormatError(
            f"{source}: expected a torch.distributed.checkpoint Metadata, got {type(metadata).__name__}"
        )
    version = getattr(metadata, "version", None)
    if version not in SUPPORTED_VERSIONS:
        known = ", ".join(sorted(v for v in SUPPORTED_VERSIONS if v))
        raise CheckpointFormatError(
            f"{source}: checkpoint format version {version!r} is not supported by this reader "
            f"(supported: {known}); it was written by a newer or foreign writer"
        )
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise CheckpointFormatError(
            f"{source}: corrupt checkpoint metadata: state_dict_metadata and storage_data must be dicts, got "
            f"{type(metadata.state_dict_metadata).__name__} and {type(metadata.storage_data).__name__}"
        )
    return metadata


def read_metadata_file(checkpoint_dir: str | os.PathLike[str]) -> Metadata:
    """The metadata of the checkpoint in ``checkpoint_dir``, read safely (see :func:`load_metadata`).

    Raises :class:`CheckpointFormatError` if the file is missing: a save writes it last, so a
    directory without it holds no complete checkpoint."""
    path = Path(checkpoint_dir) / METADATA_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        where = "directory does not exist" if not Path(checkpoint_dir).exists() else "no complete checkpoint"
        raise CheckpointFormatError(
            f"{path}: checkpoint metadata not found ({where}; a save writes it last, so an interrupted "
            "save leaves none)"
        ) from None
    except OSError as exc:
        raise CheckpointFormatError(f"{path}: cannot read checkpoint metadata: {exc}") from exc
    return load_metadata(io.BytesIO(data), source=str(path))


def dump_metadata(metadata: Metadata, stream: BinaryIO) -> None:
    """Pickle ``metadata`` as DCP does, so upstream's ``FileSystemReader`` reads it."""
    pickle.dump(metadata, stream)
