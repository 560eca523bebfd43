"""asv: full optimizer state dict and its conversion back, reference FSDP vs torch FSDP1, world size 2 (issue 4).

One rank group measures every implementation for every size (``setup_cache``), so the speedups compare
figures of the same run. Seconds are the slowest rank's best of a few calls.
"""

from __future__ import annotations

from typing import Any

from bench import config
from bench.ranks import RankGroup
from bench.workloads import optim_state as osw

PARAMS: list[int] = config.grid(config.OPTIM_STATE_PARAMS)
IMPLS: list[str] = list(osw.IMPLS)
WORLD_SIZE = 2


def _measure_grid(self: Any) -> dict[tuple[str, int], dict[str, Any]]:
    grid: dict[tuple[str, int], dict[str, Any]] = {}
    with RankGroup(WORLD_SIZE) as group:
        for params in PARAMS:
            for impl in IMPLS:
                if osw.available(impl) is not None:
                    continue
                try:
                    per_rank = group.run(osw.osd_times, impl, params, 3 if params < 10_000 else 2)
                    load = [r[1] for r in per_rank]
                    grid[impl, params] = {"get": max(r[0] for r in per_rank),
                                          "load": None if None in load else max(load), "error": None}
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
    if entry[name] is None:
        raise NotImplementedError(f"{impl} has no {name} figure")
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


class OptimStateDictToLoad:
    """Seconds of ``optim_state_dict_to_load(model, optim, osd)`` (no raw counterpart)."""

    params = (["reference", "torch"], PARAMS)
    param_names = ["impl", "params"]
    setup_cache = _measure_grid

    def setup(self, grid: dict, impl: str, params: int) -> None:
        _skip_unavailable(impl)

    def track_optim_state_dict_to_load(self, grid: dict, impl: str, params: int) -> float:
        return _figure(grid, impl, params, "load")

    track_optim_state_dict_to_load.unit = "seconds"  # type: ignore[attr-defined]


class OptimStateSpeedup:
    """The reference's speed relative to ``baseline`` in the same run (>= 1: at least as fast)."""

    params = (["torch", "raw"], PARAMS)
    param_names = ["baseline", "params"]
    setup_cache = _measure_grid

    def setup(self, grid: dict, baseline: str, params: int) -> None:
        _skip_unavailable("reference")

    def track_optim_state_dict_speedup(self, grid: dict, baseline: str, params: int) -> float:
        return _figure(grid, baseline, params, "get") / _figure(grid, "reference", params, "get")

    track_optim_state_dict_speedup.unit = "ratio"  # type: ignore[attr-defined]


class OptimStateToLoadSpeedup:
    """The reference's ``optim_state_dict_to_load`` speed relative to torch in the same run."""

    params = (["torch"], PARAMS)
    param_names = ["baseline", "params"]
    setup_cache = _measure_grid

    def setup(self, grid: dict, baseline: str, params: int) -> None:
        _skip_unavailable("reference")

    def track_optim_state_dict_to_load_speedup(self, grid: dict, baseline: str, params: int) -> float:
        return _figure(grid, baseline, params, "load") / _figure(grid, "reference", params, "load")

    track_optim_state_dict_to_load_speedup.unit = "ratio"  # type: ignore[attr-defined]
