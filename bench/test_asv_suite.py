"""Every asv benchmark once, as ``asv run --quick`` runs it: a benchmark that fails under asv fails here.

The benchmarks are found and called by asv's own runner library (``asv_runner``: its discovery, its
``Benchmark`` objects' ``setup_cache``, parameters, ``setup`` and ``teardown``), in this process and in
quick mode (``BENCH_QUICK=1``, set by ``bench/conftest.py`` under ``--benchmark-disable``): for
combinations in which every value of every parameter appears (:func:`covering_indices`), ``setup`` and
then the benchmark function once, where ``asv run --quick``
would call it once in a process of its own. A ``setup`` that raises ``NotImplementedError`` is asv's
skip (n/a), as is a ``track_`` figure of NaN; anything else a benchmark raises, and a ``track_`` value
that is not a number, fails the test. What this does not run of asv is its environment building and its
process per benchmark (``make asv`` does, in minutes).
"""

from __future__ import annotations

import math
import os
from numbers import Real
from typing import Any

import pytest

from bench import config

pytest.importorskip("asv_runner")
from asv_runner.discovery import disc_benchmarks  # noqa: E402

_ROOT = os.path.dirname(os.path.abspath(__file__))
#: setup_cache results by asv's key (one per class's setup_cache), shared as asv shares them in a run.
_CACHES: dict[Any, Any] = {}


def _benchmarks() -> dict[str, Any]:
    return {benchmark.name: benchmark for benchmark in disc_benchmarks(_ROOT)}


BENCHMARKS = _benchmarks()


def covering_indices(sizes: list[int]) -> list[int]:
    """asv's flat indices (``itertools.product`` order) of parameter combinations in which every value of
    every parameter appears at least once: as many combinations as the longest parameter has values,
    not their product. A benchmark broken for one value of one parameter fails here; one broken only
    for a pair of values is ``make asv``'s to find (it runs the whole grid)."""
    strides = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
    return sorted({sum((i % size) * stride for size, stride in zip(sizes, strides)) for i in range(max(sizes, default=1))})


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_asv_benchmark_runs_once(name: str) -> None:
    if not config.QUICK:
        pytest.skip("runs in quick mode only (BENCH_QUICK=1, or --benchmark-disable): make test's benchmark job")
    benchmark = BENCHMARKS[name]
    key = benchmark.setup_cache_key
    if key is not None and key not in _CACHES:
        _CACHES[key] = benchmark.do_setup_cache()
    indices = covering_indices([len(p) for p in benchmark._params]) if benchmark._params else [0]
    ran, skipped = 0, 0
    for index in indices:
        if benchmark._params:
            benchmark.set_param_idx(index)
        benchmark.set_cache(_CACHES.get(key) if key is not None else None)
        if benchmark.do_setup():
            skipped += 1
            continue
        try:
            value = benchmark.func(*benchmark._build_params())
        finally:
            benchmark.do_teardown()
        ran += 1
        if benchmark.type == "track":
            if not isinstance(value, Real):
                raise AssertionError(f"{name}{benchmark._current_params}: track value {value!r} is not a number")
    assert ran + skipped == len(indices)
