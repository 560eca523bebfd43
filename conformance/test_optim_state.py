"""OS: sharded data parallel and its optimizer state dicts keyed by clean FQNs (conformance/SPEC.md).

Oracle: the unwrapped zoo model, built from the same seed and trained on the whole global batch on
every rank, while the sharded model trains on its rank's equal slice of it. Second oracle: the
reference, for round trips across implementations. Goldens pin the structure of one state dict.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.nn as nn

from conformance import models
from conformance.adapters.optim_state import STRATEGIES, hybrid_mesh_shape

GLOBAL_BATCH = 8  # divisible by every world size the suite is run at (1, 2, 4, 8)

OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.02, weight_decay=0.01),
}

# Which modules (raw names in the unwrapped model) become nested units, per model and use_orig_params.
# With use_orig_params=False frozen and trainable parameters may not share a unit, and a param group
# cannot split a unit, so those layouts separate them; with True they are mixed on purpose.
UNITS: dict[str, dict[bool, tuple[str, ...]]] = {
    "mlp": {False: ("net.0", "net.4"), True: ("net.0", "net.4")},
    "tied": {False: ("body",), True: ("body",)},
    "frozen": {False: ("stem",), True: ()},
    "nested": {False: ("1", "1.inner", "10"), True: ("1", "1.inner", "10")},
    "groups": {False: ("inp",), True: ()},
    "tiny": {False: ("a",), True: ("a",)},  # a.weight: 6 elements, so at 4 ranks one shard is padding only
    # mlp whose middle layer runs under an activation-checkpoint wrapper; the wrapped Linear is a unit
    "checkpoint": {False: ("net.0", "net.2._checkpoint_wrapped_module"), True: ("net.2._checkpoint_wrapped_module",)},
}


@dataclass(frozen=True)
class Setup:
    """One sharded training run next to its oracle."""

    model: str = "mlp"
    strategy: str = "FULL_SHARD"
    use_orig_params: bool = True
    optimizer: str = "adamw"
    groups: bool = False  #: two param groups with different hyperparameters and an extra key
    extra_state: bool = False  #: add a non-tensor and a 0-dim state to every parameter with state
    seed: int = 0

    def __str__(self) -> str:
        mode = "orig" if self.use_orig_params else "flat"
        return f"{self.model}/{self.strategy}/{mode}/{self.optimizer}"


def _build(name: str, seed: int, device: torch.device, *, oracle: bool = False) -> nn.Module:
    """The zoo model ``name``; ``checkpoint`` is ``mlp`` (the oracle: exactly ``mlp``)."""
    if name != "checkpoint" or oracle:
        name = "mlp" if name == "checkpoint" else name
        return models.build(name, seed=seed, device=device)
    # The only home of torch's activation-checkpoint wrapper (it adds `_checkpoint_wrapped_module`).
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = models.build("mlp", seed=seed, device=device)
    model.net[2] = checkpoint_wrapper(model.net[2])
    return model


def _batch(setup: Setup, step: int, device: torch.device) -> torch.Tensor:
    name = "mlp" if setup.model == "checkpoint" else setup.model
    return models.batch(name, seed=100 + step, batch_size=GLOBAL_BATCH, device=device)


def _fqn_groups(setup: Setup, oracle: nn.Module) -> list[dict[str, Any]]:
    """The optimizer's param groups as FQN sets plus hyperparameters (shared by oracle and sharded run)."""
    trainable = {n for n, p in oracle.named_parameters() if p.requires_grad}
    if not setup.groups:
        return [{"fqns": trainable}]
    if setup.use_orig_params:  # the zoo's groups: matrices, then the rest
        names = {p: n for n, p in oracle.named_parameters()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "fqns": {names[p] for p in g["params"]}} for g in models.param_groups(oracle)]
    else:  # one unit per group
        first = {n for n in trainable if n.startswith("inp.")}
        groups = [{"lr": 0.02, "weight_decay": 0.01, "fqns": first}, {"lr": 0.01, "weight_decay": 0.0, "fqns": trainable - first}]
    for index, group in enumerate(groups):
        group["tag"] = f"group-{index}"  # an extra key a user put in the group
    return groups


