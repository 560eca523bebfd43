"""ML: distributed checkpoints, meta-tensor loading and resharding (SPEC.md, section ML).

Oracles: the values that were saved (round trips, compared bit for bit and, for DTensors, on every
rank against the documented layout of the full saved value), the other implementation
(cross-implementation), and the unsharded zoo model trained identically in one process (resharding
of training state). Every load goes into a state dict that differs from the saved one in every value
it must change: tensors with other bits (:func:`conformance.values.different_like`), non-tensor values
of another value, optimizer param groups with every hyperparameter perturbed, or meta tensors.

Every error requirement is checked twice where ranks can disagree: when every rank sees the bad input
and when only one rank does ("one-rank": the last rank, or for a damaged data file the rank that alone
reads it); then every rank must raise the same error,
promptly (``rank_timeout``), and leave its state dict as it was. At world size 1 the one-rank case is
the every-rank case and is skipped as such.

The inspector's requirements (ML-16, ML-17) are tested in ``tests/test_ckpt_inspect.py``.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, Replicate, Shard

from conformance import models
from conformance.adapters.base import Adapter
from conformance.adapters.sharding import ShardingPlan, hybrid_mesh_shape
from conformance.asserts import (
    assert_bitwise_equal,
    assert_local_shard,
    assert_names_key,
    assert_same_error_on_every_rank,
    assert_same_state,
    assert_unchanged,
    check_each,
    expect_error,
    expected_local_chunk,
    fail,
    raised,
    reraise,
    snapshot,
)
from conformance.checkpoint_support import (
    CODE_ROUTES,
    NAME_LIES,
    SAVE_FAULTS,
    assert_same_bits,
    call_or_skip,
    check_after_kill,
    checkpoint_ops,
    child_save,
    crafted_pickle,
    crafted_record,
    damage,
    dtensor_of,
    exact,
    extension_for_exec,
    group_of,
    injected_fault,
    is_same_bits,
    peak_bytes_during,
    record_location,
    replace_record,
    sharded_values,
    zoo_model,
)
from conformance.compare import fqn_keyed_optim, full_on_cpu
from conformance.dcp_files import read_metadata, storage_bytes_range
from conformance.error_cases import WHERE, bad_input_here
from conformance.faults import failing_reads, failing_writes, unreadable_bytes
from conformance.harness.context import RankContext, per_group_cache
from conformance.values import EDGE_DTYPES, different_like, edge_tensors, perturb_hyperparameters

# -- helpers ----------------------------------------------------------------------------------


def _shard(impl: Adapter, model: nn.Module, dist: RankContext) -> nn.Module:
    """``model`` sharded by ``impl`` over the pool's 1-D mesh (FULL_SHARD, original parameters, one unit)."""
    return impl.require("sharding").shard(model, ShardingPlan(use_orig_params=True, device=dist.device, mesh=dist.mesh()))


#: 2-D meshes by world size: building one creates process groups (collectively), so each rank builds
#: it once per default group and its tests reuse it.
_MESHES_2D: dict[int, Any] = per_group_cache()


def _mesh_2d(dist: RankContext) -> Any:
    """The 2-D mesh of HYBRID_SHARD's shape: (2, world_size / 2), (1, world_size) at odd world sizes,
    and under torchrun (nodes, ranks per node) when the world fills whole nodes."""
    if dist.world_size not in _MESHES_2D:
        _MESHES_2D[dist.world_size] = dist.mesh(*hybrid_mesh_shape(dist.world_size))
    return _MESHES_2D[dist.world_size]


def _fails_alike(dist: RankContext, fn: Callable[[], Any], *, keys: tuple[str, ...] = (), needles: tuple[str, ...] = (),
                 what: str) -> BaseException:
    """``fn()`` raises on this rank (any type: ML-15 checks the type), naming every key of ``keys``
    whole and containing every string of ``needles``; then every rank compares what it raised: the
    same type and message everywhere (a rank that returned fails the test on every rank)."""
    exc = raised(lambda: call_or_skip(fn))
    assert_same_error_on_every_rank(dist, exc, what=what)
    assert exc is not None  # assert_same_error_on_every_rank fails when any rank returned
    return expect_error(lambda: reraise(exc), BaseException, keys=keys, needles=needles, what=what,
                        where=f"rank {dist.rank} of {dist.world_size}")


def _at(state: Any, path: tuple[Any, ...]) -> Any:
    for item in path:
        state = state[item]
    return state


def _assert_local_shards(dist: RankContext, got: Any, fulls: dict[tuple[Any, ...], torch.Tensor], *, what: str) -> None:
    """Per-rank truth: every DTensor of ``got`` at a path of ``fulls`` holds, on this rank, exactly the
    piece of that full value that the documented layout (``torch.chunk`` per sharded mesh dim) gives
    this rank, empty shards included; no rank gathers anything."""
    __tracebackhide__ = True
    for path, full in fulls.items():
        assert_local_shard(_at(got, path), full, what=f"{what} {'.'.join(map(str, path))}",
                           where=f"rank {dist.rank} of {dist.world_size}")


# -- the values a checkpoint holds ---------------------------------------------------------------


