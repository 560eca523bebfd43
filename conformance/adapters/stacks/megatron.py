"""megatron-core's ``dist_checkpointing`` (``megatron.core.dist_checkpointing.save``/``load``, backend
``torch_dist``) under the ML and AS requirements.

What is mapped to what (details in docs/stacks/megatron-core.md):

- A state dict of the protocol becomes megatron's *sharded state dict*: every tensor leaf becomes a
  ``ShardedTensor`` keyed by its dotted path (DCP's flattened key). A DTensor's local shard is described by
  its global shape and offset (``compute_local_shape_and_global_offset``) and its ``replica_id`` is its
  coordinate along the mesh dims that replicate it; a regular grid (``axis_fragmentations``) is declared
  when every sharded dim splits evenly, none (megatron's "uneven sharding", validated by DCP) otherwise.
  A plain tensor is a one-chunk ``ShardedTensor`` whose main replica is the lowest rank holding the key
  (megatron needs exactly one main replica per chunk; the adapter learns the holders with one
  ``all_gather_object``). Every other value stays where it is: megatron saves it as its *common state*
  (rank 0's copy, pickled into one ``common_state`` record).
- ``load`` asks megatron for the same sharded state dict, with the caller's tensors as the ``data`` to
  load into (a meta tensor or DTensor of plain type is passed as ``data=None``, which megatron allocates;
  a DTensor is rebuilt around it with its mesh and placements), and puts what megatron returns into the
  caller's state dict: tensors copied in place when megatron did not load into them, meta entries and
  non-tensor values replaced. Options: ``strict`` and ``allow_unexpected`` are megatron's
  ``StrictHandling`` (``RAISE_UNEXPECTED``, ``RAISE_ALL``, ``LOG_UNEXPECTED``; megatron's "unexpected" is
  a key asked for but not in the checkpoint, its "missing" one in the checkpoint nobody asked for).
  ``strict=False`` with ``allow_unexpected=False`` has no ``StrictHandling`` value: ``Unsupported``.
- Sharded models: megatron's own sharding (Megatron-FSDP, ``DistributedOptimizer``) needs CUDA streams
  and devices (``torch.cuda.Stream()``, ``torch.cuda.current_device()`` at construction), so on CPU
  ranks the adapter shards with torch's ``fully_shard`` (``TorchFSDP2ShardingOps``) and takes its
  DTensor state dicts from ``torch.distributed.checkpoint.state_dict``: what is judged is megatron's
  checkpoint layer saving and loading them.
- Async saves: ``save(..., async_sharded_save=True, async_strategy="mcore")`` returns megatron's
  ``AsyncRequest``, scheduled on an ``AsyncCallsQueue(persistent=False)``: its ``TemporalAsyncCaller``
  forks one writer process per save (the ``process`` executor; megatron has no thread executor, and its
  persistent caller's worker calls ``torch.cuda.set_device`` and cannot start on CPU). The staging future
  resolves when the request is scheduled (the fork is the copy of the state); the completion future is
  resolved by megatron's finalization, ``maybe_finalize_async_calls``, which is collective and is run by
  the future's ``done``/``result``/``exception`` in the calling thread, as a trainer calls it every step
  (so every rank must ask it alike, as the suite does). A second save first finalizes the one in flight
  (``blocking=True``): ``concurrent_saves = "wait"``.

The CPU shim. On its synchronous save path megatron calls CUDA where nothing is on a GPU:
``preload_tensors`` calls ``torch.cuda.synchronize()`` after its device-to-host copies, and
``save_state_dict_async_finalize`` / ``AsyncCaller.sync_all_async_calls`` /
``AsyncCallsQueue.maybe_finalize_async_calls`` build their one-element flag tensors for ``broadcast`` /
``all_reduce`` on ``torch.cuda.current_device()``. On a CPU-only torch each raises "Torch not compiled
with CUDA enabled". The adapter replaces the name ``torch`` inside exactly three megatron modules
(``strategies.filesystem_async``, ``strategies.state_dict_saver``, ``strategies.async_utils``) by a proxy
that forwards everything to torch except ``torch.cuda.synchronize`` and ``torch.cuda.current_device``,
and those only while this process's default group is gloo (a CPU rank): ``synchronize`` is then a no-op
(no kernel was launched) and ``current_device`` answers ``"cpu"`` (the flag tensors go where gloo
reduces them). Every other CUDA call, and both of these on an nccl rank, reach torch unchanged. The
shim changes where megatron's bookkeeping flags live, never what is saved, loaded or decided.

Processes: megatron's ``FileSystemWriterAsync`` starts a ``multiprocessing`` ``Manager`` (a server
process, spawned) the first time a process saves data, keeps it in a module global for the process's
life and never shuts it down; each rank process that saved holds one. The adapter does not stop it (that
would hide it): ``shutdown`` of the async ops releases what the adapter's queue holds only.

Module-level ``PIP_INSTALLS`` and ``ENVIRONMENT`` tell ``make stacks`` how to build and run this stack's
venv. This module imports without megatron: the stack is imported inside the capability methods.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn as nn

from conformance.adapters.base import Adapter, Unsupported

if TYPE_CHECKING:
    from conformance.adapters.async_checkpoint import AsyncCheckpointOps, AsyncSave
    from conformance.adapters.checkpoint import CheckpointOps
    from conformance.adapters.sharding import ShardingOps

__all__ = ["ENVIRONMENT", "PIP_INSTALLS", "MegatronCoreAdapter", "MegatronCheckpointOps", "MegatronAsyncCheckpointOps"]

#: pip argument lists, run in order in a venv that already has the pinned torch and this project.
#: megatron-core 0.19.2 declares Requires-Python >=3.12 although its wheel is built for cp311, and
#: declares neither triton (``import megatron.core`` imports it; 3.7.1 is torch 2.13's pin) nor psutil
#: (a save imports it); packaging is its one declared dependency that torch does not bring.
PIP_INSTALLS: tuple[tuple[str, ...], ...] = (
    ("--ignore-requires-python", "--no-deps", "megatron-core==0.19.2"),
    ("packaging==26.3", "triton==3.7.1", "psutil==7.2.2"),
)

#: environment variables the suite runs this stack under. None is needed: the CPU shim is in this
#: module, and megatron's async save is driven explicitly with ``async_strategy="mcore"``.
ENVIRONMENT: dict[str, str] = {}

#: The megatron modules whose ``torch`` name the CPU shim replaces (see the module docstring).
_SHIMMED_MODULES = (
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
)


def _import_megatron() -> Any:
    """``megatron.core.dist_checkpointing`` with the CPU shim installed, or :class:`Unsupported`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its import warns about optional packages (absl, TE, ...)
            from megatron.core import dist_checkpointing
    except ImportError as exc:
        raise Unsupported(f"megatron-core is not installed: {exc}") from exc
    _install_cpu_shim()
    # Its deprecation notice for the "mcore" async strategy is logged on every save; it is not a result.
    logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").setLevel(logging.ERROR)
    return dist_checkpointing


