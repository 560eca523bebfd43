"""asv: per-test overhead of the conformance harness's rank pool at world size 4.

A test whose body only does a barrier, on the reused pool and on fresh processes per test (as torch's
MultiProcessTestCase does). Target: ``track_pool_speedup`` >= 20.
"""

from __future__ import annotations

import timeit

from bench.workloads import pool


def _skip_unavailable() -> None:
    reason = pool.available()
    if reason is not None:
        raise NotImplementedError(reason)


class PoolOverhead:
    """Seconds per test: ``pool`` (reused) or ``fresh`` (spawned for the test)."""

    params = (list(pool.IMPLS),)
    param_names = ["impl"]
    number = 1
    repeat = (2, 5, 30.0)
    warmup_time = 0.0
    processes = 1
    timeout = 900

    def setup(self, impl: str) -> None:
        _skip_unavailable()
        self.pools = pool.Pools()
        if impl == "pool":
            self.pools.start()
            self.pools.run_pool()  # the first task on a pool imports the harness on the ranks: not per-test
        self.run = self.pools.run_pool if impl == "pool" else self.pools.run_fresh

    def teardown(self, impl: str) -> None:
        self.pools.close()

    def time_barrier_test(self, impl: str) -> None:
        self.run()


class PoolSpeedup:
    """Fresh processes per test / reused pool, at world size 4 (how many times cheaper the pool is)."""

    timeout = 900
    processes = 1

    def setup(self) -> None:
        _skip_unavailable()
        self.pools = pool.Pools()
        self.pools.start()
        self.pools.run_pool()

    def teardown(self) -> None:
        self.pools.close()

    def track_pool_speedup(self) -> float:
        reused = min(timeit.repeat(self.pools.run_pool, number=1, repeat=10))
        fresh = min(timeit.repeat(self.pools.run_fresh, number=1, repeat=2))
        return fresh / reused

    track_pool_speedup.unit = "ratio"  # type: ignore[attr-defined]
