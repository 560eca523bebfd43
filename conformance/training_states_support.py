"""What the tests of the optimizer states real training jobs leave share
(``conformance/test_training_states.py``): the model with an auxiliary head (:class:`AuxModel`), its
optimizers as jobs configure them, a plain or sharded run of it (:class:`Run`), and its comparison
with the oracle run that never took a state dict."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from conformance.adapters.sharding import ShardingPlan, child_units
from conformance.adapters.state_dict import StateDictOps
from conformance.asserts import assert_names_key, assert_same_state, assert_unchanged, check_each, clause, fail, raised, snapshot
from conformance.compare import fqn_keyed_optim
from conformance.values import perturb_hyperparameters

__all__ = [
    "RTOL",
    "ATOL",
    "GLOBAL_BATCH",
    "AuxModel",
    "build",
    "batch",
    "OPTIMIZERS",
    "groups_of",
    "Run",
    "make_run",
    "full_options",
    "on_cpu",
    "where_of",
    "sharding_params",
    "assert_matches_oracle",
    "future_after",
    "round_trip",
    "assert_no_state_entries",
    "trained_source",
    "EMPTY_LAYOUTS",
    "groups_in_layout",
    "empty_groups_round_trip",
    "unequal_empty_groups_under_strict",
    "without_state",
    "names_a_parameter",
    "check_missing_state_error",
    "trainable_fqns",
    "scheduled",
]


#: Ranks average gradients; only results of training are compared with this tolerance.
ATOL, RTOL = 1e-6, 1e-5


#: Rows of every global batch (each rank of a sharded run trains on its equal slice).
GLOBAL_BATCH = 12


class AuxModel(nn.Module):
    """A trunk and two heads; ``aux`` takes part in the loss only when asked (``use_aux``), so until
    then it has no gradient and no optimizer state while the rest has both. Sizes are uneven so
    shards are uneven at 2 and 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(5, 7)
        self.head = nn.Linear(7, 3)
        self.aux = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor, use_aux: bool = False) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        out = self.head(h)
        return torch.cat([out, self.aux(h)], dim=1) if use_aux else out


def build(seed: int, device: Any = "cpu") -> AuxModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AuxModel()
    return model.to(device)


def batch(step: int, device: Any = "cpu") -> torch.Tensor:
    return torch.randn(GLOBAL_BATCH, 5, generator=torch.Generator().manual_seed(500 + step)).to(device)


#: Optimizers as jobs configure them: every group has weight decay, so a materializing step that let
#: it act would move the parameters.
OPTIMIZERS: dict[str, Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1),
    # a tensor learning rate (as jobs that schedule it inside compiled steps use) must stay a tensor
    "adamw-tensor-lr": lambda groups: torch.optim.AdamW([{**g, "lr": torch.tensor(g.get("lr", 0.05))} for g in groups], lr=torch.tensor(0.05),
                                                       weight_decay=0.1),
    "adam": lambda groups: torch.optim.Adam(groups, lr=0.05, weight_decay=0.1),
    "sgd-momentum": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.1),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.05),
    # optimizers whose state starts from the learning rate: Rprop's step sizes, ASGD's eta (and ASGD
    # decays the parameters by lambd * eta at every step, a gradient or none)
    "rprop": lambda groups: torch.optim.Rprop(groups, lr=0.05),
    "asgd": lambda groups: torch.optim.ASGD(groups, lr=0.05, lambd=1e-2, t0=1.0),
    # a state that multiplies a factor in at every step (the product of NAdam's momentum coefficients)
    "nadam": lambda groups: torch.optim.NAdam(groups, lr=0.05, weight_decay=0.1),
}


