"""Every collective the reference sharded wrapper issues, in one place.

The sharding logic (:mod:`reference.sharding`) and the optimizer-state keying (:mod:`reference.optim_state`)
only call these functions, so which c10d primitive runs on which backend is decided here. All of them are
*collective over the group they are given*: every rank of that group calls them in the same order with
tensors of the same shape. A group of ``None`` means "no group" (a trivial axis of size 1), never the
default group; every function is then a local no-op.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "group_size",
    "group_rank",
    "all_gather_flat",
    "reduce_scatter_mean",
    "all_reduce_mean",
    "all_gather_objects",
    "agree",
    "raise_if_any_rank_failed",
]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks on this axis (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank on this axis (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Fill the 1-D ``out`` (``group_size * shard.numel()`` elements) with every rank's ``shard``, rank order."""
    world = group_size(group)
    if out.numel() != world * shard.numel():
        raise RuntimeError(f"all_gather_flat: output has {out.numel()} elements, expected {world} x {shard.numel()}")
    if world == 1:
        out.copy_(shard)
        return out
    # all_gather into views of one buffer works on every backend (gloo has no all_gather_into_tensor
    # on every build); the chunks of a contiguous 1-D tensor are contiguous.
    dist.all_gather(list(out.chunk(world)), shard.contiguous(), group=group)
    return out


def reduce_scatter_mean(full: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's chunk of the element-wise mean over the group of the 1-D ``full`` tensors (a new tensor).

    ``full.numel()`` must be divisible by the group size; ``full`` may be overwritten."""
    world = group_size(group)
    if world == 1:
        return full.clone()
    if full.numel() % world:
        raise RuntimeError(f"reduce_scatter_mean: {full.numel()} elements do not split over {world} ranks")
    chunk = full.numel() // world
    if dist.get_backend(group) == dist.Backend.GLOO:
        # gloo implements no reduce_scatter: all-reduce and keep our chunk (same result, more traffic).
        dist.all_reduce(full, group=group)
        out = full[group_rank(group) * chunk : (group_rank(group) + 1) * chunk].clone()
    else:
        out = torch.empty(chunk, dtype=full.dtype, device=full.device)
        dist.reduce_scatter_tensor(out, full.contiguous(), group=group)
    return out.div_(world)


def all_reduce_mean(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Replace ``tensor`` in place by its element-wise mean over the group; returns it."""
    world = group_size(group)
    if world > 1:
        dist.all_reduce(tensor, group=group)
        tensor.div_(world)
    return tensor


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` for no group)."""
    world = group_size(group)
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def agree(error: BaseException | None, value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Agree on the outcome of a local check: every rank passes what its check raised (or None) and a
    picklable ``value``; returns every rank's ``value`` in rank order.

    If any rank failed, every rank raises the error of the lowest failing rank instead (same type,
    same message), so that no rank goes on alone into a collective the others never reach, and no rank
    changes anything the failing ones leave as it was."""
    reports = all_gather_objects((None if error is None else (type(error), str(error)), value), group)
    first = next((report for report, _ in reports if report is not None), None)
    if first is None:
        return [v for _, v in reports]
    if error is not None and (type(error), str(error)) == first:
        raise error
    kind, message = first
    try:
        agreed = kind(message)
    except Exception:  # noqa: BLE001 - an exception type that does not take one message
        agreed = RuntimeError(message)
    raise agreed from error


def raise_if_any_rank_failed(error: BaseException | None, group: dist.ProcessGroup | None) -> None:
    """:func:`agree` on the outcome of a local check alone."""
    agree(error, None, group)
