"""Ops for the SD section: get/set state_dict with submodules, on plain and sharded models.

An implementation provides the six functions of ``torch.distributed.checkpoint.state_dict`` with
torch's signatures and its ``StateDictOptions`` (built by :meth:`StateDictOps.options`); sharded
models come from the adapter's one sharding method (``Adapter.sharding()``, with
:func:`conformance.adapters.sharding.child_units` as units). Everything else in the SD tests (models,
wrappers, oracles) is the suite's own.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

from torch import nn

__all__ = [
    "StateDictOps",
    "ReferenceStateDictOps",
    "TorchStateDictOps",
    "TorchFSDP2StateDictOps",
    "SHARDING_STRATEGIES",
]

#: Sharding strategies the SD tests shard with (FSDP1 names).
SHARDING_STRATEGIES: tuple[str, ...] = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


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
    """:mod:`reference.state_dict` (models sharded by the reference ``FullyShardedDataParallel``)."""

    submodules_deprecated: ClassVar[bool] = False

    def __init__(self) -> None:
        import reference.state_dict

        self._module = reference.state_dict


class TorchStateDictOps(_Functions):
    """``torch.distributed.checkpoint.state_dict`` as installed (models sharded by FSDP1)."""

    submodules_deprecated: ClassVar[bool] = True

    def __init__(self) -> None:
        import torch.distributed.checkpoint.state_dict as dsd

        self._module = dsd


class TorchFSDP2StateDictOps(TorchStateDictOps):
    """The same functions on models sharded by ``fully_shard`` (per-parameter DTensor sharding)."""
