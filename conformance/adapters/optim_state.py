"""Ops for the OS section: shard a model, and save/load its model and optimizer state dicts by clean FQN.

Strategies are named as torch's ``ShardingStrategy`` members (``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``,
``"NO_SHARD"``, ``"HYBRID_SHARD"``). HYBRID_SHARD runs on a 2-D mesh ``(replicate, shard)`` of
:func:`hybrid_mesh_shape`. Units are chosen by a predicate on modules, applied below the root (the
root is always a unit). Every method is called on every rank of the pool, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn

from conformance.adapters.base import Unsupported
from conformance.fqn import canonical_fqn

__all__ = [
    "STRATEGIES",
    "OptimStateOps",
    "ReferenceOptimStateOps",
    "TorchFSDP1OptimStateOps",
    "TorchFSDP2OptimStateOps",
    "hybrid_mesh_shape",
]

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
UnitPredicate = Callable[[nn.Module], bool]

def hybrid_mesh_shape(world_size: int) -> tuple[int, int]:
    """``(replicate, shard)`` for HYBRID_SHARD: two replicas when the world splits in two, else one."""
    replicate = 2 if world_size % 2 == 0 else 1
    return replicate, world_size // replicate


_MESHES: dict[tuple[str, tuple[int, ...]], Any] = {}


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


@runtime_checkable
class OptimStateOps(Protocol):
    """What the OS tests need of an implementation of sharded data parallel."""

    def unsupported(self, strategy: str, use_orig_params: bool) -> str | None:
        """None if this combination can be wrapped here, else the reason it cannot."""

    def wrap(
        self, model: nn.Module, *, strategy: str, use_orig_params: bool, units: UnitPredicate | None, device: torch.device
    ) -> nn.Module:
        """``model`` sharded with ``strategy``; modules matching ``units`` (below the root) are nested units."""

    def optimizer_params(self, model: nn.Module) -> list[tuple[tuple[str, ...], nn.Parameter]]:
        """Every parameter an optimizer of the wrapped model holds, with the clean FQNs it stands for."""

    def optim_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, *, rank0_only: bool = False, cpu_offload: bool = False, sharded: bool = False
    ) -> dict[str, Any]:
        """The FQN-keyed optimizer state dict (full, or sharded DTensors with ``sharded``)."""

    def load_optim_state_dict(self, model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
        """Load an FQN-keyed optimizer state dict (full or sharded, present on every rank) into ``optim``."""

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The unsharded model state dict under clean FQNs, on every rank."""

    def load_full_state_dict(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """Load an unsharded model state dict (on every rank)."""

    def sharded_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The model state dict under clean FQNs with parameters as DTensors (buffers plain)."""

    def load_sharded_state_dict(self, model: nn.Module, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`sharded_state_dict` returns (on every rank)."""

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        """``model.state_dict()`` as a user calls it, with no state-dict settings of the caller's own:
        whatever the implementation returns by default (OS-20 compares it before and after a failure)."""

    def fqn_to_param_info(self, model: nn.Module) -> dict[str, tuple[int, int]]:
        """Clean FQN (relative to ``model``, any module of the tree) -> (which flat parameter, as the index
        of its first appearance, and the FQN's index inside it). Raises Unsupported without flat parameters."""


class ReferenceOptimStateOps:
    """``reference.fsdp`` (the wrapper, its model state dicts and its optimizer-state keying)."""

    def unsupported(self, strategy: str, use_orig_params: bool) -> str | None:
        return None

    def wrap(self, model, *, strategy, use_orig_params, units, device):
        from reference.fsdp import FullyShardedDataParallel

        mesh = _mesh(device, hybrid_mesh_shape(_world_size())) if strategy == "HYBRID_SHARD" else None
        return FullyShardedDataParallel(
            model, device_mesh=mesh, sharding_strategy=strategy, use_orig_params=use_orig_params, auto_wrap_policy=units, device_id=device
        )

    def optimizer_params(self, model):
        from reference.fsdp import get_param_to_fqns

        return [(tuple(fqns), param) for param, fqns in get_param_to_fqns(model).items()]

    def optim_state_dict(self, model, optim, *, rank0_only=False, cpu_offload=False, sharded=False):
        from reference.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel.optim_state_dict(model, optim, rank0_only=rank0_only, cpu_offload=cpu_offload, sharded=sharded)

    def load_optim_state_dict(self, model, optim, osd):
        from reference.fsdp import FullyShardedDataParallel

        optim.load_state_dict(FullyShardedDataParallel.optim_state_dict_to_load(model, optim, osd))

    def full_state_dict(self, model):
        from reference.fsdp import full_state_dict

        return full_state_dict(model)

    def load_full_state_dict(self, model, state_dict):
        from reference.fsdp import load_full_state_dict

        load_full_state_dict(model, state_dict)

    def sharded_state_dict(self, model):
        from reference.fsdp import sharded_state_dict

        return sharded_state_dict(model)

    def load_sharded_state_dict(self, model, state_dict):
        from reference.fsdp import load_sharded_state_dict

        load_sharded_state_dict(model, state_dict)

    def state_dict(self, model):
        return model.state_dict()

    def fqn_to_param_info(self, model):
        from reference.fsdp import get_fqn_to_fsdp_param_info

        return _number_flat_params({fqn: (info.flat_param, info.param_indices[fqn]) for fqn, info in get_fqn_to_fsdp_param_info(model).items()})


def _number_flat_params(raw: dict[str, tuple[Any, int]]) -> dict[str, tuple[int, int]]:
    """Replace flat-parameter objects by the order of their first appearance (comparable across impls)."""
    numbers: dict[int, int] = {}
    return {fqn: (numbers.setdefault(id(flat), len(numbers)), index) for fqn, (flat, index) in raw.items()}


class TorchFSDP1OptimStateOps:
    """``torch.distributed.fsdp.FullyShardedDataParallel`` on CPU/gloo, its optim_state_dict APIs."""

    def unsupported(self, strategy: str, use_orig_params: bool) -> str | None:
        return None

    def wrap(self, model, *, strategy, use_orig_params, units, device):
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import CustomPolicy

        # Always a mesh: with one, FSDP1's sharded state dicts hold DTensors (else ShardedTensors).
        ws = _world_size()
        mesh = _mesh(device, hybrid_mesh_shape(ws) if strategy == "HYBRID_SHARD" else (ws,))
        root = model
        policy = CustomPolicy(lambda m: m is not root and bool(units(m))) if units is not None else None
        return FullyShardedDataParallel(
            model,
            sharding_strategy=ShardingStrategy[strategy],
            use_orig_params=use_orig_params,
            auto_wrap_policy=policy,
            device_id=device,
            device_mesh=mesh,
        )

    def optimizer_params(self, model):
        out = []
        for name, param in model.named_parameters():
            # A flat parameter's FQNs are only on the private `_fqns` (relative to its unit's module);
            # they are prefixed here with the unit's clean path.
            fqns = getattr(param, "_fqns", None)
            if fqns is not None:
                unit = canonical_fqn(name.rsplit("_flat_param", 1)[0].rstrip("."))
                out.append((tuple(canonical_fqn(f"{unit}.{f}" if unit else f) for f in fqns), param))
            else:
                out.append(((canonical_fqn(name),), param))
        return out

    def _state_dict_type(self, model, *, rank0_only=False, cpu_offload=False, sharded=False):
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            ShardedOptimStateDictConfig,
            ShardedStateDictConfig,
            StateDictType,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if sharded:
            return FSDP.state_dict_type(
                model, StateDictType.SHARDED_STATE_DICT,
                ShardedStateDictConfig(offload_to_cpu=cpu_offload), ShardedOptimStateDictConfig(offload_to_cpu=cpu_offload)
            )
        return FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=cpu_offload, rank0_only=rank0_only),
            FullOptimStateDictConfig(offload_to_cpu=cpu_offload, rank0_only=rank0_only),
        )

    def optim_state_dict(self, model, optim, *, rank0_only=False, cpu_offload=False, sharded=False):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with self._state_dict_type(model, rank0_only=rank0_only, cpu_offload=cpu_offload, sharded=sharded):
            return FSDP.optim_state_dict(model, optim)

    def load_optim_state_dict(self, model, optim, osd):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.tensor import DTensor

        sharded = any(isinstance(v, DTensor) for entry in osd.get("state", {}).values() for v in entry.values())
        with self._state_dict_type(model, sharded=sharded):
            optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, osd))

    def full_state_dict(self, model):
        with self._state_dict_type(model):
            return model.state_dict()

    def load_full_state_dict(self, model, state_dict):
        with self._state_dict_type(model):
            model.load_state_dict(state_dict)

    def sharded_state_dict(self, model):
        with self._state_dict_type(model, sharded=True):
            return model.state_dict()

    def load_sharded_state_dict(self, model, state_dict):
        with self._state_dict_type(model, sharded=True):
            model.load_state_dict(state_dict)

    def state_dict(self, model):
        return model.state_dict()

    def fqn_to_param_info(self, model):
        # Private in torch: the map this requirement is about has no public accessor.
        from torch.distributed.fsdp._optim_utils import _get_fqn_to_fsdp_param_info

        infos = _get_fqn_to_fsdp_param_info(model)
        return _number_flat_params({fqn: (info.handle.flat_param, info.param_indices[fqn]) for fqn, info in infos.items()})


