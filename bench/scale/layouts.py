"""The layouts of large jobs: a llama-like model of about T tensors, and how N ranks hold it.

Vocabulary: a *role* is what a tensor is to the layout (``col``: a column-parallel linear weight, which
tensor parallelism shards along tensor dim 0; ``row``: a row-parallel one, sharded along dim 1;
``norm``: a norm's weight; ``embed``: the embedding and output weights; ``expert``: a MoE layer's
stacked expert weights, dim 0 the expert; ``scalar``: a 0-d tensor every rank holds whole). A *mesh
dim* is an axis of a DeviceMesh; a *tensor dim* a dimension of a tensor.

A layout says, for a world size N, the meshes (as rank tensors) and, for each role, the mesh and the
placements of its DTensors; ``None`` placements mean a plain tensor every rank holds (replicated data).
Every rank's state dict holds every key: a tensor on a mesh without the rank (another pipeline stage's)
is a DTensor of which the rank holds no piece, as DCP sees a stage's submesh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = ["TensorSpec", "Layout", "LAYOUTS", "model", "layout", "RankStateDicts"]

#: Sizes of a llama-7B-like model (the shapes only matter for bytes and for which pieces are empty).
DIM, FFN, VOCAB, EXPERTS = 4096, 11008, 32000, 64
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the model: its key, global shape, role and pipeline stage (of ``stages``)."""

    fqn: str
    shape: tuple[int, ...]
    role: str
    stage: int