def _on_cpu_rank() -> bool:
    """True in a process whose default group is gloo (the ranks the shim is for), or without CUDA."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_backend() == "gloo"
    return not torch.cuda.is_available()


class _CudaOnCpuRanks:
    """``torch.cuda`` as megatron's shimmed modules see it: two calls answered for CPU ranks."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        # No kernel runs on a CPU rank: there is nothing to wait for.
        if not _on_cpu_rank():
            torch.cuda.synchronize(device)

    @staticmethod
    def current_device() -> Any:
        # Megatron puts its collective flag tensors here; gloo reduces CPU tensors.
        return "cpu" if _on_cpu_rank() else torch.cuda.current_device()


class _TorchOnCpuRanks:
    """``torch`` for the shimmed modules: everything is torch's except ``cuda``."""

    cuda = _CudaOnCpuRanks()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _install_cpu_shim() -> None:
    """Point the name ``torch`` of :data:`_SHIMMED_MODULES` at :class:`_TorchOnCpuRanks` (idempotent)."""
    for name in _SHIMMED_MODULES:
        module = importlib.import_module(name)
        if not isinstance(getattr(module, "torch", None), _TorchOnCpuRanks):
            setattr(module, "torch", _TorchOnCpuRanks())  # noqa: B010 - the module's global, not an attribute of ours


# -- state dict <-> megatron's sharded state dict --------------------------------------------------


