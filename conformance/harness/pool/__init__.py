"""The suite's own ranks: pools of rank processes the pytest process starts (:class:`PoolRunner`, the
:class:`~conformance.harness.runner.Runner` outside a launched job). Each rank runs the loop of
:func:`conformance.harness.worker.rank_main`."""

from __future__ import annotations

from conformance.harness.pool.pools import PoolRunner, RankPool

__all__ = ["PoolRunner", "RankPool"]
