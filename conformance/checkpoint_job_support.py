"""ML-26 and ML-30, successive saves of a training job into one directory: the job's model and optimizer
checkpoints at each step in each layout (:func:`job_model`, :func:`job_optim`, :func:`job_paths`), the
layouts that differ from the first in one property alone (:func:`one_property_state`), and what the
ranks' state dicts say the metadata must list against what it does list (:func:`described_by_states`,
:func:`listed_in_metadata`)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, Shard

from conformance.asserts import expected_local_chunk
from conformance.checkpoint_support import dtensor_of
from conformance.dcp_files import read_metadata
from conformance.harness.context import RankContext

__all__ = [
    "job_model",
    "job_optim",
    "job_paths",
    "one_property_state",
    "described_by_states",
    "listed_in_metadata",
]


def job_model(dist: RankContext, step: float, *, last_rank_key: bool = False, changed: bool = False,
               moved: bool = False) -> dict[str, Any]:
    """A training job's model checkpoint at ``step`` (every value depends on it): a weight sharded over
    the pool's mesh, a replicated bias and scale, a note. The layouts of ML-26: ``last_rank_key``, the
    last rank also holds a counter (one rank's layout changes); ``changed``, every rank's layout
    changes (the bias's shape and dtype, a note that grew); ``moved``, only the nesting changes (the
    scale moves out of ``layers`` to a top-level key of the same flat name)."""
    rows = 4 * dist.world_size
    weight = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) * 0.5 + step
    layer: dict[str, Any] = {"weight": dtensor_of(weight, dist.mesh(), [Shard(0)]), "bias": torch.full((3,), step)}
    sd: dict[str, Any] = {"layers": {"0": layer}, "note": f"step {step}"}
    if changed:
        layer["bias"] = torch.full((5,), step, dtype=torch.float64)
        sd["note"] = f"step {step}: " + "grown " * 40
    scale = torch.tensor([step, -step])
    if moved:
        sd["layers.0.scale"] = scale
    else:
        layer["scale"] = scale
    if last_rank_key and dist.rank == dist.world_size - 1:
        sd["last_rank_counter"] = torch.tensor([int(step) * 7])
    return sd


def job_optim(dist: RankContext, step: float) -> dict[str, Any]:
    """The same job's optimizer checkpoint at ``step``: sharded Adam state keyed by FQN and its param group."""
    rows = 4 * dist.world_size
    exp_avg = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) * -0.25 + step
    return {
        "state": {"layers.0.weight": {"exp_avg": dtensor_of(exp_avg, dist.mesh(), [Shard(0)]), "step": torch.tensor(step)}},
        "param_groups": [{"lr": 1e-3 / (1 + step), "betas": (0.9, 0.999), "params": ["layers.0.weight"]}],
    }


def job_paths(kind: str, *, last_rank_key: bool = False, changed: bool = False, moved: bool = False) -> dict[str, tuple[Any, ...]]:
    """What the checkpoint's metadata lists for a save of :func:`job_model` or :func:`job_optim`:
    each flat key with its path in the nested state dict (DCP's ``planner_data``)."""
    if kind == "optim":
        state = {f"state.layers.0.weight.{k}": ("state", "layers.0.weight", k) for k in ("exp_avg", "step")}
        return {**state, **{f"param_groups.0.{k}": ("param_groups", 0, k) for k in ("lr", "betas", "params")}}
    paths: dict[str, tuple[Any, ...]] = {f"layers.0.{k}": ("layers", "0", k) for k in ("weight", "bias", "scale")}
    paths["note"] = ("note",)
    if moved:
        paths["layers.0.scale"] = ("layers.0.scale",)
    if last_rank_key:
        paths["last_rank_counter"] = ("last_rank_counter",)
    return paths


