"""What the OS tests share (``conformance/test_optim_state.py``; :func:`attach_optimizer` also
``conformance/generated/bodies_optim_state.py``): the sharded set-up and its unwrapped oracle
(:class:`Setup`, :class:`Run`, which nearly every OS test builds: OS-1 to OS-9, OS-12, OS-13, OS-15 to
OS-20), what a load means on the oracle (:func:`load_target`, :func:`load_into_oracle`), comparisons of
state dicts per rank (:func:`assert_model_matches`, :func:`assert_osd_matches`,
:func:`sharded_positional`) and a load continued on both (:func:`assert_continues`: OS-1, OS-3, OS-5,
OS-6, OS-8, OS-12); then saves and loads across world sizes (OS-6, OS-7), each rank's optimizer order
(OS-9), the partition into units (OS-15) and the golden structure (OS-18). What the tests write into
an optimizer or break in its inputs is in ``optim_state_inputs_support.py``."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from conformance import models
from conformance.adapters.base import Adapter
from conformance.adapters.sharding import ShardingPlan, strategy_layout
from conformance.asserts import assert_planned_shard, assert_same_state, fail
from conformance.compare import fqn_keyed_optim, on_cpu
from conformance.fqn import canonical_fqn
from conformance.harness.context import RankContext
from conformance.values import perturb_hyperparameters

__all__ = [
    "GLOBAL_BATCH",
    "attach_optimizer",
    "ATOL",
    "RTOL",
    "OPTIMIZERS",
    "UNITS",
    "Setup",
    "fqn_groups",
    "make_optimizer",
    "Run",
    "load_target",
    "gathered",
    "load_into_oracle",
    "assert_model_matches",
    "hyperparameters_by_fqn",
    "sharded_positional",
    "assert_osd_matches",
    "continue_from",
    "assert_continues",
    "trip_id",
    "save_phase",
    "load_phase",
    "optimizer_fqn_order",
    "same_partition",
    "structure_of",
]


GLOBAL_BATCH = 8  # divisible by every world size the suite is run at (1, 2, 4, 8)


#: Sharded and unwrapped training differ in the order of float32 sums (a gradient is averaged over
#: ranks): after a step they agree to this tolerance (torch.testing's float32 defaults). Where no
#: arithmetic happened (right after a load, state written directly) the comparison is bitwise.
ATOL, RTOL = 1e-5, 1.3e-6


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
    "dtypes": {False: ("proj",), True: ("proj",)},  # float64 parameters, a buffer of every edge dtype
    # mlp whose middle layer runs under an activation-checkpoint wrapper: the wrapper around a unit (the
    # Linear inside), and a unit around the wrapper (its recomputation runs inside the unit's backward)
    "checkpoint": {False: ("net.0", "net.2._checkpoint_wrapped_module"), True: ("net.2",)},
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
    #: "model": the optimizer lists parameters (and groups) in model order; "reversed": both reversed
    order: str = "model"

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
    model.get_submodule("net").register_module("2", checkpoint_wrapper(model.get_submodule("net.2")))
    return model


def _batch(setup: Setup, step: int, device: torch.device) -> torch.Tensor:
    name = "mlp" if setup.model == "checkpoint" else setup.model
    return models.batch(name, seed=100 + step, batch_size=GLOBAL_BATCH, device=device)


def fqn_groups(setup: Setup, oracle: nn.Module) -> list[dict[str, Any]]:
    """The optimizer's param groups as FQN sets plus hyperparameters (shared by oracle and sharded run).

    Every group carries the keys an LR scheduler and a user add (``initial_lr``, ``sdc_custom``), so a
    load must carry them too (the target's own were perturbed)."""
    trainable = {n for n, p in oracle.named_parameters() if p.requires_grad}
    if not setup.groups:
        groups: list[dict[str, Any]] = [{"fqns": trainable}]
    elif setup.use_orig_params:  # the zoo's groups: matrices, then the rest
        names = {p: n for n, p in oracle.named_parameters()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "fqns": {names[p] for p in g["params"]}} for g in models.param_groups(oracle)]
    else:  # one unit per group
        first = {n for n in trainable if n.startswith("inp.")}
        groups = [{"lr": 0.02, "weight_decay": 0.01, "fqns": first}, {"lr": 0.01, "weight_decay": 0.0, "fqns": trainable - first}]
    for index, group in enumerate(groups):
        if setup.groups:
            group["tag"] = f"group-{index}"  # an extra key a user put in the group
        group["initial_lr"] = 0.5 + index
        group["sdc_custom"] = f"source-{index}"
    return groups