def _make_optimizer(setup: Setup, groups: list[dict[str, Any]], named: list[tuple[tuple[str, ...], nn.Parameter]]) -> torch.optim.Optimizer:
    torch_groups = [{**{k: v for k, v in g.items() if k != "fqns"}, "params": []} for g in groups]
    for fqns, param in named:
        if not param.requires_grad:
            continue
        homes = {i for i, g in enumerate(groups) for fqn in fqns if fqn in g["fqns"]}
        assert len(homes) == 1, f"test layout error: {fqns} fall in groups {homes}"
        torch_groups[homes.pop()]["params"].append(param)
    return OPTIMIZERS[setup.optimizer](torch_groups)


def _add_extra_state(optim: torch.optim.Optimizer) -> None:
    for state in optim.state.values():
        state["note"] = "kept as is"
        state["scale"] = torch.tensor(2.5)


class Run:
    """A sharded model and its optimizer, with the unwrapped oracle trained on the same global batches.

    Built on every rank; ``train`` steps both (the oracle on the whole batch, the model on this rank's
    slice). Skips when the implementation cannot run ``setup``."""

    def __init__(self, dist: Any, ops: Any, setup: Setup) -> None:
        if GLOBAL_BATCH % dist.world_size:
            pytest.skip(f"the global batch of {GLOBAL_BATCH} does not split evenly over {dist.world_size} ranks")
        reason = ops.unsupported(setup.strategy, setup.use_orig_params)
        if reason:
            pytest.skip(reason)
        self.dist, self.ops, self.setup, self.steps = dist, ops, setup, 0
        self.oracle = _build(setup.model, setup.seed, dist.device, oracle=True)
        groups = _fqn_groups(setup, self.oracle)
        self.oracle_optim = _make_optimizer(setup, groups, [((n,), p) for n, p in self.oracle.named_parameters()])
        model = _build(setup.model, setup.seed, dist.device)
        unit_names = set(UNITS[setup.model][setup.use_orig_params])
        unit_ids = {id(m) for n, m in model.named_modules() if n in unit_names}
        assert len(unit_ids) == len(unit_names), f"test layout error: units {unit_names} of {setup.model}"
        self.model = ops.wrap(
            model, strategy=setup.strategy, use_orig_params=setup.use_orig_params, units=lambda m: id(m) in unit_ids, device=dist.device
        )
        self.optim = _make_optimizer(setup, groups, ops.optimizer_params(self.model))

    def train(self, steps: int) -> None:
        for _ in range(steps):
            batch = _batch(self.setup, self.steps, self.dist.device)
            models.train_step(self.oracle, self.oracle_optim, batch)
            models.train_step(self.model, self.optim, batch.chunk(self.dist.world_size)[self.dist.rank])
            if self.setup.extra_state and self.steps == 0:
                _add_extra_state(self.oracle_optim)
                _add_extra_state(self.optim)
            self.steps += 1

    def continue_oracle_of(self, other: Run) -> None:
        """Make this run's oracle (model, optimizer, step count) a copy of ``other``'s."""
        self.oracle.load_state_dict(other.oracle.state_dict())
        self.oracle_optim.load_state_dict(other.oracle_optim.state_dict())
        self.steps = other.steps

    def oracle_osd(self) -> dict[str, Any]:
        return fqn_keyed(self.oracle, self.oracle_optim)


def fqn_keyed(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """``optim.state_dict()`` of an unwrapped model with parameter ids replaced by FQNs (first name)."""
    names: dict[nn.Parameter, str] = {}
    for name, param in model.named_parameters():
        names.setdefault(param, name)
    raw = optim.state_dict()
    ids = [names[p] for g in optim.param_groups for p in g["params"]]
    return {
        "state": {ids[i]: s for i, s in raw["state"].items()},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [ids[i] for i in g["params"]]} for g in raw["param_groups"]],
    }


