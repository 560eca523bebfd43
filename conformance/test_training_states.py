"""SD: the optimizer states real training jobs leave (conformance/SPEC.md, SD-20, SD-21, SD-23..SD-25,
SD-32, SD-33).

Each requirement answers a defect users reported against ``torch.distributed.checkpoint.state_dict``
or the trainers built on it (SPEC names the reports). The states are the ones a job really has:

* an optimizer that never stepped, or that holds state for some parameters only (a parameter that
  has not received a gradient yet: an MoE expert no token was routed to, an auxiliary head whose loss
  is not wired in yet), or whose parameters hold accumulated gradients (a get between micro-batches);
* an optimizer that keeps no state at all (SGD without momentum);
* a parameter trained, then frozen while still held by the optimizer;
* a param group without parameters (kept for a scheduler or a later ``add_param_group``), or several;
* the optimizer's own ``state_dict()`` (keyed by ids) handed to the state_dict API;
* a dict that lists a parameter without its state (cut short, or written by a stateless optimizer).

Oracle: the run that never took a state dict, trained identically on one process on the whole batch.
Every comparison of a get or a set with what was saved is bitwise; a sharded run is compared with the
oracle to float tolerance (its gradients are averaged over ranks). Each test runs on a plain model
(on the controller) and, where it names ``dist``, on a model sharded by the implementation with
either ``use_orig_params`` on every rank, full state dicts gathered on every rank.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from conformance.adapters.state_dict import StateDictOps
from conformance.asserts import (
    assert_same_error_on_every_rank,
    assert_same_state,
    assert_unchanged,
    check_each,
    clause,
    fail,
    raised,
    snapshot,
)
from conformance.compare import fqn_keyed_optim
from conformance.error_cases import bad_input_here, parametrize_where
from conformance.training_states_support import (
    OPTIMIZERS,
    assert_matches_oracle,
    assert_no_state_entries,
    batch,
    build,
    check_missing_state_error,
    empty_groups_round_trip,
    full_options,
    future_after,
    groups_of,
    make_run,
    round_trip,
    scheduled,
    sharding_params,
    trainable_fqns,
    trained_source,
    unequal_empty_groups_under_strict,
    where_of,
    without_state,
)
from conformance.values import perturb_hyperparameters


@pytest.mark.req("SD-11")
def test_saved_extra_keys_are_restored_into_groups_that_lack_them(impl: Any) -> None:
    """The saved groups carry ``initial_lr`` (an LR scheduler's) and a key of the user's; a target whose
    groups have neither (no scheduler built yet) gets both from the set (pytorch/pytorch#140900)."""
    ops: StateDictOps = impl.require("state_dict")
    source, saved = trained_source(impl)
    target_model = build(1)
    target_optim = torch.optim.AdamW([{"params": g["params"]} for g in groups_of(target_model)], lr=0.3)
    ops.set_optimizer_state_dict(target_model, target_optim, copy.deepcopy(saved))
    got = [{k: v for k, v in g.items() if k != "params"} for g in ops.get_optimizer_state_dict(target_model, target_optim)["param_groups"]]
    assert_same_state(got, [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]],
                      what="param groups after a set into groups without initial_lr", check_order=False)


@pytest.mark.req("SD-20")
@pytest.mark.parametrize("situation", ("fresh", "partial", "accumulating"))
@pytest.mark.parametrize("kind", ("adamw", "adam", "sgd-momentum", "adamw-tensor-lr", "rprop", "asgd", "nadam"))
def test_get_never_changes_the_optimizers_future(impl: Any, kind: str, situation: str) -> None:
    """A get of a never-stepped optimizer (``fresh``), of one with state for some parameters only
    (``partial``: the aux head has none), or between micro-batches (``accumulating``: every parameter
    holds a gradient) changes no parameter, grad or hyperparameter, and the next real step computes
    bit for bit what it computes in the run that took no state dict (a zero-lr step that counts would
    make Adam's first update use step-2 bias correction: pytorch/pytorch#164929; a state made at a zero
    learning rate starts Rprop's step sizes at 0, which then never grow, and ASGD's eta at 0; a step
    that counts starts NAdam's momentum product one coefficient on)."""
    with_get = future_after(impl, kind, situation, take=True)
    without = future_after(impl, kind, situation, take=False)
    where = f"{kind}, {situation}"
    assert_same_state(dict(with_get[0].named_parameters()), dict(without[0].named_parameters()),
                      what="parameters after one real step, with a get before it vs without", where=where)
    assert_same_state(fqn_keyed_optim(*with_get[:2]), fqn_keyed_optim(*without[:2]),
                      what="optimizer state after one real step, with a get before it vs without", where=where)
    if situation == "partial":
        got = with_get[2]["got"]
        for fqn in ("aux.weight", "aux.bias"):
            if fqn not in got["state"]:
                fail("state of a trainable parameter without a gradient yet, in the get", sorted(got["state"]), f"an entry for {fqn!r}", where)


@pytest.mark.req("SD-21")
@pytest.mark.parametrize("flatten", (False, True), ids=("nested", "flattened"))
@pytest.mark.parametrize("kind", ("adamw", "sgd-momentum"))
def test_parameter_without_gradient_yet_round_trips(impl: Any, kind: str, flatten: bool) -> None:
    """The aux head has no gradient yet while the rest has state: get holds state for it too, a strict
    set accepts the dict, and once aux is trained the run equals the one that never stopped, bitwise
    (pytorch/pytorch#192202; torchtitan, verl and NeMo carried workarounds)."""
    round_trip(impl, None, kind, None, flatten)


@pytest.mark.req("SD-21")
@sharding_params()
@pytest.mark.parametrize("kind", ("adamw",))
def test_sharded_parameter_without_gradient_yet_round_trips(dist: Any, impl: Any, kind: str, use_orig_params: bool) -> None:
    """As the plain test, on a model sharded with each child a unit: the aux unit's parameters have no
    gradient on any rank; full state dicts on every rank; the end state equals the oracle to float
    tolerance on every rank."""
    round_trip(impl, dist, kind, use_orig_params, flatten=False)


@pytest.mark.req("SD-23")
@pytest.mark.parametrize("flatten", (False, True), ids=("nested", "flattened"))
def test_stateless_optimizer_round_trips(impl: Any, flatten: bool) -> None:
    """Training on is compared with the run that never stopped bit for bit (pytorch/pytorch#192225, #133415)."""
    where = f"sgd, {'flattened' if flatten else 'nested'}"
    ops: StateDictOps = impl.require("state_dict")
    trained = make_run(impl, None, "sgd", 0, use_orig_params=None)
    trained.step(0, "cpu", use_aux=True)
    got = ops.get_optimizer_state_dict(trained.model, trained.optim, options=ops.options(flatten_optimizer_state_dict=flatten))
    state_keys = [k for k in got if k.startswith("state.")] if flatten else list(got["state"])
    if state_keys:
        fail("state of a stateless optimizer in the get", state_keys, "none", where)
    round_trip(impl, None, "sgd", None, flatten, aux_before_save=True)
    target = make_run(impl, None, "sgd", 1, use_orig_params=None)
    source = make_run(impl, None, "sgd", 0, use_orig_params=None)
    source.step(0, "cpu", use_aux=True)
    options = ops.options(flatten_optimizer_state_dict=flatten)
    ops.set_optimizer_state_dict(target.model, target.optim, ops.get_optimizer_state_dict(source.model, source.optim, options=options),
                                 options=options)
    assert_no_state_entries(target.optim, where)


@pytest.mark.req("SD-23")
@sharding_params()
def test_sharded_stateless_optimizer_round_trips(dist: Any, impl: Any, use_orig_params: bool) -> None:
    """As the plain test, sharded: a strict set loads, no rank's optimizer holds a state entry, and
    training on matches the oracle."""
    round_trip(impl, dist, "sgd", use_orig_params, flatten=False, aux_before_save=True)
    ops: StateDictOps = impl.require("state_dict")
    source = make_run(impl, dist, "sgd", 0, use_orig_params=use_orig_params)
    source.step(0, dist.device, use_aux=True)
    saved = ops.get_optimizer_state_dict(source.model, source.optim, options=full_options(ops, dist))
    target = make_run(impl, dist, "sgd", 1, use_orig_params=use_orig_params)
    ops.set_optimizer_state_dict(target.model, target.optim, saved, options=full_options(ops, dist))
    assert_no_state_entries(target.optim, where_of(dist, "sgd", use_orig_params))


@pytest.mark.req("SD-24")
@pytest.mark.parametrize("flatten", (False, True), ids=("nested", "flattened"))
def test_state_of_a_parameter_frozen_after_training_is_kept(impl: Any, flatten: bool) -> None:
    """The body is trained, then frozen (``requires_grad_(False)``) while the optimizer still holds it, as
    a fine-tuning schedule does."""
    ops: StateDictOps = impl.require("state_dict")
    options = ops.options(flatten_optimizer_state_dict=flatten)
    source = make_run(impl, None, "adamw", 0, use_orig_params=None)
    for step in range(2):
        source.step(step, "cpu", use_aux=True)
    source.model.body.requires_grad_(False)
    expected = copy.deepcopy(fqn_keyed_optim(source.model, source.optim))
    saved = copy.deepcopy(ops.get_optimizer_state_dict(source.model, source.optim, options=options))
    target = make_run(impl, None, "adamw", 1, use_orig_params=None)
    target.step(5, "cpu", use_aux=True)
    target.model.body.requires_grad_(False)
    perturb_hyperparameters(target.optim)
    ops.set_optimizer_state_dict(target.model, target.optim, saved, options=options)
    got = fqn_keyed_optim(target.model, target.optim)
    where = "flattened" if flatten else "nested"
    for fqn in ("body.weight", "body.bias"):
        if fqn not in got["state"]:
            fail("optimizer state of a parameter frozen after training, after the load", sorted(got["state"]), f"an entry for {fqn!r}", where)
    assert_same_state(got["state"], expected["state"], what="optimizer state after the load vs the source's", where=where, check_order=False)


@pytest.mark.req("SD-25")
@pytest.mark.parametrize("flatten", (False,), ids=("nested",))
def test_param_group_without_parameters_round_trips(impl: Any, flatten: bool) -> None:
    """An optimizer with a group that holds no parameter (its own lr and a key of the user's): set
    gives the target's empty group the saved hyperparameters, not its own, so a later get equals the
    saved dict (pytorch/pytorch#143828); every parameter has state before the save."""
    round_trip(impl, None, "adamw", None, flatten, empty_group_lr=0.125, aux_before_save=True)


@pytest.mark.req("SD-25")
@sharding_params()
def test_sharded_param_group_without_parameters_round_trips(dist: Any, impl: Any, use_orig_params: bool) -> None:
    """As the plain test, on a sharded model, on every rank."""
    round_trip(impl, dist, "adamw", use_orig_params, flatten=False, empty_group_lr=0.125, aux_before_save=True)


@pytest.mark.req("SD-25")
def test_groups_without_parameters_pair_in_order_wherever_they_sit(impl: Any) -> None:
    """Two groups without parameters, each with its own hyperparameters and user key, sit first and
    third in the source's groups and last in the target's: after a set the target's first empty group
    holds the source's first one's hyperparameters and its second the second's, whatever their
    positions (a load pairing groups by position gives them a group of parameters' or each other's)."""
    empty_groups_round_trip(impl, None, None)


@pytest.mark.req("SD-25")
@sharding_params()
def test_sharded_groups_without_parameters_pair_in_order_wherever_they_sit(dist: Any, impl: Any, use_orig_params: bool) -> None:
    """As the plain test, on a sharded model, full state dicts, on every rank."""
    empty_groups_round_trip(impl, dist, use_orig_params)


@pytest.mark.req("SD-25", "SD-8")
@pytest.mark.parametrize("saved_has", ["an-empty-group", "none"], ids=("saved-empty-group", "target-empty-group"))
def test_unequal_numbers_of_groups_without_parameters_under_strict_change_nothing(impl: Any, saved_has: str) -> None:
    """The saved dict has a group without parameters and the target's optimizer none, or the other way
    round: under ``strict`` the set raises (a ``RuntimeError`` or ``ValueError``: a group the other side
    lacks is a missing or unexpected entry) and neither the model nor the optimizer changes; without
    ``strict`` the same dict loads (the state of every parameter is the source's)."""
    unequal_empty_groups_under_strict(impl, None, None, saved_has)


@pytest.mark.req("SD-25", "SD-8")
@sharding_params()
@pytest.mark.parametrize("saved_has", ["an-empty-group", "none"], ids=("saved-empty-group", "target-empty-group"))
def test_sharded_unequal_numbers_of_groups_without_parameters_under_strict_change_nothing(dist: Any, impl: Any, use_orig_params: bool,
                                                                                         saved_has: str) -> None:
    """As the plain test, on a sharded model, full state dicts, on every rank: a sharded set checks the
    dict's keys on a path of its own (the flat parameter's slots), which must refuse it alike."""
    unequal_empty_groups_under_strict(impl, dist, use_orig_params, saved_has)


@pytest.mark.req("SD-26")
def test_set_while_parameters_hold_gradients_loads_the_state(impl: Any) -> None:
    """The target's gradients come from a forward and backward before the set (as between micro-batches,
    or after a warm-up); in pytorch/pytorch#140898 the loaded state was then silently empty."""
    ops: StateDictOps = impl.require("state_dict")
    source, saved = trained_source(impl)
    expected = copy.deepcopy(fqn_keyed_optim(source.model, source.optim))
    target = make_run(impl, None, "adamw", 1, use_orig_params=None)
    target.model(batch(9), use_aux=True).pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in target.model.named_parameters() if p.grad is not None}
    ops.set_optimizer_state_dict(target.model, target.optim, copy.deepcopy(saved))
    assert_same_state(fqn_keyed_optim(target.model, target.optim)["state"], expected["state"],
                      what="optimizer state after a set while the parameters held gradients", check_order=False)
    assert_same_state({n: p.grad for n, p in target.model.named_parameters() if p.grad is not None}, grads,
                      what="gradients after the set")