def make_optimizer(setup: Setup, groups: list[dict[str, Any]], named: list[tuple[tuple[str, ...], nn.Parameter]]) -> torch.optim.Optimizer:
    torch_groups = [{**{k: v for k, v in g.items() if k != "fqns"}, "params": []} for g in groups]
    for fqns, param in named:
        if not param.requires_grad:
            continue
        homes = {i for i, g in enumerate(groups) for fqn in fqns if fqn in g["fqns"]}
        assert len(homes) == 1, f"test layout error: {fqns} fall in groups {homes}"
        torch_groups[homes.pop()]["params"].append(param)
    if setup.order == "reversed":
        torch_groups = [{**g, "params": g["params"][::-1]} for g in reversed(torch_groups)]
    return OPTIMIZERS[setup.optimizer](torch_groups)


def _add_extra_state(optim: torch.optim.Optimizer) -> None:
    for state in optim.state.values():
        state["decay_rate"] = 0.5  # a non-tensor (not a str: torch.optim's load turns those into generators)
        state["scale"] = torch.tensor(2.5)  # a 0-dim tensor


def attach_optimizer(ops: Any, model: nn.Module, optim: torch.optim.Optimizer) -> Any:
    """The optimizer a test steps and checks for ``optim`` built over ``model``'s parameters: the stack's
    own around it where its ops declare ``attach_optimizer`` (an engine that must own the optimizer:
    DeepSpeed's ``deepspeed.initialize``), else ``optim`` itself."""
    attach = getattr(ops, "attach_optimizer", None)
    return optim if attach is None else attach(model, optim)


class Run:
    """A sharded model and its optimizer, with the unwrapped oracle trained on the same global batches.

    Built on every rank; ``train`` steps both (the oracle on the whole batch, the model on this rank's
    slice). Skips when the implementation cannot run ``setup``."""

    def __init__(self, dist: RankContext, impl: Adapter, setup: Setup, *, reversed_params: bool = False) -> None:
        if GLOBAL_BATCH % dist.world_size:
            pytest.skip(f"the global batch of {GLOBAL_BATCH} does not split evenly over {dist.world_size} ranks")
        ops, sharding = impl.require("optim_state"), impl.require("sharding")
        reason = sharding.unsupported(ShardingPlan(setup.strategy, setup.use_orig_params))
        if reason:
            pytest.skip(reason)
        self.dist, self.ops, self.setup, self.steps = dist, ops, setup, 0
        self.oracle = _build(setup.model, setup.seed, dist.device, oracle=True)
        groups = fqn_groups(setup, self.oracle)
        self.oracle_optim = make_optimizer(setup, groups, [((n,), p) for n, p in self.oracle.named_parameters()])
        model = _build(setup.model, setup.seed, dist.device)
        unit_names = set(UNITS[setup.model][setup.use_orig_params])
        unit_ids = {id(m) for n, m in model.named_modules() if n in unit_names}
        assert len(unit_ids) == len(unit_names), f"test layout error: units {unit_names} of {setup.model}"
        plan = ShardingPlan(setup.strategy, setup.use_orig_params, units=lambda m: id(m) in unit_ids, device=dist.device)
        self.model = sharding.shard(model, plan)
        named = ops.optimizer_params(self.model)
        #: the ``torch.optim`` optimizer built over the model's parameters (``reversed_params``: listing
        #: them in reverse order, as some ranks of a job do)
        self.built_optim = make_optimizer(setup, groups, list(reversed(named)) if reversed_params else named)
        fqns_of = {id(param): fqns for fqns, param in named}
        #: the FQNs in the order the built optimizer lists its parameters (a flat parameter standing for
        #: its FQNs in flat order), taken before a stack's engine could rearrange its groups
        self.optimizer_order = [fqn for group in self.built_optim.param_groups for param in group["params"] for fqn in fqns_of[id(param)]]
        #: what is stepped and whose state is checked: the built optimizer, or the stack's own optimizer
        #: around it where the stack must own it (``attach_optimizer``: DeepSpeed's ZeRO optimizer)
        self.optim = attach_optimizer(ops, self.model, self.built_optim)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            batch = _batch(self.setup, self.steps, self.dist.device)
            models.train_step(self.oracle, self.oracle_optim, batch)
            models.train_step(self.model, self.optim, batch.chunk(self.dist.world_size)[self.dist.rank])
            if self.setup.extra_state and self.steps == 0:
                _add_extra_state(self.oracle_optim)
                _add_extra_state(self.optim)
            self.steps += 1

    def oracle_osd(self) -> dict[str, Any]:
        return fqn_keyed_optim(self.oracle, self.oracle_optim)

    def module(self, fqn: str) -> nn.Module:
        """The submodule of the wrapped model whose clean name is ``fqn``; under an engine that holds the
        model as an attribute of its own (DeepSpeed's ``module.``), the one module whose clean name ends
        in ``.fqn``."""
        names = {canonical_fqn(n): m for n, m in self.model.named_modules()}
        if fqn in names:
            return names[fqn]
        found = [m for n, m in names.items() if n.endswith("." + fqn)]
        if len(found) != 1:
            raise LookupError(f"the sharded model has {len(found)} submodules named {fqn!r} under a prefix: {sorted(names)[:12]}")
        return found[0]


