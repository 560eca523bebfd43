"""asv: get_state_dict / set_state_dict against the number of keys, with and without submodules.

Implementations: the reference, torch, the implementations under test (``BENCH_IMPL``) and raw, each
through its adapter's ``StateDictOps`` (see :mod:`bench.workloads.state_dict`). ``time_*`` are asv's
own timings of one call; ``track_*_us_per_key`` divides by the number of keys, so a linear
implementation draws a flat line over ``keys`` (the 64-submodule curve must stay flat too);
``track_*_speedup`` times an implementation (the reference or one under test) and the baseline back to
back in one process.
"""

from __future__ import annotations

import timeit

from bench import config
from bench import impls as _impls
from bench.workloads import state_dict as sd

KEYS: list[int] = config.grid(config.STATE_DICT_KEYS)
IMPLS: list[str] = sd.impls()
#: Whose speed the ``*Speedup`` classes report: the reference and the implementations under test.
SUBJECTS: list[str] = [impl for impl in IMPLS if _impls.is_adapter(impl) and impl not in sd.UPSTREAM]
SUBMODULES: list[str] = list(sd.SUBMODULES)


def _skip_unavailable(impl: str) -> None:
    reason = sd.available(impl)
    if reason is not None:
        raise NotImplementedError(reason)


def _best_seconds(fn: object, keys: int) -> float:
    """Best of 3 calls (of 1 from 100,000 keys, where a call takes seconds)."""
    return min(timeit.repeat(fn, number=1, repeat=3 if keys < 100_000 else 1))  # type: ignore[arg-type]


class _Heavy:
    # 100,000 keys take seconds per call: a few samples, no warm-up, one process.
    number = 1
    repeat = (1, 5, 10.0)
    warmup_time = 0.0
    processes = 1
    timeout = 900


class GetStateDict(_Heavy):
    """Seconds of ``get_state_dict(model, optim, submodules=...)`` (raw: ``model.state_dict()`` + ``optim.state_dict()``)."""

    params = (IMPLS, KEYS, SUBMODULES)
    param_names = ["impl", "keys", "submodules"]

    def setup(self, impl: str, keys: int, submodules: str) -> None:
        _skip_unavailable(impl)
        self.fn = sd.get_fn(impl, sd.case(keys), submodules)

    def time_get_state_dict(self, impl: str, keys: int, submodules: str) -> None:
        self.fn()

    def track_get_state_dict_us_per_key(self, impl: str, keys: int, submodules: str) -> float:
        """Flat across ``keys`` when the cost is linear in keys."""
        return _best_seconds(self.fn, keys) / keys * 1e6

    track_get_state_dict_us_per_key.unit = "us/key"  # type: ignore[attr-defined]


class SetStateDict(_Heavy):
    """Seconds of ``set_state_dict(model, optim, model_state_dict=..., optim_state_dict=...)`` of full dicts."""

    params = (IMPLS, KEYS)
    param_names = ["impl", "keys"]

    def setup(self, impl: str, keys: int) -> None:
        _skip_unavailable(impl)
        self.fn = sd.set_fn(impl, sd.case(keys))

    def time_set_state_dict(self, impl: str, keys: int) -> None:
        self.fn()


class GetStateDictSpeedup(_Heavy):
    """The get_state_dict speed of ``impl`` relative to ``baseline`` (>= 1: at least as fast), back to back."""

    params = (SUBJECTS, ["torch", "raw"], KEYS, SUBMODULES)
    param_names = ["impl", "baseline", "keys", "submodules"]

    def setup(self, impl: str, baseline: str, keys: int, submodules: str) -> None:
        _skip_unavailable(impl)
        _skip_unavailable(baseline)
        case = sd.case(keys)
        self.mine = sd.get_fn(impl, case, submodules)
        self.base = sd.get_fn(baseline, case, submodules)

    def track_get_state_dict_speedup(self, impl: str, baseline: str, keys: int, submodules: str) -> float:
        return _best_seconds(self.base, keys) / _best_seconds(self.mine, keys)

    track_get_state_dict_speedup.unit = "ratio"  # type: ignore[attr-defined]


class SetStateDictSpeedup(_Heavy):
    """The set_state_dict speed of ``impl`` relative to ``baseline`` (>= 1: at least as fast), back to back.

    Up to 10,000 keys: at 100,000 every implementation, raw included, spends minutes per call in
    upstream ``Optimizer.load_state_dict`` (``param_id in pg["params"]`` on a list, quadratic in
    parameters); ``SetStateDict`` still records that size."""

    params = (SUBJECTS, ["torch", "raw"], [k for k in KEYS if k <= 10_000])
    param_names = ["impl", "baseline", "keys"]

    def setup(self, impl: str, baseline: str, keys: int) -> None:
        _skip_unavailable(impl)
        _skip_unavailable(baseline)
        case = sd.case(keys)
        self.mine = sd.set_fn(impl, case)
        self.base = sd.set_fn(baseline, case)

    def track_set_state_dict_speedup(self, impl: str, baseline: str, keys: int) -> float:
        return _best_seconds(self.base, keys) / _best_seconds(self.mine, keys)

    track_set_state_dict_speedup.unit = "ratio"  # type: ignore[attr-defined]