def _has_tensor(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_tensor(item) for item in value.values())
    if isinstance(value, list):
        return any(_has_tensor(item) for item in value)
    return isinstance(value, torch.Tensor)


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every (path, leaf) of nested dicts and lists that hold tensors; a tensor, and a dict or list
    holding none, is a leaf (a non-tensor value is replaced whole by a load, as DCP does)."""
    if not _has_tensor(value) and path:
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, (*path, index))
    else:
        yield path, value


def _key(path: tuple[Any, ...]) -> str:
    """The checkpoint key of a leaf: DCP's flattened FQN."""
    return ".".join(str(part) for part in path)


def _replace_leaves(value: Any, convert: Callable[[tuple[Any, ...], Any], Any], path: tuple[Any, ...] = ()) -> Any:
    """A copy of the nesting of ``value`` with every leaf replaced by ``convert(path, leaf)``."""
    if isinstance(value, dict):
        return {key: _replace_leaves(item, convert, (*path, key)) for key, item in value.items()}
    if isinstance(value, list):
        return [_replace_leaves(item, convert, (*path, index)) for index, item in enumerate(value)]
    return convert(path, value)


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        value = value[part]
    return value


def _set(value: Any, path: tuple[Any, ...], leaf: Any) -> None:
    for part in path[:-1]:
        value = value[part]
    value[path[-1]] = leaf


def _main_holders(state_dict: dict[str, Any]) -> dict[str, int]:
    """Plain-tensor key -> the lowest rank holding it (its main replica). Collective."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    mine = [_key(path) for path, leaf in _leaves(state_dict) if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor)]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    holders: dict[str, int] = {}
    for rank, keys in enumerate(every):
        for key in keys:
            holders.setdefault(key, rank)
    return holders


def _is_meta(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).device.type == "meta"


def _sharded_tensor(key: str, tensor: torch.Tensor, main_rank: int, *, loading: bool) -> Any:
    """The ``ShardedTensor`` of one tensor leaf (see the module docstring)."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import ShardedTensor
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    # A meta tensor of plain type is allocated by megatron (data=None); a tensor subclass is handed over
    # as it is, for megatron to do with it what it does.
    plain_meta = loading and _is_meta(tensor) and type(tensor) in (torch.Tensor, nn.Parameter, DTensor)
    if isinstance(tensor, DTensor):
        mesh, placements = tensor.device_mesh, tensor.placements
        if any(not isinstance(p, (Shard, Replicate)) for p in placements) or any(type(p) is not Shard for p in placements if isinstance(p, Shard)):
            raise Unsupported(f"{key}: a DTensor placed {placements} has no contiguous chunk per rank for a megatron ShardedTensor")
        global_shape = tuple(tensor.shape)
        local_shape, global_offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
        coordinate = mesh.get_coordinate() or [0] * mesh.ndim
        replica = tuple(coordinate[dim] for dim, p in enumerate(placements) if isinstance(p, Replicate))
        fragments = [1] * len(global_shape)
        for dim, p in enumerate(placements):
            if isinstance(p, Shard):
                fragments[p.dim] *= mesh.size(dim)
        regular = all(size % parts == 0 and (parts == 1 or size >= parts) for size, parts in zip(global_shape, fragments))
        local = tensor.to_local()
        return ShardedTensor(
            key, None if plain_meta else local, tensor.dtype, tuple(local_shape), global_shape, tuple(global_offset),
            tuple(fragments) if regular else None, replica_id=replica or 0,
        )
    plain_replica = 0 if dist.get_rank() == main_rank else dist.get_rank() + 1
    shape = tuple(tensor.shape)
    return ShardedTensor(key, None if plain_meta else tensor, tensor.dtype, shape, shape, (0,) * len(shape),
                         (1,) * len(shape), replica_id=plain_replica)


