"""Generated ML-1, ML-8: sharded model and optimizer state saved through the adapter's checkpoint ops
at one world size and loaded at another.

Rank bodies: :func:`checkpoint_save` on the saving pool, then :func:`checkpoint_load` on the loading
pool with the path (a directory of the controller) and what rank 0 of the save returned.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from conformance.adapters.base import Adapter
from conformance.adapters.checkpoint import CheckpointOps
from conformance.adapters.sharding import ShardingOps, ShardingPlan
from conformance.fqn import canonical_fqn
from conformance.generated.builders import build, make_optimizer
from conformance.generated.execution import in_one_thread, rank_slice
from conformance.generated.oracles import (
    Labels,
    TrainingState,
    assert_buffers_kept,
    assert_local_state,
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
from conformance.generated.specs import Case, OptimPlan
from conformance.harness.context import RankContext

__all__ = ["checkpoint_save", "checkpoint_load"]


class CheckpointRun(NamedTuple):
    """A model the adapter sharded (one unit, its own way), its optimizer, and the checkpoint ops."""

    ops: CheckpointOps
    model: nn.Module
    optim: torch.optim.Optimizer


def _ml_run(ctx: RankContext, impl: Adapter, case: Case, seed: int, plan: OptimPlan, *, perturb: bool) -> CheckpointRun:
    ops: CheckpointOps = impl.require("checkpoint")
    sharder: ShardingOps = impl.require("sharding")
    model = sharder.shard(build(case.model, seed, ctx.device), ShardingPlan(use_orig_params=True, device=ctx.device, mesh=ctx.mesh()))
    optim = make_optimizer(case.optimizer, plan, [((canonical_fqn(n),), p) for n, p in model.named_parameters()], perturb=perturb)
    return CheckpointRun(ops, model, optim)


def _state_dicts(run: CheckpointRun) -> TrainingState:
    """The run's sharded state dicts as the checkpoint ops return them (DTensors, not gathered)."""
    return TrainingState(*run.ops.get_state_dicts(run.model, run.optim))


@in_one_thread
def checkpoint_save(ctx: RankContext, impl: Adapter, case: Case, path: str) -> TrainingState | None:
    """Train the sharded source next to the oracle, save its sharded model and optimizer state dicts to
    ``path``; return their full values (CPU) from rank 0 (None from the other ranks)."""
    run = _ml_run(ctx, impl, case, 0, case.source, perturb=False)
    oracle = oracle_run(case, case.steps, ctx.device)
    train_steps(case.model, (run.model, run.optim), range(case.steps), ctx.device, rank_slice(ctx))
    raw = _state_dicts(run)
    run.ops.save({"model": raw.model, "optim": raw.optim}, path, process_group=ctx.group)
    full = TrainingState(to_cpu(raw.model), to_cpu(raw.optim))
    atol, rtol = tolerance(case.model)
    where = f"rank {ctx.rank}, saving side at world size {ctx.world_size}, after {case.steps} steps"
    expected = oracle_state(oracle)
    assert_local_state(raw, expected, Labels("sharded model state dict", "sharded optimizer state dict"), where=where, atol=atol, rtol=rtol)
    assert_state_matches(case.model, full, expected,
        Labels("sharded model state dict vs the unwrapped model", "sharded optimizer state dict vs the unwrapped model"),
        where=where, atol=atol, rtol=rtol, check_order=False)
    return full if ctx.rank == 0 else None


@in_one_thread
def checkpoint_load(ctx: RankContext, impl: Adapter, case: Case, path: str, saved: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """Load the checkpoint at ``path`` into a sharded target of another seed (its optimizer in another
    order, hyperparameters perturbed, state of its own); every value equals the saved one bitwise;
    after ``case.more_steps`` more steps it matches the oracle that never stopped (ML-1, ML-8)."""
    run = _ml_run(ctx, impl, case, 1, case.target, perturb=True)
    warm_target(case, run.model, run.optim, ctx.device, rank_slice(ctx))
    before = non_persistent_buffers(case.model, run.model)
    model_sd, optim_sd = run.ops.get_state_dicts(run.model, run.optim)
    state = {"model": model_sd, "optim": optim_sd}
    run.ops.load(state, path, process_group=ctx.group)
    run.ops.set_state_dicts(run.model, run.optim, state["model"], state["optim"])
    where = f"rank {ctx.rank}, loading side at world size {ctx.world_size}"
    expected = TrainingState(*saved)
    raw = _state_dicts(run)
    assert_local_state(raw, expected, Labels("model state right after the load", "optimizer state right after the load"), where=where)
    assert_state_matches(case.model, TrainingState(to_cpu(raw.model), to_cpu(raw.optim)), expected,
        Labels("model state right after the load vs the saved one", "optimizer state right after the load vs the saved one"),
        where=where, check_order=False)
    assert_buffers_kept(case.model, run.model, before, by="a load", where=where)
    atol, rtol = tolerance(case.model)
    continue_and_compare(case, oracle_run(case, case.steps, ctx.device), (run.model, run.optim),
        lambda: TrainingState(*(to_cpu(sd) for sd in run.ops.get_state_dicts(run.model, run.optim))),
        where=f"{where}, {case.more_steps} more step(s) after the load", device=ctx.device, local=rank_slice(ctx), atol=atol, rtol=rtol,
        check_order=False)
