"""The conformance harness's per-test overhead: a reused rank pool against fresh processes per test.

The test body only does a barrier (``torch.distributed.barrier``, importable by every rank). ``pool``
runs it on a :class:`conformance.harness.pool.RankPool` that was started beforehand and stays up, as
the harness does for every test; ``fresh`` starts a pool, runs the body and stops the pool each time,
which is what torch's ``MultiProcessTestCase`` does per test (spawn ``world_size`` processes that
import torch and form a process group, run, tear down). Same code, so the ratio is the saving of
reuse alone. The harness's promise: at world size 4, ``pool`` at least 20x cheaper.
"""

from __future__ import annotations

import importlib.util
import tempfile
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from conformance.harness.worker import Task

__all__ = ["IMPLS", "WORLD_SIZE", "available", "Pools"]

IMPLS: tuple[str, ...] = ("pool", "fresh")
WORLD_SIZE = 4
_TIMEOUT_S = 300.0


def available() -> str | None:
    """None if the harness's pool can run here, else why not."""
    if importlib.util.find_spec("conformance.harness.pool") is None:
        return "conformance.harness.pool is not available in this build"
    return None


class Pools:
    """Runs the barrier body through the harness, reusing one pool or starting a fresh one per call."""

    def __init__(self, world_size: int = WORLD_SIZE) -> None:
        from conformance.harness.pool import RankPool

        self.world_size = world_size
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-pool-")
        self._reused = RankPool(world_size, "gloo")

    def _task(self) -> Task:
        import sys

        from conformance.harness.worker import Task

        return Task(module=dist.barrier.__module__, qualname=dist.barrier.__qualname__, args=(), kwargs={},
                    tmp_dir=self._tmp.name, sys_path=tuple(sys.path))

    @staticmethod
    def _check(run: object, what: str) -> None:
        outcomes = getattr(run, "outcomes", {})
        bad = {rank: o.error for rank, o in outcomes.items() if o.status != "ok"}
        if bad or not getattr(run, "healthy", False):
            raise RuntimeError(f"{what}: the barrier body did not pass on every rank: {bad or run}")

    def start(self) -> None:
        """Start the reused pool (not part of any timing)."""
        self._reused.start()

    def run_pool(self) -> None:
        """One test on the reused pool."""
        self._check(self._reused.run(self._task(), _TIMEOUT_S), "pool")

    def run_fresh(self) -> None:
        """One test on fresh processes: start, run, stop."""
        from conformance.harness.pool import RankPool

        fresh = RankPool(self.world_size, "gloo")
        try:
            fresh.start()
            self._check(fresh.run(self._task(), _TIMEOUT_S), "fresh")
        finally:
            fresh.stop()

    def close(self) -> None:
        self._reused.stop()
        self._tmp.cleanup()
