"""How a rank body runs: on one intra-op thread, on its rank's rows of each batch, and what it returns
when the adapter cannot lay the drawn case out."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import torch

from conformance.harness.context import RankContext

__all__ = ["Refused", "single_threaded", "in_one_thread", "rank_slice", "whole_batch"]

P = ParamSpec("P")
R = TypeVar("R")


class Refused(str):
    """What a rank body returns when the adapter cannot lay out the drawn case (it raised
    ``Unsupported``): the controller rejects the example instead of skipping the whole test."""


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run with one intra-op thread, then restore the setting. The generated models are tiny: on a
    loaded machine torch's second thread makes each backward pass ten times slower, not faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def in_one_thread(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run under :func:`single_threaded` (the name, docstring and module stay ``fn``'s, so a
    rank body pickles by its name)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        __tracebackhide__ = True
        with single_threaded():
            return fn(*args, **kwargs)

    return run


def rank_slice(ctx: RankContext) -> Callable[[torch.Tensor], torch.Tensor]:
    """This rank's equal share of the rows of a global batch (rank ``r`` of ``w`` takes chunk ``r``)."""
    return lambda x: x.chunk(ctx.world_size)[ctx.rank]


def whole_batch(x: torch.Tensor) -> torch.Tensor:
    """The share of a single process: every row."""
    return x
