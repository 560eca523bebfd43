"""Self-tests of conformance/error_cases.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conformance.error_cases import EVERY_RANK, ONE_RANK, WHERE, bad_input_here, parametrize_where


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_rank_means_the_last_rank_only(world_size: int) -> None:
    bad = [bad_input_here(SimpleNamespace(rank=r, world_size=world_size), "one-rank") for r in range(world_size)]
    assert bad == [False] * (world_size - 1) + [True]
    assert all(bad_input_here(SimpleNamespace(rank=r, world_size=world_size), "every-rank") for r in range(world_size))


def test_one_rank_at_world_size_1_is_a_skip_and_a_typo_an_error() -> None:
    with pytest.raises(pytest.skip.Exception, match="every rank"):
        bad_input_here(SimpleNamespace(rank=0, world_size=1), "one-rank")
    assert bad_input_here(SimpleNamespace(rank=0, world_size=1), "every-rank")
    with pytest.raises(ValueError, match="one-ranks"):
        bad_input_here(SimpleNamespace(rank=0, world_size=2), "one-ranks")
    assert WHERE == ("every-rank", "one-rank")


def test_the_shared_parametrization_is_where_over_both_placements() -> None:
    """Every error test spells its placement alike: the argument ``where``, the ids of WHERE."""
    assert parametrize_where.args == ("where", WHERE)
    assert (EVERY_RANK, ONE_RANK) == WHERE
