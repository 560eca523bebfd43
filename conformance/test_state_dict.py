"""SD: get/set state_dict with submodules, on plain, wrapped and sharded models (conformance/SPEC.md).

Oracles: ``nn.Module.state_dict()`` and ``Optimizer.state_dict()`` of the unwrapped model (keyed by
FQN, :func:`conformance.compare.fqn_keyed_optim`), trained identically on one process; for SD-15 the
reference.

How a load is checked. Every set goes into a target that differs from the source in everything the
load must change: model values bitwise different (:func:`~conformance.values.different_like` of the
source on plain models, another seed for sharded parameters), every param-group hyperparameter
different (:func:`~conformance.values.perturb_hyperparameters`, so ``initial_lr`` and a custom key
too, plus a key the source does not have at all), the optimizer's parameters in reverse order and,
where the API allows it (plain models), split into other groups. Then get of the target equals get of
the source bit for bit, and one more training step keeps them equal.

How a sharded result is checked: on every rank, each DTensor's local shard against the piece of the
unwrapped oracle's value that the documented layout (``torch.chunk`` along the sharded dim) assigns
to that rank; never only after gathering.

How an error is checked: the type, the message naming the canonical key whole
(:func:`~conformance.asserts.assert_names_key`), and "changes nothing" deeply for the model and the
optimizer (:func:`~conformance.asserts.snapshot`); on sharded models on every rank, also when only
the last rank's input is bad (every rank must raise the same error, promptly).

Tests without ``dist`` run on the controller, on plain models (the state_dict functions need no
process group there); tests with ``dist`` run on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import gc
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from conformance import models as zoo
from conformance.adapters.base import Adapter, Unsupported, load_adapter
from conformance.adapters.sharding import STRATEGIES, ShardingPlan, child_units
from conformance.adapters.state_dict import SHARDING_STRATEGIES
from conformance.asserts import (
    assert_bitwise_equal,
    assert_local_shard,
    assert_same_error_on_every_rank,
    assert_same_state,
    assert_unchanged,
    check_each,
    expect_error,
    fail,
    raised,
    snapshot,
)
from conformance.compare import fqn_keyed_optim, on_cpu
from conformance.flat_param_support import WRAPPINGS
from conformance.fqn import canonical_fqn
from conformance.harness.context import RankContext
from conformance.state_dict_sharded_support import (
    assert_dtensor_params,
    assert_planned_get,
    broadcast_target,
    check_broadcast_result,
    dtensor_model,
    form_of,
    hyperparameters,
    oracle_state,
    sharded_error_run,
    sharded_pair,
    sharded_target,
    single_group_adam,
    strict_load_into_dtensor_parameters_without,
)
from conformance.state_dict_support import (
    ATOL,
    ERROR_CASES,
    ERROR_CLAUSES,
    PROMPTLY_S,
    RTOL,
    SHARDED_ZOO,
    NestedStateAdam,
    SharedChild,
    add_source_extras,
    assert_matches_oracle,
    assert_same_optim,
    break_input,
    check_error,
    continue_equally,
    error_options,
    load,
    make_differ,
    per_parameter,
    plain_error_params,
    plain_pair,
    recording_deprecations,
    regroup,
    sd_ops,
    sd_shard,
    select_keys,
    source_optimizer,
    target_optimizer,
    train,
    untouched,
    wrap,
)
from conformance.values import different_like, perturb_hyperparameters

#: Wrappers that run without a process group; "ddp" is added in rank tests. "fpw" is the suite's own
#: flattening wrapper (:class:`conformance.flat_wrapper.FlatParamsWrapper`) over the model's trainable
#: parameters: one flat parameter, a state dict with the original keys.
LOCAL_WRAPPERS = ("plain", "checkpoint", "compile", "checkpoint+compile", "fpw")


@pytest.mark.req("SD-1")
@pytest.mark.parametrize("how", LOCAL_WRAPPERS)
@pytest.mark.parametrize("name", tuple(zoo.ZOO))
def test_model_keys_are_canonical_fqns(impl: Adapter, name: str, how: str) -> None:
    """get of the wrapped model == nn.Module.state_dict() of the unwrapped one: keys in order, dtypes,
    and bits (the ``dtypes`` model's NaN payloads, -0.0 and int64 beyond 2**53 included)."""
    ops = sd_ops(impl)
    model = zoo.build(name)
    expected = copy.deepcopy(model.state_dict())
    got = ops.get_model_state_dict(wrap(model, how))
    assert_same_state(got, expected, what=f"model state dict of {name} wrapped as {how}")


@pytest.mark.req("SD-1")
@pytest.mark.parametrize("how", LOCAL_WRAPPERS)
@pytest.mark.parametrize("name", ("mlp", "tied", "nested", "dtypes"))
def test_set_through_wrappers_takes_canonical_fqns(impl: Adapter, name: str, how: str) -> None:
    """set into the wrapped model of the unwrapped model's state dict (canonical FQNs) loads every entry:
    the target, built from another seed, then holds the source's values bit for bit. A wrapper the
    implementation does not know ("fpw", the suite's own) hides its segment and forwards attributes."""
    ops = sd_ops(impl)
    source, target = zoo.build(name, seed=0), zoo.build(name, seed=1)
    make_differ(target, source)
    expected = copy.deepcopy(source.state_dict())
    wrapped = wrap(target, how)
    ops.set_model_state_dict(wrapped, copy.deepcopy(expected))
    # Read back by nn.Module.state_dict() of the wrapped model, keys by the suite's own FQN rule.
    after = {canonical_fqn(key): value for key, value in wrapped.state_dict().items()}
    assert_same_state(after, expected, what=f"{name} after a set through {how}")


@pytest.mark.req("SD-1", "SD-2", "SD-11")
@pytest.mark.parametrize("name", ("tied", "buffers", "nested"))
def test_round_trip_through_ddp(dist: RankContext, impl: Adapter, name: str) -> None:
    """DDP(compile(checkpointed children)): get is keyed by clean FQNs and equals the oracle; set of it
    into a differing target through the same wrappers makes the target equal, and a step keeps it so."""
    ops = sd_ops(impl)
    pair = plain_pair(name, device=dist.device)
    expected_model = copy.deepcopy(pair.source.state_dict())
    expected_optim = copy.deepcopy(fqn_keyed_optim(pair.source, pair.source_optim))
    got_model, got_optim = ops.get_state_dict(wrap(pair.source, "checkpoint+compile+ddp"), pair.source_optim)
    assert_same_state(got_model, expected_model, what="model state dict through DDP", where=f"rank {dist.rank}")
    assert_same_state(got_optim, expected_optim, what="optimizer state dict through DDP", where=f"rank {dist.rank}")

    saved = copy.deepcopy((got_model, got_optim))
    load(ops, "set_state_dict", wrap(pair.target, "checkpoint+compile+ddp"), pair.target_optim, *copy.deepcopy(saved),
         options=None)
    assert_same_state(pair.target.state_dict(), expected_model, what="model after set through DDP")
    assert_same_optim(fqn_keyed_optim(pair.target, pair.target_optim), expected_optim, "optimizer after set through DDP")
    continue_equally(pair, name, dist.device)


@pytest.mark.req("SD-2")
@pytest.mark.parametrize("how", ("plain", "checkpoint+compile"))
@pytest.mark.parametrize("name", ("mlp", "tied", "frozen", "nested", "groups", "dtypes"))
def test_optimizer_state_keyed_by_fqn(impl: Adapter, name: str, how: str) -> None:
    """Two param groups with extra keys, two steps of Adam: state and param_groups keyed by FQN, in the
    optimizer's order, equal to the oracle bit for bit."""
    ops = sd_ops(impl)
    model = zoo.build(name)
    optim = source_optimizer(model)
    train(model, optim, name, range(2))
    got = ops.get_optimizer_state_dict(wrap(model, how), optim)
    assert_same_state(got, fqn_keyed_optim(model, optim), what=f"optimizer state dict of {name}")


@pytest.mark.req("SD-2")
@pytest.mark.parametrize("name", ("tied", "nested", "dtypes"))
def test_flattened_optimizer_state_dict(impl: Adapter, name: str) -> None:
    """flatten_optimizer_state_dict: one flat dict, state.<fqn>.<name> and param_groups.<fqn>.<key>."""
    ops = sd_ops(impl)
    model = zoo.build(name)
    optim = source_optimizer(model)
    train(model, optim, name, range(2))
    flat = ops.get_optimizer_state_dict(model, optim, options=ops.options(flatten_optimizer_state_dict=True))
    assert_same_state(flat, per_parameter(fqn_keyed_optim(model, optim), sequence_types=True),
                      what="flattened optimizer state dict", check_order=False)


@pytest.mark.req("SD-2")
def test_flattened_nested_state_round_trips(impl: Adapter) -> None:
    """Per-parameter state that holds dicts (by name and by int) flattens to ``state.<fqn>.ema.fast`` and
    ``state.<fqn>.history.0``, and a set of that flat dict into a target whose nested state differs
    restores it as it was: int keys as ints, every tensor bit for bit. A group key with dots in it
    (``sdc.schedule.phase``, flat ``param_groups.<fqn>.sdc.schedule.phase``) comes back whole: the flat
    key is split at the parameter's FQN, and the rest is the group's key."""
    ops = sd_ops(impl)
    options = ops.options(flatten_optimizer_state_dict=True)
    source = zoo.build("nested", seed=0)
    source_optim = add_source_extras(NestedStateAdam(zoo.param_groups(source)))
    for index, group in enumerate(source_optim.param_groups):
        group["sdc.schedule.phase"] = f"warm-up-{index}"
    train(source, source_optim, "nested", range(2))
    expected = fqn_keyed_optim(source, source_optim)
    try:
        flat = ops.get_optimizer_state_dict(source, source_optim, options=options)
    except Unsupported as exc:
        pytest.skip(str(exc))
    fqn = next(iter(expected["state"]))
    for key in (f"state.{fqn}.ema.fast", f"state.{fqn}.ema.slow", f"state.{fqn}.history.0", f"state.{fqn}.history.1"):
        if key not in flat:
            fail("a nested state's flattened key", sorted(k for k in flat if k.startswith(f"state.{fqn}.")), key, "flattened optimizer state dict")
    target = zoo.build("nested", seed=1)
    target_optim = NestedStateAdam([{"params": g} for g in regroup([g["params"] for g in zoo.param_groups(target)], "reversed")])
    perturb_hyperparameters(target_optim)
    train(target, target_optim, "nested", range(5, 8))  # three history entries: the load must drop the third
    ops.set_optimizer_state_dict(target, target_optim, flat, options=options)
    assert_same_optim(fqn_keyed_optim(target, target_optim), expected, what="optimizer state after a set of the flattened nested state")


@pytest.mark.req("SD-3")
@pytest.mark.parametrize("how", ("plain", "checkpoint+compile"))
def test_ignore_frozen_params(impl: Adapter, how: str) -> None:
    """get leaves out exactly the frozen parameters; set with the option loads that dict strictly into
    a target differing everywhere, loading the trainable entries and leaving the frozen ones as they were."""
    ops = sd_ops(impl)
    source = zoo.build("frozen", seed=0)
    frozen = {n for n, p in source.named_parameters() if not p.requires_grad}
    assert frozen, "the zoo's frozen model must have frozen parameters"
    options = ops.options(ignore_frozen_params=True)
    got = ops.get_model_state_dict(wrap(source, how), options=options)
    assert_same_state(got, {k: v for k, v in source.state_dict().items() if k not in frozen}, what="get without frozen")

    target = zoo.build("frozen", seed=1)
    make_differ(target, source)
    frozen_before = {k: v.clone() for k, v in target.state_dict().items() if k in frozen}
    ops.set_model_state_dict(wrap(target, how), copy.deepcopy(got), options=options)
    after = target.state_dict()
    assert_same_state({k: after[k] for k in got}, got, what="trainable entries after set")
    assert_same_state({k: after[k] for k in frozen_before}, frozen_before, what="frozen parameters after set")


@pytest.mark.req("SD-3")
def test_sharded_ignore_frozen_params(dist: RankContext, impl: Adapter) -> None:
    ops = sd_ops(impl)
    pair = sharded_pair(impl, dist, "frozen")
    frozen = {n for n, p in pair.oracle.named_parameters() if not p.requires_grad}
    got = ops.get_model_state_dict(pair.model, options=ops.options(full_state_dict=True, ignore_frozen_params=True))
    assert_same_state(got, {k: v for k, v in pair.oracle.state_dict().items() if k not in frozen}, what="trainable entries",
                      where=f"rank {dist.rank}", atol=ATOL, rtol=RTOL)


SELECTIONS = [
    pytest.param("nested", ("1",), id="nested-1"),
    pytest.param("nested", ("10",), id="nested-10"),
    pytest.param("nested", ("1.inner",), id="nested-1.inner"),
    pytest.param("nested", ("1", "10.proj"), id="nested-1+10.proj"),
    pytest.param("nested", ("1", "1.inner"), id="nested-1+1.inner"),
    pytest.param("tied", ("head",), id="tied-head"),
    pytest.param("buffers", ("norm",), id="buffers-norm"),
    pytest.param("nested", ("",), id="nested-root"),
]


@pytest.mark.req("SD-4")
@pytest.mark.parametrize("how", ("plain", "checkpoint+compile"))
@pytest.mark.parametrize("name, paths", SELECTIONS)
def test_submodules_select_entries(impl: Adapter, name: str, paths: tuple[str, ...], how: str) -> None:
    """Oracle: the model's own ``state_dict()`` entries under the selected paths, bit for bit."""
    ops = sd_ops(impl)
    model = zoo.build(name)
    expected = {k: v for k, v in model.state_dict().items() if k in select_keys(model, paths)}
    submodules = {model.get_submodule(p) for p in paths}  # resolved before wrapping: the user's modules
    wrapped = wrap(model, how)
    with recording_deprecations(ops):
        got = ops.get_model_state_dict(wrapped, submodules=submodules)
    assert_same_state(got, expected, what=f"entries selected by {paths}")


#: Selections in the "nested" model wrapped three deep by the implementation's own flat wrapper: the
#: module a wrapper wraps ("1", "1.inner", the root), one whose parameters the root wrapper flattened.
OWN_FLAT_SELECTIONS = [("1",), ("1.inner",), ("10",), ("1", "10.proj"), ("",)]


@pytest.mark.req("SD-4")
@pytest.mark.parametrize("paths", OWN_FLAT_SELECTIONS, ids=["+".join(p) or "root" for p in OWN_FLAT_SELECTIONS])
def test_submodules_select_entries_under_the_implementations_own_flat_wrapper(impl: Adapter, paths: tuple[str, ...]) -> None:
    """A model wrapped by the implementation's own FlatParameter wrapper (its FP capability), three
    deep: selecting a module a wrapper wraps, or one inside it, selects the entries the unwrapped
    model has there, the flattened ones included. The implementation's state_dict functions must see
    through its own wrapper's path segment, as through torch's."""
    ops = sd_ops(impl)
    flat = impl.require("flat_param")
    model = zoo.build("nested")
    expected = {k: v.clone() for k, v in model.state_dict().items() if k in select_keys(model, paths)}
    submodules = {model.get_submodule(p) for p in paths}  # resolved before wrapping: the user's modules
    wrapped = WRAPPINGS["nested"](flat, model)
    with recording_deprecations(ops):
        got = ops.get_model_state_dict(wrapped, submodules=submodules)
    assert_same_state(got, expected, what=f"entries selected by {paths} under the implementation's flat wrappers")


@pytest.mark.req("SD-4")
def test_submodule_not_in_model_is_an_error(impl: Adapter) -> None:
    ops = sd_ops(impl)
    model = zoo.build("nested")
    stranger = nn.Linear(2, 2)
    with recording_deprecations(ops):
        expect_error(lambda: ops.get_model_state_dict(model, submodules={stranger}), ValueError, needles=["Linear"],
                     what="get with a submodule that is not part of the model")


@pytest.mark.req("SD-4")
@pytest.mark.parametrize("entry", ("path", "parameter"))
def test_submodules_entry_that_is_no_module_is_an_error(impl: Adapter, entry: str) -> None:
    """``submodules={"1"}`` (a module's path, as a user may write it) or ``{model.1.proj.weight}`` selects
    nothing a module would: an error naming the entry's type, never the whole model's entries or none."""
    ops = sd_ops(impl)
    model = zoo.build("nested")
    given: Any = "1" if entry == "path" else model.get_parameter("1.proj.weight")
    with recording_deprecations(ops):
        # The module itself selects: an implementation that refuses every selection proves nothing here.
        selected = ops.get_model_state_dict(model, submodules={model.get_submodule("1")})
        if sorted(selected) != sorted(select_keys(model, ("1",))):
            fail("get with submodules={model.1}", sorted(selected), sorted(select_keys(model, ("1",))))
        expect_error(lambda: ops.get_model_state_dict(model, submodules={given}), (TypeError, ValueError),
                     needles=[type(given).__name__], what=f"get with submodules={{{entry}}}")


@pytest.mark.req("SD-4", "SD-5")
@pytest.mark.parametrize("keep", (True, False), ids=("keep-prefixes", "strip-prefixes"))
@pytest.mark.parametrize("path", ("1", "10", "1.inner"))
def test_sharded_submodule_selection(dist: RankContext, impl: Adapter, path: str, keep: bool) -> None:
    """Selecting a module of the user's model after it was sharded (inside a sharding unit): the
    oracle's entries of that module, bit for bit (nothing was trained), on every rank."""
    ops = sd_ops(impl)
    oracle = zoo.build("nested", seed=0, device=dist.device)
    model = zoo.build("nested", seed=0, device=dist.device)
    sub = model.get_submodule(path)  # the user's handle, taken before sharding
    try:
        sharded = sd_shard(impl, model, dist.device, "FULL_SHARD")
    except Unsupported as exc:
        pytest.skip(str(exc))
    options = ops.options(full_state_dict=True, keep_submodule_prefixes=keep)
    with recording_deprecations(ops):
        got = ops.get_model_state_dict(sharded, submodules={sub}, options=options)
    expected = {k: v for k, v in oracle.state_dict().items() if k.startswith(path + ".")}
    if not keep:
        expected = {k[len(path) + 1 :]: v for k, v in expected.items()}
    assert_same_state(got, expected, what=f"entries of {path!r}", where=f"rank {dist.rank}")


@pytest.mark.req("SD-5")
@pytest.mark.parametrize("how", ("plain", "checkpoint+compile"))
@pytest.mark.parametrize("name, path", [("nested", "1"), ("nested", "10"), ("nested", "1.inner"), ("tied", "head"), ("buffers", "norm")])
def test_strip_submodule_prefixes(impl: Adapter, name: str, path: str, how: str) -> None:
    ops = sd_ops(impl)
    model = zoo.build(name)
    sub = model.get_submodule(path)
    expected = copy.deepcopy(sub.state_dict())
    wrapped = wrap(model, how)
    with recording_deprecations(ops):
        got = ops.get_model_state_dict(wrapped, submodules={sub}, options=ops.options(keep_submodule_prefixes=False))
    assert_same_state(got, expected, what=f"state dict of {path!r} with prefixes stripped")


@pytest.mark.req("SD-5")
def test_nested_submodules_key_an_entry_relative_to_each(impl: Adapter) -> None:
    """``submodules={model.1, model.1.inner}`` with prefixes stripped: an entry of ``1.inner`` lies in
    both, and appears relative to each (``inner.0.weight`` and ``0.weight``): the two modules' own
    ``state_dict()`` together, as torch gives them."""
    ops = sd_ops(impl)
    model = zoo.build("nested")
    outer, inner = model.get_submodule("1"), model.get_submodule("1.inner")
    expected = {**copy.deepcopy(outer.state_dict()), **copy.deepcopy(inner.state_dict())}
    with recording_deprecations(ops):
        got = ops.get_model_state_dict(model, submodules={outer, inner}, options=ops.options(keep_submodule_prefixes=False))
    assert_same_state(got, expected, what="state dict of '1' and '1.inner' with prefixes stripped", check_order=False)


@pytest.mark.req("SD-5")
def test_stripped_prefixes_collide(impl: Adapter) -> None:
    """Stripping '1.' and '10.' makes '1.inner.0.weight' and '10.inner.0.weight' both 'inner.0.weight'."""
    ops = sd_ops(impl)
    model = zoo.build("nested")
    subs = {model.get_submodule("1"), model.get_submodule("10")}
    with recording_deprecations(ops):
        expect_error(
            lambda: ops.get_model_state_dict(model, submodules=subs, options=ops.options(keep_submodule_prefixes=False)),
            ValueError, keys=["1.inner.0.weight", "10.inner.0.weight"], what="get whose stripped keys collide",
        )


@pytest.mark.req("SD-6")
@pytest.mark.parametrize("strict", (True, False), ids=("strict", "nonstrict"))
@pytest.mark.parametrize("how", ("plain", "checkpoint+compile"))
def test_submodule_keyed_load(impl: Adapter, how: str, strict: bool) -> None:
    """{model.1: sd_of_1} into a target differing everywhere: '1.*' loaded bit for bit, '10.*' left as
    it was and reported missing."""
    ops = sd_ops(impl)
    source, target = zoo.build("nested", seed=0), zoo.build("nested", seed=1)
    make_differ(target, source)
    before = copy.deepcopy(target.state_dict())
    sub_sd = copy.deepcopy(source.get_submodule("1").state_dict())
    wrapped = wrap(target, how)
    with recording_deprecations(ops):
        result = ops.set_model_state_dict(
            wrapped, {target.get_submodule("1"): copy.deepcopy(sub_sd)}, options=ops.options(strict=strict)
        )
    after = target.state_dict()
    assert_same_state({k[2:]: v for k, v in after.items() if k.startswith("1.")}, sub_sd, what="entries of '1' after load")
    outside = [k for k in before if not k.startswith("1.")]
    assert_same_state({k: after[k] for k in outside}, {k: before[k] for k in outside}, what="entries outside '1'")
    assert sorted(result.missing_keys) == sorted(outside)
    assert list(result.unexpected_keys) == []


@pytest.mark.req("SD-6")
def test_submodule_key_reachable_at_two_paths_is_an_error(impl: Adapter) -> None:
    """A submodule key stands for one path; a module reachable at two has no single FQN to load at."""
    ops = sd_ops(impl)
    model = SharedChild()
    sub_sd = {k: different_like(v) for k, v in model.first.state_dict().items()}
    before = snapshot(model=model)
    expect_error(lambda: ops.set_model_state_dict(model, {model.first: sub_sd}, options=ops.options(strict=False)),
                 ValueError, needles=["first", "second"], what="set keyed by a submodule reachable at two paths")
    assert_unchanged(before, model=model, where="after the refused load")


@pytest.mark.req("SD-6")
def test_entry_given_under_two_submodule_keys_is_an_error(impl: Adapter) -> None:
    """{model.1: ..., model.1.inner: ...} gives the entries of ``1.inner`` twice: which one wins is not
    defined, so the load is refused naming a twice-given FQN, and nothing changes."""
    ops = sd_ops(impl)
    model, source = zoo.build("nested", seed=1), zoo.build("nested", seed=0)
    outer, inner = model.get_submodule("1"), model.get_submodule("1.inner")
    given = {outer: copy.deepcopy(source.get_submodule("1").state_dict()),
             inner: copy.deepcopy(source.get_submodule("1.inner").state_dict())}
    twice = sorted("1.inner." + key for key in given[inner])
    before = snapshot(model=model)
    exc = expect_error(lambda: ops.set_model_state_dict(model, given, options=ops.options(strict=False)),
                       ValueError, what="set with one entry under two submodule keys")
    if not any(key in str(exc) for key in twice):
        fail("the error names no entry that was given twice", str(exc), f"one of {twice}")
    assert_unchanged(before, model=model, where="after the refused load")


@pytest.mark.req("SD-6")
@pytest.mark.parametrize("path", ("1", "10"))
def test_sharded_submodule_keyed_load(dist: RankContext, impl: Adapter, path: str) -> None:
    """A full dict keyed by a submodule (the user's handle, taken before sharding) into a sharded model
    of another seed: that submodule's entries equal the source's on every rank, the rest is as it was."""
    ops = sd_ops(impl)
    source = zoo.build("nested", seed=0, device=dist.device)
    before = zoo.build("nested", seed=1, device=dist.device).state_dict()
    model = zoo.build("nested", seed=1, device=dist.device)
    sub = model.get_submodule(path)
    try:
        sharded = sd_shard(impl, model, dist.device, "FULL_SHARD")
    except Unsupported as exc:
        pytest.skip(str(exc))
    sub_sd = copy.deepcopy(source.get_submodule(path).state_dict())
    options = ops.options(full_state_dict=True, strict=False)
    with recording_deprecations(ops):
        result = ops.set_model_state_dict(sharded, {sub: copy.deepcopy(sub_sd)}, options=options)
    got = ops.get_model_state_dict(sharded, options=ops.options(full_state_dict=True))
    prefix = path + "."
    expected = {k: (sub_sd[k[len(prefix):]] if k.startswith(prefix) else v) for k, v in before.items()}
    assert_same_state(got, expected, what=f"model after loading {path!r} by submodule", where=f"rank {dist.rank}")
    assert sorted(result.missing_keys) == sorted(k for k in before if not k.startswith(prefix))


@pytest.mark.req("SD-7")
@pytest.mark.parametrize("call", ("set_model_state_dict", "set_state_dict"))
def test_nonstrict_partial_load_reports_keys(impl: Adapter, call: str) -> None:
    """A partial, over-full model state dict loaded non-strict, alone or beside an optimizer state dict
    (``set_state_dict`` reports the model's keys as ``set_model_state_dict`` does): the given entries
    load, the others stay, and the result names exactly the keys left out and the keys added."""
    ops = sd_ops(impl)
    source, target = zoo.build("nested", seed=0), zoo.build("nested", seed=1)
    make_differ(target, source)
    before = copy.deepcopy(target.state_dict())
    keys = list(source.state_dict())
    dropped = keys[::2]
    given = {k: v.clone() for k, v in source.state_dict().items() if k not in dropped}
    extra = {"1.inner.0.extra": torch.ones(2), "11.weight": torch.ones(3)}
    model_sd, options = {**copy.deepcopy(given), **extra}, ops.options(strict=False)
    if call == "set_model_state_dict":
        result = ops.set_model_state_dict(target, model_sd, options=options)
    else:
        optim = torch.optim.SGD(target.parameters(), lr=0.1)
        optim_sd = ops.get_optimizer_state_dict(target, optim)
        result = ops.set_state_dict(target, optim, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    reported = (sorted(getattr(result, "missing_keys", ["<no missing_keys>"])), sorted(getattr(result, "unexpected_keys", ["<no unexpected_keys>"])))
    if reported != (sorted(dropped), sorted(extra)):
        fail(f"{call}: the keys a non-strict load reports (missing, unexpected)", reported, (sorted(dropped), sorted(extra)))
    after = target.state_dict()
    assert_same_state({k: after[k] for k in given}, given, what="given entries")
    assert_same_state({k: after[k] for k in dropped}, {k: before[k] for k in dropped}, what="entries not given")


@pytest.mark.req("SD-7")
def test_nonstrict_optimizer_load_keeps_state_not_given(impl: Adapter) -> None:
    """A non-strict optimizer load that gives state for only some parameters: those take the given state,
    the others keep their own (bit for bit), whatever the order of the target's parameters."""
    ops = sd_ops(impl)
    pair = plain_pair("nested", layout="reversed")
    saved = copy.deepcopy(ops.get_optimizer_state_dict(pair.source, pair.source_optim))
    fqns = list(saved["state"])
    dropped = fqns[::2]
    given = {**saved, "state": {fqn: value for fqn, value in saved["state"].items() if fqn not in dropped}}
    before = copy.deepcopy(fqn_keyed_optim(pair.target, pair.target_optim)["state"])
    ops.set_optimizer_state_dict(pair.target, pair.target_optim, copy.deepcopy(given), options=ops.options(strict=False))
    after = fqn_keyed_optim(pair.target, pair.target_optim)["state"]
    assert sorted(after) == sorted(fqns), f"parameters with state after the load: {sorted(after)}"
    for fqn in fqns:
        expected, source = (before[fqn], "its own state") if fqn in dropped else (saved["state"][fqn], "the given state")
        assert_same_state(after[fqn], expected, what=f"optimizer state after a partial non-strict load ({source})", where=fqn)


@pytest.mark.req("SD-7", "SD-8")
def test_non_persistent_buffer_is_not_loaded(impl: Adapter) -> None:
    """A non-persistent buffer is not part of the state dict: without strict it is reported unexpected
    and not loaded (the strict case is an error case of test_load_error)."""
    ops = sd_ops(impl)
    source, target = zoo.build("buffers", seed=0), zoo.build("buffers", seed=1)
    sd = {**source.state_dict(), "scale": torch.zeros(3)}
    result = ops.set_model_state_dict(target, sd, options=ops.options(strict=False))
    assert list(result.unexpected_keys) == ["scale"]
    assert_same_state(target.scale, torch.full((3,), 0.75), what="the non-persistent buffer after a non-strict load")


#: The marks of the requirements a parametrization checks, spelled out: tests/test_spec_coverage.py reads
#: the IDs from the source.
REQ_MARKS = {
    "SD-8": pytest.mark.req("SD-8"),
    "SD-9": pytest.mark.req("SD-9"),
    "SD-10": pytest.mark.req("SD-10"),
    "SD-12": pytest.mark.req("SD-12"),
    "SD-13": pytest.mark.req("SD-13"),
    "SD-14": pytest.mark.req("SD-14"),
    "SD-17": pytest.mark.req("SD-17"),
    "SD-33": pytest.mark.req("SD-33"),
    "SD-39": pytest.mark.req("SD-39"),
}


@pytest.mark.parametrize("kind, api, how", plain_error_params(REQ_MARKS))
def test_load_error(impl: Adapter, kind: str, api: str, how: str) -> None:
    """A wrong model or optimizer dict, or bad options: the error type, the canonical key named whole
    (no wrapper segment), and model and optimizer unchanged. "single" loads the wrong part alone
    (set_model_state_dict / set_optimizer_state_dict); "set_state_dict" loads it with a valid other
    part, which must not be loaded either."""
    ops = sd_ops(impl)
    case = ERROR_CASES[kind]
    pair = plain_pair(case.model)
    model_sd, optim_sd = copy.deepcopy(ops.get_state_dict(pair.source, pair.source_optim))
    bad_model, bad_optim = break_input(case, model_sd, optim_sd)
    target = wrap(pair.target, how)
    before = snapshot(model=pair.target, optim=pair.target_optim)

    def call() -> Any:
        options = error_options(ops, case, bad=True)
        if api == "set_state_dict":
            return ops.set_state_dict(target, pair.target_optim, model_state_dict=bad_model, optim_state_dict=bad_optim,
                                      options=options)
        if case.part == "optim":
            return ops.set_optimizer_state_dict(target, pair.target_optim, bad_optim, options=options)
        return ops.set_model_state_dict(target, bad_model, options=options)

    exc = raised(call)
    refused, unchanged = ERROR_CLAUSES[case.req]
    check_each({refused: lambda: check_error(case, exc, model_sd, list(model_sd)),
                unchanged: lambda: assert_unchanged(before, model=pair.target, optim=pair.target_optim)})


@pytest.mark.req("SD-8", "SD-7")
@pytest.mark.parametrize("how", ("plain", "checkpoint+compile"))
@pytest.mark.parametrize("kind", ("missing", "unexpected", "non-persistent", "optim-missing"))
def test_strict_decides_whether_a_mismatch_is_an_error(impl: Adapter, kind: str, how: str) -> None:
    """One wrong dict (a model entry missing, an entry the model lacks, a non-persistent buffer, or an
    optimizer parameter that no saved group lists), set twice into a target that differs everywhere.
    ``strict=True``: a ``RuntimeError`` naming the canonical key whole (no wrapper segment); for the
    optimizer case also nothing changed, model or optimizer. ``strict=False`` (model cases): no error,
    every given entry of the model loaded bit for bit, a missing entry left as it was and reported in
    ``missing_keys``, an unexpected one (a non-persistent buffer too) reported in ``unexpected_keys``
    and not loaded, keys spelled canonically. (Model state left unchanged by a refused strict load is
    test_load_error's.)"""
    ops = sd_ops(impl)
    case = ERROR_CASES[kind]
    pair = plain_pair(case.model)
    model_sd, optim_sd = copy.deepcopy(ops.get_state_dict(pair.source, pair.source_optim))
    bad_model, bad_optim = break_input(case, model_sd, optim_sd)
    target = wrap(pair.target, how)
    untouched_before = copy.deepcopy(pair.target.state_dict())
    before = snapshot(model=pair.target, optim=pair.target_optim)

    def strict_load() -> Any:
        if case.part == "optim":
            return ops.set_optimizer_state_dict(target, pair.target_optim, copy.deepcopy(bad_optim), options=ops.options(strict=True))
        return ops.set_model_state_dict(target, copy.deepcopy(bad_model), options=ops.options(strict=True))

    exc = raised(strict_load)
    check_error(case, exc, model_sd, list(model_sd), where=f"strict set, {how}")
    if case.part == "optim":
        assert_unchanged(before, model=pair.target, optim=pair.target_optim, where="after the refused strict optimizer load")
        return
    result = ops.set_model_state_dict(target, copy.deepcopy(bad_model), options=ops.options(strict=False))
    after = pair.target.state_dict()
    given = {k: v for k, v in bad_model.items() if k in after}
    assert_same_state({k: after[k] for k in given}, given, what=f"entries given to a non-strict set ({kind})")
    missing = [k for k in after if k not in bad_model]
    assert_same_state({k: after[k] for k in missing}, {k: untouched_before[k] for k in missing},
                      what=f"entries not given to a non-strict set ({kind})")
    unexpected = [k for k in bad_model if k not in after]
    if sorted(result.missing_keys) != sorted(missing) or sorted(result.unexpected_keys) != sorted(unexpected):
        fail(f"keys reported by a non-strict set ({kind}, {how})", (sorted(result.missing_keys), sorted(result.unexpected_keys)),
             (sorted(missing), sorted(unexpected)))
    if kind == "non-persistent":
        assert_same_state(pair.target.scale, torch.full((3,), 0.75), what="the non-persistent buffer after a non-strict set")


@pytest.mark.req("SD-8", "SD-19")
def test_strict_load_into_dtensor_parameters_names_the_missing_key(dist: RankContext, impl: Adapter) -> None:
    """A model whose parameters are DTensors (tensor parallel, no FSDP unit) honours ``strict``: a full or
    sharded dict without one key is a ``RuntimeError`` naming it, on every rank, and the model is left
    as it was (pytorch/pytorch#126285: the missing key loaded silently)."""
    strict_load_into_dtensor_parameters_without(dist, impl, set(range(dist.world_size)))


@pytest.mark.req("SD-8", "SD-19")
@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(PROMPTLY_S)
def test_strict_load_into_dtensor_parameters_missing_a_key_on_one_rank(dist: RankContext, impl: Adapter) -> None:
    """As above, with the key missing from the last rank's dict only: the model is collective over its
    mesh, so every rank raises the same error naming the key, promptly (a rank that raises alone leaves
    the others waiting in the load's collectives), and no rank changes anything."""
    strict_load_into_dtensor_parameters_without(dist, impl, {dist.world_size - 1})


#: The error cases of sharded loads: the model and optimizer state are full dicts, except "shape-dtensor"
#: (a DTensor of the wrong global shape in a sharded dict); "broadcast-options" breaks the options.
SHARDED_ERROR_KINDS = ("missing", "unexpected", "shape", "shape-dtensor", "empty", "optim-missing", "optim-unexpected",
                       "optim-state-missing", "broadcast-options", "optim-malformed")


@pytest.mark.rank_timeout(PROMPTLY_S)
@pytest.mark.parametrize("kind", [pytest.param(k, marks=REQ_MARKS[ERROR_CASES[k].req]) for k in SHARDED_ERROR_KINDS])
def test_sharded_load_error(dist: RankContext, impl: Adapter, kind: str) -> None:
    """Every rank's input is wrong: every rank raises the same error and changes nothing."""
    sharded_error_run(dist, impl, kind, bad_ranks=set(range(dist.world_size)))


#: The one-rank cases: one per requirement and kind of input that reaches a collective.
ONE_RANK_ERROR_KINDS = ("missing", "shape-dtensor", "empty", "optim-missing", "optim-state-missing", "broadcast-options", "optim-malformed")


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(PROMPTLY_S)
@pytest.mark.parametrize("kind", [pytest.param(k, marks=REQ_MARKS[ERROR_CASES[k].req]) for k in ONE_RANK_ERROR_KINDS])
def test_sharded_load_error_on_one_rank(dist: RankContext, impl: Adapter, kind: str) -> None:
    """Only the last rank's input is wrong: still every rank raises the same error, promptly (a rank
    left waiting in a collective is cut by the timeout), and no rank changes anything."""
    sharded_error_run(dist, impl, kind, bad_ranks={dist.world_size - 1})


@pytest.mark.req("SD-8", "SD-7")
@pytest.mark.rank_timeout(PROMPTLY_S)
@pytest.mark.parametrize("kind", ("missing", "unexpected", "optim-missing"))
def test_sharded_strict_decides_whether_a_mismatch_is_an_error(dist: RankContext, impl: Adapter, kind: str) -> None:
    """On a sharded model, one wrong full dict (an entry missing, an entry the model lacks, an
    optimizer parameter no saved group lists) on every rank, set twice into a differing target.
    ``strict=True``: every rank raises the same ``RuntimeError`` naming the canonical key whole; for
    the optimizer case no rank changes anything. ``strict=False`` (model cases): no rank raises, and on
    every rank the full get holds the given entries bit for bit and the target's own value for the
    missing one, which is reported in ``missing_keys`` (an unexpected one in ``unexpected_keys``)."""
    ops = sd_ops(impl)
    case = ERROR_CASES[kind]
    source = sharded_pair(impl, dist, case.model)
    model_sd, optim_sd = copy.deepcopy(ops.get_state_dict(source.model, source.optim, options=ops.options(full_state_dict=True)))
    target, target_optim = sharded_target(impl, dist, case.model, source.oracle.state_dict())
    bad_model, bad_optim = break_input(case, model_sd, optim_sd)
    full = ops.options(full_state_dict=True)
    own = copy.deepcopy(ops.get_model_state_dict(target, options=full))
    before = snapshot(model=target, optim=target_optim)
    where = f"rank {dist.rank}"

    def strict_load() -> Any:
        options = ops.options(full_state_dict=True, strict=True)
        if case.part == "optim":
            return ops.set_optimizer_state_dict(target, target_optim, copy.deepcopy(bad_optim), options=options)
        return ops.set_model_state_dict(target, copy.deepcopy(bad_model), options=options)

    exc = raised(strict_load)
    assert_same_error_on_every_rank(dist, exc, what=f"{kind}: strict set of a sharded model")
    check_error(case, exc, model_sd, list(model_sd), where=where)
    if case.part == "optim":
        assert_unchanged(before, model=target, optim=target_optim, where=f"{where}, after the refused strict optimizer load")
        return
    box: list[Any] = []
    nonstrict = ops.options(full_state_dict=True, strict=False)
    exc = raised(lambda: box.append(ops.set_model_state_dict(target, copy.deepcopy(bad_model), options=nonstrict)))
    every = dist.all_gather_object(None if exc is None else f"{type(exc).__name__}: {exc}"[:300])
    if any(e is not None for e in every):
        fail(f"{kind}: a non-strict set of a sharded model raised", every, "no error on any rank", where)
    reported = box[0]
    after = ops.get_model_state_dict(target, options=full)
    missing = [k for k in own if k not in bad_model]
    expected = {k: (own[k] if k in missing else bad_model[k]) for k in own}
    assert_same_state(after, expected, what=f"full model state dict after a non-strict set ({kind})", where=where)
    unexpected = [k for k in bad_model if k not in own]
    if sorted(reported.missing_keys) != sorted(missing) or sorted(reported.unexpected_keys) != sorted(unexpected):
        fail(f"keys reported by a non-strict set of a sharded model ({kind})",
             (sorted(reported.missing_keys), sorted(reported.unexpected_keys)), (sorted(missing), sorted(unexpected)), where)


@pytest.mark.req("SD-10")
def test_empty_nonstrict_load_reports_everything_missing(impl: Adapter) -> None:
    ops = sd_ops(impl)
    model = zoo.build("mlp")
    before = snapshot(model=model)
    result = ops.set_model_state_dict(model, {}, options=ops.options(strict=False))
    assert sorted(result.missing_keys) == sorted(model.state_dict())
    assert_unchanged(before, model=model)


@pytest.mark.req("SD-10")
@pytest.mark.parametrize("case", ("stateless-submodule", "all-frozen", "stateless-model"))
def test_empty_get_is_not_an_error(impl: Adapter, case: str) -> None:
    ops = sd_ops(impl)
    model = zoo.build("mlp")
    with recording_deprecations(ops) if case == "stateless-submodule" else contextlib.nullcontext():
        if case == "stateless-submodule":
            got = ops.get_model_state_dict(model, submodules={model.get_submodule("net.1")})  # a ReLU
        elif case == "all-frozen":
            model.requires_grad_(False)
            got = ops.get_model_state_dict(model, options=ops.options(ignore_frozen_params=True))
        else:
            got = ops.get_model_state_dict(nn.Sequential(nn.ReLU(), nn.Tanh()))
    assert got == {}


#: (wrappers, optimizer state dict form, target's param groups, set API): every pair of two choices
#: occurs in some row, so a fault that needs two of them together is met without the full product.
ROUND_TRIPS = [
    ("plain", "nested", "reversed", "set_state_dict"),
    ("plain", "flat", "regrouped", "separate"),
    ("checkpoint+compile", "nested", "regrouped", "separate"),
    ("checkpoint+compile", "flat", "reversed", "set_state_dict"),
    ("plain", "flat", "reversed", "separate"),
    ("checkpoint+compile", "nested", "regrouped", "set_state_dict"),
]


@pytest.mark.req("SD-11")
@pytest.mark.parametrize("how, form, layout, api", [pytest.param(*row, id="-".join(row)) for row in ROUND_TRIPS])
@pytest.mark.parametrize("name", tuple(zoo.ZOO))
def test_round_trip(impl: Adapter, name: str, how: str, form: str, layout: str, api: str) -> None:
    """set(get(source)) into a target differing in values, hyperparameters (initial_lr, a custom key, a
    key of its own) and param-group layout: get of the target then equals get of the source bit for
    bit (per parameter for the optimizer), and one more step keeps source and target equal."""
    ops = sd_ops(impl)
    options = ops.options(flatten_optimizer_state_dict=(form == "flat"))
    pair = plain_pair(name, layout)
    # A deep copy travels, as through a file: Optimizer.load_state_dict keeps the given tensors, and
    # source and target stepping one shared exp_avg would tell nothing about the round trip.
    saved = copy.deepcopy(ops.get_state_dict(wrap(pair.source, how), pair.source_optim, options=options))
    load(ops, api, wrap(pair.target, how), pair.target_optim, *copy.deepcopy(saved), options=options)
    model_sd, optim_sd = ops.get_state_dict(pair.target, pair.target_optim, options=options)
    assert_same_state(model_sd, saved[0], what="model state dict after set")
    assert_same_optim(optim_sd, saved[1], "optimizer state dict after set")
    continue_equally(pair, name)


#: (zoo model, form, set API) of the sharded round trips: every zoo model full and sharded, the API
#: alternating; SD-17's flattened full form on three models.
SHARDED_ROUND_TRIPS = [
    pytest.param(name, form, api, id=f"{name}-{form}-{api}", marks=REQ_MARKS[req])
    for i, name in enumerate(SHARDED_ZOO)
    for form, api, req in (
        ("full", ("set_state_dict", "separate")[i % 2], "SD-12"),
        ("sharded", ("separate", "set_state_dict")[i % 2], "SD-13"),
    )
] + [
    pytest.param(name, "full+flat", api, id=f"{name}-full+flat-{api}", marks=REQ_MARKS["SD-17"])
    for name, api in (("nested", "set_state_dict"), ("tied", "separate"), ("dtypes", "set_state_dict"))
]


@pytest.mark.req("SD-11")
@pytest.mark.parametrize("name, form, api", SHARDED_ROUND_TRIPS)
def test_sharded_round_trip(dist: RankContext, impl: Adapter, name: str, form: str, api: str) -> None:
    """get of a sharded model (full; sharded; full and flattened) equals the unwrapped oracle on every
    rank (DTensors by their local shards: bit for bit before training, within float tolerance after);
    set of it into a sharded target differing in values, hyperparameters and parameter order makes the
    target's get equal the source's bit for bit, and one more step keeps them equal."""
    ops = sd_ops(impl)
    options = ops.options(full_state_dict=form != "sharded", flatten_optimizer_state_dict=form == "full+flat")
    source = sharded_pair(impl, dist, name, steps=0)
    initial = copy.deepcopy(source.oracle.state_dict())
    if form == "sharded":
        untrained = ops.get_model_state_dict(source.model)
        assert_dtensor_params(untrained, source.oracle, dist)
        for key, value in source.oracle.state_dict().items():  # nothing computed yet: every bit
            if isinstance(untrained.get(key), DTensor):
                assert_local_shard(untrained[key], value, what="untrained sharded state dict", where=f"{key}, rank {dist.rank}")
    source.train(name, range(2), dist.device)

    model_sd, optim_sd = ops.get_state_dict(source.model, source.optim, options=options)
    if form == "sharded":
        assert_dtensor_params(model_sd, source.oracle, dist)
    assert_matches_oracle(model_sd, source.oracle.state_dict(), f"{form} model state dict", rank=dist.rank,
                          exact=untouched(initial, source.oracle.state_dict()))
    assert_matches_oracle(per_parameter(optim_sd), per_parameter(fqn_keyed_optim(source.oracle, source.oracle_optim)),
                          f"{form} optimizer state dict", rank=dist.rank, check_order=False)

    target, target_optim = sharded_target(impl, dist, name, source.oracle.state_dict())
    saved = copy.deepcopy((model_sd, optim_sd))
    load(ops, api, target, target_optim, *copy.deepcopy(saved), options=options)
    got_model, got_optim = ops.get_state_dict(target, target_optim, options=options)
    assert_same_state(got_model, saved[0], what="model state dict after set", where=f"rank {dist.rank}")
    assert_same_optim(got_optim, saved[1], "optimizer state dict after set", where=f"rank {dist.rank}")

    batch = zoo.batch(name, seed=7, device=dist.device)
    zoo.train_step(source.model, source.optim, batch)
    zoo.train_step(target, target_optim, batch)
    after_source = ops.get_state_dict(source.model, source.optim)
    after_target = ops.get_state_dict(target, target_optim)
    assert_same_state(after_target[0], after_source[0], what="model after one more step", where=f"rank {dist.rank}")
    assert_same_optim(after_target[1], after_source[1], "optimizer after one more step", where=f"rank {dist.rank}")


#: Where a load of param groups goes through: (model, optimizer state dict form).
PARAM_GROUP_PATHS = ("plain", "plain-flat", "plain-full", "plain-broadcast", "sharded", "sharded-full")


@pytest.mark.req("SD-11")
@pytest.mark.parametrize("path", PARAM_GROUP_PATHS)
def test_load_replaces_param_groups_whole(dist: RankContext, impl: Adapter, path: str) -> None:
    """A loaded param group replaces the target's whole, as ``Optimizer.load_state_dict`` does: a key
    that only the target's groups have (say a scheduler's ``initial_lr`` added after the checkpoint was
    written) is gone after the load, the values are as saved (``betas`` stays a tuple), and get of the
    target equals get of the source, on every rank."""
    ops = sd_ops(impl)
    broadcast = path.endswith("broadcast")
    get_options = ops.options(full_state_dict=path.endswith(("full", "broadcast")),
                              flatten_optimizer_state_dict=path.endswith("flat"))
    set_options = ops.options(full_state_dict=path.endswith(("full", "broadcast")), broadcast_from_rank0=broadcast,
                              flatten_optimizer_state_dict=path.endswith("flat"))
    if path.startswith("sharded"):
        source = sharded_pair(impl, dist, "nested")
        model, optim = source.model, source.optim
        target, target_optim = sharded_target(impl, dist, "nested", source.oracle.state_dict(), extra_key=True)
    else:
        pair = plain_pair("nested", device=dist.device, extra_key=True)
        model, optim, target, target_optim = pair.source, pair.source_optim, pair.target, pair.target_optim
    saved = copy.deepcopy(ops.get_optimizer_state_dict(model, optim, options=get_options))
    given = copy.deepcopy(saved) if not broadcast or dist.rank == 0 else {}
    ops.set_optimizer_state_dict(target, target_optim, given, options=set_options)
    got = ops.get_optimizer_state_dict(target, target_optim, options=get_options)
    assert_same_optim(got, saved, "optimizer state dict after set", where=f"rank {dist.rank}", sequence_types=True)


@pytest.mark.req("SD-12")
@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
@pytest.mark.parametrize("name", ("nested", "tied"))
def test_sharded_full_state_dict(dist: RankContext, impl: Adapter, name: str, strategy: str) -> None:
    """Every strategy, on two zoo models (the zoo under FULL_SHARD is covered by test_sharded_round_trip)."""
    ops = sd_ops(impl)
    pair = sharded_pair(impl, dist, name, strategy)
    model_sd, optim_sd = ops.get_state_dict(pair.model, pair.optim, options=ops.options(full_state_dict=True))
    dtensors = [k for k, v in model_sd.items() if isinstance(v, DTensor)]
    if dtensors:
        fail("full state dict holds DTensors", dtensors, "plain tensors only", f"rank {dist.rank}")
    assert_same_state(model_sd, pair.oracle.state_dict(), what=f"full model state dict ({strategy})",
                      where=f"rank {dist.rank}", atol=ATOL, rtol=RTOL)
    assert_same_optim(optim_sd, fqn_keyed_optim(pair.oracle, pair.oracle_optim), f"full optimizer state dict ({strategy})",
                      atol=ATOL, where=f"rank {dist.rank}")


@pytest.mark.req("SD-12")
@pytest.mark.parametrize("part", ("model", "optimizer"))
def test_sharded_full_state_dict_cpu_offload(dist: RankContext, impl: Adapter, part: str) -> None:
    ops = sd_ops(impl)
    pair = sharded_pair(impl, dist, "nested")
    options = ops.options(full_state_dict=True, cpu_offload=True)
    if part == "model":
        got, expected = ops.get_model_state_dict(pair.model, options=options), pair.oracle.state_dict()
    else:
        got, expected = ops.get_optimizer_state_dict(pair.model, pair.optim, options=options), fqn_keyed_optim(pair.oracle, pair.oracle_optim)
    if dist.rank != 0:
        assert got == {}, f"rank {dist.rank}: with cpu_offload only rank 0 holds the full state dict"
        return
    leaves = list(got.values()) if part == "model" else [t for s in got["state"].values() for t in s.values()]
    on_gpu = [t.device for t in leaves if isinstance(t, torch.Tensor) and t.device.type != "cpu"]
    if on_gpu:
        fail("cpu_offload: tensors not on the CPU", on_gpu, "cpu")
    if part == "model":
        assert_same_state(got, expected, what="full model state dict", atol=ATOL, rtol=RTOL)
    else:
        assert_same_optim(got, expected, "full optimizer state dict", atol=ATOL)


@pytest.mark.req("SD-12", "SD-19")
def test_dtensor_parameters_full_cpu_offload(dist: RankContext, impl: Adapter) -> None:
    ops = sd_ops(impl)
    oracle = zoo.build("nested", seed=0, device=dist.device).state_dict()
    got = ops.get_model_state_dict(dtensor_model("nested", 0, dist), options=ops.options(full_state_dict=True, cpu_offload=True))
    if dist.rank != 0:
        assert got == {}, f"rank {dist.rank}: with cpu_offload only rank 0 holds the full state dict; got keys {list(got)}"
        return
    off_cpu = {key: str(value.device) for key, value in got.items() if value.device.type != "cpu"}
    if off_cpu:
        fail("cpu_offload: tensors not on the CPU", off_cpu, "cpu", "rank 0")
    assert_same_state(got, {k: v.cpu() for k, v in oracle.items()}, what="full state dict on rank 0", where="rank 0")


@pytest.mark.req("SD-13")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_get_follows_the_plan(dist: RankContext, impl: Adapter, strategy: str) -> None:
    """``full_state_dict=False`` on a model sharded with each strategy: every parameter and every
    positional optimizer state is a DTensor on the mesh the plan asked for (FULL_SHARD and
    SHARD_GRAD_OP: ``Shard(0)`` over every rank; NO_SHARD: ``Replicate()``; HYBRID_SHARD: the 2-D mesh
    whose dim 0 is the replicate groups and dim 1 the shard groups, ``(Replicate(), Shard(0))``), its
    mesh dims' process groups holding the ranks the plan puts together, and its local shard on every
    rank this rank's planned piece of the unwrapped oracle's value, whatever coordinate it reports. A
    mesh read the wrong way round (dims transposed) fails at world size 2 and 4."""
    ops = sd_ops(impl)
    pair = sharded_pair(impl, dist, "nested", strategy)
    model_sd, optim_sd = ops.get_state_dict(pair.model, pair.optim, options=ops.options(full_state_dict=False))
    assert_planned_get(model_sd, pair.oracle.state_dict(), strategy, dist, "sharded model state dict")
    oracle_optim = fqn_keyed_optim(pair.oracle, pair.oracle_optim)
    if sorted(optim_sd["state"]) != sorted(oracle_optim["state"]):
        fail("sharded optimizer state dict: FQNs with state", sorted(optim_sd["state"]), sorted(oracle_optim["state"]),
             f"rank {dist.rank}")
    for fqn, state in optim_sd["state"].items():
        assert_planned_get(state, oracle_optim["state"][fqn], strategy, dist, f"sharded optimizer state of {fqn!r}")


@pytest.mark.req("SD-14")
@pytest.mark.parametrize("sharded", (False, True), ids=("plain", "sharded"))
@pytest.mark.parametrize("name", ("nested", "dtypes"))
def test_broadcast_from_rank0(dist: RankContext, impl: Adapter, name: str, sharded: bool) -> None:
    """Rank 0 holds the oracle's full model and optimizer state, the other ranks pass {} to
    set_model_state_dict and set_optimizer_state_dict; every rank ends with rank 0's state bit for bit,
    hyperparameters included, in a target that differed everywhere."""
    ops = sd_ops(impl)
    expected_model, expected_optim = oracle_state(name, dist.device)
    target, target_optim = broadcast_target(impl, dist, name, sharded, expected_model)
    options = ops.options(full_state_dict=True, broadcast_from_rank0=True)
    model_sd, optim_sd = copy.deepcopy((expected_model, expected_optim)) if dist.rank == 0 else ({}, {})
    ops.set_model_state_dict(target, model_sd, options=options)
    ops.set_optimizer_state_dict(target, target_optim, optim_sd, options=options)
    check_broadcast_result(ops, dist, target, target_optim, expected_model, expected_optim)


@pytest.mark.req("SD-14", "SD-7")
@pytest.mark.parametrize("sharded", (False, True), ids=("plain", "sharded"))
def test_broadcast_with_cpu_offload_not_strict_skips_unknown_keys(dist: RankContext, impl: Adapter, sharded: bool) -> None:
    """``broadcast_from_rank0`` with ``cpu_offload`` and ``strict=False``, rank 0's dict holding a key the
    model does not have: the rest loads on every rank and the key is reported unexpected, not a
    ``KeyError`` from inside the broadcast (pytorch/pytorch#149516, PR #150239)."""
    ops = sd_ops(impl)
    expected_model, expected_optim = oracle_state("nested", dist.device)
    target, target_optim = broadcast_target(impl, dist, "nested", sharded, expected_model)
    options = ops.options(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True, strict=False)
    extra = "10.inner.0.sdc_extra"
    model_sd = {**copy.deepcopy(expected_model), extra: torch.ones(3, device=dist.device)} if dist.rank == 0 else {}
    result = ops.set_model_state_dict(target, model_sd, options=options)
    unexpected = list(getattr(result, "unexpected_keys", []))
    if unexpected != [extra]:
        fail("unexpected keys reported by a non-strict broadcast load", unexpected, [extra], f"rank {dist.rank}")
    ops.set_optimizer_state_dict(target, target_optim, copy.deepcopy(expected_optim) if dist.rank == 0 else {}, options=options)
    check_broadcast_result(ops, dist, target, target_optim, expected_model, expected_optim)


@pytest.mark.req("SD-15")
@pytest.mark.parametrize("direction", ("reference-to-impl", "impl-to-reference"))
@pytest.mark.parametrize("name", ("tied", "frozen", "buffers", "nested", "dtypes"))
def test_cross_implementation_plain(impl: Adapter, reference_impl: Any, name: str, direction: str) -> None:
    """One implementation's get loads through the other into a differing target: the target equals the
    source bit for bit, model and optimizer (per parameter). (No step after: source and target are
    wrapped differently, and activation checkpointing runs BatchNorm's forward twice.)"""
    ops, ref = sd_ops(impl), sd_ops(reference_impl)
    producer, consumer = (ref, ops) if direction == "reference-to-impl" else (ops, ref)
    pair = plain_pair(name, "reversed")  # regrouped targets are test_round_trip's
    saved = copy.deepcopy(producer.get_state_dict(wrap(pair.source, "checkpoint"), pair.source_optim))
    consumer.set_state_dict(wrap(pair.target, "compile"), pair.target_optim, model_state_dict=saved[0], optim_state_dict=saved[1])
    assert_same_state(pair.target.state_dict(), pair.source.state_dict(), what="model loaded across implementations")
    assert_same_optim(fqn_keyed_optim(pair.target, pair.target_optim), fqn_keyed_optim(pair.source, pair.source_optim),
                      "optimizer loaded across implementations")


@pytest.mark.req("SD-15")
@pytest.mark.parametrize("full_state_dict", (True, False), ids=("full", "sharded"))
@pytest.mark.parametrize("direction", ("reference-to-impl", "impl-to-reference"))
@pytest.mark.parametrize("name", ("nested", "buffers"))
def test_cross_implementation_sharded(dist: RankContext, impl: Adapter, name: str, direction: str, full_state_dict: bool) -> None:
    """Sharded by one implementation, loaded by the other into a differing sharded target: the
    consumer's full get equals the oracle on every rank."""
    # reference_impl is a controller-side fixture; on the ranks the adapter is loaded by name.
    reference = load_adapter("reference")
    producer_impl, consumer_impl = (reference, impl) if direction == "reference-to-impl" else (impl, reference)
    producer, consumer = sd_ops(producer_impl), sd_ops(consumer_impl)
    source = sharded_pair(producer_impl, dist, name)
    target, target_optim = sharded_target(consumer_impl, dist, name, source.oracle.state_dict())
    model_sd, optim_sd = producer.get_state_dict(source.model, source.optim, options=producer.options(full_state_dict=full_state_dict))
    consumer.set_state_dict(
        target, target_optim, model_state_dict=model_sd, optim_state_dict=optim_sd,
        options=consumer.options(full_state_dict=full_state_dict),
    )
    got = consumer.get_state_dict(target, target_optim, options=consumer.options(full_state_dict=True))
    assert_same_state(got[0], source.oracle.state_dict(), what="model loaded across implementations",
                      where=f"rank {dist.rank}", atol=ATOL, rtol=RTOL)
    assert_same_optim(got[1], fqn_keyed_optim(source.oracle, source.oracle_optim), "optimizer loaded across implementations",
                      atol=ATOL, where=f"rank {dist.rank}")


@pytest.mark.req("SD-16")
@pytest.mark.rank_timeout(PROMPTLY_S)
def test_set_state_dict_broadcast_with_empty_dicts_on_other_ranks(dist: RankContext, impl: Adapter) -> None:
    """One set_state_dict call on every rank of a sharded model, ranks > 0 passing {} for both the model
    and the optimizer state: it completes, and every rank ends with rank 0's state (checked on each
    rank, bit for bit). (Sharded only: a wrong implementation hangs here, and each hang costs the timeout.)"""
    ops = sd_ops(impl)
    expected_model, expected_optim = oracle_state("buffers", dist.device)
    target, target_optim = broadcast_target(impl, dist, "buffers", True, expected_model)
    options = ops.options(full_state_dict=True, broadcast_from_rank0=True)
    model_sd, optim_sd = copy.deepcopy((expected_model, expected_optim)) if dist.rank == 0 else ({}, {})
    ops.set_state_dict(target, target_optim, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    check_broadcast_result(ops, dist, target, target_optim, expected_model, expected_optim)


@pytest.mark.req("SD-18")
@pytest.mark.rank_timeout(PROMPTLY_S)
@pytest.mark.parametrize("kind", ("unexpected", "shape", "optim-missing"))
def test_failed_set_restores_state_dict_config(dist: RankContext, impl: Adapter, kind: str) -> None:
    """A full_state_dict set that raises leaves the model's state-dict configuration as it was: the
    default get then has the form it had before (sharded DTensors with the same placements and local
    shapes, the same keys), and a valid default set then loads bit for bit. Checked by behaviour, so it
    holds for every implementation; the failing set offers the model's own values, so that whether it
    changed anything (SD-8, SD-9) does not matter here."""
    ops = sd_ops(impl)
    case = ERROR_CASES[kind]
    pair = sharded_pair(impl, dist, "nested")
    before = form_of(ops.get_state_dict(pair.model, pair.optim))
    full_model, full_optim = copy.deepcopy(ops.get_state_dict(pair.model, pair.optim, options=ops.options(full_state_dict=True)))
    bad_model, bad_optim = break_input(case, full_model, full_optim)
    exc = raised(lambda: ops.set_state_dict(pair.model, pair.optim, model_state_dict=bad_model, optim_state_dict=bad_optim,
                                            options=ops.options(full_state_dict=True)))
    if not isinstance(exc, case.error):
        fail(f"{kind}: the set did not raise {case.error.__name__}", repr(exc), case.error.__name__, f"rank {dist.rank}")

    assert_same_state(form_of(ops.get_state_dict(pair.model, pair.optim)), before,
                      what="form of the default get after the failed set", where=f"rank {dist.rank}")
    other, other_optim = sharded_target(impl, dist, "nested", pair.oracle.state_dict())
    other_sd = copy.deepcopy(ops.get_state_dict(other, other_optim))
    ops.set_state_dict(pair.model, pair.optim, model_state_dict=copy.deepcopy(other_sd[0]),
                       optim_state_dict=copy.deepcopy(other_sd[1]))
    got_model, got_optim = ops.get_state_dict(pair.model, pair.optim)
    assert_same_state(got_model, other_sd[0], what="model after a valid set that followed the failed one",
                      where=f"rank {dist.rank}")
    assert_same_optim(got_optim, other_sd[1], "optimizer after a valid set that followed the failed one",
                      where=f"rank {dist.rank}")


@pytest.mark.req("SD-19")
@pytest.mark.parametrize("form", ("full", "sharded"))
@pytest.mark.parametrize("name", ("nested", "tiny", "dtypes"))
def test_dtensor_parameters_without_fsdp(dist: RankContext, impl: Adapter, name: str, form: str) -> None:
    """Each rank's local shard is checked against the documented layout; the set goes into a model of
    another seed and must restore the source bit for bit."""
    ops = sd_ops(impl)
    oracle = zoo.build(name, seed=0, device=dist.device).state_dict()
    source, target = dtensor_model(name, 0, dist), dtensor_model(name, 1, dist)
    options = ops.options(full_state_dict=form == "full")
    got = ops.get_model_state_dict(source, options=options)
    where = f"rank {dist.rank}"
    if form == "full":
        assert_same_state(got, oracle, what="full state dict of a DTensor-parameter model", where=where)
    else:
        assert list(got) == list(oracle), f"{where}: keys {list(got)}"
        params = dict(source.named_parameters())
        for key, value in got.items():
            if key in params:
                assert_local_shard(value, oracle[key], what="sharded state dict entry", where=f"{key} on {where}")
            else:
                assert_bitwise_equal(value, oracle[key], what="buffer", where=f"{key} on {where}")
    ops.set_model_state_dict(target, copy.deepcopy(got), options=options)
    full = ops.get_model_state_dict(target, options=ops.options(full_state_dict=True))
    assert_same_state(full, oracle, what=f"target after a set of the {form} state dict", where=where)


@pytest.mark.req("SD-34", "SD-14")
@pytest.mark.parametrize("api", ("set_optimizer_state_dict", "set_state_dict"))
@pytest.mark.parametrize("sharded", (False, True), ids=("plain", "sharded"))
def test_broadcast_leaves_rank0s_hyperparameters_on_every_rank(dist: RankContext, impl: Adapter, sharded: bool, api: str) -> None:
    """Each rank's optimizer starts with hyperparameters of its own (lr, betas, eps, and a key only that
    rank's groups have); rank 0's dict carries a key no rank's optimizer has. After a broadcast set,
    every rank's optimizer itself (its ``param_groups``, not a get, which may report the coordinator's
    groups) holds exactly rank 0's hyperparameters: the rank's own key gone, rank 0's key there."""
    ops = sd_ops(impl)
    expected_model, expected_optim = oracle_state("nested", dist.device)
    expected_optim["param_groups"][0]["sdc_from_rank0"] = "a key only rank 0's dict has"
    target, target_optim = broadcast_target(impl, dist, "nested", sharded, expected_model)
    for group in target_optim.param_groups:
        group["lr"] = 0.5 + dist.rank
        group["betas"] = (0.1 * (dist.rank + 1), 0.2 * (dist.rank + 1))
        group["eps"] = 10.0 ** -(dist.rank + 3)
        group[f"sdc_rank_{dist.rank}_only"] = dist.rank
    options = ops.options(full_state_dict=True, broadcast_from_rank0=True)
    model_sd, optim_sd = copy.deepcopy((expected_model, expected_optim)) if dist.rank == 0 else ({}, {})
    if api == "set_state_dict":
        ops.set_state_dict(target, target_optim, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    else:
        ops.set_optimizer_state_dict(target, target_optim, optim_sd, options=options)
    expected = [{k: v for k, v in g.items() if k != "params"} for g in expected_optim["param_groups"]]
    assert_same_state(hyperparameters(target_optim), expected, what="the optimizer's own param groups after the broadcast set",
                      where=f"rank {dist.rank} ({'sharded' if sharded else 'plain'}, {api})")


@pytest.mark.req("SD-35", "SD-12", "SD-14")
@pytest.mark.world_size(min=3)
@pytest.mark.rank_timeout(PROMPTLY_S)
def test_sharded_on_a_subgroup_without_global_rank0(dist: RankContext, impl: Adapter) -> None:
    """A model sharded over a process group of ranks ``1 .. n-1`` (global rank 0 is in no unit and
    only takes part in building the group, as a pipeline stage or a job of several models leaves it).
    "Rank 0" of every option is the group's first rank, global rank 1: with ``full_state_dict`` and
    ``cpu_offload`` it alone gets the dict, equal to the full dict every member gets without
    ``cpu_offload``; with ``broadcast_from_rank0`` it alone holds the model and optimizer state, the
    other members pass ``{}``, and afterwards every member's model, optimizer state and own param
    groups are that dict's (pytorch/pytorch#63213: global ranks taken for the group's)."""
    from torch.distributed.device_mesh import DeviceMesh

    ops = sd_ops(impl)
    members = list(range(1, dist.world_size))
    mesh = DeviceMesh(dist.device.type, torch.tensor(members))  # every rank of the job builds the group
    if dist.rank not in members:
        return
    where = f"global rank {dist.rank}, group of ranks {members}"

    def sharded(seed: int) -> nn.Module:
        raw = zoo.build("nested", seed=seed, device=dist.device)
        plan = ShardingPlan("FULL_SHARD", units=child_units(raw), device=dist.device, mesh=mesh)
        try:
            return impl.require("sharding").shard(raw, plan)
        except Unsupported as exc:
            pytest.skip(f"sharding over a subgroup: {exc}")

    source = sharded(0)
    source_optim = single_group_adam(source)
    group_rank = members.index(dist.rank)
    for seed in range(2):
        zoo.train_step(source, source_optim, zoo.batch("nested", seed=seed, device=dist.device).chunk(len(members))[group_rank])
    full = ops.options(full_state_dict=True)
    everywhere = copy.deepcopy(ops.get_state_dict(source, source_optim, options=full))
    offloaded = ops.get_state_dict(source, source_optim, options=ops.options(full_state_dict=True, cpu_offload=True))
    if dist.rank == members[0]:
        assert_same_state(on_cpu(offloaded[0]), on_cpu(everywhere[0]), what="model state dict with cpu_offload on the group's first rank",
                          where=where)
        assert_same_optim(on_cpu(offloaded[1]), on_cpu(everywhere[1]), "optimizer state dict with cpu_offload on the group's first rank",
                          where=where)
    elif offloaded != ({}, {}):
        fail("full_state_dict + cpu_offload on a member other than the group's first rank", sorted(offloaded[0])[:5], "{} for both", where)

    target = sharded(1)
    target_optim = target_optimizer([[p for p in target.parameters() if p.requires_grad]], "reversed")
    for seed in range(5, 6):
        zoo.train_step(target, target_optim, zoo.batch("nested", seed=seed, device=dist.device).chunk(len(members))[group_rank])
    given = copy.deepcopy(everywhere) if dist.rank == members[0] else ({}, {})
    ops.set_state_dict(target, target_optim, model_state_dict=given[0], optim_state_dict=given[1],
                       options=ops.options(full_state_dict=True, broadcast_from_rank0=True))
    got_model, got_optim = ops.get_state_dict(target, target_optim, options=full)
    assert_same_state(got_model, everywhere[0], what="model after a broadcast from the group's first rank", where=where)
    assert_same_optim(got_optim, everywhere[1], "optimizer after a broadcast from the group's first rank", where=where)
    assert_same_state(hyperparameters(target_optim), [{k: v for k, v in g.items() if k != "params"} for g in everywhere[1]["param_groups"]],
                      what="the optimizer's own param groups after the broadcast", where=where)


#: What a trainer calls, and a set that fails (a strict set with a key the model lacks).
GC_CALLS = ("get_model", "get_optimizer", "get_both", "set_model", "set_optimizer", "set_both", "failing_set")


@pytest.mark.req("SD-38")
@pytest.mark.parametrize("collector", ("enabled", "disabled"))
@pytest.mark.parametrize("call", GC_CALLS)
def test_calls_leave_the_garbage_collector_as_the_caller_had_it(impl: Adapter, call: str, collector: str) -> None:
    """An implementation may pause Python's cyclic garbage collector while it builds dicts of many
    tensors; after the call, returned or raised, the collector is as the caller had it: still enabled,
    or still disabled (torchtitan trains with it disabled and collects by hand, on every rank at once)."""
    ops = sd_ops(impl)
    pair = plain_pair("nested")
    model_sd = copy.deepcopy(ops.get_model_state_dict(pair.source))
    optim_sd = copy.deepcopy(ops.get_optimizer_state_dict(pair.source, pair.source_optim))
    calls: dict[str, Any] = {
        "get_model": lambda: ops.get_model_state_dict(pair.target),
        "get_optimizer": lambda: ops.get_optimizer_state_dict(pair.target, pair.target_optim),
        "get_both": lambda: ops.get_state_dict(pair.target, pair.target_optim),
        "set_model": lambda: ops.set_model_state_dict(pair.target, model_sd),
        "set_optimizer": lambda: ops.set_optimizer_state_dict(pair.target, pair.target_optim, optim_sd),
        "set_both": lambda: ops.set_state_dict(pair.target, pair.target_optim, model_state_dict=model_sd, optim_state_dict=optim_sd),
        "failing_set": lambda: ops.set_model_state_dict(pair.target, {**model_sd, "ghost.weight": torch.ones(1)},
                                                        options=ops.options(strict=True)),
    }
    if call == "failing_set":  # the same set without the stray key loads: an error proves nothing alone
        ops.set_model_state_dict(pair.target, copy.deepcopy(model_sd), options=ops.options(strict=True))
    caller_had = gc.isenabled()
    try:
        gc.enable() if collector == "enabled" else gc.disable()
        error = raised(calls[call])
        after = gc.isenabled()
    finally:
        gc.enable() if caller_had else gc.disable()
    if (error is None) != (call != "failing_set"):
        fail(call, "a normal return" if error is None else f"{type(error).__name__}: {error}"[:400],
             "an error (a key the model lacks, strict)" if call == "failing_set" else "a normal return")
    if after != (collector == "enabled"):
        fail(f"the garbage collector after {call}", "enabled" if after else "disabled", f"{collector}, as the caller had it")
