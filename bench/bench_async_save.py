"""asv: the stall of a save and the training step rate during its background write (SPEC's AS section).

One shared ``setup_cache`` measures the whole grid (saver x size x world size, sharded model + Adam
state) in one run, a rank group per world size, every saver back to back on the same state, so the
ratios compare like with like (see :mod:`bench.workloads.async_save`). The classes only report:

- ``AsyncStall.track_stall``: ms from the call until training may change the state;
- ``AsyncStall.track_stall_vs_sync``: that stall over the same implementation's synchronous save
  (the goal is at most 0.1);
- ``AsyncStepRate.track_step_ratio``: steps per second during the background write over steps per
  second without a save (the goal is at least 0.9 where a core is free for the writer);
- ``AsyncWrite.track_raw_over_write``: raw's write of the same bytes over the background write's time
  (1 is the machine's limit; the goal is at least 0.9).

``BENCH_QUICK=1`` keeps the smallest size and world size (make test's benchmark job: bench/test_async_save.py
runs every saver at each world size there).
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

from bench import config
from bench.ranks import measuring_group
from bench.workloads import async_save as aw
from bench.workloads import checkpoint as ck

SIZES: list[int] = config.checkpoint_sizes()
SIZE_LABELS: list[str] = [config.size_label(n) for n in SIZES]
WORLD_SIZES: list[int] = config.grid(list(config.CHECKPOINT_WORLD_SIZES))
SAVERS: list[str] = [s for s in aw.SAVERS if not s.endswith("/sync")]

Key = tuple[str, str, int]  # (saver, size label, world size)


def _measure_grid(self: Any) -> dict[Key, dict[str, Any]]:
    grid: dict[Key, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        directory = os.path.join(tmp, "ckpt")
        for world_size in WORLD_SIZES:
            with measuring_group(world_size, backend="gloo") as group:
                for nbytes, label in zip(SIZES, SIZE_LABELS):
                    group.run(ck.prepare, nbytes, "sharded", "cpu")
                    raw = min(max(group.run(ck.save_once, "raw", directory)) for _ in range(2))
                    syncs: dict[str, float] = {}
                    # Synchronous saves first: each async saver's stall is stated over its
                    # implementation's synchronous save, which must be measured by then.
                    runnable = [s for s in aw.SAVERS if aw.available(s) is None]
                    for saver in sorted(runnable, key=lambda s: not s.endswith("/sync")):
                        try:
                            fig = aw.measure(group, saver, nbytes, "sharded", directory,
                                             repeats=1 if config.QUICK else 2, warm_up=not config.QUICK)
                        except Exception as exc:  # reported by the figure's benchmark, not fatal to the grid
                            grid[(saver, label, world_size)] = {"error": f"{type(exc).__name__}: {exc}"}
                            continue
                        impl = saver.rpartition("/")[0]
                        if saver.endswith("/sync"):
                            syncs[impl] = fig.stall_s
                            continue
                        sync = syncs.get("torch" if saver == aw.TORCH_STAGER else impl)
                        grid[(saver, label, world_size)] = {
                            "error": None, "stall_ms": fig.stall_s * 1e3, "stall_vs_sync": fig.stall_s / sync if sync else None,
                            "step_ratio": fig.step_ratio, "raw_over_write": raw / fig.write_s,
                        }
                    group.run(aw.release)
    return grid


_measure_grid.timeout = 3 * 3600  # type: ignore[attr-defined]


def _figure(grid: dict[Key, dict[str, Any]], key: Key, name: str) -> float:
    """The figure ``name`` of ``key``; NaN, asv's n/a, for a figure the saver cannot have (raw's stall
    over a synchronous save: raw has none). A saver that failed raises: a broken benchmark fails."""
    entry = grid.get(key)
    if entry is None:
        raise RuntimeError(f"{key}: not measured ({aw.available(key[0]) or 'the grid has no entry'})")
    if entry["error"]:
        raise RuntimeError(f"{key}: {entry['error']}")
    return math.nan if entry[name] is None else float(entry[name])


class _AsyncFigure:
    params = (SAVERS, SIZE_LABELS, WORLD_SIZES)
    param_names = ["saver", "size", "world_size"]
    setup_cache = _measure_grid

    def setup(self, grid: dict, saver: str, size: str, world_size: int) -> None:
        reason = aw.available(saver)
        if reason is not None:
            raise NotImplementedError(reason)


class AsyncStall(_AsyncFigure):
    """ms from an async save's call until training may change the state; and over the synchronous save."""

    def track_stall(self, grid: dict, saver: str, size: str, world_size: int) -> float:
        return _figure(grid, (saver, size, world_size), "stall_ms")

    track_stall.unit = "ms"  # type: ignore[attr-defined]

    def track_stall_vs_sync(self, grid: dict, saver: str, size: str, world_size: int) -> float:
        return _figure(grid, (saver, size, world_size), "stall_vs_sync")

    track_stall_vs_sync.unit = "x sync save"  # type: ignore[attr-defined]


class AsyncStepRate(_AsyncFigure):
    """Steps per second during the background write over steps per second without a save."""

    def track_step_ratio(self, grid: dict, saver: str, size: str, world_size: int) -> float:
        return _figure(grid, (saver, size, world_size), "step_ratio")

    track_step_ratio.unit = "x steps without a save"  # type: ignore[attr-defined]


class AsyncWrite(_AsyncFigure):
    """Raw's write of the same bytes over the background write's time (1: the machine's limit)."""

    def track_raw_over_write(self, grid: dict, saver: str, size: str, world_size: int) -> float:
        return _figure(grid, (saver, size, world_size), "raw_over_write")

    track_raw_over_write.unit = "x raw"  # type: ignore[attr-defined]
