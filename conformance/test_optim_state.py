"""OS: sharded data parallel and its optimizer state dicts keyed by clean FQNs (conformance/SPEC.md).

Oracle: the unwrapped zoo model, built from the same seed and trained on the whole global batch on
every rank, while the sharded model trains on its rank's equal slice of it. Second oracle: the
reference, for round trips across implementations. Goldens pin the structure of one state dict.

How the tests are built:

* Every load goes into a target that differs from the source in what the load must change
  (:func:`load_target`): built from another seed, its optimizer over the parameters in reverse order
  (param groups reversed too), stepped once so it has state of its own, then every hyperparameter
  perturbed (``initial_lr`` and a custom key included). The unwrapped oracle of the target is laid out
  the same way and loads the same dicts by FQN (:func:`load_into_oracle`), so right after a load the
  implementation must equal it bit for bit, and one more step later to float tolerance.
* Sharded results are checked on every rank against the documented layout (:class:`Layout` for flat
  parameters and their original parameters, ``torch.chunk`` pieces for DTensors), never only after
  gathering.
* Errors are tried with the bad input on every rank and on one rank only; every rank must then raise
  the same error, promptly, and nothing may change on any rank.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.hooks import RemovableHandle

from conformance import models
from conformance.adapters.base import Adapter
from conformance.adapters.sharding import STRATEGIES, ShardingPlan, hybrid_mesh_shape, strategy_layout
from conformance.asserts import (
    assert_bitwise_equal,
    assert_local_shard,
    assert_names_key,
    assert_planned_shard,
    assert_same_error_on_every_rank,
    assert_same_state,
    assert_unchanged,
    check_each,
    expected_local_chunk,
    fail,
    raised,
    snapshot,
)
from conformance.asserts import (
    bits as bits_of,
)
from conformance.compare import fqn_keyed_optim
from conformance.error_cases import WHERE, bad_input_here
from conformance.fqn import canonical_fqn
from conformance.harness.context import RankContext
from conformance.values import EDGE_DTYPES, edge_values, perturb_hyperparameters

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


def _fqn_groups(setup: Setup, oracle: nn.Module) -> list[dict[str, Any]]:
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


def _make_optimizer(setup: Setup, groups: list[dict[str, Any]], named: list[tuple[tuple[str, ...], nn.Parameter]]) -> torch.optim.Optimizer:
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


class Run:
    """A sharded model and its optimizer, with the unwrapped oracle trained on the same global batches.

    Built on every rank; ``train`` steps both (the oracle on the whole batch, the model on this rank's
    slice). Skips when the implementation cannot run ``setup``."""

    def __init__(self, dist: RankContext, impl: Adapter, setup: Setup) -> None:
        if GLOBAL_BATCH % dist.world_size:
            pytest.skip(f"the global batch of {GLOBAL_BATCH} does not split evenly over {dist.world_size} ranks")
        ops, sharding = impl.require("optim_state"), impl.require("sharding")
        reason = sharding.unsupported(ShardingPlan(setup.strategy, setup.use_orig_params))
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
        plan = ShardingPlan(setup.strategy, setup.use_orig_params, units=lambda m: id(m) in unit_ids, device=dist.device)
        self.model = sharding.shard(model, plan)
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

    def oracle_osd(self) -> dict[str, Any]:
        return fqn_keyed_optim(self.oracle, self.oracle_optim)

    def module(self, fqn: str) -> nn.Module:
        """The submodule of the wrapped model whose clean name is ``fqn``."""
        return next(m for n, m in self.model.named_modules() if canonical_fqn(n) == fqn)


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


def _to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor moved to the CPU (containers rebuilt), to send between pools. Not
    :func:`conformance.compare.full_on_cpu`: this moves full state dicts as they are, gathering nothing."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


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


def _sharded_positional(value: DTensor, expected: torch.Tensor, strategy: str, what: str, where: str, atol: float | None) -> None:
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
                _sharded_positional(value, reference, strategy, "sharded optimizer state", here, atol)
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


# -- the documented layout of flat parameters (OS-2), from the unwrapped model -------------------------


@dataclass(frozen=True)
class UnitLayout:
    """One unit's flat parameter: its parameters (first names) in flat order, with shapes and offsets."""

    fqns: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int


