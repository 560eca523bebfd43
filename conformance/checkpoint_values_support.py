"""The values a checkpoint holds, as ``test_checkpoint.py`` saves and loads them: edge tensors of every
dtype, lazy views, non-tensor values of every kind and sharded DTensors on 1-D and 2-D meshes
(:func:`state_of`, :func:`mixed_state`, :class:`State` with the full value of each DTensor), and load
targets laid out like a value but differing in every bit (:func:`target_like`, :func:`meta_like`,
:func:`outside_bytes`). Used by ML-1, ML-2, ML-4, ML-5, ML-12, ML-18 and ML-19, and by ML-25's state
(``checkpoint_format_support.py``)."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from conformance.checkpoint_support import dtensor_of, mesh_2d_of
from conformance.harness.context import RankContext
from conformance.values import EDGE_DTYPES, different_like, edge_tensors, lazy_views

__all__ = [
    "target_like",
    "meta_like",
    "outside_bytes",
    "objects",
    "State",
    "state_of",
    "KINDS",
    "mixed_state",
    "large_model_state",
    "RECORD_OVERHEAD",
]


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


def target_like(value: torch.Tensor) -> torch.Tensor:
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


def meta_like(value: torch.Tensor) -> torch.Tensor:
    """A meta tensor laid out as ``value`` (shape, strides, storage offset)."""
    storage_numel = value.untyped_storage().nbytes() // value.element_size()
    return torch.empty(storage_numel, dtype=value.dtype, device="meta").as_strided(
        value.shape, value.stride(), value.storage_offset()
    )


def outside_bytes(tensor: torch.Tensor) -> torch.Tensor:
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


def objects(role: str) -> dict[str, Any]:
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
            "no_bytes": b"",  # pickle protocol 2 spells it as a call of bytes(), not as encoded text
            # One value of torch's types and pickle's together: a reader that unpickles pickle's own
            # types itself hands this one to torch.load, which must allow what it allowed alone.
            "size_and_no_bytes": (torch.Size([2, 3]), b"", b"\x00"),
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
        "no_bytes": b"\x01",
        "size_and_no_bytes": (torch.Size([0]), b"\x01", b""),
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
class State:
    """A state dict to save or load into, and the full value of each of its DTensors by path."""

    values: dict[str, Any]
    fulls: dict[tuple[Any, ...], torch.Tensor]


def state_of(dist: RankContext, kind: str, role: str, seed: int = 1) -> State:
    """The ``kind`` of state (``plain``, ``objects``, ``dtensor-1d``, ``dtensor-2d``) as saved
    (``role="saved"``), as a load target whose every value differs (``"target"``), or with every
    tensor on meta (``"meta"``). ``fulls`` are the saved full values whatever the role."""
    if kind == "plain":
        saved = {**edge_tensors(seed), **lazy_views(seed)}
        make = {"saved": lambda v: v, "target": target_like, "meta": meta_like}[role]
        return State({k: make(v) for k, v in saved.items()}, {})
    if kind in ("objects", "int-keys"):
        make_objects = objects if kind == "objects" else _int_keyed
        return State(make_objects("saved" if role == "saved" else "target"), {})
    mesh, specs = (dist.mesh(), _SPECS_1D) if kind == "dtensor-1d" else (mesh_2d_of(dist), _SPECS_2D)
    values, fulls = {}, {}
    for key, (full, placements) in _edge_sharded_fulls(specs, seed).items():
        fulls[(key,)] = full
        start = {"saved": full, "target": different_like(full), "meta": full.to("meta")}[role]
        values[key] = dtensor_of(start, mesh, placements)
    return State(values, fulls)


KINDS = ["plain", "objects", "int-keys", "dtensor-1d", "dtensor-2d"]


def mixed_state(dist: RankContext, role: str, seed: int) -> State:
    """Every kind in one nested state dict (but ``int-keys``: ML-1 checks those; ML-2 is about the format)."""
    parts = {kind: state_of(dist, kind, role, seed) for kind in KINDS if kind != "int-keys"}
    fulls = {(kind, *path): full for kind, part in parts.items() for path, full in part.fulls.items()}
    return State({kind: part.values for kind, part in parts.items()}, fulls)


#: What each entry of :func:`large_model_state` is named after: a transformer layer's parameters, each
#: with Adam's two states (the keys a trainer's optimizer state dict holds, by FQN).
_LAYER_PARAMS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm")
_LARGE_MODEL_LAYERS = 80  # a 70B Llama's


def large_model_state(dist: RankContext, offset: int) -> tuple[dict[str, Any], dict[tuple[Any, ...], torch.Tensor]]:
    """A large model's model and optimizer state as FSDP2 leaves it, 2,560 entries: every parameter and
    state a 1-D DTensor sharded over every rank (values of its own: ``offset`` plus its position), and
    a step per parameter. Also each entry's full value, by its path."""
    values: dict[str, Any] = {}
    fulls: dict[tuple[Any, ...], torch.Tensor] = {}
    mesh, length = dist.mesh(), 2 * dist.world_size
    for layer in range(_LARGE_MODEL_LAYERS):
        for name in _LAYER_PARAMS:
            fqn = f"model.layers.{layer}.{name}.weight"
            for key in (fqn, f"optim.state.{fqn}.exp_avg", f"optim.state.{fqn}.exp_avg_sq"):
                full = torch.arange(length, dtype=torch.float32) + offset + len(values)
                values[key], fulls[(key,)] = dtensor_of(full, mesh, [Shard(0)]), full
            values[f"optim.state.{fqn}.step"] = torch.tensor(float(offset + layer))
    return values, fulls


#: Bytes a record may take beyond its elements' (torch.save's zip headers: about 1.5 KiB).
RECORD_OVERHEAD = 4096
