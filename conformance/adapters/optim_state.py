"""Ops for the OS section: save/load the model and optimizer state dicts of a sharded model by clean FQN.

Models are sharded by the adapter's one sharding method (``Adapter.sharding()``, see
:mod:`conformance.adapters.sharding`). Every method is called on every rank of the pool, in the same order.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn

from conformance.adapters.unsupported import Unsupported
from conformance.fqn import canonical_fqn

__all__ = [
    "OptimStateOps",
    "ReferenceOptimStateOps",
    "TorchFSDP1OptimStateOps",
    "TorchFSDP2OptimStateOps",
]

@runtime_checkable
class OptimStateOps(Protocol):
    """What the OS tests need of an implementation of sharded data parallel, for a model sharded by the
    adapter's ``sharding()``."""

    # Optional: ``attach_optimizer(self, model, optimizer) -> optimizer``, for a stack whose engine must
    # own the optimizer (DeepSpeed's ``deepspeed.initialize``): given the ``torch.optim`` optimizer the test
    # built over :meth:`optimizer_params`, return what the test steps (``zero_grad``, ``step``; the loss's
    # ``backward`` runs on the model's output) and hands to the methods below as ``optim``. Without it
    # the built optimizer is stepped as it is.

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

    def optimizer_params(self, model):
        from reference.fsdp import get_param_to_fqns

        return [(tuple(fqns), param) for param, fqns in get_param_to_fqns(model).items()]

    def optim_state_dict(self, model, optim, *, rank0_only=False, cpu_offload=False, sharded=False):
        from reference.fsdp import FullyShardedDataParallel

        # reference.fsdp attaches this static method to the class when it is imported (torch's
        # API, see its module docstring); a type checker sees only the class body.
        return FullyShardedDataParallel.optim_state_dict(model, optim, rank0_only=rank0_only, cpu_offload=cpu_offload, sharded=sharded)  # type: ignore[attr-defined]

    def load_optim_state_dict(self, model, optim, osd):
        from reference.fsdp import FullyShardedDataParallel

        # reference.fsdp attaches this static method to the class when it is imported (torch's
        # API, see its module docstring); a type checker sees only the class body.
        optim.load_state_dict(FullyShardedDataParallel.optim_state_dict_to_load(model, optim, osd))  # type: ignore[attr-defined]

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
