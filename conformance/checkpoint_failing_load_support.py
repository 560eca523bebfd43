"""Loads that must fail and change nothing, in ``test_checkpoint.py``: a meta value no load can build
(ML-6: :class:`MarkedTensor`), the small checkpoint of the error tests and the strict loads that must
refuse a state dict asking for other keys, shapes or dtypes (ML-6, ML-10: :func:`error_checkpoint`,
:data:`MISMATCHES`), and a load that fails at any step, planning, reading or committing, on one rank or
on several (ML-23, ML-24: :func:`step_state`, :class:`StepCase`, :func:`load_with_faults`,
:func:`skeleton_of`, :func:`names_the_failure`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from conformance.asserts import assert_names_key, fail, raised, snapshot
from conformance.checkpoint_support import call_or_skip, dtensor_of, exact, group_of, no_record
from conformance.dcp_files import dcp_directory, read_metadata, storage_bytes_range
from conformance.faults import unreadable_bytes
from conformance.harness.context import RankContext
from conformance.values import different_like

__all__ = [
    "MarkedTensor",
    "error_checkpoint",
    "GOOD",
    "MISMATCHES",
    "asking_for",
    "STEPS",
    "step_state",
    "skeleton_of",
    "StepCase",
    "stateful_states",
    "load_with_faults",
    "names_the_failure",
    "most_specific_common_types",
]


# -- ML-6 unbuildable meta values ----------------------------------------------------------------------


class MarkedTensor(torch.Tensor):
    """A tensor subclass whose data lives elsewhere: allocating one like it is refused."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.empty_like, torch.zeros_like, torch.Tensor.new_empty, torch.Tensor.to):
            raise TypeError("a MarkedTensor cannot be allocated")
        return super().__torch_function__(func, types, args, kwargs or {})


def error_checkpoint() -> dict[str, torch.Tensor]:
    """The small checkpoint of the error tests: distinctive key names, values no target starts with."""
    return {"proj.weight": torch.arange(12.0).reshape(4, 3), "proj.bias": torch.tensor([0.5, -0.0])}


# -- ML-10 / ML-11 strict loading ------------------------------------------------------------------------------

_F32 = torch.float32


#: What the state dict asks for, per key: (shape, dtype). The good one matches _error_checkpoint().
GOOD = {"proj.weight": ((4, 3), _F32), "proj.bias": ((2,), _F32)}


#: mismatch -> (what the bad rank asks for, the keys the error must name, what else it must say). With
#: two keys that do not match (two shapes; a dtype, then a shape) the error names both: a load that
#: stops at the first sends its user round again for each.
MISMATCHES: dict[str, tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], tuple[str, ...], tuple[str, ...]]] = {
    "missing-key": ({**GOOD, "extra.scale": ((2,), _F32)}, ("extra.scale",), ()),
    "shape": ({**GOOD, "proj.weight": ((3, 4), _F32)}, ("proj.weight",), ("3, 4", "4, 3")),
    "two-shapes": ({"proj.weight": ((3, 4), _F32), "proj.bias": ((3,), _F32)}, ("proj.weight", "proj.bias"), ("3, 4", "4, 3")),
    "a-dtype-then-a-shape": ({"proj.weight": ((4, 3), torch.float64), "proj.bias": ((3,), _F32)}, ("proj.weight", "proj.bias"),
                             ("float64", "float32")),
    "dtype": ({**GOOD, "proj.weight": ((4, 3), torch.float64)}, ("proj.weight",), ("float64", "float32")),
}


def asking_for(spec: dict[str, tuple[tuple[int, ...], torch.dtype]], device: str) -> dict[str, torch.Tensor]:
    """A state dict of ``spec`` on ``device``; on the CPU its values differ from the checkpoint's."""
    out = {}
    for key, (shape, dtype) in spec.items():
        if device == "meta":
            out[key] = torch.empty(shape, dtype=dtype, device="meta")
        else:
            out[key] = torch.arange(math.prod(shape), dtype=torch.float64).add(0.5).neg().reshape(shape).to(dtype)
    return out


# -- ML-23 / ML-24 a load that fails at any step ---------------------------------------------------------------------

#: The steps of a load, in order: a failure in one ends the load there.
STEPS = ("planning", "reading", "committing")


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


