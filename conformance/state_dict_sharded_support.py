"""The set-up of test_state_dict.py's tests on sharded models, beside ``state_dict_support.py``: a
sharded model and its unwrapped oracle trained alike (:class:`Sharded`, :func:`sharded_pair`) and a
target differing from them (:func:`sharded_target`), used by SD-3, SD-7, SD-8, SD-11 to SD-13, SD-15
and SD-18; the checks of a sharded get (:func:`assert_dtensor_params`, :func:`assert_planned_get`:
SD-11, SD-13); models of DTensor parameters without FSDP (:func:`dtensor_model`: SD-8, SD-12, SD-19);
rank 0's state broadcast to the others (:func:`oracle_state`, :func:`broadcast_target`,
:func:`check_broadcast_result`: SD-7, SD-14, SD-16, SD-34); a set with a wrong input on some ranks of a
sharded model (:func:`sharded_error_run`: the cases of :data:`~conformance.state_dict_support.ERROR_CASES`);
and the form of a get (:func:`form_of`: SD-18)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from conformance import models as zoo
from conformance.adapters.base import Adapter, Unsupported
from conformance.adapters.sharding import strategy_layout
from conformance.adapters.state_dict import StateDictOps
from conformance.asserts import (
    WRAPPER_SEGMENTS,
    assert_planned_shard,
    assert_same_error_on_every_rank,
    assert_same_state,
    assert_unchanged,
    check_each,
    expect_error,
    fail,
    raised,
    snapshot,
)
from conformance.compare import fqn_keyed_optim
from conformance.harness.context import RankContext
from conformance.state_dict_support import (
    ATOL,
    ERROR_CASES,
    ERROR_CLAUSES,
    RTOL,
    add_source_extras,
    assert_same_optim,
    break_input,
    check_error,
    error_options,
    plain_pair,
    sd_ops,
    sd_shard,
    target_optimizer,
    train,
)
from conformance.values import different_like

__all__ = [
    "single_group_adam",
    "Sharded",
    "sharded_pair",
    "sharded_target",
    "assert_dtensor_params",
    "assert_planned_get",
    "dtensor_model",
    "strict_load_into_dtensor_parameters_without",
    "oracle_state",
    "broadcast_target",
    "check_broadcast_result",
    "hyperparameters",
    "sharded_error_run",
    "form_of",
]


def single_group_adam(model: nn.Module) -> torch.optim.Optimizer:
    """One group with the source extras: FSDP1 presents flattened views, so grouping by parameter shape
    is not portable across implementations."""
    params = [p for p in model.parameters() if p.requires_grad]
    return add_source_extras(torch.optim.Adam(params, lr=0.01, weight_decay=0.01))


@dataclass
class Sharded:
    """A sharded model and its optimizer, and the unwrapped oracle and its optimizer, trained alike."""

    model: nn.Module
    optim: torch.optim.Optimizer
    oracle: nn.Module
    oracle_optim: torch.optim.Optimizer

    def train(self, name: str, seeds: range, device: Any) -> None:
        """Every rank sees the same batches, so the averaged gradient equals the single-process one."""
        for seed in seeds:
            batch = zoo.batch(name, seed=seed, device=device)
            zoo.train_step(self.oracle, self.oracle_optim, batch)
            zoo.train_step(self.model, self.optim, batch)


def sharded_pair(impl: Adapter, dist: RankContext, name: str, strategy: str = "FULL_SHARD", steps: int = 2) -> Sharded:
    """Zoo ``name`` (seed 0) sharded with ``strategy`` and unwrapped, ``steps`` steps each; a skip if
    the implementation lacks the strategy."""
    oracle = zoo.build(name, seed=0, device=dist.device)
    try:
        model = sd_shard(impl, zoo.build(name, seed=0, device=dist.device), dist.device, strategy)
    except Unsupported as exc:
        pytest.skip(f"sharding {strategy}: {exc}")
    pair = Sharded(model, single_group_adam(model), oracle, single_group_adam(oracle))
    pair.train(name, range(steps), dist.device)
    return pair


def _clean(name: str) -> str:
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


@torch.no_grad()
def sharded_target(impl: Adapter, dist: RankContext, name: str, source_state: Mapping[str, torch.Tensor],
                   strategy: str = "FULL_SHARD", *, extra_key: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Zoo ``name`` from seed 1, sharded, with a perturbed optimizer over its parameters in reverse
    order, trained one step on another batch; its persistent buffers (plain on every rank) set to
    :func:`different_like` of the source's (``source_state``: the unwrapped source's state dict). The
    FSDP optimizer-state load matches param groups one to one, so a sharded target keeps one group."""
    try:
        model = sd_shard(impl, zoo.build(name, seed=1, device=dist.device), dist.device, strategy)
    except Unsupported as exc:
        pytest.skip(f"sharding {strategy}: {exc}")
    optim = target_optimizer([[p for p in model.parameters() if p.requires_grad]], "reversed", extra_key=extra_key)
    with torch.enable_grad():
        train(model, optim, name, range(5, 6), dist.device)
    for buffer_name, buffer in model.named_buffers():
        key = _clean(buffer_name)
        if key in source_state:  # persistent; a non-persistent buffer is never loaded
            buffer.copy_(different_like(source_state[key]))
    return model, optim


