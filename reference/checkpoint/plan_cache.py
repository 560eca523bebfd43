"""Successive saves of one layout reuse their global plan, addressed by what it was computed from.

A fast path: it exists for speed only, and the planner consults it only while
:func:`reference.checkpoint.fast_paths.enabled` (the plain path plans every save anew).

A training job saves the same layout again and again: the values change, the keys, shapes, dtypes and
sharding do not. The coordinator's global step of a save (:meth:`ReferenceSavePlanner.
create_global_plan`: the ranks' agreement on each key, which rank writes each replicated item, the
index hints, the metadata's tensor entries and nesting paths, the tiling check) is a function of every
rank's *layout* alone, in rank order: its write items (key, chunk, dtype, global size; a non-tensor
value's byte count) and its flattening paths. So its result is kept here under the digests of those
layouts (:func:`layout_key`, one per rank, computed by each rank in parallel) and reused whenever a
save's ranks bring the same digests again. Upstream's DCP caches save plans for the same reason
(pytorch/pytorch PR #147343, #149785: at 256 ranks the global step went from 90 s to 1.5 s).

Why content, and nothing else, addresses the entries. Upstream's cache is keyed by the planner's class
name and holds one plan per key; the field's reports are each a way that goes stale:

- a second checkpointer in the same process (a model and an optimizer checkpoint, or two runs) with
  the same planner class got the first one's final plan, file prefix included
  (NVIDIA-NeMo/Automodel PR #3369);
- the cached plans of all ranks were not updated when one rank's plan changed
  (pytorch/pytorch PR #148577);
- a global plan that failed validation left a half-updated cache, and the next save failed
  (pytorch/pytorch PR #176289).

Here an entry is found only by the exact layouts it was computed from, so no other save, writer,
directory or process group can be served a plan that is not its own; an entry is stored only after
its global step succeeded; and nothing that varies between saves of one layout is reused: the
non-tensor values' digests are checked every save (ML-9), and the storage writer's part of the plan
(file names carry each save's id) is made anew.

The scatter of the global plans is cut the same way: each rank keeps the global items it last
received for each of its layouts (:data:`RANK_ITEMS`, with their digest), says which it holds in its
local plan (:class:`~reference.checkpoint.planner.RankSaveData`), and a rank whose held items are the
coordinator's answer is sent the answer's digest instead of the items (:class:`GlobalItems`). What a
rank holds is its own statement, checked by digest, never something the coordinator assumes.

Both stores are bounded LRUs (:data:`CAPACITY` entries each): a job alternating a few layouts (a
model checkpoint and an optimizer checkpoint) keeps every one of them.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem

from reference.checkpoint.flatten import ObjPath
from reference.checkpoint.wire import pack_items

__all__ = [
    "CAPACITY",
    "GLOBAL_PLANS",
    "RANK_ITEMS",
    "SendWholePlan",
    "GlobalEntry",
    "GlobalItems",
    "LRU",
    "clear",
    "items_digest",
    "layout_key",
]

K = TypeVar("K")
V = TypeVar("V")

#: Entries kept by each store: distinct layouts (coordinator: distinct tuples of every rank's layout).
CAPACITY = 4


class LRU(Generic[K, V]):
    """A mapping of at most ``capacity`` entries; the least recently used one is dropped first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def _digest(value: Any) -> str:
    """sha256 of ``value`` (plain values: tuples, lists, strings, ints, dtypes) pickled without the memo.

    Pickle is faithful (``1`` and ``"1"``, ``(1,)`` and ``[1]`` encode differently), and without the
    memo the bytes depend on the values alone, not on which objects happen to be shared: equal layouts
    give equal digests, in one process or across ranks. (Pickled with the memo, a key string shared
    by an item and a path would encode otherwise than two equal strings; ``repr`` is as faithful and
    slower (figures: docs/benchmark-results.md, "Why the fast paths").)"""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=5)
    pickler.fast = True  # no memo: these values hold no cycles
    pickler.dump(value)
    return hashlib.sha256(buffer.getbuffer()).hexdigest()


def layout_key(items: list[WriteItem], paths: Mapping[str, ObjPath]) -> str | None:
    """The digest of one rank's layout: its write items, in order, and its flattening paths. ``None``
    for items this module cannot encode field for field (a planner's own item class): such a save is
    planned anew every time."""
    packed = pack_items(items)
    if packed is None:
        return None
    return _digest((packed, list(paths.items())))


def items_digest(items: list[WriteItem]) -> str | None:
    """The digest of a rank's part of a global plan (its kept items with their index hints)."""
    packed = pack_items(items)
    return None if packed is None else _digest(packed)


@dataclass(frozen=True)
class GlobalEntry:
    """The coordinator's kept global step for one tuple of layouts. Never handed out itself: a save
    gets fresh lists and metadata entries (:meth:`ReferenceSavePlanner.create_global_plan`), so that
    what a caller or a writer does to its plan or metadata cannot reach a later save."""

    items: tuple[tuple[WriteItem, ...], ...]  #: per rank, the items it keeps (index hints set)
    digests: tuple[str | None, ...]  #: per rank, :func:`items_digest` of ``items``
    state_dict_metadata: Mapping[str, TensorStorageMetadata | BytesStorageMetadata]
    paths: Mapping[str, ObjPath]


@dataclass(frozen=True)
class GlobalItems:
    """A global plan's ``planner_data``: the digest of the rank's items and whether the rank said it
    holds exactly those (then the items need not travel: :func:`reference.checkpoint.api.save` sends
    the plan without them and the rank takes its own from :data:`RANK_ITEMS`)."""

    digest: str | None
    held: bool


@dataclass(frozen=True)
class SendWholePlan:
    """A global plan's ``planner_data`` asking every rank to send its whole local plan: a rank sent
    its layout key alone and this coordinator does not hold that layout's global step
    (:meth:`~reference.checkpoint.planner.ReferenceSavePlanner.needs_whole_plans`)."""


#: The coordinator's store: every rank's layout key, in rank order -> the global step's result.
GLOBAL_PLANS: LRU[tuple[str, ...], GlobalEntry] = LRU(CAPACITY)
#: Each rank's store: its layout key -> (digest of its global items, the items).
RANK_ITEMS: LRU[str, tuple[str, tuple[WriteItem, ...]]] = LRU(CAPACITY)


def clear() -> None:
    """Forget every kept plan (the next save of any layout plans anew)."""
    GLOBAL_PLANS.clear()
    RANK_ITEMS.clear()

