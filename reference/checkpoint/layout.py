"""Where each rank's piece of a tensor sits in the global tensor, and how saved pieces map onto new ones.

Vocabulary: a *chunk* is a box of the global tensor, ``offsets`` (first index per tensor dim) and
``sizes`` (extent per tensor dim). A *mesh dim* is an axis of a DeviceMesh; a *tensor dim* is a
dimension of the tensor. A plain tensor is one chunk covering the whole tensor. A DTensor's local
tensor is one chunk, computed from its placements with ``torch.chunk`` semantics: along a tensor dim
of extent ``n`` sharded over ``k`` ranks, rank ``i`` holds ``[i * c, min((i + 1) * c, n))`` with
``c = ceil(n / k)``, so the last ranks may hold short or empty pieces (sizes 5, 10, 15 over 4 ranks).
Several mesh dims sharding one tensor dim nest left to right.

Resharding is box intersection: every saved chunk that overlaps a wanted chunk yields one read of
the overlap, in the saved chunk's and in the wanted chunk's coordinates.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["Chunk", "Overlap", "local_chunk", "overlaps", "check_tiling"]


class Chunk(NamedTuple):
    """A box of a global tensor: ``offsets[d]`` is its first index along tensor dim ``d``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


class Overlap(NamedTuple):
    """The intersection of a saved chunk and a wanted chunk.

    ``saved_offsets`` index into the saved chunk, ``wanted_offsets`` into the wanted chunk (both
    relative to that chunk's own first element); ``lengths`` is the extent of the intersection."""

    saved_offsets: tuple[int, ...]
    wanted_offsets: tuple[int, ...]
    lengths: tuple[int, ...]


def local_chunk(key: str, tensor: torch.Tensor) -> Chunk | None:
    """The chunk of the global tensor that this rank holds; None for a DTensor whose mesh does not
    include this rank. Raises TypeError, naming ``key``, for placements other than Shard/Replicate
    (a Partial value must be reduced before it is saved or loaded)."""
    if not isinstance(tensor, DTensor):
        return Chunk((0,) * tensor.dim(), tuple(tensor.shape))
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    offsets = [0] * tensor.dim()
    sizes = list(tensor.shape)
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        # type() rather than isinstance(): subclasses of Shard (strided sharding) lay data out differently.
        if type(placement) is not Shard:
            raise TypeError(
                f"key {key!r}: placement {placement} on mesh dim {mesh_dim} is not supported; "
                "expected Shard(dim) or Replicate() (redistribute a Partial DTensor first)"
            )
        dim = placement.dim % tensor.dim()
        ranks, index = mesh.size(mesh_dim), coordinate[mesh_dim]
        step = -(-sizes[dim] // ranks)  # ceil: torch.chunk's piece size
        start = min(index * step, sizes[dim])
        end = min(start + step, sizes[dim])
        offsets[dim] += start
        sizes[dim] = end - start
    chunk = Chunk(tuple(offsets), tuple(sizes))
    # Invariant: the computed box has the local tensor's shape (else DTensor disagrees with torch.chunk).
    local_shape = tuple(tensor.to_local().shape)
    if chunk.sizes != local_shape:
        raise RuntimeError(
            f"key {key!r}: local tensor has shape {list(local_shape)} but placements {tensor.placements} "
            f"of global shape {list(tensor.shape)} give {list(chunk.sizes)} on mesh coordinate {coordinate}"
        )
    return chunk


def overlaps(wanted: Chunk, saved: list[Chunk]) -> list[tuple[int, Overlap]]:
    """``(index into saved, overlap)`` for each saved chunk that intersects ``wanted`` in at least
    one element. A 0-d tensor's chunks always intersect."""
    result: list[tuple[int, Overlap]] = []
    if wanted.numel == 0:
        return result
    for i, chunk in enumerate(saved):
        starts = [max(w, s) for w, s in zip(wanted.offsets, chunk.offsets)]
        ends = [
            min(w + wl, s + sl) for w, wl, s, sl in zip(wanted.offsets, wanted.sizes, chunk.offsets, chunk.sizes)
        ]
        if any(e <= b for b, e in zip(starts, ends)):
            continue
        result.append(
            (
                i,
                Overlap(
                    saved_offsets=tuple(b - s for b, s in zip(starts, chunk.offsets)),
                    wanted_offsets=tuple(b - w for b, w in zip(starts, wanted.offsets)),
                    lengths=tuple(e - b for b, e in zip(starts, ends)),
                ),
            )
        )
    return result


def check_tiling(key: str, shape: tuple[int, ...], chunks: list[Chunk]) -> str | None:
    """None if ``chunks`` cover the tensor of ``shape`` exactly once, else what is wrong (naming ``key``).

    Chunks inside the tensor whose elements add up to the tensor's tile it exactly when no two
    intersect. Any two are never compared: that is n**2 in the chunks, which at thousands of ranks was
    seconds per key. A DTensor's chunks form a grid (each sharded dim cut at the same places in every
    chunk), where two chunks intersect exactly when they are the same cell: :func:`_grid_overlap`
    checks that in n log n whatever dims are cut (a sweep along one dim alone is still n**2 when the
    chunks are cut along another, as column shards are along dim 1, issue 47). Other tilings go to
    :func:`_sweep_overlap`."""
    for chunk in chunks:
        if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape):
            return (
                f"key {key!r}: chunk at {list(chunk.offsets)} of size {list(chunk.sizes)} does not have the "
                f"{len(shape)} dims of shape {list(shape)}"
            )
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, shape)):
            return f"key {key!r}: chunk at {list(chunk.offsets)} of size {list(chunk.sizes)} lies outside shape {list(shape)}"
    nonempty = [c for c in chunks if c.numel]
    if not shape:  # a 0-d tensor: one element, which every chunk of it holds
        if len(nonempty) > 1:
            return f"key {key!r}: {len(nonempty)} chunks hold the one element of a 0-d tensor"
    else:
        is_grid, overlap = _grid_overlap(nonempty, len(shape))
        if not is_grid:
            overlap = _sweep_overlap(nonempty, len(shape))
        if overlap is not None:
            first, second = overlap
            return f"key {key!r}: chunks at {list(first.offsets)} and {list(second.offsets)} overlap"
    covered = sum(c.numel for c in nonempty)
    if covered != math.prod(shape):
        return f"key {key!r}: chunks cover {covered} of {math.prod(shape)} elements of shape {list(shape)}"
    return None


