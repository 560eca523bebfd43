"""One way to shard a model, for every capability: a :class:`ShardingPlan` says what the test wants,
the adapter's :class:`ShardingOps` (``Adapter.sharding()``) applies it.

The SD, OS and ML tests all shard through this one method, so a fork writes its sharding glue once.
Strategies are named as torch's ``ShardingStrategy`` members. Without a mesh in the plan the
implementation shards over the default process group: a 1-D mesh, or for HYBRID_SHARD a 2-D mesh
``(replicate, shard)`` of :func:`hybrid_mesh_shape`. Units are chosen by a predicate on modules,
applied below the root (the root is always a unit); nested units are built innermost first.
``shard`` is collective: every rank of the group calls it with an identical model and plan.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn

from conformance.adapters.unsupported import Unsupported
from conformance.rank_context import hybrid_mesh_shape as _layout_mesh_shape
from conformance.rank_context import per_group_cache

__all__ = [
    "STRATEGIES",
    "ShardingPlan",
    "ShardingOps",
    "ReferenceShardingOps",
    "TorchFSDP1ShardingOps",
    "TorchFSDP2ShardingOps",
    "UnitPredicate",
    "child_units",
    "has_shared_parameters",
    "hybrid_mesh_shape",
    "strategy_layout",
]

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
UnitPredicate = Callable[[nn.Module], bool]


@dataclass(frozen=True)
class ShardingPlan:
    """How a test wants a model sharded."""

    #: one of :data:`STRATEGIES`
    strategy: str = "FULL_SHARD"
    #: expose the original parameters (True) or flat ones (False); None: the implementation's own
    #: choice (the reference: flat parameters; torch's FSDP1 here: original parameters; fully_shard
    #: has only original ones)
    use_orig_params: bool | None = None
    #: which modules below the root get a unit of their own; None: the root is the only unit
    units: UnitPredicate | None = None
    #: the compute device; None: where the model's parameters are
    device: torch.device | None = None
    #: the DeviceMesh to shard over; None: one over the default process group, shaped for ``strategy``
    mesh: Any = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"ShardingPlan: strategy must be one of {STRATEGIES}, got {self.strategy!r}")


@runtime_checkable
class ShardingOps(Protocol):
    """What every section needs to shard a model."""

    def unsupported(self, plan: ShardingPlan) -> str | None:
        """None if ``plan`` can be applied here, else the reason it cannot (the tests skip with it)."""

    def shard(self, model: nn.Module, plan: ShardingPlan) -> nn.Module:
        """``model`` sharded as ``plan`` says, ready to train; raises :class:`Unsupported` (with the
        reason of :meth:`unsupported`) for a plan it cannot apply. Collective."""


def has_shared_parameters(model: nn.Module) -> bool:
    """True if one parameter is reachable under two names (tied weights)."""
    named = list(model.named_parameters(remove_duplicate=False))
    return len(named) != len({id(p) for _, p in named})


def child_units(model: nn.Module) -> UnitPredicate:
    """The units of the SD tests: the direct children of ``model`` holding parameters, unless
    parameters are shared between children (tied weights must stay in one unit)."""
    if has_shared_parameters(model):
        return lambda module: False
    children = {id(child) for child in model.children() if any(True for _ in child.parameters())}
    return lambda module: id(module) in children


def hybrid_mesh_shape(world_size: int) -> tuple[int, int]:
    """``(replicate, shard)`` for HYBRID_SHARD: under torchrun, ``(nodes, ranks per node)`` when the
    world fills whole nodes (replicas across nodes, shards within one; the running body's
    :class:`~conformance.rank_context.RankContext` says how many ranks a node runs); otherwise two
    replicas when the world splits in two, else one (:func:`conformance.rank_context.hybrid_mesh_shape`)."""
    return _layout_mesh_shape(world_size)


def strategy_layout(strategy: str, world_size: int) -> tuple[int, int]:
    """``(replicas, shards)``: how a plan without a mesh of its own lays a value out over the default
    group. The ranks form ``replicas`` shard groups of ``shards`` consecutive ranks each (ranks
    ``[i * shards, (i + 1) * shards)``); the ranks holding the same piece (one per shard group) form a
    replicate group. FULL_SHARD and SHARD_GRAD_OP shard over every rank, NO_SHARD replicates on every
    rank, HYBRID_SHARD is :func:`hybrid_mesh_shape`: mesh dim 0 the replicate groups, dim 1 the shard
    groups."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy_layout: strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "HYBRID_SHARD":
        return hybrid_mesh_shape(world_size)
    if strategy == "NO_SHARD":
        return world_size, 1
    return 1, world_size


