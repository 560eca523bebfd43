"""The one communication layer of the sharded reference: every c10d call of :mod:`reference.fsdp`
and :mod:`reference.state_dict` goes through here.

Vocabulary. A *group* is a ``torch.distributed`` process group, or ``None`` for "no group": a trivial
axis of size 1 on which every function is a local no-op (never the default group; callers that mean
the default group pass :func:`default_group`). The *coordinator* of a group is its first rank (group
rank 0, whatever its global rank): it is the rank that ``rank0_only`` results land on and that
``broadcast_from_rank0`` sends from.

Two kinds of functions, both *collective over the group they are given* (every rank of the group calls
them, in the same order, with tensors of the same shape):

* data movement: :func:`all_gather_flat`, :func:`reduce_scatter_mean`, :func:`all_reduce_mean`,
  :func:`all_gather_objects`, :func:`broadcast_tensor`;
* agreement: :func:`agree`, :func:`gather_agreed` and :func:`broadcast_from_coordinator` run a local
  step on every rank (or on the coordinator) and exchange its *outcome*: if the step raised on any rank,
  every rank raises the same exception (type and message) instead of going on alone into a collective
  that the failing rank never reaches. Every local step that may raise before a collective is run
  through one of them.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, cast

import torch
import torch.distributed as dist

__all__ = [
    "default_group",
    "group_size",
    "group_rank",
    "is_coordinator",
    "all_gather_flat",
    "reduce_scatter_mean",
    "all_reduce_mean",
    "all_gather_objects",
    "broadcast_tensor",
    "agree",
    "gather_agreed",
    "broadcast_from_coordinator",
]

T = TypeVar("T")


# -- groups ---------------------------------------------------------------------------------------------


def default_group() -> dist.ProcessGroup | None:
    """The default process group when ``torch.distributed`` is initialized, else ``None`` (no group)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks on this axis (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank on this axis (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def is_coordinator(group: dist.ProcessGroup | None) -> bool:
    """Whether this process is the group's first rank (always, for ``None``)."""
    return group_rank(group) == 0


# -- data movement --------------------------------------------------------------------------------------


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Fill the 1-D ``out`` (``group_size * shard.numel()`` elements) with every rank's ``shard``, rank order."""
    world = group_size(group)
    # Invariant: every rank's shard has the same size (the caller's layout guarantees it).
    assert out.numel() == world * shard.numel(), f"all_gather_flat: {out.numel()} != {world} x {shard.numel()}"
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
    # Invariant: the flat parameter is padded to a multiple of the shard count.
    assert full.numel() % world == 0, f"reduce_scatter_mean: {full.numel()} elements over {world} ranks"
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


def all_reduce_any(mask: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Replace the integer ``mask`` in place by its element-wise maximum over the group (a logical or
    of 0/1 flags); returns it."""
    if group_size(group) > 1:
        dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group)
    return mask


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` for no group)."""
    world = group_size(group)
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_tensor(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Overwrite ``tensor`` in place with the coordinator's (same shape and dtype on every rank)."""
    if group_size(group) > 1:
        dist.broadcast(tensor, group=group, group_src=0)
    return tensor


# -- agreement on failure -------------------------------------------------------------------------------


class _Failure(NamedTuple):
    """What a rank sends instead of its result when its step raised."""

    kind: type[Exception]  #: the exception class (one that pickles by reference, else RuntimeError)
    message: str


def _failure(exc: Exception) -> _Failure:
    kind: type[Exception] = type(exc)
    try:
        pickle.dumps(kind)  # a class defined in a function does not travel
    except Exception:  # any pickling failure means: send the generic type
        return _Failure(RuntimeError, f"{kind.__name__}: {exc}")
    return _Failure(kind, str(exc))


def _raise_agreed(outcomes: list[Any], local: Exception | None, world: int) -> None:
    """Raise the failure of the lowest failing rank, built alike on every rank; no-op if none failed."""
    failed = [(rank, o) for rank, o in enumerate(outcomes) if isinstance(o, _Failure)]
    if not failed:
        return
    rank, failure = failed[0]
    message = failure.message
    if world > 1:
        others = f" and {len(failed) - 1} other rank(s)" if len(failed) > 1 else ""
        message = f"{message} (raised on rank {rank} of {world}{others}; every rank raises it)"
    try:
        agreed = failure.kind(message)
    except Exception:  # an exception type whose constructor takes other arguments
        agreed = RuntimeError(f"{failure.kind.__name__}: {message}")
    raise agreed from local


def gather_agreed(group: dist.ProcessGroup | None, step: Callable[[], T]) -> list[T]:
    """``step()`` on every rank; every rank's result, in rank order, if it succeeded on every rank.

    If it raised an ``Exception`` on any rank, every rank raises the error of the lowest failing rank,
    same type and message (naming that rank when the group has more than one). Collective; results
    must be picklable."""
    local: Exception | None = None
    try:
        outcome: Any = step()
    except Exception as exc:  # every failure is shared, whatever its type
        local, outcome = exc, _failure(exc)
    world = group_size(group)
    if world == 1:
        if local is not None:
            raise local
        return [outcome]
    outcomes = all_gather_objects(outcome, group)
    _raise_agreed(outcomes, local, world)
    return outcomes


def agree(group: dist.ProcessGroup | None, step: Callable[[], T]) -> T:
    """``step()`` on every rank; its local result if it succeeded on every rank, else every rank raises
    the same error (see :func:`gather_agreed`). Only the outcome travels, not the result. Collective."""
    local: Exception | None = None
    result: Any = None
    try:
        result = step()
    except Exception as exc:  # every failure is shared, whatever its type
        local = exc
    world = group_size(group)
    if world == 1:
        if local is not None:
            raise local
        return cast(T, result)
    outcomes = all_gather_objects(None if local is None else _failure(local), group)
    _raise_agreed(outcomes, local, world)
    return cast(T, result)


def broadcast_from_coordinator(group: dist.ProcessGroup | None, step: Callable[[], T]) -> T:
    """``step()`` on the coordinator only; its picklable result on every rank. If it raised there,
    every rank raises that error (same type and message). Collective."""
    if group_size(group) == 1:
        return step()
    local: Exception | None = None
    box: list[Any] = [None]
    if is_coordinator(group):
        try:
            box[0] = step()
        except Exception as exc:  # every failure is shared, whatever its type
            local, box[0] = exc, _failure(exc)
    dist.broadcast_object_list(box, group=group, group_src=0)
    _raise_agreed([box[0]], local, group_size(group))
    return cast(T, box[0])
