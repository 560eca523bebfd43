"""asv: the regression gate's benchmarks (``make asv-gate BASE=<ref>``, see ``tools/asv_gate.py``).

One small workload per core call, each call tens of milliseconds, so that many samples of every one
fit in a short run, timed through the adapter the gate is about (:func:`bench.impls.gated_impl`:
``BENCH_IMPL``, else the reference):

===========================  =========================================================================
``GateFlatten``              ``FlatParamOps.wrap`` of every level of a 4,000-parameter model nested 4 deep
``GateGetStateDict``         ``StateDictOps.get_state_dict``, 5,000 keys, 64 submodules
``GateSetStateDict``         ``StateDictOps.set_state_dict``, 1,000 keys
``GateOptimStateDict``       ``OptimStateOps.optim_state_dict``, 2,000 parameters in 10 units, one rank
``GateLoadOptimStateDict``   ``OptimStateOps.load_optim_state_dict`` of that dict
``GateCheckpointSave``       ``CheckpointOps.save`` of model + Adam state, 12 layers of 1 MiB (36 MiB,
                             96 tensors), one process
``GateCheckpointLoad``       ``CheckpointOps.load`` of it
``GateAsyncStall``           ``AsyncCheckpointOps.async_save`` of it (thread executor) until staging
                             completed: the stall of training
===========================  =========================================================================

One class per call: asv runs every benchmark in its own process and calls ``setup`` before every
sample, so a class builds only what its one call needs (a per-process cache holds it between samples).
Each call is long enough to time steadily and short enough to repeat often: shorter calls are
noisier (the figures: docs/benchmark-results.md, "Why the benchmarks are shaped so").

How the figures are made steady enough to catch a 1.2x slowdown on a shared 2-core machine (the gate's
statistics are in ``tools/asv_gate.py``):

- the timer is the CPU time of the process (``time.process_time``): the wall time of a call on a
  loaded machine is mostly its wait for a core;
- torch runs one intra-op thread (``torch.set_num_threads(1)``): idle OpenMP workers spin, and their
  spinning is CPU time of the process that depends on the machine's load, not on the code;
- the garbage collector is off while a sample runs (``timeit``'s default);
- checkpoints go to ``/dev/shm`` where it exists (memory: an ``fsync`` returns at once), so that the
  disk, which other jobs share, is not what is timed;
- every round takes exactly ``repeat`` samples, so ``tools/asv_gate.py`` can cut asv's recorded
  samples into rounds and pair each round of the base with the round of the tip run beside it.

``GateBaseline*`` time the same workloads for the upstream baseline (torch; fairscale for
flattening), raw (the plain calls / file I/O) and, when the gate is about another adapter, the
reference: the gate records them once for the tip commit, outside its verdict.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from bench import impls as _impls
from bench.workloads import flat_param as fp
from bench.workloads import state_dict as sd

#: The adapter the gated classes time.
GATED_IMPL: str = _impls.gated_impl()

FLATTEN_PARAMS, FLATTEN_DEPTH = 4_000, 4
GET_KEYS, GET_SUBMODULES = 5_000, "64"
SET_KEYS = 1_000
OPTIM_PARAMS = 2_000
CHECKPOINT_LAYERS, CHECKPOINT_WIDTH = 12, 512  # a 512 x 512 fp32 weight (1 MiB) and a bias per layer

#: Samples per round of every gated benchmark (fixed, so that the rounds can be told apart).
SAMPLES_PER_ROUND = 8
#: Rounds per commit; ``asv continuous --interleave-rounds`` runs them base, tip, tip, base, base, ...
#: The samples of one round are alike; rounds differ (another process, another minute of the
#: machine's load): 8 rounds is what the gate's interval needs (see tools/asv_gate.py).
ROUNDS = 8


class _Gate:
    timer = staticmethod(time.process_time)
    number = 1
    repeat = SAMPLES_PER_ROUND
    rounds = ROUNDS
    warmup_time = 0.05
    timeout = 300

    def _prepare(self, impl: str) -> None:
        """Build what the timed call of ``impl`` needs (cached per process) and set ``self.call``."""
        raise NotImplementedError

    def setup(self) -> None:
        _steady()
        self._prepare(GATED_IMPL)


class _Baseline(_Gate):
    # Recorded for one commit, never tested: a few samples in one round (torch's get_state_dict with
    # 64 submodules is slow: docs/benchmark-results.md, "Why the benchmarks are shaped so").
    params: tuple[list[str], ...] = ()  #: ([implementation, ...],), set by _baseline_class
    param_names: list[str] = []
    repeat = 3
    rounds = 1
    warmup_time = 0.0


def _steady() -> None:
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


_CACHE: dict[Any, Any] = {}


def _cached(key: Any, build: Callable[[], Any]) -> Any:
    if key not in _CACHE:
        _CACHE[key] = build()
    return _CACHE[key]


def _skip_unavailable(reason: str | None) -> None:
    if reason is not None:
        raise NotImplementedError(reason)


# -- flattening -------------------------------------------------------------------------------------


class GateFlatten(_Gate):
    """CPU seconds to wrap every level of a fresh 1,000-parameter, 4-deep model (``FlatParamOps.wrap``)."""

    def _prepare(self, impl: str) -> None:
        _skip_unavailable(fp.available(impl))
        self.call = fp.flatten_fn(impl, FLATTEN_PARAMS, FLATTEN_DEPTH)  # a fresh model for every call

    def time_flatten(self) -> None:
        self.call()


# -- submodule state_dict ---------------------------------------------------------------------------


class GateGetStateDict(_Gate):
    """CPU seconds of ``StateDictOps.get_state_dict`` (10,000 keys, the 64-submodule filter)."""

    def _prepare(self, impl: str) -> None:
        _skip_unavailable(sd.available(impl))
        self.call = _cached(("get", impl), lambda: sd.get_fn(impl, sd.Case(GET_KEYS), GET_SUBMODULES))

    def time_get_state_dict(self) -> None:
        self.call()


class GateSetStateDict(_Gate):
    """CPU seconds of ``StateDictOps.set_state_dict`` of full dicts (1,000 keys)."""

    def _prepare(self, impl: str) -> None:
        _skip_unavailable(sd.available(impl))
        self.call = _cached(("set", impl), lambda: sd.set_fn(impl, sd.Case(SET_KEYS)))

    def time_set_state_dict(self) -> None:
        self.call()


# -- optimizer state of a sharded model -------------------------------------------------------------


def _one_rank_group() -> bool:
    """A one-rank gloo process group for this benchmark process (sharding needs one), rendezvous in memory."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def _optim_state(impl: str) -> dict[str, Any]:
    """``impl``'s sharded model, optimizer and full optimizer state dict, built once per process."""
    from bench.workloads import optim_state as osw

    _skip_unavailable(osw.available(impl))
    _cached("process group", _one_rank_group)

    def build() -> dict[str, Any]:
        osw.prepare(impl, OPTIM_PARAMS)  # shards, trains a step, gets one state dict (checked)
        return dict(osw._CACHE)

    return _cached(("optim", impl), build)