class Layout:
    """Where every element of a setup's parameters lies on this rank, as OS-2 documents it.

    A unit flattens the parameters no nested unit owns, in ``named_parameters`` order (a tied
    parameter once, under its first name), pads with zeros to a multiple of the shard count and keeps
    chunk ``shard_rank`` of ``ceil(numel / shards)`` elements; an original parameter holds the part of
    that chunk it overlaps (1-D, possibly empty; its own shape when the shard axis is trivial)."""

    def __init__(self, setup: Setup, oracle: nn.Module, world_size: int, rank: int) -> None:
        units = sorted((canonical_fqn(u) for u in UNITS[setup.model][setup.use_orig_params]), key=len, reverse=True)
        members: dict[str, list[tuple[str, nn.Parameter]]] = {u: [] for u in ["", *units]}
        self.unit_of: dict[str, str] = {}
        for fqn, param in oracle.named_parameters():
            unit = next((u for u in units if fqn.startswith(u + ".")), "")
            members[unit].append((fqn, param))
            self.unit_of[fqn] = unit
        self.units: dict[str, UnitLayout] = {}
        for unit, params in members.items():
            offsets = [0]
            for _, p in params:
                offsets.append(offsets[-1] + p.numel())
            self.units[unit] = UnitLayout(tuple(f for f, _ in params), tuple(p.shape for _, p in params), tuple(offsets[:-1]), offsets[-1])
        if setup.strategy == "NO_SHARD":
            self.shards, self.shard_rank = 1, 0
        elif setup.strategy == "HYBRID_SHARD":
            self.shards = hybrid_mesh_shape(world_size)[1]
            self.shard_rank = rank % self.shards
        else:
            self.shards, self.shard_rank = world_size, rank

    def chunk(self, unit: str) -> int:
        return -(-self.units[unit].numel // self.shards)

    def flat_local(self, unit: str, fulls: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's chunk of the unit's zero-padded flat tensor made of ``fulls`` (FQN -> a tensor of
        that parameter's shape, any dtype)."""
        layout = self.units[unit]
        flat = torch.cat([fulls[f].reshape(-1) for f in layout.fqns])
        chunk = self.chunk(unit)
        padded = torch.cat([flat, flat.new_zeros(chunk * self.shards - flat.numel())])
        return padded[self.shard_rank * chunk : (self.shard_rank + 1) * chunk].clone()

    def real_numel(self, unit: str) -> int:
        """How many elements of this rank's chunk are not padding."""
        chunk = self.chunk(unit)
        return max(0, min(self.units[unit].numel, (self.shard_rank + 1) * chunk) - self.shard_rank * chunk)

    def orig_local(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        """The part of ``full`` (shaped like the parameter ``fqn``) that this rank's chunk holds."""
        if self.shards == 1:
            return full.clone()
        unit = self.units[self.unit_of[fqn]]
        offset = unit.offsets[unit.fqns.index(fqn)]
        chunk = self.chunk(self.unit_of[fqn])
        lo = min(max(offset, self.shard_rank * chunk), offset + full.numel())
        hi = max(min(offset + full.numel(), (self.shard_rank + 1) * chunk), lo)
        return full.reshape(-1)[lo - offset : hi - offset].clone()

    def local_value(self, fqns: tuple[str, ...], param: torch.Tensor, fulls: dict[str, torch.Tensor], flat: bool) -> torch.Tensor:
        """What the optimizer parameter ``param`` (standing for ``fqns``) holds of ``fulls`` on this rank:
        a DTensor's ``torch.chunk`` piece, a flat parameter's chunk, or an original parameter's part."""
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            coordinate = mesh.get_coordinate()
            assert coordinate is not None, "a DTensor of a mesh this rank is not in"
            piece, _ = expected_local_chunk(fulls[fqns[0]], param.placements, tuple(mesh.shape), tuple(coordinate))
            full = fulls[fqns[0]]
            return DTensor.from_local(piece.clone(), mesh, param.placements, run_check=False, shape=full.shape, stride=full.stride())
        if flat:
            return self.flat_local(self.unit_of[fqns[0]], fulls)
        return self.orig_local(fqns[0], fulls[fqns[0]])


# -- OS-1, OS-3, OS-5: training parity and the full and sharded optimizer state dicts -------------------


@pytest.mark.req("OS-1", "OS-3", "OS-5", "OS-6")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_and_optim_state_dict(dist, impl, strategy: str, use_orig_params: bool) -> None:
    """SGD with momentum and AdamW, 3 steps: parameters and the full optimizer state dict equal the
    unwrapped model's; every positional state of the sharded one is, on every rank, the documented
    local shard of the oracle's value; AdamW's sharded one loads into a differing target (another
    seed, reversed parameter order, own state, perturbed hyperparameters), which then equals the
    oracle bitwise and, after one more step, to tolerance."""
    ops = impl.require("optim_state")
    for optimizer in OPTIMIZERS:
        setup = Setup(strategy=strategy, use_orig_params=use_orig_params, optimizer=optimizer)
        run = Run(dist, impl, setup)
        run.train(3)
        assert_model_matches(ops, run, f"{setup} after 3 steps")
        assert_osd_matches(ops.optim_state_dict(run.model, run.optim), run.oracle_osd(), f"{setup} full")
        sharded = ops.optim_state_dict(run.model, run.optim, sharded=True)
        assert_osd_matches(sharded, run.oracle_osd(), f"{setup} sharded on rank {dist.rank}", sharded=True, strategy=strategy)
        if optimizer == "adamw":  # one load per strategy and mode (SGD's loads: test_zoo_model's tiny case)
            assert_continues(load_target(dist, impl, setup), run, sharded, where=f"{setup}: loaded the sharded state dict")


@pytest.mark.req("OS-4")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_rank0_only_and_cpu_offload(dist, impl, use_orig_params: bool) -> None:
    """``rank0_only`` leaves every other rank an empty dict; ``cpu_offload`` puts every tensor on the CPU."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(use_orig_params=use_orig_params))
    run.train(2)
    options = ((True, False), (False, True), (True, True))
    # Every call first (collectives), then the checks, so a failing check leaves no rank waiting.
    results = [ops.optim_state_dict(run.model, run.optim, rank0_only=r, cpu_offload=c) for r, c in options]
    for (rank0_only, cpu_offload), osd in zip(options, results):
        where = f"{run.setup} rank0_only={rank0_only} cpu_offload={cpu_offload} on rank {dist.rank}"
        if rank0_only and dist.rank != 0:
            assert_same_state(osd, {}, what="rank0_only: the optimizer state dict of a rank other than 0", where=where)
            continue
        assert_osd_matches(osd, run.oracle_osd(), where)
        if cpu_offload:
            devices = sorted({str(v.device) for s in osd["state"].values() for v in s.values() if isinstance(v, torch.Tensor)})
            if devices not in ([], ["cpu"]):
                fail("cpu_offload: devices of the state tensors", devices, ["cpu"], where)


# -- OS-3, OS-5, OS-6, OS-12: whole value domains, bit for bit ------------------------------------------


#: What a value-domain case writes besides AdamW's own state: "param-dtype", a positional entry of the
#: parameter's dtype holding its edge values; "other-dtypes", one positional entry of every other dtype
#: of EDGE_DTYPES; "0-dim", 0-dim entries of several dtypes.
EDGE_KINDS = ("param-dtype", "other-dtypes", "0-dim")


def _edge_state(run: Run, kind: str) -> dict[str, dict[str, torch.Tensor]]:
    """Optimizer state for every trainable FQN, written rather than trained, so nothing is computed and
    every comparison is bitwise: AdamW's own entries (sane values, so it can step) and the entries of
    ``kind`` (see :data:`EDGE_KINDS`): positional ones have the parameter's shape and hold the edge
    values of their dtype (float64 beyond float32, int64 beyond 2**53, NaN payloads, inf, -0.0,
    subnormals, bf16, bool, ...) shifted per parameter; 0-dim ones are the same for every FQN (a flat
    parameter has one of each)."""
    gen = torch.Generator().manual_seed(7)
    out: dict[str, dict[str, torch.Tensor]] = {}
    params = [(n, p) for n, p in run.oracle.named_parameters() if p.requires_grad]
    for index, (fqn, param) in enumerate(params):
        entry: dict[str, torch.Tensor] = {
            "step": torch.tensor(5.0),
            "exp_avg": torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param.dtype),
            "exp_avg_sq": torch.rand(param.shape, generator=gen, dtype=torch.float64).to(param.dtype) + 0.5,
        }
        if kind == "0-dim":
            entry["scalar_float64"] = torch.tensor(1.0 + 2.0**-40, dtype=torch.float64)
            entry["scalar_int64"] = torch.tensor(2**53 + 1, dtype=torch.int64)
            entry["scalar_bool"] = torch.tensor(True)
            entry["scalar_nan"] = edge_values(param.dtype)[10].clone()  # a NaN with a payload
            entry["scalar_negzero"] = torch.tensor(-0.0, dtype=param.dtype)
        else:
            dtypes = [param.dtype] if kind == "param-dtype" else [d for d in EDGE_DTYPES if d != param.dtype]
            for dtype in dtypes:
                edges = edge_values(dtype)
                reps = -(-param.numel() // edges.numel())
                entry[f"edge_{str(dtype).removeprefix('torch.')}"] = edges.repeat(reps).roll(index)[: param.numel()].reshape(param.shape)
        out[fqn] = {k: v.to(param.device) for k, v in entry.items()}
    return out


def _piece_offset(local: torch.Tensor, full: torch.Tensor, where: str) -> int:
    """Where this rank's 1-D part ``local`` of the parameter ``full`` starts in it, found by value (the
    parameters are freshly initialized, so the match is unique): an implementation's own layout, which
    OS-2 checks separately, does not decide what this test can write."""
    flat, k = full.detach().reshape(-1), local.numel()
    if k == 0 or local.shape == full.shape:
        return 0
    rows = (bits_of(flat).unfold(0, k, 1) == bits_of(local.detach().reshape(-1))).all(dim=1).nonzero()
    if rows.numel() == 0:
        fail("an original parameter's local part is no slice of the parameter", tuple(local.shape), f"a slice of {tuple(full.shape)}", where)
    return int(rows[0])


def _write_state(run: Run, values: dict[str, dict[str, torch.Tensor]]) -> None:
    """Put ``values`` into both optimizers: the oracle's full, the sharded run's as this rank's part
    (a flat parameter's chunk of the documented layout, an original parameter's part where it lies,
    a DTensor's ``torch.chunk`` piece)."""
    params = dict(run.oracle.named_parameters())
    for fqn, entry in values.items():
        run.oracle_optim.state[params[fqn]] = {n: v.clone() for n, v in entry.items()}
    layout = Layout(run.setup, run.oracle, run.dist.world_size, run.dist.rank)
    in_optim = {p for g in run.optim.param_groups for p in g["params"]}
    for fqns, param in run.ops.optimizer_params(run.model):
        if param not in in_optim:
            continue
        orig_piece = not isinstance(param, DTensor) and run.setup.use_orig_params
        offset = _piece_offset(param, params[fqns[0]], f"{fqns[0]} on rank {run.dist.rank}") if orig_piece else 0
        state: dict[str, torch.Tensor] = {}
        for name, value in values[fqns[0]].items():
            if value.dim() == 0:
                state[name] = value.clone()
            elif orig_piece:
                state[name] = value.reshape(-1)[offset : offset + param.numel()].clone().view(param.shape)
            else:
                fulls = {f: entry[name] for f, entry in values.items()}
                state[name] = layout.local_value(fqns, param, fulls, flat=not run.setup.use_orig_params)
        run.optim.state[param] = state


@pytest.mark.req("OS-3", "OS-5", "OS-6", "OS-12")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize(
    ("model", "kind"),
    [("mlp", "param-dtype"), ("dtypes", "param-dtype"), ("mlp", "other-dtypes"), ("mlp", "0-dim")],
    ids=["float32-params-float32-edges", "float64-params-float64-edges", "float32-params-other-dtypes", "float32-params-0-dim"],
)
def test_state_values_are_carried_bit_exactly(dist, impl, model: str, kind: str, use_orig_params: bool) -> None:
    """Optimizer state written directly (see :func:`_edge_state`) is gathered into the full optimizer
    state dict bit for bit, sharded into DTensors whose local shard on every rank is the documented
    piece bit for bit; both load into a differing target bit for bit, then one more step matches the
    oracle. ``torch.optim``'s own load casts every state but ``step`` to the parameter's dtype (and CPU
    kernels disagree on the NaN payloads such a cast produces), so the loaded dicts keep the entries of
    the parameter's dtype: float32 edge values for float32 parameters, float64 ones (beyond float32)
    for float64 parameters, and 0-dim float32 NaN payloads and -0.0; entries of other dtypes are
    checked gathered and sharded. A fork that routes state through float32 or a common dtype,
    canonicalises NaNs or drops -0.0 fails here."""
    ops = impl.require("optim_state")
    source = Run(dist, impl, Setup(model=model, use_orig_params=use_orig_params))
    _write_state(source, _edge_state(source, kind))
    expected = source.oracle_osd()
    full = ops.optim_state_dict(source.model, source.optim)
    assert_osd_matches(full, expected, f"{source.setup} {kind}: full optimizer state dict", atol=None)
    sharded = ops.optim_state_dict(source.model, source.optim, sharded=True)
    assert_osd_matches(sharded, expected, f"{source.setup} {kind}: sharded, rank {dist.rank}", atol=None, sharded=True)
    dtype = next(source.oracle.parameters()).dtype
    # Loads keep the parameter's dtype (above): "other-dtypes" has nothing left to load that the other
    # cases do not, and a sharded dict's 0-dim states are the full one's.
    forms = {"param-dtype": ("full", "sharded"), "0-dim": ("full",), "other-dtypes": ()}[kind]
    for name, osd in (("full", full), ("sharded", sharded)):
        if name not in forms:
            continue
        loadable = {"state": {f: {n: v for n, v in e.items() if n == "step" or v.dtype == dtype} for f, e in osd["state"].items()},
                    "param_groups": osd["param_groups"]}
        assert_continues(load_target(dist, impl, source.setup), source, loadable, where=f"{source.setup} {kind}: {name} state dict loaded")


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
    """A full optimizer state dict saved under one strategy and use_orig_params loads under another,
    into a differing target (groups and parameters in reverse order, own state, perturbed
    hyperparameters); bitwise equal to the oracle right after, and after one more step to tolerance."""
    impl.require("optim_state")
    (s1, u1), (s2, u2) = trip
    source = Run(dist, impl, Setup(strategy=s1, use_orig_params=u1, optimizer="adamw"))
    source.train(2)
    target = load_target(dist, impl, Setup(strategy=s2, use_orig_params=u2, optimizer="adamw"))
    assert_continues(target, source, where=_trip_id(trip))


def _save_phase(ctx: RankContext, impl: Adapter, setup: Setup, steps: int) -> tuple[dict, dict] | None:
    ops = impl.require("optim_state")
    run = Run(ctx, impl, setup)
    run.train(steps)
    saved = _to_cpu((ops.full_state_dict(run.model), ops.optim_state_dict(run.model, run.optim)))
    return saved if ctx.rank == 0 else None


def _load_phase(ctx: RankContext, impl: Adapter, setup: Setup, steps: int, saved: tuple[dict, dict]) -> None:
    model_sd, osd = saved
    target = load_target(ctx, impl, setup)
    model_sd = {k: v.to(ctx.device) for k, v in model_sd.items()}
    continue_from(target, model_sd, osd, steps, where=f"{setup} at world size {ctx.world_size}, loaded after {steps} steps")


@pytest.mark.req("OS-7")
@pytest.mark.parametrize("trip", ROUND_TRIPS[:3:2], ids=_trip_id)
def test_load_at_other_world_size(pools, world_size_pair, impl, trip) -> None:
    """Saved at one world size, loaded at another (strategy and use_orig_params changing too) into a
    differing target."""
    impl.require("optim_state")
    (s1, u1), (s2, u2) = trip
    save_ws, load_ws = world_size_pair
    saved = pools.run(save_ws, _save_phase, impl, Setup(strategy=s1, use_orig_params=u1), 2)[0]
    pools.run(load_ws, _load_phase, impl, Setup(strategy=s2, use_orig_params=u2), 2, saved)


@pytest.mark.req("OS-8")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("direction", ["from-reference", "to-reference"])
def test_load_across_implementations(dist, impl, reference_impl, direction: str, use_orig_params: bool) -> None:
    """A full optimizer and model state dict of the reference loads into the implementation under test
    and back, into a differing target; bitwise equal to the oracle right after, and one more step
    matches it."""
    impl.require("optim_state"), reference_impl.require("optim_state")
    if impl.name == reference_impl.name:
        pytest.skip("a differential check needs an implementation other than the reference")
    saver, loader = (reference_impl, impl) if direction == "from-reference" else (impl, reference_impl)
    source = Run(dist, saver, Setup(strategy="FULL_SHARD", use_orig_params=use_orig_params))
    source.train(2)
    target = load_target(dist, loader, Setup(strategy="SHARD_GRAD_OP", use_orig_params=use_orig_params))
    assert_continues(target, source, where=direction)


# -- OS-9: one key order on every rank -----------------------------------------------------------------


@pytest.mark.req("OS-9")
@pytest.mark.world_size(min=2)
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_ranks_agree_on_key_order(dist, impl, use_orig_params: bool) -> None:
    """Odd ranks build their optimizer over the parameters in reverse order: every rank still returns
    the same state dict, in rank 0's order, and it loads back."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="nested", use_orig_params=use_orig_params))
    if dist.rank % 2:
        named = list(reversed(ops.optimizer_params(run.model)))
        run.optim = _make_optimizer(run.setup, _fqn_groups(run.setup, run.oracle), named)
    run.train(2)
    osd = ops.optim_state_dict(run.model, run.optim)
    assert_osd_matches(osd, run.oracle_osd(), f"{run.setup} on rank {dist.rank}")
    orders = dist.all_gather_object((list(osd["state"]), [g["params"] for g in osd["param_groups"]]))
    if any(o != orders[0] for o in orders):
        fail("ranks disagree on the order of keys", orders, "rank 0's order on every rank", f"rank {dist.rank}")
    ops.load_optim_state_dict(run.model, run.optim, osd)
    run.train(1)
    assert_model_matches(ops, run, f"{run.setup} after reload on rank {dist.rank}")


def _optimizer_fqn_order(ops: Any, run: Run) -> list[str]:
    """The FQNs in the order this rank's optimizer lists its parameters (a flat parameter standing for
    its FQNs in flat order)."""
    fqns_of = {id(param): fqns for fqns, param in ops.optimizer_params(run.model)}
    return [fqn for group in run.optim.param_groups for param in group["params"] for fqn in fqns_of[id(param)]]


@pytest.mark.req("OS-9")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("order", ["model", "reversed"])
def test_one_key_order_when_ranks_list_parameters_alike(dist, impl, order: str, use_orig_params: bool) -> None:
    """Every rank's optimizer lists the parameters in one order (the model's, or reversed with the
    groups): every rank returns the state dict with the same key order (``state`` and each group's
    ``params``), the groups listing the FQNs in the order rank 0's optimizer lists them, holding the
    unwrapped model's state; it loads back, and one more step matches the unwrapped model."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="nested", use_orig_params=use_orig_params, groups=use_orig_params, order=order))
    run.train(2)
    osd = ops.optim_state_dict(run.model, run.optim)
    where = f"{run.setup} ({order} order) on rank {dist.rank}"
    assert_osd_matches(osd, run.oracle_osd(), where)
    order0 = dist.broadcast_object(_optimizer_fqn_order(ops, run))
    keys = (list(osd["state"]), [list(g["params"]) for g in osd["param_groups"]])
    every = dist.all_gather_object(keys)
    if any(k != every[0] for k in every):
        fail("ranks disagree on the order of keys", every, "one order on every rank", where)
    got_params = [fqn for group in keys[1] for fqn in group]
    if got_params != order0:
        fail("the order of the param groups' FQNs", keys[1], f"rank 0's optimizer order {order0}", where)
    ops.load_optim_state_dict(run.model, run.optim, osd)
    run.train(1)
    assert_model_matches(ops, run, f"{where}: one step after the reload")
    assert_osd_matches(ops.optim_state_dict(run.model, run.optim), run.oracle_osd(), f"{where}: one step after the reload")


@pytest.mark.req("OS-9")
@pytest.mark.world_size(min=2)
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_differently_ordered_optimizers_hold_one_state(dist, impl, use_orig_params: bool) -> None:
    """Odd ranks list the parameters in reverse order: every rank's state dict holds the unwrapped
    model's state and hyperparameters per FQN (order aside) and the same FQNs and groups as every
    other rank's; it loads back on every rank, and one more step matches the unwrapped model, model
    and optimizer state."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="nested", use_orig_params=use_orig_params))
    if dist.rank % 2:
        named = list(reversed(ops.optimizer_params(run.model)))
        run.optim = _make_optimizer(run.setup, _fqn_groups(run.setup, run.oracle), named)
    run.train(2)
    osd = ops.optim_state_dict(run.model, run.optim)
    where = f"{run.setup} on rank {dist.rank}, odd ranks' optimizers reversed"
    assert_osd_matches(osd, run.oracle_osd(), where)
    contents = dist.all_gather_object((sorted(osd["state"]), sorted(sorted(g["params"]) for g in osd["param_groups"])))
    if any(c != contents[0] for c in contents):
        fail("ranks disagree on the FQNs and groups of the state dict", contents, "the same on every rank", where)
    ops.load_optim_state_dict(run.model, run.optim, osd)
    run.train(1)
    assert_model_matches(ops, run, f"{where}: one step after the reload")
    assert_osd_matches(ops.optim_state_dict(run.model, run.optim), run.oracle_osd(), f"{where}: one step after the reload")


# -- OS-10 .. OS-14: the model zoo ----------------------------------------------------------------------


ZOO_CASES = [
    pytest.param(Setup(model="tied"), id="tied", marks=pytest.mark.req("OS-10")),
    pytest.param(Setup(model="frozen"), id="frozen", marks=pytest.mark.req("OS-11")),
    pytest.param(Setup(model="groups", groups=True, extra_state=True), id="groups", marks=pytest.mark.req("OS-12")),
    pytest.param(Setup(model="tiny", optimizer="sgd"), id="tiny", marks=pytest.mark.req("OS-13")),
    # Optimizer order b.bias, b.weight, a.weight: at world size 2 rank 0 holds no part (so no state) of
    # the first two, then a part of the third, in one unit's batch.
    pytest.param(Setup(model="tiny", optimizer="sgd", order="reversed"), id="tiny-reversed", marks=pytest.mark.req("OS-13")),
    pytest.param(Setup(model="nested", strategy="SHARD_GRAD_OP"), id="nested", marks=pytest.mark.req("OS-14")),
    pytest.param(Setup(model="checkpoint"), id="checkpoint", marks=pytest.mark.req("OS-14")),
]


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("case", ZOO_CASES)
def test_zoo_model(dist, impl, case: Setup, use_orig_params: bool) -> None:
    """Train, compare the optimizer state dict with the unwrapped model's, load it into a differing
    target, compare bitwise, step again and compare. Tied weights have one entry under their first
    FQN; frozen parameters none; param groups keep their hyperparameters and extra keys, state its
    extra entries; a parameter with an empty shard and wrapper segments (nested units, activation
    checkpointing) change nothing."""
    ops = impl.require("optim_state")
    setup = replace(case, use_orig_params=use_orig_params)
    run = Run(dist, impl, setup)
    run.train(2)
    assert_model_matches(ops, run, str(setup))
    osd = ops.optim_state_dict(run.model, run.optim)
    assert_osd_matches(osd, run.oracle_osd(), str(setup))
    assert_continues(load_target(dist, impl, setup), run, osd, where=f"{setup} reloaded")


@pytest.mark.req("OS-13")
@pytest.mark.world_size(min=2)
@pytest.mark.parametrize(
    "setup",
    [Setup(model="tiny", optimizer="sgd", order="reversed", use_orig_params=True), Setup(model="groups", use_orig_params=True)],
    ids=["tiny-reversed", "groups"],
)
def test_no_state_where_a_parameters_part_is_empty(dist, impl, setup: Setup) -> None:
    """An optimizer that skips parameters without a gradient holds no state on a rank for a parameter
    whose part is empty there (torch's FSDP leaves exactly that); the full optimizer state dict is the
    unwrapped model's all the same, for the parameters after it in the unit too: at world size 2,
    ``tiny`` in reverse order leaves rank 0 without ``b.bias`` and ``b.weight`` before ``a.weight``,
    and ``groups`` leaves the last rank without ``inp.weight`` before the parameters it holds."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, setup)
    run.train(2)
    empty = []
    for fqns, param in ops.optimizer_params(run.model):
        if (param.to_local() if isinstance(param, DTensor) else param).numel() == 0:
            run.optim.state.pop(param, None)  # torch's FSDP never makes it: such a part gets no gradient
            empty.append(fqns[0])
    if not any(dist.all_gather_object(empty)):
        pytest.skip(f"{impl.name}: no parameter's part is empty on any rank at world size {dist.world_size}")
    assert_osd_matches(ops.optim_state_dict(run.model, run.optim), run.oracle_osd(), f"{run.setup}: no state for {empty} on rank {dist.rank}")


# -- OS-2, OS-15: layout and keying ---------------------------------------------------------------------


@pytest.mark.req("OS-2")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "HYBRID_SHARD"])
def test_what_the_optimizer_sees(dist, impl, strategy: str, use_orig_params: bool) -> None:
    """Right after wrapping, on every rank: the optimizer's parameters stand for every FQN once; a flat
    parameter lists its unit's FQNs in flat order and holds, bit for bit, this rank's chunk of the
    unit's padded flat parameter made of the unwrapped parameters; an original parameter holds its part
    of that chunk (1-D, possibly empty), a DTensor its ``torch.chunk`` piece."""
    ops = impl.require("optim_state")
    # mlp at world size 2: the root unit's 165 elements pad to 166, and net.2.bias has no element on rank 0
    run = Run(dist, impl, Setup(model="mlp", strategy=strategy, use_orig_params=use_orig_params))
    oracle = dict(run.oracle.named_parameters())
    layout = Layout(run.setup, run.oracle, dist.world_size, dist.rank)
    named = ops.optimizer_params(run.model)
    fqns = sorted(f for group, _ in named for f in group)
    if fqns != sorted(oracle):
        fail("the optimizer's parameters stand for", fqns, sorted(oracle), f"rank {dist.rank}")
    for group, param in named:
        where = f"{run.setup}, rank {dist.rank}, optimizer parameter for {list(group)}"
        if isinstance(param, DTensor):
            assert_local_shard(param.detach(), oracle[group[0]].detach(), what="parameter", where=where)
        elif not use_orig_params:
            unit = layout.unit_of[group[0]]
            if tuple(group) != layout.units[unit].fqns:
                fail("a flat parameter's FQNs (flat order)", list(group), list(layout.units[unit].fqns), where)
            expected = layout.flat_local(unit, {f: oracle[f].detach() for f in group})
            if tuple(param.shape) != tuple(expected.shape):
                fail("flat parameter: local shape", tuple(param.shape), f"{tuple(expected.shape)} = ceil(numel / {layout.shards})", where)
            real = layout.real_numel(unit)
            assert_bitwise_equal(param.detach()[:real], expected[:real], what="flat parameter: local chunk (padding excluded)", where=where)
        else:
            if len(group) != 1:
                fail("an original parameter stands for one FQN", list(group), "one FQN", where)
            expected = layout.orig_local(group[0], oracle[group[0]].detach())
            assert_bitwise_equal(param.detach(), expected, what="original parameter: its part of the local chunk", where=where)


@pytest.mark.req("OS-15")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_fqn_to_param_info_from_any_module(dist, impl, use_orig_params: bool) -> None:
    """From the root: every clean FQN with its unit's flat parameter and its index there. From the
    submodule ``net``: only the units below it, with FQNs relative to ``net``."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="mlp", use_orig_params=use_orig_params))
    try:
        from_root = ops.fqn_to_param_info(run.model)
    except Exception as exc:  # Unsupported is the adapter's way to say "no flat parameters"
        from conformance.adapters.base import Unsupported

        if isinstance(exc, Unsupported):
            pytest.skip(str(exc))
        raise
    assert sorted(from_root) == sorted(n for n, _ in run.oracle.named_parameters()), f"FQNs from the root: {sorted(from_root)}"
    assert _same_partition(from_root), f"FQN -> (flat parameter, index) from the root: {from_root}"
    assert all(index == (0 if fqn.endswith("weight") else 1) for fqn, (_, index) in from_root.items()), (
        f"each unit flattens weight, then bias: {from_root}"
    )
    from_net = ops.fqn_to_param_info(run.module("net"))
    assert sorted(from_net) == ["0.bias", "0.weight", "4.bias", "4.weight"], f"FQNs from the submodule 'net': {sorted(from_net)}"
    assert from_net["0.weight"][1] == 0 and from_net["0.bias"][1] == 1, f"indices inside net.0's flat parameter: {from_net}"


def _same_partition(info: dict[str, tuple[int, int]]) -> bool:
    """Units are {net.0}, {net.4}, {root: net.2}, whatever their numbering."""
    units: dict[int, set[str]] = {}
    for fqn, (unit, _) in info.items():
        units.setdefault(unit, set()).add(fqn.rsplit(".", 1)[0])
    return sorted(map(sorted, units.values())) == [["net.0"], ["net.2"], ["net.4"]]


# -- errors: every rank sees the bad input, or one rank does ---------------------------------------------

# Where the bad input is (WHERE: on every rank, or on the last rank only while the others get a good
# one) and whether this rank gets it (bad_input_here): conformance/error_cases.py.


def _check_error(dist: RankContext, exc: BaseException | None, types: tuple[type[BaseException], ...], keys: tuple[str, ...], where: str) -> None:
    """Every rank raised the same error (type and message), of ``types``, naming every key whole."""
    __tracebackhide__ = True
    assert_same_error_on_every_rank(dist, exc, what=where)
    if not isinstance(exc, types):
        fail(f"{where}: exception type", f"{type(exc).__name__}: {exc}", " or ".join(t.__name__ for t in types), f"rank {dist.rank}")
    for key in keys:
        assert_names_key(str(exc), key, where=f"{where}, rank {dist.rank}")


def _bad_osd(kind: str, osd: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``osd`` (full or sharded) broken one way, and the FQN the error must name. New dicts around the
    same values: ``osd`` is left as it was."""
    state = {fqn: dict(entry) for fqn, entry in osd["state"].items()}
    groups = [{**g, "params": list(g["params"])} for g in osd["param_groups"]]
    if kind == "unknown-fqn":
        state["net.9.weight"] = dict(state["net.2.weight"])
        fqn = "net.9.weight"
    elif kind == "wrong-shape":
        exp_avg = state["net.2.weight"]["exp_avg"]
        # sharded: another parameter's DTensor, a well-formed DTensor of the wrong global shape
        state["net.2.weight"]["exp_avg"] = state["net.0.weight"]["exp_avg"] if isinstance(exp_avg, DTensor) else torch.zeros(3, 7)
        fqn = "net.2.weight"
    elif kind == "same-numel":
        # net.2.weight's exp_avg reshaped (15, 10) -> (10, 15): every element there, in order, but not its
        # shape; a check by element count loads it as if it fit. Sharded: a DTensor of that global shape.
        exp_avg = state["net.2.weight"]["exp_avg"]
        if isinstance(exp_avg, DTensor):
            full = exp_avg.full_tensor()
            reshaped = distribute_tensor(full.reshape(full.shape[1], full.shape[0]), exp_avg.device_mesh, exp_avg.placements)
        else:
            reshaped = exp_avg.reshape(exp_avg.shape[1], exp_avg.shape[0]).clone()
        state["net.2.weight"]["exp_avg"] = reshaped
        fqn = "net.2.weight"
    elif kind == "extra-group":  # a saved group of parameters the optimizer does not hold (the frozen stem)
        groups.append({**{k: v for k, v in groups[0].items() if k != "params"}, "params": ["stem.weight", "stem.bias"]})
        fqn = "stem.weight"
    elif kind == "group-mismatch":
        groups[0]["params"].remove("net.4.bias")
        groups.append({**{k: v for k, v in groups[0].items() if k != "params"}, "params": ["net.4.bias"]})
        fqn = "net.4.bias"
    else:
        raise AssertionError(kind)
    return {"state": state, "param_groups": groups}, fqn


@pytest.mark.req("OS-16")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize(("use_orig_params", "form"), [(False, "full"), (True, "full"), (True, "sharded")], ids=["flat-full", "orig-full", "orig-sharded"])
@pytest.mark.parametrize("kind", ["unknown-fqn", "wrong-shape", "same-numel", "group-mismatch", "extra-group"])
def test_bad_optimizer_state_dict_is_a_clear_error(dist, impl, kind: str, use_orig_params: bool, form: str, where: str) -> None:
    """A broken optimizer state dict, full or sharded (on every rank, or on the last rank only while
    the others load a good one): every rank raises the same ValueError/RuntimeError naming the FQN
    whole, and on every rank the optimizer (state, param groups, order) and the model are as they
    were. "extra-group": one more saved param group than the optimizer has, listing parameters of the
    model the optimizer does not hold (frozen ones). "same-numel": a positional state of another shape
    with the parameter's number of elements."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="frozen" if kind == "extra-group" else "mlp", use_orig_params=use_orig_params))
    run.train(1)
    good = ops.optim_state_dict(run.model, run.optim, sharded=form == "sharded")
    bad, fqn = _bad_osd(kind, good)
    before = snapshot(optim=run.optim, model=run.model)
    exc = raised(lambda: ops.load_optim_state_dict(run.model, run.optim, bad if bad_input_here(dist, where) else good))
    check_each(
        raises=lambda: _check_error(dist, exc, (ValueError, RuntimeError), (fqn,), f"{kind} ({form}) on {where}"),
        unchanged=lambda: assert_unchanged(before, where=f"{kind} ({form}) on {where}: after the failed load, rank {dist.rank}",
                                           optim=run.optim, model=run.model),
    )


@pytest.mark.req("OS-16")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize(("use_orig_params", "form"), [(False, "full"), (True, "full"), (True, "sharded")], ids=["flat-full", "orig-full", "orig-sharded"])
@pytest.mark.parametrize("kind", ["wrong-shape", "same-numel", "group-mismatch"])
def test_bad_optimizer_state_dict_fails_alike_and_changes_nothing(dist, impl, kind: str, use_orig_params: bool, form: str) -> None:
    """A positional state of the wrong shape, or param groups that do not match the optimizer's (a
    parameter moved to a group of its own), in a full or sharded optimizer state dict on every rank:
    every rank raises the same ValueError or RuntimeError (type and message), and on every rank the
    optimizer (state, param groups, order) and the model are as they were; the optimizer then loads a
    good dict and trains on as the unwrapped model. (Naming the FQN, and the dict bad on one rank
    only, are test_bad_optimizer_state_dict_is_a_clear_error's.)"""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="mlp", use_orig_params=use_orig_params))
    run.train(1)
    good = ops.optim_state_dict(run.model, run.optim, sharded=form == "sharded")
    bad, _ = _bad_osd(kind, good)
    before = snapshot(optim=run.optim, model=run.model)
    exc = raised(lambda: ops.load_optim_state_dict(run.model, run.optim, bad))
    where = f"{kind} ({form}) on rank {dist.rank}"

    def raises() -> None:
        assert_same_error_on_every_rank(dist, exc, what=f"{kind} ({form})")
        if not isinstance(exc, (ValueError, RuntimeError)):
            fail(f"{kind} ({form}): exception type", f"{type(exc).__name__}: {exc}", "ValueError or RuntimeError", where)

    check_each(raises=raises, unchanged=lambda: assert_unchanged(before, where=f"{where}: after the failed load", optim=run.optim, model=run.model))
    ops.load_optim_state_dict(run.model, run.optim, good)
    run.train(1)
    assert_model_matches(ops, run, f"{where}: one step after loading the good dict")


class _SharedAcross(nn.Module):
    """Two linear layers named ``first`` and ``second`` whose weights are one parameter."""

    def __init__(self, first: str, second: str) -> None:
        super().__init__()
        setattr(self, first, nn.Linear(4, 4))
        setattr(self, second, nn.Linear(4, 4))
        getattr(self, second).weight = getattr(self, first).weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self.children())


