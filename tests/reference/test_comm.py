"""``reference.comm``, the one communication layer of the sharded reference, and every collective path
of the reference that goes through it: when only one rank's input is bad, every rank raises the same
error (type and message), promptly, and changes nothing. Each multi-rank case breaks the input of one
rank only (the coordinator where only the coordinator's input is read, else the last rank); a rank
left waiting in a collective is cut by the rank timeout and fails the test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from conformance import models
from conformance.asserts import assert_same_error_on_every_rank, assert_unchanged, raised, snapshot
from reference import comm
from reference.fsdp import FullyShardedDataParallel, load_sharded_state_dict, optim_state_dict, sharded_state_dict
from reference.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

PROMPTLY_S = 30


# -- the layer itself, without a group ------------------------------------------------------------------


class _Local(Exception):
    pass


def test_agree_without_group_is_the_step() -> None:
    """With no group, agreement is the local step: its value, or its own exception object."""
    assert comm.agree(None, lambda: 3) == 3
    assert comm.gather_agreed(None, lambda: 3) == [3]
    assert comm.broadcast_from_coordinator(None, lambda: 3) == 3
    error = _Local("bad input 'x'")

    def fail() -> None:
        raise error

    for fn in (comm.agree, comm.gather_agreed, comm.broadcast_from_coordinator):
        assert raised(lambda: fn(None, fail)) is error, fn.__name__


def test_failure_of_an_unpicklable_exception_type_travels_as_runtime_error() -> None:
    """An exception class that cannot be sent by reference (defined in a function) is sent as a
    RuntimeError naming the class, so that every rank can build the same error."""

    class Inner(Exception):
        pass

    failure = comm.LOWEST_FAILING_RANK.record(Inner("bad"))
    assert failure == comm.Failure(RuntimeError, "Inner: bad"), failure
    assert comm.LOWEST_FAILING_RANK.record(ValueError("bad")) == comm.Failure(ValueError, "bad")


# -- every collective path of the reference, one rank's input bad ---------------------------------------


def _sharded(dist: Any, name: str = "nested", seed: int = 0) -> tuple[FullyShardedDataParallel, torch.optim.Optimizer]:
    """A sharded model (nested units under a root unit) and an Adam that has stepped once."""
    model = models.build(name, seed=seed, device=dist.device)
    wrapped = FullyShardedDataParallel(
        model, auto_wrap_policy=lambda m: m is getattr(model, "1", None), device_id=dist.device, use_orig_params=True
    )
    optim = torch.optim.Adam(wrapped.parameters(), lr=0.01)
    models.loss(wrapped(models.batch(name, device=dist.device))).backward()
    optim.step()
    optim.zero_grad()
    return wrapped, optim


def _one_rank_fails(dist: Any, bad_rank: int, call: Callable[[bool], Any], error: type[BaseException], what: str,
                    **unchanged: Any) -> BaseException:
    """``call(bad)`` on every rank, ``bad`` only on ``bad_rank``: every rank raises the same ``error``
    and ``unchanged`` objects are as they were."""
    if dist.world_size == 1:
        pytest.skip("at world size 1 the one-rank case is the every-rank case")
    before = snapshot(**unchanged)
    exc = raised(lambda: call(dist.rank == bad_rank))
    assert_same_error_on_every_rank(dist, exc, what=what)
    if not isinstance(exc, error):
        pytest.fail(f"{what}: raised {type(exc).__name__}: {exc}, expected {error.__name__} (rank {dist.rank})")
    assert f"rank {bad_rank}" in str(exc), f"{what}: the error does not name rank {bad_rank}: {exc}"
    assert_unchanged(before, where=f"rank {dist.rank}", **unchanged)
    return exc


@pytest.mark.req("SD-14")
@pytest.mark.rank_timeout(PROMPTLY_S)
@pytest.mark.parametrize("what", ["model", "optim"])
def test_broadcast_of_a_dtensor_fails_on_every_rank(dist: Any, what: str) -> None:
    """broadcast_from_rank0 with a DTensor in rank 0's state dict (a sharded dict where a full one is
    needed): rank 0 cannot send it, and every rank raises the same TypeError before anything moves."""
    model, optim = _sharded(dist)
    sharded_model = get_model_state_dict(model)
    sharded_optim = get_optimizer_state_dict(model, optim)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

    def call(bad: bool) -> Any:
        if what == "model":
            return set_model_state_dict(model, sharded_model if bad else {}, options=options)
        return set_optimizer_state_dict(model, optim, sharded_optim if bad else {}, options=options)

    exc = _one_rank_fails(dist, 0, call, TypeError, f"broadcast of a sharded {what} state dict", model=model, optim=optim)
    assert "DTensor" in str(exc), exc


@pytest.mark.req("SD-4")
@pytest.mark.rank_timeout(PROMPTLY_S)
@pytest.mark.parametrize("what", ["model", "optim"])
def test_get_with_a_foreign_submodule_on_one_rank(dist: Any, what: str) -> None:
    """A get on a sharded model whose ``submodules`` holds a module outside the model on one rank only:
    every rank raises the same ValueError (the others must not go on into the gathers)."""
    model, optim = _sharded(dist)
    inner = model.module

    def call(bad: bool) -> Any:
        chosen: set[nn.Module] = {nn.Linear(1, 1)} if bad else {inner}
        if what == "model":
            return get_model_state_dict(model, submodules=chosen)
        return get_optimizer_state_dict(model, optim, submodules=chosen)

    _one_rank_fails(dist, dist.world_size - 1, call, ValueError, f"get_{what}_state_dict with a foreign submodule")


@pytest.mark.req("OS-3")
@pytest.mark.rank_timeout(PROMPTLY_S)
@pytest.mark.parametrize("kind", ["foreign-param", "state-shape"])
def test_fsdp_optim_state_dict_with_a_bad_optimizer_on_one_rank(dist: Any, kind: str) -> None:
    """FullyShardedDataParallel's optim_state_dict when one rank's optimizer holds a parameter that is
    not the model's, or a positional state of the wrong local shape: every rank raises the same error
    naming it, before the gathers, and no optimizer changes."""
    model, optim = _sharded(dist)
    if dist.rank == dist.world_size - 1:
        if kind == "foreign-param":
            optim.add_param_group({"params": [nn.Parameter(torch.zeros(2, device=dist.device))]})
        else:
            param = next(p for p in model.parameters() if p.numel() > 0)
            optim.state[param]["exp_avg"] = torch.zeros(param.numel() + 1, device=dist.device)
    error = ValueError if kind == "foreign-param" else RuntimeError
    exc = _one_rank_fails(dist, dist.world_size - 1, lambda bad: optim_state_dict(model, optim), error,
                          f"optim_state_dict with a {kind} on one rank", optim=optim)
    assert ("not a parameter of the model" if kind == "foreign-param" else "exp_avg") in str(exc), exc


@pytest.mark.req("OS-19")
@pytest.mark.rank_timeout(PROMPTLY_S)
def test_load_sharded_state_dict_with_a_dtensor_on_one_rank_only(dist: Any) -> None:
    """load_sharded_state_dict (strict=False) where one rank passes a full tensor for an entry that is a
    DTensor on the others: the gathers would not pair up, so every rank raises the same ValueError
    naming the entry, and no model changes."""
    model, _ = _sharded(dist)
    state = sharded_state_dict(model)
    key = next(k for k, v in state.items() if hasattr(v, "full_tensor"))
    full = state[key].full_tensor()  # collective: on every rank

    def call(bad: bool) -> Any:
        given = dict(state)
        if bad:
            given[key] = full
        return load_sharded_state_dict(model, given, strict=False)

    exc = _one_rank_fails(dist, dist.world_size - 1, call, ValueError, "load_sharded_state_dict", model=model)
    assert repr(key) in str(exc), exc


@pytest.mark.req("OS-17")
@pytest.mark.rank_timeout(PROMPTLY_S)
def test_construction_with_an_unknown_policy_type_on_one_rank(dist: Any) -> None:
    """Any exception of a unit's construction checks is agreed on, not only ValueError: an
    ``auto_wrap_policy`` of the wrong type on one rank only is the same TypeError on every rank."""
    model = models.build("nested", device=dist.device)
    not_a_policy: Any = [1]  # the wrong type on purpose: the error is what this test checks

    def call(bad: bool) -> Any:
        return FullyShardedDataParallel(model, auto_wrap_policy=not_a_policy if bad else None, device_id=dist.device)

    exc = _one_rank_fails(dist, dist.world_size - 1, call, TypeError, "construction", model=model)
    assert "auto_wrap_policy" in str(exc), exc
