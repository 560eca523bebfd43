"""pytest-benchmark: the coordinator's global plan of a simulated job (see bench.scale), every layout,
reference and torch side by side (group ``scale <layout> N<world size>``); every other figure of the
simulation is in ``extra_info``. ``make test`` simulates 64 ranks; ``make bench`` 64 to 1,024
(``python -m bench.scale`` and asv: up to 16,384, as far as ``bench.scale.grid.MAX_ITEMS`` allows)."""

from __future__ import annotations

import pytest

from bench.scale import grid
from bench.scale.layouts import LAYOUTS
from bench.scale.simulate import IMPLS, simulate

CASES = [
    pytest.param(name, n, impl, id=f"{name}-N{n}-{impl}")
    for name, layout in LAYOUTS.items()
    for n in grid.world_sizes(pytest=True)
    if n >= layout.min_world_size and n * (grid.TENSORS + 4) <= grid.MAX_ITEMS
    for impl in IMPLS
]


@pytest.mark.parametrize(("layout", "world_size", "impl"), CASES)
def test_scale(benchmark, layout: str, world_size: int, impl: str) -> None:
    figures: dict[str, float] = {}

    def once() -> None:
        figures.update(simulate(LAYOUTS[layout], world_size, grid.TENSORS, impl))

    benchmark.group = f"scale {layout} N{world_size}"
    benchmark.pedantic(once, rounds=1, iterations=1)
    # The table's figure: the coordinator's global plan, CPU seconds (the rest beside it).
    benchmark.extra_info.update(impl=impl, rank_seconds=figures["global_plan_s"], **figures)
    assert figures["items"] > 0
