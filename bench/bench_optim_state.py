"""asv: full optimizer state dict of a sharded model and loading it back, world size 2: the
reference, torch (FSDP1), the implementations under test (``BENCH_IMPL``) and raw, each through its
adapter's ``ShardingOps`` and ``OptimStateOps`` (see :mod:`bench.workloads.optim_state`).

One rank group measures every implementation for every size (``setup_cache``), so the speedups compare
figures of the same run. Seconds are the slowest rank's best of a few calls.
"""

from __future__ import annotations

from typing import Any

from bench import config
from bench import impls as _impls
from bench.ranks import measuring_group
from bench.workloads import optim_state as osw

PARAMS: list[int] = config.grid(config.OPTIM_STATE_PARAMS)
IMPLS: list[str] = osw.impls()
#: Whose speed the ``*Speedup`` classes report: the reference and the implementations under test.
SUBJECTS: list[str] = [impl for impl in IMPLS if _impls.is_adapter(impl) and impl not in osw.UPSTREAM]
WORLD_SIZE = 2


def _measure_grid(self: Any) -> dict[tuple[str, int], dict[str, Any]]:
    grid: dict[tuple[str, int], dict[str, Any]] = {}
    with measuring_group(WORLD_SIZE) as group:
        for params in PARAMS:
            for impl in IMPLS:
                if osw.available(impl) is not None:
                    continue
                try:
                    per_rank = group.run(osw.osd_times, impl, params, 3 if params < 10_000 else 2)
                    grid[impl, params] = {"get": max(r[0] for r in per_rank), "load": max(r[1] for r in per_rank),
                                          "error": None}
                except Exception as exc:  # reported by the figure's benchmark
                    grid[impl, params] = {"error": f"{type(exc).__name__}: {exc}"}
    return grid


_measure_grid.timeout = 1800  # type: ignore[attr-defined]


def _figure(grid: dict, impl: str, params: int, name: str) -> float:
    entry = grid.get((impl, params))
    if entry is None:
        raise NotImplementedError(f"{impl} was not measured")
    if entry["error"]:
        raise RuntimeError(f"{impl}, {params} params: {entry['error']}")
    return float(entry[name])


def _skip_unavailable(impl: str) -> None:
    reason = osw.available(impl)
    if reason is not None:
        raise NotImplementedError(reason)


class OptimStateDict:
    """Seconds of ``optim_state_dict(model, optim)`` (raw: ``optim.state_dict()`` of the unwrapped model)."""

    params = (IMPLS, PARAMS)
    param_names = ["impl", "params"]
    setup_cache = _measure_grid

    def setup(self, grid: dict, impl: str, params: int) -> None:
        _skip_unavailable(impl)

    def track_optim_state_dict(self, grid: dict, impl: str, params: int) -> float:
        return _figure(grid, impl, params, "get")

    track_optim_state_dict.unit = "seconds"  # type: ignore[attr-defined]


class LoadOptimStateDict:
    """Seconds of ``load_optim_state_dict(model, optim, osd)`` (FSDP: ``optim_state_dict_to_load`` and
    ``optim.load_state_dict``; raw: ``optim.load_state_dict`` of the unwrapped model)."""

    params = (IMPLS, PARAMS)
    param_names = ["impl", "params"]
    setup_cache = _measure_grid

    def setup(self, grid: dict, impl: str, params: int) -> None:
        _skip_unavailable(impl)

    def track_load_optim_state_dict(self, grid: dict, impl: str, params: int) -> float:
        return _figure(grid, impl, params, "load")

    track_load_optim_state_dict.unit = "seconds"  # type: ignore[attr-defined]


class OptimStateSpeedup:
    """The speed of ``impl`` relative to ``baseline`` in the same run (>= 1: at least as fast)."""

    params = (SUBJECTS, ["torch", "raw"], PARAMS)
    param_names = ["impl", "baseline", "params"]
    setup_cache = _measure_grid

    def setup(self, grid: dict, impl: str, baseline: str, params: int) -> None:
        _skip_unavailable(impl)
        _skip_unavailable(baseline)

    def track_optim_state_dict_speedup(self, grid: dict, impl: str, baseline: str, params: int) -> float:
        return _figure(grid, baseline, params, "get") / _figure(grid, impl, params, "get")

    track_optim_state_dict_speedup.unit = "ratio"  # type: ignore[attr-defined]

    def track_load_optim_state_dict_speedup(self, grid: dict, impl: str, baseline: str, params: int) -> float:
        return _figure(grid, baseline, params, "load") / _figure(grid, impl, params, "load")

    track_load_optim_state_dict_speedup.unit = "ratio"  # type: ignore[attr-defined]
