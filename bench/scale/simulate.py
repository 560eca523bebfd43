"""Every save and load step of a simulated job that moves no tensor bytes, for the reference and torch.

:func:`simulate` runs, for one layout, world size and implementation, the steps of DCP's protocol
with the implementation's own planners (see :mod:`bench.scale`):

1. each rank's local save plan (``set_up_planner`` + ``create_local_plan``), and its pickled bytes as
   the implementation sends it (the reference: :class:`reference.checkpoint.wire.Compact`; torch: the
   plan pickled, as its object collectives do);
2. the coordinator's global plan (``create_global_plan`` on every rank's plan);
3. the metadata as a save publishes it (the storage entries are one per kept item, as the write results
   make them) and its pickled bytes, pickling and unpickling time;
4. each rank's load planning from that metadata (``set_up_planner`` + ``create_local_plan``), for a
   sample of ranks, at the same world size and resharded to half of it;
5. the second save of the same layout with each implementation's plan cache: the bytes each rank
   sends, the coordinator's global step, the bytes it scatters;
6. the write balance of replicated data: bytes of items several ranks hold, per rank that writes
   them, max over mean.

Times are CPU seconds of this process (``time.process_time``): on a shared machine a step's wall time
is mostly its wait for a core. One process simulates every rank, so a per-rank figure is one rank's
work (what that rank would spend in parallel with the others), and the coordinator's figures are the
coordinator's alone.

Each rank keeps its own plan-cache store, as it would in its own process: the reference's
``plan_cache.RANK_ITEMS`` and torch's per-rank ``SavePlanner`` caches are swapped in for the rank whose
step runs (:func:`_rank_store`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import io
import math
import pickle
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem

from bench.scale.layouts import Layout, RankStateDicts
from reference.checkpoint import plan_cache
from reference.checkpoint.metadata_io import StorageInfo, load_metadata
from reference.checkpoint.planner import ReferenceLoadPlanner, ReferenceSavePlanner
from reference.checkpoint.wire import Compact

__all__ = ["IMPLS", "FIGURES", "simulate", "sample_ranks"]

IMPLS = ("reference", "torch")

#: Every figure :func:`simulate` returns: name -> what it is (the unit is in the name).
FIGURES: dict[str, str] = {
    "items": "write items of all ranks' local plans (the coordinator's input)",
    "local_plan_s": "one rank's local save plan, the slowest rank",
    "plan_bytes_max": "pickled bytes one rank sends (its local plan), the largest",
    "plan_bytes_total": "pickled bytes the coordinator receives (every rank's local plan)",
    "global_plan_s": "the coordinator's global plan, first save",
    "scatter_bytes_total": "pickled bytes the coordinator scatters (every rank's part of the global plan)",
    "metadata_bytes": "the metadata file's bytes",
    "metadata_dump_s": "pickling the metadata",
    "metadata_load_s": "unpickling the metadata (each rank, once per load)",
    "load_plan_s": "one rank's load planning from the metadata, the slowest sampled rank",
    "reshard_plan_s": "one rank's load planning at half the world size, the slowest sampled rank",
    "second_plan_bytes_max": "second save of the same layout: pickled bytes one rank sends, the largest",
    "second_plan_bytes_total": "second save: pickled bytes the coordinator receives",
    "second_global_plan_s": "second save: the coordinator's global step",
    "second_scatter_bytes_total": "second save: pickled bytes the coordinator scatters",
    "write_balance": "bytes each rank writes, max over mean over every rank (1: even; replicated data decides it)",
    "replicated_writers": "ranks that write some of the replicated data",
}


def sample_ranks(world_size: int, count: int = 8) -> list[int]:
    """``count`` ranks spread over ``world_size`` (first and last included): whose load planning is timed."""
    return sorted({round(i * (world_size - 1) / max(count - 1, 1)) for i in range(count)})


def _save_planner(impl: str, *, cache: bool) -> SavePlanner:
    if impl == "reference":
        return ReferenceSavePlanner(cache_plans=cache)
    if impl == "torch":
        return DefaultSavePlanner(enable_plan_caching=cache)
    raise ValueError(f"impl {impl!r}: not one of {', '.join(IMPLS)}")


def _load_planner(impl: str) -> Any:
    return ReferenceLoadPlanner() if impl == "reference" else DefaultLoadPlanner()


def _wire_bytes(impl: str, value: Any) -> int:
    """Bytes ``value`` (a plan) takes pickled as ``impl`` sends it between ranks."""
    return len(pickle.dumps(Compact(value) if impl == "reference" else value))


_TORCH_RANK_CACHES = ("_cached_save_plan", "_cached_final_save_plan")
_TORCH_COORDINATOR_CACHES = ("_cached_all_plans", "_cached_global_plan", "_cached_metadata")


class _Stores:
    """Each simulated rank's plan-cache stores (what its own process would hold)."""

    def __init__(self) -> None:
        self.reference: dict[int, plan_cache.LRU[str, Any]] = {}
        self.torch: dict[int, dict[str, dict[str, SavePlan]]] = {}
        plan_cache.clear()
        for name in _TORCH_RANK_CACHES + _TORCH_COORDINATOR_CACHES:
            setattr(SavePlanner, name, {})


