"""Model state dicts of a sharded model: full (plain tensors) and sharded (DTensors), and their loads.

Every function is collective over the model's group (every rank calls it, in the same order) except
:func:`state_dict_layout` and :func:`to_dtensor`, which are local. Keys are canonical FQNs
(:mod:`reference.fqn`): exactly the keys ``state_dict()`` of the unwrapped model has.

A module's *extra state* (what its ``get_extra_state()`` returns, under ``<module>._extra_state``: Transformer
Engine keeps FP8 scaling metadata there) is any picklable object, a tensor included. It is opaque: the get
gives what ``get_extra_state()`` returned (tensors in it copied, to the CPU with ``cpu_offload``), never
sharded; the load hands the given value to that module's ``set_extra_state()``, unchecked for shape (the
module decides, as ``nn.Module.load_state_dict`` lets it), and under ``strict`` a missing one is a missing key.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn

from reference import comm
from reference.fqn import FQNResolver, join_fqn
from reference.fsdp.sharding import FlatParamHandle
from reference.fsdp.unit import (
    FLAT_PARAM,
    FullyShardedDataParallel,
    ShardingStrategy,
    model_group,
    reshard_all,
    units,
)

__all__ = [
    "EXTRA_STATE",
    "full_state_dict",
    "sharded_state_dict",
    "load_full_state_dict",
    "load_sharded_state_dict",
    "state_dict_layout",
    "to_dtensor",
]


#: The last segment of the key under which ``nn.Module.state_dict`` puts ``get_extra_state()``.
EXTRA_STATE = "_extra_state"


def _has_extra_state(module: nn.Module) -> bool:
    """Whether ``module`` contributes an extra-state entry (its class overrides ``get_extra_state``, the
    test ``nn.Module.state_dict`` applies)."""
    return type(module).get_extra_state is not nn.Module.get_extra_state


def _extra_state_modules(model: nn.Module, resolver: FQNResolver) -> dict[str, nn.Module]:
    """Clean FQN of every extra-state entry under ``model`` -> the module whose ``set_extra_state`` takes it."""
    return {
        resolver.clean_key(join_fqn(prefix, EXTRA_STATE)): module
        for prefix, module in model.named_modules()
        if _has_extra_state(module)
    }


def _copied(value: Any, *, cpu_offload: bool) -> Any:
    """``value`` with every tensor in it (itself, or inside plain dicts, lists and tuples) detached and
    copied, to the CPU with ``cpu_offload``; other objects as they are (an extra state may be anything)."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return value.cpu().clone() if cpu_offload else value.clone()
    if type(value) is dict:
        return {k: _copied(v, cpu_offload=cpu_offload) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_copied(v, cpu_offload=cpu_offload) for v in value)
    return value


def _owned_handle(unit: FullyShardedDataParallel) -> FlatParamHandle:
    """The handle of a unit that owns parameters (as every unit :func:`units` lists does)."""
    handle = unit.handle
    assert handle is not None, "a unit without parameters was listed as owning some"
    return handle


@contextlib.contextmanager
def _unsharded_params(model: nn.Module) -> Iterator[None]:
    """Inside: every original parameter name of every unit under ``model`` holds its full value (a
    detached view of the gathered flat parameter) and flat parameters are hidden, so
    ``model.state_dict()`` shows the unwrapped model's entries. All-gathers on entry (collective, units
    in ``modules()`` order); resharded on exit, also on error."""
    owning = [u for u in FullyShardedDataParallel.fsdp_modules(model) if u.handle is not None]
    reshard_all(model)
    hidden = []
    try:
        for unit in owning:
            handle = _owned_handle(unit)
            handle.unshard()
            handle.show_views(handle.full_param_views())
            if FLAT_PARAM in unit._parameters:
                hidden.append((unit, unit._parameters[FLAT_PARAM]))
                unit._parameters[FLAT_PARAM] = None
        yield
    finally:
        for unit, flat in hidden:
            unit._parameters[FLAT_PARAM] = flat
        reshard_all(model)  # every unit whose names were pointed at full views was unsharded first


