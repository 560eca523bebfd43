"""Where :mod:`reference.state_dict` gets and puts a model's state: one backend per kind of model.

:func:`for_model` chooses:

* :class:`PlainBackend` for a model with ordinary parameters, possibly wrapped by DDP,
  ``torch.compile``, activation checkpointing or FlattenParamsWrapper, and for models whose parameters
  are DTensors (tensor parallel, ``fully_shard``): ``nn.Module.state_dict`` / ``load_state_dict``.
* :class:`ShardedBackend` for a model containing the reference ``FullyShardedDataParallel``: its
  full/sharded state-dict functions and its optimizer-state conversion.

The FQN logic, submodule selection and validation live in :mod:`reference.state_dict`, the same for
both; a backend only moves values. Getting and loading state through :class:`ShardedBackend` is
collective (all ranks call, in the same order); :class:`PlainBackend` is collective only for DTensor
parameters (gathering them for ``full_state_dict``) and in :func:`broadcast_from_rank0`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from reference import comm
from reference.fqn import FQNResolver, named_parameter_fqns
from reference.state_dict import optim_fqn as _optim

if TYPE_CHECKING:
    from reference.state_dict.options import StateDictOptions

__all__ = ["ModelBackend", "PlainBackend", "ShardedBackend", "for_model", "broadcast_from_rank0", "collective_group"]


class ModelBackend(Protocol):
    """What :mod:`reference.state_dict` needs from a kind of model. Keys in and out may spell wrapper
    segments ("backend keys"); the caller turns them into canonical FQNs."""

    def model_state_dict(self, model: nn.Module, options: StateDictOptions) -> dict[str, Any]:
        """The model state dict, full or sharded as ``options`` say."""
        ...

    def local_state(self, model: nn.Module) -> Mapping[str, Any]:
        """Backend key -> the current value of every entry a load expects (shape = full shape)."""
        ...

    def load_model_state_dict(self, model: nn.Module, state_dict: dict[str, Any], options: StateDictOptions) -> None:
        """Load an already validated dict (backend keys, shapes checked). Must not fail halfway."""
        ...

    def frozen_fqns(self, model: nn.Module, resolver: FQNResolver) -> set[str]:
        """Canonical FQNs of parameters with ``requires_grad=False``."""
        ...

    def param_fqns(self, model: nn.Module) -> dict[torch.Tensor, list[str]]:
        """Parameter as the optimizers hold it -> its canonical FQNs."""
        ...

    def optim_state_dict(
        self, model: nn.Module, optims: tuple[torch.optim.Optimizer, ...], options: StateDictOptions
    ) -> dict[str, Any]:
        """The combined FQN-keyed optimizer state dict (nested form)."""
        ...

    def check_optim_load(
        self,
        model: nn.Module,
        optims: tuple[torch.optim.Optimizer, ...],
        osd: dict[str, Any],
        options: StateDictOptions,
    ) -> None:
        """The checks of an FQN-keyed optimizer state dict that need no collective (run, and agreed on,
        before :meth:`plan_optim_load`, which may gather)."""
        ...

    def from_ids(self, model: nn.Module, optims: tuple[torch.optim.Optimizer, ...], osd: dict[str, Any]) -> dict[str, Any]:
        """The FQN-keyed dict an optimizer's own (id-keyed) state dict stands for, or ``ValueError``."""
        ...

    def plan_optim_load(
        self,
        model: nn.Module,
        optims: tuple[torch.optim.Optimizer, ...],
        osd: dict[str, Any],
        options: StateDictOptions,
    ) -> Callable[[], None]:
        """Validate an FQN-keyed optimizer state dict; return the function that loads it."""
        ...

    def finish(self, state_dict: dict[str, Any], options: StateDictOptions) -> dict[str, Any]:
        """Apply ``full_state_dict`` / ``cpu_offload`` to a result that the backend has not already."""
        ...

    def device(self, model: nn.Module) -> torch.device:
        """The device collectives of this model's process group use."""
        ...


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def _collective_device() -> torch.device:
    # nccl moves CUDA tensors only; every other backend here (gloo) moves CPU tensors.
    if _in_group() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _map_leaves(tree: Any, leaf: type, fn: Callable[[Any], Any]) -> Any:
    """``tree`` (mappings, lists, tuples) rebuilt with ``fn`` applied to each instance of ``leaf``, in
    depth-first order (the same on every rank for the same structure); other values as they are."""
    if isinstance(tree, leaf):
        return fn(tree)
    if isinstance(tree, Mapping):
        return {k: _map_leaves(v, leaf, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_leaves(v, leaf, fn) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_map_leaves(v, leaf, fn) for v in tree)
    return tree


def _map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    return _map_leaves(tree, torch.Tensor, fn)


def _full_and_offloaded(tree: dict[str, Any], options: StateDictOptions) -> dict[str, Any]:
    """``full_state_dict``: DTensors become full plain tensors (collective if there are any).
    ``cpu_offload``: tensors move to CPU; with ``full_state_dict`` in a group, only the coordinator (the
    default group's first rank) keeps them, the others get ``{}``."""
    if options.full_state_dict:
        tree = _map_tensors(tree, lambda t: t.full_tensor() if isinstance(t, DTensor) else t)
    if options.cpu_offload:
        if options.full_state_dict and not comm.is_coordinator(comm.default_group()):
            return {}
        tree = _map_tensors(tree, lambda t: t.cpu())
    return tree


class PlainBackend:
    """Models whose parameters are ordinary tensors or DTensors (see the module docstring)."""

    def model_state_dict(self, model: nn.Module, options: StateDictOptions) -> dict[str, Any]:
        return dict(model.state_dict())

    def local_state(self, model: nn.Module) -> Mapping[str, Any]:
        return model.state_dict(keep_vars=True)

    def load_model_state_dict(self, model: nn.Module, state_dict: dict[str, Any], options: StateDictOptions) -> None:
        local = model.state_dict(keep_vars=True)
        ready: dict[str, Any] = {}
        for key, value in state_dict.items():
            current = local[key]
            # A full tensor into a DTensor parameter: keep this rank's part. A DTensor into a plain
            # parameter: gather it. Both as torch's _distribute_state_dict does.
            if isinstance(current, DTensor) and not isinstance(value, DTensor):
                value = distribute_tensor(value.to(current.device), current.device_mesh, current.placements)
            elif isinstance(value, DTensor) and not isinstance(current, DTensor):
                value = value.full_tensor()
            ready[key] = value
        result = model.load_state_dict(ready, strict=False)
        # Invariant: the caller validated every key, so nn.Module had nothing to reject.
        assert not result.unexpected_keys, result.unexpected_keys

    def frozen_fqns(self, model: nn.Module, resolver: FQNResolver) -> set[str]:
        return {
            resolver.clean_key(name)
            for name, p in model.named_parameters(remove_duplicate=False)
            if not p.requires_grad
        }

    def param_fqns(self, model: nn.Module) -> dict[torch.Tensor, list[str]]:
        return named_parameter_fqns(model)

    def optim_state_dict(
        self, model: nn.Module, optims: tuple[torch.optim.Optimizer, ...], options: StateDictOptions
    ) -> dict[str, Any]:
        for optim in optims:
            _optim.init_state(optim)
        return _optim.to_fqn_keyed(optims, self.param_fqns(model))

    def check_optim_load(
        self,
        model: nn.Module,
        optims: tuple[torch.optim.Optimizer, ...],
        osd: dict[str, Any],
        options: StateDictOptions,
    ) -> None:
        """Nothing beyond :meth:`plan_optim_load`, which is local here."""

    def from_ids(self, model: nn.Module, optims: tuple[torch.optim.Optimizer, ...], osd: dict[str, Any]) -> dict[str, Any]:
        return _optim.from_ids(optims, osd, self.param_fqns(model))

    def plan_optim_load(
        self,
        model: nn.Module,
        optims: tuple[torch.optim.Optimizer, ...],
        osd: dict[str, Any],
        options: StateDictOptions,
    ) -> Callable[[], None]:
        return _optim.plan_load(optims, osd, self.param_fqns(model), strict=options.strict)

    def finish(self, state_dict: dict[str, Any], options: StateDictOptions) -> dict[str, Any]:
        return _full_and_offloaded(state_dict, options)

    def device(self, model: nn.Module) -> torch.device:
        return _collective_device()


class ShardedBackend(PlainBackend):
    """Models containing the reference ``FullyShardedDataParallel`` (:mod:`reference.fsdp`).

    Getting and loading are collective. Model state goes through ``reference.fsdp``'s ``full_state_dict`` /
    ``sharded_state_dict`` / ``load_*_state_dict``, optimizer state through
    ``FullyShardedDataParallel.optim_state_dict`` / ``optim_state_dict_to_load``; all of them give and
    take canonical FQNs."""

    def model_state_dict(self, model: nn.Module, options: StateDictOptions) -> dict[str, Any]:
        from reference.fsdp import model_state

        if options.full_state_dict:
            # rank0_only with cpu_offload: N ranks must not hold N CPU copies (torch's contract).
            return model_state.full_state_dict(model, rank0_only=options.cpu_offload, cpu_offload=options.cpu_offload)
        return model_state.sharded_state_dict(model)

    def local_state(self, model: nn.Module) -> Mapping[str, Any]:
        # Shapes without a collective: meta tensors of each entry's full shape; an extra state (opaque,
        # layout None) stands as None, its key all a load checks.
        from reference.fsdp.model_state import state_dict_layout

        return {
            key: None if layout is None else torch.empty(layout[0], dtype=layout[1], device="meta")
            for key, layout in state_dict_layout(model).items()
        }

    def load_model_state_dict(self, model: nn.Module, state_dict: dict[str, Any], options: StateDictOptions) -> None:
        from reference.fsdp import model_state

        # Invariant: every rank holds the same keys (all ranks got them from one get, or from the
        # broadcast), so the all-gathers inside load_sharded_state_dict line up.
        if any(isinstance(v, DTensor) for v in state_dict.values()):
            model_state.load_sharded_state_dict(model, state_dict, strict=False)
        else:
            model_state.load_full_state_dict(model, state_dict, strict=False)

    def frozen_fqns(self, model: nn.Module, resolver: FQNResolver) -> set[str]:
        # With use_orig_params=False a flat parameter is frozen exactly when all its parameters are
        # (reference.fsdp refuses mixed units), so its requires_grad speaks for each FQN it holds.
        return {fqn for p, fqns in self.param_fqns(model).items() if not p.requires_grad for fqn in fqns}

    def param_fqns(self, model: nn.Module) -> dict[torch.Tensor, list[str]]:
        from reference.fsdp.optim_keys import get_param_to_fqns

        return {param: fqns for param, fqns in get_param_to_fqns(model).items()}

    def optim_state_dict(
        self, model: nn.Module, optims: tuple[torch.optim.Optimizer, ...], options: StateDictOptions
    ) -> dict[str, Any]:
        from reference.fsdp import optim_keys

        merged: dict[str, Any] = {_optim.STATE: {}, _optim.PG: []}
        rank0_only = options.full_state_dict and options.cpu_offload
        for optim in optims:
            # optim_keys.optim_state_dict materializes the state no rank holds, agreed across ranks
            # (a local init_state here would also fill parts another rank holds state for).
            osd = optim_keys.optim_state_dict(
                model, optim, rank0_only=rank0_only, cpu_offload=options.cpu_offload, sharded=not options.full_state_dict
            )
            if not osd:  # rank0_only, on a rank > 0
                return {}
            merged[_optim.STATE].update(osd[_optim.STATE])
            merged[_optim.PG].extend(osd[_optim.PG])
        return merged

    def check_optim_load(
        self,
        model: nn.Module,
        optims: tuple[torch.optim.Optimizer, ...],
        osd: dict[str, Any],
        options: StateDictOptions,
    ) -> None:
        from reference.fsdp.optim_keys import get_fqn_to_fsdp_param_info

        # A flat parameter stands for several parameters: each is checked, under any of its names.
        slots: dict[torch.Tensor, dict[int, list[str]]] = {}
        for fqn, info in get_fqn_to_fsdp_param_info(model).items():  # slot names before tied aliases
            if not info.state.use_orig_params:
                slots.setdefault(info.flat_param, {}).setdefault(info.param_indices[fqn], []).append(fqn)
        flat_slots = {p: list(by_index.values()) for p, by_index in slots.items()}
        _optim.check_keys(optims, osd, self.param_fqns(model), strict=options.strict, flat_slots=flat_slots)

    def from_ids(self, model: nn.Module, optims: tuple[torch.optim.Optimizer, ...], osd: dict[str, Any]) -> dict[str, Any]:
        # Its ids name this rank's flat shards (or parts of parameters): local state, not a model's.
        raise ValueError(
            "an optimizer's own state dict (keyed by parameter ids) of a sharded model holds one rank's shards: "
            "load the FQN-keyed dict of get_optimizer_state_dict instead; nothing was loaded"
        )

    def plan_optim_load(
        self,
        model: nn.Module,
        optims: tuple[torch.optim.Optimizer, ...],
        osd: dict[str, Any],
        options: StateDictOptions,
    ) -> Callable[[], None]:
        from reference.fsdp import optim_keys

        param_fqns = self.param_fqns(model)
        to_load = []
        for index, optim in enumerate(optims):
            part = _optim.part_of(optims, index, osd, param_fqns)
            to_load.append(optim_keys.optim_state_dict_to_load(model, optim, part))

        def apply() -> None:
            for optim, sd in zip(optims, to_load):
                optim.load_state_dict(sd)

        return apply

    def finish(self, state_dict: dict[str, Any], options: StateDictOptions) -> dict[str, Any]:
        # full_state_dict and its cpu_offload were applied by reference.fsdp; a sharded dict's local
        # shards still go to CPU when asked.
        if options.cpu_offload and not options.full_state_dict:
            offloaded: dict[str, Any] = _map_tensors(state_dict, lambda t: t.cpu())
            return offloaded
        return state_dict


def for_model(model: nn.Module) -> ModelBackend:
    """The backend for ``model``. A model wrapped by upstream torch FSDP1 is a ``TypeError``: the
    reference does not reach into torch's flat parameters (use torch's own state_dict API)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    if any(isinstance(m, TorchFSDP) for m in model.modules()):
        raise TypeError(
            f"{type(model).__name__} contains torch.distributed.fsdp.FullyShardedDataParallel; the reference "
            "get/set_state_dict handles the reference FullyShardedDataParallel, plain and DTensor models"
        )
    from reference.fsdp.unit import FullyShardedDataParallel

    if FullyShardedDataParallel.fsdp_modules(model):
        return ShardedBackend()
    return PlainBackend()


# ---------------------------------------------------------------------------------------------------
# which ranks take part


def collective_group(model: nn.Module, backend: ModelBackend, broadcast: bool) -> dist.ProcessGroup | None:
    """The group a get or set on ``model`` is collective over, or None when each rank may call it
    alone: a sharded model's group; the default group for DTensor parameters or ``broadcast_from_rank0``.
    Every check that may raise before a collective of such a call is agreed on over this group
    (:func:`reference.comm.agree`), so that a rank that fails alone does not leave the others waiting."""
    if isinstance(backend, ShardedBackend):
        from reference.fsdp.unit import model_group

        group = model_group(model)
    elif broadcast or any(isinstance(p, DTensor) for p in model.parameters()):
        group = comm.default_group()
    else:
        return None
    return group if comm.group_size(group) > 1 else None


# ---------------------------------------------------------------------------------------------------
# broadcast_from_rank0


class _TensorSlot(NamedTuple):
    """Placeholder for the i-th tensor of a broadcast tree (what is pickled instead of the data)."""

    position: int  #: in the coordinator's list of tensors, in tree order
    shape: torch.Size
    dtype: torch.dtype


def broadcast_from_rank0(tree: Any, device: torch.device, group: dist.ProcessGroup | None) -> Any:
    """The coordinator's ``tree`` (dicts/lists of tensors and small values) on every rank of ``group``.
    Collective; with no group (None) this returns ``tree``.

    The structure and tensor metadata travel as one pickled object; each tensor then travels by a
    broadcast on ``device``. Received tensors stay on ``device``; the coordinator keeps its own. Values
    on other ranks are ignored. A tree the coordinator cannot send (a DTensor in it) raises the same
    ``TypeError`` on every rank, before any tensor moves."""
    if comm.group_size(group) == 1:
        return tree
    tensors: list[torch.Tensor] = []

    def to_slot(t: torch.Tensor) -> _TensorSlot:
        if isinstance(t, DTensor):
            raise TypeError("broadcast_from_rank0: rank 0's state dict must hold full tensors, got a DTensor")
        tensors.append(t)
        return _TensorSlot(len(tensors) - 1, t.shape, t.dtype)

    skeleton = comm.broadcast_from_coordinator(group, lambda: _map_tensors(tree, to_slot))
    sender = comm.is_coordinator(group)

    def receive(slot: _TensorSlot) -> torch.Tensor:
        if sender:
            comm.broadcast_tensor(tensors[slot.position].detach().to(device), group)
            return tensors[slot.position]
        return comm.broadcast_tensor(torch.empty(slot.shape, dtype=slot.dtype, device=device), group)

    # Every rank walks the same skeleton, so the broadcasts pair up.
    return _map_leaves(skeleton, _TensorSlot, receive)
