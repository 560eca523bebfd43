"""What the SD tests share (conformance/test_state_dict.py, test_state_dict_options.py,
test_module_state.py, and state_dict_options_support.py): the tolerances, the optimizers a load goes
from and into, and the per-rank oracle comparison; then the set-up of test_state_dict.py's tests on
models in one process: models wrapped locally (:func:`wrap`) or sharded for submodule selection
(:func:`sd_shard`: SD-4, SD-5, SD-6), source and target pairs (:class:`Plain`: SD-1, SD-2, SD-7, SD-8,
SD-11, SD-15), the table of wrong inputs a set must refuse (:data:`ERROR_CASES`: SD-8, SD-9, SD-10,
SD-14, SD-33) and its checks, and the round trip (SD-11). The sharded models' set-up is in
``state_dict_sharded_support.py``."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from conformance import models as zoo
from conformance.adapters.base import Adapter
from conformance.adapters.sharding import ShardingPlan, child_units
from conformance.adapters.state_dict import StateDictOps
from conformance.asserts import assert_names_key, assert_same_state, bits, expected_local_chunk, fail
from conformance.compare import fqn_keyed_optim
from conformance.flat_wrapper import FlatParamsWrapper
from conformance.values import different_like, perturb_hyperparameters

__all__ = [
    "ATOL",
    "RTOL",
    "TARGET_ONLY_KEY",
    "PROMPTLY_S",
    "sd_ops",
    "add_source_extras",
    "regroup",
    "target_optimizer",
    "per_parameter",
    "localized",
    "assert_matches_oracle",
    "SHARDED_ZOO",
    "sd_shard",
    "wrap",
    "source_optimizer",
    "train",
    "make_differ",
    "Plain",
    "plain_pair",
    "assert_same_optim",
    "untouched",
    "load",
    "recording_deprecations",
    "select_keys",
    "assert_names_shapes",
    "NestedStateAdam",
    "SharedChild",
    "ErrorCase",
    "ERROR_CASES",
    "ERROR_CLAUSES",
    "break_input",
    "error_options",
    "check_error",
    "plain_error_params",
    "continue_equally",
]


#: Ranks average identical gradients; a sum over ranks may round. Only results of training are compared
#: with this tolerance; whatever a get or set only moves is compared bit for bit.
ATOL, RTOL = 1e-6, 1e-5

#: A param-group key only the target has: loading a group replaces it whole (``Optimizer.load_state_dict``),
#: so a later get must not show it (test_load_replaces_param_groups_whole).
TARGET_ONLY_KEY = "sdc_target_only"

#: Seconds a rank test that a wrong implementation can leave waiting may take: well above what torch's
#: first FSDP use in fresh rank processes takes on a loaded machine, well below the default rank timeout.
PROMPTLY_S = 30


def sd_ops(impl: Adapter) -> StateDictOps:
    """``impl``'s state_dict functions, or a skip naming what it lacks."""
    return impl.require("state_dict")