#: Sharded layouts over a 1-D mesh: uneven at every world size > 1; "one" leaves every rank but 0
#: an empty shard, "rows" leaves rank 3 empty at world size 4.
_SPECS_1D: dict[str, tuple[tuple[int, ...], list[Any]]] = {
    "rows": ((5, 3), [Shard(0)]),
    "cols": ((2, 7), [Shard(1)]),
    "replicated": ((13,), [Replicate()]),
    "one": ((1,), [Shard(0)]),
    "scalar": ((), [Replicate()]),
}
#: Over a 2-D mesh (2, world_size / 2), or (1, world_size) at odd world sizes.
_SPECS_2D: dict[str, tuple[tuple[int, ...], list[Any]]] = {
    "replicate_shard": ((7, 2), [Replicate(), Shard(0)]),
    "shard_shard": ((3, 5), [Shard(0), Shard(1)]),
    "nested_dim0": ((5, 2), [Shard(0), Shard(0)]),
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _edge_full(pool: torch.Tensor, shape: tuple[int, ...], shift: int) -> torch.Tensor:
    """A tensor of ``shape`` filled from ``pool`` (edge values and noise of one dtype), rotated by
    ``shift`` so that small tensors get different edge values."""
    numel = math.prod(shape)
    reps = max(1, -(-numel // pool.numel()))
    return torch.roll(pool, shift).repeat(reps)[:numel].reshape(shape).clone()


def _edge_sharded_fulls(specs: dict[str, tuple[tuple[int, ...], list[Any]]], seed: int) -> dict[str, tuple[torch.Tensor, list[Any]]]:
    """Key ``<dtype>.<layout>`` -> (full value of edge values, placements), for every dtype of
    :data:`~conformance.values.EDGE_DTYPES` and every layout of ``specs``."""
    pools = edge_tensors(seed)
    out = {}
    for dtype in EDGE_DTYPES:
        name = _dtype_name(dtype)
        for shift, (layout, (shape, placements)) in enumerate(specs.items()):
            out[f"{name}.{layout}"] = (_edge_full(pools[name], shape, 3 * shift), placements)
    return out


def _target_like(value: torch.Tensor) -> torch.Tensor:
    """A tensor laid out exactly as ``value`` (shape, strides, storage offset, storage size) whose
    elements all differ from ``value``'s bitwise, and whose storage bytes outside its elements hold a
    pattern (a load that writes outside a view changes them)."""
    value = value.detach()
    nbytes = value.untyped_storage().nbytes()
    pattern = torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    target = torch.empty(0, dtype=value.dtype).set_(
        pattern.untyped_storage(), value.storage_offset(), value.shape, value.stride()
    )
    target.copy_(different_like(value))
    return target


def _meta_like(value: torch.Tensor) -> torch.Tensor:
    """A meta tensor laid out as ``value`` (shape, strides, storage offset)."""
    storage_numel = value.untyped_storage().nbytes() // value.element_size()
    return torch.empty(storage_numel, dtype=value.dtype, device="meta").as_strided(
        value.shape, value.stride(), value.storage_offset()
    )


def _outside_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of the bytes of ``tensor``'s storage that belong to none of its elements."""
    storage = tensor.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    itemsize = tensor.element_size()
    elements = torch.arange(storage.nbytes() // itemsize).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
    mine = torch.zeros(storage.nbytes(), dtype=torch.bool)
    for byte in range(itemsize):
        mine[elements.reshape(-1) * itemsize + byte] = True
    return raw[~mine].clone()


_NAN_PAYLOAD = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_0123))[0]


def _objects(role: str) -> dict[str, Any]:
    """Non-tensor values of every kind a checkpoint holds. ``"saved"`` is what is saved; ``"target"``
    is the state dict a load fills: the same structure with every leaf different (in value, sign,
    NaN payload, length or type)."""
    if role == "saved":
        return {
            "step": 7,
            "big": 2**70 + 1,  # beyond int64
            "flag": True,
            "neg_zero": -0.0,
            "nan": _NAN_PAYLOAD,
            "inf": -math.inf,
            "subnormal": 5e-324,
            "name": "adam-ß-🙂",
            "raw": b"\x00\xff\x10",
            "nothing": None,
            "pair": (3, (4.5, "x")),
            "ids": [1, 2, "three"],  # a list without tensors or dicts: one value
            "records": [{"epoch": 3, "loss": 0.5}, {"epoch": 4}],  # a list of dicts: descended into
            "size": torch.Size([2, 3]),
            "dtype": torch.bfloat16,
            "nested": {"a": {"b": {"c": [1.5, None]}}},
        }
    return {
        "step": 0,
        "big": 2**70,
        "flag": False,
        "neg_zero": 0.0,
        "nan": math.nan,
        "inf": math.inf,
        "subnormal": 0.0,
        "name": "",
        "raw": b"",
        "nothing": "None",
        "pair": (0, (0.0, "")),
        "ids": [0],
        "records": [{"epoch": 0, "loss": 0.0}, {"epoch": 0}],
        "size": torch.Size([0]),
        "dtype": torch.float32,
        "nested": {"a": {"b": {"c": [0.0]}}},
    }


def _int_keyed(role: str) -> dict[str, Any]:
    """Non-tensor values under non-string keys, as ``torch.optim`` state dicts key them by parameter
    index; ``"target"`` holds other values under the same keys."""
    if role == "saved":
        return {"by_index": {0: "first", 1: {"lr": 0.1, "betas": (0.9, 0.999)}, 2: [1, 2]}}
    return {"by_index": {0: "", 1: {"lr": 0.0, "betas": (0.0, 0.0)}, 2: [0]}}


@dataclass
class _State:
    """A state dict to save or load into, and the full value of each of its DTensors by path."""

    values: dict[str, Any]
    fulls: dict[tuple[Any, ...], torch.Tensor]


def _state(dist: RankContext, kind: str, role: str, seed: int = 1) -> _State:
    """The ``kind`` of state (``plain``, ``objects``, ``dtensor-1d``, ``dtensor-2d``) as saved
    (``role="saved"``), as a load target whose every value differs (``"target"``), or with every
    tensor on meta (``"meta"``). ``fulls`` are the saved full values whatever the role."""
    if kind == "plain":
        saved = edge_tensors(seed)
        make = {"saved": lambda v: v, "target": _target_like, "meta": _meta_like}[role]
        return _State({k: make(v) for k, v in saved.items()}, {})
    if kind in ("objects", "int-keys"):
        make_objects = _objects if kind == "objects" else _int_keyed
        return _State(make_objects("saved" if role == "saved" else "target"), {})
    mesh, specs = (dist.mesh(), _SPECS_1D) if kind == "dtensor-1d" else (_mesh_2d(dist), _SPECS_2D)
    values, fulls = {}, {}
    for key, (full, placements) in _edge_sharded_fulls(specs, seed).items():
        fulls[(key,)] = full
        start = {"saved": full, "target": different_like(full), "meta": full.to("meta")}[role]
        values[key] = dtensor_of(start, mesh, placements)
    return _State(values, fulls)


_KINDS = ["plain", "objects", "int-keys", "dtensor-1d", "dtensor-2d"]


def _mixed(dist: RankContext, role: str, seed: int) -> _State:
    """Every kind in one nested state dict (but ``int-keys``: ML-1 checks those; ML-2 is about the format)."""
    parts = {kind: _state(dist, kind, role, seed) for kind in _KINDS if kind != "int-keys"}
    fulls = {(kind, *path): full for kind, part in parts.items() for path, full in part.fulls.items()}
    return _State({kind: part.values for kind, part in parts.items()}, fulls)


# -- ML-1 round trip ---------------------------------------------------------------------------


@pytest.mark.req("ML-1")
@pytest.mark.parametrize("kind", _KINDS)
def test_round_trip_restores_every_value(dist, impl, kind: str) -> None:
    """Save edge values of every dtype (NaN payloads, -0.0, inf, float64 beyond float32, int64 beyond
    2**53, 0-d, empty, non-contiguous and offset views), as plain tensors and as DTensors of every
    dtype (Shard/Replicate, uneven, empty local shards, 1-D and 2-D meshes), and non-tensor values
    of every kind; load into a state dict of the same layout whose every value differs; compare bit
    for bit, and each DTensor's local shard on every rank against the documented layout."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    saved = _state(dist, kind, "saved")
    ops.save(saved.values, path, process_group=group_of(dist))
    target = _state(dist, kind, "target")
    call_or_skip(lambda: ops.load(target.values, path, process_group=group_of(dist)))
    _assert_local_shards(dist, target.values, saved.fulls, what="loaded")
    assert_same_bits(target.values, _state(dist, kind, "saved").values)


@pytest.mark.req("ML-22")
def test_values_held_by_some_ranks_only_are_saved(dist, impl) -> None:
    """Keys that only some ranks hold (a non-tensor and a tensor on the last rank only, a value on every
    rank but the first) are saved and load back on exactly those ranks, with the values each held;
    the coordinator not holding a key loses nothing (pytorch/pytorch PR #125334)."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    last = dist.rank == dist.world_size - 1

    def state(fill: float) -> dict[str, Any]:
        values: dict[str, Any] = {"common": torch.full((3,), fill)}
        if last:
            values["last_only_count"] = int(fill * 10) + 7
            values["last_only_tensor"] = torch.full((2, 2), fill + 0.5, dtype=torch.float64)
        if dist.rank > 0:
            values[f"rank{dist.rank}_note"] = f"rank {dist.rank}: {fill}"
        return values

    ops.save(state(1.0), path, process_group=group_of(dist))
    target = state(-2.0)
    call_or_skip(lambda: ops.load(target, path, process_group=group_of(dist)))
    assert_same_bits(target, state(1.0))


# -- ML-18 loads fill tensors in place / ML-19 views are saved compactly ----------------------------


@pytest.mark.req("ML-18")
def test_load_fills_tensors_in_place(dist, impl) -> None:
    """Load into plain tensors laid out as the saved ones (views included), whose storages hold a
    pattern outside their elements, and into DTensors: every entry stays the same object over the
    same memory, takes the saved bits, and no byte outside its elements changes."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    saved = {"plain": _state(dist, "plain", "saved").values, "sharded": _state(dist, "dtensor-1d", "saved").values}
    ops.save(saved, path, process_group=group_of(dist))
    target = {"plain": _state(dist, "plain", "target").values, "sharded": _state(dist, "dtensor-1d", "target").values}
    entries = {(part, key): value for part, values in target.items() for key, value in values.items()}
    memory = {where: (v.to_local() if isinstance(v, DTensor) else v).data_ptr() for where, v in entries.items()}
    outside = {where: _outside_bytes(v) for where, v in entries.items() if not isinstance(v, DTensor)}
    call_or_skip(lambda: ops.load(target, path, process_group=group_of(dist)))
    for (part, key), value in entries.items():
        got = target[part][key]
        if got is not value:
            fail("load replaced a tensor instead of filling it", f"a new {type(got).__name__}", "the same object", f"{part}.{key}")
        local = got.to_local() if isinstance(got, DTensor) else got
        if local.data_ptr() != memory[(part, key)]:
            fail("load moved a tensor to other memory", hex(local.data_ptr()), hex(memory[(part, key)]), f"{part}.{key}")
        if (part, key) in outside:
            assert_bitwise_equal(_outside_bytes(got), outside[(part, key)], what="storage bytes outside the view's elements",
                                 where=f"{part}.{key} (shape {tuple(got.shape)}, stride {got.stride()}, offset {got.storage_offset()})")
    assert_same_bits(target, saved)


#: Bytes a record may take beyond its elements' (torch.save's zip headers: about 1.5 KiB).
_RECORD_OVERHEAD = 4096


@pytest.mark.req("ML-19")
def test_views_are_saved_as_their_own_elements(dist, impl) -> None:
    """Save views of a 1 MiB storage (a slice at an offset, a strided slice, a DTensor whose local
    shard is such a view) and read the records' lengths from the metadata: each is at most its
    elements' bytes plus a fixed overhead, not the whole storage."""

    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    big = torch.randn(2**18, generator=torch.Generator().manual_seed(3))
    full = torch.randn(4 * dist.world_size, 3, generator=torch.Generator().manual_seed(4))
    piece, _ = expected_local_chunk(full, [Shard(0)], (dist.world_size,), (dist.rank,))
    local = big[1000 : 1000 + piece.numel()].view(piece.shape)
    local.copy_(piece)
    sd = {
        "slice": big[7:13],
        "strided": big[100:400:37],
        "shard": DTensor.from_local(local, dist.mesh(), [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()),
    }
    ops.save(sd, path, process_group=group_of(dist))
    dist.barrier()
    records = read_metadata(path).storage_data
    for index, info in records.items():
        value = sd[index.fqn]
        chunk = value.to_local() if isinstance(value, DTensor) else value
        elements = chunk.numel() * chunk.element_size()
        if info.length > elements + _RECORD_OVERHEAD:
            fail(f"the record of {index.fqn!r} is larger than its elements", f"{info.length} bytes",
                 f"at most {elements} + {_RECORD_OVERHEAD} (the view's storage is {big.untyped_storage().nbytes()} bytes)",
                 f"chunk at {list(index.offset or [])}, rank {dist.rank}")
    target = {k: _target_like(v) if not isinstance(v, DTensor) else dtensor_of(different_like(full), dist.mesh(), [Shard(0)]) for k, v in sd.items()}
    call_or_skip(lambda: ops.load(target, path, process_group=group_of(dist)))
    assert_local_shard(target["shard"], full, what="loaded shard")
    assert_same_bits({k: target[k] for k in ("slice", "strided")}, {k: sd[k] for k in ("slice", "strided")})


# -- ML-2 cross-implementation ------------------------------------------------------------------


@pytest.mark.req("ML-2")
@pytest.mark.parametrize("saver", ["impl-saves", "reference-saves"])
def test_checkpoint_loads_across_implementations(dist, impl, reference_impl, saver: str) -> None:
    """Every kind of value (edge tensors, edge DTensors on 1-D and 2-D meshes, non-tensor values) in
    one nested state dict, saved by one implementation and loaded by the other into a state dict
    whose every value differs; bitwise, with per-rank local shards."""
    if impl.name == reference_impl.name and saver == "reference-saves":
        pytest.skip("for the reference itself this is the impl-saves case")
    ops, ref = checkpoint_ops(impl), checkpoint_ops(reference_impl)
    writer, reader = (ops, ref) if saver == "impl-saves" else (ref, ops)
    path = dist.tmp_dir / "ckpt"
    saved = _mixed(dist, "saved", seed=2)
    writer.save(saved.values, path, process_group=group_of(dist))
    target = _mixed(dist, "target", seed=2)
    call_or_skip(lambda: reader.load(target.values, path, process_group=group_of(dist)))
    _assert_local_shards(dist, target.values, saved.fulls, what="loaded")
    assert_same_bits(target.values, _mixed(dist, "saved", seed=2).values)


# -- ML-25 the on-disk format, read and written by upstream DCP whatever --impl selects ----------------------


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
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), process_group=group_of(dist))


def _optimizer_state(dist: RankContext, role: str, seed: int) -> _State:
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
    return _State({"state": state, "param_groups": groups}, fulls)


def _format_state(dist: RankContext, role: str, seed: int) -> _State:
    """Every kind of value in one nested state dict (edge tensors of every dtype, edge DTensors on 1-D and
    2-D meshes, non-tensor values of every kind) and an optimizer's state under ``optim``."""
    mixed, optim = _mixed(dist, role, seed), _optimizer_state(dist, role, seed)
    return _State({**mixed.values, "optim": optim.values},
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

    md = dcp.FileSystemReader(path).read_metadata()
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


def _format_save(dist: RankContext, impl: Adapter, route: str, path: str, seed: int) -> None:
    saved = _format_state(dist, "saved", seed).values
    if route == "upstream-saves":
        _upstream_save(dist, saved, path)
        return
    call_or_skip(lambda: checkpoint_ops(impl).save(saved, path, process_group=group_of(dist)))
    _upstream_save(dist, _format_state(dist, "saved", seed).values, path + "-by-upstream")  # the same state dict


def _format_load(dist: RankContext, impl: Adapter, route: str, path: str, seed: int, out: str) -> None:
    """Load what :func:`_format_save` saved (the other side loads) and check it; with ``impl-saves``,
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
        _assert_local_shards(dist, target.values, saved.fulls, what="loaded")
        assert_same_bits(target.values, saved.values, what=f"loaded by {'upstream' if route == 'impl-saves' else impl.name}")

    def converted() -> None:
        if route == "impl-saves" and dist.rank == 0:
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            dcp_to_torch_save(path, out)  # upstream rebuilds the nested state dict from the metadata alone
            assert_same_bits(torch.load(out, weights_only=False), _full_values(saved.values, saved.fulls), check_order=False,
                              what="upstream's dcp_to_torch_save of the checkpoint (nesting from planner_data)")

    check_each(metadata=metadata, loaded=loaded, converted=converted)


_FORMAT_ROUTES = ["impl-saves", "upstream-saves"]


@pytest.mark.req("ML-25")
@pytest.mark.parametrize("route", _FORMAT_ROUTES)
def test_checkpoint_format_matches_upstream(dist, impl, route: str) -> None:
    """Every kind of value (nested dicts, edge tensors and DTensors of every dtype on 1-D and 2-D meshes,
    non-tensor values of every kind, AdamW state keyed by FQN with sharded moments) saved by the
    implementation and read by upstream ``torch.distributed.checkpoint`` called directly (``load``
    with ``FileSystemReader``; on rank 0 also ``dcp_to_torch_save``, which rebuilds the nesting from
    the metadata alone), or saved by upstream and loaded by the implementation, into a state dict
    whose every value differs: bitwise, each DTensor's local shard its documented piece. The
    implementation's metadata, read with ``FileSystemReader.read_metadata``, lists what upstream's own
    save of the same state dict lists. Whatever ``--impl`` selects (the reference alone too),
    upstream is the other side."""
    path = str(dist.tmp_dir / "ckpt")
    _format_save(dist, impl, route, path, 7)
    dist.barrier()
    _format_load(dist, impl, route, path, 7, str(dist.tmp_dir / "converted.pt"))


@pytest.mark.req("ML-25")
@pytest.mark.parametrize("route", _FORMAT_ROUTES)
def test_checkpoint_format_matches_upstream_across_world_sizes(pools, world_size_pair, impl, tmp_path: Path, route: str) -> None:
    """As :func:`test_checkpoint_format_matches_upstream`, saved at one world size and read at another
    (upstream or the implementation resharding the DTensors)."""
    saved_at, loaded_at = world_size_pair
    path = str(tmp_path / "ckpt")
    pools.run(saved_at, _format_save, impl, route, path, 7)
    pools.run(loaded_at, _format_load, impl, route, path, 7, str(tmp_path / "converted.pt"))


# -- ML-3 replicated data written once ------------------------------------------------------------


@pytest.mark.req("ML-3")
def test_replicated_data_is_written_once(dist, impl) -> None:
    """Save a plain tensor, a replicated DTensor and a DTensor replicated along one mesh dim of a 2-D
    mesh; the metadata lists each chunk once, stores each once, and the chunks tile each tensor."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata


    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    mesh_2d = _mesh_2d(dist)
    sd = {
        "plain": torch.arange(12.0).reshape(3, 4),
        "replicated": dtensor_of(torch.arange(15.0), dist.mesh(), [Replicate()]),
        "replicate_shard": dtensor_of(torch.arange(30.0).reshape(10, 3), mesh_2d, [Replicate(), Shard(0)]),
    }
    ops.save(sd, path, process_group=group_of(dist))
    if dist.rank != 0:
        return
    md = read_metadata(path)
    chunks = {k: v.chunks for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    expected = {"plain": 1, "replicated": 1, "replicate_shard": min(mesh_2d.size(1), 10)}
    got = {k: len(v) for k, v in chunks.items()}
    if got != expected:
        fail("chunks per key in the metadata", got, expected, str(path))
    stored: dict[str, int] = {}
    for index in md.storage_data:
        stored[index.fqn] = stored.get(index.fqn, 0) + 1
    if stored != expected:
        fail("stored records per key", stored, expected, str(path))
    for key, key_chunks in chunks.items():
        volume = sum(math.prod(c.sizes) for c in key_chunks)
        if volume != sd[key].numel():
            fail("the saved chunks do not tile the tensor", f"{volume} elements", f"{sd[key].numel()}", key)


# -- ML-4 meta loading ------------------------------------------------------------------------------


def _check_built(dist: RankContext, loaded: dict[str, Any], saved: _State) -> None:
    """ML-4's checks of a meta load: every value built on the process group's device, no meta left,
    DTensors keep mesh, placements, global shape and stride, and every value (each rank's local
    shard of a DTensor) holds the saved bits."""
    __tracebackhide__ = True
    for key, want in saved.values.items():
        got = loaded[key]
        local = got.to_local() if isinstance(got, DTensor) else got
        if local.device != dist.device:
            fail("a meta value was built on the wrong device", local.device, dist.device, f"{key}, rank {dist.rank}")
        if isinstance(want, DTensor):
            if not isinstance(got, DTensor):
                fail("a meta DTensor was built as another type", type(got).__name__, "DTensor", key)
            if got.device_mesh != want.device_mesh or tuple(got.placements) != tuple(want.placements):
                fail("a meta DTensor's layout changed", (got.device_mesh, got.placements), (want.device_mesh, want.placements), key)
            if got.shape != want.shape or got.stride() != want.stride():
                fail("a meta DTensor's global shape/stride changed", (tuple(got.shape), got.stride()),
                     (tuple(want.shape), want.stride()), key)
    _assert_local_shards(dist, loaded, saved.fulls, what="built")
    assert_same_bits(loaded, saved.values)


@pytest.mark.req("ML-4")
def test_meta_load_builds_every_value(dist, impl) -> None:
    """Edge values of every dtype, plain (views too) and as DTensors on 1-D and 2-D meshes, loaded into
    meta tensors of the same layout: each becomes a tensor on the process group's device with the
    saved bits, each DTensor keeping its layout and holding its documented local shard."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    kinds = ("plain", "dtensor-1d", "dtensor-2d")
    saved = {kind: _state(dist, kind, "saved") for kind in kinds}
    ops.save({kind: state.values for kind, state in saved.items()}, path, process_group=group_of(dist))
    target = {kind: _state(dist, kind, "meta").values for kind in kinds}
    call_or_skip(lambda: ops.load(target, path, process_group=group_of(dist)))
    for kind in kinds:
        _check_built(dist, target[kind], saved[kind])


def _tp_plan() -> dict[str, Any]:
    """PR #113319's plan on zoo "mlp" (5 -> 10 -> 15 -> 1): net.0 row-wise (its 5 input features over the
    ranks: 3+2 at 2 ranks, 2+2+1+0 at 4), net.2 column-wise (15 outputs: 8+7, 4+4+4+3). The layouts at
    the model's edges are Replicate so that the forward runs on the full batch and gives full outputs."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"net.0": RowwiseParallel(input_layouts=Replicate()), "net.2": ColwiseParallel(output_layouts=Replicate())}


def _tp_model(dist: RankContext, seed: int, device: str | torch.device) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(zoo_model(dist, "mlp", seed, device), dist.mesh(), _tp_plan())


def _fsdp2_model(dist: RankContext, name: str, seed: int, device: str | torch.device) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = zoo_model(dist, name, seed, device)
    fully_shard(model, mesh=dist.mesh())  # shards in place (and returns ``model``, typed as an FSDPModule)
    return model


def _saved_model_state(model: nn.Module) -> _State:
    """A model's state dict and the full value of each DTensor in it (collective)."""
    sd = model.state_dict()
    return _State(sd, {(k,): v.full_tensor() for k, v in sd.items() if isinstance(v, DTensor)})


def _assert_meta_load_rebuilds(dist: RankContext, ops: Any, name: str, model: nn.Module, meta_model: Callable[[], nn.Module]) -> None:
    """Save ``model``'s state dict, load it into the state dict of ``meta_model()`` (built after the
    save), check what the load built, assign it and compare outputs with ``model``'s exactly."""
    path = dist.tmp_dir / "ckpt"
    saved = _saved_model_state(model)
    ops.save(saved.values, path, process_group=group_of(dist))

    target = meta_model()
    sd = target.state_dict()
    call_or_skip(lambda: ops.load(sd, path, process_group=group_of(dist)))
    _check_built(dist, sd, saved)
    target.load_state_dict(sd, assign=True)
    inputs = models.batch(name, seed=3, device=dist.device)
    assert_bitwise_equal(target(inputs).detach(), model(inputs).detach(), what="output of the model built from meta")


@pytest.mark.req("ML-4")
def test_meta_load_tensor_parallel_model(dist, impl) -> None:
    """PR #113319's test: a tensor-parallel model with uneven shards, loaded into a meta copy."""
    ops = checkpoint_ops(impl)
    model = _tp_model(dist, seed=5, device=dist.device)
    _assert_meta_load_rebuilds(dist, ops, "mlp", model, lambda: _tp_model(dist, seed=0, device="meta"))


@pytest.mark.req("ML-4")
@pytest.mark.parametrize("name", ["mlp", "nested", "groups", "dtypes"])
def test_meta_load_fsdp2_model(dist, impl, name: str) -> None:
    """An FSDP2 model (``dtypes``: float64 parameters, a buffer per edge dtype) loaded into a meta copy."""
    ops = checkpoint_ops(impl)
    model = _fsdp2_model(dist, name, seed=6, device=dist.device)
    _assert_meta_load_rebuilds(dist, ops, name, model, lambda: _fsdp2_model(dist, name, seed=0, device="meta"))


# -- ML-5 tied parameters -------------------------------------------------------------------------


@pytest.mark.req("ML-5")
def test_meta_load_keeps_tied_storage_shared(dist, impl) -> None:
    """Zoo ``tied`` built on meta: after the load its two tied entries share one storage, and the model
    assigned from them (re-tied) computes what the saved model computes."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    model = models.build("tied", seed=2, device=dist.device)
    ops.save(model.state_dict(), path, process_group=group_of(dist))

    meta_model = zoo_model(dist, "tied", seed=0, device="meta")
    sd = meta_model.state_dict()
    call_or_skip(lambda: ops.load(sd, path, process_group=group_of(dist)))
    _check_built(dist, sd, _State(model.state_dict(), {}))
    embed, head = sd["embed.weight"].untyped_storage().data_ptr(), sd["head.weight"].untyped_storage().data_ptr()
    if embed != head:
        fail("tied values shared a storage on meta but not after loading", f"{hex(embed)} and {hex(head)}", "one storage",
             "embed.weight, head.weight")
    meta_model.load_state_dict(sd, assign=True)
    meta_model.get_submodule("head").weight = meta_model.get_parameter("embed.weight")  # assign=True makes one Parameter per key: re-tie
    inputs = models.batch("tied", seed=1, device=dist.device)
    assert_bitwise_equal(meta_model(inputs).detach(), model(inputs).detach(), what="output of the re-tied model")


# -- ML-6 unbuildable meta values ----------------------------------------------------------------------


class MarkedTensor(torch.Tensor):
    """A tensor subclass whose data lives elsewhere: allocating one like it is refused."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.empty_like, torch.zeros_like, torch.Tensor.new_empty, torch.Tensor.to):
            raise TypeError("a MarkedTensor cannot be allocated")
        return super().__torch_function__(func, types, args, kwargs or {})


def _error_checkpoint() -> dict[str, torch.Tensor]:
    """The small checkpoint of the error tests: distinctive key names, values no target starts with."""
    return {"proj.weight": torch.arange(12.0).reshape(4, 3), "proj.bias": torch.tensor([0.5, -0.0])}


@pytest.mark.req("ML-6")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("who", WHERE)
def test_meta_value_of_unknown_type_is_an_error(dist, impl, who: str) -> None:
    """A meta tensor subclass under ``proj.weight`` (on every rank, or on the last rank only while the
    others hold a plain meta tensor): every rank raises the same error naming the key and the type,
    and the state dict, meta entries and their identities, is unchanged on every rank."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    ops.save(_error_checkpoint(), path, process_group=group_of(dist))
    weight = torch.empty(4, 3, device="meta")
    sd = {"proj.weight": weight.as_subclass(MarkedTensor) if bad_input_here(dist, who) else weight,
          "proj.bias": torch.empty(2, device="meta")}
    before = snapshot(state_dict=sd)
    exc = raised(lambda: ops.load(sd, path, process_group=group_of(dist)))
    check_each(
        raises=lambda: _fails_alike(dist, lambda: reraise(exc), keys=("proj.weight",), needles=("MarkedTensor",),
                                    what="load into a meta MarkedTensor"),
        unchanged=lambda: assert_unchanged(before, state_dict=sd, where=f"rank {dist.rank}"),
    )


# -- ML-7 peak memory of a meta load -----------------------------------------------------------------------


@pytest.mark.req("ML-7")
def test_meta_load_allocates_local_shards_once(dist, impl) -> None:
    """The peak memory of a 64 MiB-per-rank meta load, on the device the shards are built on (RSS on
    the CPU, the allocator's peak on a GPU), stays below 1.5 times the local shard bytes."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    rows = 4096 * dist.world_size
    full = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(0))  # 64 MiB per rank
    saved = {"w": dtensor_of(full, dist.mesh(), [Shard(0)])}
    ops.save(saved, path, process_group=group_of(dist))
    local_bytes = saved["w"].to_local().numel() * 4
    del full
    sd = {"w": dtensor_of(torch.empty(rows, 4096, device="meta"), dist.mesh(), [Shard(0)])}
    peak, measured = peak_bytes_during(dist.device, lambda: call_or_skip(lambda: ops.load(sd, path, process_group=group_of(dist))))
    assert_bitwise_equal(sd["w"].to_local(), saved["w"].to_local(), what="local shard loaded into meta")
    if sd["w"].to_local().device != dist.device:
        fail("the meta load built the shard on another device", sd["w"].to_local().device, dist.device, f"rank {dist.rank}")
    if peak >= 1.5 * local_bytes:
        fail(f"load into meta raised the {measured} too much", f"{peak / 2**20:.1f} MiB",
             f"below 1.5 x {local_bytes / 2**20:.1f} MiB of local shards", f"rank {dist.rank}")


# -- ML-8 resharding across world sizes ----------------------------------------------------------------------


def _save_tp(dist: RankContext, impl: Adapter, path: str) -> None:
    model = _tp_model(dist, seed=8, device=dist.device)
    checkpoint_ops(impl).save(model.state_dict(), path, process_group=group_of(dist))


def _load_tp(dist: RankContext, impl: Adapter, path: str) -> None:
    meta_model = _tp_model(dist, seed=0, device="meta")
    sd = meta_model.state_dict()
    call_or_skip(lambda: checkpoint_ops(impl).load(sd, path, process_group=group_of(dist)))
    oracle = models.build("mlp", seed=8, device=dist.device)
    expected = _tp_model(dist, seed=8, device=dist.device).state_dict()  # the layout at this world size
    unsharded = oracle.state_dict()
    _check_built(dist, sd, _State(expected, {(k,): unsharded[k] for k, v in expected.items() if isinstance(v, DTensor)}))
    meta_model.load_state_dict(sd, assign=True)
    inputs = models.batch("mlp", seed=4, device=dist.device)
    # Not bitwise: row-wise parallel sums partial products across ranks in another order.
    assert_same_state(meta_model(inputs).detach(), oracle(inputs).detach(), what="output after resharding", atol=1e-6, rtol=1e-5)


_ROUTES = ["impl-to-impl", "reference-to-impl", "impl-to-reference"]


@pytest.mark.req("ML-2", "ML-8")
@pytest.mark.parametrize("route", _ROUTES)
def test_reshard_tensor_parallel_model(pools, world_size_pair, impl, reference_impl, tmp_path: Path, route: str) -> None:
    """The grid of saver x loader x (saved world size, loaded world size), on the uneven TP model
    loaded into meta: each rank's local shard is its documented piece of the saved model's value."""
    if impl.name == reference_impl.name and route != "impl-to-impl":
        pytest.skip("for the reference itself this route is impl-to-impl")
    saver, loader = (reference_impl if part == "reference" else impl for part in route.split("-to-"))
    saved_at, loaded_at = world_size_pair
    pools.run(saved_at, _save_tp, saver, str(tmp_path / "ckpt"))
    pools.run(loaded_at, _load_tp, loader, str(tmp_path / "ckpt"))


_TRAIN_STEPS = 2
class _Tolerance(TypedDict):
    atol: float
    rtol: float


#: Training on N ranks sums gradients in another order than one process: compare within this.
_TRAINING_TOLERANCE: _Tolerance = {"atol": 1e-5, "rtol": 1e-5}


def _optimizer(model: nn.Module, *, reverse: bool = False) -> torch.optim.Optimizer:
    """Adam over two param groups (weights; the rest) with different hyperparameters, an LR
    scheduler's ``initial_lr`` and a custom key. ``reverse`` lists each group's parameters the other
    way round. Groups are chosen by name, so the sharded model and the oracle group alike."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    weights = [p for n, p in named if n.endswith("weight")]
    others = [p for n, p in named if not n.endswith("weight")]
    if reverse:
        weights, others = weights[::-1], others[::-1]
    groups = [{"params": weights, "lr": 0.02, "weight_decay": 0.01}, {"params": others, "lr": 0.01, "betas": (0.8, 0.95)}]
    optimizer = torch.optim.Adam([g for g in groups if g["params"]], lr=0.01)
    for index, group in enumerate(optimizer.param_groups):
        group["initial_lr"] = group["lr"] * 2
        group["sdc_custom"] = f"source-{index}"
    return optimizer


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, name: str, steps: range, device: Any) -> None:
    for step in steps:
        models.train_step(model, optimizer, models.batch(name, seed=step, device=device))


def _hyperparameters(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in groups]


def _save_training(dist: RankContext, impl: Adapter, name: str, path: str, saved_path: str) -> None:
    ops = checkpoint_ops(impl)
    model = _shard(impl, models.build(name, seed=11, device=dist.device), dist)
    optimizer = _optimizer(model)
    _train(model, optimizer, name, range(_TRAIN_STEPS), dist.device)
    model_sd, optim_sd = ops.get_state_dicts(model, optimizer)
    if dist.world_size > 1:  # otherwise this test would not reshard anything
        assert any(isinstance(v, DTensor) for v in model_sd.values()), "the sharded model state dict holds no DTensor"
    ops.save({"model": model_sd, "optim": optim_sd}, path, process_group=group_of(dist))
    full = full_on_cpu({"model": model_sd, "optim": optim_sd})  # collective
    if dist.rank == 0:
        torch.save(full, saved_path)  # the saved values, full, for the loading world size to compare with


def _assert_matches_full(dist: RankContext, got: Any, full: Any, where: str) -> None:
    """``got`` (a state dict of the loading world size) holds exactly the saved values ``full`` (the
    same state gathered at the saving world size): each DTensor's local shard is its documented piece
    of the full value, every other value equal bit for bit. Dict order is not compared (the target's
    optimizer lists its parameters in another order)."""
    __tracebackhide__ = True
    if isinstance(full, Mapping) and isinstance(got, Mapping):
        if set(map(str, got)) != set(map(str, full)):
            fail("resharded state: keys differ", sorted(map(str, got)), sorted(map(str, full)), where)
        by_name = {str(k): v for k, v in got.items()}
        for key, value in full.items():
            _assert_matches_full(dist, by_name[str(key)], value, f"{where}.{key}")
    elif isinstance(got, DTensor):
        assert_local_shard(got, full, what="resharded value", where=f"{where}, rank {dist.rank} of {dist.world_size}")
    else:
        assert_same_state(exact(got), exact(full), what="resharded value", where=where, check_order=False)


def _load_training(dist: RankContext, impl: Adapter, name: str, path: str, saved_path: str) -> None:
    ops = checkpoint_ops(impl)
    model = _shard(impl, models.build(name, seed=99, device=dist.device), dist)
    optimizer = _optimizer(model, reverse=True)
    perturb_hyperparameters(optimizer)
    _train(model, optimizer, name, range(50, 51), dist.device)  # optimizer state to load into, from another batch
    model_sd, optim_sd = ops.get_state_dicts(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    call_or_skip(lambda: ops.load(state, path, process_group=group_of(dist)))
    saved = torch.load(saved_path, weights_only=False)
    _assert_matches_full(dist, state, saved, "loaded")
    ops.set_state_dicts(model, optimizer, state["model"], state["optim"])
    assert_same_bits(_hyperparameters(optimizer.param_groups), _hyperparameters(saved["optim"]["param_groups"]),
                      what="optimizer hyperparameters after loading")
    got_model, got_optim = ops.get_state_dicts(model, optimizer)
    _assert_matches_full(dist, {"model": got_model, "state": got_optim["state"]},
                         {"model": saved["model"], "state": saved["optim"]["state"]}, "after set_state_dicts")

    oracle = models.build(name, seed=11, device=dist.device)
    oracle_optimizer = _optimizer(oracle)
    _train(oracle, oracle_optimizer, name, range(_TRAIN_STEPS), dist.device)
    got_model = full_on_cpu(got_model)
    want_model = full_on_cpu(oracle.state_dict())
    assert_same_state({k: got_model[k] for k in want_model}, want_model, what="model after resharding vs the unsharded run",
                      check_order=False, **_TRAINING_TOLERANCE)
    want_state = full_on_cpu(fqn_keyed_optim(oracle, oracle_optimizer)["state"])
    got_state = full_on_cpu(got_optim["state"])
    assert_same_state({k: got_state.get(k) for k in want_state}, want_state, what="optimizer state after resharding vs the unsharded run",
                      check_order=False, **_TRAINING_TOLERANCE)
    # Training resumes where the saved run left off.
    _train(model, optimizer, name, range(_TRAIN_STEPS, _TRAIN_STEPS + 1), dist.device)
    _train(oracle, oracle_optimizer, name, range(_TRAIN_STEPS, _TRAIN_STEPS + 1), dist.device)
    got_model = full_on_cpu(ops.get_state_dicts(model, optimizer)[0])
    want_model = full_on_cpu(oracle.state_dict())
    assert_same_state({k: got_model[k] for k in want_model}, want_model, what="model after resuming vs the unsharded run",
                      check_order=False, **_TRAINING_TOLERANCE)


@pytest.mark.req("ML-8")
@pytest.mark.parametrize("name", ["groups", "dtypes"])  # zoo "mlp" is resharded by the tensor-parallel test
def test_reshard_model_and_optimizer_state(pools, world_size_pair, impl, tmp_path: Path, name: str) -> None:
    """Train a sharded zoo model at one world size, save model and optimizer state, load at another
    into a model from another seed whose optimizer lists its parameters in reverse and has every
    hyperparameter perturbed: the loaded state is the saved state bit for bit (each rank's shard its
    documented piece, param groups exactly), and matches and resumes like the unsharded run."""
    saved_at, loaded_at = world_size_pair
    args = (str(tmp_path / "ckpt"), str(tmp_path / "saved.pt"))
    pools.run(saved_at, _save_training, impl, name, *args)
    pools.run(loaded_at, _load_training, impl, name, *args)


# -- ML-9 per-rank values -----------------------------------------------------------------------------------


@pytest.mark.req("ML-9")
@pytest.mark.rank_timeout(30)
@pytest.mark.world_size(min=2)
@pytest.mark.parametrize("who", WHERE)
def test_per_rank_value_under_one_key_is_an_error(dist, impl, who: str) -> None:
    """``rank_seed`` differs on every rank, or only on the last: every rank's save raises the same
    error, naming the key. The job saved the same layout with equal values before, so an
    implementation that reuses that save's plan must still compare the values."""
    if who == "one-rank" and dist.world_size < 3:
        pytest.skip("at world size 2 one differing rank is every rank differing: the every-rank case covers it")
    ops = checkpoint_ops(impl)
    ops.save({"w": torch.ones(3), "rank_seed": 1000}, dist.tmp_dir / "earlier", process_group=group_of(dist))
    seed = 1000 + (dist.rank if who == "every-rank" else int(dist.rank == dist.world_size - 1))
    sd = {"w": torch.ones(3), "rank_seed": seed}
    _fails_alike(dist, lambda: ops.save(sd, dist.tmp_dir / "ckpt", process_group=group_of(dist)), keys=("rank_seed",),
                 what="save of a per-rank value")


# -- ML-10 / ML-11 strict loading ------------------------------------------------------------------------------

_F32 = torch.float32
#: What the state dict asks for, per key: (shape, dtype). The good one matches _error_checkpoint().
_GOOD = {"proj.weight": ((4, 3), _F32), "proj.bias": ((2,), _F32)}
#: mismatch -> (what the bad rank asks for, the key the error must name, what else it must say)
_MISMATCHES: dict[str, tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], str, tuple[str, ...]]] = {
    "missing-key": ({**_GOOD, "extra.scale": ((2,), _F32)}, "extra.scale", ()),
    "shape": ({**_GOOD, "proj.weight": ((3, 4), _F32)}, "proj.weight", ("3, 4", "4, 3")),
    "dtype": ({**_GOOD, "proj.weight": ((4, 3), torch.float64)}, "proj.weight", ("float64", "float32")),
}


def _asking_for(spec: dict[str, tuple[tuple[int, ...], torch.dtype]], device: str) -> dict[str, torch.Tensor]:
    """A state dict of ``spec`` on ``device``; on the CPU its values differ from the checkpoint's."""
    out = {}
    for key, (shape, dtype) in spec.items():
        if device == "meta":
            out[key] = torch.empty(shape, dtype=dtype, device="meta")
        else:
            out[key] = torch.arange(math.prod(shape), dtype=torch.float64).add(0.5).neg().reshape(shape).to(dtype)
    return out


@pytest.mark.req("ML-10")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("who", WHERE)
@pytest.mark.parametrize("mismatch", list(_MISMATCHES))
def test_strict_load_names_the_key_and_changes_nothing(dist, impl, mismatch: str, who: str) -> None:
    """A key missing from the checkpoint, a shape or a dtype that differs (on every rank, or on the last
    rank only while the others ask for exactly the checkpoint), loading into CPU tensors and then into
    meta tensors: every rank raises the same error naming the key (with both shapes or dtypes), and
    every rank's state dict is unchanged, deeply (meta entries and identities included)."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    ops.save(_error_checkpoint(), path, process_group=group_of(dist))
    spec, key, needles = _MISMATCHES[mismatch]
    asked = spec if bad_input_here(dist, who) else _GOOD
    for device in ("cpu", "meta"):
        sd = _asking_for(asked, device)
        before = snapshot(state_dict=sd)
        _fails_alike(dist, lambda: ops.load(sd, path, process_group=group_of(dist)), keys=(key,), needles=needles,
                     what=f"strict load into {device} tensors with a {mismatch} mismatch")
        assert_unchanged(before, state_dict=sd, where=f"rank {dist.rank}, {device} tensors")


@pytest.mark.req("ML-10")
def test_non_strict_load_skips_missing_keys(dist, impl) -> None:
    """With strict loading off, a key missing from the checkpoint keeps its object and value; the
    others take the saved bits."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    saved = _error_checkpoint()
    ops.save(saved, path, process_group=group_of(dist))
    extra = torch.tensor([1.25, -0.0])
    sd = {"proj.weight": different_like(saved["proj.weight"]), "extra.scale": extra}
    call_or_skip(lambda: ops.load(sd, path, process_group=group_of(dist), strict=False))
    if sd["extra.scale"] is not extra:
        fail("a non-strict load replaced the entry of a missing key", type(sd["extra.scale"]).__name__, "the same tensor", "extra.scale")
    assert_same_bits(sd, {"proj.weight": saved["proj.weight"], "extra.scale": torch.tensor([1.25, -0.0])})


@pytest.mark.req("ML-11")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("who", WHERE)
def test_unexpected_keys_can_be_an_error(dist, impl, who: str) -> None:
    """A checkpoint key the state dict does not ask for is allowed by default (the rest loads), and with
    ``allow_unexpected=False`` is an error naming it, raised alike by every rank also when only the
    last rank lacks the key; every state dict is then unchanged."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    saved = {"proj.weight": torch.arange(12.0).reshape(4, 3), "surplus.scale": torch.tensor([2.0, -0.0])}
    ops.save(saved, path, process_group=group_of(dist))
    sd = {"proj.weight": different_like(saved["proj.weight"])}
    call_or_skip(lambda: ops.load(sd, path, process_group=group_of(dist)))  # allowed by default
    assert_bitwise_equal(sd["proj.weight"], saved["proj.weight"], what="proj.weight loaded beside an unexpected key")
    sd = {"proj.weight": different_like(saved["proj.weight"])}
    if not bad_input_here(dist, who):
        sd["surplus.scale"] = different_like(saved["surplus.scale"])
    before = snapshot(state_dict=sd)
    exc = raised(lambda: ops.load(sd, path, process_group=group_of(dist), allow_unexpected=False))
    check_each(
        raises=lambda: _fails_alike(dist, lambda: reraise(exc), keys=("surplus.scale",), what="load with an unexpected key"),
        unchanged=lambda: assert_unchanged(before, state_dict=sd, where=f"rank {dist.rank}"),
    )


# -- ML-12 one process -----------------------------------------------------------------------------------------


@pytest.mark.req("ML-12")
@pytest.mark.parametrize("target", ["filled", "meta"])
def test_save_and_load_without_a_process_group(impl, tmp_path: Path, target: str) -> None:
    """In the controller process (no process group): edge tensors and non-tensor values saved, then
    loaded into tensors whose every value differs, or into meta tensors; bitwise."""
    import torch.distributed as torch_dist

    if torch_dist.is_available() and torch_dist.is_initialized():
        pytest.skip("torch.distributed is initialized in the controller process")
    ops = checkpoint_ops(impl)
    saved = {"plain": edge_tensors(3), "objects": _objects("saved")}
    ops.save(saved, tmp_path / "ckpt")
    make = _target_like if target == "filled" else _meta_like
    state = {"plain": {k: make(v) for k, v in edge_tensors(3).items()}, "objects": _objects("target")}
    call_or_skip(lambda: ops.load(state, tmp_path / "ckpt"))
    assert_same_bits(state, {"plain": edge_tensors(3), "objects": _objects("saved")})


# -- ML-13 failed saves ----------------------------------------------------------------------------------------


@pytest.mark.req("ML-13")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("where", ["last-rank", "every-rank"])
@pytest.mark.parametrize("fault", SAVE_FAULTS)
@pytest.mark.parametrize("directory", ["fresh", "overwrite"])
def test_failed_save_leaves_the_previous_checkpoint_whole(dist, impl, directory: str, fault: str, where: str) -> None:
    """A save that fails while writing (a full disk before or in the middle of the data, a failing
    fsync; on the last rank only or on every rank) raises on every rank, naming the directory or a
    file in it, and afterwards the directory holds exactly what it held before: the previous
    checkpoint, which loads whole with its own values (never a mix of old and new), or, in a fresh
    directory, nothing that loads."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    if directory == "overwrite":
        ops.save(sharded_values(dist, 1.0), path, process_group=group_of(dist))
    dist.barrier()

    def failing_save() -> None:
        with injected_fault(dist, path, fault, where):
            ops.save(sharded_values(dist, 50.0), path, process_group=group_of(dist))

    exc = raised(failing_save)
    if exc is None:
        fail(f"a save with {fault} on {where}", "returned normally", "an error on every rank", f"rank {dist.rank}")
    if str(path) not in str(exc) and path.name not in str(exc):
        fail(f"the error of a save with {fault}", f"{type(exc).__name__}: {exc}"[:400], f"a message naming {str(path)!r}", f"rank {dist.rank}")
    dist.barrier()
    target = sharded_values(dist, -7.0)
    loaded = raised(lambda: ops.load(target, path, process_group=group_of(dist)))
    if directory == "fresh":
        if loaded is None:
            fail("a fresh directory after a failed save", "a checkpoint that loads", "nothing that loads", f"rank {dist.rank}")
        return
    if loaded is not None:
        fail("the previous checkpoint after a failed overwrite", f"{type(loaded).__name__}: {loaded}"[:400], "loads whole", f"rank {dist.rank}")
    assert_same_bits(target, sharded_values(dist, 1.0), what="the previous checkpoint after a failed overwrite")


@pytest.mark.req("ML-13")
@pytest.mark.rank_timeout(30)
def test_a_second_save_while_one_is_in_progress_never_mixes(dist, impl) -> None:
    """A save into a directory whose previous save still holds it (its writer locked it and has not
    published): either the second save is refused with an error naming the directory, or it wins
    whole; what loads afterwards is one save's values, never a mix of two."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    ops.save(sharded_values(dist, 1.0), path, process_group=group_of(dist))
    dist.barrier()
    holder = None
    if dist.rank == 0 and (path / ".lock").exists():
        import fcntl

        holder = os.open(path / ".lock", os.O_RDWR)
        fcntl.flock(holder, fcntl.LOCK_EX)  # as a save in progress in another job holds it
    dist.barrier()
    try:
        second = raised(lambda: ops.save(sharded_values(dist, 2.0), path, process_group=group_of(dist)))
    finally:
        if holder is not None:
            os.close(holder)
    dist.barrier()
    target = sharded_values(dist, -7.0)
    call_or_skip(lambda: ops.load(target, path, process_group=group_of(dist)))
    expected = sharded_values(dist, 1.0 if second is not None else 2.0)
    assert_same_bits(target, expected, what=f"the checkpoint after a {'refused' if second is not None else 'concurrent'} second save")


# -- ML-26 successive saves of a training job --------------------------------------------------------------------------


def _job_model(dist: RankContext, step: float, *, last_rank_key: bool = False, changed: bool = False,
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


def _job_optim(dist: RankContext, step: float) -> dict[str, Any]:
    """The same job's optimizer checkpoint at ``step``: sharded Adam state keyed by FQN and its param group."""
    rows = 4 * dist.world_size
    exp_avg = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) * -0.25 + step
    return {
        "state": {"layers.0.weight": {"exp_avg": dtensor_of(exp_avg, dist.mesh(), [Shard(0)]), "step": torch.tensor(step)}},
        "param_groups": [{"lr": 1e-3 / (1 + step), "betas": (0.9, 0.999), "params": ["layers.0.weight"]}],
    }


