"""asv: FlattenParamsWrapper flattening time and state_dict() of wrapped models.

Models of 100 / 1,000 / 10,000 parameters in a chain 1, 4 or 16 levels deep, one wrapper per level,
wrapped through each adapter's ``FlatParamOps.wrap``: the reference, fairscale (the upstream wrapper:
torch has no public one) and the implementations under test (``BENCH_IMPL``). ``raw`` is the
unwrapped model (and ``torch.cat`` of the same parameters for flattening). ``track_state_dict_us_per_key`` stays flat over
``params`` and ``depth`` when the wrappers' key rewriting is linear, as it must be.
"""

from __future__ import annotations

import timeit

from bench import config
from bench import impls as _impls
from bench.workloads import flat_param as fp

PARAMS: list[int] = config.grid(config.FLAT_PARAM_COUNTS)
DEPTHS: list[int] = config.grid(config.FLAT_PARAM_DEPTHS)
IMPLS: list[str] = fp.impls()
#: Whose speed ``FlatParamSpeedup`` reports: the reference and the implementations under test.
SUBJECTS: list[str] = [impl for impl in IMPLS if _impls.is_adapter(impl) and impl not in fp.UPSTREAM]


def _skip_unavailable(impl: str) -> None:
    reason = fp.available(impl)
    if reason is not None:
        raise NotImplementedError(reason)


class Flatten:
    """Seconds to wrap every level of a freshly built model (the build is in ``setup``, untimed)."""

    params = (IMPLS, PARAMS, DEPTHS)
    param_names = ["impl", "params", "depth"]
    # Wrapping is one-shot: one call per sample, a fresh model from setup for each.
    number = 1
    repeat = (3, 10, 10.0)
    warmup_time = 0.0

    def setup(self, impl: str, params: int, depth: int) -> None:
        _skip_unavailable(impl)
        self.fn = fp.flatten_fn(impl, params, depth)

    def time_flatten(self, impl: str, params: int, depth: int) -> None:
        self.fn()


class WrappedStateDict:
    """Seconds of ``state_dict()`` of the wrapped model (raw: the same model unwrapped)."""

    params = (IMPLS, PARAMS, DEPTHS)
    param_names = ["impl", "params", "depth"]

    def setup(self, impl: str, params: int, depth: int) -> None:
        _skip_unavailable(impl)
        self.model = fp.wrapped_model(impl, params, depth)

    def time_state_dict(self, impl: str, params: int, depth: int) -> None:
        self.model.state_dict()

    def track_state_dict_us_per_key(self, impl: str, params: int, depth: int) -> float:
        return min(timeit.repeat(self.model.state_dict, number=1, repeat=3)) / params * 1e6

    track_state_dict_us_per_key.unit = "us/key"  # type: ignore[attr-defined]


class FlatParamSpeedup:
    """The speed of ``impl`` relative to ``baseline`` (fairscale, or the unwrapped model), back to back."""

    params = (SUBJECTS, ["fairscale", "raw"], PARAMS, DEPTHS)
    param_names = ["impl", "baseline", "params", "depth"]

    def setup(self, impl: str, baseline: str, params: int, depth: int) -> None:
        _skip_unavailable(impl)
        _skip_unavailable(baseline)
        self.mine = fp.wrapped_model(impl, params, depth)
        self.base = fp.wrapped_model(baseline, params, depth)
        self.args = (params, depth)

    def track_state_dict_speedup(self, impl: str, baseline: str, params: int, depth: int) -> float:
        best = lambda m: min(timeit.repeat(m.state_dict, number=1, repeat=3))  # noqa: E731
        return best(self.base) / best(self.mine)

    track_state_dict_speedup.unit = "ratio"  # type: ignore[attr-defined]

    def track_flatten_speedup(self, impl: str, baseline: str, params: int, depth: int) -> float:
        def best(name: str) -> float:
            return min(timeit.timeit(fp.flatten_fn(name, *self.args), number=1) for _ in range(3))

        return best(baseline) / best(impl)

    track_flatten_speedup.unit = "ratio"  # type: ignore[attr-defined]