def one_property_state(dist: RankContext, prop: str, second: bool, step: float) -> dict[str, Any]:
    """A job's state at ``step`` in the first layout, or (``second``) in the layout that differs from
    it in ``prop`` alone: ``dtype``, the bias float64 instead of float32 (same shape); ``shape``, the
    bias of 5 elements instead of 3 (same dtype); ``nesting``, the scale out of ``layers`` under a
    top-level key of the same flat name (same tensors); ``rank``, a counter held by the last rank
    instead of rank 0 (same key, shape and dtype); ``chunking``, the weight sharded along columns
    instead of rows (same global shape and dtype); ``every-dtype``, every tensor cast alike to bfloat16
    (``model.to(torch.bfloat16)`` between two saves: a key of dtype *changes* sees none if it compares
    the tensors with each other); ``every-shape``, every tensor grown alike along its last dimension;
    ``renamed``, the bias under another name in the same place (same shapes, dtypes and order)."""
    changed = second
    rows, cols = 4 * dist.world_size, 2 * dist.world_size + (2 if prop == "every-shape" and changed else 0)
    every = torch.bfloat16 if prop == "every-dtype" and changed else torch.float32
    weight = (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * 0.5 + step).to(every)
    placements = [Shard(1)] if prop == "chunking" and changed else [Shard(0)]
    bias_size = 5 if prop in ("shape", "every-shape") and changed else 3
    bias = (torch.arange(bias_size, dtype=torch.float64 if prop == "dtype" and changed else torch.float32) + step).to(
        torch.float64 if prop == "dtype" and changed else every)
    bias_key = "shift" if prop == "renamed" and changed else "bias"
    layer: dict[str, Any] = {"weight": dtensor_of(weight, dist.mesh(), placements), bias_key: bias}
    sd: dict[str, Any] = {"layers": {"0": layer}, "note": f"step {step}"}
    scale = torch.tensor([step, -step, step, -step] if prop == "every-shape" and changed else [step, -step]).to(every)
    if prop == "nesting" and changed:
        sd["layers.0.scale"] = scale
    else:
        layer["scale"] = scale
    holder = dist.world_size - 1 if prop == "rank" and changed else 0
    if prop == "rank" and dist.rank == holder:
        sd["counter"] = torch.tensor([int(step) * 7])
    return sd


def described_by_states(dist: RankContext, sd: dict[str, Any]) -> dict[str, Any]:
    """What every rank's state dicts together say the metadata must list: flat key -> (its path in
    the nesting, and for a tensor its dtype, global shape and the set of (offsets, sizes) chunks the
    ranks hold; ``bytes`` for a non-tensor value)."""
    mine: dict[str, Any] = {}

    def walk(value: Any, path: tuple[Any, ...]) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, path + (key,))
            return
        flat = ".".join(map(str, path))
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            coordinate = mesh.get_coordinate()
            assert coordinate is not None  # every rank of the pool is in the mesh
            piece, offsets = expected_local_chunk(torch.empty(value.shape, device="meta"), value.placements, tuple(mesh.shape),
                                                  tuple(coordinate))
            mine[flat] = (path, str(value.dtype), tuple(value.shape), ((tuple(offsets), tuple(piece.shape)),))
        elif isinstance(value, torch.Tensor):
            mine[flat] = (path, str(value.dtype), tuple(value.shape), (((0,) * value.dim(), tuple(value.shape)),))
        else:
            mine[flat] = (path, "bytes")

    walk(sd, ())
    described: dict[str, Any] = {}
    for rank_items in dist.all_gather_object(mine):
        for flat, entry in rank_items.items():
            if flat in described and entry[1] != "bytes":
                entry = entry[:3] + (tuple(sorted(set(described[flat][3]) | set(entry[3]))),)
            described[flat] = entry
    return described


def listed_in_metadata(path: Path, keys: Iterable[str] | None = None) -> dict[str, Any]:
    """What the checkpoint's metadata lists, in the shape of :func:`described_by_states`. With ``keys``
    (every flat key any state dict of the test holds), only those: a record no state dict of the test
    holds is the stack's own bookkeeping (megatron-core's common state), not a layout's key, while a
    key of another save of the test (a stale plan) is still seen."""
    metadata = read_metadata(path)
    wanted = None if keys is None else set(keys)
    listed: dict[str, Any] = {}
    for flat, entry in metadata.state_dict_metadata.items():
        if wanted is not None and flat not in wanted:
            continue
        nesting = tuple((metadata.planner_data or {}).get(flat, ()))
        if isinstance(entry, TensorStorageMetadata):
            chunks = tuple(sorted({(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks}))
            listed[flat] = (nesting, str(entry.properties.dtype), tuple(entry.size), chunks)
        else:
            listed[flat] = (nesting, "bytes")
    return listed