def groups_of(model: nn.Module, *, empty_group_lr: float | None = None) -> list[dict[str, Any]]:
    """The ``head`` module's parameters in one group (other lr), the rest in another: by module, so
    that flat parameters (one per unit) split as the original ones do; with ``empty_group_lr``, a
    group without parameters between them."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # initial_lr as an LR scheduler leaves it, and a key of the user's own: a load carries both.
    groups: list[dict[str, Any]] = [{"params": [p for n, p in named if "head" not in n.split(".")], "initial_lr": 0.1, "sdc_custom": "trunk"}]
    if empty_group_lr is not None:
        groups.append({"params": [], "lr": empty_group_lr, "initial_lr": 0.5, "sdc_custom": "kept for a later add_param_group"})
    groups.append({"params": [p for n, p in named if "head" in n.split(".")], "lr": 0.02, "initial_lr": 0.04, "sdc_custom": "head"})
    return groups


@dataclass
class Run:
    """A model (plain, or sharded by the implementation) with its optimizer, and how it trains."""

    model: nn.Module
    optim: torch.optim.Optimizer
    rows: Callable[[torch.Tensor], torch.Tensor]  #: this rank's rows of a global batch

    def step(self, step: int, device: Any, *, use_aux: bool) -> None:
        self.optim.zero_grad(set_to_none=True)
        self.model(self.rows(batch(step, device)), use_aux=use_aux).pow(2).mean().backward()
        self.optim.step()


def make_run(impl: Any, dist: Any, kind: str, seed: int, *, use_orig_params: bool | None, empty_group_lr: float | None = None) -> Run:
    """``AuxModel`` of ``seed`` with optimizer ``kind``: plain when ``dist`` is None, else sharded by
    the implementation (each child a unit, FULL_SHARD, ``use_orig_params``) and trained on its rows."""
    if dist is None:
        model: nn.Module = build(seed)
        return Run(model, OPTIMIZERS[kind](groups_of(model, empty_group_lr=empty_group_lr)), lambda x: x)
    raw = build(seed, dist.device)
    plan = ShardingPlan("FULL_SHARD", use_orig_params, units=child_units(raw), device=dist.device)
    sharding = impl.require("sharding")
    reason = sharding.unsupported(plan)
    if reason is not None:
        pytest.skip(reason)
    model = sharding.shard(raw, plan)
    return Run(model, OPTIMIZERS[kind](groups_of(model, empty_group_lr=empty_group_lr)), lambda x: x.chunk(dist.world_size)[dist.rank])


def full_options(ops: StateDictOps, dist: Any, **fields: Any) -> Any:
    """Full state dicts on every rank for a sharded run (plain tensors, comparable with the oracle)."""
    return ops.options(full_state_dict=True, **fields) if dist is not None else ops.options(**fields)


def on_cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, Mapping):
        return {k: on_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [on_cpu(v) for v in tree]
    return tree


def where_of(dist: Any, kind: str, use_orig_params: bool | None) -> str:
    if dist is None:
        return f"{kind}, plain model"
    return f"{kind}, rank {dist.rank} of {dist.world_size}, use_orig_params={use_orig_params}"


def sharding_params() -> Any:
    """(use_orig_params) for the sharded variants; None marks the plain variant (no ``dist``)."""
    return pytest.mark.parametrize("use_orig_params", (False, True), ids=("flat", "orig"))


def assert_matches_oracle(ops: StateDictOps, run: Run, oracle: Run, dist: Any, *, what: str, where: str, exact: bool) -> None:
    """The run's model and optimizer state dicts equal the oracle's (FQN-keyed), bitwise when ``exact``."""
    __tracebackhide__ = True
    got_model, got_optim = ops.get_state_dict(run.model, run.optim, options=full_options(ops, dist))
    tolerance = {} if exact else {"atol": ATOL, "rtol": RTOL}
    assert_same_state(on_cpu(got_model), on_cpu(oracle.model.state_dict()), what=f"{what}: model", where=where, check_order=False, **tolerance)
    assert_same_state(on_cpu(got_optim["state"]), on_cpu(fqn_keyed_optim(oracle.model, oracle.optim)["state"]), what=f"{what}: optimizer state",
                      where=where, check_order=False, **tolerance)


# -- SD-20: taking a state dict never changes the optimizer's future ---------------------------------------


def future_after(impl: Any, kind: str, situation: str, take: bool) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """The model and optimizer after: the situation's history, a get (when ``take``), one real step."""
    ops: StateDictOps = impl.require("state_dict")
    run = make_run(impl, None, kind, 0, use_orig_params=None)
    if situation in ("partial", "accumulating"):
        run.step(0, "cpu", use_aux=False)  # aux has no gradient and no state yet
    observed: dict[str, Any] = {}
    if situation == "accumulating":
        run.optim.zero_grad(set_to_none=True)
        run.model(batch(1), use_aux=True).pow(2).mean().backward()  # a micro-batch's gradients, not yet stepped
        observed["grads"] = {n: None if p.grad is None else p.grad.clone() for n, p in run.model.named_parameters()}
    if take:
        hyper = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in run.optim.param_groups])
        params = {n: p.detach().clone() for n, p in run.model.named_parameters()}
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in run.model.named_parameters()}
        observed["got"] = ops.get_optimizer_state_dict(run.model, run.optim)
        assert_same_state({n: p.detach() for n, p in run.model.named_parameters()}, params, what="parameters after the get")
        for name, param in run.model.named_parameters():
            if (param.grad is None) != (grads[name] is None):
                fail("a parameter's grad after the get", param.grad, grads[name], name)
        assert_same_state({n: p.grad for n, p in run.model.named_parameters() if p.grad is not None},
                          {n: g for n, g in grads.items() if g is not None}, what="accumulated gradients after the get")
        assert_same_state([{k: v for k, v in g.items() if k != "params"} for g in run.optim.param_groups], hyper,
                          what="hyperparameters after the get")
    if situation == "accumulating":
        run.optim.step()
    else:
        run.step(2, "cpu", use_aux=True)
    return run.model, run.optim, observed


