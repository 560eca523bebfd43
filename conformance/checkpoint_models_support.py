"""Models saved and loaded back by ``test_checkpoint.py``: zoo models built on a rank or on meta, the
tensor-parallel and FSDP2 models and the checks of a meta load (ML-4, ML-5: :func:`check_built`,
:func:`assert_meta_load_rebuilds`), the tensor-parallel model resharded across world sizes (ML-2,
ML-8: :func:`save_tp`, :func:`load_tp`), and a sharded model with its optimizer trained, saved at one
world size and loaded at another, compared with the unsharded run (ML-8: :func:`save_training`,
:func:`load_training`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from conformance import models
from conformance.adapters.base import Adapter
from conformance.adapters.sharding import ShardingPlan
from conformance.asserts import assert_bitwise_equal, assert_local_shard, assert_same_state, fail
from conformance.checkpoint_support import assert_local_shards, assert_same_bits, call_or_skip, checkpoint_ops, exact, group_of
from conformance.checkpoint_values_support import State
from conformance.compare import fqn_keyed_optim, full_on_cpu
from conformance.harness.context import RankContext
from conformance.values import perturb_hyperparameters

__all__ = [
    "zoo_model",
    "check_built",
    "tp_model",
    "fsdp2_model",
    "assert_meta_load_rebuilds",
    "save_tp",
    "load_tp",
    "save_training",
    "load_training",
]


def zoo_model(dist: RankContext, name: str, seed: int, device: str | torch.device) -> nn.Module:
    """Zoo model ``name`` built from ``seed`` on this rank's device, or, for ``device="meta"``, with
    every tensor on meta (the seed does not matter there)."""
    if str(device) == "meta":
        with torch.device("meta"):
            return models.ZOO[name]()
    return models.build(name, seed=seed, device=dist.device)


def _shard(impl: Adapter, model: nn.Module, dist: RankContext) -> nn.Module:
    """``model`` sharded by ``impl`` over the pool's 1-D mesh (FULL_SHARD, original parameters, one unit)."""
    return impl.require("sharding").shard(model, ShardingPlan(use_orig_params=True, device=dist.device, mesh=dist.mesh()))


# -- ML-4 meta loading ------------------------------------------------------------------------------


def check_built(dist: RankContext, loaded: dict[str, Any], saved: State, parameters: frozenset[str] = frozenset()) -> None:
    """ML-4's checks of a meta load: every value built on the process group's device, no meta left,
    a Parameter exactly where the meta target was one (``parameters``: those keys), DTensors keep
    mesh, placements, global shape and stride, and every value (each rank's local shard of a DTensor)
    holds the saved bits."""
    __tracebackhide__ = True
    for key, want in saved.values.items():
        got = loaded[key]
        local = got.to_local() if isinstance(got, DTensor) else got
        if local.device != dist.device:
            fail("a meta value was built on the wrong device", local.device, dist.device, f"{key}, rank {dist.rank}")
        if isinstance(got, nn.Parameter) != (key in parameters):
            fail("a meta value was built as another kind", f"a Parameter: {isinstance(got, nn.Parameter)}",
                 f"a Parameter: {key in parameters}, as the meta target", f"{key}, rank {dist.rank}")
        if isinstance(want, DTensor):
            if not isinstance(got, DTensor):
                fail("a meta DTensor was built as another type", type(got).__name__, "DTensor", key)
            if got.device_mesh != want.device_mesh or tuple(got.placements) != tuple(want.placements):
                fail("a meta DTensor's layout changed", (got.device_mesh, got.placements), (want.device_mesh, want.placements), key)
            if got.shape != want.shape or got.stride() != want.stride():
                fail("a meta DTensor's global shape/stride changed", (tuple(got.shape), got.stride()),
                     (tuple(want.shape), want.stride()), key)
    assert_local_shards(dist, loaded, saved.fulls, what="built")
    assert_same_bits(loaded, saved.values)


