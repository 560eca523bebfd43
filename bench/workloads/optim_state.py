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

__all__ = ["IMPLS", "N_BLOCKS", "available", "osd_times"]

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
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return _fsdp(impl)(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))


def _best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    import torch.distributed as dist

    best, result = math.inf, None
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def osd_times(impl: str, params: int, repeats: int) -> tuple[float, float | None]:
    """(seconds of optim_state_dict, seconds of optim_state_dict_to_load or None for ``raw``) on this
    rank, best of ``repeats``. Every rank calls."""
    torch.manual_seed(0)
    model = wide_model(params, min(N_BLOCKS, params))
    if impl != "raw":
        model = _wrap(impl, model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.zeros(1)).sum().backward()
    optim.step()
    if impl == "raw":
        get_s, _ = _best(optim.state_dict, repeats)
        return get_s, None
    fsdp = _fsdp(impl)
    get_s, osd = _best(lambda: fsdp.optim_state_dict(model, optim), repeats)
    if len(osd["state"]) != params:
        raise RuntimeError(f"{impl}: optim_state_dict has {len(osd['state'])} entries, expected {params}")
    load_s, _ = _best(lambda: fsdp.optim_state_dict_to_load(model, optim, osd), repeats)
    return get_s, load_s
