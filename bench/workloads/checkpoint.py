"""Checkpoint workloads: save, load and load-into-meta of model + Adam state, for every implementation.

The state dict is what a trainer checkpoints: ``{"model": {fqn: param}, "optim": {"state": {fqn:
{"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}}``, built from layers of a 1024 x 1024
fp32 weight (4 MiB, the size of a transformer block's matrix shard) and a bias, so the number of
tensors grows with the size as in a real model. Two layouts:

``full``
    Plain tensors, the whole state on every rank (a replicated model). A save writes each byte once
    (DCP deduplicates replicated items); a load reads every byte on every rank.
``sharded``
    DTensors, ``Shard(0)`` over a 1-D mesh of all ranks (what FSDP2 holds). Each rank saves and loads
    its own shard.

Implementations (:func:`impls`): every adapter through its ``CheckpointOps.save`` / ``load`` on the
default process group: the reference, torch (DCP) and the implementations under test
(``BENCH_IMPL``, see :mod:`bench.impls`); and the limits of the machine for the same bytes on the
same ranks: ``raw`` (one plain file per rank, ``write`` + ``fsync`` as DCP's file writer does, and
``readinto`` the destination tensors) and ``memcpy`` (``Tensor.copy_`` of the same bytes). A third
limit, ``raw-agreed`` (:data:`AGREED_RAW`), is raw's I/O with the collectives DCP's protocol and SPEC's
agreements make every implementation run between the ranks, each carrying one integer: the limit at
world size 2 and above of any implementation that agrees as SPEC says, the rest of its gap to raw being
c10d's latency and the ranks' waits for each other. ``bench.checkpoint_io`` and
``bench.checkpoint_phases`` measure it beside raw.

Devices: the state dicts live on the CPU (gloo ranks), or with ``device="cuda"`` on ``cuda:<rank>``
(nccl ranks; ``BENCH_DEVICE=cuda``, see ``bench/config.py``). For CUDA state dicts the raw limit
stages every tensor through two reusable pinned host buffers (:class:`HostStaging`): the
device-to-host copy of the next tensor runs while the current one is written, and on load the
host-to-device copy of one tensor while the next is read, as a careful checkpointer would.

Figures are throughputs in MB/s of the state dict's global bytes (``size / seconds``, 1 MB = 2**20 B),
so every implementation and layout is on one scale. The files live in the page cache when read back
(the machines of docs/benchmark-results.md have the memory for it), for every implementation alike: the figures are software overhead against the
memory/page-cache limit, not disk speed.

The rank-side functions (``prepare``, ``save_once``, ...) run on every rank of a
:class:`bench.ranks.RankGroup`; :func:`measure` drives them from the controller.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from bench import impls as _impls
from bench.ranks import RankGroup, peak_rss_bytes, peak_rss_reset, rss_bytes, timed

__all__ = [
    "CAPABILITY", "UPSTREAM", "AGREED_RAW", "IO_LIMITS", "impls", "meta_impls", "LAYOUTS", "available", "train_state", "state_bytes",
    "HostStaging", "prepare", "save_once", "load_once", "meta_load_once", "release", "Figures", "measure",
]

CAPABILITY = "checkpoint"
#: The upstream baseline of this family (DCP).
UPSTREAM: tuple[str, ...] = ("torch",)
LAYOUTS: tuple[str, ...] = ("full", "sharded")

_WIDTH = 1024  # weight is _WIDTH x _WIDTH fp32 = 4 MiB
#: raw's I/O plus the fewest collectives of a DCP save or load that agrees as SPEC says (see
#: :func:`_agreed_raw_save`, :func:`_agreed_raw_load`); measured only where named, not in ``impls()``.
AGREED_RAW = _impls.AGREED_RAW
#: The limits of file I/O that every checkpoint measure times beside the implementations.
IO_LIMITS: tuple[str, ...] = ("raw", AGREED_RAW)


def impls() -> list[str]:
    """reference, torch, the implementations under test, raw, memcpy."""
    return _impls.family(UPSTREAM, limits=("raw", "memcpy"))


def meta_impls() -> list[str]:
    """:func:`impls` without memcpy, which has no meaning for a load into meta (nothing to copy into)."""
    return [impl for impl in impls() if impl != "memcpy"]


def available(impl: str) -> str | None:
    """None if ``impl`` can run here, else why not (its adapter has no ``CheckpointOps``)."""
    return _impls.unavailable(impl, CAPABILITY)


# -- the state dict -------------------------------------------------------------------------------


def _layer_count(nbytes: int) -> int:
    per_layer = 3 * 4 * (_WIDTH * _WIDTH + _WIDTH)  # param + exp_avg + exp_avg_sq, fp32
    return max(1, round(nbytes / per_layer))


def _rank_device(device: str) -> torch.device:
    """``cpu``, ``meta``, or this rank's GPU for ``cuda``."""
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def _mesh_device_type() -> str:
    """The device type of this process group's meshes: ``cuda`` under nccl, else ``cpu``."""
    return "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"