@pytest.mark.req("SD-27")
def test_loaded_state_shares_no_tensor_with_the_given_dict(impl: Any) -> None:
    """In pytorch/pytorch#196083 the loaded state aliased the source's tensors in one process, so two
    optimizers stepped one state. Each entry also holds what other optimizers keep beside tensors (as
    LBFGS does): a list of tensors, whose tensors must not be shared either, and a Python int."""
    ops: StateDictOps = impl.require("state_dict")
    source, saved = trained_source(impl)
    for entry in saved["state"].values():
        entry["history"] = [entry["exp_avg"] * 2, entry["exp_avg_sq"] * 3]
        entry["evaluations"] = 7
    expected = copy.deepcopy(fqn_keyed_optim(source.model, source.optim))
    for fqn, entry in expected["state"].items():
        entry.update(copy.deepcopy({k: saved["state"][fqn][k] for k in ("history", "evaluations")}))
    target = make_run(impl, None, "adamw", 1, use_orig_params=None)
    ops.set_optimizer_state_dict(target.model, target.optim, saved)  # the get's own dict, not a copy
    source.step(3, "cpu", use_aux=True)
    for entry in saved["state"].values():
        for value in entry.values():
            for tensor in value if isinstance(value, list) else [value]:
                if isinstance(tensor, torch.Tensor):
                    tensor.add_(1.0)
    assert_same_state(fqn_keyed_optim(target.model, target.optim)["state"], expected["state"],
                      what="the target's optimizer state after the source stepped and the given dict changed", check_order=False)


