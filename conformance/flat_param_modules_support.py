"""The modules the FP tests wrap to break wrapping (``conformance/test_flat_param.py``): a listed
parameter registered between unlisted ones, a module whose extra state raises (and one that catches
that inside its own), bad wrapper input (mixed dtypes, a listed flat parameter), and parameters tied
to unlisted ones by storage rather than by identity (FP-19)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from conformance import models
from conformance.adapters.flat_param import FlatParamOps

__all__ = [
    "UnlistedFirst",
    "Boom",
    "ReadsItsChild",
    "mixed_dtype",
    "listed_flat_param",
    "StorageTied",
    "SharedStorage",
    "ThreeViews",
    "BufferTied",
    "EmptyViewOfUnlisted",
]


class UnlistedFirst(nn.Module):
    """``kept`` is registered before the listed ``w`` and ``b``, and ``last`` after them."""

    def __init__(self) -> None:
        super().__init__()
        self.kept = nn.Parameter(torch.arange(3.0))
        self.w = nn.Parameter(torch.arange(4.0).reshape(2, 2) + 10)
        self.b = nn.Parameter(torch.arange(2.0) + 20)
        self.last = nn.Parameter(torch.arange(2.0) + 30)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + self.b + self.kept.sum() + self.last.sum()


class Boom(Exception):
    pass


class _RaisesWhenArmed(nn.Module):
    """A module whose extra state raises :class:`Boom` while ``armed`` (once), counting the raises."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(2.0) - 5)
        self.armed, self.raised = False, 0

    def get_extra_state(self) -> str:
        if self.armed:
            self.armed, self.raised = False, self.raised + 1
            raise Boom("extra state not ready")
        return "ready"

    def set_extra_state(self, state: Any) -> None:
        pass


class ReadsItsChild(nn.Module):
    """A module whose extra state tries its child's ``state_dict()`` first and falls back when that
    raises (the child's extra state is not ready), as an export that tries a submodule does: a
    ``state_dict`` call that raises and is caught inside another's walk.

    ``ReadsItsChild(wrap)`` wraps the child around its linear layer with ``wrap``; the root model is
    ``nn.Sequential(ReadsItsChild, nn.Linear)``, whose linear layer the root wrapper lists."""

    def __init__(self, wrap: Callable[[nn.Module, list[nn.Parameter]], nn.Module] | None = None) -> None:
        super().__init__()
        child = nn.Sequential(nn.Linear(2, 3), _RaisesWhenArmed())
        flaky = child[1]
        assert isinstance(flaky, _RaisesWhenArmed)
        self.__dict__["flaky"] = flaky  # reached directly, not through the wrapper; not registered twice
        self.sub = child if wrap is None else wrap(child, list(child[0].parameters()))

    flaky: _RaisesWhenArmed

    def get_extra_state(self) -> str:
        self.flaky.armed = True
        try:
            self.sub.state_dict()
        except Boom:
            return "fallback"
        return "read"

    def set_extra_state(self, state: Any) -> None:
        pass


# -- FP-18, FP-19: bad wrapper input ------------------------------------------------------------------


def mixed_dtype(ops: FlatParamOps) -> Any:
    model = models.build("mlp")
    model.get_submodule("net.2").double()
    return ops.wrap(model, list(model.parameters()))


def listed_flat_param(ops: FlatParamOps) -> Any:
    model = models.build("mlp")
    first = model.get_submodule("net.0")
    model.get_submodule("net").register_module("0", ops.wrap(first, list(first.parameters())))
    return ops.wrap(model, list(model.parameters()))


class StorageTied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        # Two Parameter objects over one memory: a tie by storage, not by identity.
        self.b.weight = nn.Parameter(self.a.weight.detach())


class SharedStorage(nn.Module):
    """``head`` and ``tail`` are views of one 10-element storage, ``head`` over ``[0, split)`` and
    ``tail`` over ``[start, 10)``: they overlap when ``start < split`` and only touch when equal."""

    def __init__(self, split: int, start: int) -> None:
        super().__init__()
        storage = torch.arange(10.0)
        self.head = nn.Parameter(storage[:split])
        self.tail = nn.Parameter(storage[start:])


class ThreeViews(nn.Module):
    """Views of one 30-element storage: ``first`` over ``[0, 10)``, ``second`` over ``[10, 20)``, and
    ``listed`` over ``[15, 25)``, which overlaps ``second`` only."""

    def __init__(self) -> None:
        super().__init__()
        storage = torch.arange(30.0)
        self.first = nn.Parameter(storage[:10])
        self.second = nn.Parameter(storage[10:20])
        self.listed = nn.Parameter(storage[15:25])


class BufferTied(nn.Module):
    """``weight`` is a parameter and ``running`` a buffer over part of its memory: a tie through a
    buffer, which flattening ``weight`` alone would cut (the buffer left on the old memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(6.0))
        self.register_buffer("running", self.weight.detach()[2:4])


class EmptyViewOfUnlisted(nn.Module):
    """``empty`` is a 0-element view that starts inside ``weight``'s storage: it shares no memory."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(10.0))
        self.empty = nn.Parameter(self.weight.detach()[5:5])
        self.bias = nn.Parameter(torch.ones(2))
