"""How the plans, write results and metadata of a save travel between ranks: compactly, when pickled.

A fast path: it exists for speed only (figures: docs/benchmark-results.md, "Why the fast paths"), and
while :func:`reference.checkpoint.fast_paths.enabled` is false, the plain path, a :class:`Compact`
pickles its value as it is (DCP's dataclasses).

A save gathers every rank's ``SavePlan`` to the coordinator, scatters the global plans back, then
gathers every rank's ``WriteResult`` list and broadcasts the checkpoint's ``Metadata``
(:func:`reference.checkpoint.api.save`). Pickled as they are,
these are slow to send: each write item is five nested dataclasses (pickled through ``copyreg``, with
their ``__dict__``) holding three ``torch.Size`` and a dtype, layout and memory format (each through a
Python-level ``__reduce__``), a few times slower to pickle and unpickle than the form below and
a visible part of a save at world size 2 (figures: docs/benchmark-results.md, "Why the fast paths").

:class:`Compact` wraps such a value. Unpickled, it is the value again, rebuilt as an equal object of
the same types with the same fields (index hints included), but it travels as tuples of plain
values; until it is pickled it is only a wrapper, so a save on one rank, where nothing is pickled,
pays nothing. :func:`unwrap` gives the value whichever way it came. A value this module does not know
field for field (a planner's own item subclass, a storage writer's own ``storage_data``, a torch whose
dataclasses gained a field) pickles as it is: the compact form is never lossy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import BytesIOWriteData, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from reference.checkpoint import fast_paths
from reference.checkpoint.metadata_io import StorageInfo

__all__ = ["Compact", "unwrap", "pack_items"]

T = TypeVar("T")

#: The fields this module packs, class by class. If torch's classes have others (another torch
#: version), nothing is packed: values pickle as they are.
_PACKED_FIELDS: dict[type, tuple[str, ...]] = {
    WriteItem: ("index", "type", "bytes_io_data", "tensor_data"),
    MetadataIndex: ("fqn", "offset", "index"),
    BytesIOWriteData: ("nbytes",),
    TensorWriteData: ("chunk", "properties", "size"),
    ChunkStorageMetadata: ("offsets", "sizes"),
    TensorProperties: ("dtype", "layout", "requires_grad", "memory_format", "pin_memory"),
    WriteResult: ("index", "size_in_bytes", "storage_data"),
    Metadata: ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"),
    TensorStorageMetadata: ("properties", "size", "chunks"),
    BytesStorageMetadata: (),
}
_KNOWN_FIELDS = all(tuple(f.name for f in dataclasses.fields(cls)) == names for cls, names in _PACKED_FIELDS.items())
#: StorageInfo's fields travel as a tuple in their own order (whatever this torch's are).
_STORAGE_INFO_FIELDS = tuple(f.name for f in dataclasses.fields(StorageInfo))
_ITEM_TYPES = {kind.value: kind for kind in WriteItemType}
#: Each item type's value by the member's identity: an enum's ``.value`` is a Python-level property
#: (about 1 us an item), and hashing a member calls Python too.
_ITEM_CODES = {id(kind): kind.value for kind in WriteItemType}


class Compact(Generic[T]):
    """``value`` (a ``SavePlan``, a list of ``WriteResult`` or a ``Metadata``), pickled in a compact
    form; unpickling gives back the value itself, not the wrapper."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        value: Any = self.value
        if _KNOWN_FIELDS and fast_paths.enabled():
            # Exactly a SavePlan: a subclass may have fields that dataclasses.replace cannot set.
            if type(value) is SavePlan and (rows := pack_items(value.items)) is not None:
                return _unpack_plan, (dataclasses.replace(value, items=[]), *rows)
            if isinstance(value, list) and (results := _pack_results(value)) is not None:
                return _unpack_results, (results,)
            if type(value) is Metadata and (packed := _pack_metadata(value)) is not None:
                return _unpack_metadata, (dataclasses.replace(value, state_dict_metadata={}, storage_data=None), *packed)
        return _same, (value,)


def unwrap(value: Compact[T]) -> T:
    """The value of a :class:`Compact` that was sent: the wrapper's value when it was not pickled on
    its way (one rank), else what was unpickled, the value itself (statically still a ``Compact``)."""
    return value.value if isinstance(value, Compact) else value


def _same(value: T) -> T:
    return value


def pack_items(items: list[WriteItem]) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]] | None:
    """(one row per item, the distinct tensor properties as tuples), or None if an item is not made of
    exactly the types and fields this module rebuilds."""
    rows: list[tuple[Any, ...]] = []
    properties: dict[tuple[Any, ...], int] = {}
    for item in items:
        if type(item) is not WriteItem or type(index := item.index) is not MetadataIndex:
            return None
        offset = None if index.offset is None else tuple(index.offset)
        tensor = item.tensor_data
        if tensor is None:
            data = item.bytes_io_data
            if data is not None and type(data) is not BytesIOWriteData:
                return None
            rows.append((index.fqn, offset, index.index, _ITEM_CODES[id(item.type)], None if data is None else data.nbytes))
            continue
        chunk, props = tensor.chunk, tensor.properties
        if (
            item.bytes_io_data is not None
            or type(tensor) is not TensorWriteData
            or type(chunk) is not ChunkStorageMetadata
            or type(props) is not TensorProperties
            or type(chunk.offsets) is not torch.Size
            or type(chunk.sizes) is not torch.Size
            or type(tensor.size) is not torch.Size
        ):
            return None
        key = (props.dtype, props.layout, props.requires_grad, props.memory_format, props.pin_memory)
        rows.append((index.fqn, offset, index.index, _ITEM_CODES[id(item.type)], tuple(chunk.offsets), tuple(chunk.sizes),
                     properties.setdefault(key, len(properties)), tuple(tensor.size)))
    return rows, list(properties)


