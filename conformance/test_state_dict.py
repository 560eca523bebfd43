"""SD: get/set state_dict with submodules, on plain, wrapped and sharded models (conformance/SPEC.md).

Oracles: ``nn.Module.state_dict()`` and ``Optimizer.state_dict()`` of the unwrapped model (keyed by
FQN here, :func:`fqn_keyed_optim`), trained identically on one process; for SD-15 the reference.

Tests without ``dist`` run on the controller, on plain models (the state_dict functions need no
process group there); tests with ``dist`` run on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from conformance import models as zoo
from conformance.adapters.base import Unsupported, load_adapter
from conformance.adapters.state_dict import SHARDING_STRATEGIES, StateDictOps

# -- helpers -----------------------------------------------------------------------------------------

#: Wrappers that run without a process group; "ddp" is added in rank tests. "fpw" is the reference
#: FlattenParamsWrapper over the model's trainable parameters (its state dict shows the original keys).
LOCAL_WRAPPERS = ("plain", "checkpoint", "compile", "checkpoint+compile", "fpw")
#: Zoo models that the sharded tests use (``groups`` adds nothing to the SD section).
SHARDED_ZOO = ("mlp", "tied", "frozen", "buffers", "nested", "tiny")
ATOL, RTOL = 1e-6, 1e-5  # ranks average identical gradients; the sum over 4 ranks may round


def sd_ops(impl: Any) -> StateDictOps:
    return impl.require("state_dict")


def wrap(model: nn.Module, how: str) -> nn.Module:
    """``model`` inside the wrappers named in ``how`` ("checkpoint+compile+ddp"), innermost first
    (fpw, checkpoint, compile, ddp).
    Activation checkpointing wraps each direct child; the returned model shares ``model``'s modules."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    parts = set(how.split("+")) - {"plain"}
    if "fpw" in parts:
        from reference.flat_param import FlattenParamsWrapper

        model = FlattenParamsWrapper(model, [p for p in model.parameters() if p.requires_grad])
    if "checkpoint" in parts:
        for name, child in list(model.named_children()):
            setattr(model, name, checkpoint_wrapper(child))
    if "compile" in parts:
        model = torch.compile(model)  # compiles lazily, on the first forward: the tests never run one
    if "ddp" in parts:
        model = nn.parallel.DistributedDataParallel(model)
    return model


