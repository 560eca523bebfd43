"""What a rank test body gets as ``dist``: the rank's view of its process group, and where its ranks sit.

Both the harness (which makes a :class:`RankContext` for each body) and the adapters (which shard over
the default group, and shape HYBRID_SHARD's mesh by :func:`hybrid_mesh_shape`) use this module; it
imports neither, so ``conformance/adapters`` never reads the harness's internals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RankContext", "current", "device_for_rank", "hybrid_mesh_shape", "per_group_cache", "clear_group_caches"]


#: Every cache made by :func:`per_group_cache`, emptied together by :func:`clear_group_caches`.
_GROUP_CACHES: list[dict[Any, Any]] = []


def per_group_cache() -> dict[Any, Any]:
    """A module-level dict for objects tied to the default process group (DeviceMeshes, subgroups).

    A pool's rank keeps one default group for its lifetime; under torchrun a rank's default group is
    replaced when the world size of the tests changes (and after a failure), which destroys every
    group made from it. Such caches are emptied then, so a test never gets a mesh of a dead group.
    """
    cache: dict[Any, Any] = {}
    _GROUP_CACHES.append(cache)
    return cache


def clear_group_caches() -> None:
    """Empty every :func:`per_group_cache` (before the default group is destroyed)."""
    for cache in _GROUP_CACHES:
        cache.clear()


def device_for_rank(backend: str, rank: int) -> torch.device:
    """The device a pool's rank computes on: ``cuda:<rank>`` under nccl (one GPU per rank), else cpu.
    (Under torchrun a rank computes on ``cuda:LOCAL_RANK``.)"""
    if backend == "nccl":
        return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def hybrid_mesh_shape(world_size: int, ranks_per_node: int | None = None) -> tuple[int, int]:
    """``(replicate, shard)`` of a 2-D mesh over ``world_size`` ranks (ranks ``0 .. world_size - 1``).

    When the ranks fill whole nodes of ``ranks_per_node`` (a launched job's layout; default: the
    running body's :attr:`RankContext.ranks_per_node`): ``(nodes, ranks_per_node)``, replicas across
    nodes and shards within one. Otherwise (one node, the pools): two replicas when the world splits in
    two, else one.
    """
    if ranks_per_node is None and _CURRENT is not None:
        ranks_per_node = _CURRENT.ranks_per_node
    if ranks_per_node is not None and world_size > ranks_per_node and world_size % ranks_per_node == 0:
        return world_size // ranks_per_node, ranks_per_node
    replicate = 2 if world_size % 2 == 0 else 1
    return replicate, world_size // replicate


@dataclass(frozen=True)
class RankContext:
    """One rank of a pool (or of a torchrun job), as seen by a test body running on it.

    The default process group (``dist.group.WORLD``) spans exactly the ``world_size`` ranks of the
    test. A pool keeps it across tests; under torchrun it is made anew when the world size changes
    (see :func:`per_group_cache`). ``tmp_dir`` is the same directory on every rank and fresh for each
    test, so a body can save on one world size and load on another through it. ``ranks_per_node``:
    in a launched job whose nodes run as many ranks each, that number (it shapes the 2-D meshes,
    :func:`hybrid_mesh_shape`); None for the pools (one node).
    """

    rank: int
    world_size: int
    backend: str
    device: torch.device
    tmp_dir: Path
    ranks_per_node: int | None = None

    @contextmanager
    def running(self) -> Iterator[RankContext]:
        """The context of the body running in this process while the ``with`` lasts (:func:`current`):
        code the body calls without it (an adapter's sharding) reads the layout there."""
        global _CURRENT
        previous, _CURRENT = _CURRENT, self
        try:
            yield self
        finally:
            _CURRENT = previous

    def hybrid_mesh_shape(self) -> tuple[int, int]:
        """``(replicate, shard)`` of HYBRID_SHARD's mesh over this body's ranks."""
        return hybrid_mesh_shape(self.world_size, self.ranks_per_node)

    @property
    def group(self) -> dist.ProcessGroup:
        """The default process group of the pool."""
        group = dist.group.WORLD
        assert group is not None, "a pool's rank runs in an initialized default group"
        return group

    def mesh(self, *shape: int, names: Sequence[str] | None = None) -> Any:
        """A DeviceMesh of ``shape`` (default: 1-D over all ranks) on this rank's device type."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = shape or (self.world_size,)
        return init_device_mesh(self.device.type, tuple(shape), mesh_dim_names=tuple(names) if names else None)

    def barrier(self) -> None:
        dist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """``obj`` from every rank, rank order."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def on_one_rank(self, fn: Callable[[], Any], src: int = 0) -> Any:
        """``fn()`` run on rank ``src`` only (a test's set-up: damaging a file, say), its value on every
        rank. What ``fn`` raises there ends the test alike on every rank: a skip is a skip everywhere,
        an error fails every rank naming it; the others never wait for a broadcast that does not come."""
        import pytest

        outcome: tuple[str, Any] = ("ok", None)
        if self.rank == src:
            try:
                outcome = ("ok", fn())
            except pytest.skip.Exception as exc:
                outcome = ("skip", str(exc.msg))
            except pytest.fail.Exception as exc:  # the suite's own fail() (a BaseException, not an Exception)
                outcome = ("error", str(exc.msg))
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                outcome = ("error", f"{type(exc).__name__}: {exc}")
        kind, value = self.broadcast_object(outcome, src=src)
        if kind == "skip":
            pytest.skip(value)
        if kind == "error":
            pytest.fail(f"test set-up on rank {src} failed: {value}", pytrace=False)
        return value


#: The context of the body running in this process (:meth:`RankContext.running`), else None.
_CURRENT: RankContext | None = None


def current() -> RankContext | None:
    """The :class:`RankContext` of the test body running in this process; None outside a body."""
    return _CURRENT
