"""pytest-benchmark runs of the shared workloads (``make bench``), and their quick mode (``make test``).

Under ``--benchmark-disable`` (what ``make test`` passes) or ``BENCH_QUICK=1`` every grid keeps only its
smallest size and each benchmark body runs once: a broken benchmark fails CI, speed is not judged.
Rank groups (one per world size) are shared by the whole session, as the harness shares its pools.
``BENCH_IMPL`` (``make bench IMPL=...``) adds adapters to every family (see ``bench/impls.py``); one
that cannot be loaded stops the run before anything is measured.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # Before any bench module is imported: bench.config reads BENCH_QUICK once, at import.
    if config.getoption("benchmark_disable", default=False):
        os.environ["BENCH_QUICK"] = "1"
    from bench import impls

    try:
        for spec in impls.under_test():
            impls.adapter(spec)
    except ValueError as exc:
        raise pytest.UsageError(f"{impls.ENV_VAR}: {exc}") from None


@pytest.fixture(scope="session")
def rank_group() -> Iterator[Callable[[int], object]]:
    """``rank_group(world_size, backend="gloo")``: that world size's :func:`bench.ranks.shared_group`,
    started on first use (in quick mode the asv grids of ``bench/test_asv_suite.py`` use it too); closed
    when the session ends."""
    from bench.ranks import RankGroup, close_shared_groups, shared_group

    def get(world_size: int, backend: str = "gloo") -> RankGroup:
        return shared_group(world_size, backend=backend)

    yield get
    close_shared_groups()