@contextlib.contextmanager
def _rank_store(stores: _Stores, rank: int) -> Iterator[None]:
    """Rank ``rank``'s plan-cache stores in place while its steps run (the coordinator's stay)."""
    ref = stores.reference.setdefault(rank, plan_cache.LRU(plan_cache.CAPACITY))
    mine = stores.torch.setdefault(rank, {name: {} for name in _TORCH_RANK_CACHES})
    saved_ref = plan_cache.RANK_ITEMS
    saved_torch = {name: getattr(SavePlanner, name) for name in _TORCH_RANK_CACHES}
    plan_cache.RANK_ITEMS = ref
    for name in _TORCH_RANK_CACHES:
        setattr(SavePlanner, name, mine[name])
    try:
        yield
    finally:
        plan_cache.RANK_ITEMS = saved_ref
        for name, value in saved_torch.items():
            setattr(SavePlanner, name, value)


def _without_held_items(plan: SavePlan) -> SavePlan:
    """What a reference save scatters to a rank (``reference.checkpoint.api``): its plan without the
    items when the rank said it holds them (the plan's ``GlobalItems``)."""
    data = plan.planner_data
    if isinstance(data, plan_cache.GlobalItems) and data.held and plan.items:
        return dataclasses.replace(plan, items=[])
    return plan


def _cpu(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.process_time()
    result = fn()
    return result, time.process_time() - start


def _local_plan(impl: str, state_dict: dict[str, Any], rank: int, *, cache: bool = True) -> tuple[SavePlanner, SavePlan, float]:
    planner = _save_planner(impl, cache=cache)

    def plan() -> SavePlan:
        planner.set_up_planner(state_dict, is_coordinator=rank == 0)
        return planner.create_local_plan()

    local, seconds = _cpu(plan)
    return planner, local, seconds


def _item_bytes(item: WriteItem) -> int:
    if item.tensor_data is not None:
        return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
    return item.bytes_io_data.nbytes if item.bytes_io_data is not None else 0


def _published(metadata: Metadata, plans: list[SavePlan]) -> Metadata:
    """``metadata`` as a save publishes it: one storage entry per kept item (rank's file, offset, length),
    what the write results add. The same for both implementations (it is DCP's format)."""
    storage: dict[Any, StorageInfo] = {}
    for rank, plan in enumerate(plans):
        offset = 0
        for item in plan.items:
            length = _item_bytes(item)
            storage[item.index] = StorageInfo(relative_path=f"__{rank}_0.distcp", offset=offset, length=length)
            offset += length
    return dataclasses.replace(metadata, storage_data=storage)


def _balance(local: list[SavePlan], final: list[SavePlan]) -> tuple[float, int]:
    """(max over mean of the bytes each rank writes, ranks writing some replicated data). An item of
    the final plans that no local plan holds as it is is a piece of a replicated one."""
    holders: dict[Any, int] = {}
    for plan in local:
        for item in plan.items:
            holders[item.index] = holders.get(item.index, 0) + 1
    written = [sum(_item_bytes(i) for i in plan.items) for plan in final]
    writers = sum(1 for plan in final if any(holders.get(i.index, 0) != 1 for i in plan.items))
    mean = sum(written) / len(written)
    return (max(written) / mean if mean else math.nan), writers


def _load_planning(impl: str, states: RankStateDicts, metadata: Metadata, ranks: list[int]) -> float:
    """The slowest of ``ranks``' load planning (set-up and local plan) from ``metadata``."""
    worst = 0.0
    for rank in ranks:
        state_dict = states.state_dict(rank)
        planner = _load_planner(impl)

        def plan(planner: Any = planner, state_dict: dict[str, Any] = state_dict, rank: int = rank) -> Any:
            planner.set_up_planner(state_dict, metadata, rank == 0)
            return planner.create_local_plan()

        worst = max(worst, _cpu(plan)[1])
    return worst


def simulate(layout: Layout, world_size: int, tensors: int, impl: str, *, load_ranks: int = 8,
             reshard: bool = True) -> dict[str, float]:
    """The figures of :data:`FIGURES` for ``impl`` saving and loading ``layout`` at ``world_size`` ranks
    and a model of about ``tensors`` tensors. ``load_ranks``: how many ranks' load planning is timed
    (spread over the world); ``reshard``: also load at half the world size where the layout allows."""
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r}: not one of {', '.join(IMPLS)}")
    states = RankStateDicts(layout, world_size, tensors)
    stores = _Stores()
    gc_was = gc.isenabled()
    gc.disable()  # what a save does (the reference's fast path); the simulated objects form no cycles
    try:
        return _simulate(impl, states, stores, load_ranks, reshard)
    finally:
        if gc_was:
            gc.enable()
        _Stores()  # leave no rank's cache behind


