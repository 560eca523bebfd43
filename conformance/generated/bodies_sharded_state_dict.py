"""Generated SD-12, SD-13 (with SD-11): get_state_dict / set_state_dict of models the adapter shards.

Rank bodies, run on every rank of a pool by ``pools.run(world_size, body, impl, case)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from conformance.adapters.base import Adapter, Unsupported
from conformance.adapters.sharding import ShardingPlan, child_units
from conformance.adapters.state_dict import StateDictOps
from conformance.fqn import canonical_fqn
from conformance.generated.builders import build, make_optimizer
from conformance.generated.execution import Refused, in_one_thread, rank_slice
from conformance.generated.layout import owner_unit
from conformance.generated.oracles import (
    NEVER_STOPPED,
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
from conformance.generated.specs import Case, ModelSpec, Sharding
from conformance.harness.context import RankContext

__all__ = ["sd_named_params", "sharded_state_dict_round_trip"]


def sd_named_params(spec: ModelSpec, units: Sequence[str], model: nn.Module) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    """Parameters of a model sharded by :meth:`StateDictOps.shard` with the key FQNs each stands for: a
    flat parameter (``<unit>._flat_param``) stands for the trainable keys its unit owns."""
    keys = {e.key for e in spec.params()}
    owned: dict[str, list[str]] = {}
    for entry in spec.params():
        if entry.fqn == entry.key:
            owned.setdefault(owner_unit(entry.owner, units), []).append(entry.key)
    out: list[tuple[tuple[str, ...], nn.Parameter]] = []
    for name, param in model.named_parameters():
        clean = canonical_fqn(name)
        if clean in keys:
            out.append(((clean,), param))
        else:
            unit = clean.rpartition(".")[0]
            out.append((tuple(owned.get(unit, ())), param))
    return out


def _sd_shard(impl: Adapter, case: Case, sharding: Sharding, seed: int, device: torch.device) -> nn.Module:
    """The SD tests' sharding (see conformance.test_state_dict.sd_shard); Unsupported if the adapter lacks it."""
    model = build(case.model, seed, device)
    return impl.sharding().shard(model, ShardingPlan(strategy=sharding.strategy, units=child_units(model), device=device))


@in_one_thread
def sharded_state_dict_round_trip(ctx: RankContext, impl: Adapter, case: Case) -> Refused | None:
    """SD-12/SD-13 (and SD-11 on sharded models): get_state_dict of a sharded model trained next to the
    unwrapped one equals it (within the tolerance of averaged gradients); set into a sharded model of
    another seed (optimizer reordered, perturbed, with state of its own) gives back the saved values
    bitwise; training on matches the run that never stopped."""
    assert case.save is not None and case.load is not None
    ops: StateDictOps = impl.require("state_dict")
    full = case.option("state dicts", "").startswith("full")
    options = ops.options(full_state_dict=full)
    full_options = ops.options(full_state_dict=True)
    spec = case.model
    try:
        source = _sd_shard(impl, case, case.save, 0, ctx.device)
        target = _sd_shard(impl, case, case.load, 1, ctx.device)
    except Unsupported as exc:
        return Refused(str(exc))
    optim = make_optimizer(case.optimizer, case.source, sd_named_params(spec, case.save.units, source))
    oracle = oracle_run(case, case.steps, ctx.device)
    train_steps(spec, (source, optim), range(case.steps), ctx.device, rank_slice(ctx))
    atol, rtol = tolerance(spec)
    where = f"rank {ctx.rank}, world size {ctx.world_size}, source {case.save.strategy}, after {case.steps} steps"
    raw = TrainingState(*ops.get_state_dict(source, optim, options=options))
    expected = oracle_state(oracle)
    assert_local_state(raw, expected, Labels("get_state_dict: model", "get_state_dict: optimizer"), where=where, atol=atol, rtol=rtol)
    saved = TrainingState(to_cpu(raw.model), to_cpu(raw.optim))
    assert_state_matches(spec, saved, expected, Labels("get_state_dict: model vs the unwrapped model", "get_state_dict: optimizer vs the unwrapped model"),
        where=where, atol=atol, rtol=rtol, check_order=False)

    target_optim = make_optimizer(case.optimizer, case.target, sd_named_params(spec, case.load.units, target), perturb=True)
    warm_target(case, target, target_optim, ctx.device, rank_slice(ctx))
    before = non_persistent_buffers(spec, target)
    ops.set_state_dict(target, target_optim, model_state_dict=raw.model, optim_state_dict=raw.optim, options=options)
    where = f"rank {ctx.rank}, world size {ctx.world_size}, target {case.load.strategy}, right after set_state_dict"
    again_raw = TrainingState(*ops.get_state_dict(target, target_optim, options=options))
    assert_local_state(again_raw, saved, Labels("get after set: model", "get after set: optimizer"), where=where)
    again = TrainingState(to_cpu(again_raw.model), to_cpu(again_raw.optim))
    assert_state_matches(spec, again, saved, Labels("get after set: model vs the saved one", "get after set: optimizer vs the saved one"), where=where,
        check_order=False)
    assert_buffers_kept(spec, target, before, by="set_state_dict", where=where)
    continue_and_compare(case, oracle, (target, target_optim),
        lambda: TrainingState(*(to_cpu(sd) for sd in ops.get_state_dict(target, target_optim, options=full_options))), NEVER_STOPPED,
        where=f"rank {ctx.rank}, world size {ctx.world_size}, target {case.load.strategy}, {case.more_steps} more step(s)", device=ctx.device,
        local=rank_slice(ctx), atol=atol, rtol=rtol, check_order=False)
    return None