def train_state(nbytes: int, layout: str, *, device: str = "cpu", fill: bool = True) -> dict[str, Any]:
    """Model + Adam state of about ``nbytes`` (global), in ``layout``, on ``device`` (``cpu``, ``cuda``:
    this rank's GPU, or ``meta``).

    Call on every rank of the default process group (``sharded`` builds a mesh over all of them).
    Values are cheap to make and differ per tensor, so a load that skips or swaps tensors is caught."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    where = _rank_device(device)
    mesh = None
    if layout == "sharded":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(_mesh_device_type(), (torch.distributed.get_world_size(),))

    def make(value: float, shape: tuple[int, ...]) -> torch.Tensor:
        if mesh is None:
            local = torch.empty(shape, device=where)
        else:
            # torch.chunk's split, as DTensor's Shard(0) places rows.
            rank, world = mesh.get_local_rank(), mesh.size()
            rows = math.ceil(shape[0] / world)
            start = min(rank * rows, shape[0])
            local = torch.empty((min(rows, shape[0] - start),) + shape[1:], device=where)
        if where.type != "meta":
            local.fill_(value if fill else 0.0)  # also touches every page before anything is timed
        if mesh is None:
            return local
        from torch.distributed.tensor import DTensor, Shard

        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)

    model: dict[str, Any] = {}
    state: dict[str, Any] = {}
    values = iter(_expected_values(nbytes))
    for i in range(_layer_count(nbytes)):
        for name, shape in ((f"layers.{i}.weight", (_WIDTH, _WIDTH)), (f"layers.{i}.bias", (_WIDTH,))):
            model[name] = make(next(values), shape)
    for name in model:
        shape = tuple(model[name].shape)
        state[name] = {"step": torch.tensor(10.0), "exp_avg": make(next(values), shape),
                       "exp_avg_sq": make(next(values), shape)}
    param_groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
                     "params": list(model)}]
    return {"model": model, "optim": {"state": state, "param_groups": param_groups}}


def _expected_values(nbytes: int) -> list[float]:
    """The fill value of each tensor of ``train_state(nbytes, ...)``, in :func:`tensors_of` order."""
    return [float(i + 1) for i in range(3 * 2 * _layer_count(nbytes))]


def _local(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def tensors_of(sd: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of every large tensor in a fixed order; DTensors as they are (not localized)."""
    for name, value in sd["model"].items():
        yield f"model.{name}", value
    for name, entry in sd["optim"]["state"].items():
        yield f"optim.{name}.exp_avg", entry["exp_avg"]
        yield f"optim.{name}.exp_avg_sq", entry["exp_avg_sq"]


def state_bytes(sd: dict[str, Any]) -> int:
    """Global bytes of the large tensors of ``sd`` (what the MB/s figures divide by)."""
    return sum(t.numel() * t.element_size() for _, t in tensors_of(sd))


def _local_bytes(sd: dict[str, Any]) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for _, t in tensors_of(sd))