# -- SD-21: every trainable parameter's state round-trips ---------------------------------------------------


def round_trip(impl: Any, dist: Any, kind: str, use_orig_params: bool | None, flatten: bool, *, empty_group_lr: float | None = None,
                aux_before_save: bool = False) -> None:
    """Source trains 2 steps (without aux unless ``aux_before_save``); get; set (strict) into another
    seed's run that took a step with aux (state for every parameter) and whose hyperparameters differ;
    get again equals the saved dict bitwise; then 2 steps with aux (aux's first gradient, unless
    ``aux_before_save``) equal the run that never stopped."""
    __tracebackhide__ = True
    ops: StateDictOps = impl.require("state_dict")
    device = dist.device if dist is not None else "cpu"
    where = where_of(dist, kind, use_orig_params) + (", flattened" if flatten else "")
    oracle = make_run(impl, None, kind, 0, use_orig_params=None, empty_group_lr=empty_group_lr)
    oracle.model.to(device)
    source = make_run(impl, dist, kind, 0, use_orig_params=use_orig_params, empty_group_lr=empty_group_lr)
    for step in range(2):
        oracle.step(step, device, use_aux=aux_before_save)
        source.step(step, device, use_aux=aux_before_save)
    options = full_options(ops, dist, flatten_optimizer_state_dict=flatten)
    saved = on_cpu(ops.get_state_dict(source.model, source.optim, options=options))

    target = make_run(impl, dist, kind, 1, use_orig_params=use_orig_params, empty_group_lr=None if empty_group_lr is None else empty_group_lr * 3)
    target.step(7, device, use_aux=True)
    perturb_hyperparameters(target.optim)
    ops.set_state_dict(target.model, target.optim, model_state_dict=copy.deepcopy(saved[0]), optim_state_dict=copy.deepcopy(saved[1]),
                       options=options)
    again = on_cpu(ops.get_state_dict(target.model, target.optim, options=options))
    assert_same_state(again[0], saved[0], what="model state dict: get after set vs the saved one", where=where, check_order=False)
    assert_same_state(again[1], saved[1], what="optimizer state dict: get after set vs the saved one", where=where, check_order=False)
    if empty_group_lr is not None:
        empty = [g for g in target.optim.param_groups if not g["params"]]
        if len(empty) != 1 or empty[0]["lr"] != empty_group_lr or empty[0].get("initial_lr") != 0.5:
            fail("the param group without parameters after the load", [{k: v for k, v in g.items() if k != "params"} for g in empty],
                 f"the saved one: lr {empty_group_lr}, initial_lr 0.5", where)
    for step in range(2, 4):
        oracle.step(step, device, use_aux=True)
        target.step(step, device, use_aux=True)
    assert_matches_oracle(ops, target, oracle, dist, what="after 2 more steps with aux, vs the run that never stopped", where=where,
                          exact=dist is None)


