"""Sharded optimizer-state workloads: the full optimizer state dict and loading it back, at world size 2.

The model is :func:`~bench.workloads.models.wide_model` with ``params`` parameters in 10 blocks, each
block its own unit, sharded by the adapter's ``sharding()`` (``ShardingPlan``: FULL_SHARD, flat
parameters, on CPU; an implementation without flat parameters, such as ``fully_shard``, shards with
its own choice instead), and Adam after one training step. Timed on the ranks (best of ``repeats``),
through the adapter's ``OptimStateOps``:

``get``
    ``optim_state_dict(model, optim)``: the full, FQN-keyed dict, on every rank.
``load``
    ``load_optim_state_dict(model, optim, osd)`` of that dict: for FSDP, ``optim_state_dict_to_load``
    and ``optim.load_state_dict`` of its result.

Implementations (:func:`impls`): the reference, torch (FSDP1) and the implementations under test
(``BENCH_IMPL``, see :mod:`bench.impls`); and ``raw``: ``optim.state_dict()`` /
``optim.load_state_dict()`` of the unwrapped model on each rank, the work no sharded implementation
can avoid.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from bench import impls as _impls
from bench.workloads.models import Block, wide_model

__all__ = ["CAPABILITY", "UPSTREAM", "N_BLOCKS", "impls", "available", "plan", "prepare", "get_once", "get_step",
           "load_once", "release", "osd_times"]

CAPABILITY = "optim_state"
#: The upstream baseline of this family (FSDP1).
UPSTREAM: tuple[str, ...] = ("torch",)
N_BLOCKS = 10


def impls() -> list[str]:
    """reference, torch, the implementations under test, raw."""
    return _impls.family(UPSTREAM)


def available(impl: str) -> str | None:
    """None if ``impl`` can run here, else why not (its adapter lacks ``OptimStateOps`` or sharding)."""
    return _impls.unavailable(impl, CAPABILITY) or _impls.unavailable(impl, "sharding")


def _is_block(module: torch.nn.Module) -> bool:
    return isinstance(module, Block)


def plan(impl: str) -> Any:
    """The ``ShardingPlan`` of ``impl``: each Block a unit, FULL_SHARD on CPU, flat parameters where the
    implementation has them (else its own choice). Raises ``Unsupported`` when it can shard neither way."""
    from conformance.adapters.base import Unsupported
    from conformance.adapters.sharding import ShardingPlan

    sharding = _impls.ops(impl, "sharding")
    reasons = []
    for use_orig_params in (False, None):
        candidate = ShardingPlan("FULL_SHARD", use_orig_params=use_orig_params, units=_is_block, device=torch.device("cpu"))
        reason = sharding.unsupported(candidate)
        if reason is None:
            return candidate
        reasons.append(reason)
    raise Unsupported(f"{impl} cannot shard the benchmark model: {'; '.join(reasons)}")


def _best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    import torch.distributed as dist

    best, result = math.inf, None
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


# This rank's sharded model, optimizer, ops and last full optimizer state dict, between calls.
_CACHE: dict[str, Any] = {}


def prepare(impl: str, params: int) -> None:
    """Build, shard and train one step; get one optimizer state dict and check it holds every parameter
    (nothing timed). Every rank calls."""
    _CACHE.clear()
    torch.manual_seed(0)
    model: torch.nn.Module = wide_model(params, min(N_BLOCKS, params))
    ops = None
    if _impls.is_adapter(impl):
        model = _impls.ops(impl, "sharding").shard(model, plan(impl))
        ops = _impls.ops(impl, CAPABILITY)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.zeros(1)).sum().backward()
    optim.step()
    _CACHE.update(impl=impl, params=params, model=model, optim=optim, ops=ops)
    osd = get_once()
    if ops is not None and len(osd["state"]) != params:
        raise RuntimeError(f"{impl}: optim_state_dict has {len(osd['state'])} entries, expected {params}")
    _CACHE["osd"] = osd


def get_once() -> dict[str, Any]:
    """``optim_state_dict(model, optim)`` of the prepared model (raw: ``optim.state_dict()``).

    Returns the dict: called through a RankGroup, use :func:`get_step`, which does not send it back."""
    ops, model, optim = _CACHE["ops"], _CACHE["model"], _CACHE["optim"]
    if ops is None:
        return optim.state_dict()
    state: dict[str, Any] = ops.optim_state_dict(model, optim)
    return state


def get_step() -> None:
    """:func:`get_once` for a RankGroup: the state dict stays on the rank."""
    get_once()


def load_once() -> None:
    """Load the prepared optimizer state dict back: ``load_optim_state_dict(model, optim, osd)`` (raw:
    ``optim.load_state_dict(osd)``)."""
    ops, model, optim, osd = _CACHE["ops"], _CACHE["model"], _CACHE["optim"], _CACHE["osd"]
    if ops is None:
        optim.load_state_dict(osd)
    else:
        ops.load_optim_state_dict(model, optim, osd)


def release() -> None:
    _CACHE.clear()


def osd_times(impl: str, params: int, repeats: int) -> tuple[float, float]:
    """(seconds of optim_state_dict, seconds of loading it back) on this rank, best of ``repeats``. Every
    rank calls."""
    prepare(impl, params)
    try:
        return _best(get_once, repeats)[0], _best(load_once, repeats)[0]
    finally:
        release()
