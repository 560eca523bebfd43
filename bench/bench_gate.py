"""asv: the regression gate's benchmarks (``make asv-gate BASE=<ref>``, see ``tools/asv_gate.py``).

One small workload per capability, each call tens of milliseconds, so that asv can take many samples
of every benchmark in a few seconds and its significance test (Mann-Whitney U at p < 0.002, which
needs at least 7 samples per commit) can say "changed" or "not changed":

=========================  ==========================================================================
``GateFlatten``            wrap a 1,000-parameter model nested 4 deep (``FlattenParamsWrapper``)
``GateStateDict``          ``get_state_dict`` (10,000 keys, 64 submodules), ``set_state_dict`` (1,000)
``GateOptimState``         FSDP ``optim_state_dict`` / ``optim_state_dict_to_load``, 1,000 parameters
``GateCheckpoint``         ``save`` / ``load`` of 32 MB (8 tensors of 4 MiB), one process
=========================  ==========================================================================

Times are the CPU time of the benchmark process (``time.process_time``), see ``_Gate``.

Only the reference is timed by these classes: the gate compares two commits of this project, and
upstream torch or the raw limit cannot change between them (timing them in the gate only adds
chances of a false alarm). ``GateBaseline*`` time the same workloads for upstream and raw; the gate
records them once for the tip commit, outside its verdict, so the ratios stay at hand.

Every class holds what is expensive to build (models, optimizer, process group, the saved checkpoint)
in a per-process cache: asv re-runs ``setup`` (and ``teardown``) around every timed call.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.workloads import flat_param as fp
from bench.workloads import state_dict as sd

FLATTEN_PARAMS, FLATTEN_DEPTH = 1_000, 4
GET_KEYS, GET_SUBMODULES = 10_000, "64"
SET_KEYS = 1_000
OPTIM_PARAMS = 1_000
CHECKPOINT_TENSORS = 8  # of 1024 x 1024 fp32: 32 MiB


class _Gate:
    # CPU time of this process, not wall time: on a shared machine the wall time of a call is mostly
    # how long it waited for a core (load 3-10 on 2 cores here made identical code 2-3x "slower" and
    # hid a real 2x slowdown in the noise); the CPU time is the work the reference does. The
    # checkpoint benchmarks' file I/O counts as the CPU time of its system calls (copies to and from
    # the page cache), which is the software cost the gate is about.
    timer = staticmethod(time.process_time)
    # Many short samples in each of 4 rounds, which `asv continuous --interleave-rounds` runs as
    # base, tip, tip, base, base, tip, tip, base: a load burst from another job on a shared machine
    # then falls on both commits, not on one (with 2 rounds the tip's rounds ran back to back, and a
    # burst there made identical code look 2-3x slower here). 4 x 5..10 samples per commit.
    number = 1
    repeat = (5, 10, 3.0)
    rounds = 4
    warmup_time = 0.1
    min_run_count = 2
    timeout = 300


class _Baseline(_Gate):
    # Recorded for one commit, never tested for significance: a few samples (torch's get_state_dict
    # with 64 submodules takes about a second here).
    repeat = (3, 5, 5.0)
    rounds = 1


_CACHE: dict[Any, Any] = {}


def _cached(key: Any, build: Callable[[], Any]) -> Any:
    if key not in _CACHE:
        _CACHE[key] = build()
    return _CACHE[key]


def _skip_unavailable(available: Callable[[str], str | None], impl: str) -> None:
    reason = available(impl)
    if reason is not None:
        raise NotImplementedError(reason)


# -- capability 1: flattening ---------------------------------------------------------------------


def _flatten_setup(self: Any, impl: str) -> None:
    _skip_unavailable(fp.available, impl)
    self.flatten = fp.flatten_fn(impl, FLATTEN_PARAMS, FLATTEN_DEPTH)  # a fresh model for every call


class GateFlatten(_Gate):
    """Seconds to wrap every level of a fresh 1,000-parameter, 4-deep model in ``FlattenParamsWrapper``."""

    def setup(self) -> None:
        _flatten_setup(self, "reference")

    def time_flatten(self) -> None:
        self.flatten()


class GateBaselineFlatten(_Baseline):
    """``GateFlatten`` for fairscale's wrapper and for ``torch.cat`` of the same parameters (raw)."""

    params = (["fairscale", "raw"],)
    param_names = ["impl"]

    def setup(self, impl: str) -> None:
        _flatten_setup(self, impl)

    def time_flatten(self, impl: str) -> None:
        self.flatten()


# -- capability 2: submodule state_dict -----------------------------------------------------------


def _state_dict_setup(self: Any, impl: str) -> None:
    _skip_unavailable(sd.available, impl)
    self.get = _cached(("get", impl), lambda: sd.get_fn(impl, sd.Case(GET_KEYS), GET_SUBMODULES))
    self.set = _cached(("set", impl), lambda: sd.set_fn(impl, sd.Case(SET_KEYS)))


class GateStateDict(_Gate):
    """Seconds of ``get_state_dict`` (10,000 keys, 64 submodules) and ``set_state_dict`` (1,000 keys)."""

    def setup(self) -> None:
        _state_dict_setup(self, "reference")

    def time_get_state_dict(self) -> None:
        self.get()

    def time_set_state_dict(self) -> None:
        self.set()


class GateBaselineStateDict(_Baseline):
    """``GateStateDict`` for torch's ``get_state_dict``/``set_state_dict`` and the plain module calls (raw)."""

    params = (["torch", "raw"],)
    param_names = ["impl"]

    def setup(self, impl: str) -> None:
        _state_dict_setup(self, impl)

    def time_get_state_dict(self, impl: str) -> None:
        self.get()

    def time_set_state_dict(self, impl: str) -> None:
        self.set()