def add_source_extras(optim: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """What a real run's param groups carry beyond the defaults: ``initial_lr`` (an LR scheduler
    leaves it) and a key of the user's own. A load must carry both."""
    for index, group in enumerate(optim.param_groups):
        group["initial_lr"] = group["lr"] * 2
        group["sdc_custom"] = f"source-{index}"
    return optim


def regroup(groups: list[list[nn.Parameter]], layout: str) -> list[list[nn.Parameter]]:
    """The target's parameter groups for the source's ``groups``: in reverse order, each with its
    parameters reversed ("reversed"); or first split, each group of two or more parameters in two
    halves, then reversed ("regrouped": a load must match groups by parameter, not by position)."""
    if layout == "regrouped":
        groups = [part for g in groups for part in ((g[: len(g) // 2], g[len(g) // 2 :]) if len(g) > 1 else (g,))]
    elif layout != "reversed":
        raise ValueError(f"unknown layout {layout!r}")
    return [list(reversed(g)) for g in reversed(groups)]


def target_optimizer(groups: list[list[nn.Parameter]], layout: str, *, extra_key: bool = False) -> torch.optim.Optimizer:
    """Adam over ``regroup(groups, layout)`` whose every hyperparameter differs from the source's, with
    ``initial_lr`` and the custom key set to other values (and with ``extra_key``, a key the source lacks)."""
    optim = torch.optim.Adam([{"params": g} for g in regroup(groups, layout)])
    perturb_hyperparameters(optim)
    if extra_key:
        for group in optim.param_groups:
            group[TARGET_ONLY_KEY] = "must not survive a load"
    return optim


def per_parameter(osd: Mapping[str, Any], *, sequence_types: bool = False) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict (nested or flattened) as ``{"state.<fqn>.<name>": value,
    "param_groups.<fqn>.<key>": value}``: each parameter's state and its group's hyperparameters,
    whatever the group split. Two optimizers that hold the same state with the same hyperparameters
    for the same parameters give equal dicts (compare without order: the split decides the order).
    A hyperparameter that is a tuple is given as a list unless ``sequence_types``: whether a load keeps
    ``betas`` a tuple is checked once, by test_load_replaces_param_groups_whole."""
    if set(osd) == {"state", "param_groups"}:
        flat: dict[str, Any] = {}
        for fqn, state in osd["state"].items():
            flat.update({f"state.{fqn}.{k}": v for k, v in state.items()})
        for group in osd["param_groups"]:
            for fqn in group["params"]:
                flat.update({f"param_groups.{fqn}.{k}": v for k, v in group.items() if k != "params"})
    else:
        flat = dict(osd)  # already flattened
    if sequence_types:
        return flat
    return {k: list(v) if isinstance(v, tuple) and k.startswith("param_groups.") else v for k, v in flat.items()}


def localized(got: Any, expected: Any) -> tuple[Any, Any]:
    """``got`` and ``expected`` with each DTensor of ``got`` replaced by its local shard and the plain
    tensor at the same place of ``expected`` by the piece of it that this rank must hold
    (:func:`~conformance.asserts.expected_local_chunk` under the DTensor's placements)."""
    if isinstance(got, DTensor) and isinstance(expected, torch.Tensor) and not isinstance(expected, DTensor):
        if tuple(got.shape) != tuple(expected.shape):
            fail("DTensor: global shape differs", tuple(got.shape), tuple(expected.shape))
        coordinate = got.device_mesh.get_coordinate()
        assert coordinate is not None, "a DTensor of a mesh this rank is not in"
        piece, _ = expected_local_chunk(expected, got.placements, tuple(got.device_mesh.shape), tuple(coordinate))
        return got.to_local(), piece
    if isinstance(got, Mapping) and isinstance(expected, Mapping):
        pairs = {k: localized(got[k], expected[k]) for k in got if k in expected}
        return ({k: pairs[k][0] if k in pairs else v for k, v in got.items()},
                {k: pairs[k][1] if k in pairs else v for k, v in expected.items()})
    if isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)) and len(got) == len(expected):
        elementwise = [localized(g, e) for g, e in zip(got, expected)]
        return type(got)(p[0] for p in elementwise), type(expected)(p[1] for p in elementwise)
    return got, expected


def assert_matches_oracle(got: Any, expected: Any, what: str, *, rank: int, atol: float | None = ATOL,
                          check_order: bool = True, exact: frozenset[str] = frozenset()) -> None:
    """Per-rank truth: ``got`` (plain tensors, or DTensors of the oracle's global shapes) equals the
    oracle's full values ``expected``; a DTensor's local shard is compared with the piece of the oracle's
    value this rank must hold, never gathered. Within ``atol`` for trained values, bit for bit for the
    top-level keys in ``exact`` (what training did not touch: a get only moves it)."""
    __tracebackhide__ = True
    local_got, local_expected = localized(got, expected)
    assert_same_state(local_got, local_expected, what=what, where=f"rank {rank}", atol=atol,
                      rtol=RTOL if atol is not None else 0.0, check_order=check_order)
    for key in sorted(exact & set(local_got) & set(local_expected)):
        assert_same_state(local_got[key], local_expected[key], what=f"{what} (untouched by training: bit for bit)",
                          where=f"rank {rank}, [{key!r}]")


# -- test_state_dict.py: models, wrappers, source and target -------------------------------------------


#: Zoo models that the sharded tests use (``groups`` adds nothing to the SD section).
SHARDED_ZOO = ("mlp", "tied", "frozen", "buffers", "nested", "tiny", "dtypes")


def sd_shard(impl: Adapter, model: nn.Module, device: torch.device, strategy: str = "FULL_SHARD") -> nn.Module:
    """``model`` sharded by ``impl`` as the SD tests shard: ``strategy``, each parameter-holding child
    a unit (:func:`child_units`), the implementation's own ``use_orig_params``."""
    return impl.require("sharding").shard(model, ShardingPlan(strategy=strategy, units=child_units(model), device=device))


def wrap(model: nn.Module, how: str) -> nn.Module:
    """``model`` inside the wrappers named in ``how`` ("checkpoint+compile+ddp"), innermost first
    (fpw, checkpoint, compile, ddp).
    Activation checkpointing wraps each direct child; the returned model shares ``model``'s modules."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    parts = set(how.split("+")) - {"plain"}
    if "fpw" in parts:
        model = FlatParamsWrapper(model, [p for p in model.parameters() if p.requires_grad])
    if "checkpoint" in parts:
        for name, child in list(model.named_children()):
            setattr(model, name, checkpoint_wrapper(child))
    if "compile" in parts:
        compiled = torch.compile(model)  # compiles lazily, on the first forward: the tests never run one
        assert isinstance(compiled, nn.Module)  # an OptimizedModule; torch.compile's stubs say a callable
        model = compiled
    if "ddp" in parts:
        model = nn.parallel.DistributedDataParallel(model)
    return model


def source_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Adam over the zoo's two param groups (different lr and weight decay), with the source extras."""
    return add_source_extras(torch.optim.Adam(zoo.param_groups(model)))


def train(model: nn.Module, optim: torch.optim.Optimizer, name: str, seeds: range, device: Any = "cpu") -> None:
    for seed in seeds:
        zoo.train_step(model, optim, zoo.batch(name, seed=seed, device=device))


@torch.no_grad()
def make_differ(target: nn.Module, source: nn.Module) -> None:
    """Every state-dict entry of ``target`` set to :func:`different_like` of the source's: no element
    of the target equals the source's bitwise, so any entry a load skips shows. (Same zoo model.)"""
    target_entries = target.state_dict(keep_vars=True)
    source_entries = source.state_dict()
    assert list(target_entries) == list(source_entries), "make_differ needs two models of one zoo entry"
    for key, value in target_entries.items():
        value.copy_(different_like(source_entries[key]))


@dataclass
class Plain:
    """A trained source and a target that differs from it in everything a load must change."""

    source: nn.Module
    source_optim: torch.optim.Optimizer
    target: nn.Module
    target_optim: torch.optim.Optimizer


def plain_pair(name: str, layout: str = "reversed", device: Any = "cpu", *, extra_key: bool = False) -> Plain:
    """Source: zoo ``name`` (seed 0), Adam in the zoo's two groups with the source extras, two steps.
    Target: seed 1, perturbed Adam in ``layout``, one step on another batch (its ``step`` and moments
    differ), then every model entry made bitwise different from the source's."""
    source = zoo.build(name, seed=0, device=device)
    source_optim = source_optimizer(source)
    train(source, source_optim, name, range(2), device)
    target = zoo.build(name, seed=1, device=device)
    target_optim = target_optimizer([g["params"] for g in zoo.param_groups(target)], layout, extra_key=extra_key)
    train(target, target_optim, name, range(5, 6), device)
    make_differ(target, source)
    return Plain(source, source_optim, target, target_optim)


def assert_same_optim(got: Mapping[str, Any], expected: Mapping[str, Any], what: str, *, atol: float | None = None,
                      where: str = "", sequence_types: bool = False) -> None:
    """Same state and hyperparameters per parameter (:func:`per_parameter`), bitwise unless ``atol``."""
    __tracebackhide__ = True
    assert_same_state(per_parameter(got, sequence_types=sequence_types),
                      per_parameter(expected, sequence_types=sequence_types), what=what, where=where,
                      check_order=False, atol=atol, rtol=RTOL if atol is not None else 0.0)


def untouched(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]) -> frozenset[str]:
    """The keys whose values training left bit for bit as they were."""
    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))

    return frozenset(k for k in before if k in after and same(after[k], before[k]))


def load(ops: StateDictOps, api: str, model: nn.Module, optim: torch.optim.Optimizer, model_sd: Any, optim_sd: Any,
         options: Any) -> Any:
    """Load model and optimizer state with one ``set_state_dict`` ("set_state_dict") or with
    ``set_model_state_dict`` then ``set_optimizer_state_dict`` ("separate")."""
    if api == "set_state_dict":
        return ops.set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    if api != "separate":
        raise ValueError(f"unknown api {api!r}")
    result = ops.set_model_state_dict(model, model_sd, options=options)
    ops.set_optimizer_state_dict(model, optim, optim_sd, options=options)
    return result


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


def _shape_text(message: str) -> str:
    return message.replace("torch.Size([", "(").replace("])", ")")


def assert_names_shapes(message: str, got_shape: tuple[int, ...], want_shape: tuple[int, ...]) -> None:
    """SD-9: the message names both shapes (as tuples or ``torch.Size``)."""
    __tracebackhide__ = True
    text = _shape_text(message)
    for shape in (got_shape, want_shape):
        if str(shape) not in text:
            fail("the size-mismatch message does not name both shapes", message, f"{got_shape} and {want_shape}")


class NestedStateAdam(torch.optim.Adam):
    """Adam that also keeps nested per-parameter state, as optimizers with EMA or history do: a dict of
    tensors by name and a dict by int (the flattened form spells both keys as text)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state[param]
                ema = state.setdefault("ema", {"fast": torch.zeros_like(param), "slow": torch.zeros_like(param)})
                ema["fast"].lerp_(param, 0.5)
                ema["slow"].lerp_(param, 0.125)
                history = state.setdefault("history", {})
                history[len(history)] = param.detach().clone()
        return loss


class SharedChild(nn.Module):
    """``first`` and ``second`` are one module, reachable at two paths."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 2)
        self.second = self.first
        self.other = nn.Linear(2, 2)


@dataclass(frozen=True)
class ErrorCase:
    """One wrong input of a set: what is broken, the error it must raise and what the message names.

    ``part`` is the part of the input that is wrong ("model", "optim" or "options"); ``key`` the
    canonical FQN the message must name whole (None: ``needle`` must appear instead)."""

    kind: str
    req: str
    model: str
    part: str
    error: type[BaseException]
    key: str | None = None
    needle: str | None = None
    strict: bool = True

    @property
    def fqn(self) -> str:
        """``key``, for a kind whose fault sits at one key (``ValueError`` for a case without one)."""
        if self.key is None:
            raise ValueError(f"error case {self.kind!r} for {self.model!r} names no key")
        return self.key


#: The clauses an error case checks, by its requirement: the refusal (the error and what it names), and
#: that the refused set changed nothing.
ERROR_CLAUSES = {
    "SD-8": ("SD-8.a", "SD-8.b"),
    "SD-9": ("SD-9.a", "SD-9.b"),
    "SD-10": ("SD-10.a", "SD-10.b"),
    "SD-14": ("SD-14.a", "SD-14.b"),
    "SD-33": ("SD-33.a", "SD-33.b"),
    "SD-39": ("SD-39.a", "SD-39.b"),
}

ERROR_CASES = {
    case.kind: case
    for case in (
        ErrorCase("missing", "SD-8", "nested", "model", RuntimeError, key="10.inner.0.weight"),
        ErrorCase("unexpected", "SD-8", "nested", "model", RuntimeError, key="10.inner.0.extra"),
        ErrorCase("non-persistent", "SD-8", "buffers", "model", RuntimeError, key="scale"),
        ErrorCase("shape", "SD-9", "nested", "model", RuntimeError, key="10.inner.0.weight"),
        ErrorCase("shape-nonstrict", "SD-9", "nested", "model", RuntimeError, key="10.inner.0.weight", strict=False),
        ErrorCase("shape-dtensor", "SD-9", "nested", "model", RuntimeError, key="10.inner.0.weight"),
        ErrorCase("empty", "SD-10", "nested", "model", RuntimeError),
        ErrorCase("optim-missing", "SD-8", "nested", "optim", RuntimeError, key="1.proj.bias"),
        ErrorCase("optim-unexpected", "SD-8", "nested", "optim", RuntimeError, key="11.weight"),
        # Adam's state of one trainable parameter dropped, the parameter still listed in its group.
        ErrorCase("optim-state-missing", "SD-33", "nested", "optim", RuntimeError, key="1.proj.weight"),
        ErrorCase("broadcast-options", "SD-14", "nested", "options", ValueError, needle="full_state_dict"),
        # No optimizer state dict at all: its "param_groups" left out (a trainer's own dict, or part of one).
        ErrorCase("optim-malformed", "SD-39", "nested", "optim", ValueError, key="param_groups"),
    )
}


def _wrong_shape_like(value: torch.Tensor) -> torch.Tensor:
    """A tensor (a DTensor of the same layout for a DTensor) whose last dim is one longer."""
    if isinstance(value, DTensor):
        local = value.to_local()
        bad_local = torch.zeros(*local.shape[:-1], local.shape[-1] + 1, dtype=local.dtype, device=local.device)
        shape = (*value.shape[:-1], value.shape[-1] + 1)
        return DTensor.from_local(bad_local, value.device_mesh, value.placements, run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())
    return torch.zeros(*value.shape[:-1], value.shape[-1] + 1, dtype=value.dtype, device=value.device)


def break_input(case: ErrorCase, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_sd, optim_sd)`` with ``case``'s fault (copies; the inputs stay as they are)."""
    model_sd, optim_sd = dict(model_sd), {"state": dict(optim_sd["state"]), "param_groups": optim_sd["param_groups"]}
    if case.kind == "missing":
        del model_sd[case.fqn]
    elif case.kind in ("unexpected", "non-persistent"):
        model_sd[case.fqn] = torch.zeros(3, device=next(iter(model_sd.values())).device)
    elif case.kind.startswith("shape"):
        model_sd[case.fqn] = _wrong_shape_like(model_sd[case.fqn])
    elif case.kind == "empty":
        model_sd = {}
    elif case.kind == "optim-state-missing":
        # Listed in its group, no state: Adam keeps state for it, so the dict lacks its moments (SD-33).
        del optim_sd["state"][case.fqn]
    elif case.kind == "optim-missing":
        # A parameter the saved dict does not list at all.
        optim_sd["state"].pop(case.key, None)
        optim_sd["param_groups"] = [{**g, "params": [p for p in g["params"] if p != case.key]} for g in optim_sd["param_groups"]]
    elif case.kind == "optim-unexpected":
        optim_sd["state"][case.key] = copy.deepcopy(next(iter(optim_sd["state"].values())))
    elif case.kind == "optim-malformed":
        optim_sd = {"state": optim_sd["state"]}
    elif case.kind != "broadcast-options":
        raise ValueError(case.kind)
    return model_sd, optim_sd


def error_options(ops: StateDictOps, case: ErrorCase, bad: bool, *, mutate: bool = False, **fields: Any) -> Any:
    """The options of a load of ``case`` on a rank whose input is ``bad`` (or not). For
    "broadcast-options" every rank loads with ``full_state_dict`` and ``broadcast_from_rank0``, except
    that a bad rank lacks ``full_state_dict``: its options are built without it (the implementation may
    refuse them at construction), or with ``mutate`` built valid and then changed (the dataclass is
    mutable; only a check in the call sees that, and in the one-rank case the call on every rank must
    fail alike)."""
    if case.kind != "broadcast-options":
        return ops.options(strict=case.strict, **fields)
    fields = {**fields, "full_state_dict": True, "broadcast_from_rank0": True}
    if not bad:
        return ops.options(strict=case.strict, **fields)
    if not mutate:
        return ops.options(strict=case.strict, **{**fields, "full_state_dict": False})
    options = ops.options(strict=case.strict, **fields)
    options.full_state_dict = False
    return options


def _names(message: str, key: str) -> bool:
    try:
        assert_names_key(message, key)
    except pytest.fail.Exception:
        return False
    return True


def check_error(case: ErrorCase, exc: BaseException | None, model_sd: Mapping[str, Any], expected_keys: list[str],
                where: str = "") -> None:
    """``exc`` is ``case``'s error type and its message names what ``case`` says (for "empty": one of
    ``expected_keys``; for a shape mismatch: both shapes)."""
    __tracebackhide__ = True
    if exc is None:
        fail(f"{case.kind}: no error raised", "a normal return", case.error.__name__, where)
    if not isinstance(exc, case.error):
        fail(f"{case.kind}: wrong exception type", f"{type(exc).__name__}: {exc}", case.error.__name__, where)
    message = str(exc)
    if case.key is not None:
        assert_names_key(message, case.key, what=f"{case.kind}: {type(exc).__name__} message", where=where)
    if case.needle is not None and case.needle not in message:
        fail(f"{case.kind}: the message lacks {case.needle!r}", message, f"a message naming {case.needle!r}", where)
    if case.kind == "empty" and not any(_names(message, k) for k in expected_keys):
        fail("empty: the message names no entry of the model", message, f"one of {expected_keys}", where)
    if case.kind.startswith("shape"):
        shape = tuple(model_sd[case.fqn].shape)
        assert_names_shapes(message, (*shape[:-1], shape[-1] + 1), shape)


def plain_error_params(req_marks: Mapping[str, Any]) -> list[Any]:
    params = []
    for kind, case in ERROR_CASES.items():
        if kind == "shape-dtensor":
            continue  # a sharded model's case
        for api in ("set_state_dict", "single"):
            if kind == "empty" and api == "set_state_dict":
                continue  # an empty model dict in set_state_dict means "optimizer only", not an error
            for how in ("plain", "checkpoint+compile"):
                params.append(pytest.param(kind, api, how, id=f"{kind}-{api}-{how}", marks=req_marks[case.req]))
    return params


# -- SD-11: round trip --------------------------------------------------------------------------------


def continue_equally(pair: Plain, name: str, device: Any = "cpu") -> None:
    """One more step of source and target on one batch leaves them equal, bit for bit."""
    __tracebackhide__ = True
    batch = zoo.batch(name, seed=7, device=device)
    zoo.train_step(pair.source, pair.source_optim, batch)
    zoo.train_step(pair.target, pair.target_optim, batch)
    assert_same_state(pair.target.state_dict(), pair.source.state_dict(), what="model after one more step")
    assert_same_optim(fqn_keyed_optim(pair.target, pair.target_optim), fqn_keyed_optim(pair.source, pair.source_optim),
                      "optimizer after one more step")