def _bad_layout(kind: str, bad: bool, device: Any) -> tuple[nn.Module, tuple[str, ...], tuple[str, ...], bool]:
    """A model whose layout is bad in the way ``kind`` says when ``bad`` (else one that would wrap), the
    units to wrap, the FQNs the error must name and the ``use_orig_params`` it needs."""
    if kind == "mixed-requires-grad":
        model = models.build("frozen", device=device)
        if not bad:
            model.stem.requires_grad_(True)  # this rank's model is uniform: it would wrap
        return model, (), ("stem.weight",), False
    if kind == "mixed-dtype":  # one unit (the root) would flatten float32 and float64 parameters together
        model = models.build("mlp", device=device)
        if bad:
            model.get_submodule("net.2").double()
        return model, (), ("net.2.weight", "net.2.bias"), True
    if kind == "shared-across-units":  # embed.weight is head.weight: a unit at `embed` and the root would both hold it
        return models.build("tied", device=device), ("embed",), ("embed.weight", "head.weight"), True
    # shared by units whose names end alike ("proj" and "projX", "h.1" and "h.10"): units are told
    # apart by their whole names, so the shared parameter is still an error naming both
    first, second = kind.removeprefix("shared-across-units:").split("/")
    return _SharedAcross(first, second).to(device), (first, second), (f"{first}.weight", f"{second}.weight"), True