def _simulate(impl: str, states: RankStateDicts, stores: _Stores, load_ranks: int, reshard: bool) -> dict[str, float]:
    n = states.world_size
    fig: dict[str, float] = {}
    # 1. local plans (the plan cache on: a default save of either implementation is the first of many)
    local: list[SavePlan] = []
    local_s = 0.0
    sent: list[int] = []
    for rank in range(n):
        with _rank_store(stores, rank):
            _, plan, seconds = _local_plan(impl, states.state_dict(rank), rank)
        local.append(plan)
        local_s = max(local_s, seconds)
        sent.append(_wire_bytes(impl, plan))
    fig["items"] = sum(len(p.items) for p in local)
    fig["local_plan_s"], fig["plan_bytes_max"], fig["plan_bytes_total"] = local_s, max(sent), sum(sent)
    # 2. the coordinator's global plan
    coordinator = _save_planner(impl, cache=True)
    (global_plans, metadata), fig["global_plan_s"] = _cpu(functools.partial(coordinator.create_global_plan, local))
    scattered = [_without_held_items(p) for p in global_plans] if impl == "reference" else global_plans
    fig["scatter_bytes_total"] = sum(_wire_bytes(impl, p) for p in scattered)
    fig["write_balance"], fig["replicated_writers"] = _balance(local, global_plans)
    # 3. the metadata as published
    published = _published(metadata, global_plans)
    data, fig["metadata_dump_s"] = _cpu(lambda: pickle.dumps(published))
    fig["metadata_bytes"] = len(data)
    reader: Callable[[], Metadata] = (
        (lambda: load_metadata(_bytes_io(data))) if impl == "reference" else (lambda: pickle.loads(data))
    )
    loaded, fig["metadata_load_s"] = _cpu(reader)
    # 5. the second save: each rank finishes the first (its store keeps what it got), then plans again
    second: list[SavePlan] = []
    for rank in range(n):
        with _rank_store(stores, rank):
            state_dict = states.state_dict(rank)
            planner, _, _ = _local_plan(impl, state_dict, rank)
            planner.finish_plan(global_plans[rank])
            _, plan, _ = _local_plan(impl, state_dict, rank)
        second.append(plan)
    sent = [_wire_bytes(impl, p) for p in second]
    fig["second_plan_bytes_max"], fig["second_plan_bytes_total"] = max(sent), sum(sent)
    coordinator = _save_planner(impl, cache=True)
    (second_global, _), fig["second_global_plan_s"] = _cpu(functools.partial(coordinator.create_global_plan, second))
    scattered = [_without_held_items(p) for p in second_global] if impl == "reference" else second_global
    fig["second_scatter_bytes_total"] = sum(_wire_bytes(impl, p) for p in scattered)
    del local, global_plans, second, second_global, scattered
    # 4. load planning, at the same world size and resharded to half of it
    fig["load_plan_s"] = _load_planning(impl, states, loaded, sample_ranks(n, load_ranks))
    half = n // 2
    fig["reshard_plan_s"] = math.nan
    if reshard and half >= max(states.layout.min_world_size, 1):
        target = RankStateDicts(states.layout, half, len(states.specs))
        fig["reshard_plan_s"] = _load_planning(impl, target, loaded, sample_ranks(half, load_ranks))
    return fig


def _bytes_io(data: bytes) -> io.BytesIO:
    return io.BytesIO(data)