def model(tensors: int, *, moe: bool = False, stages: int = 1) -> list[TensorSpec]:
    """A llama-like model of ``tensors`` tensors (at least 16): embedding, layers of 9 tensors (4
    attention weights, 3 MLP or expert weights, 2 norms), final norm and output, and 0-d scalars (an
    optimizer's ``step``s) making up the count. Layer ``i`` sits on stage ``i * stages // layers``; the
    embedding on the first, the final norm and output on the last."""
    if tensors < 16:
        raise ValueError(f"tensors: a model has at least 16 tensors (one layer and its neighbours), got {tensors}")
    layers = (tensors - 4) // 9
    specs = [TensorSpec("model.tok_embeddings.weight", (VOCAB, DIM), "embed", 0)]
    for i in range(layers):
        stage = i * stages // layers
        p = f"model.layers.{i}."
        specs += [TensorSpec(p + f"attention.{n}.weight", (DIM, DIM), "col", stage) for n in ("wq", "wk", "wv")]
        specs.append(TensorSpec(p + "attention.wo.weight", (DIM, DIM), "row", stage))
        if moe:
            specs += [TensorSpec(p + f"experts.{n}", (EXPERTS, FFN // 8, DIM), "expert", stage) for n in ("w1", "w2", "w3")]
        else:
            specs += [TensorSpec(p + f"feed_forward.{n}.weight", (FFN, DIM), "col", stage) for n in ("w1", "w3")]
            specs.append(TensorSpec(p + "feed_forward.w2.weight", (DIM, FFN), "row", stage))
        specs += [TensorSpec(p + f"{n}.weight", (DIM,), "norm", stage) for n in ("attention_norm", "ffn_norm")]
    specs.append(TensorSpec("model.norm.weight", (DIM,), "norm", stages - 1))
    specs.append(TensorSpec("model.output.weight", (VOCAB, DIM), "embed", stages - 1))
    specs += [TensorSpec(f"optim.step.{i}", (), "scalar", 0) for i in range(tensors - len(specs))]
    return specs


#: The non-tensor state every rank saves alike (a trainer's counters, a sampler's state).
TRAIN_STATE: dict[str, Any] = {"step": 1000, "epoch": 3, "sampler": {"seed": 0, "offset": 123456}, "lr": [3e-4, 3e-4]}


@dataclass(frozen=True)
class Layout:
    """How N ranks hold the model: ``meshes(N)`` are the meshes' rank tensors; ``placements[role]`` is
    ``(mesh index, placements)``, the mesh index taken from the tensor's stage when ``per_stage``;
    ``None`` for a plain tensor on every rank. ``moe`` and ``stages`` shape the model."""

    name: str
    meshes: Callable[[int], list[torch.Tensor]]
    placements: dict[str, tuple[int, tuple[Placement, ...]] | None]
    min_world_size: int = 1
    moe: bool = False
    stages: int = 1
    per_stage: bool = False
    doc: str = ""

    def model(self, tensors: int) -> list[TensorSpec]:
        return model(tensors, moe=self.moe, stages=self.stages)


S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()
#: Tensor-parallel degree, HSDP shard-group size (at most), PP stages and EP degree of the layouts.
TP, HSDP_SHARD, PP, EP = 8, 64, 4, 8


def _one_dim(n: int) -> list[torch.Tensor]:
    return [torch.arange(n)]


def _dp_tp(n: int) -> list[torch.Tensor]:
    return [torch.arange(n).view(n // TP, TP)]


def _hsdp(n: int) -> list[torch.Tensor]:
    shard = min(n, HSDP_SHARD)
    return [torch.arange(n).view(n // shard, shard)]


def _pp_dp_tp(n: int) -> list[torch.Tensor]:
    per = n // PP
    return [torch.arange(s * per, (s + 1) * per).view(per // TP, TP) for s in range(PP)]


def _dp_ep(n: int) -> list[torch.Tensor]:
    return [torch.arange(n).view(n // EP, EP)]


_FSDP_TP: dict[str, tuple[int, tuple[Placement, ...]] | None] = {
    # A grid: FSDP cuts the dim TP does not (no strided sharding of one dim by two mesh dims).
    "col": (0, (S1, S0)), "row": (0, (S0, S1)), "embed": (0, (S1, S0)), "norm": (0, (S0, R)), "scalar": None,
}

LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in [
    Layout("fsdp", _one_dim, {"col": (0, (S0,)), "row": (0, (S0,)), "embed": (0, (S0,)), "norm": (0, (S0,)), "scalar": None},
           doc="FSDP2 over all ranks: every weight Shard(0) (row shards), 0-d scalars replicated"),
    Layout("tp", _one_dim, {"col": (0, (S0,)), "row": (0, (S1,)), "embed": (0, (S0,)), "norm": (0, (R,)), "scalar": None},
           doc="tensor parallel over all ranks: column-parallel weights Shard(0), row-parallel Shard(1), norms Replicate()"),
    Layout("fsdp-tp", _dp_tp, _FSDP_TP, min_world_size=2 * TP,
           doc=f"2-D (dp, tp={TP}): FSDP on the dim TP leaves whole, norms sharded by dp and replicated by tp"),
    Layout("hsdp", _hsdp, {"col": (0, (R, S0)), "row": (0, (R, S0)), "embed": (0, (R, S0)), "norm": (0, (R, S0)), "scalar": None},
           doc=f"2-D HSDP (replicate, shard={HSDP_SHARD}): Shard(0) within a group, replicated across groups"),
    Layout("3d", _pp_dp_tp, _FSDP_TP, min_world_size=2 * TP * PP, stages=PP, per_stage=True,
           doc=f"3-D (pp={PP}, dp, tp={TP}): each stage's tensors on its stage's mesh; other stages' ranks hold no piece"),
    Layout("moe", _dp_ep, {"col": (0, (S0, R)), "row": (0, (S0, R)), "embed": (0, (S0, R)), "norm": (0, (R, R)),
                           "expert": (0, (S1, S0)), "scalar": None}, min_world_size=2 * EP, moe=True,
           doc=f"MoE (dp, ep={EP}): {EXPERTS} experts Shard(0) over ep and FSDP on dim 1; dense weights FSDP over dp, replicated over ep"),
    Layout("replicated", _one_dim, {"col": None, "row": None, "embed": None, "norm": None, "scalar": None},
           doc="DDP: every tensor a plain tensor held whole by every rank (replicated data only)"),
]}


def layout(name: str) -> Layout:
    """The layout ``name``; a ``ValueError`` naming the known ones otherwise."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"layout {name!r}: not one of {', '.join(LAYOUTS)}") from None


def _piece(size: int, ranks: int, index: int) -> tuple[int, int]:
    """``(offset, length)`` of piece ``index`` of ``size`` cut into ``ranks`` by ``torch.chunk``'s rule."""
    step = -(-size // ranks)
    start = min(index * step, size)
    return start, min(step, size - start)


class RankStateDicts:
    """Each simulated rank's state dict for one layout at world size ``world_size``.

    ``state_dict(rank)`` is rank ``rank``'s: ``{"model": {fqn: DTensor or tensor}, "train": {...}}``.
    DTensors hold a zero-stride view of one element as their local tensor (planning reads shapes, never
    values); their mesh is rank ``rank``'s view of it. Build one rank at a time and drop it: 16,384 of
    them at once would not fit."""

    def __init__(self, layout: Layout, world_size: int, tensors: int) -> None:
        if world_size < layout.min_world_size:
            raise ValueError(f"layout {layout.name!r} needs at least {layout.min_world_size} ranks, got {world_size}")
        self.layout, self.world_size = layout, world_size
        self.specs = layout.model(tensors)
        self.mesh_ranks = layout.meshes(world_size)
        self._one = torch.zeros((), dtype=DTYPE)  # every local tensor is a zero-stride view of it

    def state_dict(self, rank: int) -> dict[str, Any]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        meshes = [DeviceMesh("cpu", ranks, _init_backend=False, _rank=rank) for ranks in self.mesh_ranks]
        model_sd: dict[str, torch.Tensor] = {}
        specs: dict[Any, DTensorSpec] = {}
        for spec in self.specs:
            how = self.layout.placements.get(spec.role)
            if how is None:
                model_sd[spec.fqn] = self._one.expand(spec.shape)
                continue
            mesh_index, placements = how
            mesh = meshes[spec.stage if self.layout.per_stage else mesh_index]
            model_sd[spec.fqn] = self._dtensor(mesh, placements, spec.shape, specs)
        return {"model": model_sd, "train": dict(TRAIN_STATE)}

    def _dtensor(self, mesh: DeviceMesh, placements: tuple[Placement, ...], shape: tuple[int, ...],
                 specs: dict[Any, DTensorSpec]) -> DTensor:
        key = (id(mesh), placements, shape)
        dspec = specs.get(key)
        if dspec is None:
            stride = _contiguous_stride(shape)
            dspec = DTensorSpec(mesh, placements, TensorMeta(torch.Size(shape), stride, DTYPE))
            specs[key] = dspec
        coordinate = mesh.get_coordinate()
        if coordinate is None:  # another stage's tensor: this rank holds no piece of it
            local = self._one.expand((0,) * len(shape))
        else:
            local_shape = list(shape)
            for mesh_dim, placement in enumerate(placements):
                if isinstance(placement, Shard):
                    local_shape[placement.dim] = _piece(local_shape[placement.dim], mesh.size(mesh_dim), coordinate[mesh_dim])[1]
            local = self._one.expand(local_shape)
        return DTensor(local, dspec, requires_grad=False)


@functools.cache
def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))
