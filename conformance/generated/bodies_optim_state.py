"""Generated OS-1, OS-3, OS-5, OS-6, OS-7 (and OS-10..12): optimizer state dicts of sharded models,
saved under one sharding and loaded under another.

Rank bodies, run on every rank of a pool: :func:`optim_state_both` when both sides have one world
size, else :func:`optim_state_save` on one pool and :func:`optim_state_load` on the other, with what
the first returned.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from conformance.adapters.base import Adapter, Unsupported
from conformance.adapters.optim_state import OptimStateOps
from conformance.adapters.sharding import ShardingOps, ShardingPlan
from conformance.fqn import canonical_fqn
from conformance.generated.builders import build, make_optimizer
from conformance.generated.execution import Refused, in_one_thread, rank_slice
from conformance.generated.oracles import (
    Labels,
    TrainingState,
    assert_buffers_kept,
    assert_local_shards,
    assert_state_matches,
    continue_and_compare,
    non_persistent_buffers,
    oracle_run,
    oracle_state,
    to_cpu,
    tolerance,
    train_steps,
    warm_target,
)
from conformance.generated.specs import Case, OptimPlan, Sharding
from conformance.harness.context import RankContext
from conformance.optim_state_support import attach_optimizer

__all__ = ["SavedRun", "optim_state_save", "optim_state_load", "optim_state_both"]


class ShardedRun(NamedTuple):
    """A model the adapter sharded, its optimizer, and the adapter's ops for both."""

    ops: OptimStateOps
    model: nn.Module
    optim: torch.optim.Optimizer


class SavedRun(NamedTuple):
    """What :func:`optim_state_save` returns with ``keep``: the run, and its full state dicts (CPU)."""

    run: ShardedRun
    model_sd: dict[str, Any]
    full_osd: dict[str, Any]


def _os_run(ctx: RankContext, impl: Adapter, case: Case, sharding: Sharding, seed: int, plan: OptimPlan, *, perturb: bool) -> ShardedRun:
    """Model of ``seed`` sharded as ``sharding`` by the adapter, and its optimizer laid out by ``plan``."""
    ops: OptimStateOps = impl.require("optim_state")
    model = build(case.model, seed, ctx.device)
    unit_ids = {id(model.get_submodule(path)) for path in sharding.units}
    sharding_plan = ShardingPlan(sharding.strategy, sharding.use_orig_params, units=lambda m: id(m) in unit_ids, device=ctx.device)
    sharder: ShardingOps = impl.require("sharding")
    wrapped = sharder.shard(model, sharding_plan)
    optim = make_optimizer(case.optimizer, plan, [(tuple(canonical_fqn(f) for f in fqns), p) for fqns, p in ops.optimizer_params(wrapped)], perturb=perturb)
    return ShardedRun(ops, wrapped, attach_optimizer(ops, wrapped, optim))


def _full_state(run: ShardedRun) -> TrainingState:
    """The run's full model and optimizer state dicts, on the CPU (collective)."""
    return TrainingState(to_cpu(run.ops.full_state_dict(run.model)), to_cpu(run.ops.optim_state_dict(run.model, run.optim)))


def _save(ctx: RankContext, impl: Adapter, case: Case) -> SavedRun | Refused:
    assert case.save is not None
    try:
        run = _os_run(ctx, impl, case, case.save, 0, case.source, perturb=False)
    except Unsupported as exc:
        return Refused(str(exc))
    oracle = oracle_run(case, case.steps, ctx.device)
    train_steps(case.model, (run.model, run.optim), range(case.steps), ctx.device, rank_slice(ctx))
    atol, rtol = tolerance(case.model)
    where = f"rank {ctx.rank}, saving side ({case.save.describe()}), after {case.steps} steps"
    full = _full_state(run)
    assert_state_matches(case.model, full, oracle_state(oracle),
        Labels("full model state dict vs the unwrapped model", "full optimizer state dict vs the unwrapped model"),
        where=where, atol=atol, rtol=rtol, check_order=False)
    return SavedRun(run, full.model, full.optim)


@in_one_thread
def optim_state_save(ctx: RankContext, impl: Adapter, case: Case) -> tuple[dict[str, Any], dict[str, Any]] | Refused:
    """Train the source sharded run ``case.steps`` steps next to the oracle; check it (OS-1, OS-3) and
    return the full model and optimizer state dicts (CPU, every rank)."""
    saved = _save(ctx, impl, case)
    if isinstance(saved, Refused):
        return saved
    return saved.model_sd, saved.full_osd


@in_one_thread
def optim_state_load(ctx: RankContext, impl: Adapter, case: Case, saved: tuple[dict[str, Any], dict[str, Any], dict[str, Any]]) -> Refused | None:
    """Load what the source saved (full model state dict, full optimizer state dict, the optimizer
    state dict to load) into a target of another seed, sharded as ``case.load``, whose optimizer has
    the target plan and perturbed hyperparameters; check the load bitwise, continue
    ``case.more_steps`` steps, and compare with the oracle that never stopped (OS-6, OS-7)."""
    assert case.load is not None
    model_sd, osd, to_load = saved
    try:
        run = _os_run(ctx, impl, case, case.load, 1, case.target, perturb=True)
    except Unsupported as exc:
        return Refused(str(exc))
    ops, model, optim = run
    warm_target(case, model, optim, ctx.device, rank_slice(ctx))
    before = non_persistent_buffers(case.model, model)
    where = f"rank {ctx.rank}, loading side ({case.load.describe()})"
    ops.load_full_state_dict(model, {k: v.to(ctx.device) for k, v in model_sd.items()})
    ops.load_optim_state_dict(model, optim, to_load)
    assert_state_matches(case.model, _full_state(run), TrainingState(model_sd, osd),
        Labels("full model state dict right after the load vs the saved one", "optimizer state dict right after the load vs the saved one"),
        where=where, check_order=False)
    assert_buffers_kept(case.model, model, before, by="a load", where=where)
    atol, rtol = tolerance(case.model)
    continue_and_compare(case, oracle_run(case, case.steps, ctx.device), (model, optim), lambda: _full_state(run),
        where=f"{where}, {case.more_steps} more step(s) after the load", device=ctx.device, local=rank_slice(ctx), atol=atol, rtol=rtol,
        check_order=False)
    return None


@in_one_thread
def optim_state_both(ctx: RankContext, impl: Adapter, case: Case) -> Refused | None:
    """Save and load in one pool (the same world size); the sharded optimizer state dict is checked rank by
    rank against the full one (OS-5) and passed as is."""
    assert case.save is not None
    kept = _save(ctx, impl, case)
    if isinstance(kept, Refused):
        return kept
    to_load = kept.full_osd
    if case.option("optimizer state dict") != "full":
        to_load = kept.run.ops.optim_state_dict(kept.run.model, kept.run.optim, sharded=True)
        # OS-5 on each rank: every DTensor's local shard is its piece of the full state dict's value.
        assert_local_shards(to_load, kept.full_osd, what="sharded optimizer state dict", where=f"rank {ctx.rank}, saving side ({case.save.describe()})")
    return optim_state_load(ctx, impl, case, (kept.model_sd, kept.full_osd, to_load))
