"""The one communication layer of the reference: every c10d call of :mod:`reference.fsdp`,
:mod:`reference.state_dict` and :mod:`reference.checkpoint` goes through here.

Vocabulary. A *group* is a ``torch.distributed`` process group, or ``None`` for "no group": a trivial
axis of size 1 on which every function is a local no-op (never the default group; callers that mean
the default group pass :func:`default_group`). A group may also be a gloo backend made directly and
never registered with ``torch.distributed`` (async saves' background groups,
:mod:`reference.checkpoint.async_save`): only calls that take it as it is are made on a group here
(its own rank and size, group-relative sources and destinations), never ones that look it up. The
*coordinator* of a group is its first rank (group rank 0, whatever its global rank): it is the rank
that ``rank0_only`` results land on and that ``broadcast_from_rank0`` sends from.

Two kinds of functions, both *collective over the group they are given* (every rank of the group calls
them, in the same order, with tensors of the same shape):

* data movement: :func:`all_gather_flat`, :func:`reduce_scatter_mean`, :func:`all_reduce_mean`,
  :func:`all_gather_objects`, :func:`broadcast_tensor`;
* agreement: :func:`agree`, :func:`gather_agreed`, :func:`broadcast_from_coordinator`,
  :func:`gather_decide_scatter` and :func:`gather_decide_broadcast` run a local step on every rank (or
  on the coordinator) and exchange its *outcome*: if the step raised on any rank, every rank raises one
  agreed exception instead of going on alone into a collective that the failing rank never reaches.
  Every local step that may raise before a collective is run through one of them.

What the agreed exception is comes from an :class:`ErrorPolicy`: how a rank's exception becomes the
:class:`Failure` record that travels, and how the failures by rank become the exception raised. The
default, :class:`LowestFailingRank`, raises the lowest failing rank's error, its own type and message;
the checkpoint's policy (:class:`reference.checkpoint.collective.CheckpointErrors`) raises one
checkpoint error naming every failing rank. On every rank that raised, its own exception is the agreed
error's ``__cause__``. In a group of one rank nothing is pickled: outcomes stay where they are.

Outcomes travel pickled, in frames of :data:`FRAME_BYTES` (see "objects over the wire" below): one
collective per exchange while they fit, where torch's object collectives make two or three. A result
that does not pickle is its rank's failure like any other, never a rank raising alone.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple, NoReturn, Protocol, TypeVar, cast

import torch
import torch.distributed as dist

from reference.host_bytes import element_bytes

__all__ = [
    "default_group",
    "group_device",
    "group_size",
    "group_rank",
    "is_coordinator",
    "all_gather_flat",
    "reduce_scatter_mean",
    "all_reduce_mean",
    "all_gather_objects",
    "broadcast_tensor",
    "FRAME_BYTES",
    "FRAMES_BUDGET",
    "MIN_FRAME_BYTES",
    "frame_bytes",
    "agree",
    "gather_agreed",
    "broadcast_from_coordinator",
    "gather_decide_scatter",
    "gather_decide_broadcast",
    "Failure",
    "ErrorPolicy",
    "LowestFailingRank",
    "LOWEST_FAILING_RANK",
]

T = TypeVar("T")
R = TypeVar("R")


# -- groups ---------------------------------------------------------------------------------------------


def default_group() -> dist.ProcessGroup | None:
    """The default process group when ``torch.distributed`` is initialized, else ``None`` (no group)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks on this axis (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank on this axis (0 for ``None``)."""
    return 0 if group is None else group.rank()


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


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device ``group`` communicates on: the CPU for gloo (and for no group, or when
    ``torch.distributed`` is not initialized), the current accelerator for nccl/xccl."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    for device_type in _accelerator_types(group):
        return torch.device(device_type, getattr(torch, device_type).current_device())
    return torch.device("cpu")


def _backends(group: dist.ProcessGroup | None) -> set[str]:
    # "nccl", "gloo", or per-device pairs such as "cpu:gloo,cuda:nccl". A backend made directly (never
    # registered, so get_backend cannot look it up) is its own one backend.
    if group is not None and not isinstance(group, dist.ProcessGroup):
        return {group.name()}
    return {part.split(":")[-1] for part in str(dist.get_backend(group)).split(",")}


def _accelerator_types(group: dist.ProcessGroup | None) -> list[str]:
    """The non-CPU device types whose default backend ``group`` runs."""
    backends = _backends(group)
    return [
        device_type
        for device_type, backend in dist.Backend.default_device_backend_map.items()
        if device_type not in ("cpu", "mps") and backend in backends
    ]


def _exchange_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the small tensors of an exchange (flags, frames) live: the CPU when the group can carry
    CPU tensors (no device synchronization), else the group's accelerator."""
    cpu_capable = not _accelerator_types(group) or bool(_backends(group) & {"gloo", "mpi"})
    return torch.device("cpu") if cpu_capable else group_device(group)


def _any_rank(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether ``flag`` is set on any rank of ``group`` (of more than one rank): one all-reduce of one
    integer."""
    mask = torch.tensor([int(flag)], dtype=torch.int32, device=_exchange_device(group))
    return bool(all_reduce_any(mask, group).item())


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, each an unpickled copy (``[obj]`` itself for no
    group or one rank). One all-gather of a frame per rank, a second only if an object outgrew it."""
    if group_size(group) == 1:
        return [obj]
    return [pickle.loads(data) for data in _all_gather_bytes(_pickled(obj), group)]


def broadcast_tensor(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Overwrite ``tensor`` in place with the coordinator's (same shape and dtype on every rank)."""
    if group_size(group) > 1:
        dist.broadcast(tensor, group=group, group_src=0)
    return tensor


# -- objects over the wire ------------------------------------------------------------------------------
#
# What an agreement costs is the latency of its collectives, not their bytes: its objects (a
# checkpoint's plans, write results and metadata) are tens of KB. Torch's object collectives send sizes
# in collectives of their own before the objects (``gather_object`` makes two collectives,
# ``scatter_object_list`` three, ``broadcast_object_list`` and ``all_gather_object`` two each). Here a
# pickle travels in a *frame* instead: a tensor of ``FRAME_BYTES`` bytes (fewer when an exchange
# carries more than 64 frames: ``frame_bytes``) holding the pickle's length and its first bytes, one
# collective for the whole exchange. A pickle longer than its frame sends the rest after it: point to
# point between the coordinator and that rank alone after a gather or a scatter (only those two know
# the length), in one more collective after a broadcast or an all-gather (every rank has read the
# length). Each function here is called with a group of more than one rank. The frames are plain bytes
# made without torch ops: a fill or a copy of 64 KiB would wake torch's intra-op threads, whose
# spinning takes the CPU from the other ranks of a machine with few cores.

#: Bytes of one frame, its header included: room for the plans of a model of some hundred tensors.
FRAME_BYTES = 64 * 1024
#: What the frames of one gather, scatter or all-gather (one frame per rank) may add up to. Up to 64
#: ranks each frame has ``FRAME_BYTES``; past that, frames shrink (down to ``MIN_FRAME_BYTES``) so that
#: an exchange of small objects among thousands of ranks stays a few MB, as torch's object collectives
#: (each object padded to the longest) keep it; a pickle that outgrows its frame sends its rest as above.
FRAMES_BUDGET = 4 * 1024 * 1024
MIN_FRAME_BYTES = 1024
_HEADER = struct.Struct("<Q")  # the length of the whole pickle, little-endian

_Payload = bytes | memoryview  # a received pickle: a view of its frame, or bytes when it had a rest


def frame_bytes(frames: int) -> int:
    """Bytes of each frame of an exchange of ``frames`` frames (a multiple of 64)."""
    return max(MIN_FRAME_BYTES, min(FRAME_BYTES, FRAMES_BUDGET // frames // 64 * 64))


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _on(buffer: bytearray, device: torch.device) -> torch.Tensor:
    """``buffer`` as a uint8 tensor on ``device`` (on the CPU a view of it: nothing copied)."""
    tensor = torch.frombuffer(buffer, dtype=torch.uint8)
    return tensor if device.type == "cpu" else tensor.to(device)


def _room(size: int) -> int:
    """Bytes of a pickle that a frame of ``size`` bytes carries itself."""
    return size - _HEADER.size


def _frame(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    """The frame of ``size`` bytes that carries ``data``'s length and its first bytes."""
    frame = bytearray(size)
    _HEADER.pack_into(frame, 0, len(data))
    head = memoryview(data)[: _room(size)]
    frame[_HEADER.size : _HEADER.size + len(head)] = head
    return _on(frame, device)


def _rest(data: bytes, size: int, device: torch.device) -> torch.Tensor | None:
    """The bytes of ``data`` past its frame of ``size`` bytes, or ``None`` if the frame holds it all."""
    room = _room(size)
    return _on(bytearray(memoryview(data)[room:]), device) if len(data) > room else None


def _empty_frames(count: int, size: int, device: torch.device) -> torch.Tensor:
    """``count`` frames of ``size`` bytes to receive into, as the rows of one buffer (``torch.empty``:
    nothing filled)."""
    return torch.empty((count, size), dtype=torch.uint8, device=device)


def _rows(frames: torch.Tensor) -> list[memoryview]:
    """The received ``frames`` (one per row) as bytes on the CPU."""
    frames = frames.cpu()
    size = frames.shape[1]
    received = element_bytes(frames)
    return [received[row * size : (row + 1) * size] for row in range(frames.shape[0])]


def _length(frame: memoryview) -> int:
    return int(_HEADER.unpack_from(frame)[0])


def _overflow(frame: memoryview) -> int:
    """Bytes of the pickle a received ``frame`` announces that it does not hold itself (0 or more)."""
    return max(0, _length(frame) - _room(len(frame)))


def _rest_buffer(frame: memoryview, device: torch.device) -> torch.Tensor | None:
    """A buffer for the bytes of the pickle ``frame`` announces that it does not hold, or ``None`` if it
    holds them all."""
    overflow = _overflow(frame)
    return torch.empty(overflow, dtype=torch.uint8, device=device) if overflow else None


def _payload(frame: memoryview, rest: torch.Tensor | None) -> _Payload:
    """The pickle that a received ``frame`` and its ``rest`` (``None`` if the frame holds it all) carry."""
    length, overflow = _length(frame), _overflow(frame)
    if not overflow:
        return frame[_HEADER.size : _HEADER.size + length]
    assert rest is not None, "a frame announced more bytes than it holds, and no rest was received"
    return bytes(frame[_HEADER.size :]) + bytes(element_bytes(rest.cpu())[:overflow])


def _send(tensor: torch.Tensor, group: dist.ProcessGroup | None, group_dst: int) -> None:
    if isinstance(group, dist.ProcessGroup):
        dist.send(tensor, group=group, group_dst=group_dst)
    else:  # a backend made directly: dist.send and dist.recv look its ranks up in torch's registry
        cast(Any, group).send([tensor], group_dst, 0).wait()


def _recv(tensor: torch.Tensor, group: dist.ProcessGroup | None, group_src: int) -> None:
    if isinstance(group, dist.ProcessGroup):
        dist.recv(tensor, group=group, group_src=group_src)
    else:
        cast(Any, group).recv([tensor], group_src, 0).wait()


def _gather_bytes(data: bytes, group: dist.ProcessGroup | None) -> list[_Payload]:
    """Every rank's ``data`` at the coordinator, in rank order, except its own (an empty slot: it sends
    nothing to itself); ``[]`` on the other ranks. One gather of frames; a rank whose data outgrew its
    frame then sends the rest to the coordinator alone."""
    device, world = _exchange_device(group), group_size(group)
    size = frame_bytes(world)
    if not is_coordinator(group):
        dist.gather(_frame(data, size, device), None, group=group, group_dst=0)
        if (rest := _rest(data, size, device)) is not None:
            _send(rest, group, 0)
        return []
    frames = _empty_frames(world, size, device)
    dist.gather(_frame(b"", size, device), list(frames.unbind(0)), group=group, group_dst=0)
    received: list[_Payload] = [b""]
    for rank, frame in enumerate(_rows(frames)[1:], start=1):
        if (rest := _rest_buffer(frame, device)) is not None:
            _recv(rest, group, rank)
        received.append(_payload(frame, rest))
    return received


def _scatter_bytes(outgoing: list[bytes] | None, group: dist.ProcessGroup | None) -> _Payload:
    """``outgoing[r]`` (given on the coordinator, one per rank; its own entry is not sent) at rank ``r``;
    the coordinator gets an empty payload. One scatter of frames; the rest of a payload that outgrew its
    frame then goes to its rank alone."""
    device, world = _exchange_device(group), group_size(group)
    size = frame_bytes(world)
    if is_coordinator(group):
        assert outgoing is not None and len(outgoing) == world
        outgoing = [b"", *outgoing[1:]]
        frames = [_frame(data, size, device) for data in outgoing]
        dist.scatter(_empty_frames(1, size, device)[0], frames, group=group, group_src=0)
        for rank, data in enumerate(outgoing):
            if (rest := _rest(data, size, device)) is not None:
                _send(rest, group, rank)
        return b""
    frame = _empty_frames(1, size, device)
    dist.scatter(frame[0], None, group=group, group_src=0)
    view = _rows(frame)[0]
    if (rest := _rest_buffer(view, device)) is not None:
        _recv(rest, group, 0)
    return _payload(view, rest)


def _broadcast_bytes(data: bytes | None, group: dist.ProcessGroup | None) -> _Payload:
    """The coordinator's ``data`` (``None`` on the other ranks) on every rank. One broadcast of a frame
    of ``FRAME_BYTES`` (every rank receives one frame, whatever the group's size), a second of the rest
    if the data outgrew it."""
    device = _exchange_device(group)
    if is_coordinator(group):
        assert data is not None
        dist.broadcast(_frame(data, FRAME_BYTES, device), group=group, group_src=0)
        if (rest := _rest(data, FRAME_BYTES, device)) is not None:
            dist.broadcast(rest, group=group, group_src=0)
        return data
    frame = _empty_frames(1, FRAME_BYTES, device)
    dist.broadcast(frame[0], group=group, group_src=0)
    view = _rows(frame)[0]
    if (rest := _rest_buffer(view, device)) is not None:
        dist.broadcast(rest, group=group, group_src=0)
    return _payload(view, rest)


def _all_gather_bytes(data: bytes, group: dist.ProcessGroup | None) -> list[_Payload]:
    """Every rank's ``data`` on every rank, in rank order. One all-gather of frames; if any rank's data
    outgrew its frame, a second of every rank's rest, padded to the longest."""
    device, world = _exchange_device(group), group_size(group)
    size = frame_bytes(world)
    frames = _empty_frames(world, size, device)
    dist.all_gather(list(frames.unbind(0)), _frame(data, size, device), group=group)
    views = _rows(frames)
    longest = max(_overflow(view) for view in views)
    if not longest:
        return [_payload(view, None) for view in views]
    rests = torch.empty((world, longest), dtype=torch.uint8, device=device)
    mine = bytearray(longest)
    tail = memoryview(data)[_room(size) :]
    mine[: len(tail)] = tail
    dist.all_gather(list(rests.unbind(0)), _on(mine, device), group=group)
    return [_payload(view, rest) for view, rest in zip(views, rests.unbind(0), strict=True)]


# -- agreement on failure -------------------------------------------------------------------------------


class Failure(NamedTuple):
    """What a rank sends instead of its result when its step raised: made by an :class:`ErrorPolicy`
    from the local exception, read back by the same policy on every rank."""

    #: the error's class as the policy sends it: the class itself (one that pickles by reference) or a
    #: name the policy resolves
    kind: type[Exception] | str
    message: str


class ErrorPolicy(Protocol):
    """How the agreement functions turn a step's exception into one error raised on every rank.

    :meth:`record` runs on the rank where the step raised and makes what travels; :meth:`error` runs on
    every rank with the same failures (by group rank, ascending) and builds the exception that rank
    raises, so that every rank raises the same type with the same message."""

    #: In a group of one rank (or no group), raise the step's own exception object unchanged instead of
    #: :meth:`error`'s.
    reraise_alone: ClassVar[bool]

    def record(self, exc: Exception) -> Failure:
        """What is sent for ``exc`` (picklable)."""
        ...

    def error(self, failures: Mapping[int, Failure], group: dist.ProcessGroup | None) -> Exception:
        """The exception every rank of ``group`` raises for ``failures`` (non-empty, by group rank)."""
        ...


class LowestFailingRank:
    """The default policy: every rank raises the error of the lowest failing rank, its own type, its
    message followed by "(raised on rank r of w[ and n other rank(s)]; every rank raises it)" when the
    group has more than one rank; a type that cannot travel (defined in a function) or whose constructor
    takes no single message becomes a ``RuntimeError`` naming it. Alone, the step's own exception."""

    reraise_alone: ClassVar[bool] = True

    def record(self, exc: Exception) -> Failure:
        kind: type[Exception] = type(exc)
        try:
            pickle.dumps(kind)  # a class defined in a function does not travel
        except Exception:  # any pickling failure means: send the generic type
            return Failure(RuntimeError, f"{kind.__name__}: {exc}")
        return Failure(kind, str(exc))

    def error(self, failures: Mapping[int, Failure], group: dist.ProcessGroup | None) -> Exception:
        rank = min(failures)
        failure = failures[rank]
        kind = cast("type[Exception]", failure.kind)  # this policy's records hold the class
        message = failure.message
        world = group_size(group)
        if world > 1:
            others = f" and {len(failures) - 1} other rank(s)" if len(failures) > 1 else ""
            message = f"{message} (raised on rank {rank} of {world}{others}; every rank raises it)"
        try:
            agreed = kind(message)
        except Exception:  # an exception type whose constructor takes other arguments
            agreed = RuntimeError(f"{kind.__name__}: {message}")
        # As if raised ``from None`` on a rank whose step did not fail: the agreed error is shown alone,
        # not as raised while handling whatever the caller was handling.
        agreed.__suppress_context__ = True
        return agreed


#: The policy of :func:`agree` and the others when none is given.
LOWEST_FAILING_RANK = LowestFailingRank()


class _Failed(NamedTuple):
    """What the coordinator sends instead of its decision when a rank failed: the failures by rank."""

    failures: dict[int, Failure]


def _raise(errors: ErrorPolicy, failures: Mapping[int, Failure], local: Exception | None,
           group: dist.ProcessGroup | None) -> NoReturn:
    """Raise the agreed error for ``failures`` (non-empty), with this rank's own exception, if one of its
    steps raised, as the ``__cause__``; in a group of one rank, under a policy that says so, that
    exception itself."""
    if local is not None and errors.reraise_alone and group_size(group) == 1:
        raise local
    error = errors.error(failures, group)
    if local is not None:
        raise error from local
    raise error


def _raise_alone(errors: ErrorPolicy, local: Exception, group: dist.ProcessGroup | None) -> NoReturn:
    """A group of one rank whose step raised ``local``: raise without exchanging anything (and without
    recording it under a policy that raises it as it is)."""
    if errors.reraise_alone:
        raise local
    _raise(errors, {0: errors.record(local)}, local, group)


def _failures(outcomes: list[Any]) -> dict[int, Failure]:
    return {rank: o for rank, o in enumerate(outcomes) if isinstance(o, Failure)}


def _outcome_bytes(outcome: Any, local: Exception | None, errors: ErrorPolicy) -> tuple[bytes, Exception | None]:
    """What this rank sends for its step: the pickled result, or the failure record of ``local``. A
    result that does not pickle is this rank's failure, so that it is reported like any other instead
    of this rank raising alone while the others wait in the exchange. Returns the bytes and this rank's
    exception, if any."""
    if local is None:
        try:
            return _pickled(outcome), None
        except Exception as exc:  # any pickling failure: the result cannot travel
            local = exc
    return _pickled(errors.record(local)), local


def _decision_bytes(decision: Any, local: Exception | None, errors: ErrorPolicy) -> tuple[bytes, Any, Exception | None]:
    """On the coordinator, what it sends for ``decision``: its pickle, or, if it does not pickle, the
    coordinator's failure instead. Returns the bytes, the decision they carry and the coordinator's
    exception, if any."""
    try:
        return _pickled(decision), decision, local
    except Exception as exc:  # any pickling failure: the decision cannot travel
        failed = _Failed({0: errors.record(exc)})
        return _pickled(failed), failed, exc


def gather_agreed(group: dist.ProcessGroup | None, step: Callable[[], T], *,
                  errors: ErrorPolicy = LOWEST_FAILING_RANK) -> list[T]:
    """``step()`` on every rank; every rank's result, in rank order, if it succeeded on every rank.

    If it raised an ``Exception`` on any rank, every rank raises the error that ``errors`` builds from
    the failures by rank (by default the lowest failing rank's, same type and message, naming that rank
    when the group has more than one: :class:`LowestFailingRank`), a failing rank with its own exception
    as the cause. Collective over ``group``: one all-gather of the outcomes (none for one rank, where
    nothing is pickled); results must be picklable."""
    local: Exception | None = None
    outcome: Any = None
    try:
        outcome = step()
    except Exception as exc:  # every failure is shared, whatever its type
        local = exc
    if group_size(group) == 1:
        if local is not None:
            _raise_alone(errors, local, group)
        return [outcome]
    data, local = _outcome_bytes(outcome, local, errors)
    outcomes = [pickle.loads(payload) for payload in _all_gather_bytes(data, group)]
    if failures := _failures(outcomes):
        _raise(errors, failures, local, group)
    return outcomes


def agree(group: dist.ProcessGroup | None, step: Callable[[], T], *, errors: ErrorPolicy = LOWEST_FAILING_RANK) -> T:
    """``step()`` on every rank; its local result if it succeeded on every rank, else every rank raises
    the agreed error (as :func:`gather_agreed`). Only the outcome travels (``None`` or a
    :class:`Failure`), not the result. Collective over ``group``: one all-reduce of a flag, and only when
    a rank failed an all-gather of the failures (nothing for one rank)."""
    local: Exception | None = None
    result: Any = None
    try:
        result = step()
    except Exception as exc:  # every failure is shared, whatever its type
        local = exc
    if group_size(group) == 1:
        if local is not None:
            _raise_alone(errors, local, group)
        return cast(T, result)
    # The common case, success everywhere, costs one small all-reduce and no pickling; every rank learns
    # from the same flag whether the failures are gathered, so all of them take part in that gather.
    if not _any_rank(local is not None, group):
        return cast(T, result)
    outcomes = all_gather_objects(None if local is None else errors.record(local), group)
    if failures := _failures(outcomes):
        _raise(errors, failures, local, group)
    return cast(T, result)


def _broadcast_outcome(group: dist.ProcessGroup | None, outcome: Any, local: Exception | None,
                       errors: ErrorPolicy) -> Any:
    """Send the coordinator's ``outcome`` (a value, or :class:`_Failed`) to every rank of ``group`` (of
    more than one rank) and return it there (the coordinator its own object), or raise the agreed error
    it carries."""
    if is_coordinator(group):
        data, outcome, local = _decision_bytes(outcome, local, errors)
        _broadcast_bytes(data, group)
    else:
        outcome = pickle.loads(_broadcast_bytes(None, group))
    if isinstance(outcome, _Failed):
        _raise(errors, outcome.failures, local, group)
    return outcome


def broadcast_from_coordinator(group: dist.ProcessGroup | None, step: Callable[[], T], *,
                               errors: ErrorPolicy = LOWEST_FAILING_RANK) -> T:
    """``step()`` on the coordinator only; its picklable result on every rank. If it raised there,
    every rank raises the agreed error (by default that error, same type and message, naming the
    coordinator as rank 0), the coordinator with its own exception as the cause. Collective over
    ``group``: one broadcast from the coordinator (none for one rank)."""
    local: Exception | None = None
    outcome: Any = None
    if is_coordinator(group):
        try:
            outcome = step()
        except Exception as exc:  # every failure is shared, whatever its type
            local = exc
    if group_size(group) == 1:
        if local is not None:
            _raise_alone(errors, local, group)
        return cast(T, outcome)
    if local is not None:
        outcome = _Failed({0: errors.record(local)})
    return cast(T, _broadcast_outcome(group, outcome, local, errors))


def _unpickled(payload: _Payload, rank: int, errors: ErrorPolicy) -> Any:
    """On the coordinator, what ``rank`` sent; if it cannot be unpickled here (a class this process
    cannot import), that rank's failure, which the coordinator's answer then carries to every rank."""
    try:
        return pickle.loads(payload)
    except Exception as exc:  # any unpickling failure: the value cannot be read here
        return errors.record(RuntimeError(f"what rank {rank} sent cannot be unpickled on the coordinator: "
                                          f"{type(exc).__name__}: {exc}"))


def _gather_and_decide(group: dist.ProcessGroup | None, local_step: Callable[[], T],
                       decide: Callable[[list[T]], R], errors: ErrorPolicy) -> tuple[Any, Exception | None]:
    """``local_step()`` on every rank, the outcomes gathered to the coordinator (rank order); there,
    unless a rank failed, ``decide`` of the results. Returns this rank's exception, if any of its steps
    raised, and on the coordinator the decision or :class:`_Failed` (on the other ranks ``None``)."""
    local: Exception | None = None
    outcome: Any = None
    try:
        outcome = local_step()
    except Exception as exc:  # every failure is shared, whatever its type
        local = exc
    if not is_coordinator(group):
        data, local = _outcome_bytes(outcome, local, errors)
        _gather_bytes(data, group)
        return None, local
    # The coordinator keeps its own outcome rather than pickling it to itself (as for one rank).
    gathered: list[Any] = [outcome if local is None else errors.record(local)]
    if group_size(group) > 1:
        for rank, payload in enumerate(_gather_bytes(b"", group)[1:], start=1):
            gathered.append(_unpickled(payload, rank, errors))
    if failures := _failures(gathered):
        return _Failed(failures), local
    try:
        return decide(gathered), local
    except Exception as exc:  # every failure is shared, whatever its type
        return _Failed({0: errors.record(exc)}), exc


def gather_decide_scatter(group: dist.ProcessGroup | None, local_step: Callable[[], T],
                          decide: Callable[[list[T]], list[R]], *, errors: ErrorPolicy = LOWEST_FAILING_RANK) -> R:
    """``local_step()`` on every rank; ``decide`` on the coordinator with every rank's result (rank
    order), returning one value per rank; each rank returns its value. If either step raised anywhere
    (``decide`` runs only if no local step raised), every rank raises the agreed error (as
    :func:`gather_agreed`; ``decide``'s failure is the coordinator's). Collective over ``group``: a
    gather to the coordinator, then a scatter from it (neither for one rank, where nothing is pickled;
    the coordinator's own result and value are never pickled, it keeps them as they are)."""
    decision, local = _gather_and_decide(group, local_step, decide, errors)
    world = group_size(group)
    if is_coordinator(group):
        outgoing = [decision] * world if isinstance(decision, _Failed) else list(decision)
        mine = outgoing[0]  # the coordinator's own value stays here, unpickled (as for one rank)
        if world > 1:
            try:
                data = [b"", *(_pickled(value) for value in outgoing[1:])]
            except Exception as exc:  # a value that does not pickle fails the decision on every rank
                local = exc
                mine = _Failed({0: errors.record(exc)})
                data = [_pickled(mine)] * world
            _scatter_bytes(data, group)
    else:
        mine = pickle.loads(_scatter_bytes(None, group))
    if isinstance(mine, _Failed):
        _raise(errors, mine.failures, local, group)
    return cast(R, mine)


def gather_decide_broadcast(group: dist.ProcessGroup | None, local_step: Callable[[], T],
                            decide: Callable[[list[T]], R], *, errors: ErrorPolicy = LOWEST_FAILING_RANK) -> R:
    """``local_step()`` on every rank; ``decide`` on the coordinator with every rank's result (rank
    order); every rank returns its value. Failures as in :func:`gather_decide_scatter`. Collective over
    ``group``: a gather to the coordinator, then a broadcast from it (neither for one rank)."""
    decision, local = _gather_and_decide(group, local_step, decide, errors)
    if group_size(group) == 1:
        if isinstance(decision, _Failed):
            _raise(errors, decision.failures, local, group)
        return cast(R, decision)
    return cast(R, _broadcast_outcome(group, decision, local, errors))
