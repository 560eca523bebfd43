"""Staging: the snapshot an async save writes, copied from the caller's state dict (SPEC.md AS-1, AS-5).

An async save writes in the background while training goes on, so it cannot write the caller's
tensors: training changes them in place (optimizer steps), replaces them (``param.data = ...``), and
changes non-tensor values (the step counter). What is written is a *staged* copy made before the call
returns, so the checkpoint is the state at staging, whatever happens after (torchtitan #930,
pytorch/pytorch#144657, Megatron-Bridge #3267).

:class:`Stager` copies every tensor (a DTensor's local shard, with its mesh and placements) into one
buffer, an *arena*, that it keeps and reuses for the next save of the same layout, so that a training
job pays for the allocation once, not at every save (pytorch/pytorch#170163: a stager that allocated
per save grew host memory with every save). The arena is pinned on CUDA, so that device-to-host copies
run asynchronously; for a writer process it is a memory file (``memfd``) that the process maps once,
so the staged bytes reach it without a copy and one descriptor stands for all tensors (InternLM/xtuner
PR #1852 ran out of room passing one descriptor per tensor).

Reuse is what makes a stager dangerous: an arena refilled while a writer still reads it puts the next
step's values in the previous checkpoint (Megatron-LM PR #2288). So the invariant, kept by
:mod:`reference.checkpoint.async_save`, is: **a stager is refilled only after the save that read its
arena has ended** (completed or failed). One stager holds at most one staged copy.

Non-tensor values are deep-copied.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from reference.host_bytes import element_bytes

__all__ = ["Arena", "Stager", "StagedState", "ARENA_ALIGNMENT", "tensor_in"]

#: Every tensor starts at a multiple of this many bytes of the arena (any dtype's view is aligned).
ARENA_ALIGNMENT = 64

#: A path of keys and indexes from the state dict's top to a value.
_Path = tuple[Any, ...]
_ids = itertools.count()


@dataclass(eq=False)
class Arena:
    """One buffer holding a staged copy of every tensor of a layout. ``fd``: the memory file behind a
    shared arena (None otherwise), which a writer process maps."""

    id: int
    bytes: torch.Tensor  # uint8, 1-D
    fd: int | None
    pinned: bool = False  #: page-locked by :func:`_pin` (unlocked on close)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class StagedState:
    """A staged state dict, its arena, and for CUDA sources the event its copies end at (None: ready)."""

    def __init__(self, state_dict: dict[str, Any], arena: Arena | None, copies_done: torch.cuda.Event | None) -> None:
        self.state_dict = state_dict
        self.arena = arena
        self.copies_done = copies_done

    def wait(self) -> None:
        """Block until every device-to-host copy of the staging has ended."""
        if self.copies_done is not None:
            self.copies_done.synchronize()


class Stager:
    """Copies state dicts into an arena it reuses across saves of one layout (see the module docstring).

    ``shared``: the arena is a memory file a writer process can map. ``pin``: pinned host memory when
    CUDA is available (default), so that copies from the GPU run asynchronously on the current stream.
    """

    def __init__(self, *, shared: bool = False, pin: bool | None = None) -> None:
        self.shared = shared
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._arena: Arena | None = None
        self._layout: tuple[tuple[_Path, torch.Size, torch.dtype], ...] = ()

    @property
    def arena(self) -> Arena | None:
        return self._arena

    @property
    def staged_bytes(self) -> int:
        """The bytes of the arena this stager holds: the memory a staged copy costs."""
        return self._arena.bytes.numel() if self._arena is not None else 0

    def stage(self, state_dict: dict[str, Any]) -> StagedState:
        """A copy of ``state_dict`` whose tensors live in this stager's arena and whose other values are
        deep copies. Device tensors are copied on the current stream without waiting: work queued on that
        stream after this call runs after the copies; wait for :meth:`StagedState.wait` before changing
        them any other way. A state dict of another layout gets a new arena; the old one is released."""
        tensors: list[tuple[_Path, torch.Tensor]] = []
        _collect_tensors(state_dict, (), tensors)
        layout = tuple((path, value.shape, value.dtype) for path, value in tensors)
        if self._arena is None or layout != self._layout:
            self.release()
            self._arena, self._layout = self._new_arena(layout), layout
        arena = self._arena
        views: dict[_Path, torch.Tensor] = {}
        offset = 0
        device_copies = False
        for (path, value), (_, shape, dtype) in zip(tensors, layout):
            nbytes = math.prod(shape) * dtype.itemsize
            view = tensor_in(arena.bytes, offset, dtype, shape)
            device_copies |= value.device.type == "cuda"
            view.copy_(value.detach(), non_blocking=value.device.type == "cuda")
            views[path] = view
            offset = _aligned(offset + nbytes)
        staged = {key: _rebuilt(value, (key,), views) for key, value in state_dict.items()}
        done = None
        if device_copies:
            done = torch.cuda.Event()
            done.record()
        return StagedState(staged, arena, done)

    def release(self) -> None:
        """Drop the arena (its memory is freed once no staged state refers to it)."""
        if self._arena is not None:
            self._arena.close()
        self._arena, self._layout = None, ()

    def _new_arena(self, layout: tuple[tuple[_Path, torch.Size, torch.dtype], ...]) -> Arena:
        total = 0
        for _, shape, dtype in layout:
            total = _aligned(total + math.prod(shape) * dtype.itemsize)
        total = max(total, ARENA_ALIGNMENT)
        if not self.shared:
            return Arena(next(_ids), torch.empty(total, dtype=torch.uint8, pin_memory=self.pin), None)
        fd = os.memfd_create("async-save-arena", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, total)
            data = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=total, dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            raise
        return Arena(next(_ids), data, fd, pinned=self.pin and _pin(data))


def tensor_in(arena: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` over the bytes of ``arena`` (uint8) from ``offset``, whose
    storage is exactly its own bytes: the storage writer writes a tensor's whole storage (as torch.save
    does), so a plain view into the arena would be copied out of it before every write."""
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    region = element_bytes(arena[offset:offset + count * dtype.itemsize])
    return torch.frombuffer(region, dtype=dtype, count=count).view(shape)