class GateOptimStateDict(_Gate):
    """CPU seconds of ``OptimStateOps.optim_state_dict``: 1,000 parameters in 10 units, Adam after one
    step, one rank."""

    def _prepare(self, impl: str) -> None:
        state = _optim_state(impl)
        ops, model, optim = state["ops"], state["model"], state["optim"]
        self.call = (lambda: optim.state_dict()) if ops is None else (lambda: ops.optim_state_dict(model, optim))

    def time_optim_state_dict(self) -> None:
        self.call()


class GateLoadOptimStateDict(_Gate):
    """CPU seconds of ``OptimStateOps.load_optim_state_dict`` of that full optimizer state dict."""

    def _prepare(self, impl: str) -> None:
        state = _optim_state(impl)
        ops, model, optim, osd = state["ops"], state["model"], state["optim"], state["osd"]
        self.call = (lambda: optim.load_state_dict(osd)) if ops is None else (
            lambda: ops.load_optim_state_dict(model, optim, osd))

    def time_load_optim_state_dict(self) -> None:
        self.call()


# -- checkpoint save / load -------------------------------------------------------------------------


def _checkpoint_state() -> dict[str, Any]:
    """Model + Adam state as a trainer saves it: ``{"model": ..., "optim": {"state": ..., "param_groups": ...}}``."""
    model: dict[str, torch.Tensor] = {}
    for i in range(CHECKPOINT_LAYERS):
        model[f"layers.{i}.weight"] = torch.full((CHECKPOINT_WIDTH, CHECKPOINT_WIDTH), float(i + 1))
        model[f"layers.{i}.bias"] = torch.full((CHECKPOINT_WIDTH,), float(i + 1))
    state = {name: {"step": torch.tensor(10.0), "exp_avg": torch.full_like(p, 0.5), "exp_avg_sq": torch.full_like(p, 0.25)}
             for name, p in model.items()}
    param_groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": list(model)}]
    return {"model": model, "optim": {"state": state, "param_groups": param_groups}}