# -- the raw limit ----------------------------------------------------------------------------------


def _raw_assignment(sd: dict[str, Any], layout: str) -> list[tuple[int, torch.Tensor]]:
    """(writing rank, local tensor) for every tensor: the bytes the raw limit writes and reads.

    ``sharded``: each rank its own shards. ``full``: tensors dealt round-robin, so each byte is written
    once, as DCP does with replicated data."""
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    items = [_local(t) for _, t in tensors_of(sd)]
    if layout == "sharded":
        return [(rank, t) for t in items]
    return [(i % world, t) for i, t in enumerate(items)]


def _raw_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"raw_rank{rank}.bin")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous tensor's memory (any device)."""
    if not tensor.is_contiguous():
        raise ValueError("HostStaging needs contiguous tensors")
    return tensor.reshape(-1).view(torch.uint8)


def _copy_done(device: torch.device) -> Any:
    """An event marking the copies issued so far on ``device``'s current stream (None on the CPU,
    where a copy is done when it returns)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class HostStaging:
    """Two reusable host buffers through which tensors of another device pass to and from files.

    Copies are issued with ``non_blocking=True`` and alternate between the buffers, so that the copy
    of one tensor overlaps the file I/O of the other; buffers are pinned (page-locked) for CUDA,
    which is what makes a device-to-host copy asynchronous. ``pin=False`` gives plain buffers (CPU
    tensors, tests). Each buffer holds ``nbytes``: at least the largest tensor staged."""

    def __init__(self, nbytes: int, *, pin: bool) -> None:
        self.buffers = [torch.empty(max(1, nbytes), dtype=torch.uint8, pin_memory=pin) for _ in range(2)]

    def _slot(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        n = _nbytes(tensor)
        if n > self.buffers[0].numel():
            raise ValueError(f"tensor #{index} has {n} bytes, the staging buffers {self.buffers[0].numel()}")
        return self.buffers[index % 2][:n]

    def to_host(self, tensors: list[torch.Tensor]) -> Iterator[memoryview]:
        """Each tensor's bytes, in order, as a host memoryview valid until the next one is asked for.

        The copy of tensor ``k + 1`` is issued before tensor ``k``'s bytes are handed out (it goes to
        the other buffer, whose bytes were consumed already), so it runs while the caller writes."""

        def issue(k: int) -> tuple[torch.Tensor, Any]:
            slot = self._slot(k, tensors[k])
            slot.copy_(_as_bytes(tensors[k]), non_blocking=True)
            return slot, _copy_done(tensors[k].device)

        if not tensors:
            return
        upcoming = issue(0)
        for k in range(len(tensors)):
            slot, done = upcoming
            if k + 1 < len(tensors):
                upcoming = issue(k + 1)
            if done is not None:
                done.synchronize()
            yield slot.numpy().data.cast("B")

    def from_host(self, tensors: list[torch.Tensor], read_into: Callable[[int, memoryview], None]) -> None:
        """Fill each tensor from a host buffer that ``read_into(k, view)`` fills with tensor ``k``'s
        bytes. The copy of tensor ``k`` to its device runs while tensor ``k + 1`` is read; a buffer
        is reused only once its previous copy has finished. Returns when every copy has finished."""
        done: list[Any] = [None, None]
        for k, tensor in enumerate(tensors):
            if done[k % 2] is not None:
                done[k % 2].synchronize()
            slot = self._slot(k, tensor)
            read_into(k, slot.numpy().data.cast("B"))
            _as_bytes(tensor).copy_(slot, non_blocking=True)
            done[k % 2] = _copy_done(tensor.device)
        for event in done:
            if event is not None:
                event.synchronize()


def _staging_for(tensors: list[torch.Tensor]) -> HostStaging | None:
    """Pinned staging for tensors on a GPU; None when every tensor is on the CPU already."""
    if all(t.device.type == "cpu" for t in tensors):
        return None
    return HostStaging(max((_nbytes(t) for t in tensors), default=1), pin=True)


def _raw_save(sd: dict[str, Any], layout: str, directory: str) -> None:
    rank = torch.distributed.get_rank()
    mine = [tensor for writer, tensor in _raw_assignment(sd, layout) if writer == rank]
    staging = _staging_for(mine)
    with open(_raw_path(directory, rank), "wb") as f:
        if staging is None:
            for tensor in mine:
                f.write(tensor.numpy().data.cast("B"))
        else:
            for view in staging.to_host(mine):
                f.write(view)
        f.flush()
        os.fsync(f.fileno())


def _raw_load(sd: dict[str, Any], layout: str, directory: str) -> None:
    files: dict[int, Any] = {}
    assignment = _raw_assignment(sd, layout)

    def read_into(k: int, view: memoryview) -> None:
        writer = assignment[k][0]
        if writer not in files:
            files[writer] = open(_raw_path(directory, writer), "rb")
        if files[writer].readinto(view) != len(view):
            raise RuntimeError(f"raw checkpoint in {directory}: file of rank {writer} is short")

    try:
        tensors = [tensor for _, tensor in assignment]
        staging = _staging_for(tensors)
        if staging is None:
            for k, tensor in enumerate(tensors):
                read_into(k, tensor.numpy().data.cast("B"))
        else:
            staging.from_host(tensors, read_into)
    finally:
        for f in files.values():
            f.close()


def _raw_meta_load(meta_sd: dict[str, Any], layout: str, directory: str) -> None:
    """Allocate every local tensor and read its bytes: what a load into meta cannot do better than."""
    from torch.distributed.tensor import DTensor

    device = _rank_device(_mesh_device_type())  # where a load into meta puts values: the group's device

    def materialize(value: torch.Tensor) -> torch.Tensor:
        if isinstance(value, DTensor):
            local = torch.empty_like(value.to_local(), device=device)
            return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                      shape=value.shape, stride=value.stride())
        return torch.empty_like(value, device=device)

    for name in list(meta_sd["model"]):
        meta_sd["model"][name] = materialize(meta_sd["model"][name])
    for entry in meta_sd["optim"]["state"].values():
        entry["exp_avg"] = materialize(entry["exp_avg"])
        entry["exp_avg_sq"] = materialize(entry["exp_avg_sq"])
    _raw_load(meta_sd, layout, directory)


def _one_int() -> torch.Tensor:
    """What each collective of :data:`AGREED_RAW` carries: one int32 on the group's device."""
    return torch.zeros(1, dtype=torch.int32, device=_rank_device(_mesh_device_type()))


