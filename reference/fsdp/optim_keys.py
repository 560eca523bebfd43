"""FSDP optimizer-state keying: optimizer state dicts of a sharded model, keyed by clean FQNs.

A local ``torch.optim`` state dict is keyed by parameter *ids* (positions in the optimizer's param
groups) and holds *sharded* tensors: with ``use_orig_params=False`` one entry per flat parameter, its
tensors the size of the local shard; with ``use_orig_params=True`` one entry per original parameter,
its tensors the parameter's (possibly empty) part of the shard. This module turns that into what
``torch.optim`` returns for the unwrapped model, keyed by clean FQNs, and back:

* every optimizer parameter is described by an :class:`_OptimStateKey`: the clean FQNs of the original
  parameters it stands for (several for a flat parameter, one for an original parameter) and whether
  it is *FSDP-managed* (flattened into a unit) or a plain parameter outside every unit;
* an FSDP-managed key is resolved through one map from every clean FQN to its :class:`FSDPParamInfo`
  (the unit, its flat parameter and each FQN's index in it), built by walking the module tree from the
  module passed in, so the FQNs are global from there and free of wrapper segments;
* ranks agree on one order of keys (the coordinator's, then keys only other ranks have), because the
  all-gathers that unshard state must be issued in the same order everywhere.

State conventions (as torch's FSDP): a tensor state of positive dimension is *positional*: it has the
parameter's shape and is sharded, gathered and re-sharded like it; a 0-dim tensor (``step``) or a
non-tensor is carried as is (copied to every FQN of a flat parameter).

Which ranks call what: :func:`optim_state_dict` and :func:`optim_state_dict_to_load` are collective
over the model's groups (every rank, same order); :func:`get_fqn_to_fsdp_param_info` and
:func:`get_param_to_fqns` are local.
"""

from __future__ import annotations

import copy
import functools
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from reference import comm
from reference.fqn import FQNResolver
from reference.fsdp.model_state import to_dtensor
from reference.fsdp.sharding import FlatParamHandle, ParamSlot
from reference.fsdp.unit import FSDP_WRAPPED_MODULE, FullyShardedDataParallel, model_group, reshard_all
from reference.state_dict.optim_fqn import init_state

__all__ = [
    "_OptimStateKey",
    "FSDPParamInfo",
    "get_fqn_to_fsdp_param_info",
    "get_param_to_fqns",
    "optim_state_dict",
    "optim_state_dict_to_load",
]


class _OptimStateKey(NamedTuple):
    """Rank-independent identity of one optimizer parameter (the name mirrors torch's private one).

    ``unflat_param_names`` are the clean FQNs it stands for, in flat-parameter order (one for an
    original parameter; tied aliases are not repeated); ``is_fsdp_managed`` says whether it lives in a
    unit's flat parameter (its state must be gathered) or is a plain parameter (state as is)."""

    unflat_param_names: tuple[str, ...]
    is_fsdp_managed: bool


@dataclass
class FSDPParamInfo:
    """A unit, as seen from the FQNs of the parameters it flattens."""

    state: FullyShardedDataParallel  #: the unit
    flat_param: nn.Parameter  #: its flat parameter
    #: clean FQN -> index of its slot in the flat parameter; a tied alias maps to its slot's index
    param_indices: dict[str, int] = field(default_factory=dict)

    @property
    def handle(self) -> FlatParamHandle:
        handle = self.state.handle
        assert handle is not None, "FSDPParamInfo is built for units that own parameters only"
        return handle


def _unit_base(prefix: str) -> str:
    return (prefix + "." if prefix else "") + FSDP_WRAPPED_MODULE + "."


def get_fqn_to_fsdp_param_info(model: nn.Module) -> dict[str, FSDPParamInfo]:
    """Every clean FQN (aliases included) of a flattened parameter under ``model`` -> its unit's info.

    ``model`` may be any module of the tree (a submodule too): FQNs are relative to it. Local."""
    out: dict[str, FSDPParamInfo] = {}
    resolver = FQNResolver(model)
    for prefix, unit in model.named_modules():
        if not isinstance(unit, FullyShardedDataParallel) or unit.handle is None:
            continue
        handle = unit.handle
        info = FSDPParamInfo(unit, handle.flat_param)
        names = [(s.fqn, i) for i, s in enumerate(handle.slots)] + [(a.fqn, a.slot_index) for a in handle.aliases]
        for local_fqn, index in names:
            fqn = resolver.clean_key(_unit_base(prefix) + local_fqn)
            # Invariant: one parameter, one unit (enforced at construction).
            assert fqn not in out, f"{fqn} is flattened by two units"
            out[fqn] = info
            info.param_indices[fqn] = index
    return out