@pytest.mark.req("SD-32", "SD-27")
@pytest.mark.parametrize("kind", ("adamw", "sgd-momentum", "sgd"))
def test_optimizers_own_state_dict_loads(impl: Any, kind: str) -> None:
    """``set_optimizer_state_dict(model, optim, optim.state_dict())``, without a process group: the
    int-keyed dict ``torch.optim`` gives (of a source that trained every parameter) loads into another
    seed's optimizer with other hyperparameters and state of its own, leaving exactly the source's
    state and hyperparameters (bit for bit, no tensor shared with the dict), and training on equals the
    run that never stopped (pytorch/pytorch#124942: the dict was refused; PR #127385)."""
    ops: StateDictOps = impl.require("state_dict")
    where = f"{kind}, id-keyed dict, no process group"
    oracle = make_run(impl, None, kind, 0, use_orig_params=None)
    source = make_run(impl, None, kind, 0, use_orig_params=None)
    for step in range(2):
        oracle.step(step, "cpu", use_aux=True)
        source.step(step, "cpu", use_aux=True)
    given = source.optim.state_dict()
    expected = copy.deepcopy(fqn_keyed_optim(source.model, source.optim))
    target = make_run(impl, None, kind, 1, use_orig_params=None)
    target.step(7, "cpu", use_aux=True)
    perturb_hyperparameters(target.optim)
    target.model.load_state_dict(source.model.state_dict())
    with clause("SD-32.a"):
        ops.set_optimizer_state_dict(target.model, target.optim, given)
        assert_same_state(fqn_keyed_optim(target.model, target.optim), expected, what="optimizer after the set of the id-keyed dict vs the source's",
                          where=where)
        source.step(2, "cpu", use_aux=True)  # steps the tensors `given` holds: the target's must not move
        for step in range(2, 4):
            oracle.step(step, "cpu", use_aux=True)
            target.step(step, "cpu", use_aux=True)
        assert_matches_oracle(ops, target, oracle, None, what="after 2 more steps, vs the run that never stopped", where=where, exact=True)