def _collect_tensors(value: Any, path: _Path, into: list[tuple[_Path, torch.Tensor]]) -> None:
    """Every tensor of ``value`` (a DTensor as its local shard), with its path, in a fixed order."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise ValueError(f"key {_key(path)!r}: a tensor on the meta device has no values to save")
        into.append((path, value))
    elif isinstance(value, dict):
        for key, item in value.items():
            _collect_tensors(item, (*path, key), into)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _collect_tensors(item, (*path, index), into)


def _rebuilt(value: Any, path: _Path, views: dict[_Path, torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by its staged view and everything else deep-copied."""
    if isinstance(value, DTensor):
        return _dtensor_like(value, views[path])
    if isinstance(value, torch.Tensor):
        return views[path]
    if isinstance(value, dict):
        return {key: _rebuilt(item, (*path, key), views) for key, item in value.items()}
    if isinstance(value, list):
        return [_rebuilt(item, (*path, index), views) for index, item in enumerate(value)]
    if isinstance(value, tuple) and any(isinstance(item, torch.Tensor) for item in value):
        return tuple(_rebuilt(item, (*path, index), views) for index, item in enumerate(value))
    return copy.deepcopy(value)


def _dtensor_like(source: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor with ``source``'s mesh, placements and global shape over the host tensor ``local``."""
    if source.device_mesh.device_type == "cpu":
        return DTensor.from_local(
            local, source.device_mesh, source.placements, shape=source.shape, stride=source.stride(), run_check=False
        )
    # DTensor.from_local moves the local tensor to the mesh's device, which would undo the staging (a
    # host copy is what is staged); DTensor's constructor with the source's spec is the one way to keep
    # a GPU mesh's shard on the host. The planner only reads the spec and the local tensor.
    return DTensor(local, source._spec, requires_grad=False)


def _pin(data: torch.Tensor) -> bool:
    """Page-lock a shared arena for CUDA's asynchronous copies; whether it worked (if not, the copies
    are synchronous). torch pins only memory it allocates itself; cudaHostRegister through
    torch.cuda.cudart() is how DCP's stager pins shared memory too."""
    return int(torch.cuda.cudart().cudaHostRegister(data.data_ptr(), data.numel(), 0)) == 0


def _aligned(offset: int) -> int:
    return -(-offset // ARENA_ALIGNMENT) * ARENA_ALIGNMENT


def _key(path: _Path) -> str:
    return ".".join(str(part) for part in path)