#: Meshes by (device type, shape), per default process group (torchrun replaces it between world sizes).
_MESHES: dict[tuple[str, tuple[int, ...]], Any] = per_group_cache()


def _mesh(device: torch.device, shape: tuple[int, ...]) -> Any:
    """One DeviceMesh per (device type, shape) per process: creating one makes new process groups."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (device.type, shape)
    if key not in _MESHES:
        # fully_shard reads a 2-D mesh as (replicate, shard) only when its dimensions are named.
        names = ("replicate", "shard") if len(shape) == 2 else None
        _MESHES[key] = init_device_mesh(device.type, shape, mesh_dim_names=names)
    return _MESHES[key]


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def _device(model: nn.Module, plan: ShardingPlan) -> torch.device:
    if plan.device is not None:
        return plan.device
    return next(model.parameters()).device


class ReferenceShardingOps:
    """``reference.fsdp.FullyShardedDataParallel`` (nested units by its ``auto_wrap_policy``)."""

    def unsupported(self, plan: ShardingPlan) -> str | None:
        return None

    def shard(self, model: nn.Module, plan: ShardingPlan) -> nn.Module:
        try:
            from reference.fsdp import FullyShardedDataParallel
        except ImportError as exc:
            raise Unsupported(f"reference.fsdp is not available ({exc})") from exc
        device = _device(model, plan)
        mesh = plan.mesh
        if mesh is None and plan.strategy == "HYBRID_SHARD":
            mesh = _mesh(device, hybrid_mesh_shape(_world_size()))
        return FullyShardedDataParallel(
            model,
            device_mesh=mesh,
            sharding_strategy=plan.strategy,
            use_orig_params=bool(plan.use_orig_params),
            auto_wrap_policy=plan.units,
            device_id=device,
        )


class TorchFSDP1ShardingOps:
    """``torch.distributed.fsdp.FullyShardedDataParallel``, always on a device mesh (so that its sharded
    state dicts hold DTensors rather than ShardedTensors); nested units by a ``CustomPolicy``."""

    def unsupported(self, plan: ShardingPlan) -> str | None:
        return None

    def shard(self, model: nn.Module, plan: ShardingPlan) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import CustomPolicy

        device = _device(model, plan)
        mesh = plan.mesh
        if mesh is None:
            ws = _world_size()
            mesh = _mesh(device, hybrid_mesh_shape(ws) if plan.strategy == "HYBRID_SHARD" else (ws,))
        units = plan.units
        policy = CustomPolicy(lambda m: m is not model and bool(units(m))) if units is not None else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FSDP1 is deprecated upstream; it is what this adapter checks
            return FullyShardedDataParallel(
                model,
                sharding_strategy=ShardingStrategy[plan.strategy],
                use_orig_params=plan.use_orig_params is not False,
                auto_wrap_policy=policy,
                device_id=device,
                device_mesh=mesh,
            )


class TorchFSDP2ShardingOps:
    """``torch.distributed.fsdp.fully_shard`` (per-parameter DTensor sharding): NO_SHARD on a
    ``(world, 1)`` mesh, HYBRID_SHARD on :func:`hybrid_mesh_shape`; nested units innermost first."""

    def unsupported(self, plan: ShardingPlan) -> str | None:
        if plan.use_orig_params is False:
            return "fully_shard shards each parameter as a DTensor: there is no flat parameter (use_orig_params=False)"
        return None

    def shard(self, model: nn.Module, plan: ShardingPlan) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        reason = self.unsupported(plan)
        if reason:
            raise Unsupported(reason)
        device = _device(model, plan)
        mesh = plan.mesh
        if mesh is None:
            ws = _world_size()
            mesh = _mesh(device, {"HYBRID_SHARD": hybrid_mesh_shape(ws), "NO_SHARD": (ws, 1)}.get(plan.strategy, (ws,)))
        reshard = plan.strategy in ("FULL_SHARD", "HYBRID_SHARD")
        model.to(device)
        if plan.units is not None:
            # Innermost first, as auto-wrapping does: a unit never takes a nested unit's parameters.
            for module in reversed(list(model.modules())):
                if module is not model and plan.units(module):
                    fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return model