def step_state(dist: RankContext, target: str, *, saved: bool, planning: str | None = None, refusing: str | None = None) -> dict[str, Any]:
    """The state dict of the step tests, as saved (``saved=True``: tensors plain for ``target="plain"``,
    DTensors otherwise) or as a load target whose every value differs from the saved one: ``plain``
    tensors and ``dtensor`` DTensors filled in place, or ``meta`` (a meta DTensor, a meta Parameter, a
    meta tensor). Tensors are nested under ``model``, non-tensor values under ``extra``, beside a
    top-level non-tensor value (``epoch``, as trainers keep one beside the model: the load replaces
    it in the caller's dict, so a failed load must put it back) and two top-level ``Stateful`` values.
    ``planning`` is the key asked for with another shape; ``refusing`` the key whose value refuses what
    is loaded (:data:`_STEP_FAULTS`)."""
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
        return {"model": model, "extra": {"step": 7, "note": "saved"}, "epoch": 4, "a_counter": _Progress(3, "run-a"),
                "b_progress": _Progress(5, "run-b")}
    first, last = (_REFUSALS[i] if refusing == _STEP_FAULTS["committing"][i] else None for i in (0, 1))
    extra = {"step": 0, "note": ""}
    return {"model": model, "extra": extra if last is None else _ReadOnlyEntry(extra, "note", last), "epoch": 0,
            "a_counter": _Progress(0, ""), "b_progress": _Progress(0, "", refuse=first)}


def skeleton_of(value: Any) -> Any:
    """What a load that fails after planning must leave as it was: every entry's identity, kind, dtype,
    shape, device and memory (a meta entry as it was, a DTensor's local shard over the same memory),
    every non-tensor value bit for bit, each ``Stateful``'s state; not the values of tensors filled in
    place (a failure while reading may leave them partly read)."""
    from torch.distributed.checkpoint.stateful import Stateful

    if isinstance(value, Mapping):
        return {"__type__": type(value).__name__, "items": [(k, id(v), skeleton_of(v)) for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, *(skeleton_of(v) for v in value)]
    if isinstance(value, DTensor):
        return ("dtensor", tuple(value.placements), tuple(value.shape), skeleton_of(value.to_local()))
    if isinstance(value, torch.Tensor):
        where = value.device.type if value.device.type == "meta" else (str(value.device), value.data_ptr())
        return ("tensor", type(value).__name__, value.dtype, tuple(value.shape), value.stride(), where)
    if isinstance(value, Stateful):
        return ("stateful", type(value).__name__, exact(value.state_dict()))
    return exact(value)


@dataclass(frozen=True)
class StepCase:
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


def _unreadable_records(path: Path, fqn: str) -> dict[str, list[tuple[int, int]]]:
    """file -> the byte ranges in the middle of the saved data of every chunk of ``fqn``: far from its
    records' headers and directories, so a reader that checks those while planning plans
    successfully, and fails when it reads the data."""

    regions: dict[str, list[tuple[int, int]]] = {}
    base = dcp_directory(path)
    for index, info in read_metadata(path).storage_data.items():
        if index.fqn != fqn:
            continue
        with open(base / info.relative_path, "rb", buffering=0) as file:
            start, end = storage_bytes_range(file, info.offset, info.length)
        nbytes = end - start
        middle = start + max(0, nbytes - _UNREADABLE_BYTES) // 2
        regions.setdefault(info.relative_path, []).append((middle, middle + min(nbytes, _UNREADABLE_BYTES)))
    if not regions:  # every rank reads the same metadata: every rank skips alike
        no_record(path, fqn)
    return regions


@dataclass
class _StepLoad:
    """One load of the step tests on this rank: the target, what it was before, what the load raised."""

    state: dict[str, Any]
    before: Any
    skeleton: Any
    exc: BaseException | None


def stateful_states(state: dict[str, Any]) -> list[tuple[str, tuple[tuple[str, Any], ...]]]:
    """Each top-level ``Stateful``'s key and the items of its ``state_dict()``, as plain values."""
    return [(k, tuple(v.state_dict().items())) for k, v in state.items() if isinstance(v, _Progress)]


def load_with_faults(dist: RankContext, ops: Any, path: Path, target: str, faults: dict[int, tuple[str, int]]) -> _StepLoad:
    """A load into a fresh ``target`` state dict with this rank's fault of ``faults``, if any."""
    step, which = faults.get(dist.rank, (None, 0))
    state = step_state(dist, target, saved=False, planning=_STEP_FAULTS["planning"][which] if step == "planning" else None,
                        refusing=_STEP_FAULTS["committing"][which] if step == "committing" else None)
    before = snapshot(state_dict=state, stateful=stateful_states(state))
    skeleton = skeleton_of(state)
    fault: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if step == "reading":
        fault = unreadable_bytes(path, _unreadable_records(path, _STEP_FAULTS["reading"][which]))
    with fault:
        exc = raised(lambda: call_or_skip(lambda: ops.load(state, path, process_group=group_of(dist))))
    return _StepLoad(state, before, skeleton, exc)


def names_the_failure(text: str, path: Path, step: str, which: int) -> None:
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


def most_specific_common_types(types: list[type]) -> list[type]:
    """The classes every one of ``types`` derives from that no other such class derives from."""
    common = set.intersection(*(set(t.__mro__) for t in types))
    return [c for c in common if not any(o is not c and issubclass(o, c) for o in common)]