def load_target(dist: RankContext, impl: Adapter, setup: Setup) -> Run:
    """A run to load into that differs from any source of ``setup`` in every respect a load must
    change: built from another seed; its optimizer (and its oracle's) over the parameters in reverse
    order, param groups reversed too; stepped once, so it holds state and a step count of its own;
    then every hyperparameter perturbed (lr, betas, eps, weight_decay, ``initial_lr``, ``sdc_custom``)."""
    run = Run(dist, impl, replace(setup, seed=setup.seed + 1, order="reversed"))
    run.train(1)
    perturb_hyperparameters(run.optim)
    perturb_hyperparameters(run.oracle_optim)
    return run


# -- what a load means, on the unwrapped model ---------------------------------------------------------


def gathered(osd: dict[str, Any]) -> dict[str, Any]:
    """``osd`` with every DTensor replaced by its full value (a collective, issued in sorted FQN and
    state order so every rank gathers in the same order whatever order its dict has)."""
    fulls: dict[tuple[str, str], torch.Tensor] = {}
    for fqn in sorted(osd["state"]):
        for name in sorted(osd["state"][fqn]):
            value = osd["state"][fqn][name]
            if isinstance(value, DTensor):
                fulls[fqn, name] = value.full_tensor()
    state = {fqn: {name: fulls.get((fqn, name), value) for name, value in entry.items()} for fqn, entry in osd["state"].items()}
    return {"state": state, "param_groups": copy.deepcopy(osd["param_groups"])}