def assert_dtensor_params(model_sd: Mapping[str, Any], oracle: nn.Module, dist: RankContext) -> None:
    """SD-13: at world size > 1 every parameter entry of a sharded get is a DTensor."""
    __tracebackhide__ = True
    if dist.world_size == 1:
        return
    params = dict(oracle.named_parameters(remove_duplicate=False))
    plain = [k for k, v in model_sd.items() if k in params and not isinstance(v, DTensor)]
    if plain:
        fail("sharded state dict: parameters that are not DTensors", plain, "DTensor shards", f"rank {dist.rank}")


def assert_planned_get(got: Mapping[str, Any], expected: Mapping[str, Any], strategy: str, dist: RankContext, what: str) -> None:
    """Every positional tensor of ``got`` (a model state dict, or one parameter's optimizer state) is a
    DTensor laid out as ``strategy`` asks (:func:`~conformance.asserts.assert_planned_shard`: mesh
    ranks and groups, placements, coordinate, this rank's piece of ``expected`` to float tolerance);
    at world size 1 a plain tensor equal to ``expected`` is accepted. Every other entry equals
    ``expected`` as it is."""
    __tracebackhide__ = True
    replicas, shards = strategy_layout(strategy, dist.world_size)
    if list(got) != list(expected):
        fail(f"{what}: keys", list(got), list(expected), f"rank {dist.rank}")
    for key, value in got.items():
        want, here = expected[key], f"{what}[{key!r}] on rank {dist.rank} of {dist.world_size} ({strategy})"
        positional = isinstance(want, torch.Tensor) and want.dim() > 0 and want.is_floating_point()
        if positional and (isinstance(value, DTensor) or dist.world_size > 1):
            assert_planned_shard(value, want, replicas=replicas, shards=shards, rank=dist.rank, what=what, where=here,
                                 atol=ATOL, rtol=RTOL)
        else:
            assert_same_state(value, want, what=what, where=here, atol=ATOL, rtol=RTOL)


def dtensor_model(name: str, seed: int, dist: RankContext) -> nn.Module:
    """Zoo model ``name`` whose every parameter is a DTensor sharded on dim 0 over all ranks, with no
    FSDP wrapper (how tensor parallelism leaves a model); buffers stay plain."""
    from torch.distributed.tensor import Shard, distribute_tensor

    model, mesh = zoo.build(name, seed=seed, device=dist.device), dist.mesh()
    for module in model.modules():
        for attr, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), mesh, [Shard(0)])
            module.register_parameter(attr, nn.Parameter(sharded, requires_grad=param.requires_grad))
    return model


def strict_load_into_dtensor_parameters_without(dist: RankContext, impl: Adapter, bad_ranks: set[int]) -> None:
    """SD-8/SD-19 on :func:`dtensor_model`: a full and a sharded dict without one key on ``bad_ranks``,
    set with ``strict``: every rank raises the same ``RuntimeError`` naming the key, and nothing changes."""
    ops = sd_ops(impl)
    source, target = dtensor_model("nested", 0, dist), dtensor_model("nested", 1, dist)
    key = "10.inner.0.weight"
    for form in ("full", "sharded"):
        options = ops.options(full_state_dict=form == "full")
        given = ops.get_model_state_dict(source, options=options)
        if dist.rank in bad_ranks:
            del given[key]
        before = snapshot(model=target)
        strict_set = functools.partial(ops.set_model_state_dict, target, given, options=ops.options(full_state_dict=form == "full", strict=True))
        exc = expect_error(strict_set,
                           RuntimeError, keys=[key], what=f"strict load of a {form} dict without {key!r}", where=f"rank {dist.rank}")
        assert_same_error_on_every_rank(dist, exc, what=f"strict load of a {form} dict without {key!r}")
        assert_unchanged(before, model=target, where=f"rank {dist.rank}, after the refused {form} load")


