"""Meta-tests of conformance/generated/, one process: the strategies draw valid cases, the builders are
deterministic in their seed, and the one comparison with the oracle fails on every kind of perturbed
value (one element, one dtype, a missing or extra key, a key order, a hyperparameter)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

from conformance.asserts import bits
from conformance.generated.builders import batch, buffer_value, build, hyperparameters, make_optimizer, oracle_params
from conformance.generated.execution import rank_slice
from conformance.generated.families import (
    CASE_FAMILIES,
    CHECKPOINT_TEST,
    FLAT_PARAM_TEST,
    OPTIM_STATE_TEST,
    SHARDED_STATE_DICT_TEST,
    STATE_DICT_TEST,
    CaseFamily,
    excluded_families,
    families_of,
)
from conformance.generated.layout import flat_atoms, fp_atoms, is_below, join_atoms, param_atoms, tie_spans, units_homogeneous
from conformance.generated.oracles import (
    Labels,
    TrainingState,
    assert_buffers_kept,
    assert_state_matches,
    continue_alongside,
    continue_and_compare,
    fqn_keyed,
    non_persistent_buffers,
    oracle_run,
    oracle_state,
)
from conformance.generated.specs import (
    GLOBAL_BATCH,
    NAMES,
    STRATEGIES,
    Buffer,
    Case,
    Linear,
    ModelSpec,
    Module,
    OptimPlan,
    Sharding,
    Tie,
)
from conformance.generated.strategies import (
    MAX_LEAVES,
    checkpoint_cases,
    flat_param_cases,
    model_specs,
    optim_state_cases,
    round_trip_cases,
    sharded_state_dict_cases,
    usable_world_sizes,
)
from conformance.harness.context import RankContext
from conformance.values import EDGE_DTYPES

#: Derandomized and bounded: these run in ``make test`` next to everything else.
DRAWS = settings(max_examples=30, derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies draw valid specs and cases -------------------------------------------------------------------


def _depth(path: str) -> int:
    return len(path.split(".")) if path else 0


@DRAWS
@given(spec=model_specs())
def test_model_specs_are_valid_trees_that_build_as_described(spec: ModelSpec) -> None:
    leaves = spec.leaves()
    assert 1 <= len(leaves) <= MAX_LEAVES
    assert max(_depth(path) for path, _ in spec.nodes()) <= 3
    for path, node in spec.nodes():
        if isinstance(node, Module):
            names = [c.name for c in node.children] + [b.name for b in node.buffers] + [t.name for t in node.ties]
            assert len(names) == len(set(names)) and set(names) <= set(NAMES), f"{path!r}: names {names}"
            for tie in node.ties:
                assert isinstance(spec.node(f"{path}.{tie.source}" if path else tie.source), Linear), f"{path!r}: tie {tie}"
        else:
            assert 1 <= node.in_features <= 7 and 1 <= node.out_features <= 7
    assert any(not lin.frozen for _, lin in leaves), "no trainable parameter"
    assert sum(len(n.ties) for _, n in spec.nodes() if isinstance(n, Module)) <= 2
    assert {b.dtype for _, b in spec.buffers()} <= {str(d).removeprefix("torch.") for d in EDGE_DTYPES}

    model = build(spec, 0)
    named = list(model.named_parameters(remove_duplicate=False))
    entries = spec.params()
    assert [n for n, _ in named] == [e.fqn for e in entries]
    params = dict(named)
    for entry, (_, param) in zip(entries, named):
        assert param is params[entry.key], f"{entry.fqn} is not the Parameter of {entry.key}"
        assert tuple(param.shape) == entry.shape and param.requires_grad == (not entry.frozen)
        assert param.dtype == getattr(torch, spec.dtype)
    assert spec.trainable() == [n for n, p in model.named_parameters() if p.requires_grad]
    buffers = dict(model.named_buffers())
    assert sorted(buffers) == sorted(fqn for fqn, _ in spec.buffers())
    for fqn, buf in spec.buffers():
        assert buffers[fqn].dtype == getattr(torch, buf.dtype) and tuple(buffers[fqn].shape) == buf.shape
    persistent = {fqn for fqn, b in spec.buffers() if b.persistent}
    assert set(model.state_dict()) == {e.fqn for e in entries} | persistent
    assert sorted(spec.non_persistent()) == sorted(set(buffers) - persistent)


@DRAWS
@given(spec=model_specs(frozen_ties=False))
def test_model_specs_without_frozen_ties_tie_only_trainable_weights(spec: ModelSpec) -> None:
    for _, leaf in tie_spans(spec):
        node = spec.node(leaf)
        assert isinstance(node, Linear) and not node.frozen, f"tie to frozen {leaf}"


def _flat(groups: Sequence[Sequence[str]]) -> list[str]:
    return [fqn for group in groups for fqn in group]


def _standing_for(atoms: Sequence[Sequence[str]]) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    """One parameter per atom, standing for its key FQNs (as a flat parameter does)."""
    return [(tuple(atom), nn.Parameter(torch.zeros(1))) for atom in atoms]


def _check_plans(case: Case, atoms: Sequence[Sequence[str]], target: str) -> None:
    """The source and target plans cover the trainable keys once each, keep every atom in one group,
    and the target is the documented variation of the source (``target`` as in strategies._plans)."""
    trainable = case.model.trainable()
    source, other = case.source, case.target
    for plan in (source, other):
        assert sorted(_flat(plan.groups)) == sorted(trainable) and all(plan.groups), plan
        assert sorted(plan.order) == sorted(trainable), plan
        make_optimizer(case.optimizer, plan, _standing_for(atoms))  # raises if an atom spans two groups
    if target == "positional":
        assert other == source
        return
    if len(trainable) > 1:
        assert other.order != source.order, "the target lists its parameters in the source's order"
    if target == "same":
        assert other.groups == source.groups and not other.hyper_index
    elif target == "permute":
        assert [source.groups[i] for i in other.hyper_index] == list(other.groups)
        if len(source.groups) > 1:
            assert other.groups != source.groups, "groups not reordered"
    else:  # refine: each source group split into pieces that keep its hyperparameters
        for index, group in enumerate(source.groups):
            pieces = [g for g, h in zip(other.groups, other.hyper_index) if h == index]
            assert sorted(_flat(pieces)) == sorted(group), (index, pieces)


def _check_excluded(case: Case, test: str, excluded: Sequence[CaseFamily]) -> None:
    for family in excluded:
        predicate = family.applies[test]
        assert predicate is None or not predicate(case), f"drew a case of excluded family {family.name}"


def _check_units(spec: ModelSpec, sharding: Sharding) -> None:
    for holder, leaf in tie_spans(spec):
        split = [u for u in sharding.units if is_below(u, holder) and (leaf == u or is_below(leaf, u))]
        assert not split, f"units {split} separate tie {holder} -> {leaf}"
    if not sharding.use_orig_params:
        assert units_homogeneous(spec, sharding.units), f"a unit owns frozen and trainable parameters: {sharding.units}"


def _families(test: str, *names: str) -> tuple[CaseFamily, ...]:
    return excluded_families(list(names), test)


@pytest.mark.parametrize("excluded", [(), ("split-groups", "compiled-three-names")], ids=["all", "torch-exclusions"])
def test_round_trip_cases_are_consistent(excluded: tuple[str, ...]) -> None:
    families = _families(STATE_DICT_TEST, *excluded)

    @DRAWS
    @given(case=round_trip_cases(families))
    def check(case: Case) -> None:
        _check_plans(case, param_atoms(case.model), "permute" if "split-groups" in excluded else "refine")
        assert case.option("wrapper") in ("plain", "checkpoint", "compile") and 1 <= case.steps <= 3 and 1 <= case.more_steps <= 2
        _check_excluded(case, STATE_DICT_TEST, families)

    check()


@pytest.mark.parametrize("excluded", [(), ("nested-wrappers", "tied-parameters")], ids=["all", "fairscale-exclusions"])
def test_flat_param_cases_are_consistent(excluded: tuple[str, ...]) -> None:
    families = _families(FLAT_PARAM_TEST, *excluded)

    @DRAWS
    @given(case=flat_param_cases(families))
    def check(case: Case) -> None:
        wrappers = case.option("_wrappers")
        _check_plans(case, fp_atoms(case.model, wrappers), "positional")
        if "nested-wrappers" in excluded:
            assert wrappers == ("",)
        for (path, order), (target_path, target_order) in zip(case.option("_source_lists"), case.option("_target_lists")):
            assert path == target_path and sorted(order) == sorted(target_order)
            assert len(order) < 2 or order != target_order, f"{path!r}: the target param_list order is the source's"
        _check_excluded(case, FLAT_PARAM_TEST, families)

    check()


CHOICES = [(s, o) for s in STRATEGIES for o in (False, True)]


@pytest.mark.parametrize(
    "excluded, choices",
    [((), CHOICES), (("hybrid-shard-replicas", "flat-to-orig", "no-shard-frozen-above-unit", "reordered-groups"), CHOICES),
     (("sharded-osd-other-mesh", "three-names"), [c for c in CHOICES if c[1]])],
    ids=["all", "torch-exclusions", "fsdp2-exclusions"],
)
def test_optim_state_cases_are_consistent(excluded: tuple[str, ...], choices: list[tuple[str, bool]]) -> None:
    families = _families(OPTIM_STATE_TEST, *excluded)
    world_sizes = [1, 2, 4, 5]

    @DRAWS
    @given(case=optim_state_cases(world_sizes, choices, families))
    def check(case: Case) -> None:
        assert case.save is not None and case.load is not None
        spec = case.model
        _check_plans(case, join_atoms(spec, flat_atoms(spec, case.save), flat_atoms(spec, case.load)), "permute")
        for sharding in (case.save, case.load):
            assert sharding.world_size in usable_world_sizes(world_sizes) and (sharding.strategy, sharding.use_orig_params) in choices
            _check_units(spec, sharding)
        if case.option("optimizer state dict") != "full":
            assert case.save.world_size == case.load.world_size
        _check_excluded(case, OPTIM_STATE_TEST, families)

    check()


def test_checkpoint_cases_are_consistent() -> None:
    @DRAWS
    @given(case=checkpoint_cases([1, 2, 5, 6]))
    def check(case: Case) -> None:
        _check_plans(case, param_atoms(case.model), "same")
        assert case.save is not None and case.load is not None
        assert {case.save.world_size, case.load.world_size} <= {1, 2, 6} and not case.save.drawn and not case.load.drawn

    check()


@pytest.mark.parametrize("excluded", [(), ("three-names", "reordered-groups")], ids=["all", "fsdp2-exclusions"])
def test_sharded_state_dict_cases_are_consistent(excluded: tuple[str, ...]) -> None:
    families = _families(SHARDED_STATE_DICT_TEST, *excluded)

    @DRAWS
    @given(case=sharded_state_dict_cases([1, 2], families))
    def check(case: Case) -> None:
        assert case.save is not None and case.load is not None
        spec = case.model
        _check_plans(case, flat_atoms(spec, Sharding(1, case.save.strategy, False, case.save.units)), "same" if "reordered-groups" in excluded else "permute")
        assert units_homogeneous(spec, case.save.units) and case.save.units == case.load.units
        if not case.option("state dicts").startswith("full"):
            assert case.save.strategy == case.load.strategy
        _check_excluded(case, SHARDED_STATE_DICT_TEST, families)

    check()


def test_every_family_is_drawn_by_a_test_and_unknown_names_are_refused() -> None:
    tests = {STATE_DICT_TEST, SHARDED_STATE_DICT_TEST, FLAT_PARAM_TEST, OPTIM_STATE_TEST, CHECKPOINT_TEST}
    for name, family in CASE_FAMILIES.items():
        assert family.name == name and family.applies and set(family.applies) <= tests, name
        assert all(name in families_of(test) for test in family.applies)
    with pytest.raises(ValueError, match=r"draws no case families \['nested-wrappers'\]"):
        excluded_families(["nested-wrappers"], OPTIM_STATE_TEST)
    with pytest.raises(ValueError, match="no-such-family"):
        excluded_families(["no-such-family"], STATE_DICT_TEST)


# -- builders are deterministic in their seed --------------------------------------------------------------------


def _all_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too) by name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@DRAWS
@given(spec=model_specs())
def test_build_is_deterministic_in_its_seed_and_seeds_differ(spec: ModelSpec) -> None:
    torch.manual_seed(7)
    rng = torch.random.get_rng_state()
    first, again, other = (_all_state(build(spec, seed)) for seed in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), rng), "build() changed the global RNG"
    assert list(first) == list(again) == list(other)
    for name in first:
        assert torch.equal(bits(first[name]), bits(again[name])), f"{name}: two builds of seed 0 differ"
    for name, _ in build(spec, 0).named_parameters():
        assert not torch.equal(first[name], other[name]), f"{name}: seeds 0 and 1 give the same values"
    for fqn, _ in spec.buffers():
        if first[fqn].numel():
            assert bool((bits(first[fqn]) != bits(other[fqn])).all()), f"{fqn}: an element is the same for seeds 0 and 1"


@pytest.mark.parametrize("dtype", EDGE_DTYPES, ids=str)
def test_buffer_values_hold_edge_values_and_differ_between_seeds_in_every_element(dtype: torch.dtype) -> None:
    buf = Buffer("b", str(dtype).removeprefix("torch."), (4, 3), persistent=True)
    zero, one = buffer_value(buf, 0), buffer_value(buf, 1)
    assert zero.dtype == dtype and zero.shape == (4, 3)
    assert bool((bits(zero) != bits(one)).all())
    assert torch.equal(bits(zero), bits(buffer_value(buf, 0)))
    assert len({v for v in bits(zero).reshape(-1).tolist()}) >= 2, "a buffer of one repeated value"


def test_batches_are_deterministic_per_step_and_ranks_slice_the_same_rows(tmp_path: Path) -> None:
    spec = ModelSpec(Module("", (Linear("1", 5, 2, True),)), "float64")
    x = batch(spec, 3)
    assert x.shape == (GLOBAL_BATCH, 5) and x.dtype == torch.float64
    assert torch.equal(x, batch(spec, 3)) and not torch.equal(x, batch(spec, 4))
    for ws in usable_world_sizes([1, 2, 3, 4, 5, 8]):
        pieces = [rank_slice(RankContext(r, ws, "gloo", torch.device("cpu"), tmp_path))(x) for r in range(ws)]
        assert torch.equal(torch.cat(pieces), x) and len({p.shape[0] for p in pieces}) == 1


def test_make_optimizer_follows_the_plan_and_perturbs_every_hyperparameter() -> None:
    spec = ModelSpec(Module("", (Linear("1", 2, 2, True), Linear("a", 2, 1, True, frozen=True), Linear("b", 2, 2, False))))
    model = build(spec, 0)
    params = dict(model.named_parameters())
    plan = OptimPlan((("b.weight", "1.weight"), ("1.bias",)), ("1.bias", "b.weight", "1.weight"), (1, 0))
    optim = make_optimizer("sgd", plan, oracle_params(model))
    assert [[id(p) for p in g["params"]] for g in optim.param_groups] == [
        [id(params["b.weight"]), id(params["1.weight"])], [id(params["1.bias"])]
    ]
    perturbed = make_optimizer("sgd", plan, oracle_params(build(spec, 0)), perturb=True)
    for group, other in zip(optim.param_groups, perturbed.param_groups):
        changed = {k for k in group if k != "params" and group[k] != other[k]}
        assert changed == {k for k in group if k != "params" and not isinstance(group[k], bool) and group[k] is not None}
    for group, index in zip(optim.param_groups, plan.hyper_index):
        assert {k: group[k] for k in hyperparameters("sgd", index)} == hyperparameters("sgd", index), "hyper_index not followed"
    with pytest.raises(AssertionError, match="falls in groups"):
        make_optimizer("sgd", plan, [(("1.weight", "1.bias"), nn.Parameter(torch.zeros(1)))])


# -- the one comparison with the oracle fails on every perturbed value --------------------------------------------

#: A model with a tie under a second name, a frozen leaf, and buffers of three dtypes (one non-persistent).
SPEC = ModelSpec(
    Module(
        "",
        (Linear("1", 3, 2, True), Module("a", (Linear("10", 2, 3, False, frozen=True), Linear("ab", 3, 1, True)), (Buffer("b", "int64", (2, 3), True),))),
        (Buffer("0", "float64", (3,), True), Buffer("11", "bool", (4, 1), False)),
        (Tie("abc", "a.ab"),),
    ),
    "float32",
)
PLAN = OptimPlan((("abc", "1.weight"), ("1.bias", "a.ab.bias")), ("1.bias", "abc", "a.ab.bias", "1.weight"))
CASE = Case(SPEC, "adam", PLAN, PLAN, steps=2, more_steps=2)
LABELS = Labels("model under test", "optimizer under test")
MODEL_KEYS = list(build(SPEC, 0).state_dict())
PARAM_KEYS = [e.fqn for e in SPEC.params()]


@pytest.fixture(scope="module")
def oracle() -> TrainingState:
    return oracle_state(oracle_run(CASE, CASE.steps))


def _nudged(value: torch.Tensor) -> torch.Tensor:
    """``value`` with its first element changed by the least step of its dtype."""
    out = value.clone()
    flat = out.view(-1)
    if out.dtype == torch.bool:
        flat[0] = ~flat[0]
    elif out.is_floating_point():
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=out.dtype))
    else:
        flat[0] += 1
    return out


def _fails(oracle: TrainingState, change: Callable[[TrainingState], None], match: str, **kwargs: Any) -> None:
    got = copy.deepcopy(oracle)
    change(got)
    with pytest.raises(pytest.fail.Exception, match=match):
        assert_state_matches(SPEC, got, oracle, LABELS, where="the test", **kwargs)


def test_an_equal_copy_passes(oracle: TrainingState) -> None:
    assert MODEL_KEYS == ["abc", "0", "1.weight", "1.bias", "a.b", "a.10.weight", "a.ab.weight", "a.ab.bias"]
    for check_order in (True, False):
        assert_state_matches(SPEC, copy.deepcopy(oracle), oracle, LABELS, where="the test", check_order=check_order)
        assert_state_matches(SPEC, copy.deepcopy(oracle), oracle, LABELS, where="the test", atol=1e-5, rtol=1e-4, check_order=check_order)


@pytest.mark.parametrize("key", MODEL_KEYS)
def test_one_element_of_any_model_entry_fails(oracle: TrainingState, key: str) -> None:
    kind = "parameters" if key in PARAM_KEYS else "buffers"
    _fails(oracle, lambda got: got.model.__setitem__(key, _nudged(got.model[key])),
        rf"model under test: {kind}: values differ(.|\n)*where: +the test\['{key}'\]")


@pytest.mark.parametrize("key", [k for k in MODEL_KEYS if k not in PARAM_KEYS])
def test_buffers_stay_bitwise_under_a_tolerance(oracle: TrainingState, key: str) -> None:
    """Buffers are never computed: the tolerance for averaged gradients does not apply to them."""
    _fails(oracle, lambda got: got.model.__setitem__(key, _nudged(got.model[key])), "buffers: values differ", atol=1e-5, rtol=1e-4)


def test_parameters_compare_within_the_tolerance_given(oracle: TrainingState) -> None:
    def scaled(factor: float) -> Callable[[TrainingState], None]:
        return lambda got: got.model.__setitem__("1.weight", got.model["1.weight"] * factor)

    got = copy.deepcopy(oracle)
    scaled(1 + 1e-6)(got)
    assert_state_matches(SPEC, got, oracle, LABELS, where="the test", atol=1e-5, rtol=1e-4)
    _fails(oracle, scaled(1 + 1e-6), "parameters: values differ")
    _fails(oracle, scaled(1.01), "parameters: values differ", atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("key", MODEL_KEYS)
def test_one_dtype_changed_fails(oracle: TrainingState, key: str) -> None:
    other = {torch.float32: torch.float64, torch.float64: torch.float32, torch.int64: torch.int32, torch.bool: torch.uint8}
    _fails(oracle, lambda got: got.model.__setitem__(key, got.model[key].to(other[got.model[key].dtype])), "dtype differs")
    if key in PARAM_KEYS:
        _fails(oracle, lambda got: got.model.__setitem__(key, got.model[key].double()), "dtype/shape differ", atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("key", MODEL_KEYS)
def test_a_missing_model_key_fails(oracle: TrainingState, key: str) -> None:
    for check_order in (True, False):
        _fails(oracle, lambda got: got.model.pop(key), "model under test: keys differ", check_order=check_order)


def test_an_extra_model_key_fails(oracle: TrainingState) -> None:
    _fails(oracle, lambda got: got.model.__setitem__("a.extra", torch.zeros(1)), "model under test: keys differ", check_order=False)


def test_key_order_counts_only_where_asked(oracle: TrainingState) -> None:
    def swap(got: TrainingState) -> None:
        items = list(got.model.items())
        items[0], items[1] = items[1], items[0]
        got.model.clear()
        got.model.update(items)

    _fails(oracle, swap, r"keys differ \(or their order\)")
    got = copy.deepcopy(oracle)
    swap(got)
    assert_state_matches(SPEC, got, oracle, LABELS, where="the test", check_order=False)


@pytest.mark.parametrize("fqn", SPEC.trainable())
@pytest.mark.parametrize("name", ["exp_avg", "exp_avg_sq", "step"])
def test_one_element_of_optimizer_state_fails(oracle: TrainingState, fqn: str, name: str) -> None:
    _fails(oracle, lambda got: got.optim["state"][fqn].__setitem__(name, _nudged(got.optim["state"][fqn][name])),
        rf"optimizer under test: state: values differ(.|\n)*\['{fqn}'\]\['{name}'\]")


@pytest.mark.parametrize("name", ["lr", "betas", "eps", "weight_decay", "initial_lr", "sdc_custom", "amsgrad"])
def test_one_hyperparameter_changed_fails(oracle: TrainingState, name: str) -> None:
    def change(got: TrainingState) -> None:
        group = got.optim["param_groups"][1]
        value = group[name]
        group[name] = not value if isinstance(value, bool) else (value[0], value[1] + 1e-9) if isinstance(value, tuple) else \
            value + "!" if isinstance(value, str) else value + 1e-12

    _fails(oracle, change, rf"optimizer under test: hyperparameters: (.|\n)*\['1.bias'\]\['{name}'\]")


def test_missing_optimizer_state_of_one_parameter_fails(oracle: TrainingState) -> None:
    _fails(oracle, lambda got: got.optim["state"].pop("1.bias"), "optimizer under test: state: keys differ")


def test_the_optimizer_is_skipped_only_when_its_label_is_none(oracle: TrainingState) -> None:
    got = copy.deepcopy(oracle)
    got.optim["param_groups"][0]["lr"] += 1.0
    assert_state_matches(SPEC, got, oracle, Labels("model under test", None), where="the test")
    got.model["1.bias"] = _nudged(got.model["1.bias"])
    with pytest.raises(pytest.fail.Exception, match="model under test: parameters"):
        assert_state_matches(SPEC, got, oracle, Labels("model under test", None), where="the test")


def test_a_changed_non_persistent_buffer_fails() -> None:
    model = build(SPEC, 0)
    before = non_persistent_buffers(SPEC, model)
    assert list(before) == ["11"]
    assert_buffers_kept(SPEC, model, before, by="nothing", where="the test")
    getattr(model, "11").copy_(_nudged(getattr(model, "11")))
    with pytest.raises(pytest.fail.Exception, match="non-persistent buffers changed by a load"):
        assert_buffers_kept(SPEC, model, before, by="a load", where="the test")


# -- the oracle is trained one way, and continues where it stopped -----------------------------------------------


def test_the_oracle_is_deterministic_and_continues_where_it_stopped(oracle: TrainingState) -> None:
    assert_state_matches(SPEC, oracle_state(oracle_run(CASE, CASE.steps)), oracle, LABELS, where="a second oracle run")
    stopped, again = oracle_run(CASE, CASE.steps), oracle_run(CASE, CASE.steps)
    continue_alongside(CASE, stopped, again)
    assert_state_matches(SPEC, oracle_state(again), oracle_state(oracle_run(CASE, CASE.steps + CASE.more_steps)), LABELS, where="continued")
    with pytest.raises(pytest.fail.Exception, match="values differ"):
        assert_state_matches(SPEC, oracle_state(again), oracle, LABELS, where="continued vs stopped")


@pytest.mark.parametrize("target", ["same", "perturbed", "one step behind", "another seed"])
def test_continue_and_compare_passes_only_for_the_run_that_never_stopped(target: str) -> None:
    if target == "same":
        model, optim = oracle_run(CASE, CASE.steps)
    elif target == "one step behind":
        model, optim = oracle_run(CASE, CASE.steps - 1)
    elif target == "perturbed":
        model, optim = oracle_run(CASE, CASE.steps)
        optim.param_groups[1]["lr"] *= 1.5
    else:
        model = build(SPEC, 1)
        optim = make_optimizer(CASE.optimizer, PLAN, oracle_params(model))
    compare = lambda: continue_and_compare(  # noqa: E731
        CASE, oracle_run(CASE, CASE.steps), (model, optim), lambda: TrainingState(model.state_dict(), fqn_keyed(model, optim)), where="the test"
    )
    if target == "same":
        compare()
    else:
        with pytest.raises(pytest.fail.Exception, match="vs the unwrapped run that never stopped"):
            compare()
