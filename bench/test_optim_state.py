"""pytest-benchmark: FSDP full optimizer state dict and its conversion back, world size 2
(see bench.workloads.optim_state)."""

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


@pytest.mark.parametrize("impl", osw.IMPLS)
@pytest.mark.parametrize("params", PARAMS)
def test_optim_state_dict(benchmark, rank_group, params: int, impl: str) -> None:
    _skip_unavailable(impl)
    group = rank_group(WORLD_SIZE)
    group.run(osw.prepare, impl, params)
    benchmark.group = f"optim_state_dict {params} params ws{WORLD_SIZE}"
    benchmark.extra_info.update(impl=impl, keys=params)
    try:
        benchmark.pedantic(group.run, args=(osw.get_step,), rounds=_rounds(params), iterations=1)
    finally:
        group.run(osw.release)


@pytest.mark.parametrize("impl", [impl for impl in osw.IMPLS if impl != "raw"])
@pytest.mark.parametrize("params", PARAMS)
def test_optim_state_dict_to_load(benchmark, rank_group, params: int, impl: str) -> None:
    _skip_unavailable(impl)
    group = rank_group(WORLD_SIZE)
    group.run(osw.prepare, impl, params)
    benchmark.group = f"optim_state_dict_to_load {params} params ws{WORLD_SIZE}"
    benchmark.extra_info.update(impl=impl, keys=params)
    try:
        benchmark.pedantic(group.run, args=(osw.to_load_once,), rounds=_rounds(params), iterations=1)
    finally:
        group.run(osw.release)