#: Ways an id-keyed dict does not fit the optimizers it is given with.
ID_KEYED_MISFITS = ("other-groups", "one-group-more", "an-fqn-among-ids", "two-optimizers")


@pytest.mark.req("SD-32")
@pytest.mark.parametrize("misfit", ID_KEYED_MISFITS)
def test_optimizers_own_state_dict_that_does_not_fit_changes_nothing(impl: Any, misfit: str) -> None:
    """An id-keyed dict whose groups do not fit the optimizer (one group for the target's two; or two
    groups that fit the target's first two, which has a third, empty one: matching groups pairwise
    until one list ends would load it; or one id written as its parameter's FQN, a dict mixing the two
    forms), or given with two optimizers (its ids name positions in one: the dict of the first, which
    would load into it, given with both) is refused with a ``ValueError`` or ``RuntimeError``, and
    neither optimizer nor the model changes; the same dict (the mixed one before its id was written
    over) given with an optimizer it fits loads."""
    ops: StateDictOps = impl.require("state_dict")
    target_model = build(1)
    trunk = [p for n, p in target_model.named_parameters() if "head" not in n.split(".")]
    head = [p for n, p in target_model.named_parameters() if "head" in n.split(".")]
    fitting: dict[str, Any] = {}
    if misfit == "other-groups":
        source = make_run(impl, None, "adamw", 0, use_orig_params=None)
        source.step(0, "cpu", use_aux=True)
        given = source.optim.state_dict()
        fits = (source.model, source.optim)
        optims: list[torch.optim.Optimizer] = [OPTIMIZERS["adamw"]([{"params": trunk + head}])]
    elif misfit == "an-fqn-among-ids":
        # The target's own dict with one id of its first group written as that parameter's FQN.
        source = make_run(impl, None, "adamw", 0, use_orig_params=None)
        source.step(0, "cpu", use_aux=True)
        fits = (source.model, source.optim)
        fitting = source.optim.state_dict()
        optims = [OPTIMIZERS["adamw"]([{"params": trunk}, {"params": head}])]
        given = copy.deepcopy(fitting)
        given["param_groups"][0]["params"][0] = next(n for n, p in source.model.named_parameters()
                                                     if p is source.optim.param_groups[0]["params"][0])
    elif misfit == "one-group-more":
        twin = build(2)
        twin_optim = OPTIMIZERS["adamw"]([{"params": [p for n, p in twin.named_parameters() if "head" not in n.split(".")]},
                                          {"params": [p for n, p in twin.named_parameters() if "head" in n.split(".")]}])
        twin(batch(3), use_aux=True).pow(2).mean().backward()
        twin_optim.step()
        given = twin_optim.state_dict()
        fits = (twin, twin_optim)
        optims = [OPTIMIZERS["adamw"]([{"params": trunk}, {"params": head}, {"params": []}])]
    else:
        # The first optimizer's own dict, from another seed's model: alone, that optimizer takes it.
        twin = build(2)
        twin_optim = OPTIMIZERS["adamw"]([{"params": [p for n, p in twin.named_parameters() if "head" not in n.split(".")]}])
        twin(batch(3), use_aux=True).pow(2).mean().backward()
        twin_optim.step()
        given = twin_optim.state_dict()
        fits = (twin, twin_optim)
        optims = [OPTIMIZERS["adamw"]([{"params": trunk}]), OPTIMIZERS["adamw"]([{"params": head}])]
    target_model(batch(7), use_aux=True).pow(2).mean().backward()
    for optim in optims:
        optim.step()
    with clause("SD-32.a"):  # the same dict loads where it fits: a set that refuses everything does not pass
        ops.set_optimizer_state_dict(*fits, copy.deepcopy(fitting if misfit == "an-fqn-among-ids" else given))
    before = snapshot(model=target_model, optims=optims)
    exc = raised(lambda: ops.set_optimizer_state_dict(target_model, optims if len(optims) > 1 else optims[0], copy.deepcopy(given)))
    where = f"id-keyed dict, {misfit}"

    def raises() -> None:
        if not isinstance(exc, (ValueError, RuntimeError)):
            fail(f"{where}: the set", "a normal return" if exc is None else f"{type(exc).__name__}: {exc}", "ValueError or RuntimeError")

    check_each({"SD-32.b": raises, "SD-32.c": lambda: assert_unchanged(before, where=where, model=target_model, optims=optims)})


