"""pytest-benchmark: checkpoint save, load and load into meta (see bench.workloads.checkpoint).

Groups are workloads (``save 64MB ws2 sharded``, ``... cuda`` for CUDA state dicts); within a group, one
benchmark per implementation (the reference, torch, the implementations under test of ``BENCH_IMPL``,
each through its ``CheckpointOps``; raw; memcpy). ``extra_info["bytes"]`` lets ``tools.bench_table``
turn seconds into MB/s, and ``extra_info["rank_seconds"]`` is the median over the rounds of the ranks'
own time of the operation (barrier to barrier, see ``bench.ranks.timed``): the controller's clock also
sees the messaging and, for a load, the zeroing of the destination and the check of every value.
``BENCH_DEVICE=cuda`` measures state dicts on the GPUs; without CUDA those cases skip, saying why.
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from bench import config
from bench.ranks import RankGroup
from bench.workloads import checkpoint as ck

# make bench stays in minutes: the 2 GB case is asv's (bench_checkpoint.py).
SIZES = config.checkpoint_sizes(2)
DEVICE = config.DEVICE
_SUFFIX = "" if DEVICE == "cpu" else f"-{DEVICE}"
CASES = [
    pytest.param(nbytes, world_size, layout, impl,
                 id=f"{config.size_label(nbytes)}-ws{world_size}-{layout}-{impl}{_SUFFIX}")
    for world_size in config.checkpoint_world_sizes(DEVICE)
    for nbytes in SIZES
    for layout in ck.LAYOUTS
    for impl in ck.impls()
]
ROUNDS = 1 if config.QUICK else 3


def _workload(op: str, nbytes: int, world_size: int, layout: str) -> str:
    return f"{op} {config.size_label(nbytes)} ws{world_size} {layout}" + ("" if DEVICE == "cpu" else f" {DEVICE}")


def _skip_unavailable(impl: str, world_size: int) -> None:
    reason = ck.available(impl) or config.device_unavailable(DEVICE, world_size)
    if reason is not None:
        pytest.skip(reason)


def _group(rank_group, world_size: int) -> RankGroup:
    return rank_group(world_size, config.backend(DEVICE))


def _ranks_timed(benchmark, group: RankGroup, step: Any, impl: str, directory: str, total: int) -> None:
    """Run ``step(impl, directory)`` on the ranks for every round; record the median of the slowest
    rank's own seconds as ``rank_seconds`` (what the table uses) beside the controller's timing."""
    seconds: list[float] = []

    def once() -> None:
        seconds.append(max(group.run(step, impl, directory)))

    benchmark.pedantic(once, rounds=ROUNDS, iterations=1)
    benchmark.extra_info.update(impl=impl, bytes=total, rank_seconds=statistics.median(seconds),
                                rank_seconds_rounds=seconds)


@pytest.mark.parametrize(("nbytes", "world_size", "layout", "impl"), CASES)
def test_save(benchmark, rank_group, tmp_path, nbytes: int, world_size: int, layout: str, impl: str) -> None:
    _skip_unavailable(impl, world_size)
    group = _group(rank_group, world_size)
    total = group.run(ck.prepare, nbytes, layout, DEVICE)[0]
    benchmark.group = _workload("save", nbytes, world_size, layout)
    _ranks_timed(benchmark, group, ck.save_once, impl, str(tmp_path / "ckpt"), total)


@pytest.mark.parametrize(("nbytes", "world_size", "layout", "impl"), CASES)
def test_load(benchmark, rank_group, tmp_path, nbytes: int, world_size: int, layout: str, impl: str) -> None:
    _skip_unavailable(impl, world_size)
    group = _group(rank_group, world_size)
    total = group.run(ck.prepare, nbytes, layout, DEVICE)[0]
    directory = str(tmp_path / "ckpt")
    group.run(ck.save_once, impl, directory)
    benchmark.group = _workload("load", nbytes, world_size, layout)
    # load_once zeroes the destination and checks every value after the load (both untimed on the ranks).
    _ranks_timed(benchmark, group, ck.load_once, impl, directory, total)


META_CASES = [case for case in CASES if case.values[3] in ck.meta_impls()]


@pytest.mark.parametrize(("nbytes", "world_size", "layout", "impl"), META_CASES)
def test_meta_load(benchmark, rank_group, tmp_path, nbytes: int, world_size: int, layout: str, impl: str) -> None:
    """One round on fresh ranks (their peak RSS must be the load's own); extra_info has the peak.

    In quick mode the session's ranks load instead: the code path is the same, the peak is not judged,
    and a dozen rank start-ups are saved."""
    _skip_unavailable(impl, world_size)
    group = _group(rank_group, world_size)
    total = group.run(ck.prepare, nbytes, layout, DEVICE)[0]
    directory = str(tmp_path / "ckpt")
    group.run(ck.save_once, impl, directory)
    fresh: dict[str, RankGroup] = {}
    results: list = []

    def start_ranks() -> None:
        if not config.QUICK:
            fresh["group"] = RankGroup(world_size, backend=config.backend(DEVICE))

    def load() -> None:
        results[:] = fresh.get("group", group).run(ck.meta_load_once, impl, directory, nbytes, layout)

    benchmark.group = _workload("meta-load", nbytes, world_size, layout)
    try:
        benchmark.pedantic(load, setup=start_ranks, rounds=1, iterations=1)
    finally:
        if "group" in fresh:
            fresh["group"].close()
    peak = max(p / local for _, p, local in results)
    # The ranks time the load itself; the controller's clock also sees the rank's first imports and
    # the building of the meta state dict, which a fresh process pays once. The table uses the former.
    benchmark.extra_info.update(impl=impl, bytes=total, peak_rss_ratio=round(peak, 3),
                                rank_seconds=max(s for s, _, _ in results))