def full_state_dict(model: nn.Module, *, rank0_only: bool = False, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded model state dict under clean FQNs: the keys and values ``state_dict()`` of the
    unwrapped model would have (tied parameters under every name, non-persistent buffers absent).

    Collective: every rank of the model's groups calls it. With ``rank0_only`` only the coordinator
    (the first rank of the model's group, :func:`model_group`) gets the values, the other ranks ``{}``;
    with ``cpu_offload`` values are on the CPU. Values are copies, never views of the model; extra state
    is what ``get_extra_state()`` returned, its tensors copied (module docstring)."""
    keep = not rank0_only or comm.is_coordinator(model_group(model))
    names = FQNResolver(model)
    with _unsharded_params(model):
        raw = model.state_dict()
        out = {}
        for key, value in raw.items():
            if keep:
                out[names.clean_key(key)] = _copied(value, cpu_offload=cpu_offload)
    return out


def _param_placements(unit: FullyShardedDataParallel, ndim: int) -> tuple[Any, tuple[Any, ...]]:
    """``(mesh, placements)`` of a sharded-state-dict DTensor of a ``ndim``-dim parameter of ``unit``."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = unit.device_mesh
    shard = Shard(0) if ndim > 0 else Replicate()
    if unit.sharding_strategy is ShardingStrategy.HYBRID_SHARD:
        return mesh, (Replicate(), shard)
    if unit.sharding_strategy is ShardingStrategy.NO_SHARD:
        return mesh, (Replicate(),)
    return mesh, (shard,)


def to_dtensor(unit: FullyShardedDataParallel, full: torch.Tensor) -> Any:
    """``full`` (identical on every rank) as a DTensor laid out like ``unit``'s parameters: this rank
    keeps its ``torch.chunk`` piece along dim 0 of the shard axis. Local; no collective."""
    from torch.distributed.tensor import DTensor, Shard

    mesh, placements = _param_placements(unit, full.dim())
    local = full
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            pieces = torch.chunk(full, mesh.size(mesh_dim), dim=0)
            coordinate = mesh.get_local_rank(mesh_dim)
            # torch.chunk may return fewer pieces than ranks: the missing ones are empty.
            local = pieces[coordinate] if coordinate < len(pieces) else full.new_empty((0, *full.shape[1:]))
    return DTensor.from_local(local.clone(), mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _slot_names(resolver: FQNResolver, base: str, handle: FlatParamHandle) -> list[list[str]]:
    """Per slot of ``handle``, its canonical FQNs under ``resolver.root``: the first name, then tied aliases."""
    names = [[resolver.clean_key(base + slot.fqn)] for slot in handle.slots]
    for alias in handle.aliases:
        names[alias.slot_index].append(resolver.clean_key(base + alias.fqn))
    return names


def _param_owner_units(model: nn.Module) -> dict[str, FullyShardedDataParallel]:
    """Clean FQN of every flattened parameter (aliases included) -> its unit."""
    resolver = FQNResolver(model)
    return {name: unit for base, unit in units(model) for names in _slot_names(resolver, base, _owned_handle(unit)) for name in names}


def sharded_state_dict(model: nn.Module) -> dict[str, Any]:
    """The model state dict under clean FQNs with parameters as DTensors (layout in the module
    docstring) and buffers as plain tensors. Collective: every rank of the model's groups calls it."""
    owners = _param_owner_units(model)
    full = full_state_dict(model)
    return {key: to_dtensor(owners[key], value) if key in owners else value for key, value in full.items()}


def load_sharded_state_dict(model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
    """Load what :func:`sharded_state_dict` returns (DTensors of any layout over this world, or plain
    tensors). Collective. Checked like :func:`load_full_state_dict` before anything is gathered."""
    from torch.distributed.tensor import DTensor

    expected = state_dict_layout(model)

    def check() -> list[str]:
        _check_state_dict(model, state_dict, strict=strict, expected=expected)
        return sorted(key for key, value in state_dict.items() if isinstance(value, DTensor))

    # The gathers below are issued per DTensor entry: every rank must hold the same ones.
    every = comm.gather_agreed(model_group(model), check)
    for keys in every:
        if keys != every[0]:
            odd = sorted(set(keys) ^ set(every[0]))[0]
            forms = ", ".join(f"rank {r}: {'DTensor' if odd in k else 'no DTensor'}" for r, k in enumerate(every))
            raise ValueError(
                f"state dict entry {odd!r} is not a DTensor on every rank ({forms}): "
                "every rank must load the same sharded state dict"
            )
    full = {}
    for key in sorted(state_dict):  # one order on every rank: full_tensor() is a collective
        value = state_dict[key]
        full[key] = value.full_tensor() if isinstance(value, DTensor) else value
    load_full_state_dict(model, full, strict=strict)


def state_dict_layout(model: nn.Module) -> dict[str, tuple[torch.Size, torch.dtype] | None]:
    """Clean FQN -> (shape, dtype) of every entry of the full state dict, computed locally (no
    collective), so any rank can describe a sharded model without gathering it; None for an extra-state
    entry (opaque: any object, checked by its module's ``set_extra_state`` alone)."""
    shapes = {}
    resolver = FQNResolver(model)
    for base, unit in units(model):
        handle = _owned_handle(unit)
        for slot, names in zip(handle.slots, _slot_names(resolver, base, handle)):
            for name in names:
                shapes[name] = (slot.shape, handle.flat_param.dtype)
    out: dict[str, tuple[torch.Size, torch.dtype] | None] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        name = resolver.clean_key(key)
        # Flattened parameters show as 1-D shards (or not at all) here; their real shapes are above.
        if key.split(".")[-1] == FLAT_PARAM or name in shapes:
            continue
        out[name] = None if key.split(".")[-1] == EXTRA_STATE else (value.shape, value.dtype)
    out.update(shapes)
    return out


def _check_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool, expected: dict[str, tuple[torch.Size, torch.dtype] | None]
) -> None:
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"state dict does not match the model: missing keys {missing}, unexpected keys {unexpected} "
            f"(the model expects {len(expected)} clean FQNs)"
        )
    for key, value in state_dict.items():
        layout = expected.get(key)
        if layout is None:  # not the model's, or an extra state (opaque)
            continue
        shape, _ = layout
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state dict entry {key!r}: expected a tensor, got {type(value).__name__}")
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"state dict entry {key!r}: shape {tuple(value.shape)} in the state dict, {tuple(shape)} in the model")


def _checked_on_every_rank(
    model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool, expected: dict[str, tuple[torch.Size, torch.dtype] | None]
) -> None:
    """:func:`_check_state_dict` on every rank of the model's groups, agreed: if any rank's dict is bad,
    every rank raises that rank's error. Collective."""
    comm.agree(model_group(model), lambda: _check_state_dict(model, state_dict, strict=strict, expected=expected))


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load unsharded tensors under clean FQNs (what :func:`full_state_dict` returns, on every rank).

    Every entry is checked first (missing/unexpected keys under ``strict``, shapes), on every rank: if
    any rank's dict is bad, every rank raises that error naming the key, and no model changes.
    Collective (the check's outcome is agreed on); each rank then copies its own shard.
    A tied parameter is written from the first of its names present. An extra-state entry is handed to
    its module's ``set_extra_state`` (module docstring), after every tensor was written."""
    expected = state_dict_layout(model)
    _checked_on_every_rank(model, state_dict, strict=strict, expected=expected)
    reshard_all(model)
    with torch.no_grad():
        done: set[str] = set()
        resolver = FQNResolver(model)
        for base, unit in units(model):
            handle = _owned_handle(unit)
            for slot, slot_names in zip(handle.slots, _slot_names(resolver, base, handle)):
                done.update(slot_names)
                key = next((n for n in slot_names if n in state_dict), None)
                if key is None:
                    continue
                r = handle.slot_shard(slot)
                source = state_dict[key].detach().reshape(-1)[r.part.as_slice()]
                handle.local_shard[r.in_shard].copy_(source)
        # Everything else (buffers, parameters outside any unit) is plain: load it as torch would.
        rest = {k: v for k, v in state_dict.items() if k not in done}
        extra = _extra_state_modules(model, resolver)
        for key, tensor in _plain_entries(model).items():
            if key in rest and key not in extra:
                tensor.copy_(rest[key])
        # Extra state is the module's to take: writing into the object get_extra_state() returned (a
        # fresh tensor for most modules) would change nothing.
        for key, module in extra.items():
            if key in rest:
                module.set_extra_state(rest[key])


def _plain_entries(model: nn.Module) -> dict[str, torch.Tensor]:
    """Clean FQN -> the live tensor of every state-dict entry not flattened into a unit."""
    resolver = FQNResolver(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if value is None or key.split(".")[-1] in (FLAT_PARAM, EXTRA_STATE):
            continue
        out.setdefault(resolver.clean_key(key), value)
    owners = _param_owner_units(model)
    return {k: v for k, v in out.items() if k not in owners}