# -- SD-23: a stateless optimizer round-trips -----------------------------------------------------------------


def assert_no_state_entries(optim: torch.optim.Optimizer, where: str) -> None:
    entries = {i: s for i, s in optim.state_dict()["state"].items()}
    if entries:
        fail("state entries of a stateless optimizer after the load", entries, "none (not even empty ones)", where)


# -- SD-26: a set between micro-batches; SD-27: a loaded state is the optimizer's own ---------------------------


def trained_source(impl: Any, kind: str = "adamw") -> tuple[Run, dict[str, Any]]:
    ops: StateDictOps = impl.require("state_dict")
    source = make_run(impl, None, kind, 0, use_orig_params=None)
    for step in range(2):
        source.step(step, "cpu", use_aux=True)
    return source, ops.get_optimizer_state_dict(source.model, source.optim)


# -- SD-25: groups without parameters pair in order, wherever they sit ------------------------------------------

#: Param-group layouts: "trunk" and "head" hold those modules' parameters, "empty" none. The source's
#: two empty groups sit before and between, the target's after all the others: a load that pairs
#: groups by position gives them the wrong hyperparameters.
EMPTY_LAYOUTS = {"source": ("empty", "trunk", "empty", "head"), "target": ("trunk", "head", "empty", "empty")}


