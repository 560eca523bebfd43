"""FlattenParamsWrapper workloads: flattening time, and ``state_dict()`` of a wrapped model.

The model is :func:`~bench.workloads.models.nested_model`: ``params`` parameters over a chain of
``depth`` levels, each level wrapped in its own wrapper (innermost first), so a depth-16 model has
wrappers nested 16 deep and keys 16 segments long. The wrappers' key rewriting must not make
``state_dict()`` quadratic in depth or in keys.

Implementations (:func:`impls`): every adapter through its ``FlatParamOps.wrap``: the reference,
fairscale (upstream torch has no public FlattenParamsWrapper, so fairscale is the upstream column
here) and the implementations under test (``BENCH_IMPL``, see :mod:`bench.impls`); and ``raw``: the
same model unwrapped (``state_dict()`` of plain modules; for flattening, ``torch.cat`` of the same
parameters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench import impls as _impls
from bench.workloads.models import Level, nested_model

__all__ = ["CAPABILITY", "UPSTREAM", "impls", "available", "wrap_all", "flatten_fn", "wrapped_model"]

CAPABILITY = "flat_param"
#: The upstream baseline of this family (torch has no public FlattenParamsWrapper).
UPSTREAM: tuple[str, ...] = ("fairscale",)


def impls() -> list[str]:
    """reference, fairscale, the implementations under test, raw."""
    return _impls.family(UPSTREAM)


def available(impl: str) -> str | None:
    """None if ``impl`` can run here, else why not (its adapter has no ``FlatParamOps``)."""
    return _impls.unavailable(impl, CAPABILITY)


def _levels(model: Level) -> list[Level]:
    """The chain of levels of an unwrapped model, outermost first."""
    levels: list[Level] = []
    level: nn.Module | None = model
    while level is not None:
        if not isinstance(level, Level):
            raise TypeError(f"expected an unwrapped model, found a {type(level).__name__} in the chain")
        levels.append(level)
        level = level.child
    return levels


def wrap_all(impl: str, model: Level) -> nn.Module:
    """Wrap each level of ``model`` with ``impl``'s ``FlatParamOps.wrap`` over its own parameters,
    innermost first."""
    return _wrap_levels(_impls.ops(impl, CAPABILITY), model)


def _wrap_levels(ops: Any, model: Level) -> nn.Module:
    levels = _levels(model)
    wrapped: nn.Module | None = None
    for level in reversed(levels):
        if wrapped is not None:
            level.child = wrapped
        own = list(level.params.parameters())
        wrapped = ops.wrap(level, own)
    assert wrapped is not None
    return wrapped


def flatten_fn(impl: str, params: int, depth: int) -> Callable[[], Any]:
    """A one-shot timed call that flattens a freshly built model (build it outside the timing)."""
    model = nested_model(params, depth)
    if impl == "raw":
        groups = [list(level.params.parameters()) for level in _levels(model)]
        return lambda: [torch.cat([p.detach().reshape(-1) for p in group]) for group in groups]
    ops = _impls.ops(impl, CAPABILITY)  # resolved here: the adapter's own set-up is not the wrapping
    return lambda: _wrap_levels(ops, model)


def wrapped_model(impl: str, params: int, depth: int) -> nn.Module:
    """The model of ``params`` parameters and ``depth`` levels, wrapped by ``impl`` (``raw``: unwrapped)."""
    model = nested_model(params, depth)
    return model if impl == "raw" else wrap_all(impl, model)
