"""pytest-benchmark: the full optimizer state dict of a sharded model and loading it back, world size 2,
through each adapter's ``OptimStateOps`` (see bench.workloads.optim_state)."""

from __future__ import annotations

import pytest

from bench import config
from bench.workloads import optim_state as osw

PARAMS = config.grid(config.OPTIM_STATE_PARAMS)
WORLD_SIZE = 2


def _skip_unavailable(impl: str) -> None:
    reason = osw.available(impl)
    if reason is not None:
        pytest.skip(reason)


def _rounds(params: int) -> int:
    return 1 if config.QUICK else 5 if params <= 1_000 else 3


def _bench_on_ranks(benchmark, rank_group, impl: str, params: int, step, label: str) -> None:
    """Time ``step`` on the ranks of one group after ``osw.prepare``; release the model either way."""
    _skip_unavailable(impl)
    group = rank_group(WORLD_SIZE)
    group.run(osw.prepare, impl, params)
    benchmark.group = f"{label} {params} params ws{WORLD_SIZE}"
    benchmark.extra_info.update(impl=impl, keys=params)
    try:
        benchmark.pedantic(group.run, args=(step,), rounds=_rounds(params), iterations=1)
    finally:
        group.run(osw.release)


@pytest.mark.parametrize("impl", osw.impls())
@pytest.mark.parametrize("params", PARAMS)
def test_optim_state_dict(benchmark, rank_group, params: int, impl: str) -> None:
    _bench_on_ranks(benchmark, rank_group, impl, params, osw.get_step, "optim_state_dict")


@pytest.mark.parametrize("impl", osw.impls())
@pytest.mark.parametrize("params", PARAMS)
def test_load_optim_state_dict(benchmark, rank_group, params: int, impl: str) -> None:
    _bench_on_ranks(benchmark, rank_group, impl, params, osw.load_once, "load_optim_state_dict")