def _job_paths(kind: str, *, last_rank_key: bool = False, changed: bool = False, moved: bool = False) -> dict[str, tuple[Any, ...]]:
    """What the checkpoint's metadata lists for a save of :func:`_job_model` or :func:`_job_optim`:
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


@pytest.mark.req("ML-26")
@pytest.mark.rank_timeout(60)
def test_successive_saves_each_hold_their_own_state(dist, impl) -> None:
    """A job's saves in turn, as :func:`_job_model`'s docstring lists the layouts: each checkpoint,
    loaded strictly right after its save and again after every other save, holds exactly its own keys
    and values on every rank. A plan cache that serves a save anything of an earlier one (its keys, its
    shapes, which rank writes what, its file names, its directory) fails here."""
    ops = checkpoint_ops(impl)
    group = group_of(dist)
    last_saved: dict[str, tuple[Callable[[float], dict[str, Any]], float, dict[str, tuple[Any, ...]]]] = {}

    def save_and_check(directory: str, kind: str, step: float, **layout: bool) -> None:
        def build(at: float) -> dict[str, Any]:
            return _job_optim(dist, at) if kind == "optim" else _job_model(dist, at, **layout)

        ops.save(build(step), dist.tmp_dir / directory, process_group=group)
        last_saved[directory] = (build, step, _job_paths(kind, **layout))
        check(directory, after=f"its save ({kind}, step {step})")

    def check(directory: str, *, after: str) -> None:
        build, step, paths = last_saved[directory]
        path = dist.tmp_dir / directory
        metadata = read_metadata(path)
        listed = {key: tuple((metadata.planner_data or {}).get(key, ())) for key in metadata.state_dict_metadata}
        assert listed == paths, (
            f"{directory} after {after}: the metadata lists {listed}, the save held {paths} "
            f"(missing {sorted(paths.keys() - listed.keys())}, from another save {sorted(listed.keys() - paths.keys())})"
        )
        target = build(-100.0 - step)
        call_or_skip(lambda: ops.load(target, path, process_group=group))
        assert_same_bits(target, build(step), what=f"{directory} (step {step}) loaded after {after}")

    save_and_check("model-a", "model", 1.0)
    save_and_check("optim-a", "optim", 1.0)
    save_and_check("model-b", "model", 2.0)  # the same layout, other values, another directory
    save_and_check("optim-b", "optim", 2.0)
    save_and_check("model-c", "model", 3.0, last_rank_key=True)  # one rank's layout changed
    save_and_check("model-d", "model", 4.0, changed=True)  # every rank's layout changed
    save_and_check("model-f", "model", 5.0, moved=True)  # only the nesting changed
    save_and_check("model-a", "model", 5.0)  # the first layout again, over the first checkpoint
    if dist.world_size > 1:
        # A value that differs on the last rank only (ML-9), in the layout saved before (the note
        # pickles to as many bytes): refused on every rank alike, the failed global step of the plan
        # caches' reports. An implementation that lets it through (an ML-9 deviation, which ML-9's own
        # test reports) saves it on every rank; either way the next save must be whole.
        refused = {**_job_model(dist, 6.0), "note": "step 6.1" if dist.rank == dist.world_size - 1 else "step 6.0"}
        exc = raised(lambda: ops.save(refused, dist.tmp_dir / "model-e", process_group=group))
        if any(dist.all_gather_object(exc is not None)):
            _fails_alike(dist, lambda: reraise(exc), keys=("note",), what="a save of a per-rank value between good saves")
    save_and_check("model-e", "model", 6.0)  # the save after a refused one
    for directory in last_saved:
        check(directory, after="every save")


#: The layout properties ML-30 changes one at a time between two saves of a job.
_ONE_PROPERTY = ("dtype", "shape", "nesting", "rank", "chunking")


def _one_property_state(dist: RankContext, prop: str, second: bool, step: float) -> dict[str, Any]:
    """A job's state at ``step`` in the first layout, or (``second``) in the layout that differs from
    it in ``prop`` alone: ``dtype``, the bias float64 instead of float32 (same shape); ``shape``, the
    bias of 5 elements instead of 3 (same dtype); ``nesting``, the scale out of ``layers`` under a
    top-level key of the same flat name (same tensors); ``rank``, a counter held by the last rank
    instead of rank 0 (same key, shape and dtype); ``chunking``, the weight sharded along columns
    instead of rows (same global shape and dtype)."""
    changed = second
    rows, cols = 4 * dist.world_size, 2 * dist.world_size
    weight = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * 0.5 + step
    placements = [Shard(1)] if prop == "chunking" and changed else [Shard(0)]
    bias = torch.arange(5 if prop == "shape" and changed else 3, dtype=torch.float64 if prop == "dtype" and changed else torch.float32) + step
    layer: dict[str, Any] = {"weight": dtensor_of(weight, dist.mesh(), placements), "bias": bias}
    sd: dict[str, Any] = {"layers": {"0": layer}, "note": f"step {step}"}
    scale = torch.tensor([step, -step])
    if prop == "nesting" and changed:
        sd["layers.0.scale"] = scale
    else:
        layer["scale"] = scale
    holder = dist.world_size - 1 if prop == "rank" and changed else 0
    if prop == "rank" and dist.rank == holder:
        sd["counter"] = torch.tensor([int(step) * 7])
    return sd


def _described(dist: RankContext, sd: dict[str, Any]) -> dict[str, Any]:
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


def _listed(path: Path) -> dict[str, Any]:
    """What the checkpoint's metadata lists, in the shape of :func:`_described`."""
    metadata = read_metadata(path)
    listed: dict[str, Any] = {}
    for flat, entry in metadata.state_dict_metadata.items():
        nesting = tuple((metadata.planner_data or {}).get(flat, ()))
        if isinstance(entry, TensorStorageMetadata):
            chunks = tuple(sorted({(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks}))
            listed[flat] = (nesting, str(entry.properties.dtype), tuple(entry.size), chunks)
        else:
            listed[flat] = (nesting, "bytes")
    return listed


@pytest.mark.req("ML-26", "ML-30")
@pytest.mark.rank_timeout(60)
@pytest.mark.parametrize("prop", _ONE_PROPERTY)
def test_a_save_that_changes_one_property_of_its_layout_holds_its_own(dist, impl, prop: str) -> None:
    """Two saves of a job whose layouts differ in one property only (see :func:`_one_property_state`),
    then the first layout again: after each save its metadata lists exactly that save's keys, paths,
    dtypes, global shapes and chunks (as every rank's state dict describes them), and it loads back
    strictly into a target of its own layout with its own values, bit for bit on every rank; each
    earlier checkpoint still does. A plan cache whose key ignores the changed property (the dtypes,
    say: ML-26's own case changes shape and dtype together) reuses the earlier save's metadata here."""
    if prop in ("rank", "chunking") and dist.world_size == 1:
        pytest.skip(f"at world size 1 there is no other rank to move a {prop!r} to")
    ops = checkpoint_ops(impl)
    group = group_of(dist)
    saves: list[tuple[str, bool, float]] = []

    def check(directory: str, second: bool, step: float, *, after: str) -> None:
        path = dist.tmp_dir / directory
        described, listed = _described(dist, _one_property_state(dist, prop, second, step)), _listed(path)
        if listed != described:
            differ = sorted(k for k in described.keys() | listed.keys() if described.get(k) != listed.get(k))
            fail(f"the metadata of {directory} after {after}", {k: listed.get(k) for k in differ},
                 {k: described.get(k) for k in differ}, f"{prop} changed, rank {dist.rank} of {dist.world_size}")
        target = _one_property_state(dist, prop, second, -100.0 - step)
        call_or_skip(lambda: ops.load(target, path, process_group=group))
        assert_same_bits(target, _one_property_state(dist, prop, second, step), what=f"{directory} (step {step}) loaded after {after}")

    for directory, second, step in (("first", False, 1.0), ("second", True, 2.0), ("first-again", False, 3.0)):
        ops.save(_one_property_state(dist, prop, second, step), dist.tmp_dir / directory, process_group=group)
        saves.append((directory, second, step))
        check(directory, second, step, after="its save")
    for directory, second, step in saves:
        check(directory, second, step, after="every save")


# -- ML-27 / ML-28 crafted checkpoints -----------------------------------------------------------------------------------

#: The environment variable the crafted code sets (besides creating its marker file) where it runs.
_RAN_ENV = "CONFORMANCE_CRAFTED_CODE_RAN"

#: (what is crafted, the route, who reads it). ``object``: the record of the non-tensor value ``note``
#: (asked for by every rank, or by the last only); ``tensor``: the record of the replicated tensor ``b``
#: (every rank reads it) or of the last rank's shard of ``w`` (only that rank reads it); ``metadata``:
#: the ``.metadata`` file itself (every rank reads it).
_CRAFTED = (
    [("object", route, who) for route in CODE_ROUTES + NAME_LIES for who in WHERE]
    + [("tensor", route, who) for route in ("global", "stack-global", "ext1", "duplicate-data-pkl", "other-folder") for who in WHERE]
    + [("metadata", route, "every-rank") for route in CODE_ROUTES]
)


@pytest.mark.req("ML-27", "ML-28")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("target, route, who", _CRAFTED, ids=[f"{t}-{r}-{w}" for t, r, w in _CRAFTED])
def test_a_crafted_checkpoint_runs_no_code(dist, impl, target: str, route: str, who: str) -> None:
    """A good checkpoint whose record (of a non-tensor value, or of a tensor chunk) or ``.metadata`` is
    replaced by a crafted one that would run code (create a marker file, set an environment variable)
    by one pickle route (a global, a global built on the stack, BUILD calling a ``__setstate__`` set
    on an allow-listed class, a persistent id built by a call, an extension code), or a record whose
    zip member names lie (a second ``data.pkl``, a member of another folder, a ``..`` name), read by
    every rank or by one: the load raises the same error on every rank, naming the key (or the
    metadata file) and the file, and for a code route the global it asked for (``builtins.exec``);
    the code ran on no rank; no rank's state dict has a meta entry built or a non-tensor value loaded."""
    bad_input_here(dist, who)  # skips the one-rank case at world size 1
    ops = checkpoint_ops(impl)
    group = group_of(dist)
    path = dist.tmp_dir / "ckpt"
    marker = dist.tmp_dir / "crafted-code-ran"
    os.environ.pop(_RAN_ENV, None)
    code = f"import os; open({str(marker)!r}, 'a').close(); os.environ[{_RAN_ENV!r}] = '1'"
    full = torch.randn(4 * dist.world_size, 3, generator=torch.Generator().manual_seed(7))
    saved_b = torch.arange(5.0)
    ops.save({"w": dtensor_of(full, dist.mesh(), [Shard(0)]), "b": saved_b, "step": 7, "note": "saved"}, path, process_group=group)
    dist.barrier()
    key = {"object": "note", "metadata": None, "tensor": "b" if who == "every-rank" else "w"}[target]
    if dist.rank == 0:
        if target == "metadata":
            (path / ".metadata").write_bytes(crafted_pickle(route, code))
            name = ".metadata"
        else:
            offset = (4 * (dist.world_size - 1), 0) if key == "w" else None
            name = replace_record(path, str(key), crafted_record(route, code), offset)
    name = dist.broadcast_object(name if dist.rank == 0 else None)
    sd: dict[str, Any] = {"w": dtensor_of(full.to("meta"), dist.mesh(), [Shard(0)]), "b": different_like(saved_b), "step": 0}
    if target != "object" or bad_input_here(dist, who):
        sd["note"] = ""

    def checked() -> dict[str, Any]:  # what a failed load leaves as it was (``b`` is filled in place: ML-20)
        return {k: v for k, v in sd.items() if k != "b"}

    before = snapshot(state_dict=checked())
    with extension_for_exec(route):
        exc = raised(lambda: ops.load(sd, path, process_group=group))
    ran = dist.all_gather_object((marker.exists(), os.environ.pop(_RAN_ENV, None) is not None))
    what = f"load of a checkpoint with a crafted {target} ({route})"

    def no_code_ran() -> None:
        if any(created or set_env for created, set_env in ran):
            fail(f"{what}: the crafted code ran", [f"rank {r}: marker file {c}, environment variable {e}" for r, (c, e) in enumerate(ran)],
                 "nothing from the checkpoint runs", f"rank {dist.rank}")

    needles = (name,) if route in NAME_LIES else (name, "builtins.exec")
    check_each(
        ran=no_code_ran,
        raises=lambda: _fails_alike(dist, lambda: reraise(exc), keys=(key,) if key else (), needles=needles, what=what),
        unchanged=lambda: assert_unchanged(before, state_dict=checked(), where=f"rank {dist.rank}"),
    )


# -- ML-14 / ML-15 bad checkpoints and error types ---------------------------------------------------------------------


_BAD_CHECKPOINTS = [
    ("missing-data-file", "every-rank"),
    ("missing-data-file", "one-rank"),
    ("truncated-data-file", "every-rank"),
    ("truncated-data-file", "one-rank"),
    ("missing-metadata", "every-rank"),
    ("corrupt-metadata", "every-rank"),
    ("unknown-version", "every-rank"),
]


@pytest.mark.req("ML-14")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("case, who", _BAD_CHECKPOINTS, ids=[f"{c}-{w}" for c, w in _BAD_CHECKPOINTS])
def test_bad_checkpoint_fails_fast_naming_the_file(dist, impl, case: str, who: str) -> None:
    """Damage a checkpoint (a data file every rank reads or only one rank reads, or the
    metadata); every rank's load raises the same error naming the file (or the version) within
    seconds, and every rank's state dict is unchanged."""
    bad_input_here(dist, who)  # skips the one-rank case at world size 1
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    full = torch.randn(4 * dist.world_size, 3, generator=torch.Generator().manual_seed(5))
    ops.save({"w": dtensor_of(full, dist.mesh(), [Shard(0)]), "b": torch.arange(5.0)}, path, process_group=group_of(dist))
    dist.barrier()
    needle = dist.broadcast_object(damage(dist, path, case, who) if dist.rank == 0 else None)
    target = {"w": dtensor_of(different_like(full), dist.mesh(), [Shard(0)]), "b": different_like(torch.arange(5.0))}
    before = snapshot(state_dict=target)
    start = time.monotonic()
    exc = raised(lambda: ops.load(target, path, process_group=group_of(dist)))
    elapsed = time.monotonic() - start

    def raises() -> None:
        _fails_alike(dist, lambda: reraise(exc), needles=(needle,), what=f"load of a checkpoint with a {case}")
        if elapsed >= 30:
            fail(f"{case}: the error took too long", f"{elapsed:.0f} s", "within seconds", f"rank {dist.rank}")

    check_each(raises=raises, unchanged=lambda: assert_unchanged(before, state_dict=target, where=f"rank {dist.rank}"))


@pytest.mark.req("ML-20")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("who", WHERE)
def test_failed_read_replaces_nothing(dist, impl, who: str) -> None:
    """The record of the non-tensor value ``note`` is overwritten with zeros (planning cannot see it;
    reading fails), and it is asked for by every rank, or only by the last (the others do not ask for
    it, so they read everything else successfully). Targets: a DTensor on meta and a non-tensor
    value. Every rank raises the same error naming the file and the key, and no rank's state dict has
    a meta entry or a non-tensor value replaced."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    full = torch.randn(4 * dist.world_size, 3, generator=torch.Generator().manual_seed(6))
    ops.save({"w": dtensor_of(full, dist.mesh(), [Shard(0)]), "step": 7, "note": "saved"}, path, process_group=group_of(dist))
    dist.barrier()
    if dist.rank == 0:
        name, offset, length = record_location(path, "note")
        with open(path / name, "r+b") as f:
            f.seek(offset)
            f.write(b"\0" * length)
    name = dist.broadcast_object(name if dist.rank == 0 else None)
    sd: dict[str, Any] = {"w": dtensor_of(full.to("meta"), dist.mesh(), [Shard(0)]), "step": 0}
    if bad_input_here(dist, who):
        sd["note"] = ""
    before = snapshot(state_dict=sd)
    exc = raised(lambda: ops.load(sd, path, process_group=group_of(dist)))
    check_each(
        raises=lambda: _fails_alike(dist, lambda: reraise(exc), keys=("note",), needles=(name,),
                                    what="load of a checkpoint with a corrupt record"),
        unchanged=lambda: assert_unchanged(before, state_dict=sd, where=f"rank {dist.rank}"),
    )


@pytest.mark.req("ML-15")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("failure", ["missing-key", "missing-metadata", "save-fails-on-rank-0"])
def test_errors_are_exceptions_alike_on_every_rank(dist, impl, failure: str) -> None:
    """A load of a key the checkpoint lacks, of a directory without metadata, and a save whose data
    file rank 0 cannot write: each raises an ``Exception`` (``except Exception`` catches it), the same
    type and message on every rank."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    if failure == "save-fails-on-rank-0":
        def call() -> None:
            with failing_writes(path) if dist.rank == 0 else contextlib.nullcontext():
                ops.save(sharded_values(dist, 3.0), path, process_group=group_of(dist))
    else:
        if failure == "missing-key":
            ops.save({"w": torch.ones(2)}, path, process_group=group_of(dist))
        call = lambda: ops.load({"w": torch.zeros(2), "v": torch.zeros(2)}, path, process_group=group_of(dist))  # noqa: E731
    exc = _fails_alike(dist, call, what=failure)
    if not isinstance(exc, Exception):
        fail("the error is not an Exception: `except Exception` misses it",
             f"{type(exc).__module__}.{type(exc).__qualname__} (bases {[b.__name__ for b in type(exc).__mro__[1:]]})",
             "a subclass of Exception", failure)


@pytest.mark.req("ML-14", "ML-20")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("where", ["last-rank", "every-rank"])
@pytest.mark.parametrize("how", ["vanish", "truncate"])
def test_files_that_vanish_or_shrink_during_a_load_fail_it_cleanly(dist, impl, how: str, where: str) -> None:
    """The data files of a good checkpoint vanish, or are cut short, between the load's planning and
    its reads (another job cleaning up, a copy in progress), on the last rank or on every rank: the
    load raises an ``Exception`` on every rank, naming the data file, and replaces nothing in the
    state dict (no non-tensor value is loaded; tensors filled in place may hold partial data)."""
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    ops.save(sharded_values(dist, 1.0), path, process_group=group_of(dist))
    dist.barrier()
    target = sharded_values(dist, -7.0)
    entries = dict(target)
    faulty = where == "every-rank" or dist.rank == dist.world_size - 1

    def load() -> None:
        with failing_reads(path, how) if faulty else contextlib.nullcontext():
            ops.load(target, path, process_group=group_of(dist))

    exc = _fails_alike(dist, load, what=f"a load whose data files {how}")
    if not isinstance(exc, Exception):
        fail("the error is not an Exception", type(exc).__name__, "a subclass of Exception", f"rank {dist.rank}")
    if ".distcp" not in str(exc) and "__" not in str(exc):
        fail(f"the error of a load whose data files {how}", f"{type(exc).__name__}: {exc}"[:400], "a message naming the data file", f"rank {dist.rank}")
    if target["step"] != -7 or any(target[k] is not v for k, v in entries.items()):
        fail("the state dict after a failed load", {k: type(v).__name__ for k, v in target.items()}, "the same objects, 'step' still -7", f"rank {dist.rank}")


# -- ML-23 / ML-24 a load that fails at any step ---------------------------------------------------------------------

#: The steps of a load, in order: a failure in one ends the load there.
_STEPS = ("planning", "reading", "committing")
#: The tensors of the step tests: key -> (global shape, dtype, placement on the 1-D mesh). Uneven at
#: world size 2 (``w`` 3 + 2 rows, ``b`` 1801 + 1800 elements). The two that reads fail on hold more
#: than 8 KiB per chunk, so that the middle of their data lies apart from the headers a reader may
#: check while planning (a zip record's headers sit at its start and its directory at its end).
_STEP_TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype, Any]] = {
    "w": ((5, 2048), torch.float32, Shard(0)),
    "b": ((3601,), torch.float64, Shard(0)),
    "n": ((4,), torch.int64, Replicate()),
}
#: Bytes in the middle of a chunk's data that the reading fault makes unreadable.
_UNREADABLE_BYTES = 64
#: What goes wrong, per step, on the first rank and on the last: another key on each, so that an error
#: naming only one failing rank's problem is seen. Planning: the key is asked for with another shape.
#: Reading: the bytes of the key's saved data cannot be read (EIO). Committing: the value at the key
#: refuses what was read, with the words of :data:`_REFUSALS` (on the first rank a top-level
#: ``Stateful``, after another one loaded; on the last a mapping of non-tensor values whose ``note``
#: is frozen, after its ``step`` took the loaded value).
_STEP_FAULTS: dict[str, tuple[str, str]] = {
    "planning": ("model.w", "model.b"),
    "reading": ("model.w", "model.b"),
    "committing": ("b_progress", "extra.note"),
}
_REFUSALS = ("the saved epoch is older than this run's", "the run's settings are read-only")


