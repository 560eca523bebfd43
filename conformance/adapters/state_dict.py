"""Ops for the SD section: get/set state_dict with submodules, on plain and sharded models.

An implementation provides the six functions of ``torch.distributed.checkpoint.state_dict`` with
torch's signatures, its ``StateDictOptions`` (built by :meth:`StateDictOps.options`), and a way to
shard a model on the current process group (:meth:`StateDictOps.shard`). Everything else in the SD
tests (models, wrappers, oracles) is the suite's own.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from conformance.adapters.base import Unsupported

__all__ = [
    "StateDictOps",
    "ReferenceStateDictOps",
    "TorchStateDictOps",
    "TorchFSDP2StateDictOps",
    "SHARDING_STRATEGIES",
    "has_shared_parameters",
]

#: Sharding strategies the SD tests ask :meth:`StateDictOps.shard` for (FSDP1 names).
SHARDING_STRATEGIES: tuple[str, ...] = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


def has_shared_parameters(model: nn.Module) -> bool:
    """True if one parameter is reachable under two names (tied weights)."""
    named = list(model.named_parameters(remove_duplicate=False))
    return len(named) != len({id(p) for _, p in named})


def _wrap_units(model: nn.Module) -> list[nn.Module]:
    """The submodules that get their own sharding unit: the direct children holding parameters,
    unless parameters are shared between children (tied weights must stay in one unit)."""
    if has_shared_parameters(model):
        return []
    return [child for child in model.children() if any(True for _ in child.parameters())]


@runtime_checkable
class StateDictOps(Protocol):
    """What the SD tests call. Functions mirror ``torch.distributed.checkpoint.state_dict``.

    All of them are called on every rank of the process group when the model is sharded; on a plain
    model they may be called on one process without a process group."""

    #: Whether this implementation emits a ``FutureWarning`` for ``submodules=`` and submodule-keyed
    #: model state dicts (torch deprecated both but still implements them). Tests record the warning.
    submodules_deprecated: ClassVar[bool]

    def options(self, **fields: Any) -> Any:
        """This implementation's ``StateDictOptions(**fields)`` (torch's field names)."""
        ...

    def get_model_state_dict(self, model: nn.Module, *, submodules: set[nn.Module] | None = None, options: Any = None) -> dict[str, Any]: ...

    def get_optimizer_state_dict(self, model: nn.Module, optimizers: Any, *, options: Any = None) -> dict[str, Any]: ...

    def get_state_dict(
        self, model: nn.Module, optimizers: Any, *, submodules: set[nn.Module] | None = None, options: Any = None
    ) -> tuple[dict[str, Any], dict[str, Any]]: ...

    def set_model_state_dict(self, model: nn.Module, model_state_dict: Any, *, options: Any = None) -> Any:
        """Returns ``(missing_keys, unexpected_keys)`` (a NamedTuple with those fields)."""
        ...

    def set_optimizer_state_dict(self, model: nn.Module, optimizers: Any, optim_state_dict: dict[str, Any], *, options: Any = None) -> None: ...

    def set_state_dict(
        self, model: nn.Module, optimizers: Any, *, model_state_dict: Any, optim_state_dict: dict[str, Any], options: Any = None
    ) -> Any: ...

    def shard(self, model: nn.Module, device: torch.device, *, strategy: str = "FULL_SHARD") -> nn.Module:
        """``model`` sharded over the default process group on ``device`` with ``strategy`` (one of
        :data:`SHARDING_STRATEGIES`): the root and each parameter-holding child (unless weights are
        tied across children) are sharding units. Raises ``Unsupported`` for a strategy it lacks.
        Collective: every rank calls it with an identical ``model``."""
        ...


class _Functions:
    """Forwards the six functions to a module that defines them (torch's or the reference's)."""

    _module: Any

    def options(self, **fields: Any) -> Any:
        return self._module.StateDictOptions(**fields)

    def get_model_state_dict(self, model: nn.Module, *, submodules: set[nn.Module] | None = None, options: Any = None) -> dict[str, Any]:
        return self._module.get_model_state_dict(model, submodules=submodules, options=options)

    def get_optimizer_state_dict(self, model: nn.Module, optimizers: Any, *, options: Any = None) -> dict[str, Any]:
        return self._module.get_optimizer_state_dict(model, optimizers, options=options)

    def get_state_dict(
        self, model: nn.Module, optimizers: Any, *, submodules: set[nn.Module] | None = None, options: Any = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        return self._module.get_state_dict(model, optimizers, submodules=submodules, options=options)

    def set_model_state_dict(self, model: nn.Module, model_state_dict: Any, *, options: Any = None) -> Any:
        return self._module.set_model_state_dict(model, model_state_dict, options=options)

    def set_optimizer_state_dict(self, model: nn.Module, optimizers: Any, optim_state_dict: dict[str, Any], *, options: Any = None) -> None:
        return self._module.set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)

    def set_state_dict(
        self, model: nn.Module, optimizers: Any, *, model_state_dict: Any, optim_state_dict: dict[str, Any], options: Any = None
    ) -> Any:
        return self._module.set_state_dict(
            model, optimizers, model_state_dict=model_state_dict, optim_state_dict=optim_state_dict, options=options
        )


class ReferenceStateDictOps(_Functions):
    """:mod:`reference.state_dict`; sharding by the reference ``FullyShardedDataParallel``."""

    submodules_deprecated: ClassVar[bool] = False

    def __init__(self) -> None:
        import reference.state_dict

        self._module = reference.state_dict

    def shard(self, model: nn.Module, device: torch.device, *, strategy: str = "FULL_SHARD") -> nn.Module:
        try:
            from reference import fsdp
        except ImportError as exc:
            raise Unsupported(f"reference.fsdp is not available ({exc})") from exc
        kwargs: dict[str, Any] = {"sharding_strategy": strategy, "device_id": device, "use_orig_params": False}
        for unit in _wrap_units(model):
            _replace_child(model, unit, fsdp.FullyShardedDataParallel(unit, **kwargs))
        return fsdp.FullyShardedDataParallel(model, **kwargs)


class TorchStateDictOps(_Functions):
    """``torch.distributed.checkpoint.state_dict`` as installed; sharding by FSDP1
    (``FullyShardedDataParallel`` with ``use_orig_params=True``)."""

    submodules_deprecated: ClassVar[bool] = True

    def __init__(self) -> None:
        import torch.distributed.checkpoint.state_dict as dsd

        self._module = dsd

    def shard(self, model: nn.Module, device: torch.device, *, strategy: str = "FULL_SHARD") -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        if strategy not in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            raise Unsupported(f"sharding strategy {strategy} needs a 2-D mesh; the SD tests use a 1-D group")
        # A device mesh (rather than a process group) makes FSDP1's sharded state dicts DTensors
        # instead of the legacy ShardedTensor.
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        kwargs: dict[str, Any] = {
            "sharding_strategy": ShardingStrategy[strategy],
            "device_id": device,
            "device_mesh": mesh,
            "use_orig_params": True,
        }
        for unit in _wrap_units(model):
            _replace_child(model, unit, FSDP(unit, **kwargs))
        return FSDP(model, **kwargs)


class TorchFSDP2StateDictOps(TorchStateDictOps):
    """The same functions on models sharded by ``fully_shard`` (per-parameter DTensor sharding)."""

    def shard(self, model: nn.Module, device: torch.device, *, strategy: str = "FULL_SHARD") -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if strategy == "FULL_SHARD":
            reshard = True
        elif strategy == "SHARD_GRAD_OP":
            reshard = False
        else:
            raise Unsupported(f"fully_shard has no {strategy} strategy (use replicate for no sharding)")
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        for unit in _wrap_units(model):
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return model


def _replace_child(parent: nn.Module, child: nn.Module, replacement: nn.Module) -> None:
    for name, module in parent.named_children():
        if module is child:
            setattr(parent, name, replacement)
            return
    raise ValueError(f"{type(child).__name__} is not a child of {type(parent).__name__}")