#: What a cut-short dict lacks: every state entry of ``head.weight`` (its moments, its step), or every
#: state entry of every parameter (the ``state`` section gone, the groups kept).
DROPS = ("one-parameter", "every-parameter")


@pytest.mark.req("SD-33", "SD-8")
@pytest.mark.parametrize("drop", DROPS)
@pytest.mark.parametrize("flatten", (False, True), ids=("nested", "flattened"))
@pytest.mark.parametrize("kind", ("adamw", "sgd-momentum"))
def test_missing_state_the_optimizer_keeps_is_an_error(impl: Any, kind: str, flatten: bool, drop: str) -> None:
    """A dict of an optimizer that keeps state for every trainable parameter (AdamW's moments, SGD's
    momentum buffer), cut short: ``head.weight`` (or every parameter) still listed in its group, its
    state gone. A strict set raises a ``RuntimeError`` naming the parameter and changes nothing, not
    the state nor the hyperparameters (pytorch/pytorch#192224: the flattened form loaded and dropped the
    moments silently; torch 2.13 refuses the nested form)."""
    ops: StateDictOps = impl.require("state_dict")
    where = f"{kind}, {'flattened' if flatten else 'nested'}, state of {drop} dropped"
    options = ops.options(flatten_optimizer_state_dict=flatten)
    source = make_run(impl, None, kind, 0, use_orig_params=None)
    for step in range(2):
        source.step(step, "cpu", use_aux=True)
    bad = without_state(ops.get_optimizer_state_dict(source.model, source.optim, options=options), flatten=flatten, drop=drop)
    target = make_run(impl, None, kind, 1, use_orig_params=None)
    target.step(7, "cpu", use_aux=True)
    perturb_hyperparameters(target.optim)
    before = snapshot(model=target.model, optim=target.optim)
    exc = raised(lambda: ops.set_optimizer_state_dict(target.model, target.optim, copy.deepcopy(bad), options=options))
    fqns = ["head.weight"] if drop == "one-parameter" else trainable_fqns(target.model)
    check_each({"SD-33.a": lambda: check_missing_state_error(exc, fqns, where),
                "SD-33.b": lambda: assert_unchanged(before, where=where, model=target.model, optim=target.optim)})