def _detached(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def load_into_oracle(run: Run, model_sd: dict[str, torch.Tensor], osd: dict[str, Any]) -> None:
    """What SPEC says loading ``model_sd`` and the full FQN-keyed ``osd`` means, done to the unwrapped
    oracle of ``run`` with torch's own loads: the model takes ``model_sd``; the optimizer takes the
    state of each FQN, and each of its param groups the hyperparameters of the saved group that lists
    its FQNs, whatever the order of its parameters and groups (torch.optim then casts state as it
    always does)."""
    run.oracle.load_state_dict({k: v.detach().clone() for k, v in model_sd.items()})
    name_of = {p: n for n, p in run.oracle.named_parameters()}
    fqns = [name_of[p] for group in run.oracle_optim.param_groups for p in group["params"]]
    ids = {fqn: i for i, fqn in enumerate(fqns)}
    saved_group_of = {fqn: g for g in osd["param_groups"] for fqn in g["params"]}
    groups, start = [], 0
    for group in run.oracle_optim.param_groups:
        mine = fqns[start : start + len(group["params"])]
        start += len(mine)
        homes = {id(saved_group_of[f]) for f in mine}
        assert len(homes) == 1, f"test error: oracle group {mine} spans saved groups"
        saved = saved_group_of[mine[0]]
        groups.append({**{k: copy.deepcopy(v) for k, v in saved.items() if k != "params"}, "params": [ids[f] for f in mine]})
    state = {ids[fqn]: {n: _detached(v) for n, v in entry.items()} for fqn, entry in osd["state"].items()}
    run.oracle_optim.load_state_dict({"state": state, "param_groups": groups})


# -- comparisons ---------------------------------------------------------------------------------------


def assert_model_matches(ops: Any, run: Run, where: str, *, atol: float | None = ATOL) -> None:
    """The full model state dict has the unwrapped model's keys in its order and its values: bit for
    bit with ``atol=None``, else to float tolerance."""
    __tracebackhide__ = True
    got = ops.full_state_dict(run.model)
    assert_same_state(got, run.oracle.state_dict(), what="full model state dict", where=where, atol=atol, rtol=0.0 if atol is None else RTOL)


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    # A list where torch.optim has a tuple (`betas`) is the same hyperparameter.
    return {k: tuple(v) if isinstance(v, list) else v for k, v in group.items() if k != "params"}


def hyperparameters_by_fqn(osd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """FQN -> the hyperparameters of the param group that lists it (sorted by FQN)."""
    out = {fqn: _hyper(group) for group in osd["param_groups"] for fqn in group["params"]}
    return {fqn: out[fqn] for fqn in sorted(out)}


def sharded_positional(value: DTensor, expected: torch.Tensor, strategy: str, what: str, where: str, atol: float | None) -> None:
    """OS-5 on this rank: a DTensor of the parameter's full shape and dtype laid out as the plan asked
    for (:func:`~conformance.asserts.assert_planned_shard` with the strategy's
    :func:`~conformance.adapters.sharding.strategy_layout`): on the 1-D mesh of every rank with
    ``Shard(0)`` (FULL_SHARD, SHARD_GRAD_OP) or ``Replicate()`` (NO_SHARD), or on the 2-D mesh whose
    dim 0 is the replicate groups and dim 1 the shard groups with ``(Replicate(), Shard(0))``
    (HYBRID_SHARD), each mesh dim's process group holding the ranks the plan puts together; its local
    shard is this rank's ``torch.chunk`` piece of ``expected`` as the plan assigns it (bit for bit, or
    to ``atol``), whatever coordinate the DTensor reports."""
    __tracebackhide__ = True
    import torch.distributed as tdist

    replicas, shards = strategy_layout(strategy, tdist.get_world_size())
    assert_planned_shard(value, expected, replicas=replicas, shards=shards, rank=tdist.get_rank(), what=what, where=where,
                         atol=atol, rtol=RTOL if atol is not None else 0.0)


def assert_osd_matches(
    got: dict[str, Any], expected: dict[str, Any], where: str, *, atol: float | None = ATOL, sharded: bool = False, strategy: str = "FULL_SHARD"
) -> None:
    """``got`` (FQN-keyed) holds what the unwrapped model's optimizer holds: the same FQNs and state
    names (in any order), the same values (bit for bit with ``atol=None``), a 0-dim state on the device
    torch.optim keeps it; param groups in order with the same hyperparameters (extra keys included)
    and the same FQNs. With ``sharded`` every positional state is a DTensor checked on this rank
    against its documented local shard (OS-5); nothing is gathered."""
    __tracebackhide__ = True
    if set(got) != {"state", "param_groups"}:
        fail("optimizer state dict: top-level keys", sorted(got), ["param_groups", "state"], where)
    state: dict[str, Any] = {}
    for fqn, entry in got["state"].items():
        want = expected["state"].get(fqn, {})
        state[fqn] = {}
        for name, value in entry.items():
            here = f"{where}: state[{fqn!r}][{name!r}]"
            reference = want.get(name)
            if isinstance(reference, torch.Tensor) and reference.dim() > 0 and sharded:
                if not isinstance(value, DTensor):
                    fail("sharded optimizer state: a positional state is not a DTensor", type(value).__name__, "DTensor", here)
                sharded_positional(value, reference, strategy, "sharded optimizer state", here, atol)
                value = reference  # checked on this rank: compare the rest of the dict around it
            elif isinstance(reference, torch.Tensor) and reference.dim() == 0 and isinstance(value, torch.Tensor):
                if value.device != reference.device:
                    fail("a 0-dim state moved", value.device, f"{reference.device}, where torch.optim keeps it", here)
            state[fqn][name] = value
    assert_same_state(state, expected["state"], what="optimizer state", where=where, atol=atol, rtol=0.0 if atol is None else RTOL, check_order=False)
    groups = [{**_hyper(g), "params": sorted(g["params"])} for g in got["param_groups"]]
    want_groups = [{**_hyper(g), "params": sorted(g["params"])} for g in expected["param_groups"]]
    assert_same_state(groups, want_groups, what="param groups", where=where, check_order=False)


def continue_from(target: Run, model_sd: dict[str, torch.Tensor], osd: dict[str, Any], steps: int, *, where: str) -> None:
    """``target`` (see :func:`load_target`) loads ``model_sd`` and ``osd`` (full or sharded) with its
    own ops, and its oracle the same by FQN. Right after the load, model and optimizer state dicts
    equal the oracle's bit for bit and every FQN has the saved hyperparameters; after one more step
    (the ``steps``-th batch) they match to float tolerance. Collective: every rank calls."""
    ops = target.ops
    full = gathered(osd)
    load_into_oracle(target, model_sd, full)  # first: a load may rewrite the dicts it is given
    ops.load_full_state_dict(target.model, model_sd)
    ops.load_optim_state_dict(target.model, target.optim, osd)
    target.steps = steps
    assert_model_matches(ops, target, f"{where}: right after the load", atol=None)
    loaded = ops.optim_state_dict(target.model, target.optim)
    assert_osd_matches(loaded, target.oracle_osd(), f"{where}: right after the load", atol=None)
    assert_same_state(hyperparameters_by_fqn(loaded), hyperparameters_by_fqn(full), what="hyperparameters after the load", where=where)
    target.train(1)
    assert_model_matches(ops, target, f"{where}: one step after the load")
    assert_osd_matches(ops.optim_state_dict(target.model, target.optim), target.oracle_osd(), f"{where}: one step after the load")


def assert_continues(target: Run, source: Run, osd: dict[str, Any] | None = None, *, where: str) -> None:
    """``target`` takes over from ``source``: :func:`continue_from` with ``source``'s full model state
    dict and ``osd`` (by default its full optimizer state dict), each run's own ops saving and loading."""
    model_sd = source.ops.full_state_dict(source.model)
    if osd is None:
        osd = source.ops.optim_state_dict(source.model, source.optim)
    continue_from(target, model_sd, osd, source.steps, where=where)


# -- across world sizes (OS-6, OS-7), in each rank's order (OS-9), by unit (OS-15) -----------------


def trip_id(trip: tuple[tuple[str, bool], tuple[str, bool]]) -> str:
    return "-to-".join(f"{s}.{'orig' if u else 'flat'}" for s, u in trip)


def save_phase(ctx: RankContext, impl: Adapter, setup: Setup, steps: int) -> tuple[dict, dict] | None:
    ops = impl.require("optim_state")
    run = Run(ctx, impl, setup)
    run.train(steps)
    saved = on_cpu((ops.full_state_dict(run.model), ops.optim_state_dict(run.model, run.optim)))
    return saved if ctx.rank == 0 else None


def load_phase(ctx: RankContext, impl: Adapter, setup: Setup, steps: int, saved: tuple[dict, dict]) -> None:
    model_sd, osd = saved
    target = load_target(ctx, impl, setup)
    model_sd = {k: v.to(ctx.device) for k, v in model_sd.items()}
    continue_from(target, model_sd, osd, steps, where=f"{setup} at world size {ctx.world_size}, loaded after {steps} steps")


def optimizer_fqn_order(ops: Any, run: Run) -> list[str]:
    """The FQNs in the order this rank's optimizer lists its parameters (a flat parameter standing for
    its FQNs in flat order)."""
    return list(run.optimizer_order)


def same_partition(info: dict[str, tuple[int, int]]) -> bool:
    """Units are {net.0}, {net.4}, {root: net.2}, whatever their numbering."""
    units: dict[int, set[str]] = {}
    for fqn, (unit, _) in info.items():
        units.setdefault(unit, set()).add(fqn.rsplit(".", 1)[0])
    return sorted(map(sorted, units.values())) == [["net.0"], ["net.2"], ["net.4"]]


# -- OS-18: golden structure ------------------------------------------------------------------------------


def structure_of(osd: dict[str, Any]) -> str:
    """State FQNs with each state's kind, shape and dtype, then param groups: stable text for a golden."""
    lines = []
    for fqn in sorted(osd["state"]):
        states = osd["state"][fqn]
        parts = []
        for name in sorted(states):
            value = states[name]
            if isinstance(value, torch.Tensor):
                parts.append(f"{name}={str(value.dtype).replace('torch.', '')}{list(value.shape)}")
            else:
                parts.append(f"{name}={value!r}")
        lines.append(f"{fqn}: {' '.join(parts)}")
    for index, group in enumerate(osd["param_groups"]):
        hyper = {k: (tuple(v) if isinstance(v, list) else v) for k, v in group.items() if k in ("lr", "weight_decay", "betas", "tag")}
        lines.append(f"group {index}: {hyper} params={sorted(group['params'])}")
    return "\n".join(lines) + "\n"