def _grid_overlap(chunks: list[Chunk], ndim: int) -> tuple[bool, tuple[Chunk, Chunk] | None]:
    """``(True, two intersecting chunks or None)`` for ``chunks`` (non-empty, inside the tensor) that
    form a grid; ``(False, None)`` when some chunk spans more than one cell of the grid cut by every
    chunk's boundaries (then the cells say nothing about overlap).

    Along each dim the boundaries are every chunk's first and end index; a chunk that starts and ends
    at consecutive boundaries in every dim is one cell of the grid, and distinct cells are disjoint.
    So chunks that are all single cells intersect exactly when two are the same cell."""
    cuts = [sorted({c.offsets[d] for c in chunks} | {c.offsets[d] + c.sizes[d] for c in chunks}) for d in range(ndim)]
    where = [{x: i for i, x in enumerate(dim_cuts)} for dim_cuts in cuts]
    cells: dict[tuple[int, ...], Chunk] = {}
    for chunk in chunks:
        cell = tuple(where[d][chunk.offsets[d]] for d in range(ndim))
        if any(where[d][chunk.offsets[d] + chunk.sizes[d]] != cell[d] + 1 for d in range(ndim)):
            return False, None
        other = cells.setdefault(cell, chunk)
        if other is not chunk:
            return True, (other, chunk)
    return True, None


def _sweep_overlap(chunks: list[Chunk], ndim: int) -> tuple[Chunk, Chunk] | None:
    """Two intersecting ``chunks``, or None: a sweep along the dim cut at the most places (sorted by
    first index there, a chunk can only intersect those still open at its first index)."""
    dim = max(range(ndim), key=lambda d: len({c.offsets[d] for c in chunks}))
    open_chunks: list[Chunk] = []
    for chunk in sorted(chunks, key=lambda c: c.offsets[dim]):
        first = chunk.offsets[dim]
        open_chunks = [c for c in open_chunks if c.offsets[dim] + c.sizes[dim] > first]
        for other in open_chunks:  # these share indices along dim with chunk: compare every dim
            if all(max(a, b) < min(a + al, b + bl) for a, al, b, bl in zip(chunk.offsets, chunk.sizes, other.offsets, other.sizes)):
                return other, chunk
        open_chunks.append(chunk)
    return None