def groups_in_layout(model: nn.Module, layout: tuple[str, ...], tag: str) -> list[dict[str, Any]]:
    """Param groups of ``model`` in ``layout``; the k-th empty group has lr ``0.125 * (k + 1)``, its own
    ``initial_lr`` and a user key naming ``tag`` and k."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups: list[dict[str, Any]] = []
    empties = 0
    for part in layout:
        if part == "empty":
            groups.append({"params": [], "lr": 0.125 * (empties + 1), "initial_lr": 0.5 + empties, "sdc_custom": f"{tag}-empty-{empties}"})
            empties += 1
        else:
            head = part == "head"
            groups.append({"params": [p for n, p in named if ("head" in n.split(".")) == head], "initial_lr": 0.1, "sdc_custom": part})
    return groups


def _empty_groups(optim: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups if not g["params"]]


def _run_in_layout(impl: Any, dist: Any, seed: int, layout: tuple[str, ...], tag: str, use_orig_params: bool | None) -> Run:
    run = make_run(impl, dist, "adamw", seed, use_orig_params=use_orig_params)
    return Run(run.model, OPTIMIZERS["adamw"](groups_in_layout(run.model, layout, tag)), run.rows)


def empty_groups_round_trip(impl: Any, dist: Any, use_orig_params: bool | None) -> None:
    __tracebackhide__ = True
    ops: StateDictOps = impl.require("state_dict")
    device = dist.device if dist is not None else "cpu"
    where = where_of(dist, "adamw", use_orig_params) + f", groups {EMPTY_LAYOUTS['source']} -> {EMPTY_LAYOUTS['target']}"
    source = _run_in_layout(impl, dist, 0, EMPTY_LAYOUTS["source"], "saved", use_orig_params)
    for step in range(2):
        source.step(step, device, use_aux=True)
    options = full_options(ops, dist)
    saved = on_cpu(ops.get_optimizer_state_dict(source.model, source.optim, options=options))
    expected = _empty_groups(source.optim)
    target = _run_in_layout(impl, dist, 1, EMPTY_LAYOUTS["target"], "target", use_orig_params)
    target.step(7, device, use_aux=True)
    perturb_hyperparameters(target.optim)
    ops.set_optimizer_state_dict(target.model, target.optim, copy.deepcopy(saved), options=options)
    assert_same_state(_empty_groups(target.optim), expected,
                      what="the groups without parameters after the load, in order (the k-th takes the k-th saved)", where=where)


def unequal_empty_groups_under_strict(impl: Any, dist: Any, use_orig_params: bool | None, saved_has: str) -> None:
    """SD-25 and SD-8 on groups without parameters that do not pair: the saved dict has one and the
    target's optimizer none (``saved_has="an-empty-group"``), or the other way round. A strict set
    raises ``RuntimeError`` or ``ValueError`` and changes neither the model nor the optimizer; the same
    dict then loads without ``strict``. Plain when ``dist`` is None, else sharded, full state dicts."""
    __tracebackhide__ = True
    ops: StateDictOps = impl.require("state_dict")
    device = dist.device if dist is not None else "cpu"
    where = where_of(dist, "adamw", use_orig_params) + f", {saved_has} saved"
    source = make_run(impl, dist, "adamw", 0, use_orig_params=use_orig_params, empty_group_lr=0.125 if saved_has == "an-empty-group" else None)
    source.step(0, device, use_aux=True)
    saved = on_cpu(ops.get_optimizer_state_dict(source.model, source.optim, options=full_options(ops, dist)))
    target = make_run(impl, dist, "adamw", 1, use_orig_params=use_orig_params, empty_group_lr=None if saved_has == "an-empty-group" else 0.5)
    target.step(3, device, use_aux=True)
    before = snapshot(model=target.model, optim=target.optim)
    exc = raised(lambda: ops.set_optimizer_state_dict(target.model, target.optim, copy.deepcopy(saved), options=full_options(ops, dist, strict=True)))

    def raises() -> None:
        if not isinstance(exc, (RuntimeError, ValueError)):
            fail(f"a strict set whose groups without parameters do not pair ({saved_has} saved)",
                 "no error" if exc is None else f"{type(exc).__name__}: {exc}", "a RuntimeError or ValueError", where)

    check_each({
        "SD-8.a": raises,
        "SD-8.b": lambda: assert_unchanged(before, where=f"{where}, after the refused strict set", model=target.model, optim=target.optim),
    })
    with clause("SD-25"):  # the refusal above is no pass: the same dict loads when not strict
        ops.set_optimizer_state_dict(target.model, target.optim, copy.deepcopy(saved), options=full_options(ops, dist, strict=False))
        got = on_cpu(ops.get_optimizer_state_dict(target.model, target.optim, options=full_options(ops, dist)))
        assert_same_state(got["state"], saved["state"], what="optimizer state after the non-strict set", where=where, check_order=False)


def without_state(saved: Mapping[str, Any], *, flatten: bool, drop: str) -> dict[str, Any]:
    """``saved`` (nested or flattened) without the state ``drop`` names; its groups list every parameter."""
    if flatten:
        prefix = "state.head.weight." if drop == "one-parameter" else "state."
        return {k: v for k, v in saved.items() if not k.startswith(prefix)}
    state = {fqn: entry for fqn, entry in saved["state"].items() if drop == "one-parameter" and fqn != "head.weight"}
    return {"state": state, "param_groups": saved["param_groups"]}


def names_a_parameter(message: str, fqns: list[str]) -> bool:
    for fqn in fqns:
        try:
            assert_names_key(message, fqn)
        except pytest.fail.Exception:
            continue
        return True
    return False


def check_missing_state_error(exc: BaseException | None, fqns: list[str], where: str) -> None:
    """``exc`` is a ``RuntimeError`` naming one of ``fqns`` whole (the parameters without state)."""
    __tracebackhide__ = True
    if not isinstance(exc, RuntimeError):
        fail(f"{where}: a strict set of a dict that lists a parameter without its state",
             "a normal return" if exc is None else f"{type(exc).__name__}: {exc}", "RuntimeError naming the parameter")
    if not names_a_parameter(str(exc), fqns):
        fail(f"{where}: the error names no parameter without state", str(exc)[:600], f"one of {fqns} named whole")


def trainable_fqns(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


# -- SD-36: scheduler state with int-keyed containers --------------------------------------------------------------


def scheduled(milestones: list[int], gamma: float, epochs: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.MultiStepLR]:
    optim = torch.optim.SGD(build(0).parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optim, milestones=milestones, gamma=gamma)
    for _ in range(epochs):
        optim.step()
        scheduler.step()
    return optim, scheduler
