"""asv: FlattenParamsWrapper flattening time and state_dict() of wrapped models (issue 3).

Models of 100 / 1,000 / 10,000 parameters in a chain 1, 4 or 16 levels deep, one wrapper per level.
``raw`` is the unwrapped model (and ``torch.cat`` of the same parameters for flattening); fairscale is
the upstream wrapper (torch has no public one). ``track_state_dict_us_per_key`` stays flat over
``params`` and ``depth`` when the wrappers' key rewriting is linear, as it must be.
"""

from __future__ import annotations

import timeit

from bench import config
from bench.workloads import flat_param as fp

PARAMS: list[int] = config.grid(config.FLAT_PARAM_COUNTS)
DEPTHS: list[int] = config.grid(config.FLAT_PARAM_DEPTHS)
IMPLS: list[str] = list(fp.IMPLS)


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
    """The reference's speed relative to ``baseline`` (fairscale, or the unwrapped model), back to back."""

    params = (["fairscale", "raw"], PARAMS, DEPTHS)
    param_names = ["baseline", "params", "depth"]

    def setup(self, baseline: str, params: int, depth: int) -> None:
        _skip_unavailable("reference")
        _skip_unavailable(baseline)
        self.ref = fp.wrapped_model("reference", params, depth)
        self.base = fp.wrapped_model(baseline, params, depth)
        self.args = (params, depth)

    def track_state_dict_speedup(self, baseline: str, params: int, depth: int) -> float:
        best = lambda m: min(timeit.repeat(m.state_dict, number=1, repeat=3))  # noqa: E731
        return best(self.base) / best(self.ref)

    track_state_dict_speedup.unit = "ratio"  # type: ignore[attr-defined]

    def track_flatten_speedup(self, baseline: str, params: int, depth: int) -> float:
        def best(impl: str) -> float:
            return min(timeit.timeit(fp.flatten_fn(impl, *self.args), number=1) for _ in range(3))

        return best(baseline) / best("reference")

    track_flatten_speedup.unit = "ratio"  # type: ignore[attr-defined]
