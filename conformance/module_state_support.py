"""What the tests of module state beyond parameters and buffers share
(``conformance/test_module_state.py``): the extra-state values tried (:data:`EXTRA_KINDS`), the models
that hold them (:class:`ExtraModel`) and their checks, and the forms of a dtype change after wrapping
(:data:`DTYPE_FORMS`)."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from conformance.adapters.base import Adapter, Unsupported
from conformance.adapters.sharding import ShardingPlan
from conformance.asserts import assert_same_state, fail, raised

__all__ = [
    "EXTRA_KINDS",
    "PLACES",
    "extra_value",
    "fresh",
    "comparable",
    "same",
    "ExtraLinear",
    "ExtraModel",
    "build_extra",
    "holders",
    "extra_entries",
    "assert_extra_entries",
    "assert_holds",
    "tensors_of",
    "shard_extra",
    "SHARDED_GETS",
    "DTYPE_FORMS",
    "DTYPE_ATOL",
]


# -- extra state ---------------------------------------------------------------------------------------

#: The values an extra state takes here: ``grown-tensor`` is a uint8 tensor whose length depends on the
#: seed (Transformer Engine's serialized metadata); ``none`` is None in the source and a string in the
#: target, so that loading None is seen.
EXTRA_KINDS = ("str", "bytes", "bytesio", "tensor", "grown-tensor", "dict", "none")


#: Where a model holds extra state: its root, and the module sharding makes a unit.
PLACES = {"root": "_extra_state", "unit": "inp._extra_state"}


def extra_value(kind: str, seed: int, place: str) -> Any:
    """The extra state of ``place`` in a model built from ``seed``: distinct per kind, seed and place."""
    tag = len(place)
    raw = bytes([seed, 0, 255, tag]) + place.encode()
    if kind == "str":
        return f"{place}-fp8-recipe-{seed}"
    if kind == "bytes":
        return raw
    if kind == "bytesio":
        return io.BytesIO(raw)
    if kind == "tensor":
        return torch.tensor([seed + 0.5, -0.0 if seed == 0 else 2.0**-60, 1e300 * (tag + seed)], dtype=torch.float64)
    if kind == "grown-tensor":
        return torch.arange(3 + 2 * seed, dtype=torch.uint8) + tag
    if kind == "dict":
        return {"scale": torch.full((3,), 2.0**-seed) * tag, "history": [torch.arange(2) + seed, seed], "recipe": f"{place}-{seed}"}
    if kind == "none":
        return None if seed == 0 else f"{place}-set-{seed}"
    raise ValueError(f"unknown extra-state kind {kind!r}; expected one of {EXTRA_KINDS}")


def fresh(value: Any) -> Any:
    """A copy of ``value`` sharing no object with it (a BytesIO with the same bytes, tensors cloned)."""
    if isinstance(value, io.BytesIO):
        return io.BytesIO(value.getvalue())
    return copy.deepcopy(value)


def comparable(value: Any) -> Any:
    """``value`` with every BytesIO read out (``("BytesIO", bytes)``), for :func:`assert_same_state`."""
    if isinstance(value, io.BytesIO):
        return ("BytesIO", value.getvalue())
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(comparable(v) for v in value)
    return value


def same(got: Any, expected: Any) -> bool:
    """Whether ``got`` equals ``expected`` as :func:`assert_same_state` compares (BytesIO by its bytes)."""
    return raised(lambda: assert_same_state(comparable(got), comparable(expected))) is None


class _ExtraState:
    """``get_extra_state`` returns a fresh copy of ``extra``; ``set_extra_state`` records what it was
    handed and keeps a copy of it."""

    extra: Any
    received: list[Any]

    def get_extra_state(self) -> Any:
        return fresh(self.extra)

    def set_extra_state(self, state: Any) -> None:
        self.received.append(state)
        self.extra = fresh(state)


class ExtraLinear(_ExtraState, nn.Linear):
    def __init__(self, d_in: int, d_out: int, extra: Any) -> None:
        super().__init__(d_in, d_out)
        self.extra, self.received = extra, []


class ExtraModel(_ExtraState, nn.Module):
    """Extra state at the root and in ``inp`` (a unit when sharded); ``head`` has none."""

    def __init__(self, kind: str, seed: int) -> None:
        super().__init__()
        self.inp = ExtraLinear(5, 6, extra_value(kind, seed, "unit"))
        self.head = nn.Linear(6, 3)
        self.extra, self.received = extra_value(kind, seed, "root"), []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inp(x)))


def build_extra(kind: str, seed: int, device: Any = "cpu") -> ExtraModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ExtraModel(kind, seed)
    return model.to(device)


def holders(model: ExtraModel) -> dict[str, _ExtraState]:
    """The modules holding extra state, by place, taken before any wrapping (the user's handles)."""
    return {"root": model, "unit": model.inp}


def extra_entries(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    return {place: state_dict[key] for place, key in PLACES.items() if key in state_dict}


def assert_extra_entries(state_dict: Mapping[str, Any], kind: str, seed: int, what: str, where: str) -> None:
    """The extra-state entries of ``state_dict`` are those of a model built from ``seed``, under their keys."""
    __tracebackhide__ = True
    missing = [key for key in PLACES.values() if key not in state_dict]
    if missing:
        fail(f"{what}: extra-state entries missing", missing, list(PLACES.values()), where)
    want = {place: comparable(extra_value(kind, seed, place)) for place in PLACES}
    assert_same_state(comparable(extra_entries(state_dict)), want, what=f"{what}: extra state ({kind})", where=where)


def assert_holds(modules: Mapping[str, _ExtraState], kind: str, seed: int, what: str, where: str) -> None:
    """Every module holds the extra state of a model built from ``seed``, handed to its ``set_extra_state``."""
    __tracebackhide__ = True
    for place, module in modules.items():
        want = comparable(extra_value(kind, seed, place))
        if not module.received:
            fail(f"{what}: set_extra_state of the {place} module was never called", "never called", f"called with {want!r}"[:200], where)
        assert_same_state(comparable(module.extra), want, what=f"{what}: the {place} module's extra state ({kind})", where=where)


def tensors_of(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [t for v in tree.values() for t in tensors_of(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors_of(v)]
    return []


def shard_extra(impl: Adapter, model: nn.Module, device: torch.device) -> nn.Module:
    plan = ShardingPlan("FULL_SHARD", units=lambda m: isinstance(m, ExtraLinear), device=device)
    try:
        return impl.require("sharding").shard(model, plan)
    except Unsupported as exc:
        pytest.skip(str(exc))


#: The get options of a sharded model tried with extra state (SD-12, SD-13, SD-30).
SHARDED_GETS = {
    "sharded": {"full_state_dict": False},
    "sharded+offload": {"full_state_dict": False, "cpu_offload": True},
    "full": {"full_state_dict": True},
    "full+offload": {"full_state_dict": True, "cpu_offload": True},
}


# -- a dtype change after wrapping -------------------------------------------------------------------------

#: How a model's floating-point dtype is changed, and the dtype it then has.
DTYPE_FORMS: dict[str, tuple[Callable[[nn.Module], Any], torch.dtype]] = {
    "to-float64": (lambda m: m.to(torch.float64), torch.float64),
    "to-dtype-keyword": (lambda m: m.to(dtype=torch.float64), torch.float64),
    "double": (lambda m: m.double(), torch.float64),
    "type": (lambda m: m.type(torch.float64), torch.float64),
    "half": (lambda m: m.half(), torch.float16),
    "bfloat16": (lambda m: m.bfloat16(), torch.bfloat16),
}


#: Tolerance of trained values per dtype (ranks average gradients: a sum may round).
DTYPE_ATOL = {torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 2e-2}