class _ReadOnlyEntry(dict[str, Any]):
    """Non-tensor values in a mapping with one entry that cannot be replaced, as a config object refuses
    a frozen field: ``__setitem__`` of ``frozen`` raises ``TypeError(refuse)``; other entries take
    new values."""

    def __init__(self, values: Mapping[str, Any], frozen: str, refuse: str) -> None:
        super().__init__(values)
        self.frozen, self.refuse = frozen, refuse

    def __setitem__(self, key: str, value: Any) -> None:
        if key == self.frozen:
            raise TypeError(self.refuse)
        super().__setitem__(key, value)


class _Progress:
    """A top-level ``Stateful`` (DCP's convention: saved and loaded through ``state_dict()`` and
    ``load_state_dict()``) holding non-tensor state. Its ``load_state_dict`` is collective (a barrier of
    the default group first, as one that loads through ``set_state_dict`` may be), so a loader must
    call it on every rank alike. With ``refuse``, it then raises ``ValueError(refuse)`` and changes
    nothing, as a component does when a loaded value fails its own checks."""

    def __init__(self, epoch: int, tag: str, refuse: str | None = None) -> None:
        self.epoch, self.tag, self.refuse = epoch, tag, refuse

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "tag": self.tag}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        import torch.distributed as torch_dist

        if torch_dist.is_available() and torch_dist.is_initialized():
            torch_dist.barrier()
        if self.refuse is not None:
            raise ValueError(self.refuse)
        self.epoch, self.tag = state_dict["epoch"], state_dict["tag"]