class TorchFSDP2OptimStateOps(TorchFSDP1OptimStateOps):
    """``torch.distributed.fsdp.fully_shard`` (per-parameter DTensor sharding) with
    ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``."""

    def unsupported(self, strategy: str, use_orig_params: bool) -> str | None:
        if not use_orig_params:
            return "fully_shard shards each parameter as a DTensor: there is no flat parameter (use_orig_params=False)"
        return None

    def wrap(self, model, *, strategy, use_orig_params, units, device):
        from torch.distributed.fsdp import fully_shard

        reason = self.unsupported(strategy, use_orig_params)
        if reason:
            raise Unsupported(reason)
        ws = _world_size()
        shape = {"HYBRID_SHARD": hybrid_mesh_shape(ws), "NO_SHARD": (ws, 1)}.get(strategy, (ws,))
        mesh = _mesh(device, shape)
        reshard = strategy in ("FULL_SHARD", "HYBRID_SHARD")
        model.to(device)
        if units is not None:
            # Innermost first, as auto-wrapping does: a unit never takes a nested unit's parameters.
            for module in reversed(list(model.modules())):
                if module is not model and units(module):
                    fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return model

    def optimizer_params(self, model):
        return [((canonical_fqn(name),), param) for name, param in model.named_parameters()]

    def full_state_dict(self, model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    def load_full_state_dict(self, model, state_dict):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))

    def sharded_state_dict(self, model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))

    def load_sharded_state_dict(self, model, state_dict):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=False))

    def optim_state_dict(self, model, optim, *, rank0_only=False, cpu_offload=False, sharded=False):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        # torch ties rank0_only to cpu_offload: a full state dict offloaded to the CPU is kept on rank 0 only.
        options = StateDictOptions(full_state_dict=not sharded, cpu_offload=cpu_offload or rank0_only)
        return get_optimizer_state_dict(model, optim, options=options)

    def load_optim_state_dict(self, model, optim, osd):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        from torch.distributed.tensor import DTensor

        sharded = any(isinstance(v, DTensor) for entry in osd.get("state", {}).values() for v in entry.values())
        set_optimizer_state_dict(model, optim, osd, options=StateDictOptions(full_state_dict=not sharded))

    def fqn_to_param_info(self, model):
        raise Unsupported("fully_shard has no flat parameters to key optimizer state by")