def _unpack_plan(shell: SavePlan, rows: list[tuple[Any, ...]], properties: list[tuple[Any, ...]]) -> SavePlan:
    items: list[WriteItem] = []
    for row in rows:
        if len(row) == 5:  # a non-tensor value
            fqn, offset, hint, kind, nbytes = row
            items.append(WriteItem(index=MetadataIndex(fqn, offset, hint), type=_ITEM_TYPES[kind],
                                   bytes_io_data=None if nbytes is None else BytesIOWriteData(nbytes)))
            continue
        fqn, offset, hint, kind, chunk_offsets, chunk_sizes, props, size = row
        items.append(WriteItem(
            index=MetadataIndex(fqn, offset, hint),
            type=_ITEM_TYPES[kind],
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(torch.Size(chunk_offsets), torch.Size(chunk_sizes)),
                properties=TensorProperties(*properties[props]),  # one object per item, as before
                size=torch.Size(size),
            ),
        ))
    return dataclasses.replace(shell, items=items)


def _pack_results(results: list[Any]) -> list[tuple[Any, ...]] | None:
    """One row per result, or None if a result is not exactly a ``WriteResult`` with a
    ``MetadataIndex`` and a ``StorageInfo``."""
    rows: list[tuple[Any, ...]] = []
    for result in results:
        index, info = getattr(result, "index", None), getattr(result, "storage_data", None)
        if type(result) is not WriteResult or type(index) is not MetadataIndex or type(info) is not StorageInfo:
            return None
        offset = None if index.offset is None else tuple(index.offset)
        rows.append((index.fqn, offset, index.index, result.size_in_bytes,
                     tuple(getattr(info, name) for name in _STORAGE_INFO_FIELDS)))
    return rows


def _unpack_results(rows: list[tuple[Any, ...]]) -> list[WriteResult]:
    return [
        WriteResult(index=MetadataIndex(fqn, offset, hint), size_in_bytes=size, storage_data=StorageInfo(*info))
        for fqn, offset, hint, size, info in rows
    ]


def _pack_metadata(metadata: Metadata) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]] | None:
    """(one row per key in order, the distinct tensor properties, one row per storage entry in order),
    or None if an entry is not made of exactly the types and fields this module rebuilds."""
    rows: list[tuple[Any, ...]] = []
    properties: dict[tuple[Any, ...], int] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if type(entry) is BytesStorageMetadata:
            rows.append((fqn,))
            continue
        if type(entry) is not TensorStorageMetadata:
            return None
        props, chunks = entry.properties, entry.chunks
        if type(props) is not TensorProperties or type(entry.size) is not torch.Size or type(chunks) is not list:
            return None
        packed_chunks = []
        for chunk in chunks:
            if type(chunk) is not ChunkStorageMetadata or type(chunk.offsets) is not torch.Size or type(chunk.sizes) is not torch.Size:
                return None
            packed_chunks.append((tuple(chunk.offsets), tuple(chunk.sizes)))
        key = (props.dtype, props.layout, props.requires_grad, props.memory_format, props.pin_memory)
        rows.append((fqn, properties.setdefault(key, len(properties)), tuple(entry.size), packed_chunks))
    storage = metadata.storage_data
    if type(storage) is not dict:
        return None
    entries: list[tuple[Any, ...]] = []
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(info) is not StorageInfo:
            return None
        offset = None if index.offset is None else tuple(index.offset)
        entries.append((index.fqn, offset, index.index, tuple(getattr(info, name) for name in _STORAGE_INFO_FIELDS)))
    return rows, list(properties), entries


def _unpack_metadata(shell: Metadata, rows: list[tuple[Any, ...]], properties: list[tuple[Any, ...]],
                     entries: list[tuple[Any, ...]]) -> Metadata:
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for row in rows:
        if len(row) == 1:  # a non-tensor value
            state_dict_metadata[row[0]] = BytesStorageMetadata()
            continue
        fqn, props, size, chunks = row
        state_dict_metadata[fqn] = TensorStorageMetadata(
            properties=TensorProperties(*properties[props]),  # one object per key, as before
            size=torch.Size(size),
            chunks=[ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in chunks],
        )
    storage_data = {MetadataIndex(fqn, offset, hint): StorageInfo(*info) for fqn, offset, hint, info in entries}
    return dataclasses.replace(shell, state_dict_metadata=state_dict_metadata, storage_data=storage_data)