@pytest.mark.req("SD-33", "SD-23")
@pytest.mark.parametrize("case", ("stateless-into-momentum", "momentum-into-stateless"))
def test_missing_state_follows_the_loaded_hyperparameters(impl: Any, case: str) -> None:
    """Whether a listed parameter without state is an error depends on the optimizer with the loaded
    hyperparameters, not on the target's own nor on the dict alone. "stateless-into-momentum": SGD
    without momentum saves no state; a strict set into SGD with momentum (which holds buffers) loads
    ``momentum=0`` and leaves no state entry at all; training on equals the run that never stopped.
    "momentum-into-stateless": SGD with momentum's dict with every state entry gone, into SGD without
    momentum: with the loaded ``momentum=0.9`` the buffers would be dropped, so a strict set raises
    naming a parameter and changes nothing."""
    ops: StateDictOps = impl.require("state_dict")
    source_kind, target_kind = ("sgd", "sgd-momentum") if case == "stateless-into-momentum" else ("sgd-momentum", "sgd")
    oracle = make_run(impl, None, source_kind, 0, use_orig_params=None)
    source = make_run(impl, None, source_kind, 0, use_orig_params=None)
    for step in range(2):
        oracle.step(step, "cpu", use_aux=True)
        source.step(step, "cpu", use_aux=True)
    saved = without_state(ops.get_optimizer_state_dict(source.model, source.optim), flatten=False, drop="every-parameter")
    target = make_run(impl, None, target_kind, 1, use_orig_params=None)
    target.step(7, "cpu", use_aux=True)
    target.model.load_state_dict(source.model.state_dict())
    if case == "momentum-into-stateless":
        before = snapshot(model=target.model, optim=target.optim)
        exc = raised(lambda: ops.set_optimizer_state_dict(target.model, target.optim, copy.deepcopy(saved)))
        check_each({"SD-33.a": lambda: check_missing_state_error(exc, trainable_fqns(target.model), case),
                    "SD-33.b": lambda: assert_unchanged(before, where=case, model=target.model, optim=target.optim)})
        return
    ops.set_optimizer_state_dict(target.model, target.optim, copy.deepcopy(saved))
    assert_no_state_entries(target.optim, case)
    for step in range(2, 4):
        oracle.step(step, "cpu", use_aux=True)
        target.step(step, "cpu", use_aux=True)
    assert_matches_oracle(ops, target, oracle, None, what="after 2 more steps, vs the run that never stopped", where=case, exact=True)


