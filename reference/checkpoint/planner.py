"""The save and load planners: what each rank writes and reads, decided from plain values.

Planners implement DCP's :class:`~torch.distributed.checkpoint.planner.SavePlanner` and
:class:`~torch.distributed.checkpoint.planner.LoadPlanner` and never talk to a process group: they are
given ``is_coordinator`` and the other ranks' plans as values (the collectives live in
:mod:`reference.checkpoint.collective`), so every decision here can be tested in one process.

Call order (DCP's), and which ranks make each call:

save: ``set_up_planner`` (all) -> ``create_local_plan`` (all) -> ``create_global_plan`` (coordinator,
      with every rank's local plan) -> ``finish_plan`` (all, with its part of the global plan) ->
      ``resolve_data`` (all, once per write item, from the storage writer).
load: ``set_up_planner`` (all) -> ``create_local_plan`` (all) -> ``create_global_plan`` (coordinator)
      -> ``finish_plan`` (all) -> ``resolve_tensor`` / ``load_bytes`` (all, from the storage reader)
      -> :meth:`ReferenceLoadPlanner.commit` (all, once every rank has read successfully; undone on
      every rank when it fails on any).

The planning calls and ``resolve_data`` run without autograd (``torch.no_grad``), and ``resolve_tensor``
narrows a detached target: nothing they make is differentiated, and a DTensor's ``to_local()`` is then
a plain read of its local tensor instead of an autograd function call per tensor, a large part of
planning a checkpoint of many DTensors.
The load's ``create_global_plan`` returns the ranks' plans unchanged, so :func:`reference.checkpoint.load`
agrees on the outcome of planning without sending the plans, unless another planner or reader is given.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import heapq
import io
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, cast

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.tensor import DTensor

from reference.checkpoint import fast_paths, plan_cache
from reference.checkpoint.errors import CheckpointError, CheckpointFormatError, StateDictError
from reference.checkpoint.flatten import FlatStateDict, ObjPath, flatten_state_dict, get_value, set_value
from reference.checkpoint.layout import Chunk, Overlap, check_tiling, local_chunk, overlaps
from reference.checkpoint.metadata_io import CURRENT_VERSION
from reference.checkpoint.records import read_object_record
from reference.host_bytes import element_bytes

__all__ = ["ReferenceSavePlanner", "ReferenceLoadPlanner", "LoadResult", "RankSaveData"]

#: At most this many problems are listed in one error message (the count of the rest is given).
_MAX_LISTED = 20


def _problems_error(what: str, problems: list[str]) -> StateDictError:
    listed = problems[:_MAX_LISTED]
    more = f"\n  ... and {len(problems) - len(listed)} more" if len(problems) > len(listed) else ""
    return StateDictError(f"{what}:\n  " + "\n  ".join(listed) + more)


def _shape(size: Any) -> list[int]:
    return list(size)


# -- save -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RankSaveData:
    """What a rank sends the coordinator besides its write items (``SavePlan.planner_data``)."""

    paths: dict[str, ObjPath]  #: flat key -> path in the nested state dict (stored in the metadata)
    object_digests: dict[str, str]  #: flat key -> sha256 of the serialized non-tensor value
    #: :func:`~reference.checkpoint.plan_cache.layout_key` of this plan (``None``: not cached)
    layout_key: str | None = None
    #: the digest of the global items this rank holds for that layout, from an earlier save
    held_items: str | None = None
    #: False: the plan was sent as its layout key alone (no items, no paths), since this rank was sent
    #: a global plan for that layout before (the coordinator kept it); see :meth:`ReferenceSavePlanner.
    #: needs_whole_plans`
    whole: bool = True


class ReferenceSavePlanner(SavePlanner):
    """Plans a save: one write item per local chunk and per non-tensor value; the coordinator keeps
    one copy of each replicated item (balancing bytes across ranks) and builds the metadata.

    Invariants checked by the coordinator, each an error naming the key and the ranks:
    every rank that holds a key holds the same kind of value with the same dtype and global shape;
    a non-tensor value is equal on every rank that holds it (a per-rank value has no place in a
    checkpoint that other world sizes load); the chunks of each tensor tile it exactly once.

    The plain path plans every save anew. With ``cache_plans`` (the default) and the fast paths on
    (:mod:`reference.checkpoint.fast_paths`), a save whose ranks bring the layouts of an earlier
    successful save reuses that save's global step instead of computing it again
    (:mod:`reference.checkpoint.plan_cache`: the entries are found by the layouts' digests, so a plan is
    never another layout's); the non-tensor values are still checked every save.
    """

    def __init__(self, *, cache_plans: bool = True) -> None:
        self.cache_plans = cache_plans
        self._tensors: dict[str, torch.Tensor] = {}
        self._objects: dict[str, bytes] = {}
        self._paths: dict[str, ObjPath] = {}
        self._offsets: dict[str, tuple[int, ...]] = {}  # key -> offsets of this rank's chunk
        self._layout_key: str | None = None
        self._whole_plan: SavePlan | None = None
        self.plan: SavePlan | None = None

    @torch.no_grad()
    def set_up_planner(
        self,
        state_dict: Mapping[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        flat = flatten_state_dict(state_dict)
        self._tensors, self._objects, self._paths = {}, {}, flat.paths
        problems = []
        for key, value in flat.values.items():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                if local.device.type == "meta":
                    problems.append(f"key {key!r}: tensor is on the meta device and holds no data to save")
                elif local.layout != torch.strided:
                    problems.append(f"key {key!r}: layout {local.layout} is not supported; save a strided tensor")
                else:
                    self._tensors[key] = value
            else:
                buffer = io.BytesIO()
                torch.save(value, buffer)  # DCP's encoding of non-tensor values, so torch reads them
                self._objects[key] = buffer.getvalue()
        if problems:
            raise _problems_error("cannot save this state dict", problems)

    @torch.no_grad()
    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        self._offsets = {}
        for key, value in self._tensors.items():
            chunk = local_chunk(key, value)
            if chunk is None:  # a DTensor on a mesh without this rank: other ranks write it
                continue
            self._offsets[key] = chunk.offsets
            local = value.to_local() if isinstance(value, DTensor) else value
            items.append(
                WriteItem(
                    index=MetadataIndex(key, chunk.offsets),
                    type=WriteItemType.SHARD if isinstance(value, DTensor) else WriteItemType.TENSOR,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes)),
                        properties=TensorProperties(dtype=local.dtype),
                        size=torch.Size(value.shape),
                    ),
                )
            )
        for key, data in self._objects.items():
            items.append(
                WriteItem(
                    index=MetadataIndex(key), type=WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(len(data))
                )
            )
        digests = {key: hashlib.sha256(data).hexdigest() for key, data in self._objects.items()}
        rank_data = RankSaveData(dict(self._paths), digests)
        self._layout_key = None
        if self._caching():
            rank_data = self._with_layout_key(items, rank_data)
        self._whole_plan = SavePlan(items, planner_data=rank_data)
        if rank_data.held_items is not None:
            # A layout this rank was sent a global plan for: the key stands for its items and paths
            # (the non-tensor values' digests still travel: they change between saves, ML-9), so a
            # later save gathers a constant size per rank, not every rank's items (ML-35).
            return SavePlan([], planner_data=dataclasses.replace(rank_data, paths={}, whole=False))
        return self._whole_plan

    def whole_local_plan(self) -> SavePlan:
        """This rank's last local plan with its items and paths, for a coordinator that does not hold
        the layout its key named (:meth:`needs_whole_plans`)."""
        if self._whole_plan is None:
            raise RuntimeError("whole_local_plan() before create_local_plan()")
        return self._whole_plan

    def needs_whole_plans(self, all_plans: list[SavePlan]) -> bool:
        """Coordinator: whether a rank sent its plan as its layout key alone and the global step of these
        layouts is not kept here (another coordinator planned it, or it was dropped): then every rank
        sends :meth:`whole_local_plan` and the global step is computed from those."""
        if all(getattr(plan.planner_data, "whole", True) for plan in all_plans):
            return False
        keys = tuple(getattr(plan.planner_data, "layout_key", None) for plan in all_plans)
        return None in keys or plan_cache.GLOBAL_PLANS.get(cast(tuple[str, ...], keys)) is None

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Every rank's part of the global plan and the metadata without storage data, computed by
        :meth:`_plan_globally` (the fast path: :meth:`_create_global_plan_cached`)."""
        if self._caching():
            return self._create_global_plan_cached(all_plans)
        plans, state_dict_metadata, paths = self._plan_globally(all_plans)
        metadata = Metadata(state_dict_metadata, planner_data=paths, version=CURRENT_VERSION)
        return [dataclasses.replace(plan, planner_data=None) for plan in plans], metadata

    def _plan_globally(
        self, all_plans: list[SavePlan]
    ) -> tuple[list[SavePlan], dict[str, TensorStorageMetadata | BytesStorageMetadata], dict[str, ObjPath]]:
        """The global step: check that the ranks agree, keep one copy of each replicated item, set the
        index hints, build the metadata's entries, check the tiling. Returns every rank's plan, the
        metadata's entries and its nesting paths."""
        problems = _check_rank_agreement(all_plans)
        if problems:
            raise _problems_error("the ranks' state dicts disagree", problems)
        plans = _dedup(all_plans)
        state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        chunks: dict[str, list[tuple[tuple[int, ...], int, int]]] = {}  # key -> (offsets, rank, position)
        for rank, plan in enumerate(plans):
            for position, item in enumerate(plan.items):
                key = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    state_dict_metadata[key] = BytesStorageMetadata()
                    continue
                assert item.tensor_data is not None  # internal invariant: tensor items carry tensor_data
                state_dict_metadata.setdefault(
                    key,
                    TensorStorageMetadata(properties=item.tensor_data.properties, size=item.tensor_data.size, chunks=[]),
                )
                chunks.setdefault(key, []).append((tuple(item.tensor_data.chunk.offsets), rank, position))
        # Each key's chunks are listed in offset order, whichever rank writes each (after deduplication
        # HSDP's pieces are written by ranks of every replica), so that a rank's load finds its own by
        # binary search (ML-37). The index hint lets a reader find the chunk without a search at all.
        hints: dict[tuple[int, int], int] = {}
        for key, entries in chunks.items():
            entries.sort()
            md = state_dict_metadata[key]
            assert isinstance(md, TensorStorageMetadata)
            for hint, (_, rank, position) in enumerate(entries):
                tensor_data = plans[rank].items[position].tensor_data
                assert tensor_data is not None
                md.chunks.append(tensor_data.chunk)
                hints[rank, position] = hint
        new_plans = [
            dataclasses.replace(plan, items=[
                item if item.type == WriteItemType.BYTE_IO
                else dataclasses.replace(item, index=MetadataIndex(item.index.fqn, item.index.offset, hints[rank, position]))
                for position, item in enumerate(plan.items)
            ])
            for rank, plan in enumerate(plans)
        ]
        tiling = [
            check_tiling(key, md.size, [Chunk(c.offsets, c.sizes) for c in md.chunks])  # torch.Size is a tuple
            for key, md in state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        ]
        problems = [p for p in tiling if p is not None]
        if problems:
            raise _problems_error("the ranks' shards do not tile their tensors", problems)
        paths: dict[str, ObjPath] = {}
        for plan in all_plans:
            paths.update(plan.planner_data.paths)
        return new_plans, state_dict_metadata, paths

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """This rank's part of the global plan (the fast path: :meth:`_with_held_items`)."""
        if self._caching():
            new_plan = self._with_held_items(new_plan)
        self.plan = new_plan
        return new_plan

    @torch.no_grad()
    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """The tensor (or serialized object) to write for ``write_item``. Called once per item,
        lazily, by the storage writer. A CPU tensor owns exactly its bytes; a tensor on another device
        is returned as it is, and the storage writer copies it to the host (as upstream's does)."""
        key = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._objects[key])
        value = self._tensors[key]
        local = (value.to_local() if isinstance(value, DTensor) else value).detach()
        assert write_item.tensor_data is not None  # internal invariant: tensor items carry tensor_data
        piece = write_item.tensor_data.chunk
        if tuple(piece.sizes) != tuple(local.shape):  # a piece of a replicated chunk (_pieces)
            for dim, (start, base, length) in enumerate(zip(piece.offsets, self._offsets[key], piece.sizes)):
                local = local.narrow(dim, start - base, length)
        if local.device.type != "cpu":
            return local
        if local.untyped_storage().nbytes() != local.numel() * local.element_size():
            # torch.save writes a view's whole storage: write only this tensor's bytes. Where they lie
            # together (a piece of a replicated chunk, cut along its first dimension), a tensor over the
            # same memory holds exactly them: a copy would be one more of the piece in memory, beside
            # the staged copies AS-5 bounds. A lazy conjugate or negation is the clone's to resolve.
            if local.is_contiguous() and local.numel() > 0 and not (local.is_conj() or local.is_neg()):
                return torch.frombuffer(element_bytes(local), dtype=local.dtype, count=local.numel()).view(local.shape)
            return local.clone()
        return local

    # -- the plan cache: a fast path (see reference.checkpoint.plan_cache) ---------------------------
    #
    # It exists for speed only: at hundreds of ranks the global step of every save is seconds
    # (figures: docs/benchmark-results.md, "Why the fast paths", and plan_cache's docstring).

    def _caching(self) -> bool:
        """Whether this save reuses kept plans: ``cache_plans``, and the fast paths are on."""
        return self.cache_plans and fast_paths.enabled()

    def _with_layout_key(self, items: list[WriteItem], rank_data: RankSaveData) -> RankSaveData:
        """``rank_data`` with this rank's layout key and the digest of the global items it holds for it."""
        self._layout_key = plan_cache.layout_key(items, self._paths)
        held = plan_cache.RANK_ITEMS.get(self._layout_key) if self._layout_key is not None else None
        return dataclasses.replace(rank_data, layout_key=self._layout_key, held_items=held[0] if held is not None else None)

    def _create_global_plan_cached(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """:meth:`create_global_plan`, each rank's planner data a :class:`~reference.checkpoint.
        plan_cache.GlobalItems`; the global step taken from :data:`~reference.checkpoint.plan_cache.
        GLOBAL_PLANS` when every rank's layout is one planned before (only the non-tensor values are
        checked then), else computed by :meth:`_plan_globally` and kept."""
        keys = tuple(getattr(plan.planner_data, "layout_key", None) for plan in all_plans)
        cache_key = cast(tuple[str, ...], keys) if self.cache_plans and None not in keys else None
        entry = plan_cache.GLOBAL_PLANS.get(cache_key) if cache_key is not None else None
        if entry is None:
            if self.needs_whole_plans(all_plans):  # the caller skipped the round that asks for them
                raise CheckpointError("save planning: a rank sent its plan as a layout key this coordinator does not hold")
            plans, state_dict_metadata, paths = self._plan_globally(all_plans)
            rank_items = tuple(tuple(plan.items) for plan in plans)
            digests = tuple(plan_cache.items_digest(list(items)) for items in rank_items)
            entry = plan_cache.GlobalEntry(rank_items, digests, state_dict_metadata, paths)
            if cache_key is not None:
                plan_cache.GLOBAL_PLANS.put(cache_key, entry)
        else:
            problems = _check_object_digests(all_plans)
            if problems:
                raise _problems_error("the ranks' state dicts disagree", problems)
        new_plans = []
        for plan, items, digest in zip(all_plans, entry.items, entry.digests):
            held = digest is not None and getattr(plan.planner_data, "held_items", None) == digest
            new_plans.append(dataclasses.replace(plan, items=list(items), planner_data=plan_cache.GlobalItems(digest, held)))
        # Fresh entries and chunk lists: what is done to this save's metadata cannot reach the kept one.
        state_dict_metadata = {
            key: md if isinstance(md, BytesStorageMetadata) else TensorStorageMetadata(md.properties, md.size, list(md.chunks))
            for key, md in entry.state_dict_metadata.items()
        }
        metadata = Metadata(state_dict_metadata, planner_data=dict(entry.paths), version=CURRENT_VERSION)
        return new_plans, metadata

    def _with_held_items(self, new_plan: SavePlan) -> SavePlan:
        """:meth:`finish_plan`'s plan, sent without its items when the rank said it holds them
        (:class:`~reference.checkpoint.plan_cache.GlobalItems`): they are taken from this rank's store,
        by its layout key and the coordinator's digest; items that came are kept there for later saves."""
        data = new_plan.planner_data
        if isinstance(data, plan_cache.GlobalItems) and data.digest is not None and self._layout_key is not None:
            held = plan_cache.RANK_ITEMS.get(self._layout_key)
            if data.held and not new_plan.items:
                if held is None or held[0] != data.digest:
                    raise CheckpointError(
                        "save planning: the coordinator sent this rank's plan as the one it holds "
                        f"(digest {data.digest[:12]}), but this rank holds {'none' if held is None else held[0][:12]}"
                    )
                new_plan = dataclasses.replace(new_plan, items=list(held[1]))
            elif held is None or held[0] != data.digest:
                plan_cache.RANK_ITEMS.put(self._layout_key, (data.digest, tuple(new_plan.items)))
        return new_plan


def _signature(item: WriteItem) -> tuple[Any, ...]:
    if item.type == WriteItemType.BYTE_IO:
        return ("a non-tensor value",)
    assert item.tensor_data is not None
    return ("a tensor", item.tensor_data.properties.dtype, tuple(item.tensor_data.size))


def _describe(signature: tuple[Any, ...]) -> str:
    if len(signature) == 1:
        return str(signature[0])
    return f"a {signature[1]} tensor of shape {list(signature[2])}"


def _check_rank_agreement(all_plans: list[SavePlan]) -> list[str]:
    """Every key held as the same kind of value, dtype and global shape on every rank that holds it,
    and every non-tensor value equal on every rank that holds it."""
    problems = []
    signatures: dict[str, dict[tuple[Any, ...], list[int]]] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            holders = signatures.setdefault(item.index.fqn, {}).setdefault(_signature(item), [])
            if not holders or holders[-1] != rank:  # ranks come in order: a membership test would be O(ranks)
                holders.append(rank)
    for key, by_signature in signatures.items():
        if len(by_signature) > 1:
            seen = "; ".join(f"ranks {ranks} hold {_describe(sig)}" for sig, ranks in by_signature.items())
            problems.append(f"key {key!r}: {seen}")
    return problems + _check_object_digests(all_plans)


def _check_object_digests(all_plans: list[SavePlan]) -> list[str]:
    """Every non-tensor value equal on every rank that holds it (ML-9): checked every save, since the
    values change between saves of one layout."""
    problems = []
    digests: dict[str, dict[str, list[int]]] = {}
    for rank, plan in enumerate(all_plans):
        for key, digest in plan.planner_data.object_digests.items():
            digests.setdefault(key, {}).setdefault(digest, []).append(rank)
    for key, by_digest in digests.items():
        if len(by_digest) > 1:
            groups = "; ".join(f"ranks {ranks}" for ranks in by_digest.values())
            problems.append(
                f"key {key!r}: the non-tensor value differs across ranks ({groups} agree); a per-rank value "
                "cannot be resharded: give each rank its own key or make the value equal on all ranks"
            )
    return problems


def _item_bytes(item: WriteItem) -> int:
    """Bytes this item writes: its chunk's for a tensor (not the global tensor's), its size for an object."""
    if item.tensor_data is not None:
        dtype = item.tensor_data.properties.dtype
        return math.prod(item.tensor_data.chunk.sizes) * dtype.itemsize
    return item.bytes_io_data.nbytes if item.bytes_io_data is not None else 0


#: What writing one record costs beyond its bytes, in bytes written in the same time: a record's fixed
#: work (resolving the item, the record's header and tail, its result) at page-cache write speed
#: (the figures are in docs/benchmark-results.md). Balancing by bytes alone handed one rank a run of
#: small replicated items (an optimizer's 4-byte ``step`` tensors), all of whose fixed costs the save
#: then waited for.
RECORD_COST_BYTES = 32 * 1024


def _item_cost(item: WriteItem) -> int:
    """What writing ``item`` costs, in bytes: its bytes and a record's fixed cost."""
    return _item_bytes(item) + RECORD_COST_BYTES


#: A replicated chunk of at least twice this many bytes is cut along its first dim into pieces of about
#: this size, each written by another of its holders (replica-parallel writes): whole, one large
#: replicated tensor (an embedding) kept one rank writing while the others waited in the commit
#: (marin-community/marin PR #8140, issue 47). A piece this large costs 1% more than its bytes (RECORD_COST_BYTES).
REPLICA_PIECE_BYTES = 4 << 20


def _pieces(item: WriteItem, holders: int) -> list[WriteItem]:
    """``item`` cut along the first dim of its chunk into at most ``holders`` pieces of at least
    :data:`REPLICA_PIECE_BYTES` (``torch.chunk``'s rule), each its own item at its own offsets; the item
    itself when it is not worth cutting."""
    data = item.tensor_data
    if data is None or holders < 2 or not data.chunk.sizes or data.chunk.sizes[0] < 2:
        return [item]
    count = min(holders, _item_bytes(item) // REPLICA_PIECE_BYTES, data.chunk.sizes[0])
    if count < 2:
        return [item]
    rows, offsets, sizes = data.chunk.sizes[0], list(data.chunk.offsets), list(data.chunk.sizes)
    step = -(-rows // count)
    pieces = []
    for start in range(0, rows, step):
        piece_offsets = torch.Size([offsets[0] + start, *offsets[1:]])
        piece_sizes = torch.Size([min(step, rows - start), *sizes[1:]])
        chunk = ChunkStorageMetadata(piece_offsets, piece_sizes)
        pieces.append(dataclasses.replace(item, index=MetadataIndex(item.index.fqn, piece_offsets),
                                          tensor_data=dataclasses.replace(data, chunk=chunk)))
    return pieces


def _least_planned(ranks: tuple[int, ...], planned: list[int], heaps: dict[tuple[int, ...], list[tuple[int, int]]]) -> int:
    """The rank of ``ranks`` with the least work planned (the lowest rank among equals), as
    ``min(ranks, key=lambda r: (planned[r], r))`` but in log(ranks): a heap per set of holders, whose
    entries may lag ``planned`` (work only grows), refreshed when they come to the top. Scanning every
    holder for every replicated item was ranks x items at the coordinator (issue 47: DDP's tensors
    are held by every rank)."""
    heap = heaps.get(ranks)
    if heap is None:
        heap = heaps[ranks] = [(planned[r], r) for r in ranks]
        heapq.heapify(heap)
    while True:
        work, rank = heap[0]
        if work == planned[rank]:  # every other entry is at most its rank's work: this is the least
            return rank
        heapq.heapreplace(heap, (planned[rank], rank))


def _dedup(all_plans: list[SavePlan]) -> list[SavePlan]:
    """Each write item (same key, same offsets) is kept on one rank only: replicated data is written
    once. Among the ranks holding it, the one with the least work planned so far keeps it (work
    counted by :func:`_item_cost`: bytes, and a fixed cost per record); a large one is cut into
    pieces (:func:`_pieces`), each kept so."""
    holders: dict[MetadataIndex, list[int]] = {}
    items: dict[MetadataIndex, WriteItem] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            holders.setdefault(item.index, []).append(rank)
            items.setdefault(item.index, item)
    planned = [0] * len(all_plans)
    keep: list[set[MetadataIndex]] = [set() for _ in all_plans]
    cut: dict[MetadataIndex, list[WriteItem]] = {}  # a replicated item -> its pieces
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # holders -> their (planned, rank) heap
    # Items held by one rank first (no choice to make), then the costliest shared ones first, so that
    # balancing works on the items that matter.
    costs = {index: _item_cost(item) for index, item in items.items()}
    for index in sorted(holders, key=lambda i: (len(holders[i]) > 1, -costs[i])):
        ranks = holders[index]
        if len(ranks) == 1:
            planned[ranks[0]] += costs[index]
            keep[ranks[0]].add(index)
            continue
        pieces = _pieces(items[index], len(ranks))
        if len(pieces) > 1:
            cut[index] = pieces
        for piece in pieces:
            rank = _least_planned(tuple(ranks), planned, heaps)
            planned[rank] += _item_cost(piece)
            keep[rank].add(piece.index)
    return [
        dataclasses.replace(plan, items=[
            piece for item in plan.items for piece in cut.get(item.index, (item,)) if piece.index in keep[rank]
        ])
        for rank, plan in enumerate(all_plans)
    ]


# -- load -------------------------------------------------------------------------------------


class LoadResult(NamedTuple):
    """What :func:`reference.checkpoint.load` did not load, like ``nn.Module.load_state_dict``'s result."""

    missing_keys: list[str]  #: asked for by the state dict, absent from the checkpoint (only with strict=False)
    unexpected_keys: list[str]  #: in the checkpoint, not asked for


_BUILDABLE = (torch.Tensor, torch.nn.Parameter, DTensor)


class ReferenceLoadPlanner(LoadPlanner):
    """Plans a load into ``state_dict``, checking it against the checkpoint before anything changes.

    * Strict (default): a key of the state dict missing from the checkpoint, or a dtype that differs,
      is an error naming the key; with ``strict=False`` a missing key is skipped and reported in
      :class:`LoadResult` and a dtype is converted. A shape or kind (tensor vs. object) mismatch is
      always an error. ``allow_unexpected=False`` makes keys of the checkpoint that the state dict
      does not ask for an error too.
    * Meta: a tensor, Parameter or DTensor on the meta device is built on ``device`` (a DTensor on
      its mesh's device, keeping mesh, placements, global shape and stride) and filled with the saved
      values. Values that shared a storage on meta (tied weights) share one new storage. The new
      values replace the meta ones in the state dict only in :meth:`commit`, after every rank has
      read successfully, so a failed load leaves the state dict as it was.
    """

    def __init__(
        self, *, strict: bool = True, allow_unexpected: bool = True, device: torch.device | str = "cpu"
    ) -> None:
        self.strict = strict
        self.allow_unexpected = allow_unexpected
        self.device = torch.device(device)
        self.result = LoadResult([], [])

    @torch.no_grad()
    def set_up_planner(
        self,
        state_dict: Any,
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        if metadata is None:
            raise ValueError("ReferenceLoadPlanner needs the checkpoint metadata")
        self.metadata = metadata
        self._state_dict = state_dict
        self._flat: FlatStateDict = flatten_state_dict(state_dict)
        self._targets: dict[str, torch.Tensor] = {}  # key -> local tensor that reads land in
        self._chunks: dict[str, Chunk] = {}  # key -> the box of the global tensor it holds
        self._objects: list[str] = []  # keys of non-tensor values to read
        self._replacements: dict[str, Any] = {}  # key -> new value to put in the state dict at commit
        saved = metadata.state_dict_metadata
        problems: list[str] = []
        missing: list[str] = []
        meta_keys: list[str] = []
        for key, value in self._flat.values.items():
            md = saved.get(key)
            if md is None:
                missing.append(key)
                continue
            if not isinstance(value, torch.Tensor):
                if isinstance(md, TensorStorageMetadata):
                    problems.append(
                        f"key {key!r}: the checkpoint holds a {md.properties.dtype} tensor of shape "
                        f"{_shape(md.size)}, the state dict a {type(value).__name__}"
                    )
                else:
                    self._objects.append(key)
                continue
            if not isinstance(md, TensorStorageMetadata):
                problems.append(f"key {key!r}: the checkpoint holds a non-tensor value, the state dict a tensor")
                continue
            if tuple(md.size) != tuple(value.shape):
                problems.append(
                    f"key {key!r}: shape {_shape(md.size)} in the checkpoint, {_shape(value.shape)} in the state dict"
                )
                continue
            if md.properties.dtype != value.dtype and self.strict:
                problems.append(
                    f"key {key!r}: dtype {md.properties.dtype} in the checkpoint, {value.dtype} in the state dict"
                )
                continue
            local = value.to_local() if isinstance(value, DTensor) else value
            if local.device.type == "meta":
                meta_keys.append(key)
        if missing and self.strict:
            problems += [f"key {key!r}: missing from the checkpoint" for key in missing]
        unexpected = sorted(set(saved) - set(self._flat.values))
        if unexpected and not self.allow_unexpected:
            problems += [f"key {key!r}: in the checkpoint but not in the state dict" for key in unexpected]
        if problems:
            raise _problems_error(f"state dict does not match the checkpoint ({len(problems)} problems)", problems)
        self._materialize(meta_keys)
        skipped = set(missing) | set(self._objects)
        for key, value in self._flat.values.items():
            if key in skipped:
                continue
            chunk = local_chunk(key, value)
            if chunk is None:
                continue
            self._chunks[key] = chunk
            if key not in self._replacements:
                self._targets[key] = value.to_local() if isinstance(value, DTensor) else value
        self.result = LoadResult(missing, unexpected)

    def _materialize(self, meta_keys: list[str]) -> None:
        """Build every meta value of ``meta_keys`` on its device (nothing is put in the state dict yet)."""
        unbuildable = [
            f"key {key!r}: cannot build a {type(self._flat.values[key]).__module__}."
            f"{type(self._flat.values[key]).__qualname__} from the meta device "
            "(only torch.Tensor, nn.Parameter and DTensor are built)"
            for key in meta_keys
            if type(self._flat.values[key]) not in _BUILDABLE
        ]
        if unbuildable:
            raise _problems_error("cannot load into meta values", unbuildable)
        # meta storage -> new storage: values that aliased on meta (tied weights) alias afterwards.
        # The meta storage is kept in the value so that its id() is not reused while we look it up.
        storages: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

        def build(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
            storage = meta.untyped_storage()
            entry = storages.get(id(storage))
            if entry is None or entry[1].device != device:
                entry = (storage, torch.UntypedStorage(storage.nbytes(), device=device))
                storages[id(storage)] = entry
            return torch.empty(0, dtype=meta.dtype, device=device).set_(
                entry[1], meta.storage_offset(), meta.shape, meta.stride()
            )

        for key in meta_keys:
            value = self._flat.values[key]
            if isinstance(value, DTensor):
                device = _mesh_device(value.device_mesh.device_type)
                local = build(value.to_local(), device)
                new: torch.Tensor = DTensor.from_local(
                    local,
                    value.device_mesh,
                    value.placements,
                    run_check=False,
                    shape=value.shape,
                    stride=value.stride(),
                )
                if isinstance(value, torch.nn.Parameter):
                    new = torch.nn.Parameter(new, requires_grad=value.requires_grad)
            else:
                local = build(value, self.device)
                new = local
                if isinstance(value, torch.nn.Parameter):
                    new = torch.nn.Parameter(local, requires_grad=value.requires_grad)
            self._targets[key] = local
            self._replacements[key] = new

    @torch.no_grad()
    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        items: list[ReadItem] = []
        for key, chunk in self._chunks.items():
            md = saved[key]
            assert isinstance(md, TensorStorageMetadata)  # checked in set_up_planner
            if not chunk.numel:
                continue  # nothing to read (and no saved chunk to look for among all ranks' chunks)
            if fast_paths.enabled() and (same := _same_chunk(md.chunks, chunk)) is not None:
                # A fast path. The common cases, a tensor saved whole and wanted whole, or a shard
                # wanted as it was saved (a resume at the same world size and sharding): one read of all
                # of the saved chunk, the item the plain path below makes from overlaps(), without its
                # arithmetic (figures: docs/benchmark-results.md, "Why the fast paths").
                zeros = _zero_offsets(len(chunk.sizes))
                items.append(_tensor_read(key, chunk.offsets, same, chunk.offsets, zeros, zeros, torch.Size(chunk.sizes)))
                continue
            # The saved chunks that overlap the wanted one, looked for by binary search among those that
            # can reach it (a save lists a DTensor's chunks in offset order); among every chunk when
            # those do not cover it (a list in another order). Chunks tile, so the found ones cover the
            # wanted chunk exactly when no other chunk overlaps it.
            matches, saved_chunks = _overlapping(chunk, md.chunks, _candidates(md.chunks, chunk))
            if sum(math.prod(o.lengths) for _, o in matches) != chunk.numel:
                matches, saved_chunks = _overlapping(chunk, md.chunks, range(len(md.chunks)))
            covered = 0
            for i, overlap in matches:
                covered += math.prod(overlap.lengths)
                items.append(
                    _tensor_read(
                        key,
                        chunk.offsets,
                        i,
                        saved_chunks[i].offsets,
                        torch.Size(overlap.wanted_offsets),
                        torch.Size(overlap.saved_offsets),
                        torch.Size(overlap.lengths),
                    )
                )
            # Invariant: the saved chunks cover what this rank wants (a checkpoint's chunks tile each tensor).
            if covered != chunk.numel:
                raise CheckpointFormatError(
                    f"key {key!r}: the checkpoint's chunks cover {covered} of the {chunk.numel} elements "
                    f"at offsets {list(chunk.offsets)} of size {list(chunk.sizes)}"
                )
        for key in self._objects:
            index = MetadataIndex(key)
            zero = torch.Size([0])
            items.append(ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan  # every rank reads what it needs; nothing to coordinate

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            # As torch.load(weights_only=True): a checkpoint's non-tensor values are data; never run
            # code from them.
            self._replacements[key] = read_object_record(value.getbuffer() if isinstance(value, io.BytesIO) else value.read())
        except Exception as exc:
            raise CheckpointFormatError(
                f"key {key!r}: cannot read the saved non-tensor value with torch.load(weights_only=True): {exc}"
            ) from exc

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The part of the target that ``read_item`` fills: the target itself, or a view of it without
        autograd history (detached first, rather than under ``no_grad``, which costs more than the
        narrowing for the hundreds of whole-tensor reads of a load)."""
        tensor = self._targets[read_item.dest_index.fqn]
        if any(read_item.dest_offsets) or tuple(read_item.lengths) != tuple(tensor.shape):
            tensor = tensor.detach()
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                if start != 0 or length != tensor.size(dim):
                    tensor = tensor.narrow(dim, start, length)
        return tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # reads land in the target's memory directly

    def commit(self, undo: list[Callable[[], None]] | None = None) -> LoadResult:
        """Put the built values and the loaded non-tensor values into the state dict. Call on every
        rank once all ranks have read successfully.

        For each value put in, a step that puts the old value back is appended to ``undo`` (run them
        in reverse to restore the state dict). A container that refuses a value (its ``__setitem__``
        raises) is a :class:`StateDictError` naming the key, raised after the values put in before it;
        the caller undoes those."""
        replacements, self._replacements = self._replacements, {}
        for key, value in replacements.items():
            path = self._flat.native_paths[key]
            old = get_value(self._state_dict, path)
            try:
                set_value(self._state_dict, path, value)
            except Exception as exc:
                raise StateDictError(
                    f"key {key!r}: the state dict refused the loaded value ({type(exc).__name__}: {exc})"
                ) from exc
            if undo is not None:
                undo.append(functools.partial(set_value, self._state_dict, path, old))
        return self.result


def _same_chunk(saved: list[ChunkStorageMetadata], wanted: Chunk) -> int | None:
    """The index of the saved chunk that is exactly ``wanted`` (same offsets and sizes), if any.

    A save lists a tensor's chunks in rank order, which for every DTensor layout is the order of their
    offsets: a binary search finds the chunk in log(chunks), where a scan made each rank's load
    planning grow with the world size that saved (every rank scanning every rank's chunks, issue 47).
    A list in another order (a foreign writer's) may hide the chunk from the search: the caller then
    finds it as an overlap like any other (:func:`_candidates`, and every chunk when those miss)."""
    lo = bisect.bisect_left(saved, wanted.offsets, key=_chunk_offsets)
    for index in range(lo, len(saved)):
        chunk = saved[index]
        if tuple(chunk.offsets) != wanted.offsets:
            break
        if tuple(chunk.sizes) == wanted.sizes:
            return index
    return None


def _chunk_offsets(chunk: ChunkStorageMetadata) -> tuple[int, ...]:
    return tuple(chunk.offsets)


def _candidates(saved: list[ChunkStorageMetadata], wanted: Chunk, lo: int = 0, hi: int | None = None, dim: int = 0) -> list[int]:
    """Indices of the chunks of ``saved[lo:hi]`` that can overlap ``wanted`` if ``saved`` is in offset
    order (as a save lists a DTensor's chunks: a grid, row-major): along ``dim``, the run whose first
    index lies from the last one at or before ``wanted``'s to before its end, and within each value
    there, the same along the next dim. Binary searches: the rows and columns it crosses times
    log(chunks), not chunks. In another order the indices may miss chunks (the caller checks)."""
    hi = len(saved) if hi is None else hi
    if dim == len(wanted.offsets):
        return list(range(lo, hi))

    def key(chunk: ChunkStorageMetadata) -> int:
        return chunk.offsets[dim] if len(chunk.offsets) > dim else 0

    first, end = wanted.offsets[dim], wanted.offsets[dim] + wanted.sizes[dim]
    below = bisect.bisect_right(saved, first, lo, hi, key=key)
    start = bisect.bisect_left(saved, key(saved[below - 1]) if below > lo else first, lo, hi, key=key)
    stop = max(start, bisect.bisect_left(saved, end, lo, hi, key=key))
    found: list[int] = []
    while start < stop:
        run_end = bisect.bisect_right(saved, key(saved[start]), start, stop, key=key)
        found += _candidates(saved, wanted, start, run_end, dim + 1)
        start = run_end
    return found


def _overlapping(
    wanted: Chunk, saved: list[ChunkStorageMetadata], indices: Iterable[int]
) -> tuple[list[tuple[int, Overlap]], dict[int, Chunk]]:
    """:func:`overlaps` of ``wanted`` with the chunks ``saved[i]`` of ``indices``, indexed into ``saved``;
    and those chunks by index."""
    chunks = {i: Chunk(tuple(saved[i].offsets), tuple(saved[i].sizes)) for i in indices}
    indices = list(chunks)
    found = overlaps(wanted, [chunks[i] for i in indices])
    return [(indices[j], overlap) for j, overlap in found], chunks


def _tensor_read(
    key: str,
    wanted_offsets: tuple[int, ...],
    saved_index: int,
    saved_offsets: tuple[int, ...],
    dest_offsets: torch.Size,
    storage_offsets: torch.Size,
    lengths: torch.Size,
) -> ReadItem:
    """The read of ``lengths`` elements of ``key``: from the saved chunk ``saved_index`` (at
    ``saved_offsets`` of the global tensor), ``storage_offsets`` into it, to ``dest_offsets`` into the
    wanted chunk at ``wanted_offsets``."""
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(key, wanted_offsets),
        dest_offsets=dest_offsets,
        storage_index=MetadataIndex(key, saved_offsets, saved_index),
        storage_offsets=storage_offsets,
        lengths=lengths,
    )


@functools.cache
def _zero_offsets(ndim: int) -> torch.Size:
    """``torch.Size([0] * ndim)``, one object per ``ndim`` (a ``torch.Size`` is immutable)."""
    return torch.Size((0,) * ndim)


def _mesh_device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type)
    return torch.device(device_type, module.current_device())
