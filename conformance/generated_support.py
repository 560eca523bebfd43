"""Helpers of the generated tests (``test_generated.py``): the domain an adapter's expected-failures
file leaves to a test, the selected world sizes a generated case may use, running one drawn case on the
rank pools with its failure kept as hypothesis reports it, and the shrunk examples (witnesses) of the
deviations the generated tests found."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any, TypedDict

import pytest
from hypothesis import HealthCheck, reject

from conformance import generated as gen
from conformance.adapters.sharding import ShardingPlan
from conformance.harness.plugin import selected_world_sizes

__all__ = [
    "FIXTURE_SETTINGS", "WITNESSES", "GeneratedCaseFailed", "accept", "checked", "excluded", "refused_is_a_skip",
    "run_checkpoint", "run_optim_state", "run_witness", "witness_params", "world_sizes",
]


class _FixtureSettings(TypedDict):
    """The keyword arguments of ``settings`` that ``FIXTURE_SETTINGS`` passes, typed so that
    ``settings(..., **FIXTURE_SETTINGS)`` is checked against the parameter it fills."""

    suppress_health_check: Collection[HealthCheck]


# The pools and excluded_cases fixtures are function-scoped, which hypothesis warns about because they
# are not reset between examples. They hold no per-example state (a handle on the session's rank pools,
# each pools.run with a fresh tmp_dir; the test's exclusions, a tuple), so reusing them across examples
# is exactly what is wanted.
FIXTURE_SETTINGS: _FixtureSettings = {"suppress_health_check": [HealthCheck.function_scoped_fixture]}


def excluded(excluded_cases: Any, test: str) -> tuple[gen.CaseFamily, ...]:
    """The case families the expected-failures entries that apply to this test (``exclude=NAME``, the
    adapter's and those it inherits) leave out of its domain."""
    return gen.excluded_families([entry.exclude for entry in excluded_cases], test)


def world_sizes(config: pytest.Config) -> list[int]:
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


def checked(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, a failure of it raised as :class:`GeneratedCaseFailed`."""
    try:
        return fn(*args)
    except pytest.fail.Exception as exc:
        raise GeneratedCaseFailed(str(exc.msg)) from None


def accept(values: list[Any]) -> list[Any]:
    """Per-rank results of a rank body; an adapter that refused the drawn layout rejects the example."""
    refused = [v for v in values if isinstance(v, gen.Refused)]
    if refused:
        reject()
    return values


def run_optim_state(impl: Any, pools: Any, case: gen.Case, on_values: Callable[[list[Any]], list[Any]] = accept) -> None:
    """One OS case: save and load in one pool call at one world size, else one call each; each call's
    per-rank results go through ``on_values`` (a refused layout rejects the example by default)."""
    assert case.save is not None and case.load is not None
    if case.save.world_size == case.load.world_size:
        on_values(checked(pools.run, case.save.world_size, gen.optim_state_both, impl, case))
        return
    model_sd, osd = on_values(checked(pools.run, case.save.world_size, gen.optim_state_save, impl, case))[0]
    on_values(checked(pools.run, case.load.world_size, gen.optim_state_load, impl, case, (model_sd, osd, osd)))


def run_checkpoint(impl: Any, pools: Any, case: gen.Case) -> None:
    """One ML case: save at one world size, load at the other, through a directory of the controller."""
    assert case.save is not None and case.load is not None
    directory = tempfile.mkdtemp(prefix="sdc-generated-")
    try:
        saved = checked(pools.run, case.save.world_size, gen.checkpoint_save, impl, case, f"{directory}/ckpt")[0]
        checked(pools.run, case.load.world_size, gen.checkpoint_load, impl, case, f"{directory}/ckpt", saved)
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


def witness_params() -> list[Any]:
    """One parameter per witness, marked with the SPEC IDs it checks."""
    return [pytest.param(name, marks=pytest.mark.req(*WITNESSES[name][1]), id=name) for name in WITNESSES]


def refused_is_a_skip(values: list[Any]) -> list[Any]:
    """Per-rank results of a witness's rank body; an adapter that refused its layout skips it."""
    refused = [v for v in values if isinstance(v, gen.Refused)]
    if refused:
        pytest.skip(f"the adapter cannot shard this witness: {refused[0]}")
    return values


def run_witness(impl: Any, pools: Any, config: pytest.Config, name: str) -> None:
    """Run the witness ``name`` as its generated test ran it; an optimizer-state witness at the smallest
    selected world size, and skipped where the adapter cannot shard it."""
    capability, _, case = WITNESSES[name]
    ops = impl.require(capability)
    if capability == "state_dict":
        checked(gen.state_dict_round_trip, ops, case)
    elif capability == "flat_param":
        checked(gen.flat_param_round_trip, ops, case)
    elif capability == "optim_state":
        ws = min(world_sizes(config))
        assert case.save is not None and case.load is not None
        for sharding in (case.save, case.load):
            reason = impl.require("sharding").unsupported(ShardingPlan(sharding.strategy, sharding.use_orig_params))
            if reason:
                pytest.skip(f"{impl.name} cannot shard this witness: {reason}")
        case = replace(case, save=replace(case.save, world_size=ws), load=replace(case.load, world_size=ws))
        run_optim_state(impl, pools, case, refused_is_a_skip)
