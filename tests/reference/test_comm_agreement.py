"""Rank tests of the reference's failure agreement (``reference.comm``'s agreement functions):
the rule that makes a step failing on some ranks one error on every rank, of one type, with one
message that names the rank it came from."""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import pytest
import torch.distributed

from conformance.asserts import raised
from reference import comm
from reference.checkpoint.collective import Collective
from reference.checkpoint.errors import StateDictError


class _TwoPartError(Exception):
    """An exception class (importable, so it pickles) whose constructor takes no single message."""

    def __init__(self, key: str, code: int) -> None:
        super().__init__(f"{key} failed with code {code}")


def _fail(error: BaseException | None, value: Any = None) -> Any:
    if error is not None:
        raise error
    return value


def test_gather_agreed_returns_every_ranks_result_in_rank_order(dist: Any) -> None:
    assert comm.gather_agreed(dist.group, lambda: dist.rank * 10) == [r * 10 for r in range(dist.world_size)]
    assert comm.agree(dist.group, lambda: dist.rank * 10) == dist.rank * 10


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("how", ["agree", "gather_agreed"])
def test_the_lowest_failing_ranks_error_is_raised_on_every_rank(dist: Any, how: str) -> None:
    """Ranks 0 and 1 fail differently, any others not at all: every rank raises rank 0's error type,
    its message naming rank 0 and the count of other failing ranks; the local error is the cause."""
    error = {0: ValueError("key 'a.weight' is bad"), 1: KeyError("b.bias")}.get(dist.rank)
    exc = raised(lambda: getattr(comm, how)(dist.group, lambda: _fail(error, dist.rank)))
    expected = f"key 'a.weight' is bad (raised on rank 0 of {dist.world_size} and 1 other rank(s); every rank raises it)"
    assert type(exc) is ValueError and str(exc) == expected, f"rank {dist.rank}: {exc!r}"
    assert exc.__cause__ is error, f"rank {dist.rank}: the cause is {exc.__cause__!r}, expected this rank's own error {error!r}"


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(30)
def test_an_error_type_that_takes_no_single_message_is_a_runtime_error_naming_it(dist: Any) -> None:
    """The last rank's error cannot be rebuilt from one message: every rank raises RuntimeError with
    its class name and message."""
    last = dist.world_size - 1
    error = _TwoPartError("net.0.weight", 7) if dist.rank == last else None
    exc = raised(lambda: comm.agree(dist.group, lambda: _fail(error)))
    expected = f"_TwoPartError: net.0.weight failed with code 7 (raised on rank {last} of {dist.world_size}; every rank raises it)"
    assert type(exc) is RuntimeError and str(exc) == expected, f"rank {dist.rank}: {exc!r}"


def _gather_decide(how: str, group: Any, local: Any, decide: Any = None) -> Any:
    """``comm.gather_decide_scatter`` (default decision: ``10 * rank`` for each rank) or
    ``comm.gather_decide_broadcast`` (default decision: the results as gathered)."""
    if how == "gather_decide_scatter":
        return comm.gather_decide_scatter(group, local, decide or (lambda rs: [10 * r for r in range(len(rs))]))
    return comm.gather_decide_broadcast(group, local, decide or (lambda rs: list(rs)))