@pytest.mark.req("SD-33")
@pytest.mark.rank_timeout(60)
@parametrize_where
@pytest.mark.parametrize("flatten", (False, True), ids=("nested", "flattened"))
@sharding_params()
def test_sharded_missing_state_is_an_error(dist: Any, impl: Any, use_orig_params: bool, flatten: bool, where: str) -> None:
    """As the plain test, on a sharded model (full dicts, nested or flattened) whose ``head`` unit
    flattens ``head.weight`` and ``head.bias`` into one flat parameter without ``use_orig_params``:
    the dict lacks ``head.weight``'s state only (on every rank, or on the last rank while the others
    get the whole dict). Every rank raises the same ``RuntimeError`` naming it, and no rank changes
    anything (a flat parameter half of whose state is missing must not be filled with zeros)."""
    ops: StateDictOps = impl.require("state_dict")
    options = full_options(ops, dist, flatten_optimizer_state_dict=flatten)
    source = make_run(impl, dist, "adamw", 0, use_orig_params=use_orig_params)
    for step in range(2):
        source.step(step, dist.device, use_aux=True)
    good = ops.get_optimizer_state_dict(source.model, source.optim, options=options)
    given = without_state(good, flatten=flatten, drop="one-parameter") if bad_input_here(dist, where) else good
    target = make_run(impl, dist, "adamw", 1, use_orig_params=use_orig_params)
    target.step(7, dist.device, use_aux=True)
    perturb_hyperparameters(target.optim)
    before = snapshot(model=target.model, optim=target.optim)
    exc = raised(lambda: ops.set_optimizer_state_dict(target.model, target.optim, copy.deepcopy(given), options=options))
    label = f"{where_of(dist, 'adamw', use_orig_params)}, {'flattened' if flatten else 'nested'}, head.weight's state dropped on {where}"

    def raises() -> None:
        assert_same_error_on_every_rank(dist, exc, what=label)
        check_missing_state_error(exc, ["head.weight"], label)

    check_each({"SD-33.a": raises, "SD-33.b": lambda: assert_unchanged(before, where=label, model=target.model, optim=target.optim)})