def _to_sharded(state_dict: dict[str, Any], *, loading: bool) -> dict[str, Any]:
    """Megatron's sharded state dict of ``state_dict`` (a new nesting; the tensors are the caller's)."""
    holders = _main_holders(state_dict)

    def convert(path: tuple[Any, ...], leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            key = _key(path)
            return _sharded_tensor(key, leaf, holders.get(key, 0), loading=loading)
        return leaf

    return _replace_leaves(state_dict, convert)


def _strict_handling(strict: bool, allow_unexpected: bool) -> Any:
    """The protocol's load options as megatron's ``StrictHandling``."""
    from megatron.core.dist_checkpointing.validation import StrictHandling

    if strict:
        # Megatron's "unexpected": asked for but not in the checkpoint; its "missing": the converse.
        return StrictHandling.RAISE_UNEXPECTED if allow_unexpected else StrictHandling.RAISE_ALL
    if allow_unexpected:
        return StrictHandling.LOG_UNEXPECTED
    raise Unsupported("megatron-core's StrictHandling has no mode that skips keys missing from the checkpoint "
                      "and refuses checkpoint keys nobody asked for (RAISE_ALL raises on both)")


def _require_default_group(process_group: Any, op: str) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise Unsupported(f"megatron-core's dist_checkpointing.{op} needs an initialized default process group "
                          "(it calls torch.distributed.get_rank() and collectives on the default group)")
    if process_group is not None and dist.get_world_size(process_group) != dist.get_world_size():
        raise Unsupported(f"megatron-core's dist_checkpointing.{op} saves and plans over the default group only")


class MegatronCheckpointOps:
    """``megatron.core.dist_checkpointing.save``/``load`` (backend ``torch_dist``) of the protocol's state
    dicts; sharded models through torch's ``fully_shard`` state dicts (module docstring)."""

    name = "megatron-core"

    def __init__(self) -> None:
        self._dc = _import_megatron()

    def save(self, state_dict: dict[str, Any], checkpoint_id: str | os.PathLike[str], *, process_group: Any = None) -> None:
        """``dist_checkpointing.save`` of ``state_dict`` into the directory ``checkpoint_id`` (created first:
        megatron lists it and does not create it)."""
        _require_default_group(process_group, "save")
        os.makedirs(checkpoint_id, exist_ok=True)
        self._dc.save(_to_sharded(state_dict, loading=False), str(checkpoint_id))

    def load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str | os.PathLike[str],
        *,
        process_group: Any = None,
        strict: bool = True,
        allow_unexpected: bool = True,
    ) -> None:
        """``dist_checkpointing.load`` of ``state_dict``'s keys, then what it returned put into
        ``state_dict``: tensors it did not load into are copied in place, meta entries and non-tensor
        values replaced, keys it did not return left as they were."""
        from torch.distributed.tensor import DTensor

        _require_default_group(process_group, "load")
        handling = _strict_handling(strict, allow_unexpected)
        loaded = self._dc.load(_to_sharded(state_dict, loading=True), str(checkpoint_id), strict=handling,
                               process_group=process_group)
        for path, leaf in list(_leaves(state_dict)):
            try:
                value = _get(loaded, path)
            except (KeyError, IndexError, TypeError):
                continue  # skipped (strict=False) or not in its common state: megatron returned nothing here
            if isinstance(leaf, torch.Tensor) and not _is_meta(leaf):
                target = leaf.to_local() if isinstance(leaf, DTensor) else leaf
                got = value.to_local() if isinstance(value, DTensor) else value
                if isinstance(got, torch.Tensor) and got.data_ptr() != target.data_ptr():
                    with torch.no_grad():
                        target.copy_(got)
            elif isinstance(leaf, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                _set(state_dict, path, DTensor.from_local(value, leaf.device_mesh, leaf.placements,
                                                          shape=leaf.shape, stride=leaf.stride()))
            else:
                _set(state_dict, path, value)

    def get_state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """torch's DTensor state dicts of a ``fully_shard`` model (megatron's own sharding needs CUDA)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(model, optimizer)

    def set_state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


# -- async saves -------------------------------------------------------------------------------------


class _Finalized(Future):
    """The completion future of one megatron async save: resolved by megatron's collective
    ``maybe_finalize_async_calls``, which ``done``/``result``/``exception`` run in the calling thread (every
    rank must ask alike, as a trainer calls it every step)."""

    def __init__(self, ops: MegatronAsyncCheckpointOps, call_idx: int) -> None:
        super().__init__()
        self._ops = ops
        self._call_idx = call_idx

    def _drive(self, blocking: bool) -> None:
        if super().done():
            return
        self._ops._finalize(blocking)

    def done(self) -> bool:
        self._drive(blocking=False)
        return super().done()

    def result(self, timeout: float | None = None) -> Any:
        self._drive(blocking=True)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._drive(blocking=True)
        return super().exception(timeout)


@dataclass(frozen=True)
class _Response:
    staging_completion: Future[Any]
    upload_completion: Future[Any]


class MegatronAsyncCheckpointOps:
    """``dist_checkpointing.save(..., async_sharded_save=True, async_strategy="mcore")`` scheduled on an
    ``AsyncCallsQueue(persistent=False)`` (a forked writer process per save; module docstring)."""

    name = "megatron-core"
    executors: tuple[str, ...] = ("process",)
    concurrent_saves: Literal["wait", "refuse"] = "wait"

    def __init__(self) -> None:
        self._dc = _import_megatron()
        self._queue: Any = None
        self._pending: dict[int, _Finalized] = {}

    def _finalize(self, blocking: bool) -> None:
        """Megatron's finalization of the saves in flight (collective), resolving their futures."""
        if self._queue is None:
            return
        try:
            finished = self._queue.maybe_finalize_async_calls(blocking=blocking)
        except Exception as exc:  # megatron raises the first unfinished save's failure
            if self._queue.async_calls:
                call_idx = self._queue.async_calls.popleft().idx
            else:
                call_idx = min(self._pending, default=-1)
            future = self._pending.pop(call_idx, None)
            if future is not None:
                future.set_exception(exc)
            return
        for call_idx in finished:
            future = self._pending.pop(call_idx, None)
            if future is not None:
                future.set_result(None)

    def async_save(
        self, state_dict: dict[str, Any], checkpoint_id: str | os.PathLike[str], *, process_group: Any = None,
        executor: Literal["thread", "process"] = "process",
    ) -> AsyncSave:
        """Plan and stage (fork) the save now; write in the forked process; finalize as :class:`_Finalized` says."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        if executor not in self.executors:
            raise Unsupported(f"megatron-core has no {executor} executor for async saves: its TemporalAsyncCaller forks "
                              "a writer process per save (its persistent worker calls torch.cuda.set_device)")
        _require_default_group(process_group, "save")
        if self._queue is None:
            self._queue = AsyncCallsQueue(persistent=False)
        self._finalize(blocking=True)  # a save in flight completes first ("wait")
        os.makedirs(checkpoint_id, exist_ok=True)
        staged: Future[Any] = Future()
        try:
            request = self._dc.save(_to_sharded(state_dict, loading=False), str(checkpoint_id),
                                    async_sharded_save=True, async_strategy="mcore")
            call_idx = self._queue.schedule_async_request(request)
        except Exception as exc:
            staged.set_exception(exc)
            failed: Future[Any] = Future()
            failed.set_exception(exc)
            return _Response(staged, failed)
        staged.set_result(None)
        completion = _Finalized(self, call_idx)
        self._pending[call_idx] = completion
        return _Response(staged, completion)

    def writer_processes(self) -> list[int]:
        """The forked writer processes of the saves in flight: megatron's results-queue ``Manager``, a
        child process too, writes nothing and is not one."""
        calls = self._queue.async_calls if self._queue is not None else ()
        processes = [getattr(call.async_caller, "process", None) for call in calls]
        return [p.pid for p in processes if p is not None and p.pid is not None and p.is_alive()]

    def shutdown(self) -> None:
        """Finalize the save in flight and drop the queue (its writer processes are joined by then)."""
        if self._queue is not None:
            with contextlib.suppress(Exception):
                self._finalize(blocking=True)
            self._queue.close()
            self._queue = None


class MegatronCoreAdapter(Adapter):
    """megatron-core 0.19.2's ``dist_checkpointing`` (ML, AS); models sharded by torch's ``fully_shard``."""

    name = "megatron-core"
    xfails_file = "../../xfails/megatron-core.txt"
    checkpoint_format = "megatron"
    # Its directory holds DCP's .metadata and .distcp files (read by megatron through DCP's reader), beside
    # its metadata.json: the tests that read DCP's metadata or place a fault by it apply.
    dcp_files = True
    needs_process_group = True
    devices = ("cpu", "cuda")

    def checkpoint(self) -> CheckpointOps:
        return MegatronCheckpointOps()

    def async_checkpoint(self) -> AsyncCheckpointOps:
        return MegatronAsyncCheckpointOps()

    def sharding(self) -> ShardingOps:
        from conformance.adapters.sharding import TorchFSDP2ShardingOps

        _import_megatron()  # no megatron, no checkpoint tests of sharded models either
        return TorchFSDP2ShardingOps()