@pytest.mark.req("OS-17")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize(
    ("kind", "where", "strategy"),
    [("mixed-requires-grad", "every-rank", "FULL_SHARD"), ("mixed-requires-grad", "one-rank", "FULL_SHARD"),
     ("mixed-dtype", "every-rank", "FULL_SHARD"), ("mixed-dtype", "one-rank", "FULL_SHARD"),
     ("shared-across-units", "every-rank", "FULL_SHARD"), ("shared-across-units:proj/projX", "every-rank", "FULL_SHARD"),
     ("shared-across-units:enc/enc_", "every-rank", "FULL_SHARD"),
     ("mixed-requires-grad", "one-rank", "HYBRID_SHARD")],
    ids=lambda value: value.replace("/", "+").replace(":", "-"),
)
def test_bad_layout_is_a_clear_error(dist, impl, kind: str, where: str, strategy: str) -> None:
    """Frozen and trainable parameters in one flat parameter, or float32 and float64 ones (on every
    rank, or on the last rank only: a rank that froze or cast a layer by mistake), or one parameter in
    two units (also units whose names end alike): every rank raises the same ValueError naming the
    parameters whole, and every rank's module is as it was. HYBRID_SHARD's 2-D mesh spans the world
    too: the ranks agree on the error over all of it."""
    impl.require("optim_state")
    model, units, names, orig = _bad_layout(kind, bad_input_here(dist, where), dist.device)
    sharding = impl.require("sharding")
    ids = {id(m) for n, m in model.named_modules() if n in units}
    plan = ShardingPlan(strategy, orig, units=lambda m: id(m) in ids, device=dist.device)
    reason = sharding.unsupported(plan)
    if reason:
        pytest.skip(reason)
    before = snapshot(model=model)
    exc = raised(lambda: sharding.shard(model, plan))

    def unwrapped() -> None:
        assert_unchanged(before, where=f"{kind} on {where}: rank {dist.rank}", model=model)
        wrapped = [type(m).__name__ for m in model.modules() if "FullyShard" in type(m).__name__ or "FSDP" in type(m).__name__]
        if wrapped:
            fail(f"{kind}: the module was wrapped", wrapped, "no unit", f"rank {dist.rank}")

    check_each(raises=lambda: _check_error(dist, exc, (ValueError,), names, f"{kind} on {where}"), unchanged=unwrapped)