@pytest.mark.req("SD-36")
def test_scheduler_state_with_a_counter_round_trips_through_a_checkpoint(impl: Any, tmp_path: Any) -> None:
    """``MultiStepLR``'s state holds ``milestones``, a ``collections.Counter`` keyed by int epochs (a
    milestone listed twice counts 2). Saved in a checkpoint beside the training state and loaded into
    the state dict of a scheduler built from the same milestones, at another epoch and with another
    count and gamma: ``milestones`` is still a ``Counter`` whose keys are ints (no ``'7'`` beside
    ``7``), every value is the saved one, and the loaded scheduler then gives the source's learning
    rate at every later epoch (its optimizer loaded too, as a resume does), and the loaded state saves
    again (pytorch/pytorch#153842: ``'7'`` beside ``7``, and the next save failed on the duplicate)."""
    ops = impl.require("checkpoint")
    _, source = scheduled([3, 7, 7], 0.5, epochs=4)
    saved = copy.deepcopy(source.state_dict())
    ops.save({"scheduler": source.state_dict()}, tmp_path / "ckpt")
    target_optim, target = scheduled([3, 7], 0.9, epochs=1)
    state = {"scheduler": target.state_dict()}
    ops.load(state, tmp_path / "ckpt")
    loaded = state["scheduler"]
    milestones: Any = loaded.get("milestones")
    if type(milestones) is not type(saved["milestones"]) or sorted(map(repr, milestones)) != sorted(map(repr, saved["milestones"])):
        fail("MultiStepLR milestones after the load", f"{type(milestones).__name__} {milestones!r}",
             f"{type(saved['milestones']).__name__} {saved['milestones']!r} (int keys)")
    assert_same_state(loaded, saved, what="scheduler state after the load vs the saved one")
    ops.save({"scheduler": loaded}, tmp_path / "again")
    source_optim = source.optimizer
    target_optim.load_state_dict(copy.deepcopy(source_optim.state_dict()))  # the learning rate it had (not the point here)
    target.load_state_dict(loaded)
    for epoch in range(4, 10):
        if target.get_last_lr() != source.get_last_lr():
            fail("learning rate of the loaded scheduler", target.get_last_lr(), source.get_last_lr(), f"epoch {epoch}")
        for optim, scheduler in ((source_optim, source), (target_optim, target)):
            optim.step()
            scheduler.step()


@pytest.mark.req("SD-37")
@pytest.mark.parametrize("api", ("get", "set"))
def test_a_parameter_held_by_two_optimizers_is_an_error_naming_it(impl: Any, api: str) -> None:
    """Two optimizers given together both hold the head (a head trained by a second optimizer too, as
    an auxiliary loss's optimizer may): a state dict keyed by FQN has one slot per parameter, so a get
    would keep one optimizer's state of the head and drop the other's, and a set would load one state
    into both. A get raises ``ValueError`` naming the head's parameters; a set raises it too, or the
    ``RuntimeError`` of a dict that does not fit (SD-8), naming them, and changes nothing. The same calls
    with optimizers that do not overlap succeed."""
    ops: StateDictOps = impl.require("state_dict")
    model = build(1)
    trunk = [p for n, p in model.named_parameters() if n.split(".")[0] != "head"]
    head = [p for n, p in model.named_parameters() if n.split(".")[0] == "head"]
    apart = [OPTIMIZERS["adamw"]([{"params": trunk}]), OPTIMIZERS["adamw"]([{"params": head}])]
    overlapping = [OPTIMIZERS["adamw"]([{"params": trunk + head}]), OPTIMIZERS["adamw"]([{"params": head}])]
    model(batch(7), use_aux=True).pow(2).mean().backward()
    for optim in (*apart, *overlapping):
        optim.step()
    saved = ops.get_optimizer_state_dict(model, apart)  # optimizers that do not overlap: the call works
    if api == "get":
        call: Any = lambda: ops.get_optimizer_state_dict(model, overlapping)  # noqa: E731
    else:
        ops.set_optimizer_state_dict(model, apart, copy.deepcopy(saved))
        call = lambda: ops.set_optimizer_state_dict(model, overlapping, copy.deepcopy(saved))  # noqa: E731
    before = snapshot(model=model, optims=overlapping)
    error = raised(call)
    # A set may also find first that the saved groups cannot fit optimizers that overlap (SD-8's error).
    allowed = (ValueError,) if api == "get" else (ValueError, RuntimeError)
    if not isinstance(error, allowed):
        fail(f"{api} with two optimizers that both hold head.weight and head.bias",
             "a normal return" if error is None else f"{type(error).__name__}: {error}"[:400],
             f"{' or '.join(t.__name__ for t in allowed)} naming them")
    if "head.weight" not in str(error) and "head.bias" not in str(error):
        fail(f"{api} with two optimizers that both hold the head: the error", str(error)[:400], "names head.weight or head.bias")
    assert_unchanged(before, model=model, optims=overlapping, where=f"after a refused {api}")
