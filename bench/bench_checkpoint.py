"""asv: save, load and load-into-meta of model + Adam state: the reference, torch, the
implementations under test (``BENCH_IMPL``) and the raw limit, each through its adapter's ``CheckpointOps``.

All figures of the grid (impl x size x world size x layout) are measured once, by one shared
``setup_cache``, in one run: a rank group per world size measures every implementation back to back
on the same state dicts, so the ratios compare like with like. The classes below only report:
throughput (MB/s), the load into meta (seconds, and peak memory as a multiple of the bytes loaded),
and the speed of the reference and of each implementation under test relative to torch and to raw
(``*_speedup``, >= 1 means at least as fast).

``BENCH_QUICK=1`` restricts the grid to the smallest size; ``BENCH_DEVICE=cuda`` measures state dicts
on the GPUs (world size 4 too where 4 are visible), and without CUDA every figure is a skip saying why
(see ``bench/config.py``).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from bench import config
from bench import impls as _impls
from bench.ranks import measuring_group
from bench.workloads import checkpoint as ck

SIZES: list[int] = config.checkpoint_sizes()
SIZE_LABELS: list[str] = [config.size_label(n) for n in SIZES]
DEVICE: str = config.DEVICE
# Quick mode (asv --quick, make test) measures the smallest world size only: bench/test_checkpoint.py
# runs every implementation's save, load and meta load at both.
WORLD_SIZES: list[int] = config.grid(config.checkpoint_world_sizes(DEVICE))
LAYOUTS: list[str] = list(ck.LAYOUTS)
IMPLS: list[str] = ck.impls()
#: Whose speed ``CheckpointSpeedup`` reports: the reference and the implementations under test.
SUBJECTS: list[str] = [impl for impl in IMPLS if _impls.is_adapter(impl) and impl not in ck.UPSTREAM]

Key = tuple[str, str, int, str]  # (impl, size label, world size, layout)


def _repeats(nbytes: int) -> int:
    # Best of several: on a shared machine one sample of a save can be far off the others
    # (docs/benchmark-results.md, "Why the benchmarks are shaped so").
    # Quick mode (make test) runs each benchmark once to catch a broken one, not to measure it.
    if config.QUICK:
        return 1
    return 3 if nbytes <= 512 * config.MiB else 2


def _measure_grid(self: Any) -> dict[Key, dict[str, Any]]:
    """Measure every available implementation over the whole grid: {key: figures as a dict}."""
    grid: dict[Key, dict[str, Any]] = {}
    impls = [impl for impl in IMPLS if ck.available(impl) is None]
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        for world_size in WORLD_SIZES:
            if config.device_unavailable(DEVICE, world_size) is not None:
                continue  # each figure's setup skips with the reason
            with measuring_group(world_size, backend=config.backend(DEVICE)) as group:
                # Quick mode checks that every figure can be made, not the figures: its loads into meta
                # run on the same ranks instead of fresh ones per implementation and layout (a minute here).
                meta_group = group if config.QUICK else None
                for nbytes, label in zip(SIZES, SIZE_LABELS):
                    for layout in LAYOUTS:
                        for impl in impls:
                            key = (impl, label, world_size, layout)
                            try:
                                fig = ck.measure(group, impl, nbytes, layout, os.path.join(tmp, "ckpt"),
                                                 repeats=_repeats(nbytes), device=DEVICE, meta_group=meta_group)
                                grid[key] = {"save_mbps": fig.save_mbps, "load_mbps": fig.load_mbps,
                                             "meta_load_s": fig.meta_load_s, "meta_peak": fig.meta_peak_ratio,
                                             "meta_error": fig.meta_error, "error": None}
                            except Exception as exc:  # reported by the figure's benchmark, not fatal to the grid
                                grid[key] = {"error": f"{type(exc).__name__}: {exc}"}
                    group.run(ck.release)
    return grid


# A 2 GB state dict at two world sizes, four implementations, save + load + meta: minutes, not seconds.
_measure_grid.timeout = 3 * 3600  # type: ignore[attr-defined]


def _figure(grid: dict[Key, dict[str, Any]], key: Key, name: str) -> float:
    entry = grid.get(key)
    if entry is None:
        raise NotImplementedError(f"{key} was not measured")
    if entry["error"]:
        raise RuntimeError(f"{key}: {entry['error']}")
    value = entry[name]
    if value is None:
        raise RuntimeError(f"{key}: no {name} figure: {entry.get('meta_error')}")
    return float(value)


def _skip_unavailable(impl: str, world_size: int) -> None:
    reason = ck.available(impl) or config.device_unavailable(DEVICE, world_size)
    if reason is not None:
        raise NotImplementedError(reason)


class CheckpointThroughput:
    """Save and load throughput of model + Adam state, MB/s (2**20 bytes of state dict per second)."""

    params = (IMPLS, SIZE_LABELS, WORLD_SIZES, LAYOUTS)
    param_names = ["impl", "size", "world_size", "layout"]
    setup_cache = _measure_grid

    def setup(self, grid: dict, impl: str, size: str, world_size: int, layout: str) -> None:
        _skip_unavailable(impl, world_size)

    def track_save(self, grid: dict, impl: str, size: str, world_size: int, layout: str) -> float:
        return _figure(grid, (impl, size, world_size, layout), "save_mbps")

    track_save.unit = "MB/s"  # type: ignore[attr-defined]

    def track_load(self, grid: dict, impl: str, size: str, world_size: int, layout: str) -> float:
        return _figure(grid, (impl, size, world_size, layout), "load_mbps")

    track_load.unit = "MB/s"  # type: ignore[attr-defined]


class CheckpointMetaLoad:
    """Load into a state dict of meta tensors, on fresh ranks: seconds, and peak RSS growth / local bytes."""

    params = (ck.meta_impls(), SIZE_LABELS, WORLD_SIZES, LAYOUTS)
    param_names = ["impl", "size", "world_size", "layout"]
    setup_cache = _measure_grid

    def setup(self, grid: dict, impl: str, size: str, world_size: int, layout: str) -> None:
        _skip_unavailable(impl, world_size)

    def track_meta_load_time(self, grid: dict, impl: str, size: str, world_size: int, layout: str) -> float:
        return _figure(grid, (impl, size, world_size, layout), "meta_load_s")

    track_meta_load_time.unit = "seconds"  # type: ignore[attr-defined]

    def track_meta_load_peak_memory(self, grid: dict, impl: str, size: str, world_size: int, layout: str) -> float:
        """Target: below 1.2 (the loaded bytes plus 20%)."""
        return _figure(grid, (impl, size, world_size, layout), "meta_peak")

    track_meta_load_peak_memory.unit = "x bytes loaded"  # type: ignore[attr-defined]


class CheckpointSpeedup:
    """The speed of ``impl`` (the reference, or an implementation under test) relative to ``baseline`` on
    the same bytes in the same run (>= 1: as fast).

    Targets for the reference: >= 1 against torch; >= 0.9 against raw for save and load."""

    params = (SUBJECTS, ["torch", "raw"], SIZE_LABELS, WORLD_SIZES, LAYOUTS)
    param_names = ["impl", "baseline", "size", "world_size", "layout"]
    setup_cache = _measure_grid

    def setup(self, grid: dict, impl: str, baseline: str, size: str, world_size: int, layout: str) -> None:
        _skip_unavailable(impl, world_size)
        _skip_unavailable(baseline, world_size)

    def _ratio(self, grid: dict, impl: str, baseline: str, rest: tuple[str, int, str], name: str, higher_is_faster: bool) -> float:
        mine = _figure(grid, (impl, *rest), name)
        base = _figure(grid, (baseline, *rest), name)
        return mine / base if higher_is_faster else base / mine

    def track_save_speedup(self, grid: dict, impl: str, baseline: str, size: str, world_size: int, layout: str) -> float:
        return self._ratio(grid, impl, baseline, (size, world_size, layout), "save_mbps", True)

    track_save_speedup.unit = "ratio"  # type: ignore[attr-defined]

    def track_load_speedup(self, grid: dict, impl: str, baseline: str, size: str, world_size: int, layout: str) -> float:
        return self._ratio(grid, impl, baseline, (size, world_size, layout), "load_mbps", True)

    track_load_speedup.unit = "ratio"  # type: ignore[attr-defined]

    def track_meta_load_speedup(self, grid: dict, impl: str, baseline: str, size: str, world_size: int, layout: str) -> float:
        return self._ratio(grid, impl, baseline, (size, world_size, layout), "meta_load_s", False)

    track_meta_load_speedup.unit = "ratio"  # type: ignore[attr-defined]
