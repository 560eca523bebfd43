"""pytest-benchmark: FlattenParamsWrapper flattening and wrapped state_dict() (see bench.workloads.flat_param)."""

from __future__ import annotations

import pytest

from bench import config
from bench.workloads import flat_param as fp

PARAMS = config.grid(config.FLAT_PARAM_COUNTS)
DEPTHS = config.grid(config.FLAT_PARAM_DEPTHS)


def _skip_unavailable(impl: str) -> None:
    reason = fp.available(impl)
    if reason is not None:
        pytest.skip(reason)


def _rounds(params: int) -> int:
    return 1 if config.QUICK else 10 if params <= 1_000 else 3


@pytest.mark.parametrize("impl", fp.impls())
@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("params", PARAMS)
def test_flatten(benchmark, params: int, depth: int, impl: str) -> None:
    _skip_unavailable(impl)
    benchmark.group = f"flatten {params} params, depth {depth}"
    benchmark.extra_info.update(impl=impl, keys=params)
    # A fresh model for every round (wrapping is one-shot); building it is not timed.
    benchmark.pedantic(lambda fn: fn(), setup=lambda: ((fp.flatten_fn(impl, params, depth),), {}),
                       rounds=_rounds(params), iterations=1)


@pytest.mark.parametrize("impl", fp.impls())
@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("params", PARAMS)
def test_wrapped_state_dict(benchmark, params: int, depth: int, impl: str) -> None:
    _skip_unavailable(impl)
    model = fp.wrapped_model(impl, params, depth)
    benchmark.group = f"wrapped state_dict {params} params, depth {depth}"
    benchmark.extra_info.update(impl=impl, keys=params)
    result = benchmark.pedantic(model.state_dict, rounds=_rounds(params), iterations=1)
    assert list(result) == list(fp.wrapped_model("raw", params, depth).state_dict()), f"{impl}: keys differ from unwrapped"