# -- comparisons ---------------------------------------------------------------------------------------


def _full(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def assert_model_matches(ops: Any, run: Run, where: str) -> None:
    got = ops.full_state_dict(run.model)
    expected = run.oracle.state_dict()
    assert sorted(got) == sorted(expected), f"{where}: full state dict keys {sorted(got)}, expected {sorted(expected)}"
    for key, value in expected.items():
        torch.testing.assert_close(_full(got[key]).to(value.device), value, msg=lambda m: f"{where}: parameter {key!r} differs from the unwrapped model: {m}")


def assert_osd_matches(got: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    """``got`` (FQN-keyed, full or sharded) holds what the unwrapped model's optimizer holds.

    Collective when ``got`` holds DTensors (every rank compares, in sorted order)."""
    assert set(got) == {"state", "param_groups"}, f"{where}: optimizer state dict keys {sorted(got)}, expected ['param_groups', 'state']"
    assert sorted(got["state"]) == sorted(expected["state"]), (
        f"{where}: optimizer state for {sorted(got['state'])}, expected exactly {sorted(expected['state'])}"
    )
    for fqn in sorted(expected["state"]):
        states, actual_states = expected["state"][fqn], got["state"][fqn]
        assert sorted(actual_states) == sorted(states), f"{where}: {fqn!r} has states {sorted(actual_states)}, expected {sorted(states)}"
        for name in sorted(states):
            value, actual = states[name], _full(actual_states[name])
            if isinstance(value, torch.Tensor):
                assert isinstance(actual, torch.Tensor), f"{where}: state {name!r} of {fqn!r} is {type(actual).__name__}, expected a tensor"
                if value.dim() == 0:  # `step` and other scalars stay where torch.optim keeps them
                    assert actual.dim() == 0 and actual.device == value.device, (
                        f"{where}: state {name!r} of {fqn!r}: shape {tuple(actual.shape)} on {actual.device}, expected a scalar on {value.device}"
                    )
                torch.testing.assert_close(actual.to(value.device), value, msg=lambda m: f"{where}: state {name!r} of {fqn!r}: {m}")
            else:
                assert actual == value, f"{where}: state {name!r} of {fqn!r} is {actual!r}, expected {value!r}"
    assert len(got["param_groups"]) == len(expected["param_groups"]), (
        f"{where}: {len(got['param_groups'])} param groups, expected {len(expected['param_groups'])}"
    )
    for index, (group, want) in enumerate(zip(got["param_groups"], expected["param_groups"])):
        hyper = {k: v for k, v in group.items() if k != "params"}
        want_hyper = {k: v for k, v in want.items() if k != "params"}
        assert hyper == want_hyper, f"{where}: param group {index} hyperparameters {hyper}, expected {want_hyper}"
        assert sorted(group["params"]) == sorted(want["params"]), (
            f"{where}: param group {index} lists {sorted(group['params'])}, expected {sorted(want['params'])}"
        )


def _check_sharded_layout(osd: dict[str, Any], run: Run, where: str) -> None:
    """Positional states are DTensors of the parameter's shape, sharded on dim 0 unless replicated."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shapes = {k: v.shape for k, v in run.oracle.state_dict().items()}
    for fqn, states in osd["state"].items():
        for name, value in states.items():
            if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                continue
            assert isinstance(value, DTensor), f"{where}: sharded state {name!r} of {fqn!r} is a {type(value).__name__}, expected a DTensor"
            assert value.shape == shapes[fqn], f"{where}: {fqn!r} {name!r} has global shape {tuple(value.shape)}, expected {tuple(shapes[fqn])}"
            placements = tuple(value.placements)
            assert all(isinstance(p, (Shard, Replicate)) for p in placements), f"{where}: {fqn!r} {name!r} placements {placements}"
            if run.setup.strategy != "NO_SHARD" and value.device_mesh.size(len(placements) - 1) > 1 and value.dim() > 0:
                assert placements[-1] == Shard(0), f"{where}: {fqn!r} {name!r} placements {placements}, expected Shard(0) on the shard dimension"


# -- OS-1, OS-3, OS-5: training parity and the full and sharded optimizer state dicts -------------------


@pytest.mark.req("OS-1", "OS-3", "OS-5", "OS-6")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_and_optim_state_dict(dist, impl, strategy: str, use_orig_params: bool) -> None:
    """SGD with momentum and AdamW, 3 steps: parameters and the full optimizer state dict equal the
    unwrapped model's; the sharded one consolidates to it; loading the sharded one back into a fresh
    sharded model and stepping once more stays equal to the oracle."""
    ops = impl.require("optim_state")
    for optimizer in OPTIMIZERS:
        setup = Setup(strategy=strategy, use_orig_params=use_orig_params, optimizer=optimizer)
        run = Run(dist, ops, setup)
        run.train(3)
        assert_model_matches(ops, run, f"{setup} after 3 steps")
        assert_osd_matches(ops.optim_state_dict(run.model, run.optim), run.oracle_osd(), f"{setup} full")
        sharded = ops.optim_state_dict(run.model, run.optim, sharded=True)
        _check_sharded_layout(sharded, run, f"{setup} sharded")
        assert_osd_matches(sharded, run.oracle_osd(), f"{setup} sharded")

        fresh = Run(dist, ops, replace(setup, seed=1))
        fresh.continue_oracle_of(run)
        ops.load_full_state_dict(fresh.model, ops.full_state_dict(run.model))
        ops.load_optim_state_dict(fresh.model, fresh.optim, sharded)
        fresh.train(1)
        assert_model_matches(ops, fresh, f"{setup}: loaded the sharded state dict, one more step")
        assert_osd_matches(ops.optim_state_dict(fresh.model, fresh.optim), fresh.oracle_osd(), f"{setup} after load and step")


@pytest.mark.req("OS-4")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_rank0_only_and_cpu_offload(dist, impl, use_orig_params: bool) -> None:
    """``rank0_only`` leaves every other rank an empty dict; ``cpu_offload`` puts every tensor on the CPU."""
    ops = impl.require("optim_state")
    run = Run(dist, ops, Setup(use_orig_params=use_orig_params))
    run.train(2)
    for rank0_only, cpu_offload in ((True, False), (False, True), (True, True)):
        where = f"{run.setup} rank0_only={rank0_only} cpu_offload={cpu_offload} on rank {dist.rank}"
        osd = ops.optim_state_dict(run.model, run.optim, rank0_only=rank0_only, cpu_offload=cpu_offload)
        if rank0_only and dist.rank != 0:
            assert osd == {}, f"{where}: expected an empty dict, got keys {sorted(osd)}"
            continue
        assert_osd_matches(osd, run.oracle_osd(), where)
        if cpu_offload:
            devices = {v.device.type for s in osd["state"].values() for v in s.values() if isinstance(v, torch.Tensor)}
            assert devices <= {"cpu"}, f"{where}: tensors on {devices}"


# -- OS-6, OS-7, OS-8: loading into a differently sharded model ----------------------------------------

# (saved with, loaded into): strategy and use_orig_params on each side
ROUND_TRIPS = [
    (("FULL_SHARD", False), ("NO_SHARD", True)),
    (("NO_SHARD", True), ("HYBRID_SHARD", False)),
    (("SHARD_GRAD_OP", True), ("FULL_SHARD", False)),
    (("HYBRID_SHARD", True), ("SHARD_GRAD_OP", True)),
]


def _trip_id(trip: tuple[tuple[str, bool], tuple[str, bool]]) -> str:
    return "-to-".join(f"{s}.{'orig' if u else 'flat'}" for s, u in trip)


@pytest.mark.req("OS-6")
@pytest.mark.parametrize("trip", ROUND_TRIPS, ids=_trip_id)
def test_load_into_other_strategy(dist, impl, trip) -> None:
    """A full optimizer state dict saved under one strategy and use_orig_params loads under another;
    one more step matches the unwrapped model."""
    ops = impl.require("optim_state")
    (s1, u1), (s2, u2) = trip
    source = Run(dist, ops, Setup(strategy=s1, use_orig_params=u1, optimizer="adamw"))
    source.train(2)
    target = Run(dist, ops, Setup(strategy=s2, use_orig_params=u2, optimizer="adamw", seed=1))
    target.continue_oracle_of(source)
    ops.load_full_state_dict(target.model, ops.full_state_dict(source.model))
    ops.load_optim_state_dict(target.model, target.optim, ops.optim_state_dict(source.model, source.optim))
    target.train(1)
    assert_model_matches(ops, target, f"{_trip_id(trip)}")
    assert_osd_matches(ops.optim_state_dict(target.model, target.optim), target.oracle_osd(), _trip_id(trip))


def _save_phase(ctx: Any, impl: Any, setup: Setup, steps: int) -> tuple[dict, dict] | None:
    ops = impl.require("optim_state")
    run = Run(ctx, ops, setup)
    run.train(steps)
    model_sd = {k: v.cpu() for k, v in ops.full_state_dict(run.model).items()}
    osd = ops.optim_state_dict(run.model, run.optim, cpu_offload=True)
    return (model_sd, osd) if ctx.rank == 0 else None


def _load_phase(ctx: Any, impl: Any, setup: Setup, steps: int, saved: tuple[dict, dict]) -> None:
    ops = impl.require("optim_state")
    model_sd, osd = saved
    run = Run(ctx, ops, setup)
    # The oracle retrains from scratch: its global batches do not depend on the world size.
    oracle_only = Run(ctx, ops, replace(setup, seed=Setup.seed))  # the saving run's seed
    oracle_only.train(steps)
    run.continue_oracle_of(oracle_only)
    ops.load_full_state_dict(run.model, {k: v.to(ctx.device) for k, v in model_sd.items()})
    ops.load_optim_state_dict(run.model, run.optim, osd)
    run.train(1)
    where = f"{setup} at world size {ctx.world_size}, loaded after {steps} steps"
    assert_model_matches(ops, run, where)
    assert_osd_matches(ops.optim_state_dict(run.model, run.optim), run.oracle_osd(), where)


@pytest.mark.req("OS-7")
@pytest.mark.parametrize("trip", ROUND_TRIPS[:3:2], ids=_trip_id)
def test_load_at_other_world_size(pools, world_size_pair, impl, trip) -> None:
    """Saved at one world size, loaded at another (strategy and use_orig_params changing too)."""
    impl.require("optim_state")
    (s1, u1), (s2, u2) = trip
    save_ws, load_ws = world_size_pair
    saved = pools.run(save_ws, _save_phase, impl, Setup(strategy=s1, use_orig_params=u1), 2)[0]
    pools.run(load_ws, _load_phase, impl, Setup(strategy=s2, use_orig_params=u2, seed=1), 2, saved)


@pytest.mark.req("OS-8")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("direction", ["from-reference", "to-reference"])
def test_load_across_implementations(dist, impl, reference_impl, direction: str, use_orig_params: bool) -> None:
    """A full optimizer and model state dict of the reference loads into the implementation under test
    and back; one more step matches the unwrapped model."""
    ops, ref = impl.require("optim_state"), reference_impl.require("optim_state")
    if impl.name == reference_impl.name:
        pytest.skip("a differential check needs an implementation other than the reference")
    saver, loader = (ref, ops) if direction == "from-reference" else (ops, ref)
    source = Run(dist, saver, Setup(strategy="FULL_SHARD", use_orig_params=use_orig_params))
    source.train(2)
    target = Run(dist, loader, Setup(strategy="SHARD_GRAD_OP", use_orig_params=use_orig_params, seed=1))
    target.continue_oracle_of(source)
    loader.load_full_state_dict(target.model, saver.full_state_dict(source.model))
    loader.load_optim_state_dict(target.model, target.optim, saver.optim_state_dict(source.model, source.optim))
    target.train(1)
    assert_model_matches(loader, target, direction)
    assert_osd_matches(loader.optim_state_dict(target.model, target.optim), target.oracle_osd(), direction)


# -- OS-9: one key order on every rank -----------------------------------------------------------------


@pytest.mark.req("OS-9")
@pytest.mark.world_size(min=2)
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_ranks_agree_on_key_order(dist, impl, use_orig_params: bool) -> None:
    """Odd ranks build their optimizer over the parameters in reverse order: every rank still returns
    the same state dict, in rank 0's order, and it loads back."""
    ops = impl.require("optim_state")
    run = Run(dist, ops, Setup(model="nested", use_orig_params=use_orig_params))
    if dist.rank % 2:
        named = list(reversed(ops.optimizer_params(run.model)))
        run.optim = _make_optimizer(run.setup, _fqn_groups(run.setup, run.oracle), named)
    run.train(2)
    osd = ops.optim_state_dict(run.model, run.optim)
    assert_osd_matches(osd, run.oracle_osd(), f"{run.setup} on rank {dist.rank}")
    orders = dist.all_gather_object((list(osd["state"]), [g["params"] for g in osd["param_groups"]]))
    assert all(o == orders[0] for o in orders), f"ranks disagree on the order of keys: {orders}"
    ops.load_optim_state_dict(run.model, run.optim, osd)
    run.train(1)
    assert_model_matches(ops, run, f"{run.setup} after reload on rank {dist.rank}")


# -- OS-10 .. OS-14: the model zoo ----------------------------------------------------------------------


ZOO_CASES = [
    pytest.param(Setup(model="tied"), id="tied", marks=pytest.mark.req("OS-10")),
    pytest.param(Setup(model="frozen"), id="frozen", marks=pytest.mark.req("OS-11")),
    pytest.param(Setup(model="groups", groups=True, extra_state=True), id="groups", marks=pytest.mark.req("OS-12")),
    pytest.param(Setup(model="tiny", optimizer="sgd"), id="tiny", marks=pytest.mark.req("OS-13")),
    pytest.param(Setup(model="nested", strategy="SHARD_GRAD_OP"), id="nested", marks=pytest.mark.req("OS-14")),
    pytest.param(Setup(model="checkpoint"), id="checkpoint", marks=pytest.mark.req("OS-14")),
]


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("case", ZOO_CASES)
def test_zoo_model(dist, impl, case: Setup, use_orig_params: bool) -> None:
    """Train, compare the optimizer state dict with the unwrapped model's, reload it into a fresh
    sharded model, step again and compare. Tied weights have one entry under their first FQN; frozen
    parameters none; param groups keep their hyperparameters and extra keys, state its extra entries;
    a parameter with an empty shard and wrapper segments (nested units, activation checkpointing)
    change nothing."""
    ops = impl.require("optim_state")
    setup = replace(case, use_orig_params=use_orig_params)
    run = Run(dist, ops, setup)
    run.train(2)
    assert_model_matches(ops, run, str(setup))
    osd = ops.optim_state_dict(run.model, run.optim)
    assert_osd_matches(osd, run.oracle_osd(), str(setup))
    if setup.model == "tied":
        assert "head.weight" not in osd["state"], f"{setup}: tied weight has a second entry under 'head.weight'"
    fresh = Run(dist, ops, replace(setup, seed=1))
    fresh.continue_oracle_of(run)
    ops.load_full_state_dict(fresh.model, ops.full_state_dict(run.model))
    ops.load_optim_state_dict(fresh.model, fresh.optim, osd)
    fresh.train(1)
    assert_model_matches(ops, fresh, f"{setup} reloaded")
    assert_osd_matches(ops.optim_state_dict(fresh.model, fresh.optim), fresh.oracle_osd(), f"{setup} reloaded")