def _agreed_raw_save(sd: dict[str, Any], layout: str, directory: str) -> None:
    """raw's save between the four collectives of DCP's save protocol, each of one integer: the local
    plans gathered to the coordinator and the global plans scattered back before anything is written;
    the write results gathered and the metadata broadcast after (torch's ``save`` and the reference's
    alike). What an implementation sends in them, and how, is its own cost, not this limit's."""
    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    flag = _one_int()
    everyone = [torch.zeros_like(flag) for _ in range(world)] if rank == 0 else None
    dist.gather(flag, everyone, dst=0)
    dist.scatter(flag, everyone, src=0)
    _raw_save(sd, layout, directory)
    dist.gather(flag, everyone, dst=0)
    dist.broadcast(flag, src=0)


def _agreed_raw_load(sd: dict[str, Any], layout: str, directory: str) -> None:
    """raw's load between SPEC's three agreements of a load (ML-23, ML-24: every rank planned, every
    rank read, every rank committed), each an all-reduce of one integer, as the reference's are."""
    flag = _one_int()
    torch.distributed.all_reduce(flag)
    _raw_load(sd, layout, directory)
    torch.distributed.all_reduce(flag)
    torch.distributed.all_reduce(flag)


def _memcpy(source: dict[str, Any], dest: dict[str, Any], layout: str, *, only_written: bool) -> None:
    rank = torch.distributed.get_rank()
    for (writer, src), (_, dst) in zip(_raw_assignment(source, layout), _raw_assignment(dest, layout)):
        if not only_written or writer == rank:
            dst.copy_(src)


