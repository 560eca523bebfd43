"""FlattenParamsWrapper workloads: flattening time, and ``state_dict()`` of a wrapped model.

The model is :func:`~bench.workloads.models.nested_model`: ``params`` parameters over a chain of
``depth`` levels, each level wrapped in its own wrapper (innermost first), so a depth-16 model has
wrappers nested 16 deep and keys 16 segments long. The wrappers' key rewriting must not make
``state_dict()`` quadratic in depth or in keys.

Implementations: ``reference`` (``reference.flat_param``), ``fairscale`` (its FlattenParamsWrapper:
upstream torch has no public one, so fairscale is the upstream column here), and ``raw``: the same
model unwrapped (``state_dict()`` of plain modules; for flattening, ``torch.cat`` of the same
parameters).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench.workloads.models import Level, nested_model

__all__ = ["IMPLS", "available", "wrapper_class", "wrap_all", "flatten_fn", "wrapped_model"]

IMPLS: tuple[str, ...] = ("reference", "fairscale", "raw")


def available(impl: str) -> str | None:
    """None if ``impl`` can run here, else why not."""
    module = {"reference": "reference.flat_param", "fairscale": "fairscale"}.get(impl)
    if module is not None and importlib.util.find_spec(module) is None:
        return f"{module} is not available in this environment"
    return None


def wrapper_class(impl: str) -> type[nn.Module]:
    if impl == "reference":
        from reference.flat_param import FlattenParamsWrapper
    elif impl == "fairscale":
        from fairscale.nn.misc.flatten_params_wrapper import FlattenParamsWrapper
    else:
        raise ValueError(f"not a wrapper implementation: {impl!r}")
    return FlattenParamsWrapper


def _levels(model: Level) -> list[Level]:
    levels: list[Level] = []
    level: Level | None = model
    while level is not None:
        levels.append(level)
        level = level.child
    return levels


def wrap_all(impl: str, model: Level) -> nn.Module:
    """Wrap each level of ``model`` in ``impl``'s wrapper over its own parameters, innermost first."""
    wrapper = wrapper_class(impl)
    levels = _levels(model)
    wrapped: nn.Module | None = None
    for level in reversed(levels):
        if wrapped is not None:
            level.child = wrapped
        own = list(level.params.parameters())
        wrapped = wrapper(level, own)
    assert wrapped is not None
    return wrapped


def flatten_fn(impl: str, params: int, depth: int) -> Callable[[], Any]:
    """A one-shot timed call that flattens a freshly built model (build it outside the timing)."""
    model = nested_model(params, depth)
    if impl == "raw":
        groups = [list(level.params.parameters()) for level in _levels(model)]
        return lambda: [torch.cat([p.detach().reshape(-1) for p in group]) for group in groups]
    return lambda: wrap_all(impl, model)


def wrapped_model(impl: str, params: int, depth: int) -> nn.Module:
    """The model of ``params`` parameters and ``depth`` levels, wrapped by ``impl`` (``raw``: unwrapped)."""
    model = nested_model(params, depth)
    return model if impl == "raw" else wrap_all(impl, model)
