"""Generated cases (conformance/generated/): hypothesis-drawn models and their state, every capability.

Each test draws a :class:`~conformance.generated.Case` (a model tree with ties, frozen leaves and
buffers of every edge dtype; an optimizer with its param groups and order on both sides; shardings)
and checks the implementation under test against the unwrapped model trained on one process: after a
save and a load into a target built from another seed, with perturbed hyperparameters and another
parameter order, and a few more steps, everything equals the run that never stopped. A shrunk failure
prints the case as a model description ("Draw 1 (case): ...").

Examples per test come from the hypothesis profile: ``ci`` (the default, derandomized, bounded) or
``--hypothesis-profile thorough``; see README "Running the suite". Multi-rank cases run one example per
``pools.run`` call: hypothesis (and its shrinking) stays on the controller.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Collection
from typing import Any, TypedDict

import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from conformance import generated as gen
from conformance.adapters.sharding import ShardingPlan
from conformance.harness.plugin import selected_world_sizes


class _FixtureSettings(TypedDict):
    """The keyword arguments of ``settings`` that ``FIXTURE_SETTINGS`` passes, typed so that
    ``settings(..., **FIXTURE_SETTINGS)`` is checked against the parameter it fills."""

    suppress_health_check: Collection[HealthCheck]


# The test functions' source and signatures are part of their derandomized draws (hypothesis seeds the
# ci profile from a digest of them): an edit of a @given test's code or signature draws other cases.
#
# The pools and excluded_cases fixtures are function-scoped, which hypothesis warns about because they
# are not reset between examples. They hold no per-example state (a handle on the session's rank pools,
# each pools.run with a fresh tmp_dir; the test's exclusions, a tuple), so reusing them across examples
# is exactly what is wanted.
FIXTURE_SETTINGS: _FixtureSettings = {"suppress_health_check": [HealthCheck.function_scoped_fixture]}


def _excluded(excluded_cases: Any, test: str) -> tuple[gen.CaseFamily, ...]:
    """The case families the expected-failures entries that apply to this test (``exclude=NAME``, the
    adapter's and those it inherits) leave out of its domain."""
    return gen.excluded_families([entry.exclude for entry in excluded_cases], test)


def _world_sizes(config: pytest.Config) -> list[int]:
    """The selected world sizes (``--world-size``, as the harness parsed it) that split a generated
    global batch evenly."""
    sizes = selected_world_sizes(config)
    usable = gen.usable_world_sizes(sizes)
    if not usable:
        pytest.skip(f"no selected world size divides the generated global batch of {gen.GLOBAL_BATCH} rows: {sizes}")
    return usable


class GeneratedCaseFailed(AssertionError):
    """A generated case failed. Raised in place of ``pytest.fail(..., pytrace=False)`` (what the
    assertion helpers and the rank pools raise), whose report would drop hypothesis's notes: the
    falsifying example, i.e. the shrunk case printed as a model description."""


def _checked(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except pytest.fail.Exception as exc:
        raise GeneratedCaseFailed(str(exc.msg)) from None


def _accept(values: list[Any]) -> list[Any]:
    """Per-rank results of a rank body; an adapter that refused the drawn layout rejects the example."""
    refused = [v for v in values if isinstance(v, gen.Refused)]
    if refused:
        reject()
    return values


@pytest.mark.req("SD-11", "SD-1", "SD-2")
@pytest.mark.case_families(*gen.families_of(gen.STATE_DICT_TEST))
@settings(max_examples=gen.budget("state_dict"), **FIXTURE_SETTINGS)
@given(data=st.data())
def test_generated_state_dict_round_trip(impl: Any, excluded_cases: Any, data: st.DataObject) -> None:
    """get_state_dict of a drawn model (plain, activation-checkpointed or compiled; optimizer state
    nested or flattened) equals the unwrapped model's; set into a model of another seed, with the
    param groups split further, reordered, perturbed and holding state of their own, gives back the
    saved state bitwise, and training on matches the run that never stopped bitwise."""
    ops = impl.require("state_dict")
    case = data.draw(gen.round_trip_cases(_excluded(excluded_cases, gen.STATE_DICT_TEST)), label="case")
    _checked(gen.state_dict_round_trip, ops, case)


@pytest.mark.req("SD-12", "SD-13", "SD-11")
@pytest.mark.case_families(*gen.families_of(gen.SHARDED_STATE_DICT_TEST))
@settings(max_examples=gen.budget("sharded_state_dict"), **FIXTURE_SETTINGS)
@given(data=st.data())
def test_generated_sharded_state_dict_round_trip(impl: Any, pools: Any, pytestconfig: pytest.Config, excluded_cases: Any, data: st.DataObject) -> None:
    """A drawn model sharded by the adapter (drawn strategy, at a drawn world size) trains like the
    unwrapped model; get_state_dict (full or DTensors) equals it; set into another seed's sharded model
    (another strategy for full state dicts; optimizer reordered, perturbed, with state of its own) gives
    the saved values back bitwise, and training on matches the unwrapped run."""
    impl.require("state_dict")
    sizes = _world_sizes(pytestconfig)
    case = data.draw(gen.sharded_state_dict_cases(sizes, _excluded(excluded_cases, gen.SHARDED_STATE_DICT_TEST)), label="case")
    assert case.save is not None
    _accept(_checked(pools.run, case.save.world_size, gen.sharded_state_dict_round_trip, impl, case))


@pytest.mark.req("FP-8", "FP-13", "FP-6", "FP-9", "FP-12")
@pytest.mark.case_families(*gen.families_of(gen.FLAT_PARAM_TEST))
@settings(max_examples=gen.budget("flat_param"), **FIXTURE_SETTINGS)
@given(data=st.data())
def test_generated_flat_param_round_trip(impl: Any, excluded_cases: Any, data: st.DataObject) -> None:
    """FlattenParamsWrappers at drawn modules (nested; only the root where the adapter cannot), each flattening its
    parameters from a drawn ``param_list`` order: training equals the unwrapped model bitwise (model
    and optimizer state cut per parameter); the state dict and optimizer state load into a model of
    another seed wrapped from another order, and training on matches the run that never stopped."""
    ops = impl.require("flat_param")
    case = data.draw(gen.flat_param_cases(_excluded(excluded_cases, gen.FLAT_PARAM_TEST)), label="case")
    _checked(gen.flat_param_round_trip, ops, case)


@pytest.mark.req("OS-6", "OS-7", "OS-1", "OS-3", "OS-10", "OS-11", "OS-12")
@pytest.mark.case_families(*gen.families_of(gen.OPTIM_STATE_TEST))
@settings(max_examples=gen.budget("optim_state"), **FIXTURE_SETTINGS)
@given(data=st.data())
def test_generated_optim_state_reload(impl: Any, pools: Any, pytestconfig: pytest.Config, excluded_cases: Any, data: st.DataObject) -> None:
    """A drawn model sharded with a drawn strategy, use_orig_params and units at one world size trains
    like the unwrapped model on the whole batch; its full (or, at one world size, sharded) optimizer
    state dict and full model state dict load into another seed's model sharded another way, maybe at
    another world size, whose optimizer lists its groups and parameters in another order with
    perturbed hyperparameters; the load is bitwise, and training on matches the unwrapped run."""
    impl.require("optim_state")
    sizes = _world_sizes(pytestconfig)
    sharding = impl.require("sharding")
    choices = [(s, o) for s in gen.STRATEGIES for o in (False, True) if sharding.unsupported(ShardingPlan(s, o)) is None]
    case = data.draw(gen.optim_state_cases(sizes, choices, _excluded(excluded_cases, gen.OPTIM_STATE_TEST)), label="case")
    _run_optim_state(impl, pools, case, _accept)


def _run_optim_state(impl: Any, pools: Any, case: gen.Case, accept: Callable[[list[Any]], list[Any]]) -> None:
    """One OS case: save and load in one pool call at one world size, else one call each."""
    assert case.save is not None and case.load is not None
    if case.save.world_size == case.load.world_size:
        accept(_checked(pools.run, case.save.world_size, gen.optim_state_both, impl, case))
        return
    model_sd, osd = accept(_checked(pools.run, case.save.world_size, gen.optim_state_save, impl, case))[0]
    accept(_checked(pools.run, case.load.world_size, gen.optim_state_load, impl, case, (model_sd, osd, osd)))


@pytest.mark.req("ML-1", "ML-8")
@pytest.mark.case_families(*gen.families_of(gen.CHECKPOINT_TEST))
@settings(max_examples=gen.budget("checkpoint"), **FIXTURE_SETTINGS)
@given(data=st.data())
def test_generated_checkpoint_reshard(impl: Any, pools: Any, pytestconfig: pytest.Config, excluded_cases: Any, data: st.DataObject) -> None:
    """The sharded model and optimizer state of a drawn model, trained next to the unwrapped one, saved
    at a drawn world size and loaded at another into another seed's model (optimizer reordered and
    perturbed, with state of its own): every value equals the saved one bitwise, and training on
    matches the unwrapped run that never stopped."""
    impl.require("checkpoint")
    sizes = _world_sizes(pytestconfig)
    case = data.draw(gen.checkpoint_cases(sizes, _excluded(excluded_cases, gen.CHECKPOINT_TEST)), label="case")
    _run_checkpoint(impl, pools, case)


def _run_checkpoint(impl: Any, pools: Any, case: gen.Case) -> None:
    """One ML case: save at one world size, load at the other, through a directory of the controller."""
    assert case.save is not None and case.load is not None
    directory = tempfile.mkdtemp(prefix="sdc-generated-")
    try:
        saved = _checked(pools.run, case.save.world_size, gen.checkpoint_save, impl, case, f"{directory}/ckpt")[0]
        _checked(pools.run, case.load.world_size, gen.checkpoint_load, impl, case, f"{directory}/ckpt", saved)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# -- witnesses of the deviations the generated tests found ----------------------------------------------------
#
# A deviation found by a generated test is left out of that adapter's generated domain (an exclude=
# entry of its expected-failures file naming a family of generated.CASE_FAMILIES), so that its generated
# test goes on checking everything else. Each one that no section test pins is pinned here by its shrunk
# example, run for every adapter: the reference passes it, the deviating adapter xfails it
# (conformance/xfails/<adapter>.txt), and a fix upstream fails the run as "no longer deviates" until its
# entries are removed.

G = gen


def _plan(groups: tuple[tuple[str, ...], ...], order: tuple[str, ...], hyper_index: tuple[int, ...] = ()) -> gen.OptimPlan:
    return gen.OptimPlan(groups, order, hyper_index)


_BIASED = G.ModelSpec(G.Module("", (G.Linear("1", 1, 1, True),)))
_THREE_NAMES = G.ModelSpec(G.Module("", (G.Linear("1", 1, 2, False), G.Linear("10", 1, 1, False)), (), (G.Tie("ab", "1"), G.Tie("b", "1"))))
_FROZEN_ROOT = G.ModelSpec(G.Module("", (G.Linear("10", 1, 1, False, frozen=True), G.Linear("a", 1, 1, False))))
_TIED_ROOT = G.ModelSpec(G.Module("", (G.Linear("1", 1, 1, True),), (), (G.Tie("ab", "1"),)))

#: name -> (capability, SPEC IDs, case; world sizes are set to the smallest selected one).
WITNESSES: dict[str, tuple[str, tuple[str, ...], gen.Case]] = {
    "compiled-three-names": (
        "state_dict",
        ("SD-1", "SD-11"),
        gen.Case(
            _THREE_NAMES, "sgd",
            _plan((("ab", "10.weight"),), ("ab", "10.weight")),
            _plan((("ab", "10.weight"),), ("10.weight", "ab")),
            1, 1, options=(("wrapper", "compile"), ("flatten_optimizer_state_dict", False)),
        ),
    ),
    "wrapper-tie-key-order": (
        "flat_param",
        ("FP-12",),
        gen.Case(
            _TIED_ROOT, "sgd",
            _plan((("ab", "1.bias"),), ("ab", "1.bias")),
            _plan((("ab", "1.bias"),), ("ab", "1.bias")),
            1, 1, options=(("_source_lists", (("", ("ab", "1.bias")),)), ("_target_lists", (("", ("1.bias", "ab")),))),
        ),
    ),
    "no-shard-frozen-above-unit": (
        "optim_state",
        ("OS-11", "OS-19"),
        gen.Case(
            _FROZEN_ROOT, "sgd",
            _plan((("a.weight",),), ("a.weight",)),
            _plan((("a.weight",),), ("a.weight",)),
            1, 1, G.Sharding(1, "NO_SHARD", True, ("a",)), G.Sharding(1, "NO_SHARD", True, ("a",)), options=(("optimizer state dict", "full"),),
        ),
    ),
    "sharded-osd-other-mesh": (
        "optim_state",
        ("OS-6",),
        gen.Case(
            _BIASED, "sgd",
            _plan((("1.weight", "1.bias"),), ("1.weight", "1.bias")),
            _plan((("1.weight", "1.bias"),), ("1.bias", "1.weight")),
            1, 1, G.Sharding(1, "FULL_SHARD"), G.Sharding(1, "NO_SHARD"), options=(("optimizer state dict", "sharded (DTensors)"),),
        ),
    ),
    "sharded-three-names": (
        "optim_state",
        ("OS-10", "OS-19"),
        gen.Case(
            _THREE_NAMES, "sgd",
            _plan((("ab", "10.weight"),), ("ab", "10.weight")),
            _plan((("ab", "10.weight"),), ("10.weight", "ab")),
            1, 1, G.Sharding(1), G.Sharding(1), options=(("optimizer state dict", "full"),),
        ),
    ),
}


def _witness_params() -> list[Any]:
    return [pytest.param(name, marks=pytest.mark.req(*WITNESSES[name][1]), id=name) for name in WITNESSES]


@pytest.mark.parametrize("name", _witness_params())
def test_generated_deviation_witness(impl: Any, pools: Any, pytestconfig: pytest.Config, name: str) -> None:
    """The shrunk example of a deviation a generated test found (see WITNESSES) runs as it did there:
    the reference passes it; an adapter that deviates is listed in its expected-failures file."""
    from dataclasses import replace

    capability, _, case = WITNESSES[name]
    ops = impl.require(capability)
    if capability == "state_dict":
        _checked(gen.state_dict_round_trip, ops, case)
    elif capability == "flat_param":
        _checked(gen.flat_param_round_trip, ops, case)
    elif capability == "optim_state":
        ws = min(_world_sizes(pytestconfig))
        assert case.save is not None and case.load is not None
        for sharding in (case.save, case.load):
            reason = impl.require("sharding").unsupported(ShardingPlan(sharding.strategy, sharding.use_orig_params))
            if reason:
                pytest.skip(f"{impl.name} cannot shard this witness: {reason}")
        case = replace(case, save=replace(case.save, world_size=ws), load=replace(case.load, world_size=ws))
        _run_optim_state(impl, pools, case, _refused_is_a_skip)


def _refused_is_a_skip(values: list[Any]) -> list[Any]:
    refused = [v for v in values if isinstance(v, gen.Refused)]
    if refused:
        pytest.skip(f"the adapter cannot shard this witness: {refused[0]}")
    return values
