"""What a rank test body gets as ``dist``: :class:`RankContext` (defined in :mod:`conformance.rank_context`,
which the adapters import too; the names are re-exported here, where tests and forks find them)."""

from __future__ import annotations

from conformance.rank_context import RankContext, clear_group_caches, current, device_for_rank, hybrid_mesh_shape, per_group_cache

__all__ = ["RankContext", "current", "device_for_rank", "hybrid_mesh_shape", "per_group_cache", "clear_group_caches"]