def _tp_plan() -> dict[str, Any]:
    """PR #113319's plan on zoo "mlp" (5 -> 10 -> 15 -> 1): net.0 row-wise (its 5 input features over the
    ranks: 3+2 at 2 ranks, 2+2+1+0 at 4), net.2 column-wise (15 outputs: 8+7, 4+4+4+3). The layouts at
    the model's edges are Replicate so that the forward runs on the full batch and gives full outputs."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"net.0": RowwiseParallel(input_layouts=Replicate()), "net.2": ColwiseParallel(output_layouts=Replicate())}


def tp_model(dist: RankContext, seed: int, device: str | torch.device) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(zoo_model(dist, "mlp", seed, device), dist.mesh(), _tp_plan())


def fsdp2_model(dist: RankContext, name: str, seed: int, device: str | torch.device) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = zoo_model(dist, name, seed, device)
    fully_shard(model, mesh=dist.mesh())  # shards in place (and returns ``model``, typed as an FSDPModule)
    return model


def _saved_model_state(model: nn.Module) -> State:
    """A model's state dict and the full value of each DTensor in it (collective)."""
    sd = model.state_dict()
    return State(sd, {(k,): v.full_tensor() for k, v in sd.items() if isinstance(v, DTensor)})


def assert_meta_load_rebuilds(dist: RankContext, ops: Any, name: str, model: nn.Module, meta_model: Callable[[], nn.Module]) -> None:
    """Save ``model``'s state dict, load it into the state dict of ``meta_model()`` (built after the
    save), check what the load built, assign it and compare outputs with ``model``'s exactly."""
    path = dist.tmp_dir / "ckpt"
    saved = _saved_model_state(model)
    ops.save(saved.values, path, process_group=group_of(dist))

    target = meta_model()
    sd = target.state_dict()
    call_or_skip(lambda: ops.load(sd, path, process_group=group_of(dist)))
    check_built(dist, sd, saved)
    target.load_state_dict(sd, assign=True)
    inputs = models.batch(name, seed=3, device=dist.device)
    assert_bitwise_equal(target(inputs).detach(), model(inputs).detach(), what="output of the model built from meta")


# -- ML-8 resharding across world sizes ----------------------------------------------------------------------


def save_tp(dist: RankContext, impl: Adapter, path: str) -> None:
    model = tp_model(dist, seed=8, device=dist.device)
    checkpoint_ops(impl).save(model.state_dict(), path, process_group=group_of(dist))


def load_tp(dist: RankContext, impl: Adapter, path: str) -> None:
    meta_model = tp_model(dist, seed=0, device="meta")
    sd = meta_model.state_dict()
    call_or_skip(lambda: checkpoint_ops(impl).load(sd, path, process_group=group_of(dist)))
    oracle = models.build("mlp", seed=8, device=dist.device)
    expected = tp_model(dist, seed=8, device=dist.device).state_dict()  # the layout at this world size
    unsharded = oracle.state_dict()
    check_built(dist, sd, State(expected, {(k,): unsharded[k] for k, v in expected.items() if isinstance(v, DTensor)}))
    meta_model.load_state_dict(sd, assign=True)
    inputs = models.batch("mlp", seed=4, device=dist.device)
    # Not bitwise: row-wise parallel sums partial products across ranks in another order.
    assert_same_state(meta_model(inputs).detach(), oracle(inputs).detach(), what="output after resharding", atol=1e-6, rtol=1e-5)


_TRAIN_STEPS = 2


class _Tolerance(TypedDict):
    atol: float
    rtol: float


#: Training on N ranks sums gradients in another order than one process: compare within this.
_TRAINING_TOLERANCE: _Tolerance = {"atol": 1e-5, "rtol": 1e-5}