# -- OS-18: golden structure ------------------------------------------------------------------------------


def _structure(osd: dict[str, Any]) -> str:
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


@pytest.mark.req("OS-18")
def test_optim_state_dict_structure_golden(dist, impl) -> None:
    """AdamW on the ``groups`` model (two param groups, use_orig_params): the full optimizer state dict's
    structure, identical at every world size and for every implementation."""
    from expecttest import assert_expected_inline

    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="groups", groups=True))
    run.train(1)
    structure = _structure(ops.optim_state_dict(run.model, run.optim))
    assert structure == _structure(run.oracle_osd()), f"structure differs from the unwrapped model's:\n{structure}"
    if dist.rank == 0:  # one rank writes the golden when accepting
        assert_expected_inline(structure, """\
inp.bias: exp_avg=float32[9] exp_avg_sq=float32[9] step=float32[]
inp.weight: exp_avg=float32[9, 5] exp_avg_sq=float32[9, 5] step=float32[]
norm.bias: exp_avg=float32[9] exp_avg_sq=float32[9] step=float32[]
norm.weight: exp_avg=float32[9] exp_avg_sq=float32[9] step=float32[]
out.bias: exp_avg=float32[2] exp_avg_sq=float32[2] step=float32[]
out.weight: exp_avg=float32[2, 9] exp_avg_sq=float32[2, 9] step=float32[]
group 0: {'lr': 0.02, 'weight_decay': 0.01, 'tag': 'group-0', 'betas': (0.9, 0.999)} params=['inp.weight', 'out.weight']
group 1: {'lr': 0.01, 'weight_decay': 0.0, 'tag': 'group-1', 'betas': (0.9, 0.999)} params=['inp.bias', 'norm.bias', 'norm.weight', 'out.bias']
""")