def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    return [*state["model"].values(), *(t for entry in state["optim"]["state"].values() for t in entry.values())]


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "optim": {"state": {k: {n: torch.zeros_like(t) for n, t in entry.items()} for k, entry in state["optim"]["state"].items()},
                      "param_groups": [dict(group) for group in state["optim"]["param_groups"]]}}


def _raw_save(state: dict[str, Any], directory: str) -> None:
    with open(os.path.join(directory, "raw.bin"), "wb") as f:
        for tensor in _tensors(state):
            f.write(tensor.numpy().data.cast("B"))
        f.flush()
        os.fsync(f.fileno())


def _raw_load(state: dict[str, Any], directory: str) -> None:
    with open(os.path.join(directory, "raw.bin"), "rb") as f:
        for tensor in _tensors(state):
            f.readinto(tensor.numpy().data.cast("B"))


def _checkpoint_ops(impl: str) -> tuple[Callable[[dict, str], Any], Callable[[dict, str], Any]]:
    """(save, load) of ``impl``: its ``CheckpointOps`` with no process group, or raw file I/O."""
    from bench.workloads import checkpoint as ck

    _skip_unavailable(ck.available(impl))
    if impl == "raw":
        return _raw_save, _raw_load
    ops = _impls.ops(impl, ck.CAPABILITY)
    return (lambda state, d: ops.save(state, d)), (lambda state, d: ops.load(state, d))


