"""asv: a simulated job's planning and metadata at production world sizes (see bench.scale).

One ``setup_cache`` simulates the grid (layout x world size x implementation); the classes report:

- ``ScalePlan.track_global_plan``: the coordinator's global plan of a first save, CPU seconds;
- ``ScalePlan.track_second_global_plan``: the same for the second save of the layout (plan caches);
- ``ScalePlan.track_load_plan``: one rank's load planning from the metadata (slowest sampled rank);
- ``ScaleBytes.track_plan_bytes`` / ``track_second_plan_bytes``: what the coordinator receives, first
  and second save; ``track_metadata_bytes``: the metadata file;
- ``ScaleBalance.track_write_balance``: bytes written per rank, max over mean.

``BENCH_QUICK=1`` keeps 64 ranks.
"""

from __future__ import annotations

from typing import Any

from bench.scale import grid
from bench.scale.layouts import LAYOUTS
from bench.scale.simulate import IMPLS, simulate

LAYOUT_NAMES: list[str] = list(LAYOUTS)
WORLD_SIZES: list[int] = grid.world_sizes()
Key = tuple[str, int, str]


def _fits(layout: str, world_size: int) -> bool:
    return world_size >= LAYOUTS[layout].min_world_size and world_size * (grid.TENSORS + 4) <= grid.MAX_ITEMS


def _simulate_grid(self: Any) -> dict[Key, dict[str, float]]:
    return {
        (layout, n, impl): simulate(LAYOUTS[layout], n, grid.TENSORS, impl)
        for layout in LAYOUT_NAMES for n in WORLD_SIZES if _fits(layout, n) for impl in IMPLS
    }


_simulate_grid.timeout = 3 * 3600  # type: ignore[attr-defined]


class _ScaleFigure:
    params = (LAYOUT_NAMES, WORLD_SIZES, list(IMPLS))
    param_names = ["layout", "world_size", "impl"]
    setup_cache = _simulate_grid

    def setup(self, grid_: dict, layout: str, world_size: int, impl: str) -> None:
        if not _fits(layout, world_size):
            raise NotImplementedError(f"{layout} at {world_size} ranks: below its smallest world size or over grid.MAX_ITEMS")


class ScalePlan(_ScaleFigure):
    def track_global_plan(self, grid_: dict, layout: str, world_size: int, impl: str) -> float:
        return grid_[(layout, world_size, impl)]["global_plan_s"]

    track_global_plan.unit = "s"  # type: ignore[attr-defined]

    def track_second_global_plan(self, grid_: dict, layout: str, world_size: int, impl: str) -> float:
        return grid_[(layout, world_size, impl)]["second_global_plan_s"]

    track_second_global_plan.unit = "s"  # type: ignore[attr-defined]

    def track_load_plan(self, grid_: dict, layout: str, world_size: int, impl: str) -> float:
        return grid_[(layout, world_size, impl)]["load_plan_s"]

    track_load_plan.unit = "s"  # type: ignore[attr-defined]


class ScaleBytes(_ScaleFigure):
    def track_plan_bytes(self, grid_: dict, layout: str, world_size: int, impl: str) -> float:
        return grid_[(layout, world_size, impl)]["plan_bytes_total"]

    track_plan_bytes.unit = "bytes"  # type: ignore[attr-defined]

    def track_second_plan_bytes(self, grid_: dict, layout: str, world_size: int, impl: str) -> float:
        return grid_[(layout, world_size, impl)]["second_plan_bytes_total"]

    track_second_plan_bytes.unit = "bytes"  # type: ignore[attr-defined]

    def track_metadata_bytes(self, grid_: dict, layout: str, world_size: int, impl: str) -> float:
        return grid_[(layout, world_size, impl)]["metadata_bytes"]

    track_metadata_bytes.unit = "bytes"  # type: ignore[attr-defined]


class ScaleBalance(_ScaleFigure):
    def track_write_balance(self, grid_: dict, layout: str, world_size: int, impl: str) -> float:
        return grid_[(layout, world_size, impl)]["write_balance"]

    track_write_balance.unit = "max/mean"  # type: ignore[attr-defined]