# -- OS-19: model state dicts -------------------------------------------------------------------------------


@pytest.mark.req("OS-19")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("model", ["tied", "dtypes"])
def test_full_model_state_dict(dist, impl, model: str, use_orig_params: bool) -> None:
    """The full model state dict has the unwrapped model's keys in its order and its values (``tied``
    after a step, to tolerance; ``dtypes``, float64 parameters and a buffer of every edge dtype, right
    after wrapping, bit for bit); it loads into a model built from another seed, whose full state dict
    then equals it bit for bit."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model=model, use_orig_params=use_orig_params))
    trained = model != "dtypes"
    if trained:
        run.train(1)
    assert_model_matches(ops, run, f"{run.setup}: full state dict", atol=ATOL if trained else None)
    full = ops.full_state_dict(run.model)
    expected = {k: v.detach().clone() for k, v in full.items()}  # a load may rewrite the dict it is given
    target = Run(dist, impl, replace(run.setup, seed=1))
    ops.load_full_state_dict(target.model, full)
    assert_same_state(ops.full_state_dict(target.model), expected, what="full model state dict after the load", where=str(run.setup))


@pytest.mark.req("OS-19")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "HYBRID_SHARD"])  # SHARD_GRAD_OP: FULL_SHARD's layout
def test_sharded_model_state_dict(dist, impl, strategy: str, use_orig_params: bool) -> None:
    """The sharded model state dict has the full one's keys; every parameter is a DTensor of its full
    shape whose local shard on every rank is its documented piece of the full value (bit for bit),
    buffers are as in the full one; it loads into a model built from another seed, which then has the
    same full state dict bit for bit."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="tiny", strategy=strategy, use_orig_params=use_orig_params))
    run.train(1)
    full = ops.full_state_dict(run.model)
    sharded = ops.sharded_state_dict(run.model)
    if list(sharded) != list(full):
        fail("sharded model state dict: keys", list(sharded), list(full), str(run.setup))
    params = {n for n, _ in run.oracle.named_parameters()}
    for key, value in sharded.items():
        where = f"{run.setup}: {key!r} on rank {dist.rank}"
        if key in params:
            if not isinstance(value, DTensor):
                fail("sharded model state dict: a parameter is not a DTensor", type(value).__name__, "DTensor", where)
            _sharded_positional(value, full[key], strategy, "sharded model state dict", where, None)
        else:
            assert_same_state(value, full[key], what="sharded model state dict: a buffer", where=where)
    full = {k: v.detach().clone() for k, v in full.items()}
    target = Run(dist, impl, replace(run.setup, seed=1))
    ops.load_sharded_state_dict(target.model, sharded)
    assert_same_state(ops.full_state_dict(target.model), full, what="full model state dict after loading the sharded one", where=str(run.setup))