def _optimizer(model: nn.Module, *, reverse: bool = False) -> torch.optim.Optimizer:
    """Adam over two param groups (weights; the rest) with different hyperparameters, an LR
    scheduler's ``initial_lr`` and a custom key. ``reverse`` lists each group's parameters the other
    way round. Groups are chosen by name, so the sharded model and the oracle group alike."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    weights = [p for n, p in named if n.endswith("weight")]
    others = [p for n, p in named if not n.endswith("weight")]
    if reverse:
        weights, others = weights[::-1], others[::-1]
    groups = [{"params": weights, "lr": 0.02, "weight_decay": 0.01}, {"params": others, "lr": 0.01, "betas": (0.8, 0.95)}]
    optimizer = torch.optim.Adam([g for g in groups if g["params"]], lr=0.01)
    for index, group in enumerate(optimizer.param_groups):
        group["initial_lr"] = group["lr"] * 2
        group["sdc_custom"] = f"source-{index}"
    return optimizer


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, name: str, steps: range, device: Any) -> None:
    for step in steps:
        models.train_step(model, optimizer, models.batch(name, seed=step, device=device))


def _hyperparameters(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in groups]


def save_training(dist: RankContext, impl: Adapter, name: str, path: str, saved_path: str) -> None:
    ops = checkpoint_ops(impl)
    model = _shard(impl, models.build(name, seed=11, device=dist.device), dist)
    optimizer = _optimizer(model)
    _train(model, optimizer, name, range(_TRAIN_STEPS), dist.device)
    model_sd, optim_sd = ops.get_state_dicts(model, optimizer)
    if dist.world_size > 1:  # otherwise this test would not reshard anything
        assert any(isinstance(v, DTensor) for v in model_sd.values()), "the sharded model state dict holds no DTensor"
    ops.save({"model": model_sd, "optim": optim_sd}, path, process_group=group_of(dist))
    full = full_on_cpu({"model": model_sd, "optim": optim_sd})  # collective
    if dist.rank == 0:
        torch.save(full, saved_path)  # the saved values, full, for the loading world size to compare with


def _assert_matches_full(dist: RankContext, got: Any, full: Any, where: str) -> None:
    """``got`` (a state dict of the loading world size) holds exactly the saved values ``full`` (the
    same state gathered at the saving world size): each DTensor's local shard is its documented piece
    of the full value, every other value equal bit for bit. Dict order is not compared (the target's
    optimizer lists its parameters in another order)."""
    __tracebackhide__ = True
    if isinstance(full, Mapping) and isinstance(got, Mapping):
        if set(map(str, got)) != set(map(str, full)):
            fail("resharded state: keys differ", sorted(map(str, got)), sorted(map(str, full)), where)
        by_name = {str(k): v for k, v in got.items()}
        for key, value in full.items():
            _assert_matches_full(dist, by_name[str(key)], value, f"{where}.{key}")
    elif isinstance(got, DTensor):
        assert_local_shard(got, full, what="resharded value", where=f"{where}, rank {dist.rank} of {dist.world_size}")
    else:
        assert_same_state(exact(got), exact(full), what="resharded value", where=where, check_order=False)


def load_training(dist: RankContext, impl: Adapter, name: str, path: str, saved_path: str) -> None:
    ops = checkpoint_ops(impl)
    model = _shard(impl, models.build(name, seed=99, device=dist.device), dist)
    optimizer = _optimizer(model, reverse=True)
    perturb_hyperparameters(optimizer)
    _train(model, optimizer, name, range(50, 51), dist.device)  # optimizer state to load into, from another batch
    model_sd, optim_sd = ops.get_state_dicts(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    call_or_skip(lambda: ops.load(state, path, process_group=group_of(dist)))
    saved = torch.load(saved_path, weights_only=False)
    _assert_matches_full(dist, state, saved, "loaded")
    ops.set_state_dicts(model, optimizer, state["model"], state["optim"])
    assert_same_bits(_hyperparameters(optimizer.param_groups), _hyperparameters(saved["optim"]["param_groups"]),
                      what="optimizer hyperparameters after loading")
    got_model, got_optim = ops.get_state_dicts(model, optimizer)
    _assert_matches_full(dist, {"model": got_model, "state": got_optim["state"]},
                         {"model": saved["model"], "state": saved["optim"]["state"]}, "after set_state_dicts")

    oracle = models.build(name, seed=11, device=dist.device)
    oracle_optimizer = _optimizer(oracle)
    _train(oracle, oracle_optimizer, name, range(_TRAIN_STEPS), dist.device)
    got_model = full_on_cpu(got_model)
    want_model = full_on_cpu(oracle.state_dict())
    assert_same_state({k: got_model[k] for k in want_model}, want_model, what="model after resharding vs the unsharded run",
                      check_order=False, **_TRAINING_TOLERANCE)
    want_state = full_on_cpu(fqn_keyed_optim(oracle, oracle_optimizer)["state"])
    got_state = full_on_cpu(got_optim["state"])
    assert_same_state({k: got_state.get(k) for k in want_state}, want_state, what="optimizer state after resharding vs the unsharded run",
                      check_order=False, **_TRAINING_TOLERANCE)
    # Training resumes where the saved run left off.
    _train(model, optimizer, name, range(_TRAIN_STEPS, _TRAIN_STEPS + 1), dist.device)
    _train(oracle, oracle_optimizer, name, range(_TRAIN_STEPS, _TRAIN_STEPS + 1), dist.device)
    got_model = full_on_cpu(ops.get_state_dicts(model, optimizer)[0])
    want_model = full_on_cpu(oracle.state_dict())
    assert_same_state({k: got_model[k] for k in want_model}, want_model, what="model after resuming vs the unsharded run",
                      check_order=False, **_TRAINING_TOLERANCE)
