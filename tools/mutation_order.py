"""A pytest plugin for :mod:`tools.mutation`: the tests that killed earlier mutants run first.

    pytest -p tools.mutation_order ...   # with MUTATION_FIRST=<file of test node ids, most telling first>

A mutant runs its section's tests with ``-x``, so its cost is the time to the first failing test. Most
mutants are caught by a handful of tests that caught others before (a broken round trip fails the
first round trip), so moving those to the front makes a killed mutant cost seconds. A survivor still
runs every test: the order changes how soon a run ends, never its verdict, since the suite's tests do
not depend on each other's order (each rank test runs on a reused pool, but starts from its own state).

Tests not named keep their collection order after the named ones; names that match no test are
ignored (the file may come from an older tree).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: The environment variable naming the file of node ids (one per line).
FIRST_ENV = "MUTATION_FIRST"


def first_tests() -> list[str]:
    """The node ids to run first, in order, from the file ``$MUTATION_FIRST`` names (none without it)."""
    named = os.environ.get(FIRST_ENV, "")
    if not named or not Path(named).is_file():
        return []
    return [line.strip() for line in Path(named).read_text(encoding="utf-8").splitlines() if line.strip()]


def ordered(nodeids: list[str], first: list[str]) -> list[int]:
    """Indices of ``nodeids`` with those in ``first`` leading, in ``first``'s order; the rest after, in
    their own order."""
    rank = {nodeid: i for i, nodeid in enumerate(first)}
    return sorted(range(len(nodeids)), key=lambda i: (rank.get(nodeids[i], len(rank)), i))


@pytest.hookimpl(trylast=True)  # after the suite's plugin has skipped, marked and dealt the items
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    first = first_tests()
    if first:
        items[:] = [items[i] for i in ordered([item.nodeid for item in items], first)]
