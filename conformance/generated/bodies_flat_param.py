"""Generated FP-6, FP-8, FP-9, FP-12, FP-13: FlattenParamsWrappers at drawn modules, on one process.

A wrapped model's optimizer holds flat parameters; to compare it with the unwrapped oracle its state
is cut back into its parameters' pieces (:func:`flat_fqn_keyed`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from conformance.adapters.flat_param import FlatParamOps
from conformance.fqn import canonical_fqn
from conformance.generated.builders import build, make_optimizer
from conformance.generated.execution import in_one_thread
from conformance.generated.oracles import (
    Labels,
    TrainingState,
    assert_buffers_kept,
    assert_model_matches,
    assert_state_matches,
    continue_and_compare,
    fqn_keyed,
    non_persistent_buffers,
    oracle_run,
    train_steps,
    warm_target,
)
from conformance.generated.specs import Case, ModelSpec, join_path

__all__ = ["wrap_flat", "flat_named_params", "flat_fqn_keyed", "flat_param_round_trip"]

NamedParams = list[tuple[tuple[str, ...], nn.Parameter]]


def _parent(path: str) -> tuple[str, str]:
    head, _, name = path.rpartition(".")
    return head, name


def wrap_flat(
    ops: FlatParamOps, spec: ModelSpec, model: nn.Module, lists: Sequence[tuple[str, Sequence[str]]]
) -> tuple[nn.Module, list[tuple[str, nn.Module]]]:
    """Wrap ``model`` at each path of ``lists`` (innermost first) flattening the listed key FQNs, in
    that order. Returns the model (the root wrapper when the root is wrapped) and (path, wrapper) pairs."""
    modules = {path: model.get_submodule(path) for path, _ in spec.nodes()}
    params = dict(model.named_parameters())
    wrappers = []
    root = model
    for path, keys in lists:
        wrapper = ops.wrap(modules[path], [params[k] for k in keys])
        wrappers.append((path, wrapper))
        if path:
            parent, name = _parent(path)
            setattr(modules[parent], name, wrapper)
        else:
            root = wrapper
    return root, wrappers


def flat_named_params(ops: FlatParamOps, spec: ModelSpec, model: nn.Module, wrappers: Sequence[tuple[str, nn.Module]]) -> NamedParams:
    """Every parameter of the wrapped ``model`` with the key FQNs it stands for (a flat parameter: those
    of its parameters, in flat order)."""
    key_of = {e.fqn: e.key for e in spec.params()}
    flats: dict[int, tuple[str, ...]] = {}
    for path, wrapper in wrappers:
        flat = ops.flat_param(wrapper)
        if flat is not None:
            flats[id(flat)] = tuple(key_of[canonical_fqn(join_path(path, n))] for n in ops.info(flat).names)
    out = []
    for name, param in model.named_parameters():
        out.append((flats[id(param)] if id(param) in flats else (key_of[canonical_fqn(name)],), param))
    return out


def flat_fqn_keyed(ops: FlatParamOps, named: Sequence[tuple[tuple[str, ...], nn.Parameter]], optim: torch.optim.Optimizer, spec: ModelSpec) -> dict[str, Any]:
    """The wrapped model's optimizer state keyed by FQN: a flat parameter's positional state cut into
    its parameters' pieces (flat order, their shapes), its scalar state given to each."""
    shapes = {e.key: e.shape for e in spec.params()}
    fqns_of = {id(p): fqns for fqns, p in named}
    osd = optim.state_dict()
    ids = [p for g in optim.param_groups for p in g["params"]]
    state: dict[str, Any] = {}
    for pid, entry in osd["state"].items():
        param = ids[pid]
        fqns = fqns_of[id(param)]
        if len(fqns) == 1 and not ops.is_flat_param(param):
            state[fqns[0]] = entry
            continue
        offset = 0
        for fqn in fqns:
            numel = math.prod(shapes[fqn])
            state[fqn] = {
                k: (v.reshape(-1)[offset : offset + numel].reshape(shapes[fqn]) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                for k, v in entry.items()
            }
            offset += numel
    groups = [{**g, "params": [f for pid in g["params"] for f in fqns_of[id(ids[pid])]]} for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


@in_one_thread
def flat_param_round_trip(ops: FlatParamOps, case: Case) -> None:
    """FP-8, FP-12, FP-13 (with FP-6, FP-9 on the way): the wrapped model trains like the unwrapped one
    and shows its state dict, bitwise; its state dict loads (strict) into a model of another seed
    wrapped with another ``param_list`` order, and the optimizer state into that model's optimizer;
    ``case.more_steps`` more steps equal the run that never stopped, bitwise; the unwrapped model
    loads the wrapped one's state dict."""
    __tracebackhide__ = True
    spec = case.model
    oracle = oracle_run(case, case.steps)
    source, source_wrappers = wrap_flat(ops, spec, build(spec, 0), case.option("_source_lists"))
    source_named = flat_named_params(ops, spec, source, source_wrappers)
    source_optim = make_optimizer(case.optimizer, case.source, source_named)
    train_steps(spec, (source, source_optim), range(case.steps))
    assert_state_matches(spec, TrainingState(source.state_dict(), flat_fqn_keyed(ops, source_named, source_optim, spec)),
        TrainingState(oracle[0].state_dict(), fqn_keyed(*oracle)),
        Labels("wrapped state_dict() vs the unwrapped model trained identically", "flat optimizer state vs the unwrapped model's"),
        where=f"after {case.steps} steps")
    saved = copy.deepcopy((source.state_dict(), source_optim.state_dict()))

    target, target_wrappers = wrap_flat(ops, spec, build(spec, 1), case.option("_target_lists"))
    target_named = flat_named_params(ops, spec, target, target_wrappers)
    target_optim = make_optimizer(case.optimizer, case.target, target_named, perturb=True)
    warm_target(case, target, target_optim, "cpu")
    before = non_persistent_buffers(spec, target)
    model_in, optim_in = copy.deepcopy(saved)
    target.load_state_dict(model_in)
    target_optim.load_state_dict(optim_in)
    where = "target wrapped with the target param_list order, right after the load"
    assert_model_matches(spec, target.state_dict(), saved[0], what="state_dict() after load_state_dict vs the saved one", where=where)
    assert_buffers_kept(spec, target, before, by="load_state_dict", where=where)
    continue_and_compare(case, oracle, (target, target_optim),
        lambda: TrainingState(target.state_dict(), flat_fqn_keyed(ops, target_named, target_optim, spec)),
        Labels("model vs the unwrapped run that never stopped", "flat optimizer state vs the unwrapped run that never stopped"),
        where=f"{case.more_steps} more step(s) after the load")
    plain = build(spec, 2)
    plain.load_state_dict(target.state_dict())
    assert_model_matches(spec, plain.state_dict(), target.state_dict(), what="the unwrapped model after loading the wrapped model's state_dict()",
        where="FP-13, wrapped to unwrapped")
