"""Generated SD-11 on one process: get_state_dict / set_state_dict of plain (or wrapped) models.

Run on the controller (no process group): a plain model's get and set need none.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from conformance.adapters.state_dict import StateDictOps
from conformance.asserts import assert_same_state
from conformance.generated.builders import build, make_optimizer, oracle_params
from conformance.generated.execution import in_one_thread
from conformance.generated.oracles import (
    Labels,
    TrainingState,
    assert_buffers_kept,
    assert_state_matches,
    continue_and_compare,
    fqn_keyed,
    non_persistent_buffers,
    oracle_run,
    warm_target,
)
from conformance.generated.specs import Case

__all__ = ["wrap_for_state_dict", "state_dict_round_trip"]


def wrap_for_state_dict(model: nn.Module, how: str) -> nn.Module:
    """``model`` as the SD tests see it: ``plain``, each direct child activation-checkpoint wrapped in
    place (``checkpoint``), or inside ``torch.compile`` (``compile``; never run, so never compiled)."""
    if how == "checkpoint":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for name, child in list(model.named_children()):
            setattr(model, name, checkpoint_wrapper(child))
        return model
    if how == "compile":
        compiled: nn.Module = torch.compile(model)  # type: ignore[assignment]
        return compiled
    return model


@in_one_thread
def state_dict_round_trip(ops: StateDictOps, case: Case) -> None:
    """SD-11 (with SD-1, SD-2 on the way): get from a model trained ``case.steps`` steps equals the
    unwrapped model's own state dicts; set into a model of another seed whose optimizer has other
    groups, another order and perturbed hyperparameters makes every get equal the saved one, bitwise;
    ``case.more_steps`` more steps then equal the run that never stopped, bitwise (one process: the
    same arithmetic)."""
    __tracebackhide__ = True
    spec = case.model
    how, flatten = case.option("wrapper"), case.option("flatten_optimizer_state_dict")
    options = ops.options(flatten_optimizer_state_dict=flatten)
    where = f"wrapper {how}"
    oracle = oracle_run(case, case.steps)
    source, source_optim = oracle_run(case, case.steps)
    model_sd, optim_sd = ops.get_state_dict(wrap_for_state_dict(source, how), source_optim, options=options)
    got_labels = Labels("get_state_dict: model state dict vs nn.Module.state_dict()",
        None if flatten else "get_state_dict: optimizer state dict vs Optimizer.state_dict() by FQN")
    assert_state_matches(spec, TrainingState(model_sd, optim_sd), TrainingState(oracle[0].state_dict(), fqn_keyed(*oracle)), got_labels, where=where)
    saved = copy.deepcopy((model_sd, optim_sd))  # as through a file: the target must not share tensors with the source

    target = build(spec, 1)
    target_optim = make_optimizer(case.optimizer, case.target, oracle_params(target), perturb=True)
    warm_target(case, target, target_optim, "cpu")
    before = non_persistent_buffers(spec, target)
    model_in, optim_in = copy.deepcopy(saved)
    ops.set_state_dict(wrap_for_state_dict(target, how), target_optim, model_state_dict=model_in, optim_state_dict=optim_in, options=options)
    again_model, again_optim = ops.get_state_dict(target, target_optim, options=options)
    again_labels = Labels("get after set: model state dict vs the saved one", None if flatten else "get after set: optimizer state dict vs the saved one")
    assert_state_matches(spec, TrainingState(again_model, again_optim), TrainingState(*saved), again_labels, where=where)
    if flatten:  # keyed by flattened paths, not by parameter: compared as nested state
        assert_same_state(again_optim, saved[1], what="get after set: flattened optimizer state dict vs the saved one", where=where,
            check_order=False)
    assert_buffers_kept(spec, target, before, by="set_state_dict", where=where)

    continue_and_compare(case, oracle, (target, target_optim), lambda: TrainingState(target.state_dict(), fqn_keyed(target, target_optim)),
        where=f"wrapper {how}, {case.more_steps} more step(s) after the load")