def get_param_to_fqns(model: nn.Module) -> dict[nn.Parameter, list[str]]:
    """Every parameter an optimizer of ``model`` can hold -> the clean FQNs it stands for.

    A flat parameter stands for the first FQN of each of its slots (in flat order); an original or
    plain parameter for all its names, the first being the one state is keyed by. Local."""
    out: dict[nn.Parameter, list[str]] = {}
    resolver = FQNResolver(model)
    units = {id(u): u for u in FullyShardedDataParallel.fsdp_modules(model)}
    for prefix, module in model.named_modules():
        if id(module) in units and module.handle is not None and not module.use_orig_params:
            base = _unit_base(prefix)
            out[module.handle.flat_param] = [resolver.clean_key(base + s.fqn) for s in module.handle.slots]
    for name, param in model.named_parameters(remove_duplicate=False):
        if param in out and name.rsplit(".", 1)[-1] == "_flat_param":
            continue
        out.setdefault(param, []).append(resolver.clean_key(name))
    return out


def _optimizer_params(optim: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The optimizer's parameters in state-dict id order (as ``Optimizer.state_dict`` numbers them)."""
    return [p for group in optim.param_groups for p in group["params"]]


_MISSING = object()  # placeholder for a scalar state whose value this rank has not seen yet


def _is_positional(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


# -- saving ---------------------------------------------------------------------------------------------


def _key_of(param: nn.Parameter, fqns: list[str], infos: Mapping[str, FSDPParamInfo]) -> _OptimStateKey:
    info = infos.get(fqns[0])
    if info is not None and info.flat_param is param:
        return _OptimStateKey(tuple(fqns), True)
    # An original parameter: one slot of a flat parameter, keyed by its first name only.
    return _OptimStateKey((fqns[0],), info is not None)


def _slot_of(info: FSDPParamInfo, fqn: str) -> ParamSlot:
    return info.handle.slots[info.param_indices[fqn]]


def _local_shape(info: FSDPParamInfo, key: _OptimStateKey) -> torch.Size:
    """The shape this rank's positional state of ``key`` has: the flat shard's, or its parameter's part."""
    if not info.state.use_orig_params:
        return info.handle.local_shard.shape
    return info.handle.local_view(_slot_of(info, key.unflat_param_names[0])).shape


def _local_optim_state(
    model: nn.Module, optim: torch.optim.Optimizer, infos: Mapping[str, FSDPParamInfo]
) -> tuple[list[_OptimStateKey], dict[_OptimStateKey, dict[str, Any]], list[tuple[dict[str, Any], list[_OptimStateKey]]]]:
    """``(keys, local state by key, param groups as (hyperparameters, keys))`` of ``optim`` on this rank,
    after checking, locally, that every parameter belongs to the model and every positional state of an
    FSDP-managed parameter has its local shape (ValueError / RuntimeError naming the FQN)."""
    param_to_fqns = get_param_to_fqns(model)
    local_osd = optim.state_dict()
    keys: list[_OptimStateKey] = []
    local_state: dict[_OptimStateKey, dict[str, Any]] = {}
    for param_id, param in enumerate(_optimizer_params(optim)):
        if param not in param_to_fqns:
            raise ValueError(f"optimizer parameter #{param_id} (shape {tuple(param.shape)}) is not a parameter of the model")
        key = _key_of(param, param_to_fqns[param], infos)
        keys.append(key)
        if param_id not in local_osd["state"]:
            continue
        local_state[key] = local_osd["state"][param_id]
        if not key.is_fsdp_managed:
            continue
        info = infos[key.unflat_param_names[0]]
        for name, value in local_state[key].items():
            if _is_positional(value) and value.shape != _local_shape(info, key):
                raise RuntimeError(
                    f"optimizer state {name!r} of {key.unflat_param_names[0]!r}: local tensor of shape "
                    f"{tuple(value.shape)}, expected the parameter's local shape {tuple(_local_shape(info, key))}"
                )
    groups = [
        ({k: v for k, v in g.items() if k != "params"}, [keys[i] for i in g["params"]]) for g in local_osd["param_groups"]
    ]
    return keys, local_state, groups


def _gather_positional(
    info: FSDPParamInfo, state_name: str, items: list[tuple[_OptimStateKey, torch.Tensor | None]]
) -> dict[_OptimStateKey, list[torch.Tensor]]:
    """The full values of one positional state of several keys of one unit, with ONE all-gather over
    its shard axis (collective: every rank passes the same keys, in the same order).

    Each ``items`` entry is a key and this rank's tensor of it: the flat shard's state
    (``use_orig_params=False``) or the original parameter's part (``True``); None if this rank holds no
    state for it (zeros stand in). Returns, per key, the full value for each of its FQNs."""
    handle = info.handle
    flat_mode = not info.state.use_orig_params
    present = [t for _, t in items if t is not None]
    dtype = present[0].dtype if present else handle.flat_param.dtype
    # The state laid out like the flat parameter: every key's part at its offset in this rank's shard.
    shard = torch.zeros(handle.shard_numel, dtype=dtype, device=handle.local_shard.device)
    slots_of = {key: [_slot_of(info, fqn) for fqn in key.unflat_param_names] for key, _ in items}
    for key, local in items:
        if local is None:
            continue
        # Invariant: the shapes were checked, and agreed on, by _local_optim_state.
        assert local.shape == _local_shape(info, key), (key, state_name)
        if flat_mode:
            shard.copy_(local.detach())
        else:
            shard[handle.slot_shard(slots_of[key][0]).in_shard].copy_(local.detach().reshape(-1))
    full = torch.empty(handle.padded_numel, dtype=dtype, device=shard.device)
    comm.all_gather_flat(full, shard, handle.shard_group)
    # Views, not copies (``full`` is this call's own buffer, and slots never overlap), all cut by one
    # split_with_sizes rather than a slice per slot: at 10,000 parameters the slices were the cost.
    ordered = sorted({id(s): s for slots in slots_of.values() for s in slots}.values(), key=lambda s: s.flat.start)
    sizes: list[int] = []
    owners: list[ParamSlot | None] = []
    at = 0
    for s in ordered:
        if s.flat.start > at:  # padding between slots
            sizes.append(s.flat.start - at)
            owners.append(None)
        sizes.append(s.flat.numel)
        owners.append(s)
        at = s.flat.end + 1
    sizes.append(full.numel() - at)
    owners.append(None)
    views = {
        id(owner): piece if len(owner.shape) == 1 else piece.view(owner.shape)
        for owner, piece in zip(owners, full.split_with_sizes(sizes))
        if owner is not None
    }
    return {key: [views[id(s)] for s in slots] for key, slots in slots_of.items()}


def _materialize_missing_state(model: nn.Module, optim: torch.optim.Optimizer, group: Any) -> None:
    """Create the state of every trainable parameter that no rank holds state for, as the optimizer
    would and without changing its future (SD-20, SD-21), so that a checkpoint holds what a resume loads
    into. A parameter some rank holds state for is left alone here: that rank's scalar state is what
    the others' part takes (a rank may hold none for an empty part, as torch's FSDP leaves it).
    Collective; agreed first, so a rank whose optimizer holds a foreign parameter fails every rank."""
    params = _optimizer_params(optim)

    def stateless_here() -> set[str]:
        param_to_fqns = get_param_to_fqns(model)
        for param_id, param in enumerate(params):
            if param not in param_to_fqns:
                raise ValueError(f"optimizer parameter #{param_id} (shape {tuple(param.shape)}) is not a parameter of the model")
        return {param_to_fqns[p][0] for p in params if p.requires_grad and not optim.state.get(p)}

    everywhere = set.intersection(*comm.gather_agreed(group, stateless_here))
    if everywhere:
        param_to_fqns = get_param_to_fqns(model)
        init_state(optim, only={p for p in params if param_to_fqns[p][0] in everywhere})


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    *,
    rank0_only: bool = False,
    cpu_offload: bool = False,
    sharded: bool = False,
) -> dict[str, Any]:
    """``optim``'s state as ``torch.optim`` would return it for the unwrapped model, keyed by clean FQNs.

    ``state`` maps each FQN that has state to its states (positional ones unsharded; ``step`` and other
    scalars as is); FQNs without state (frozen, never stepped) are absent. ``param_groups`` keep every
    hyperparameter and extra key, with ``params`` listing FQNs. With ``sharded``, positional states of
    FSDP-managed parameters are DTensors laid out like :func:`reference.fsdp.sharded_state_dict`'s
    parameters (their ``full_tensor()`` is the full value). With ``rank0_only`` every rank but the
    coordinator (the first rank of the model's group) gets ``{}``; with ``cpu_offload`` tensors are on
    the CPU.

    Collective over the model's groups: every rank calls it, with optimizers over the same parameters
    (their order within groups, and the order of states, may differ by rank)."""
    group = model_group(model)
    reshard_all(model)
    infos = get_fqn_to_fsdp_param_info(model)
    _materialize_missing_state(model, optim, group)
    local_state, order, groups = _agreed_state_layout(model, optim, infos, group)
    keep = not rank0_only or comm.is_coordinator(group)
    gathered_full = _gather_flat_states(infos, local_state, order)
    state = _assemble_state(infos, local_state, order, gathered_full, sharded=sharded)
    if not keep:
        return {}
    if cpu_offload:
        state = {fqn: {n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in entry.items()} for fqn, entry in state.items()}
    param_groups = []
    for hyper, group_keys in groups:  # the coordinator's groups
        param_group = copy.deepcopy(hyper)
        param_group["params"] = [fqn for key in group_keys for fqn in key.unflat_param_names]
        param_groups.append(param_group)
    return {"state": state, "param_groups": param_groups}


# -- loading ---------------------------------------------------------------------------------------------


def _check_osd_shape(osd: Mapping[str, Any]) -> None:
    if not isinstance(osd, Mapping) or "state" not in osd or "param_groups" not in osd:
        got = sorted(osd) if isinstance(osd, Mapping) else type(osd).__name__
        raise ValueError(f"an optimizer state dict needs the keys 'state' and 'param_groups', got {got}")


def _check_entries(osd: Mapping[str, Any]) -> None:
    for fqn, entry in osd["state"].items():
        if not isinstance(entry, Mapping):
            raise ValueError(f"optimizer state of {fqn!r}: expected a dict of states, got {type(entry).__name__}")


def _param_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Every clean FQN an optimizer state may be saved under (tied aliases included) -> its full shape."""
    shapes = {fqn: _slot_of(info, fqn).shape for fqn, info in get_fqn_to_fsdp_param_info(model).items()}
    for param, fqns in get_param_to_fqns(model).items():
        for fqn in fqns:
            shapes.setdefault(fqn, param.shape)
    return shapes


def _check_sharded_states(model: nn.Module, osd: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The (FQN, state name) of every DTensor state of ``osd``, sorted, after checking, locally, that
    each belongs to a parameter of the model and has its full shape (raises ValueError naming it)."""
    from torch.distributed.tensor import DTensor

    keys = sorted((fqn, name) for fqn, entry in osd["state"].items() for name, v in entry.items() if isinstance(v, DTensor))
    if not keys:
        return keys
    shapes = _param_shapes(model)
    unknown = sorted({fqn for fqn, _ in keys if fqn not in shapes})
    if unknown:
        raise ValueError(f"optimizer state dict has state for {unknown}, which are not parameters of the model")
    for fqn, name in keys:
        value = osd["state"][fqn][name]
        if value.dim() > 0 and tuple(value.shape) != tuple(shapes[fqn]):
            raise ValueError(
                f"optimizer state {name!r} of {fqn!r}: shape {tuple(value.shape)} in the state dict, {tuple(shapes[fqn])} in the model"
            )
    return keys


def _to_full(osd: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``osd['state']`` with every DTensor replaced by its full tensor (collective, sorted key order)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for fqn in sorted(osd["state"]):
        out[fqn] = {n: (v.full_tensor() if isinstance(v, DTensor) else v) for n, v in sorted(osd["state"][fqn].items())}
    return out


def _scalar_bits(value: Any) -> Any:
    """A key equal for equal bits (NaN payloads and -0.0 told apart, NaN equal to itself)."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        return (str(value.dtype), tuple(value.shape), bytes(flat.view(torch.uint8).tolist()) if flat.numel() else b"")
    if isinstance(value, float):
        return ("float", struct.pack("<d", value))
    return (type(value).__name__, repr(value))


class _NoState:
    """What a parameter saved without a scalar state holds in :func:`_check_one_scalar`'s comparison."""

    def __repr__(self) -> str:
        return "no state"


_NO_STATE = _NoState()


def _check_one_scalar(name: str, values: list[tuple[str, Any]]) -> None:
    """Invariant of a flat parameter: one optimizer state for all its parameters, so one value of each
    scalar state. Saved per parameter (``use_orig_params``), they may differ (an expert that got no
    gradient for some steps has a smaller ``step``); taking one would change the others' bias
    correction silently, so it is a ValueError naming the parameters and their values."""

    def plain(value: Any) -> Any:
        return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value

    groups: list[tuple[Any, Any, list[str]]] = []  # (bits, shown value, FQNs)
    for fqn, value in values:
        key = _scalar_bits(value)
        for seen, _, fqns in groups:
            if seen == key:
                fqns.append(fqn)
                break
        else:
            groups.append((key, plain(value), [fqn]))
    if len(groups) > 1:
        groups.sort(key=lambda group: len(group[2]))  # the odd ones out first
        shown = "; ".join(f"{value!r} for {fqns[:4]}" + (f" and {len(fqns) - 4} more" if len(fqns) > 4 else "") for _, value, fqns in groups)
        raise ValueError(
            f"optimizer state {name!r} differs among the parameters of one flat parameter: {shown}; a flat parameter holds "
            "one value for all of them: load with use_orig_params=True, or into units that keep these parameters apart"
        )


def _agreed_state_layout(
    model: nn.Module, optim: torch.optim.Optimizer, infos: dict[str, FSDPParamInfo], group: dist.ProcessGroup | None
) -> tuple[
    dict[_OptimStateKey, dict[str, Any]],
    dict[_OptimStateKey, dict[str, Any]],
    list[tuple[dict[str, Any], list[_OptimStateKey]]],
]:
    """``(local_state, order, groups)``: this rank's state per key; the agreed keys in one order for every
    rank (the coordinator's, then what only other ranks hold), each with its state names mapped to
    ``None`` (positional: gathered later) or the scalar value; and the coordinator's param groups.
    Collective; a rank whose optimizer does not fit the model fails every rank."""
    local_state: dict[_OptimStateKey, dict[str, Any]] = {}

    def describe() -> tuple[list[tuple[_OptimStateKey, dict[str, bool]]], list[tuple[dict[str, Any], list[_OptimStateKey]]]]:
        # One order for every rank: the coordinator's, then what only other ranks hold. Only structure travels
        # (which states each key has, and which are positional); values are exchanged below only for
        # keys some rank holds no state for.
        keys, state, groups = _local_optim_state(model, optim, infos)
        local_state.update(state)
        return [(key, {n: _is_positional(v) for n, v in state[key].items()}) for key in keys if key in state], groups

    # Agreed: a rank whose optimizer does not fit the model must not leave the others in the gathers.
    gathered = comm.gather_agreed(group, describe)
    order: dict[_OptimStateKey, dict[str, Any]] = {}
    holders: dict[_OptimStateKey, int] = {}
    for rank_summary, _ in gathered:
        for key, names in rank_summary:
            holders[key] = holders.get(key, 0) + 1
            merged = order.setdefault(key, {})
            for name, positional in names.items():
                merged.setdefault(name, None if positional else _MISSING)
    lacking = [key for key, count in holders.items() if count < len(gathered)]
    if lacking:
        # Scalar state of a key this rank may lack: every holder sends it, the first one counts.
        offers = {k: {n: v for n, v in local_state[k].items() if not _is_positional(v)} for k in lacking if k in local_state}
        for rank_offers in comm.all_gather_objects(offers, group):
            for key, values in rank_offers.items():
                for name, value in values.items():
                    if order[key].get(name) is _MISSING:
                        order[key][name] = value
    return local_state, order, gathered[0][1]


def _gather_flat_states(
    infos: dict[str, FSDPParamInfo], local_state: dict[_OptimStateKey, dict[str, Any]], order: dict[_OptimStateKey, dict[str, Any]]
) -> dict[tuple[_OptimStateKey, str], list[torch.Tensor]]:
    """The full values of every positional state of FSDP-managed keys, per (key, state name), one per
    unflattened parameter. Collective."""
    # Positional states of FSDP-managed keys travel one (unit, state name) at a time: one all-gather of
    # the unit's flat layout carries that state of all its parameters. Batches are formed in the agreed
    # key order, so every rank issues the same all-gathers in the same order.
    batches: dict[tuple[int, str], list[_OptimStateKey]] = {}
    for key, names in order.items():
        if key.is_fsdp_managed:
            flat_id = id(infos[key.unflat_param_names[0]].flat_param)
            for name, replicated in names.items():
                if replicated is None:
                    batches.setdefault((flat_id, name), []).append(key)
    gathered_full: dict[tuple[_OptimStateKey, str], list[torch.Tensor]] = {}
    for (_, name), batch in batches.items():
        info = infos[batch[0].unflat_param_names[0]]
        items = [(key, local_state.get(key, {}).get(name)) for key in batch]
        for key, fulls in _gather_positional(info, name, items).items():
            gathered_full[key, name] = fulls
    return gathered_full


def _assemble_state(
    infos: dict[str, FSDPParamInfo],
    local_state: dict[_OptimStateKey, dict[str, Any]],
    order: dict[_OptimStateKey, dict[str, Any]],
    gathered_full: dict[tuple[_OptimStateKey, str], list[torch.Tensor]],
    *,
    sharded: bool,
) -> dict[str, dict[str, Any]]:
    """FQN -> its states: gathered positional values (as DTensors with ``sharded``), scalars and the
    states of parameters outside every unit copied, one copy per FQN. Local."""
    state: dict[str, dict[str, Any]] = {}
    for key, names in order.items():
        local = local_state.get(key, {})
        info = infos.get(key.unflat_param_names[0]) if key.is_fsdp_managed else None
        per_fqn: list[dict[str, Any]] = [{} for _ in key.unflat_param_names]
        for name, replicated in names.items():
            if (key, name) in gathered_full:
                assert info is not None, "only the positional state of a unit's parameters is gathered"
                for entry, full in zip(per_fqn, gathered_full[key, name]):
                    entry[name] = to_dtensor(info.state, full) if sharded else full
                continue
            # Scalar state, or any state of a parameter outside every unit: as is, one copy per FQN.
            value = local.get(name, replicated)
            for entry in per_fqn:
                entry[name] = value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
        for fqn, entry in zip(key.unflat_param_names, per_fqn):
            state[fqn] = entry
    return state


def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, osd: Mapping[str, Any]) -> dict[str, Any]:
    """Turn an FQN-keyed optimizer state dict, full or sharded (from any strategy, world size or
    ``use_orig_params``; on every rank), into what ``optim.load_state_dict`` takes on this rank.

    A tied parameter's state is found under any of its names. Inside a flat parameter, a parameter
    without saved state gets zeros for the positional states of the others. Every FQN is checked
    before anything is returned: an FQN not in the model, a positional state whose shape is not the
    parameter's, a saved param group that a local group would straddle, or a different number of
    groups raises ``ValueError`` naming the FQN, on every rank alike when only some ranks' dicts are
    bad. Collective over the model's groups: every rank calls it."""
    group = model_group(model)

    def check() -> list[tuple[str, str]]:
        _check_osd_shape(osd)
        _check_entries(osd)
        return _check_sharded_states(model, osd)

    # Before _to_full, whose gathers (one per DTensor state) every rank must issue alike: agree that
    # every rank's dict is well formed and holds the same DTensor states, of the parameters' shapes.
    every = comm.gather_agreed(group, check)
    for rank, keys in enumerate(every):
        if keys != every[0]:
            odd = sorted(set(keys) ^ set(every[0]))[0]
            raise ValueError(
                f"optimizer state {odd[1]!r} of {odd[0]!r} is a DTensor on rank {rank if odd in keys else 0} only: "
                "every rank must load the same sharded optimizer state dict"
            )
    saved = _to_full(osd)
    return comm.agree(group, lambda: _optim_state_dict_to_load(model, optim, osd, saved))


def _optim_state_dict_to_load(
    model: nn.Module, optim: torch.optim.Optimizer, osd: Mapping[str, Any], saved: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The local part of :func:`optim_state_dict_to_load`, given the full values ``saved``."""
    infos = get_fqn_to_fsdp_param_info(model)
    param_to_fqns = get_param_to_fqns(model)
    known: dict[str, nn.Parameter] = {}
    for param, fqns in param_to_fqns.items():
        for fqn in fqns:
            known[fqn] = param
    for fqn in infos:  # tied aliases inside flat parameters are known too
        known.setdefault(fqn, infos[fqn].flat_param)
    unknown = [fqn for fqn in saved if fqn not in known]
    if unknown:
        raise ValueError(f"optimizer state dict has state for {unknown}, which are not parameters of the model")

    # Every name of each flattened parameter (tied aliases included), built once.
    names_by_slot: dict[tuple[int, int], list[str]] = {}
    for fqn, unit_info in infos.items():
        names_by_slot.setdefault((id(unit_info.flat_param), unit_info.param_indices[fqn]), []).append(fqn)

    def names_of(fqn: str) -> list[str]:
        """Every name of the parameter ``fqn``, ``fqn`` first."""
        info = infos.get(fqn)
        if info is None:
            return [fqn]
        return [fqn] + [f for f in names_by_slot[id(info.flat_param), info.param_indices[fqn]] if f != fqn]

    def saved_entry(fqn: str) -> Mapping[str, Any] | None:
        if fqn in saved:  # the usual case, without building the list of aliases
            return saved[fqn]
        return next((saved[n] for n in names_of(fqn) if n in saved), None)

    def full_shape(fqn: str) -> torch.Size:
        info = infos.get(fqn)
        return _slot_of(info, fqn).shape if info is not None else known[fqn].shape

    def checked(fqn: str, name: str, value: Any, *, copied: bool = True, shape: torch.Size | None = None) -> Any:
        """``value`` after checking its shape against the parameter's (``shape``, when the caller has it)."""
        if _is_positional(value) and tuple(value.shape) != tuple(shape if shape is not None else full_shape(fqn)):
            raise ValueError(
                f"optimizer state {name!r} of {fqn!r}: shape {tuple(value.shape)} in the state dict, "
                f"{tuple(full_shape(fqn))} in the model"
            )
        if not copied:  # the caller copies it into a buffer of its own
            return value.detach()
        # A copy: the optimizer steps scalar state in place, and must not step the caller's dict.
        return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)

    params = _optimizer_params(optim)
    state: dict[int, dict[str, Any]] = {}
    for param_id, param in enumerate(params):
        if param not in param_to_fqns:
            raise ValueError(f"optimizer parameter #{param_id} (shape {tuple(param.shape)}) is not a parameter of the model")
        key = _key_of(param, param_to_fqns[param], infos)
        entries = [(fqn, saved_entry(fqn)) for fqn in key.unflat_param_names]
        present = [(fqn, e) for fqn, e in entries if e is not None]
        if not present:
            continue
        local: dict[str, Any] = {}
        info = infos.get(key.unflat_param_names[0]) if key.is_fsdp_managed else None
        for name in dict.fromkeys(n for _, e in present for n in e):
            first = next(e[name] for _, e in present if name in e)
            if not _is_positional(first) or info is None:
                if len(entries) > 1:
                    # A parameter without this state (none at all: no gradient yet) would get the others'
                    # value in the flat parameter: that differs as much as another value does (SPEC OS-24).
                    _check_one_scalar(name, [(fqn, e.get(name, _NO_STATE) if e is not None else _NO_STATE) for fqn, e in entries])
                local[name] = checked(present[0][0], name, first)
                continue
            handle = info.handle
            if len(key.unflat_param_names) > 1 or not info.state.use_orig_params:
                local[name] = _flat_layout_shard(info, name, [(fqn, e[name]) for fqn, e in present if name in e], checked)
            else:
                fqn = key.unflat_param_names[0]
                slot = _slot_of(info, fqn)
                value = checked(fqn, name, first, copied=False).reshape(-1)[handle.slot_shard(slot).part.as_slice()]
                local[name] = value.clone().view(handle.local_view(slot).shape)
        state[param_id] = local

    param_groups = _load_param_groups(optim, osd["param_groups"], known, names_of, lambda p: _key_of(p, param_to_fqns[p], infos))
    return {"state": state, "param_groups": param_groups}


def _load_param_groups(
    optim: torch.optim.Optimizer,
    saved_groups: list[Mapping[str, Any]],
    known: Mapping[str, nn.Parameter],
    names_of: Callable[[str], list[str]],
    key_of: Callable[[nn.Parameter], _OptimStateKey],
) -> list[dict[str, Any]]:
    """``optim``'s param groups for ``load_state_dict``: each local group takes the hyperparameters of the
    saved group that lists its parameters (under any of their names, ``names_of``), with ``params`` as
    positional ids. Raises ``ValueError`` naming the FQNs when a local group holds parameters no saved
    group lists or that several saved groups list, when a saved group lists an FQN not in ``known``,
    or when the numbers of groups differ."""
    group_of: dict[str, int] = {}
    for index, group in enumerate(saved_groups):
        for fqn in group.get("params", []):
            if fqn not in known:
                raise ValueError(f"param group {index} of the optimizer state dict lists {fqn!r}, which is not a parameter of the model")
            for name in names_of(fqn):
                group_of.setdefault(name, index)
    param_groups = []
    param_id = 0
    # A group without parameters cannot be matched by them: the k-th such local group takes the k-th
    # saved one, so its hyperparameters survive the load (pytorch/pytorch#143828).
    # A local one left without a saved match keeps its own (SD-25 without strict; a strict load was
    # refused before, by the key checks).
    empty_saved = iter([index for index, g in enumerate(saved_groups) if not g.get("params")])
    taken: set[int] = set()  # the saved groups some local group took
    for local_index, group in enumerate(optim.param_groups):
        ids = list(range(param_id, param_id + len(group["params"])))
        param_id += len(group["params"])
        if not group["params"]:
            match = next(empty_saved, None)
            hyper: Mapping[str, Any] = group
            if match is not None:
                hyper = saved_groups[match]
                taken.add(match)
            param_groups.append({**copy.deepcopy({k: v for k, v in hyper.items() if k != "params"}), "params": []})
            continue
        fqns = [f for p in group["params"] for f in key_of(p).unflat_param_names]
        homes = {fqn: group_of.get(fqn) for fqn in fqns}
        missing = [fqn for fqn, home in homes.items() if home is None]
        if missing:
            raise ValueError(f"param group {local_index} of the optimizer holds {missing}, which no saved param group lists")
        if len(set(homes.values())) > 1:
            raise ValueError(
                f"param group {local_index} of the optimizer holds parameters of several saved param groups: "
                + ", ".join(f"{fqn!r} in saved group {home}" for fqn, home in homes.items())
            )
        home = next(index for index in homes.values() if index is not None)
        taken.add(home)
        loaded = copy.deepcopy({k: v for k, v in saved_groups[home].items() if k != "params"})
        loaded["params"] = ids
        param_groups.append(loaded)
    # Checked after the per-group check above, whose message names the FQNs that moved: a saved group
    # that no local group took (a second listing of taken parameters, a group without parameters more
    # than the optimizer has) would be dropped silently.
    left = [index for index in range(len(saved_groups)) if index not in taken]
    if left:
        raise ValueError(
            f"optimizer state dict has {len(saved_groups)} param groups "
            f"({[list(g.get('params', [])) for g in saved_groups]}), and no param group of the optimizer (it has "
            f"{len(optim.param_groups)}) takes group(s) {left}"
        )
    return param_groups


def _flat_layout_shard(
    info: FSDPParamInfo, name: str, values: list[tuple[str, Any]], checked: Callable[..., Any]
) -> torch.Tensor:
    """This rank's shard of positional state ``name`` laid out like ``info``'s flat parameter: the saved
    ``(fqn, value)`` pairs at their slots, zeros in the gaps (padding, parameters without saved state).
    ``checked(fqn, name, value, copied=False, shape=...)`` raises on a value of the wrong shape."""
    handle = info.handle
    # One torch.cat of the saved values and zeros for the gaps, not a slice and a copy per parameter
    # (at 10,000 parameters those were the cost).
    # torch.optim casts a loaded state to its parameter's dtype: casting each value to it here rounds
    # each value once, as loading the unwrapped model does. The first value's dtype would round the
    # others through it first (a bf16 value before float64 ones: SPEC OS-6).
    device, dtype = handle.local_shard.device, handle.local_shard.dtype
    if not dtype.is_floating_point:
        dtype = functools.reduce(torch.promote_types, (value.dtype for _, value in values))
    placed = sorted(((_slot_of(info, fqn), fqn, value) for fqn, value in values), key=lambda placed_value: placed_value[0].flat.start)
    pieces: list[torch.Tensor] = []
    at = 0
    # No autograd history from the saved values (in place of a detach per value).
    with torch.no_grad():
        for slot, fqn, value in placed:
            # The common case (a tensor of the slot's shape) is checked inline: checked() per value was
            # most of the time of this loop; it raises on a wrong shape.
            if not (isinstance(value, torch.Tensor) and value.shape == slot.shape):
                value = checked(fqn, name, value, copied=False, shape=slot.shape)
            if slot.flat.start > at:
                pieces.append(torch.zeros(slot.flat.start - at, dtype=dtype, device=device))
            if value.dtype != dtype or value.device != device:
                value = value.to(device=device, dtype=dtype)
            pieces.append(value if value.dim() == 1 else value.reshape(-1))
            at = slot.flat.end + 1
        if handle.padded_numel > at:
            pieces.append(torch.zeros(handle.padded_numel - at, dtype=dtype, device=device))
        flat = torch.cat(pieces)
    start = handle.shard_rank * handle.shard_numel
    return flat[start : start + handle.shard_numel].clone()
