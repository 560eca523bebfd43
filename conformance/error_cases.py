"""Where an error test puts its bad input. Every error requirement is tried twice: with the bad input
on every rank, and on one rank only (the last; the others get a good one), because the second is
where an implementation that checks locally and then enters a collective leaves the others waiting,
or raises on one rank only. Self-tests: ``tests/test_error_cases.py``."""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["WHERE", "EVERY_RANK", "ONE_RANK", "parametrize_where", "bad_input_here"]

#: The two placements, as test ids spell them.
WHERE = ("every-rank", "one-rank")
EVERY_RANK, ONE_RANK = WHERE

#: The one parametrization of a placement: ``@parametrize_where`` gives a test a ``where`` argument,
#: each of :data:`WHERE`. A table that crosses placements with cases of its own (not every case at
#: both) spells them :data:`EVERY_RANK` and :data:`ONE_RANK`.
parametrize_where = pytest.mark.parametrize("where", WHERE)


def bad_input_here(dist: Any, where: str) -> bool:
    """Whether this rank (``dist``: the test's rank context) gets the bad input for ``where``. At world
    size 1 the one-rank case is the every-rank case: it is skipped, saying so."""
    if where not in WHERE:
        raise ValueError(f"where must be one of {WHERE}, got {where!r}")
    if where == "one-rank" and dist.world_size == 1:
        pytest.skip("at world size 1 the one rank is every rank: the every-rank case covers it")
    return where == "every-rank" or dist.rank == dist.world_size - 1
