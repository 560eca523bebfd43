"""get_state_dict / set_state_dict workloads: time against the number of keys, with submodule filters.

The model is :func:`~bench.workloads.models.wide_model` with 64 blocks and ``keys`` parameters, and
Adam with state for every parameter. ``submodules`` is ``none`` (no filter), ``1`` (the first block)
or ``64`` (every block, so the filter keeps everything and its cost is all overhead). A filter that
tests every key against every submodule (torch's, see STYLE.md) costs keys x submodules; the
reference's must stay linear in keys.

Implementations (:func:`impls`): every adapter through its ``StateDictOps`` (``get_state_dict`` /
``set_state_dict`` with the ops' own ``options()``): the reference, torch, and the implementations
under test (``BENCH_IMPL``, see :mod:`bench.impls`); and ``raw``: ``model.state_dict()`` and
``optim.state_dict()`` (for set: ``load_state_dict`` of both), the plain calls every wrapper API builds
on. Single process, no process group (plain modules need none).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from bench import impls as _impls
from bench.workloads.models import adam_with_state, wide_model

__all__ = ["CAPABILITY", "UPSTREAM", "impls", "SUBMODULES", "N_BLOCKS", "available", "Case", "case", "get_fn", "set_fn"]

CAPABILITY = "state_dict"
#: The upstream baseline of this family.
UPSTREAM: tuple[str, ...] = ("torch",)
SUBMODULES: tuple[str, ...] = ("none", "1", "64")
N_BLOCKS = 64


def impls() -> list[str]:
    """reference, torch, the implementations under test, raw."""
    return _impls.family(UPSTREAM)


def available(impl: str) -> str | None:
    """None if ``impl`` can run here, else why not (its adapter has no ``StateDictOps``)."""
    return _impls.unavailable(impl, CAPABILITY)


class Case:
    """A model with ``keys`` parameters in 64 blocks, its Adam optimizer with state, and a full state dict."""

    def __init__(self, keys: int) -> None:
        self.keys = keys
        self.model = wide_model(keys, min(N_BLOCKS, keys))
        self.optim = adam_with_state(self.model)
        self.model_sd = self.model.state_dict()
        self.optim_sd = self.optim.state_dict()

    def submodules(self, which: str) -> set[nn.Module] | None:
        if which == "none":
            return None
        blocks = list(self.model.blocks)
        return set(blocks[: int(which)])


_CASES: dict[int, Case] = {}


def case(keys: int) -> Case:
    """The :class:`Case` of ``keys`` keys, built once per process (building 100,000 parameters takes seconds)."""
    if keys not in _CASES:
        _CASES.clear()
        _CASES[keys] = Case(keys)
    return _CASES[keys]


def _ops(impl: str) -> Any:
    return _impls.ops(impl, CAPABILITY)


def get_fn(impl: str, c: Case, submodules: str) -> Callable[[], Any]:
    """The timed call: get the model and optimizer state dict of ``c`` (filtered by ``submodules``);
    it returns ``(model_sd, optim_sd)``."""
    if impl == "raw":
        return lambda: (c.model.state_dict(), c.optim.state_dict())
    ops = _ops(impl)
    subs = c.submodules(submodules)
    options = ops.options()
    # torch deprecates submodules= (still present in 2.13); its warning is not what is measured.
    warnings.filterwarnings("ignore", message=".*submodules.*deprecated.*")
    return lambda: ops.get_state_dict(c.model, c.optim, submodules=subs, options=options)


def set_fn(impl: str, c: Case) -> Callable[[], Any]:
    """The timed call: load the full model and optimizer state dict of ``c`` back into it."""
    if impl == "raw":
        return lambda: (c.model.load_state_dict(c.model_sd), c.optim.load_state_dict(c.optim_sd))
    ops = _ops(impl)
    model_sd, optim_sd = ops.get_state_dict(c.model, c.optim)
    return lambda: ops.set_state_dict(c.model, c.optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
