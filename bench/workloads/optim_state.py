"""FSDP optimizer-state workloads: a full optimizer state dict and its conversion back, at world size 2.

The model is :func:`~bench.workloads.models.wide_model` with ``params`` parameters in 10 blocks, each
block its own FSDP unit (FULL_SHARD, ``use_orig_params=False``), and Adam after one training step.
Timed on the ranks (best of ``repeats``): ``optim_state_dict(model, optim)`` (the full, FQN-keyed
dict, on every rank) and ``optim_state_dict_to_load(model, optim, osd)``.

Implementations: ``reference`` (``reference.fsdp.FullyShardedDataParallel``), ``torch`` (upstream
FSDP1), and ``raw``: ``optim.state_dict()`` of the unwrapped model on each rank, the work no sharded
implementation can avoid. ``raw`` has no ``optim_state_dict_to_load`` figure: that conversion has no
unsharded counterpart (``optim.load_state_dict``, which follows it in every implementation, is not
part of it).
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.workloads.models import Block, wide_model

__all__ = ["IMPLS", "N_BLOCKS", "available", "prepare", "get_once", "get_step", "to_load_once", "release", "osd_times"]

IMPLS: tuple[str, ...] = ("reference", "torch", "raw")
N_BLOCKS = 10


def available(impl: str) -> str | None:
    """None if ``impl`` can run here, else why not."""
    if impl == "reference" and importlib.util.find_spec("reference.fsdp") is None:
        return "reference.fsdp is not available in this build"
    return None


def _fsdp(impl: str) -> Any:
    if impl == "reference":
        from reference.fsdp import FullyShardedDataParallel
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel
    return FullyShardedDataParallel


def _wrap(impl: str, model: torch.nn.Module) -> torch.nn.Module:
    """Each Block its own unit, FULL_SHARD, use_orig_params=False, on CPU."""
    if impl == "reference":
        policy: Any = {Block}  # the reference takes module classes (or a module -> bool predicate)
    else:
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy({Block})
    return _fsdp(impl)(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))


def _best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    import torch.distributed as dist

    best, result = math.inf, None
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


# This rank's wrapped model, optimizer and last full optimizer state dict, between calls.
_CACHE: dict[str, Any] = {}


def prepare(impl: str, params: int) -> None:
    """Build, wrap and train one step; get one optimizer state dict (nothing timed). Every rank calls."""
    _CACHE.clear()
    torch.manual_seed(0)
    model = wide_model(params, min(N_BLOCKS, params))
    if impl != "raw":
        model = _wrap(impl, model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.zeros(1)).sum().backward()
    optim.step()
    _CACHE.update(impl=impl, params=params, model=model, optim=optim)
    osd = get_once()
    if impl != "raw" and len(osd["state"]) != params:
        raise RuntimeError(f"{impl}: optim_state_dict has {len(osd['state'])} entries, expected {params}")
    _CACHE["osd"] = osd


def get_once() -> dict[str, Any]:
    """``optim_state_dict(model, optim)`` of the prepared model (raw: ``optim.state_dict()``).

    Returns the dict: called through a RankGroup, use :func:`get_step`, which does not send it back."""
    impl, model, optim = _CACHE["impl"], _CACHE["model"], _CACHE["optim"]
    if impl == "raw":
        return optim.state_dict()
    return _fsdp(impl).optim_state_dict(model, optim)


def get_step() -> None:
    """:func:`get_once` for a RankGroup: the state dict stays on the rank."""
    get_once()


def to_load_once() -> None:
    """``optim_state_dict_to_load(model, optim, osd)`` of the prepared model and its state dict."""
    impl = _CACHE["impl"]
    if impl == "raw":
        raise ValueError("optim_state_dict_to_load has no raw counterpart")
    _fsdp(impl).optim_state_dict_to_load(_CACHE["model"], _CACHE["optim"], _CACHE["osd"])


def release() -> None:
    _CACHE.clear()


def osd_times(impl: str, params: int, repeats: int) -> tuple[float, float | None]:
    """(seconds of optim_state_dict, seconds of optim_state_dict_to_load or None for ``raw``) on this
    rank, best of ``repeats``. Every rank calls."""
    prepare(impl, params)
    try:
        get_s, _ = _best(get_once, repeats)
        load_s = None if impl == "raw" else _best(to_load_once, repeats)[0]
        return get_s, load_s
    finally:
        release()