def _step_full(key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The saved full value of ``key`` (of ``shape``, for a target asking for another shape)."""
    want, dtype, _ = _STEP_TENSORS[key]
    shape = want if shape is None else shape
    return torch.arange(math.prod(shape), dtype=torch.float64).add(1.5).neg().reshape(shape).to(dtype)


def _step_state(dist: RankContext, target: str, *, saved: bool, planning: str | None = None, refusing: str | None = None) -> dict[str, Any]:
    """The state dict of the step tests, as saved (``saved=True``: tensors plain for ``target="plain"``,
    DTensors otherwise) or as a load target whose every value differs from the saved one: ``plain``
    tensors and ``dtensor`` DTensors filled in place, or ``meta`` (a meta DTensor, a meta Parameter, a
    meta tensor). Tensors are nested under ``model``, non-tensor values under ``extra``, beside two
    top-level ``Stateful`` values. ``planning`` is the key asked for with another shape; ``refusing``
    the key whose value refuses what is loaded (:data:`_STEP_FAULTS`)."""
    model: dict[str, Any] = {}
    for key, (shape, dtype, placement) in _STEP_TENSORS.items():
        if f"model.{key}" == planning:
            shape = shape[::-1] if len(shape) > 1 else (shape[0] + 1,)
        full = _step_full(key, shape)
        if saved:
            model[key] = full if target == "plain" else dtensor_of(full, dist.mesh(), [placement])
        elif target == "plain":
            model[key] = different_like(full)
        elif target == "dtensor":
            model[key] = dtensor_of(different_like(full), dist.mesh(), [placement])
        elif key == "w":
            model[key] = dtensor_of(full.to("meta"), dist.mesh(), [placement])
        elif key == "b":
            model[key] = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
        else:
            model[key] = torch.empty(shape, dtype=dtype, device="meta")
    if saved:
        return {"model": model, "extra": {"step": 7, "note": "saved"}, "a_counter": _Progress(3, "run-a"), "b_progress": _Progress(5, "run-b")}
    first, last = (_REFUSALS[i] if refusing == _STEP_FAULTS["committing"][i] else None for i in (0, 1))
    extra = {"step": 0, "note": ""}
    return {"model": model, "extra": extra if last is None else _ReadOnlyEntry(extra, "note", last), "a_counter": _Progress(0, ""),
            "b_progress": _Progress(0, "", refuse=first)}


def _skeleton(value: Any) -> Any:
    """What a load that fails after planning must leave as it was: every entry's identity, kind, dtype,
    shape, device and memory (a meta entry as it was, a DTensor's local shard over the same memory),
    every non-tensor value bit for bit, each ``Stateful``'s state; not the values of tensors filled in
    place (a failure while reading may leave them partly read)."""
    from torch.distributed.checkpoint.stateful import Stateful

    if isinstance(value, Mapping):
        return {"__type__": type(value).__name__, "items": [(k, id(v), _skeleton(v)) for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, *(_skeleton(v) for v in value)]
    if isinstance(value, DTensor):
        return ("dtensor", tuple(value.placements), tuple(value.shape), _skeleton(value.to_local()))
    if isinstance(value, torch.Tensor):
        where = value.device.type if value.device.type == "meta" else (str(value.device), value.data_ptr())
        return ("tensor", type(value).__name__, value.dtype, tuple(value.shape), value.stride(), where)
    if isinstance(value, Stateful):
        return ("stateful", type(value).__name__, exact(value.state_dict()))
    return exact(value)


@dataclass(frozen=True)
class _StepCase:
    """Which step fails on the first rank and on the last (None: that rank's load has no fault)."""

    first: str | None
    last: str | None

    @property
    def id(self) -> str:
        return f"first-{self.first or 'ok'}-last-{self.last or 'ok'}"

    def faults(self, world_size: int) -> dict[int, tuple[str, int]]:
        """rank -> (step, 0 for the first rank's fault or 1 for the last's)."""
        out: dict[int, tuple[str, int]] = {}
        if self.first is not None:
            out[0] = (self.first, 0)
        if self.last is not None:
            out[world_size - 1] = (self.last, 1)
        return out


_STEP_CASES = [_StepCase(first, last) for first in (None, *_STEPS) for last in (None, *_STEPS) if (first, last) != (None, None)]


def _unreadable_records(path: Path, fqn: str) -> dict[str, list[tuple[int, int]]]:
    """file -> the byte ranges in the middle of the saved data of every chunk of ``fqn``: far from its
    records' headers and directories, so a reader that checks those while planning plans
    successfully, and fails when it reads the data."""

    regions: dict[str, list[tuple[int, int]]] = {}
    for index, info in read_metadata(path).storage_data.items():
        if index.fqn != fqn:
            continue
        with open(path / info.relative_path, "rb", buffering=0) as file:
            start, end = storage_bytes_range(file, info.offset, info.length)
        nbytes = end - start
        middle = start + max(0, nbytes - _UNREADABLE_BYTES) // 2
        regions.setdefault(info.relative_path, []).append((middle, middle + min(nbytes, _UNREADABLE_BYTES)))
    if not regions:
        fail("test set-up: no record of the key", sorted(str(i.fqn) for i in read_metadata(path).storage_data), fqn, str(path))
    return regions


@dataclass
class _StepLoad:
    """One load of the step tests on this rank: the target, what it was before, what the load raised."""

    state: dict[str, Any]
    before: Any
    skeleton: Any
    exc: BaseException | None


def _stateful_states(state: dict[str, Any]) -> list[tuple[str, tuple[tuple[str, Any], ...]]]:
    """Each top-level ``Stateful``'s key and the items of its ``state_dict()``, as plain values."""
    return [(k, tuple(v.state_dict().items())) for k, v in state.items() if isinstance(v, _Progress)]


def _load_with_faults(dist: RankContext, ops: Any, path: Path, target: str, faults: dict[int, tuple[str, int]]) -> _StepLoad:
    """A load into a fresh ``target`` state dict with this rank's fault of ``faults``, if any."""
    step, which = faults.get(dist.rank, (None, 0))
    state = _step_state(dist, target, saved=False, planning=_STEP_FAULTS["planning"][which] if step == "planning" else None,
                        refusing=_STEP_FAULTS["committing"][which] if step == "committing" else None)
    before = snapshot(state_dict=state, stateful=_stateful_states(state))
    skeleton = _skeleton(state)
    fault: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if step == "reading":
        fault = unreadable_bytes(path, _unreadable_records(path, _STEP_FAULTS["reading"][which]))
    with fault:
        exc = raised(lambda: call_or_skip(lambda: ops.load(state, path, process_group=group_of(dist))))
    return _StepLoad(state, before, skeleton, exc)


def _names_the_failure(text: str, path: Path, step: str, which: int) -> None:
    """``text`` names what one rank's fault at ``step`` is about: the key (and, for a read, the data
    file; for a refused commit, the words of the refusal)."""
    __tracebackhide__ = True
    key = _STEP_FAULTS[step][which]
    assert_names_key(text, key, what=f"the error of a failed {step}")
    if step == "committing" and _REFUSALS[which] not in text:
        fail("the error of a refused commit lacks the refusal's own words", text[:600], _REFUSALS[which], key)
    if step == "reading":
        files = sorted(_unreadable_records(path, key))
        if not any(name in text for name in files):
            fail("the error of a failed read does not name the data file", text[:600], f"one of {files}", key)


def _most_specific_common_types(types: list[type]) -> list[type]:
    """The classes every one of ``types`` derives from that no other such class derives from."""
    common = set.intersection(*(set(t.__mro__) for t in types))
    return [c for c in common if not any(o is not c and issubclass(o, c) for o in common)]


@pytest.mark.req("ML-23", "ML-24")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("case", _STEP_CASES, ids=[c.id for c in _STEP_CASES])
@pytest.mark.parametrize("target", ["plain", "dtensor", "meta"])
def test_a_load_failing_at_any_step_replaces_nothing(dist, impl, target: str, case: _StepCase) -> None:
    """A load fails while planning (a key asked for with another shape), while reading (the middle of a
    key's saved data cannot be read: EIO, on this rank only) or while committing (on the first rank a
    top-level ``Stateful`` refuses its loaded state after another one loaded; on the last a mapping of
    non-tensor values refuses one, a frozen entry), into plain tensors, DTensors or meta values, on
    the first rank, the last, both (each with its own key) or both at different steps. Every rank
    raises the same error; it names each rank whose fault lies in the earliest failing step (its
    rank, its key, for a read its data file, for a refusal its words); with two such ranks its type
    is the most specific type both ranks' errors alone have; with a rank whose fault lies in a later
    step, it is exactly the error the earlier fault alone gives. No rank's state dict has anything
    replaced (after a planning failure, nothing changed at all) and each ``Stateful`` holds its state
    from before."""
    if case.last is not None and dist.world_size == 1 and case.first is not None:
        pytest.skip("at world size 1 the first rank is the last: the first rank's cases cover it")
    if case.first is None and dist.world_size == 1:
        pytest.skip("at world size 1 the last rank is the first: the first rank's cases cover it")
    ops = checkpoint_ops(impl)
    path = dist.tmp_dir / "ckpt"
    ops.save(_step_state(dist, target, saved=True), path, process_group=group_of(dist))
    dist.barrier()
    faults = case.faults(dist.world_size)
    earliest = min(_STEPS.index(step) for step, _ in faults.values())
    failing = {rank: fault for rank, fault in faults.items() if _STEPS.index(fault[0]) == earliest}
    alone = {}  # rank -> what the load raised here when that rank alone had its fault
    if len(failing) < len(faults) or len(failing) > 1:
        alone = {rank: _load_with_faults(dist, ops, path, target, {rank: fault}).exc for rank, fault in failing.items()}
    load = _load_with_faults(dist, ops, path, target, faults)
    exc, text = load.exc, str(load.exc)

    def names() -> None:
        if exc is None:
            fail("the load returned normally", "no error", f"an error naming the failure of ranks {sorted(failing)}", f"rank {dist.rank}")
        for rank, (step, which) in sorted(failing.items()):
            _names_the_failure(text, path, step, which)
            if dist.world_size > 1 and not re.search(rf"\brank\W{{0,2}}{rank}\b", text, re.IGNORECASE):
                fail("the error does not name a failing rank", text[:600], f"rank {rank} named", f"rank {dist.rank} of {dist.world_size}")

    def agreed_type() -> None:
        if not alone:
            return
        if any(e is None for e in alone.values()):
            fail("a load with one rank's fault alone returned normally here", {r: repr(e)[:200] for r, e in alone.items()},
                 "an error on every rank", f"rank {dist.rank}")
        if len(failing) < len(faults):  # the later step's fault was never reached
            (single,) = alone.values()
            if type(exc) is not type(single) or text != str(single):
                fail("a failure in an earlier step must end the load: the error differs from the one that fault alone gives",
                     f"{type(exc).__name__}: {text[:400]}", f"{type(single).__name__}: {str(single)[:400]}", f"rank {dist.rank}")
            return
        types = [type(e) for e in alone.values()]
        wanted = _most_specific_common_types(types)
        if type(exc) not in wanted:
            fail("the agreed error's type is not the most specific type of every failing rank's own error",
                 type(exc).__qualname__, f"one of {[t.__qualname__ for t in wanted]} (ranks alone: {[t.__qualname__ for t in types]})",
                 f"rank {dist.rank}")

    def unchanged() -> None:
        if earliest == 0:
            assert_unchanged(load.before, state_dict=load.state, stateful=_stateful_states(load.state), where=f"rank {dist.rank}, failed while planning")
        else:
            assert_same_bits(_skeleton(load.state), load.skeleton, what=f"the state dict after a load that failed while {_STEPS[earliest]} "
                              "(entries replaced, meta built, non-tensor or Stateful values loaded)")

    check_each(
        agreed=lambda: assert_same_error_on_every_rank(dist, exc, what=f"load failing ({case.id})"),
        names=names,
        type=agreed_type,
        unchanged=unchanged,
    )


# -- ML-13 a save killed at each step ------------------------------------------------------------------------------

#: (step of the save, which occurrence) a child is killed at: its first data file opened, mid-data,
#: its last writes and fsyncs (after data, before or during metadata), the publication.
KILL_POINTS = (("open", 1), ("write", 1), ("write", 6), ("fsync", 1), ("open", 2), ("fsync", 2), ("rename", 1))
#: Every write and rename of publication (ML-29), whatever the implementation names its files: a
#: metadata file just opened for writing (truncated, if written in place), torn in the middle of a write,
#: just renamed into place (before the old files' removal), and just after a file was removed.
PUBLICATION_KILL_POINTS = (("open-metadata", 1), ("write-metadata", 1), ("renamed", 1), ("removed", 1))
#: Each trial is a fresh process (a second or two): the default profile tries these, ``thorough`` all.
QUICK_KILL_POINTS = (("write", 6), ("fsync", 1), ("open", 2), ("rename", 1))


def _kill_points() -> tuple[tuple[str, int], ...]:
    from hypothesis import settings

    points = KILL_POINTS if settings.get_current_profile_name() == "thorough" else QUICK_KILL_POINTS
    return points + PUBLICATION_KILL_POINTS


#: (kill point, which rank) of the two-rank trials: the last rank as it opens its data file, mid-data
#: and after its data before the metadata; the coordinator (rank 0) at every step of publication;
#: ``thorough`` adds every kill point on each rank and on both.
QUICK_TWO_RANK_KILLS = (
    (("open", 1), "1"), (("write", 2), "1"), (("fsync", 1), "1"),
    *((point, "0") for point in PUBLICATION_KILL_POINTS),
)


def _two_rank_kills() -> tuple[tuple[tuple[str, int], str], ...]:
    from hypothesis import settings

    if settings.get_current_profile_name() == "thorough":
        return tuple((point, who) for point in KILL_POINTS + PUBLICATION_KILL_POINTS for who in ("0", "1", "all"))
    return QUICK_TWO_RANK_KILLS


@pytest.mark.req("ML-13", "ML-29")
@pytest.mark.parametrize("kill", _kill_points(), ids=[f"{op}-{n}" for op, n in _kill_points()])
@pytest.mark.parametrize("directory", ["fresh", "overwrite"])
def test_a_killed_save_leaves_one_whole_checkpoint(impl: Adapter, tmp_path: Path, directory: str, kill: tuple[str, int]) -> None:
    """A process saving a checkpoint is killed (SIGKILL: no cleanup) at a step of the save: the
    directory then holds the previous checkpoint whole (overwrite), nothing that loads (fresh), or,
    if the kill came after publication, the new one whole; never a mix. One process, no group (ML-12)."""
    check_after_kill(impl, tmp_path / "ckpt", directory, kill, world=1, killed="all")


@pytest.mark.req("ML-13", "ML-29")
@pytest.mark.parametrize("kill, killed", _two_rank_kills(), ids=[f"{op}-{n}-rank-{who}" for (op, n), who in _two_rank_kills()])
@pytest.mark.parametrize("directory", ["fresh", "overwrite"])
def test_a_save_killed_on_one_rank_of_two_leaves_one_whole_checkpoint(impl: Adapter, tmp_path: Path, directory: str, kill: tuple[str, int],
                                                                      killed: str) -> None:
    """A two-rank save (a sharded tensor: each rank writes a part) in which one rank, or both, are
    killed at a step of the save: the survivor fails or is stopped, and the directory holds the
    previous checkpoint whole, nothing that loads, or the new one whole; never a mix. Loaded in one
    process (ML-12), which reads every rank's part."""
    check_after_kill(impl, tmp_path / "ckpt", directory, kill, world=2, killed=killed)


@pytest.mark.req("ML-13")
@pytest.mark.parametrize("directory", ["fresh", "overwrite"])
def test_two_jobs_saving_to_one_directory_at_once_never_mix(impl: Adapter, tmp_path: Path, directory: str) -> None:
    """Two independent jobs (two processes, no shared group) save different values into one directory
    at the same moment: each either finishes or is refused with an error, and what loads afterwards is
    one save's values whole (or, in a fresh directory, nothing if both were refused); never a mix."""
    from conformance import crash_child
    from conformance.child_process import start_child
    from conformance.crash_child import crash_state

    ops = checkpoint_ops(impl)
    path = tmp_path / "ckpt"
    if directory == "overwrite":
        assert child_save(impl, path, 1.0) == 0
    jobs = [start_child(crash_child.main, [impl.name, str(path), str(fill)], description=f"the job saving fill {fill}") for fill in (3.0, 4.0)]
    outcomes = [(job.wait(timeout=120), job.output) for job in jobs]
    for job in jobs:
        job.close()
    finished = [fill for fill, (code, _) in zip((3.0, 4.0), outcomes) if code == 0]
    where = f"{directory} directory, exit statuses {[code for code, _ in outcomes]}"
    target = crash_state(-5.0)
    loaded = raised(lambda: ops.load(target, path))
    if loaded is not None:
        if directory == "fresh" and not finished:
            return
        fail("the directory after two concurrent saves", f"{type(loaded).__name__}: {loaded}"[:400], "one save's checkpoint, whole", where)
    candidates = [1.0, 3.0, 4.0] if directory == "overwrite" else [3.0, 4.0]
    if not any(is_same_bits(target, crash_state(fill)) for fill in candidates):
        fail("the checkpoint after two concurrent saves", {k: (v.flatten()[:3].tolist() if isinstance(v, torch.Tensor) else v) for k, v in target.items()},
             f"one save's values whole (one of fills {candidates})", where)
