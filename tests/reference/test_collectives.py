"""Rank tests of the reference's failure agreement (``reference._collectives.agree``): the layer that
makes a check failing on one rank an error on every rank, with one type and one message."""

from __future__ import annotations

from typing import Any

import pytest

from conformance.asserts import raised
from reference import _collectives as C


class _TwoPartError(Exception):
    """An exception class whose constructor cannot be called with one message."""

    def __init__(self, key: str, code: int) -> None:
        super().__init__(f"{key} failed with code {code}")


def test_agree_returns_every_ranks_value_in_rank_order(dist: Any) -> None:
    assert C.agree(None, dist.rank * 10, dist.group) == [r * 10 for r in range(dist.world_size)]


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(30)
def test_the_lowest_failing_ranks_error_is_raised_on_every_rank(dist: Any) -> None:
    """Ranks 0 and 1 fail differently, the others not at all: every rank raises rank 0's error."""
    error = {0: ValueError("rank 0's key 'a.weight'"), 1: KeyError("b.bias")}.get(dist.rank)
    exc = raised(lambda: C.agree(error, dist.rank, dist.group))
    assert type(exc) is ValueError and str(exc) == "rank 0's key 'a.weight'", f"rank {dist.rank}: {exc!r}"
    assert exc is error if dist.rank == 0 else exc.__cause__ is error, f"rank {dist.rank}: the local error is the cause"


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(30)
def test_an_error_type_that_takes_no_single_message_is_a_runtime_error_elsewhere(dist: Any) -> None:
    """The last rank's error cannot be rebuilt from its message: the others raise RuntimeError with
    that message; the failing rank raises its own."""
    last = dist.rank == dist.world_size - 1
    error = _TwoPartError("net.0.weight", 7) if last else None
    exc = raised(lambda: C.raise_if_any_rank_failed(error, dist.group))
    if last:
        assert exc is error, f"rank {dist.rank}: {exc!r}"
    else:
        assert type(exc) is RuntimeError and str(exc) == "net.0.weight failed with code 7", f"rank {dist.rank}: {exc!r}"
