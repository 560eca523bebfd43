"""Staging: the snapshot an async save writes, copied from the caller's state dict (SPEC.md AS-1, AS-6).

An async save writes in the background while training goes on, so it cannot write the caller's
tensors: training changes them in place (optimizer steps), replaces them (``param.data = ...``), and
changes non-tensor values (the step counter). What is written is a *staged* copy made before the call
returns, so the checkpoint is the state at staging, whatever happens after (torchtitan #930,
Megatron-Bridge #3267).

:class:`Stager` copies every tensor (a DTensor's local shard, with its mesh and placements) into a
buffer it keeps and reuses for the next save of the same layout, so that a training job pays for the
allocation once, not at every save (pinned on CUDA, so that the device-to-host copy is asynchronous;
in shared memory for a writer process, so that the process reads it without another copy). Reuse is
what makes a stager dangerous: a buffer refilled while a writer still reads it puts the next step's
values in the previous checkpoint (Megatron-LM PR #2288). So the invariant, kept by
:mod:`reference.checkpoint.async_save`, is: **a stager is refilled only after the save that read its
buffers has ended** (completed or failed). One stager holds at most one staged copy of each tensor.

Non-tensor values are deep-copied. Tensors nested in lists are staged like tensors in dicts.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["Stager", "StagedState"]

#: A path of keys and indexes from the state dict's top to a value.
_Path = tuple[Any, ...]


class StagedState:
    """A staged state dict and, for CUDA sources, the event its copies end at (``None``: ready)."""

    def __init__(self, state_dict: dict[str, Any], copies_done: torch.cuda.Event | None) -> None:
        self.state_dict = state_dict
        self.copies_done = copies_done

    def wait(self) -> None:
        """Block until every device-to-host copy of the staging has ended."""
        if self.copies_done is not None:
            self.copies_done.synchronize()


class Stager:
    """Copies state dicts into buffers it reuses across saves (see the module docstring).

    ``shared``: buffers in shared memory (for a writer process). ``pin``: pinned host buffers when CUDA
    is available (default), so that copies from the GPU run asynchronously on the current stream.
    """

    def __init__(self, *, shared: bool = False, pin: bool | None = None) -> None:
        self.shared = shared
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: dict[_Path, torch.Tensor] = {}

    @property
    def staged_bytes(self) -> int:
        """The bytes of the buffers this stager holds: the memory a staged copy costs."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    def stage(self, state_dict: dict[str, Any]) -> StagedState:
        """A copy of ``state_dict`` whose tensors live in this stager's buffers and whose other values are
        deep copies. Device tensors are copied on the current stream without waiting: work queued on that
        stream after this call runs after the copies; wait for :meth:`StagedState.wait` before changing
        them any other way. Buffers of paths the new state dict lacks are released."""
        used: set[_Path] = set()
        device_copies = False

        def copy_of(value: Any, path: _Path) -> Any:
            nonlocal device_copies
            if isinstance(value, DTensor):
                local = copy_of(value.to_local(), path)
                return _dtensor_like(value, local)
            if isinstance(value, torch.Tensor):
                if value.is_meta:
                    raise ValueError(f"key {_key(path)!r}: a tensor on the meta device has no values to save")
                used.add(path)
                buffer = self._buffer(path, value)
                device_copies |= value.device.type == "cuda"
                buffer.copy_(value.detach(), non_blocking=value.device.type == "cuda")
                return buffer
            if isinstance(value, dict):
                return {k: copy_of(v, (*path, k)) for k, v in value.items()}
            if isinstance(value, list):
                return [copy_of(v, (*path, i)) for i, v in enumerate(value)]
            if isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value):
                return tuple(copy_of(v, (*path, i)) for i, v in enumerate(value))
            return copy.deepcopy(value)

        staged = {key: copy_of(value, (key,)) for key, value in state_dict.items()}
        for path in set(self._buffers) - used:
            del self._buffers[path]
        done = None
        if device_copies:
            done = torch.cuda.Event()
            done.record()
        return StagedState(staged, done)

    def release(self) -> None:
        """Drop every buffer (shared and pinned memory is freed once no staged state refers to it)."""
        self._buffers.clear()

    def _buffer(self, path: _Path, value: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            pin = self.pin and value.device.type == "cuda" and not self.shared
            buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=pin)
            if self.shared:
                buffer.share_memory_()
            self._buffers[path] = buffer
        return buffer


def _dtensor_like(source: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor with ``source``'s mesh, placements and global shape over the host tensor ``local``."""
    if source.device_mesh.device_type == "cpu":
        return DTensor.from_local(
            local, source.device_mesh, source.placements, shape=source.shape, stride=source.stride(), run_check=False
        )
    # DTensor.from_local moves the local tensor to the mesh's device, which would undo the staging (a
    # host copy is what is staged); DTensor's constructor with the source's spec is the one way to keep
    # a GPU mesh's shard on the host. The planner only reads the spec and the local tensor.
    return DTensor(local, source._spec, requires_grad=False)  # type: ignore[call-arg]


def _key(path: _Path) -> str:
    return ".".join(str(part) for part in path)
