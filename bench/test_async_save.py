"""pytest-benchmark: the stall of a save and the training step rate while it writes (see
bench.workloads.async_save).

Groups are ``async stall <size> ws<N> <executor>``; within a group one benchmark per implementation
(``reference``, ``torch``, the implementations under test), so ``tools.bench_table`` puts the reference
beside torch: ``extra_info["rank_seconds"]`` is the slowest rank's stall (call to staging complete), the
figure the table shows. ``extra_info`` also has the write's seconds and the step ratio (steps per second
during the write over steps per second without a save); ``python -m bench.async_save`` prints them all in
one table, synchronous saves and raw's write beside them.
"""

from __future__ import annotations

import pytest

from bench import config
from bench.workloads import async_save as aw
from bench.workloads import checkpoint as ck

SIZES = config.checkpoint_sizes(2)
CASES = [
    pytest.param(nbytes, world_size, saver, id=f"{config.size_label(nbytes)}-ws{world_size}-{saver.replace('/', '-')}")
    for world_size in config.CHECKPOINT_WORLD_SIZES
    for nbytes in SIZES
    for saver in aw.SAVERS
]
ROUNDS = 1 if config.QUICK else 3


@pytest.mark.parametrize(("nbytes", "world_size", "saver"), CASES)
def test_async_save(benchmark, rank_group, tmp_path, nbytes: int, world_size: int, saver: str) -> None:
    reason = aw.available(saver)
    if reason is not None:
        pytest.skip(reason)
    if config.DEVICE != "cpu":
        pytest.skip("the async-save benchmark measures CPU state dicts here; BENCH_DEVICE=cuda runs python -m bench.async_save")
    group = rank_group(world_size)
    impl, _, how = saver.rpartition("/")
    total = group.run(ck.prepare, nbytes, "sharded", "cpu")[0]
    directory = str(tmp_path / "ckpt")
    if not config.QUICK:  # quick mode (make test) checks that the benchmark runs, not its figures
        group.run(aw.measure_once, saver, directory)  # the first save starts what the saver keeps
    rounds: list[aw.AsyncFigures] = []

    def once() -> None:
        ranks = group.run(aw.measure_once, saver, directory)
        rounds.append(aw.AsyncFigures(
            stall_s=max(r["stall_s"] for r in ranks), write_s=max(r["write_s"] for r in ranks),
            steps_during=min(int(r["steps_during"]) for r in ranks), step_ratio=min(r["step_ratio"] for r in ranks),
        ))

    benchmark.group = f"async stall {config.size_label(nbytes)} ws{world_size} {how}"
    benchmark.pedantic(once, rounds=ROUNDS, iterations=1)
    best = min(rounds, key=lambda f: f.stall_s)
    benchmark.extra_info.update(impl=impl, rank_seconds=best.stall_s, write_seconds=best.write_s, bytes_saved=total,
                                step_ratio=best.step_ratio, steps_during=best.steps_during)
    if how != "sync" and best.write_s < best.stall_s:
        raise AssertionError(f"{saver}: the save completed ({best.write_s:.4f} s) before its staging did ({best.stall_s:.4f} s)")
    group.run(aw.release)