@pytest.mark.req("OS-19")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("kind", ["wrong-shape", "missing-key"])
def test_bad_model_state_dict_is_a_clear_error(dist, impl, kind: str, use_orig_params: bool, where: str) -> None:
    """A full model state dict with a wrongly shaped or a missing entry (on every rank, or on the last
    rank only): every rank raises the same ValueError/RuntimeError naming the key whole, and every
    rank's model is as it was."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="tied", use_orig_params=use_orig_params))
    good = ops.full_state_dict(run.model)
    key = "body.weight" if kind == "wrong-shape" else "body.bias"
    bad = {**good, key: torch.zeros(2, 3)} if kind == "wrong-shape" else {k: v for k, v in good.items() if k != key}
    before = snapshot(model=run.model)
    exc = raised(lambda: ops.load_full_state_dict(run.model, bad if bad_input_here(dist, where) else good))
    check_each(
        raises=lambda: _check_error(dist, exc, (ValueError, RuntimeError), (key,), f"{kind} on {where}"),
        unchanged=lambda: assert_unchanged(before, where=f"{kind} on {where}: rank {dist.rank}", model=run.model),
    )


# -- OS-20: settings survive a failure inside a state-dict call ---------------------------------------------


class InjectedFault(RuntimeError):
    """Raised by a hook the test installs, from inside an implementation's state-dict call."""


