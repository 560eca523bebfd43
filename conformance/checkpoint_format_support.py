"""ML-25, the on-disk format: a nested state dict of every kind of value and an optimizer's state, saved
by the implementation and loaded by upstream ``torch.distributed.checkpoint`` (and the other way round),
whatever ``--impl`` selects; the metadata compared with upstream's save of the same state dict, and
upstream's ``dcp_to_torch_save`` of the checkpoint (:func:`format_save`, :func:`format_load`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from conformance.adapters.base import Adapter
from conformance.asserts import check_each
from conformance.checkpoint_support import assert_local_shards, assert_same_bits, call_or_skip, checkpoint_ops, dtensor_of, group_of
from conformance.checkpoint_values_support import State, mixed_state
from conformance.dcp_files import dcp_directory
from conformance.harness.context import RankContext
from conformance.values import different_like

__all__ = [
    "format_save",
    "format_load",
]


def _upstream_save(dist: RankContext, state: dict[str, Any], path: str) -> None:
    """Upstream ``torch.distributed.checkpoint.save`` (default planner, ``FileSystemWriter``), called
    directly: the counterpart of every implementation, whatever ``--impl`` selects."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns on overwrite
        dcp.save(state, checkpoint_id=path, process_group=group_of(dist))


def _upstream_load(dist: RankContext, state: dict[str, Any], path: str) -> None:
    """Upstream ``torch.distributed.checkpoint.load`` with its ``FileSystemReader``, called directly."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=dcp.FileSystemReader(dcp_directory(path)), process_group=group_of(dist))


def _optimizer_state(dist: RankContext, role: str, seed: int) -> State:
    """AdamW's state after two steps of a small model, in one process, keyed as a sharded optimizer's
    state dict is (``torch.distributed.checkpoint.state_dict``'s layout): ``state`` by parameter FQN with
    ``step`` a 0-d tensor and the moments as DTensors sharded by rows over the 1-D mesh (uneven at 2
    ranks), ``param_groups`` a list of dicts of hyperparameters naming their parameters by FQN.
    ``"target"``: the same layout with every value different."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    names = {id(p): n for n, p in model.named_parameters()}
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.AdamW([{"params": weights, "weight_decay": 0.1}, {"params": biases, "lr": 0.02, "betas": (0.8, 0.95)}], lr=0.01)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 6, generator=gen)).square().sum().backward()
        optimizer.step()
    state: dict[str, Any] = {}
    fulls: dict[tuple[Any, ...], torch.Tensor] = {}
    for param, s in optimizer.state.items():
        name = names[id(param)]
        entry: dict[str, Any] = {"step": s["step"].clone() if role == "saved" else different_like(s["step"])}
        for moment in ("exp_avg", "exp_avg_sq"):
            full = s[moment].detach().clone()
            fulls[("state", name, moment)] = full
            entry[moment] = dtensor_of(full if role == "saved" else different_like(full), dist.mesh(), [Shard(0)])
        state[name] = entry
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        params = [names[id(p)] for p in group["params"]]
        if role != "saved":  # every value other: floats and ints moved, flags flipped, tuples and names changed
            hyper = {k: (not v if isinstance(v, bool) else v * 2 + 1 if isinstance(v, (int, float)) else
                         tuple(x * 2 + 1 for x in v) if isinstance(v, tuple) else v) for k, v in hyper.items()}
            params = [*params, "other"]
        groups.append({**hyper, "params": params})
    return State({"state": state, "param_groups": groups}, fulls)


def _format_state(dist: RankContext, role: str, seed: int) -> State:
    """Every kind of value in one nested state dict (edge tensors of every dtype, edge DTensors on 1-D and
    2-D meshes, non-tensor values of every kind) and an optimizer's state under ``optim``."""
    mixed, optim = mixed_state(dist, role, seed), _optimizer_state(dist, role, seed)
    return State({**mixed.values, "optim": optim.values},
                  {**mixed.fulls, **{("optim", *path): full for path, full in optim.fulls.items()}})


def _full_values(value: Any, fulls: dict[tuple[Any, ...], torch.Tensor], path: tuple[Any, ...] = ()) -> Any:
    """``value`` with every DTensor replaced by its full value (``fulls`` by path)."""
    if isinstance(value, Mapping):
        return {k: _full_values(v, fulls, (*path, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_full_values(v, fulls, (*path, i)) for i, v in enumerate(value)]
    if isinstance(value, DTensor):
        return fulls[path]
    return value


def _metadata_layout(path: str) -> dict[str, Any]:
    """What a checkpoint's metadata says, read with upstream's public reader, that does not depend on
    who wrote it: each key's kind, tensor properties, global shape and chunks, the stored chunks, the
    flattening paths (``planner_data``) and the format version."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(dcp_directory(path)).read_metadata()
    keys: dict[str, tuple[Any, ...]] = {}
    for key, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
            keys[key] = ("tensor", entry.properties, tuple(entry.size), chunks)
        else:
            keys[key] = (type(entry).__name__,)
    stored = sorted((index.fqn, tuple(index.offset or ())) for index in md.storage_data)
    planner_data = {k: tuple(v) for k, v in (md.planner_data or {}).items()}
    return {"keys": keys, "stored chunks": stored, "planner_data": planner_data, "version": md.version}


def format_save(dist: RankContext, impl: Adapter, route: str, path: str, seed: int) -> None:
    saved = _format_state(dist, "saved", seed).values
    if route == "upstream-saves":
        _upstream_save(dist, saved, path)
        return
    call_or_skip(lambda: checkpoint_ops(impl).save(saved, path, process_group=group_of(dist)))
    _upstream_save(dist, _format_state(dist, "saved", seed).values, path + "-by-upstream")  # the same state dict


def format_load(dist: RankContext, impl: Adapter, route: str, path: str, seed: int, out: str) -> None:
    """Load what :func:`format_save` saved (the other side loads) and check it; with ``impl-saves``,
    also the metadata against upstream's save of the same state dict and, on rank 0, upstream's
    ``dcp_to_torch_save`` of the checkpoint. Each property is reported even when another failed."""
    saved = _format_state(dist, "saved", seed)  # the saved values, laid out at this world size
    target = _format_state(dist, "target", seed)

    def metadata() -> None:
        if route == "impl-saves" and dist.rank == 0:
            assert_same_bits(_metadata_layout(path), _metadata_layout(path + "-by-upstream"), check_order=False,
                              what=f"{impl.name}'s checkpoint metadata vs upstream's of the same state dict")

    def loaded() -> None:  # collective: every rank loads, whatever the other checks found
        if route == "upstream-saves":
            call_or_skip(lambda: checkpoint_ops(impl).load(target.values, path, process_group=group_of(dist)))
        else:
            _upstream_load(dist, target.values, path)
        assert_local_shards(dist, target.values, saved.fulls, what="loaded")
        assert_same_bits(target.values, saved.values, what=f"loaded by {'upstream' if route == 'impl-saves' else impl.name}")

    def converted() -> None:
        if route == "impl-saves" and dist.rank == 0:
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            dcp_to_torch_save(dcp_directory(path), out)  # upstream rebuilds the nested state dict from the metadata alone
            assert_same_bits(torch.load(out, weights_only=False), _full_values(saved.values, saved.fulls), check_order=False,
                              what="upstream's dcp_to_torch_save of the checkpoint (nesting from planner_data)")

    check_each({"ML-25.d": metadata, "ML-25.a" if route == "impl-saves" else "ML-25.c": loaded, "ML-25.b": converted})
