"""Rank tests of the reference's failure agreement (``reference.comm.agree`` and ``gather_agreed``):
the rule that makes a step failing on some ranks one error on every rank, of one type, with one
message that names the rank it came from."""

from __future__ import annotations

from typing import Any

import pytest

from conformance.asserts import raised
from reference import comm


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