def _fail_once(register: Callable[[Callable[..., Any]], RemovableHandle]) -> None:
    """Register, through ``register``, a hook that raises :class:`InjectedFault` the first time it runs
    and removes itself."""
    handle: RemovableHandle | None = None

    def hook(*args: Any) -> None:
        assert handle is not None  # registered before anything can run it
        handle.remove()
        raise InjectedFault("fault injected by the test inside a state-dict call")

    handle = register(hook)


#: A state-dict call that fails from inside (a hook of torch's own state_dict/load_state_dict raises),
#: by name: how to arm the fault, and the call.
FAILING_CALLS: dict[str, tuple[Callable[[Run], None], Callable[[Run, dict[str, Any]], Any]]] = {
    "optim_state_dict-full": (
        lambda run: _fail_once(run.optim.register_state_dict_pre_hook),
        lambda run, saved: run.ops.optim_state_dict(run.model, run.optim),
    ),
    "optim_state_dict-sharded": (
        lambda run: _fail_once(run.optim.register_state_dict_pre_hook),
        lambda run, saved: run.ops.optim_state_dict(run.model, run.optim, sharded=True),
    ),
    "load-full-optim_state_dict": (
        lambda run: _fail_once(run.optim.register_load_state_dict_pre_hook),
        lambda run, saved: run.ops.load_optim_state_dict(run.model, run.optim, saved["optim-full"]),
    ),
    "load-sharded-optim_state_dict": (
        lambda run: _fail_once(run.optim.register_load_state_dict_pre_hook),
        lambda run, saved: run.ops.load_optim_state_dict(run.model, run.optim, saved["optim-sharded"]),
    ),
    "full-model-state_dict": (
        lambda run: _fail_once(run.module("net.2").register_state_dict_pre_hook),
        lambda run, saved: run.ops.full_state_dict(run.model),
    ),
    "sharded-model-state_dict": (
        lambda run: _fail_once(run.module("net.2").register_state_dict_pre_hook),
        lambda run, saved: run.ops.sharded_state_dict(run.model),
    ),
}


def _state_dict_calls(run: Run) -> dict[str, Any]:
    """What every state-dict call of the implementation returns now (in a fixed order: collectives)."""
    ops = run.ops
    return {
        "model-default": ops.state_dict(run.model),
        "model-full": ops.full_state_dict(run.model),
        "model-sharded": ops.sharded_state_dict(run.model),
        "optim-full": ops.optim_state_dict(run.model, run.optim),
        "optim-sharded": ops.optim_state_dict(run.model, run.optim, sharded=True),
    }


@pytest.mark.req("OS-20")
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("call", list(FAILING_CALLS))
def test_state_dict_settings_survive_a_failure(dist, impl, call: str) -> None:
    """A state-dict call that raises from inside (a hook of the optimizer's or a submodule's own
    state_dict/load_state_dict raises once, on every rank) lets that exception through; afterwards
    every state-dict call (the model's default ``state_dict()``, full and sharded model state dicts,
    full and sharded optimizer state dicts) returns exactly what it returned before, and training goes
    on matching the unwrapped model: no state-dict type, option or unsharded parameter is left behind."""
    ops = impl.require("optim_state")
    run = Run(dist, impl, Setup(model="mlp"))
    run.train(1)
    before = _state_dict_calls(run)
    arm, failing = FAILING_CALLS[call]
    arm(run)
    exc = raised(lambda: failing(run, before))
    if not isinstance(exc, InjectedFault):
        fail(f"{call}: what the failing call raised", f"{type(exc).__name__}: {exc}" if exc else "nothing",
             "the InjectedFault raised inside it", f"rank {dist.rank}")
    after = _state_dict_calls(run)
    for name in before:
        assert_same_state(after[name], before[name], what=f"{name} after a failed {call}", where=f"rank {dist.rank}")
    run.train(1)
    assert_model_matches(ops, run, f"{call}: one step after the failure")