def trained(name: str, seed: int = 0, steps: int = 1, device: Any = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    """Zoo model ``name`` and its Adam (two param groups) after ``steps`` training steps."""
    model = zoo.build(name, seed=seed, device=device)
    optim = torch.optim.Adam(zoo.param_groups(model))
    for step in range(steps):
        zoo.train_step(model, optim, zoo.batch(name, seed=step, device=device))
    return model, optim


def fqn_keyed_optim(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The oracle of SD-2: ``optim.state_dict()`` with ids replaced by the FQN ``named_parameters``
    gives first (tied parameters appear once there)."""
    osd = optim.state_dict()
    # The model's own children may be checkpoint-wrapped (``wrap`` wraps in place); its state_dict()
    # hides that segment, named_parameters() of the parent does not.
    name_of = {p: n.replace("_checkpoint_wrapped_module.", "") for n, p in model.named_parameters()}
    fqns = [name_of[p] for group in optim.param_groups for p in group["params"]]
    return {
        "state": {fqns[i]: s for i, s in osd["state"].items()},
        "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in osd["param_groups"]],
    }


def full(value: Any) -> Any:
    """Plain tensors for comparison: DTensors gathered, everything on CPU."""
    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(full(v) for v in value)
    return value


def assert_same(actual: Any, expected: Any, what: str, exact: bool = True, path: str = "") -> None:
    """Equal nested state: same keys, tensors equal in value and dtype (``exact`` or within the
    tolerance of ranks averaging), other values ``==``. The message names ``what`` and the path."""
    where = f"{what}, at {path or 'the top'}"
    actual, expected = full(actual), full(expected)
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: got {type(actual).__name__}, expected a dict"
        assert sorted(map(str, actual)) == sorted(map(str, expected)), (
            f"{where}: keys differ; missing {sorted(set(map(str, expected)) - set(map(str, actual)))}, "
            f"unexpected {sorted(set(map(str, actual)) - set(map(str, expected)))}"
        )
        for key in expected:
            assert_same(actual[key], expected[key], what, exact, f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{where}: got {actual!r}, expected {expected!r}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, what, exact, f"{path}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: got {type(actual).__name__}, expected a tensor"
        tol = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": RTOL, "atol": ATOL}
        torch.testing.assert_close(actual, expected, check_device=False, msg=lambda m: f"{where}: {m}", **tol)
    else:
        assert actual == expected, f"{where}: got {actual!r}, expected {expected!r}"


def snapshot(model: nn.Module, *optims: torch.optim.Optimizer) -> tuple[Any, ...]:
    return (copy.deepcopy(model.state_dict()), *(copy.deepcopy(o.state_dict()) for o in optims))


@contextlib.contextmanager
def recording_deprecations(ops: StateDictOps) -> Iterator[list[str]]:
    """Record the FutureWarning torch emits for ``submodules=`` and submodule-keyed dicts (deprecated
    upstream, still implemented): the behaviour is checked either way; the warning must match what the
    adapter declares."""
    recorded: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield recorded
    recorded += [
        str(w.message) for w in caught if issubclass(w.category, FutureWarning) and "deprecated" in str(w.message)
    ]
    if ops.submodules_deprecated:
        assert recorded, "the adapter declares submodules deprecated, but no FutureWarning was emitted"
    else:
        assert not recorded, f"unexpected deprecation warning(s): {recorded}"


def select_keys(model: nn.Module, paths: tuple[str, ...]) -> list[str]:
    """Oracle of SD-4: the keys of ``model.state_dict()`` under any of ``paths`` (at a '.' boundary)."""
    return [k for k in model.state_dict() if any(p == "" or k.startswith(p + ".") for p in paths)]


# -- SD-1, SD-2: canonical FQNs through wrappers --------------------------------------------------


@pytest.mark.req("SD-1")
@pytest.mark.parametrize("how", LOCAL_WRAPPERS)
@pytest.mark.parametrize("name", tuple(zoo.ZOO))
def test_model_keys_are_canonical_fqns(impl: Any, name: str, how: str) -> None:
    """get of the wrapped model == nn.Module.state_dict() of the unwrapped one: keys (in order), values, dtypes."""
    ops = sd_ops(impl)
    model = zoo.build(name)
    expected = copy.deepcopy(model.state_dict())
    got = ops.get_model_state_dict(wrap(model, how))
    assert list(got) == list(expected)
    assert_same(got, expected, f"{name} wrapped as {how}")
    assert all(got[k].dtype == v.dtype for k, v in expected.items())


@pytest.mark.req("SD-1", "SD-2")
@pytest.mark.parametrize("name", ("tied", "buffers", "nested"))
def test_keys_are_canonical_through_ddp(dist: Any, impl: Any, name: str) -> None:
    """DDP(compile(checkpointed children)): model and optimizer state dicts keyed by clean FQNs."""
    ops = sd_ops(impl)
    model, optim = trained(name, device=dist.device)
    expected_model = copy.deepcopy(model.state_dict())
    expected_optim = fqn_keyed_optim(model, optim)
    got_model, got_optim = ops.get_state_dict(wrap(model, "checkpoint+compile+ddp"), optim)
    assert list(got_model) == list(expected_model)
    assert_same(got_model, expected_model, "model state dict through DDP")
    assert_same(got_optim, expected_optim, "optimizer state dict through DDP")


@pytest.mark.req("SD-2")
@pytest.mark.parametrize("how", ("plain", "checkpoint+compile"))
@pytest.mark.parametrize("name", ("mlp", "tied", "frozen", "nested", "groups"))
def test_optimizer_state_keyed_by_fqn(impl: Any, name: str, how: str) -> None:
    """Two param groups, one step of Adam: state and param_groups keyed by FQN, equal to the oracle."""
    ops = sd_ops(impl)
    model, optim = trained(name)
    expected = fqn_keyed_optim(model, optim)
    got = ops.get_optimizer_state_dict(wrap(model, how), optim)
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    assert_same(got, expected, f"optimizer state dict of {name}")


@pytest.mark.req("SD-2")
@pytest.mark.parametrize("name", ("tied", "nested"))
def test_flattened_optimizer_state_dict(impl: Any, name: str) -> None:
    """flatten_optimizer_state_dict: one flat dict, state.<fqn>.<name> and param_groups.<fqn>.<key>."""
    ops = sd_ops(impl)
    model, optim = trained(name)
    expected = fqn_keyed_optim(model, optim)
    flat = ops.get_optimizer_state_dict(model, optim, options=ops.options(flatten_optimizer_state_dict=True))
    want: dict[str, Any] = {}
    for fqn, st in expected["state"].items():
        want.update({f"state.{fqn}.{k}": v for k, v in st.items()})
    for group in expected["param_groups"]:
        for fqn in group["params"]:
            want.update({f"param_groups.{fqn}.{k}": v for k, v in group.items() if k != "params"})
    assert sorted(flat) == sorted(want)
    assert_same(flat, want, "flattened optimizer state dict")


# -- SD-3: frozen parameters ------------------------------------------------------------------------


@pytest.mark.req("SD-3")
@pytest.mark.parametrize("how", ("plain", "checkpoint+compile"))
def test_ignore_frozen_params(impl: Any, how: str) -> None:
    """get leaves out exactly the frozen parameters; set with the option loads that dict strictly."""
    ops = sd_ops(impl)
    source = zoo.build("frozen", seed=0)
    frozen = {n for n, p in source.named_parameters() if not p.requires_grad}
    assert frozen, "the zoo's frozen model must have frozen parameters"
    options = ops.options(ignore_frozen_params=True)
    got = ops.get_model_state_dict(wrap(source, how), options=options)
    assert list(got) == [k for k in source.state_dict() if k not in frozen]

    target = zoo.build("frozen", seed=1)
    frozen_before = {n: p.detach().clone() for n, p in target.named_parameters() if n in frozen}
    ops.set_model_state_dict(wrap(target, how), got, options=options)
    after = target.state_dict()
    assert_same({k: after[k] for k in got}, got, "trainable entries after set")
    assert_same({k: after[k] for k in frozen}, frozen_before, "frozen parameters after set")


# -- SD-4, SD-5: submodule selection ---------------------------------------------------------------

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
def test_submodules_select_entries(impl: Any, name: str, paths: tuple[str, ...], how: str) -> None:
    """Exactly the entries under the selected modules, full FQNs, '.'-boundary matching."""
    ops = sd_ops(impl)
    model = zoo.build(name)
    expected = select_keys(model, paths)
    submodules = {model.get_submodule(p) for p in paths}  # resolved before wrapping: the user's modules
    wrapped = wrap(model, how)
    with recording_deprecations(ops):
        got = ops.get_model_state_dict(wrapped, submodules=submodules)
    assert list(got) == expected
    assert_same(got, {k: model.state_dict()[k] for k in expected}, "selected entries")


@pytest.mark.req("SD-4")
def test_submodule_not_in_model_is_an_error(impl: Any) -> None:
    ops = sd_ops(impl)
    model = zoo.build("nested")
    stranger = nn.Linear(2, 2)
    with recording_deprecations(ops), pytest.raises(ValueError, match="Linear"):
        ops.get_model_state_dict(model, submodules={stranger})


@pytest.mark.req("SD-5")
@pytest.mark.parametrize("how", ("plain", "checkpoint+compile"))
@pytest.mark.parametrize("name, path", [("nested", "1"), ("nested", "10"), ("nested", "1.inner"), ("tied", "head"), ("buffers", "norm")])
def test_strip_submodule_prefixes(impl: Any, name: str, path: str, how: str) -> None:
    """keep_submodule_prefixes=False with one submodule gives that submodule's own state_dict()."""
    ops = sd_ops(impl)
    model = zoo.build(name)
    sub = model.get_submodule(path)
    expected = copy.deepcopy(sub.state_dict())
    wrapped = wrap(model, how)
    with recording_deprecations(ops):
        got = ops.get_model_state_dict(wrapped, submodules={sub}, options=ops.options(keep_submodule_prefixes=False))
    assert list(got) == list(expected)
    assert_same(got, expected, f"state dict of {path!r} with prefixes stripped")


@pytest.mark.req("SD-5")
def test_stripped_prefixes_collide(impl: Any) -> None:
    """Stripping '1.' and '10.' makes '1.inner.0.weight' and '10.inner.0.weight' both 'inner.0.weight'."""
    ops = sd_ops(impl)
    model = zoo.build("nested")
    subs = {model.get_submodule("1"), model.get_submodule("10")}
    with recording_deprecations(ops), pytest.raises(ValueError) as info:
        ops.get_model_state_dict(model, submodules=subs, options=ops.options(keep_submodule_prefixes=False))
    message = str(info.value)
    assert "1.inner.0.weight" in message and "10.inner.0.weight" in message, message


# -- SD-6: submodule-keyed loads --------------------------------------------------------------------


@pytest.mark.req("SD-6")
@pytest.mark.parametrize("strict", (True, False), ids=("strict", "nonstrict"))
@pytest.mark.parametrize("how", ("plain", "checkpoint+compile"))
def test_submodule_keyed_load(impl: Any, how: str, strict: bool) -> None:
    """{model.1: sd_of_1} loads '1.*', leaves '10.*' as it was and reports it missing."""
    ops = sd_ops(impl)
    source = zoo.build("nested", seed=0)
    target = zoo.build("nested", seed=1)
    before = copy.deepcopy(target.state_dict())
    sub_sd = copy.deepcopy(source.get_submodule("1").state_dict())
    wrapped = wrap(target, how)
    with recording_deprecations(ops):
        result = ops.set_model_state_dict(
            wrapped, {target.get_submodule("1"): sub_sd}, options=ops.options(strict=strict)
        )
    after = target.state_dict()
    assert_same({k[2:]: v for k, v in after.items() if k.startswith("1.")}, sub_sd, "entries of '1' after load")
    outside = [k for k in before if not k.startswith("1.")]
    assert_same({k: after[k] for k in outside}, {k: before[k] for k in outside}, "entries outside '1'")
    assert sorted(result.missing_keys) == sorted(outside)
    assert list(result.unexpected_keys) == []


# -- SD-7, SD-8, SD-9: partial, strict and mismatched loads -----------------------------------------


@pytest.mark.req("SD-7")
def test_nonstrict_partial_load_reports_keys(impl: Any) -> None:
    ops = sd_ops(impl)
    source, target = zoo.build("nested", seed=0), zoo.build("nested", seed=1)
    before = copy.deepcopy(target.state_dict())
    keys = list(source.state_dict())
    dropped = keys[::2]
    given = {k: v for k, v in source.state_dict().items() if k not in dropped}
    extra = {"1.inner.0.extra": torch.ones(2), "11.weight": torch.ones(3)}
    result = ops.set_model_state_dict(target, {**given, **extra}, options=ops.options(strict=False))
    assert sorted(result.missing_keys) == sorted(dropped)
    assert sorted(result.unexpected_keys) == sorted(extra)
    after = target.state_dict()
    assert_same({k: after[k] for k in given}, given, "given entries")
    assert_same({k: after[k] for k in dropped}, {k: before[k] for k in dropped}, "entries not given")


def _break(sd: dict[str, Any], how: str) -> tuple[dict[str, Any], str]:
    """``sd`` made wrong in one way, and the key the error must name."""
    sd = dict(sd)
    key = "10.inner.0.weight"
    if how == "missing":
        del sd[key]
    elif how == "unexpected":
        key = "10.inner.0.extra"
        sd[key] = torch.zeros(3)
    elif how == "shape":
        sd[key] = torch.zeros(sd[key].shape[0], sd[key].shape[1] + 1)
    else:
        raise ValueError(how)
    return sd, key


@pytest.mark.req("SD-8")
@pytest.mark.parametrize("broken", ("missing", "unexpected"))
def test_strict_load_error_changes_nothing(impl: Any, broken: str) -> None:
    ops = sd_ops(impl)
    source, target = zoo.build("nested", seed=0), zoo.build("nested", seed=1)
    sd, key = _break(source.state_dict(), broken)
    before = snapshot(target)
    with pytest.raises(RuntimeError, match=key.replace(".", r"\.")):
        ops.set_model_state_dict(target, sd, options=ops.options(strict=True))
    assert_same(snapshot(target), before, "model after the failed load")


@pytest.mark.req("SD-8")
def test_non_persistent_buffer_is_unexpected(impl: Any) -> None:
    """A non-persistent buffer is not part of the state dict: given, it is an unexpected key."""
    ops = sd_ops(impl)
    source, target = zoo.build("buffers", seed=0), zoo.build("buffers", seed=1)
    sd = {**source.state_dict(), "scale": torch.zeros(3)}
    before = snapshot(target)
    with pytest.raises(RuntimeError, match="scale"):
        ops.set_model_state_dict(target, sd, options=ops.options(strict=True))
    assert_same(snapshot(target), before, "model after the failed load")
    result = ops.set_model_state_dict(target, sd, options=ops.options(strict=False))
    assert list(result.unexpected_keys) == ["scale"]
    assert torch.equal(target.scale, torch.full((3,), 0.75)), "a non-persistent buffer must not be loaded"


@pytest.mark.req("SD-8")
def test_strict_optimizer_load_missing_state(impl: Any) -> None:
    """Optimizer state dict without the state of one trainable parameter: RuntimeError naming it."""
    ops = sd_ops(impl)
    source, source_optim = trained("nested", seed=0)
    target, target_optim = trained("nested", seed=1)
    osd = ops.get_optimizer_state_dict(source, source_optim)
    del osd["state"]["1.proj.bias"]
    before = snapshot(target, target_optim)
    with pytest.raises(RuntimeError, match=r"1\.proj\.bias"):
        ops.set_optimizer_state_dict(target, target_optim, osd, options=ops.options(strict=True))
    assert_same(snapshot(target, target_optim), before, "model and optimizer after the failed load")


@pytest.mark.req("SD-8")
def test_failed_set_state_dict_leaves_optimizer(impl: Any) -> None:
    """set_state_dict with a valid optimizer dict and a model dict missing a key changes neither."""
    ops = sd_ops(impl)
    source, source_optim = trained("nested", seed=0)
    target, target_optim = trained("nested", seed=1)
    model_sd, optim_sd = ops.get_state_dict(source, source_optim)
    model_sd, key = _break(model_sd, "missing")
    before = snapshot(target, target_optim)
    with pytest.raises(RuntimeError, match=key.replace(".", r"\.")):
        ops.set_state_dict(target, target_optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert_same(snapshot(target, target_optim), before, "model and optimizer after the failed load")


@pytest.mark.req("SD-9")
@pytest.mark.parametrize("strict", (True, False), ids=("strict", "nonstrict"))
def test_shape_mismatch_names_key_and_changes_nothing(impl: Any, strict: bool) -> None:
    ops = sd_ops(impl)
    source, target = zoo.build("nested", seed=0), zoo.build("nested", seed=1)
    sd, key = _break(source.state_dict(), "shape")
    got_shape, want_shape = tuple(sd[key].shape), tuple(target.state_dict()[key].shape)
    before = snapshot(target)
    with pytest.raises(RuntimeError) as info:
        ops.set_model_state_dict(target, sd, options=ops.options(strict=strict))
    message = str(info.value).replace("torch.Size([", "(").replace("])", ")")
    assert key in message, message
    assert str(got_shape) in message and str(want_shape) in message, f"both shapes should be named: {message}"
    assert_same(snapshot(target), before, "model after the failed load")


# -- SD-10: empty state dicts ------------------------------------------------------------------------


@pytest.mark.req("SD-10")
def test_empty_strict_load_is_an_error(impl: Any) -> None:
    ops = sd_ops(impl)
    model = zoo.build("mlp")
    before = snapshot(model)
    with pytest.raises(RuntimeError):
        ops.set_model_state_dict(model, {}, options=ops.options(strict=True))
    assert_same(snapshot(model), before, "model after the failed load")


@pytest.mark.req("SD-10")
def test_empty_nonstrict_load_reports_everything_missing(impl: Any) -> None:
    ops = sd_ops(impl)
    model = zoo.build("mlp")
    before = snapshot(model)
    result = ops.set_model_state_dict(model, {}, options=ops.options(strict=False))
    assert sorted(result.missing_keys) == sorted(model.state_dict())
    assert_same(snapshot(model), before, "model after an empty non-strict load")


@pytest.mark.req("SD-10")
@pytest.mark.parametrize("case", ("stateless-submodule", "all-frozen", "stateless-model"))
def test_empty_get_is_not_an_error(impl: Any, case: str) -> None:
    """A selection, or a model, that has no entries gives {}."""
    ops = sd_ops(impl)
    model = zoo.build("mlp")
    with recording_deprecations(ops) if case == "stateless-submodule" else contextlib.nullcontext():
        if case == "stateless-submodule":
            got = ops.get_model_state_dict(model, submodules={model.net[1]})  # a ReLU
        elif case == "all-frozen":
            model.requires_grad_(False)
            got = ops.get_model_state_dict(model, options=ops.options(ignore_frozen_params=True))
        else:
            got = ops.get_model_state_dict(nn.Sequential(nn.ReLU(), nn.Tanh()))
    assert got == {}


# -- SD-11: round trip --------------------------------------------------------------------------------


@pytest.mark.req("SD-11")
@pytest.mark.parametrize("flatten", (False, True), ids=("nested-osd", "flat-osd"))
@pytest.mark.parametrize("how", ("plain", "checkpoint+compile"))
@pytest.mark.parametrize("name", tuple(zoo.ZOO))
def test_round_trip(impl: Any, name: str, how: str, flatten: bool) -> None:
    """set(get(source)) into a model of another seed: equal gets, and equal after one more step."""
    ops = sd_ops(impl)
    options = ops.options(flatten_optimizer_state_dict=flatten)
    source, source_optim = trained(name, seed=0)
    target, target_optim = trained(name, seed=1)
    model_sd, optim_sd = ops.get_state_dict(wrap(source, how), source_optim, options=options)
    # A deep copy travels, as through a file: Optimizer.load_state_dict keeps the given tensors, and
    # source and target stepping one shared exp_avg would tell nothing about the round trip.
    saved = copy.deepcopy((model_sd, optim_sd))
    model_sd, optim_sd = copy.deepcopy(saved)
    ops.set_state_dict(wrap(target, how), target_optim, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    again = ops.get_state_dict(wrap(target, "plain"), target_optim, options=options)
    assert_same(again, saved, "get after set")
    batch = zoo.batch(name, seed=7)
    zoo.train_step(source, source_optim, batch)
    zoo.train_step(target, target_optim, batch)
    assert_same(target.state_dict(), source.state_dict(), "model after one more step")
    assert_same(fqn_keyed_optim(target, target_optim), fqn_keyed_optim(source, source_optim), "optimizer after one more step")


# -- SD-12, SD-13, SD-14: sharded models ------------------------------------------------------------


def _single_group_adam(model: nn.Module) -> torch.optim.Optimizer:
    # One group: FSDP1 presents flattened views, so grouping by parameter shape is not portable.
    return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01, weight_decay=0.01)


def sharded_and_oracle(
    ops: StateDictOps, dist: Any, name: str, strategy: str, steps: int = 2, seed: int = 0
) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]:
    """(sharded model, its optimizer, unwrapped oracle, its optimizer), trained identically: every
    rank sees the same batches, so the averaged gradient equals the single-process one."""
    oracle = zoo.build(name, seed=seed, device=dist.device)
    oracle_optim = _single_group_adam(oracle)
    model = ops.shard(zoo.build(name, seed=seed, device=dist.device), dist.device, strategy=strategy)
    optim = _single_group_adam(model)
    for step in range(steps):
        batch = zoo.batch(name, seed=step, device=dist.device)
        zoo.train_step(oracle, oracle_optim, batch)
        zoo.train_step(model, optim, batch)
    return model, optim, oracle, oracle_optim


def _shard_or_skip(ops: StateDictOps, dist: Any, name: str, strategy: str, **kw: Any) -> Any:
    try:
        return sharded_and_oracle(ops, dist, name, strategy, **kw)
    except Unsupported as exc:
        pytest.skip(f"sharding {strategy}: {exc}")


@pytest.mark.req("SD-12")
@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
@pytest.mark.parametrize("name", ("nested", "tied"))
def test_sharded_full_state_dict_by_strategy(dist: Any, impl: Any, name: str, strategy: str) -> None:
    ops = sd_ops(impl)
    model, optim, oracle, oracle_optim = _shard_or_skip(ops, dist, name, strategy)
    model_sd, optim_sd = ops.get_state_dict(model, optim, options=ops.options(full_state_dict=True))
    assert list(model_sd) == list(oracle.state_dict())
    assert all(not isinstance(v, DTensor) for v in model_sd.values())
    assert_same(model_sd, oracle.state_dict(), f"full model state dict ({strategy})", exact=False)
    assert_same(optim_sd, fqn_keyed_optim(oracle, oracle_optim), f"full optimizer state dict ({strategy})", exact=False)


@pytest.mark.req("SD-12")
@pytest.mark.parametrize("name", SHARDED_ZOO)
def test_sharded_full_state_dict(dist: Any, impl: Any, name: str) -> None:
    ops = sd_ops(impl)
    model, optim, oracle, oracle_optim = _shard_or_skip(ops, dist, name, "FULL_SHARD")
    model_sd, optim_sd = ops.get_state_dict(model, optim, options=ops.options(full_state_dict=True))
    assert list(model_sd) == list(oracle.state_dict())
    assert_same(model_sd, oracle.state_dict(), "full model state dict", exact=False)
    assert_same(optim_sd, fqn_keyed_optim(oracle, oracle_optim), "full optimizer state dict", exact=False)


@pytest.mark.req("SD-12")
@pytest.mark.parametrize("part", ("model", "optimizer"))
def test_sharded_full_state_dict_cpu_offload(dist: Any, impl: Any, part: str) -> None:
    """full_state_dict + cpu_offload: rank 0 holds the full dict on CPU, the other ranks {}."""
    ops = sd_ops(impl)
    model, optim, oracle, oracle_optim = _shard_or_skip(ops, dist, "nested", "FULL_SHARD")
    options = ops.options(full_state_dict=True, cpu_offload=True)
    if part == "model":
        got, expected = ops.get_model_state_dict(model, options=options), oracle.state_dict()
    else:
        got, expected = ops.get_optimizer_state_dict(model, optim, options=options), fqn_keyed_optim(oracle, oracle_optim)
    if dist.rank != 0:
        assert got == {}, f"rank {dist.rank}: with cpu_offload only rank 0 holds the full state dict"
        return
    assert_same(got, expected, f"full {part} state dict", exact=False)
    leaves = list(got.values()) if part == "model" else [t for s in got["state"].values() for t in s.values()]
    assert all(t.device.type == "cpu" for t in leaves if isinstance(t, torch.Tensor))


@pytest.mark.req("SD-4", "SD-5")
@pytest.mark.parametrize("keep", (True, False), ids=("keep-prefixes", "strip-prefixes"))
@pytest.mark.parametrize("path", ("1", "10", "1.inner"))
def test_sharded_submodule_selection(dist: Any, impl: Any, path: str, keep: bool) -> None:
    """Selecting a module of the user's model after it was sharded (inside a sharding unit)."""
    ops = sd_ops(impl)
    oracle = zoo.build("nested", seed=0, device=dist.device)
    model = zoo.build("nested", seed=0, device=dist.device)
    sub = model.get_submodule(path)  # the user's handle, taken before sharding
    try:
        sharded = ops.shard(model, dist.device, strategy="FULL_SHARD")
    except Unsupported as exc:
        pytest.skip(str(exc))
    options = ops.options(full_state_dict=True, keep_submodule_prefixes=keep)
    with recording_deprecations(ops):
        got = ops.get_model_state_dict(sharded, submodules={sub}, options=options)
    expected = {k: v for k, v in oracle.state_dict().items() if k.startswith(path + ".")}
    if not keep:
        expected = {k[len(path) + 1 :]: v for k, v in expected.items()}
    assert list(got) == list(expected)
    assert_same(got, expected, f"entries of {path!r}")


@pytest.mark.req("SD-3")
def test_sharded_ignore_frozen_params(dist: Any, impl: Any) -> None:
    ops = sd_ops(impl)
    model, _, oracle, _ = _shard_or_skip(ops, dist, "frozen", "FULL_SHARD")
    frozen = {n for n, p in oracle.named_parameters() if not p.requires_grad}
    got = ops.get_model_state_dict(model, options=ops.options(full_state_dict=True, ignore_frozen_params=True))
    assert list(got) == [k for k in oracle.state_dict() if k not in frozen]
    assert_same(got, {k: v for k, v in oracle.state_dict().items() if k not in frozen}, "trainable entries", exact=False)


@pytest.mark.req("SD-13")
@pytest.mark.parametrize("name", SHARDED_ZOO)
def test_sharded_state_dict_round_trip(dist: Any, impl: Any, name: str) -> None:
    ops = sd_ops(impl)
    model, optim, oracle, oracle_optim = _shard_or_skip(ops, dist, name, "FULL_SHARD")
    model_sd, optim_sd = ops.get_state_dict(model, optim)
    params = dict(oracle.named_parameters())
    for key, value in model_sd.items():
        if dist.world_size > 1 and key in params:
            assert isinstance(value, DTensor), f"{key}: expected a DTensor shard, got {type(value).__name__}"
    assert_same(model_sd, oracle.state_dict(), "sharded model state dict (gathered)", exact=False)

    target, target_optim, _, _ = _shard_or_skip(ops, dist, name, "FULL_SHARD", seed=1, steps=1)
    ops.set_state_dict(target, target_optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    restored = ops.get_state_dict(target, target_optim, options=ops.options(full_state_dict=True))
    assert_same(restored[0], oracle.state_dict(), "model after set of the sharded dict", exact=False)
    assert_same(restored[1], fqn_keyed_optim(oracle, oracle_optim), "optimizer after set of the sharded dict", exact=False)


@pytest.mark.req("SD-14")
@pytest.mark.parametrize("sharded", (False, True), ids=("plain", "sharded"))
@pytest.mark.parametrize("name", ("nested", "buffers"))
def test_broadcast_from_rank0(dist: Any, impl: Any, name: str, sharded: bool) -> None:
    """Rank 0 holds the oracle's full model and optimizer state; every rank ends with it."""
    ops = sd_ops(impl)
    if sharded:
        target, target_optim, _, _ = _shard_or_skip(ops, dist, name, "FULL_SHARD", seed=1, steps=1)
    else:
        target = zoo.build(name, seed=1, device=dist.device)
        target_optim = _single_group_adam(target)
        zoo.train_step(target, target_optim, zoo.batch(name, seed=5, device=dist.device))
    oracle = zoo.build(name, seed=0, device=dist.device)
    oracle_optim = _single_group_adam(oracle)
    for step in range(2):
        zoo.train_step(oracle, oracle_optim, zoo.batch(name, seed=step, device=dist.device))
    expected_model, expected_optim = oracle.state_dict(), fqn_keyed_optim(oracle, oracle_optim)

    options = ops.options(full_state_dict=True, broadcast_from_rank0=True)
    model_sd = copy.deepcopy(expected_model) if dist.rank == 0 else {}
    optim_sd = copy.deepcopy(expected_optim) if dist.rank == 0 else {}
    # Two calls, not set_state_dict: torch 2.13's set_state_dict takes an empty model dict on ranks > 0
    # for "optimizer only" and skips the model's collectives there, which hangs rank 0.
    ops.set_model_state_dict(target, model_sd, options=options)
    ops.set_optimizer_state_dict(target, target_optim, optim_sd, options=options)
    got = ops.get_state_dict(target, target_optim, options=ops.options(full_state_dict=True))
    assert_same(got[0], expected_model, f"model on rank {dist.rank} after broadcast", exact=False)
    assert_same(got[1], expected_optim, f"optimizer on rank {dist.rank} after broadcast", exact=False)


@pytest.mark.req("SD-14")
def test_broadcast_needs_full_state_dict(impl: Any) -> None:
    ops = sd_ops(impl)
    model = zoo.build("mlp")
    with pytest.raises(ValueError, match="full_state_dict"):
        ops.set_model_state_dict(model, model.state_dict(), options=ops.options(broadcast_from_rank0=True))


# -- SD-15: across implementations ------------------------------------------------------------------


@pytest.mark.req("SD-15")
@pytest.mark.parametrize("direction", ("reference-to-impl", "impl-to-reference"))
@pytest.mark.parametrize("name", ("tied", "frozen", "buffers", "nested"))
def test_cross_implementation_plain(impl: Any, reference_impl: Any, name: str, direction: str) -> None:
    ops, ref = sd_ops(impl), sd_ops(reference_impl)
    producer, consumer = (ref, ops) if direction == "reference-to-impl" else (ops, ref)
    source, source_optim = trained(name, seed=0)
    target, target_optim = trained(name, seed=1)
    model_sd, optim_sd = copy.deepcopy(producer.get_state_dict(wrap(source, "checkpoint"), source_optim))
    consumer.set_state_dict(wrap(target, "compile"), target_optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert_same(target.state_dict(), source.state_dict(), "model loaded across implementations")
    assert_same(fqn_keyed_optim(target, target_optim), fqn_keyed_optim(source, source_optim), "optimizer loaded across implementations")


@pytest.mark.req("SD-15")
@pytest.mark.parametrize("full_state_dict", (True, False), ids=("full", "sharded"))
@pytest.mark.parametrize("direction", ("reference-to-impl", "impl-to-reference"))
@pytest.mark.parametrize("name", ("nested", "buffers"))
def test_cross_implementation_sharded(dist: Any, impl: Any, name: str, direction: str, full_state_dict: bool) -> None:
    # reference_impl is a controller-side fixture; on the ranks the adapter is loaded by name.
    ops, ref = sd_ops(impl), sd_ops(load_adapter("reference"))
    producer, consumer = (ref, ops) if direction == "reference-to-impl" else (ops, ref)
    model, optim, oracle, oracle_optim = _shard_or_skip(producer, dist, name, "FULL_SHARD")
    target, target_optim, _, _ = _shard_or_skip(consumer, dist, name, "FULL_SHARD", seed=1, steps=1)
    model_sd, optim_sd = producer.get_state_dict(model, optim, options=producer.options(full_state_dict=full_state_dict))
    consumer.set_state_dict(
        target, target_optim, model_state_dict=model_sd, optim_state_dict=optim_sd,
        options=consumer.options(full_state_dict=full_state_dict),
    )
    got = consumer.get_state_dict(target, target_optim, options=consumer.options(full_state_dict=True))
    assert_same(got[0], oracle.state_dict(), "model loaded across implementations", exact=False)
    assert_same(got[1], fqn_keyed_optim(oracle, oracle_optim), "optimizer loaded across implementations", exact=False)