def oracle_state(name: str, device: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The unwrapped model's (model, FQN-keyed optimizer) state dicts after two steps: what rank 0 holds."""
    oracle = zoo.build(name, seed=0, device=device)
    oracle_optim = single_group_adam(oracle)
    train(oracle, oracle_optim, name, range(2), device)
    return copy.deepcopy(oracle.state_dict()), copy.deepcopy(fqn_keyed_optim(oracle, oracle_optim))


def broadcast_target(impl: Adapter, dist: RankContext, name: str, sharded: bool, expected_model: Mapping[str, Any]
                      ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A target for rank 0's state: sharded, or plain and differing everywhere; one param group, like
    the source (a split target is test_round_trip's)."""
    if sharded:
        return sharded_target(impl, dist, name, expected_model)
    pair = plain_pair(name, device=dist.device)
    optim = target_optimizer([[p for p in pair.target.parameters() if p.requires_grad]], "reversed")
    train(pair.target, optim, name, range(5, 6), dist.device)
    return pair.target, optim


def check_broadcast_result(ops: StateDictOps, dist: RankContext, model: nn.Module, optim: torch.optim.Optimizer,
                            expected_model: dict[str, Any], expected_optim: dict[str, Any]) -> None:
    __tracebackhide__ = True
    got_model, got_optim = ops.get_state_dict(model, optim, options=ops.options(full_state_dict=True))
    assert_same_state(got_model, expected_model, what="model after the broadcast load", where=f"rank {dist.rank}")
    assert_same_optim(got_optim, expected_optim, "optimizer after the broadcast load", where=f"rank {dist.rank}")


def hyperparameters(optim: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]


def sharded_error_run(dist: RankContext, impl: Adapter, kind: str, bad_ranks: set[int]) -> None:
    """A sharded nested model and its optimizer (trained, perturbed, like every target) get a set whose
    input is wrong on ``bad_ranks`` only. Every rank raises the same error type with the same message
    (naming the canonical key) and keeps its model and optimizer exactly as they were."""
    ops = sd_ops(impl)
    case = ERROR_CASES[kind]
    source = sharded_pair(impl, dist, case.model)
    full = kind != "shape-dtensor"
    model_sd, optim_sd = copy.deepcopy(ops.get_state_dict(source.model, source.optim, options=ops.options(full_state_dict=full)))
    target, target_optim = sharded_target(impl, dist, case.model, source.oracle.state_dict())
    bad = dist.rank in bad_ranks
    if bad:
        model_sd_in, optim_sd_in = break_input(case, model_sd, optim_sd)
    else:
        model_sd_in, optim_sd_in = model_sd, optim_sd
    before = snapshot(model=target, optim=target_optim)
    where = f"rank {dist.rank}, bad input on rank(s) {sorted(bad_ranks)}"

    def call() -> Any:
        options = error_options(ops, case, bad, mutate=len(bad_ranks) < dist.world_size, full_state_dict=full)
        if kind == "empty":
            return ops.set_model_state_dict(target, model_sd_in, options=options)
        return ops.set_state_dict(target, target_optim, model_state_dict=model_sd_in, optim_state_dict=optim_sd_in,
                                  options=options)

    exc = raised(call)

    def raises() -> None:
        assert_same_error_on_every_rank(dist, exc, what=f"{kind}: set with bad input on rank(s) {sorted(bad_ranks)}")
        check_error(case, exc, model_sd, list(model_sd), where=where)

    refused, unchanged = ERROR_CLAUSES[case.req]
    check_each({refused: raises, unchanged: lambda: assert_unchanged(before, where=where, model=target, optim=target_optim)})


def form_of(tree: Any) -> Any:
    """What a state-dict configuration decides about a get, without the values: the keys (in order),
    and for every tensor its kind, placements, global and local shape and dtype."""
    if isinstance(tree, Mapping):
        return {k: form_of(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [form_of(v) for v in tree]
    if isinstance(tree, DTensor):
        return ("DTensor", str(tree.placements), tuple(tree.shape), tuple(tree.to_local().shape), str(tree.dtype))
    if isinstance(tree, torch.Tensor):
        return ("Tensor", tuple(tree.shape), str(tree.dtype))
    return type(tree).__name__