# -- the implementations -----------------------------------------------------------------------------


def dcp_ops(impl: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(save, load) of ``impl``'s ``CheckpointOps``, each ``(state_dict, directory)``, on the default
    process group."""
    ops = _impls.ops(impl, CAPABILITY)
    return (lambda sd, directory: ops.save(sd, directory)), (lambda sd, directory: ops.load(sd, directory))


# -- rank-side steps (run on every rank of a RankGroup) -----------------------------------------------

# This rank's source and destination state dicts, kept between calls so that the (slow) building of
# a 2 GB state dict is not repeated for each implementation.
_CACHE: dict[str, Any] = {}


def prepare(nbytes: int, layout: str, device: str = "cpu") -> int:
    """Build this rank's source and destination state dicts on ``device`` (``cpu`` or ``cuda``); return
    the global bytes. Every rank calls."""
    if _CACHE.get("key") != (nbytes, layout, device):
        release()
        source = train_state(nbytes, layout, device=device)
        dest = train_state(nbytes, layout, device=device, fill=False)
        _CACHE.update(key=(nbytes, layout, device), source=source, dest=dest, layout=layout)
    return state_bytes(_CACHE["source"])


def source_state() -> dict[str, Any]:
    """This rank's source state dict, built by :func:`prepare`."""
    source: dict[str, Any] = _CACHE["source"]
    return source


def release() -> None:
    """Drop this rank's state dicts."""
    _CACHE.clear()
    gc.collect()


def fresh_dir(directory: str, *, keep: bool = False) -> None:
    """Empty ``directory`` (or, with ``keep``, leave what it holds), then wait for every rank: rank 0
    alone looks and decides, so that every rank makes the same collective calls."""
    if torch.distributed.get_rank() == 0:
        if not (keep and os.path.isdir(directory)):
            shutil.rmtree(directory, ignore_errors=True)
            os.makedirs(directory)
    torch.distributed.barrier()


def save_once(impl: str, directory: str, over_previous: bool = False) -> float:
    """Seconds to save the prepared source state dict with ``impl`` into an emptied ``directory``, or,
    with ``over_previous``, over the checkpoint an earlier save of ``impl`` left there (a job that
    keeps one latest checkpoint): then the cost of replacing the earlier files counts too, wherever the
    implementation pays it (raw truncates its file as it opens it for writing)."""
    source, layout = _CACHE["source"], _CACHE["layout"]
    fresh_dir(directory, keep=over_previous)
    if impl == "raw":
        return timed(lambda: _raw_save(source, layout, directory))
    if impl == AGREED_RAW:
        return timed(lambda: _agreed_raw_save(source, layout, directory))
    if impl == "memcpy":
        return timed(lambda: _memcpy(source, _CACHE["dest"], layout, only_written=True))
    save, _ = dcp_ops(impl)
    return timed(lambda: save(source, directory))


def _zero(sd: dict[str, Any]) -> None:
    for _, tensor in tensors_of(sd):
        _local(tensor).zero_()


def _check_loaded(sd: dict[str, Any], nbytes: int, impl: str) -> None:
    """Every tensor of ``sd`` holds what ``train_state(nbytes)`` saved (each tensor is one value)."""
    for (key, tensor), value in zip(tensors_of(sd), _expected_values(nbytes), strict=True):
        local = _local(tensor)
        if local.device.type == "meta" or not bool((local == value).all()):
            raise RuntimeError(f"{impl}: {key} after load differs from what was saved (expected all {value})")


def load_once(impl: str, directory: str) -> float:
    """Seconds to load ``directory`` (saved by ``save_once(impl)``) into the destination state dict.

    The destination is zeroed first and compared with the source after (neither is timed), so a load
    that does nothing cannot look fast."""
    source, dest, layout = _CACHE["source"], _CACHE["dest"], _CACHE["layout"]
    _zero(dest)
    if impl == "raw":
        seconds = timed(lambda: _raw_load(dest, layout, directory))
    elif impl == AGREED_RAW:
        seconds = timed(lambda: _agreed_raw_load(dest, layout, directory))
    elif impl == "memcpy":
        seconds = timed(lambda: _memcpy(source, dest, layout, only_written=False))
    else:
        _, load = dcp_ops(impl)
        seconds = timed(lambda: load(dest, directory))
    _check_loaded(dest, state_bytes(source), impl)
    return seconds


def meta_load_once(impl: str, directory: str, nbytes: int, layout: str) -> tuple[float, int, int]:
    """Load ``directory`` (saved from ``train_state(nbytes, layout)``) into a state dict of meta tensors.

    Values are built on the process group's device (a GPU under nccl). Returns (seconds, peak host
    RSS growth, local bytes). Run it on fresh ranks: the peak is this process's
    high-water mark (reset just before the load) minus its resident size before the load, which is
    the memory the load allocates at once, temporaries included, only when no freed memory is lying
    around resident in the allocator to be reused unseen."""
    meta_sd = train_state(nbytes, layout, device="meta")
    local_bytes = _local_bytes(meta_sd)
    if impl != "raw":
        # A load of nothing first: on a fresh process it imports the implementation and runs its code
        # paths once, and that memory is not the load's.
        dcp_ops(impl)[1]({}, directory)
    gc.collect()
    if not peak_rss_reset():
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs): no peak-memory figure here")
    before = rss_bytes()
    if impl == "raw":
        seconds = timed(lambda: _raw_meta_load(meta_sd, layout, directory))
    else:
        _, load = dcp_ops(impl)
        seconds = timed(lambda: load(meta_sd, directory))
    peak = peak_rss_bytes() - before
    _check_loaded(meta_sd, nbytes, impl)
    return seconds, peak, local_bytes