@pytest.mark.parametrize("how", ["gather_decide_scatter", "gather_decide_broadcast"])
def test_gather_decide_gives_each_rank_the_coordinators_decision(dist: Any, how: str) -> None:
    seen: list[list[int]] = []

    def decide(results: list[int]) -> list[int]:
        seen.append(results)
        return [10 * r for r in range(len(results))] if how == "gather_decide_scatter" else results

    got = _gather_decide(how, dist.group, lambda: dist.rank + 100, decide)
    every = [r + 100 for r in range(dist.world_size)]
    assert seen == ([every] if dist.rank == 0 else []), f"rank {dist.rank}: decided on {seen!r}"
    expected = 10 * dist.rank if how == "gather_decide_scatter" else every
    assert got == expected, f"rank {dist.rank}: {how} returned {got!r}, expected {expected!r}"


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("how", ["gather_decide_scatter", "gather_decide_broadcast"])
def test_gather_decide_raises_a_failed_local_step_on_every_rank_without_deciding(dist: Any, how: str) -> None:
    last = dist.world_size - 1
    error = KeyError("b.bias") if dist.rank == last else None
    decided: list[Any] = []
    exc = raised(lambda: _gather_decide(how, dist.group, lambda: _fail(error, 1), decided.append))
    expected = f"'b.bias' (raised on rank {last} of {dist.world_size}; every rank raises it)"
    assert type(exc) is KeyError and exc.args == (expected,), f"rank {dist.rank}: {exc!r}"
    assert exc.__cause__ is error, f"rank {dist.rank}: the cause is {exc.__cause__!r}, expected {error!r}"
    assert not decided, f"rank {dist.rank}: decided on {decided!r} after a rank failed"


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(30)
@pytest.mark.parametrize("how", ["gather_decide_scatter", "gather_decide_broadcast"])
def test_gather_decide_raises_a_failed_decision_as_the_coordinators(dist: Any, how: str) -> None:
    error = ValueError("plans disagree")

    def decide(results: list[Any]) -> Any:
        raise error

    exc = raised(lambda: _gather_decide(how, dist.group, lambda: dist.rank, decide))
    expected = f"plans disagree (raised on rank 0 of {dist.world_size}; every rank raises it)"
    assert type(exc) is ValueError and str(exc) == expected, f"rank {dist.rank}: {exc!r}"
    cause = error if dist.rank == 0 else None
    assert exc.__cause__ is cause, f"rank {dist.rank}: the cause is {exc.__cause__!r}, expected {cause!r}"


@pytest.mark.world_size(1)
def test_a_group_of_one_rank_sends_nothing(dist: Any) -> None:
    """In a group of one rank (and with no group) every agreement function runs its steps locally: no
    c10d call is made (nothing is pickled), results come back as they are, and a failure is
    the step's own exception object (the default policy) or the checkpoint's error naming rank 0 of 1."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a c10d call was made in a group of one rank")

    error = ValueError("bad")
    value = object()  # through pickle it would come back as another object
    with contextlib.ExitStack() as stack:
        for name in ("all_gather_object", "gather_object", "scatter_object_list", "broadcast_object_list",
                     "all_reduce", "all_gather", "gather", "scatter", "broadcast", "send", "recv"):
            stack.enter_context(mock.patch.object(torch.distributed, name, refuse))
        for group in (dist.group, None):
            assert comm.agree(group, lambda: value) is value
            assert comm.gather_agreed(group, lambda: value)[0] is value
            assert comm.broadcast_from_coordinator(group, lambda: value) is value
            assert comm.gather_decide_scatter(group, lambda: value, lambda rs: [rs[0]]) is value
            assert comm.gather_decide_broadcast(group, lambda: value, lambda rs: rs[0]) is value
            for fn in (comm.agree, comm.gather_agreed, comm.broadcast_from_coordinator):
                assert raised(lambda: fn(group, lambda: _fail(error))) is error, fn.__name__
            assert raised(lambda: comm.gather_decide_scatter(group, lambda: _fail(error), list)) is error
            assert raised(lambda: comm.gather_decide_broadcast(group, lambda: 1, lambda rs: _fail(error))) is error
        collective = Collective(dist.group, action="load from 'p'")
        assert collective.all_succeed("reading", lambda: value) is value
        assert collective.gather_decide_scatter("planning", lambda: value, lambda rs: [rs[0]]) is value
        assert collective.gather_decide_broadcast("writing", lambda: value, lambda rs: rs[0]) is value
        exc = raised(lambda: collective.all_succeed("reading", lambda: _fail(error)))
        assert isinstance(exc, StateDictError) and str(exc) == "load from 'p' failed in reading on rank 0 of 1: ValueError: bad", exc
        assert exc.__cause__ is error