# -- capability 3: FSDP optimizer-state keying ----------------------------------------------------


def _one_rank_group() -> bool:
    """A one-rank gloo process group for this benchmark process (FSDP needs one), rendezvous in memory."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def _optim_state_setup(self: Any, impl: str) -> None:
    from bench.workloads import optim_state as osw

    _skip_unavailable(osw.available, impl)
    _cached("process group", _one_rank_group)

    def build() -> dict[str, Any]:
        osw.prepare(impl, OPTIM_PARAMS)  # wraps, trains a step, gets one state dict (checked)
        return dict(osw._CACHE)

    state = _cached(("optim", impl), build)
    self.get = lambda: osw._fsdp(impl).optim_state_dict(state["model"], state["optim"])
    self.to_load = lambda: osw._fsdp(impl).optim_state_dict_to_load(state["model"], state["optim"], state["osd"])


class GateOptimState(_Gate):
    """Seconds of FSDP ``optim_state_dict`` and ``optim_state_dict_to_load``: 1,000 parameters in 10
    units, Adam after one step, one rank."""

    def setup(self) -> None:
        _optim_state_setup(self, "reference")

    def time_optim_state_dict(self) -> None:
        self.get()

    def time_optim_state_dict_to_load(self) -> None:
        self.to_load()


class GateBaselineOptimState(_Baseline):
    """``GateOptimState`` for upstream FSDP1."""

    params = (["torch"],)
    param_names = ["impl"]

    def setup(self, impl: str) -> None:
        _optim_state_setup(self, impl)

    def time_optim_state_dict(self, impl: str) -> None:
        self.get()

    def time_optim_state_dict_to_load(self, impl: str) -> None:
        self.to_load()


# -- capability 4: checkpoint save / load ---------------------------------------------------------


def _checkpoint_state() -> dict[str, torch.Tensor]:
    return {f"layers.{i}.weight": torch.full((1024, 1024), float(i + 1)) for i in range(CHECKPOINT_TENSORS)}


def _raw_save(state: dict[str, torch.Tensor], directory: str) -> None:
    with open(os.path.join(directory, "raw.bin"), "wb") as f:
        for tensor in state.values():
            f.write(memoryview(tensor.numpy()).cast("B"))


def _raw_load(state: dict[str, torch.Tensor], directory: str) -> None:
    with open(os.path.join(directory, "raw.bin"), "rb") as f:
        for tensor in state.values():
            f.readinto(memoryview(tensor.numpy()).cast("B"))


def _checkpoint_ops(impl: str) -> tuple[Callable[[dict, str], Any], Callable[[dict, str], Any]]:
    """(save, load) of ``impl``. No fsync anywhere: the gate times the software, and on a shared disk
    an fsync's time is the other jobs' (the throughput benchmarks, bench_checkpoint.py, do fsync)."""
    if impl == "raw":
        return _raw_save, _raw_load
    if impl == "reference":
        import reference.checkpoint as ckpt

        writer: Callable[[str], Any] = lambda d: ckpt.FileSystemWriter(d, sync_files=False)  # noqa: E731
    else:
        import torch.distributed.checkpoint as ckpt  # type: ignore[no-redef]

        writer = lambda d: ckpt.FileSystemWriter(d, sync_files=False)  # noqa: E731
    return (
        lambda state, d: ckpt.save(state, checkpoint_id=d, storage_writer=writer(d)),
        lambda state, d: ckpt.load(state, checkpoint_id=d),
    )


def _checkpoint_setup(self: Any, impl: str) -> None:
    from bench.workloads import checkpoint as ck

    _skip_unavailable(ck.available, impl)
    save, load = _checkpoint_ops(impl)
    source = _cached(("checkpoint", impl), _checkpoint_state)
    dest = _cached(("checkpoint dest", impl), lambda: {k: torch.zeros_like(v) for k, v in source.items()})
    # asv runs setup and teardown around every timed call: a fresh directory each time, removed after.
    self.directory = tempfile.mkdtemp(prefix=f"bench-gate-ckpt-{impl}-")
    save(source, self.directory)  # what time_load reads (time_save writes it again)
    self.save = lambda: save(source, self.directory)
    self.load = lambda: load(dest, self.directory)


def _checkpoint_teardown(self: Any) -> None:
    shutil.rmtree(self.directory, ignore_errors=True)


class GateCheckpoint(_Gate):
    """Seconds of ``reference.checkpoint.save`` / ``load`` of 32 MiB (8 plain fp32 tensors), no process
    group, no fsync; the load reads from the page cache."""

    def setup(self) -> None:
        _checkpoint_setup(self, "reference")

    def teardown(self) -> None:
        _checkpoint_teardown(self)

    def time_save(self) -> None:
        self.save()

    def time_load(self) -> None:
        self.load()


class GateBaselineCheckpoint(_Baseline):
    """``GateCheckpoint`` for torch DCP and for raw ``write`` / ``readinto`` of the same bytes."""

    params = (["torch", "raw"],)
    param_names = ["impl"]

    def setup(self, impl: str) -> None:
        _checkpoint_setup(self, impl)

    def teardown(self, impl: str) -> None:
        _checkpoint_teardown(self)

    def time_save(self, impl: str) -> None:
        self.save()

    def time_load(self, impl: str) -> None:
        self.load()


#: The classes whose benchmarks decide the gate: reference code only, one class per capability.
GATED: tuple[type, ...] = (GateFlatten, GateStateDict, GateOptimState, GateCheckpoint)
#: Timed for the tip commit alongside the gate, never part of its verdict.
BASELINES: tuple[type, ...] = (GateBaselineFlatten, GateBaselineStateDict, GateBaselineOptimState, GateBaselineCheckpoint)