# -- the controller ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    """What one (impl, size, world size, layout) measured. Seconds are the best of the repeats."""

    nbytes: int  # global bytes of the state dict
    save_s: float
    load_s: float
    meta_load_s: float | None  # None for memcpy, or when the load into meta failed
    meta_peak_ratio: float | None  # max over ranks of peak RSS growth / local bytes
    meta_error: str | None = None  # why meta_load_s is None, when it failed

    @property
    def save_mbps(self) -> float:
        return self.nbytes / 2**20 / self.save_s

    @property
    def load_mbps(self) -> float:
        return self.nbytes / 2**20 / self.load_s


def measure(
    group: RankGroup, impl: str, nbytes: int, layout: str, directory: str, *, repeats: int = 1, device: str = "cpu",
    meta_group: RankGroup | None = None,
) -> Figures:
    """Save and load with ``impl`` on ``group`` ``repeats`` times (best of), then load into meta once
    on fresh ranks (so that their peak memory is the load's own), or on ``meta_group`` where given: a
    quick run that checks the benchmark works, not its figure, loads every implementation on one group
    instead of starting ranks for each.

    ``directory`` is emptied before each save and removed at the end."""
    from bench.ranks import RankError

    total = group.run(prepare, nbytes, layout, device)[0]
    try:
        save_s = load_s = math.inf
        for _ in range(repeats):
            save_s = min(save_s, group.run(save_once, impl, directory)[0])
            load_s = min(load_s, group.run(load_once, impl, directory)[0])
        meta_s = meta_ratio = meta_error = None
        if impl != "memcpy":
            try:
                if meta_group is not None:
                    results = meta_group.run(meta_load_once, impl, directory, nbytes, layout)
                else:
                    with RankGroup(group.world_size, backend=group.backend) as fresh:
                        results = fresh.run(meta_load_once, impl, directory, nbytes, layout)
                meta_s = results[0][0]
                meta_ratio = max(peak / local for _, peak, local in results)
            except RankError as exc:  # an implementation that cannot load into meta is a figure too
                meta_error = str(exc).strip().splitlines()[-1]
        return Figures(total, save_s, load_s, meta_s, meta_ratio, meta_error)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