def _scratch_root() -> str | None:
    """``/dev/shm`` where it is a writable directory (memory, where fsync costs nothing), else the default."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _new_checkpoint_dir(self: Any, impl: str) -> str:
    """An empty directory for this sample, removed by :func:`_remove_checkpoint_dir` (teardown, which
    asv calls after every sample: nothing is left behind in memory)."""
    self.directory = tempfile.mkdtemp(prefix=f"bench-gate-{impl.replace(':', '-')}-", dir=_scratch_root())
    return self.directory


def _remove_checkpoint_dir(self: Any) -> None:
    directory = getattr(self, "directory", None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
        self.directory = None


class GateCheckpointSave(_Gate):
    """CPU seconds of ``CheckpointOps.save`` of model + Adam state (36 MiB in 96 tensors, and the param
    groups) into an empty directory, no process group."""

    def _prepare(self, impl: str) -> None:
        save, _ = _checkpoint_ops(impl)
        source = _cached("checkpoint source", _checkpoint_state)
        directory = _new_checkpoint_dir(self, impl)
        self.call = lambda: save(source, directory)

    def time_save(self) -> None:
        self.call()

    def teardown(self) -> None:
        _remove_checkpoint_dir(self)


class GateCheckpointLoad(_Gate):
    """CPU seconds of ``CheckpointOps.load`` of that checkpoint (saved by the same implementation in
    ``setup``) into a state dict of the same shapes, no process group."""

    def _prepare(self, impl: str) -> None:
        save, load = _checkpoint_ops(impl)
        source = _cached("checkpoint source", _checkpoint_state)
        dest = _cached(("checkpoint dest", impl), lambda: _zeros_like(source))
        directory = _new_checkpoint_dir(self, impl)
        save(source, directory)
        self.call = lambda: load(dest, directory)

    def time_load(self) -> None:
        self.call()

    def teardown(self) -> None:
        _remove_checkpoint_dir(self)


def _async_stall(impl: str) -> Callable[[dict, str], Any]:
    """``(state, directory) -> pending save``: ``impl``'s async save on its thread executor, returned once
    staging has completed (the stall); for raw, a copy of every tensor (what staging cannot beat)."""
    from bench.workloads import async_save as aw

    if impl == "raw":
        return lambda state, d: [tensor.clone() for tensor in _tensors(state)]
    _skip_unavailable(aw.available(f"{impl}/thread"))
    ops = _impls.ops(impl, aw.CAPABILITY)

    def stall(state: dict, directory: str) -> Any:
        response = ops.async_save(state, directory, executor="thread")
        response.staging_completion.result()
        return response

    return stall


class GateAsyncStall(_Gate):
    """CPU seconds from an async save's call (thread executor, the checkpoint gate's 36 MiB state, no
    process group) until its staging has completed: the stall of training. The background write is
    waited for in ``teardown``, outside the sample."""

    def _prepare(self, impl: str) -> None:
        stall = _async_stall(impl)
        source = _cached("checkpoint source", _checkpoint_state)
        directory = _new_checkpoint_dir(self, impl)
        self.pending = None

        def call() -> None:
            self.pending = stall(source, directory)

        self.call = call

    def time_async_stall(self) -> None:
        self.call()

    def teardown(self) -> None:
        upload = getattr(getattr(self, "pending", None), "upload_completion", None)
        if upload is not None:
            upload.result()
        _remove_checkpoint_dir(self)


#: The classes whose benchmarks decide the gate, one per core call.
GATED: tuple[type[_Gate], ...] = (
    GateFlatten, GateGetStateDict, GateSetStateDict, GateOptimStateDict, GateLoadOptimStateDict,
    GateCheckpointSave, GateCheckpointLoad, GateAsyncStall,
)


def _baseline_impls(upstream: tuple[str, ...]) -> list[str]:
    """What a baseline class times: the upstream baseline, raw, and the reference when it is not gated."""
    names = [*upstream, "raw"] + (["reference"] if GATED_IMPL != "reference" else [])
    return [name for name in names if name != GATED_IMPL]


def _baseline_class(gated: type[_Gate], upstream: tuple[str, ...]) -> type[_Baseline]:
    """``GateBaseline<Name>``: ``gated``'s workload for each of :func:`_baseline_impls`, asv parameter ``impl``."""
    method = next(name for name in vars(gated) if name.startswith("time_"))

    def setup(self: Any, impl: str) -> None:
        _steady()
        gated._prepare(self, impl)

    def timed(self: Any, impl: str) -> None:
        self.call()

    def teardown(self: Any, impl: str) -> None:
        if hasattr(gated, "teardown"):
            gated.teardown(self)  # the async stall waits for its save's write there
        else:
            _remove_checkpoint_dir(self)

    namespace: dict[str, Any] = {
        "__module__": __name__,
        "__doc__": f"``{gated.__name__}`` for {', '.join(_baseline_impls(upstream))}.",
        "params": (_baseline_impls(upstream),),
        "param_names": ["impl"],
        "setup": setup,
        method: timed,
        "teardown": teardown,
    }
    return type(f"GateBaseline{gated.__name__.removeprefix('Gate')}", (_Baseline,), namespace)


GateBaselineFlatten = _baseline_class(GateFlatten, fp.UPSTREAM)
GateBaselineGetStateDict = _baseline_class(GateGetStateDict, sd.UPSTREAM)
GateBaselineSetStateDict = _baseline_class(GateSetStateDict, sd.UPSTREAM)
GateBaselineOptimStateDict = _baseline_class(GateOptimStateDict, ("torch",))
GateBaselineLoadOptimStateDict = _baseline_class(GateLoadOptimStateDict, ("torch",))
GateBaselineCheckpointSave = _baseline_class(GateCheckpointSave, ("torch",))
GateBaselineCheckpointLoad = _baseline_class(GateCheckpointLoad, ("torch",))
GateBaselineAsyncStall = _baseline_class(GateAsyncStall, ("torch",))

#: Timed for the tip commit alongside the gate, never part of its verdict.
BASELINES: tuple[type[_Baseline], ...] = (
    GateBaselineFlatten, GateBaselineGetStateDict, GateBaselineSetStateDict, GateBaselineOptimStateDict,
    GateBaselineLoadOptimStateDict, GateBaselineCheckpointSave, GateBaselineCheckpointLoad, GateBaselineAsyncStall,
)
