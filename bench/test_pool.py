"""pytest-benchmark: per-test overhead of the harness's rank pool at world size 4 vs fresh processes
(see bench.workloads.pool)."""

from __future__ import annotations

import pytest

from bench import config
from bench.workloads import pool


@pytest.mark.parametrize("impl", pool.IMPLS)
def test_barrier_test_overhead(benchmark, impl: str) -> None:
    reason = pool.available()
    if reason is not None:
        pytest.skip(reason)
    pools = pool.Pools()
    try:
        if impl == "pool":
            pools.start()
            pools.run_pool()  # the first task imports the harness on the ranks: not a per-test cost
        benchmark.group = f"harness per-test overhead ws{pool.WORLD_SIZE}"
        benchmark.extra_info.update(impl=impl)
        rounds = 1 if config.QUICK else 20 if impl == "pool" else 3
        benchmark.pedantic(pools.run_pool if impl == "pool" else pools.run_fresh, rounds=rounds, iterations=1)
    finally:
        pools.close()
