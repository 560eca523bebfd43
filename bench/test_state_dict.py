"""pytest-benchmark: get_state_dict / set_state_dict against keys and submodules (see bench.workloads.state_dict).

Up to 10,000 keys here (``make bench`` stays in minutes); asv (bench_state_dict.py) goes to 100,000.
"""

from __future__ import annotations

import pytest

from bench import config
from bench.workloads import state_dict as sd

KEYS = config.grid(config.STATE_DICT_KEYS[:3])


def _skip_unavailable(impl: str) -> None:
    reason = sd.available(impl)
    if reason is not None:
        pytest.skip(reason)


def _rounds(keys: int) -> int:
    return 1 if config.QUICK else 10 if keys <= 1_000 else 3


@pytest.mark.parametrize("impl", sd.impls())
@pytest.mark.parametrize("submodules", sd.SUBMODULES)
@pytest.mark.parametrize("keys", KEYS)
def test_get_state_dict(benchmark, keys: int, submodules: str, impl: str) -> None:
    _skip_unavailable(impl)
    fn = sd.get_fn(impl, sd.case(keys), submodules)
    benchmark.group = f"get_state_dict {keys} keys, submodules={submodules}"
    benchmark.extra_info.update(impl=impl, keys=keys)
    model_sd, _ = benchmark.pedantic(fn, rounds=_rounds(keys), iterations=1)
    expected = keys if submodules != "1" or impl == "raw" else len(list(sd.case(keys).model.blocks[0].parameters()))
    assert len(model_sd) == expected, f"{impl}: {len(model_sd)} model keys, expected {expected}"


@pytest.mark.parametrize("impl", sd.impls())
@pytest.mark.parametrize("keys", KEYS)
def test_set_state_dict(benchmark, keys: int, impl: str) -> None:
    _skip_unavailable(impl)
    fn = sd.set_fn(impl, sd.case(keys))
    benchmark.group = f"set_state_dict {keys} keys"
    benchmark.extra_info.update(impl=impl, keys=keys)
    benchmark.pedantic(fn, rounds=_rounds(keys), iterations=1)
