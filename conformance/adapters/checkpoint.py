"""Ops for distributed checkpoints (SPEC.md ML-*): the protocol and the shipped implementations.

An implementation provides checkpoint I/O (``save``/``load`` of a state dict, on every rank) and,
for the sharded-model requirements (models sharded by the adapter's ``sharding()``), getting/setting
the sharded model and optimizer state dicts. The suite compares what comes back with the unsharded model (the
oracle) and with the reference. Every method is called by every rank of the process group.

Errors: an implementation may raise any exception type; the suite checks the type separately
(ML-15) from the message (it must name the key or file, and be the same on every rank).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn

from conformance.adapters.unsupported import Unsupported

__all__ = [
    "CheckpointOps",
    "ReferenceCheckpointOps",
    "TorchCheckpointOps",
    "TorchFSDP2CheckpointOps",
]


@runtime_checkable
class CheckpointOps(Protocol):
    """What the ML section needs from an implementation."""

    #: Short name for messages.
    name: str

    def save(
        self, state_dict: dict[str, Any], checkpoint_id: str | os.PathLike[str], *, process_group: Any = None
    ) -> None:
        """Save ``state_dict`` to the directory ``checkpoint_id``, in DCP's on-disk format unless the adapter
        declares another (``Adapter.checkpoint_format``). Its values: plain tensors, DTensors, non-tensor
        values (numbers, strings, ``None``, nested dicts, and lists and tuples that mix tensors with other
        values), and top-level ``Stateful`` objects (DCP's protocol: an object with ``state_dict()`` and
        ``load_state_dict(sd)``; what its ``state_dict()`` returns is saved under its key, and either call
        may be collective). ``process_group=None`` with torch.distributed not initialized: one process
        (an adapter declaring ``needs_process_group`` is not asked for that)."""

    def load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str | os.PathLike[str],
        *,
        process_group: Any = None,
        strict: bool = True,
        allow_unexpected: bool = True,
    ) -> None:
        """Load into ``state_dict`` in place (meta values are replaced by built ones; a top-level
        ``Stateful`` gets its loaded state through ``load_state_dict``, on every rank). ``strict=False``
        skips keys missing from the checkpoint; ``allow_unexpected=False`` makes checkpoint keys the state
        dict does not ask for an error. Raise :class:`Unsupported` for an option not provided."""

    def get_state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The sharded model and optimizer state dicts of a model the adapter's ``sharding()`` sharded, keyed by
        parameter FQNs, their sharded values as DTensors, ready to :meth:`save`."""

    def set_state_dicts(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict
    ) -> None:
        """Load state dicts shaped like :meth:`get_state_dicts`' into ``model`` and ``optimizer``."""


class _TorchStateDicts:
    """Sharded state dicts through ``torch.distributed.checkpoint.state_dict`` (DTensor-valued)."""

    def get_state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(model, optimizer)

    def set_state_dicts(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)



class ReferenceCheckpointOps:
    """``reference.checkpoint.save/load``; the DTensor-valued sharded model and optimizer state dicts of
    ``reference.fsdp.FullyShardedDataParallel``."""

    name = "reference"

    def save(self, state_dict: dict[str, Any], checkpoint_id: str | os.PathLike[str], *, process_group: Any = None) -> None:
        from reference import checkpoint

        checkpoint.save(state_dict, checkpoint_id=checkpoint_id, process_group=process_group)

    def load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str | os.PathLike[str],
        *,
        process_group: Any = None,
        strict: bool = True,
        allow_unexpected: bool = True,
    ) -> None:
        from reference import checkpoint

        checkpoint.load(
            state_dict,
            checkpoint_id=checkpoint_id,
            process_group=process_group,
            strict=strict,
            allow_unexpected=allow_unexpected,
        )

    def get_state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        from reference.fsdp import FullyShardedDataParallel, sharded_state_dict

        # reference.fsdp attaches this static method to the class when it is imported (torch's
        # API, see its module docstring); a type checker sees only the class body.
        return sharded_state_dict(model), FullyShardedDataParallel.optim_state_dict(model, optimizer, sharded=True)  # type: ignore[attr-defined]

    def set_state_dicts(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict
    ) -> None:
        from reference.fsdp import FullyShardedDataParallel, load_sharded_state_dict

        load_sharded_state_dict(model, model_sd)
        # reference.fsdp attaches this static method to the class when it is imported (torch's
        # API, see its module docstring); a type checker sees only the class body.
        optimizer.load_state_dict(FullyShardedDataParallel.optim_state_dict_to_load(model, optimizer, optim_sd))  # type: ignore[attr-defined]


class TorchCheckpointOps(_TorchStateDicts):
    """``torch.distributed.checkpoint.save/load`` with the default planners; sharded models are FSDP1
    (on a device mesh, so its sharded state dicts hold DTensors)."""

    name = "torch"

    def save(self, state_dict: dict[str, Any], checkpoint_id: str | os.PathLike[str], *, process_group: Any = None) -> None:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns on overwrite and without a process group
            dcp.save(state_dict, checkpoint_id=checkpoint_id, process_group=process_group)

    def load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str | os.PathLike[str],
        *,
        process_group: Any = None,
        strict: bool = True,
        allow_unexpected: bool = True,
    ) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        if not allow_unexpected:
            raise Unsupported("torch.distributed.checkpoint.load has no option to reject or report unexpected keys")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(
                state_dict,
                checkpoint_id=checkpoint_id,
                process_group=process_group,
                planner=DefaultLoadPlanner(allow_partial_load=not strict),
            )


class TorchFSDP2CheckpointOps(TorchCheckpointOps):
    """``torch.distributed.checkpoint.save/load``; sharded models are ``fully_shard`` (FSDP2)."""

    name = "torch-fsdp2"

