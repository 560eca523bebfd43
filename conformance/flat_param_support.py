"""What the FP tests share (``conformance/test_flat_param.py``): how each zoo model is wrapped
(:data:`WRAPPINGS`), access to a wrapper's flat parameters and their metadata, the "changes nothing"
state of flat parameters, parameters of one dtype holding its edge values, and the element-walk oracle
of shard metadata. The modules that break wrapping in other ways are in
:mod:`conformance.flat_param_modules_support`."""

from __future__ import annotations

import copy
import functools
import math
import pickle
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn

from conformance import fqn, models
from conformance.adapters.base import Unsupported
from conformance.adapters.flat_param import FlatParamInfo, FlatParamOps, ShardInfo
from conformance.asserts import WRAPPER_SEGMENTS, assert_bitwise_equal, bits, fail
from conformance.values import different_like, edge_tensors

__all__ = [
    "SHARD_COUNTS",
    "FP_SEGMENTS",
    "dtype_id",
    "shard_or_skip",
    "flatten_all",
    "WRAPPINGS",
    "pair",
    "flat_params",
    "flat_of",
    "wrapped_module",
    "tensor_at",
    "grad_of",
    "plain_name",
    "flats_with_prefix",
    "flat_keys_of",
    "quoted",
    "sgd",
    "unlike",
    "target_unlike",
    "assert_differs_everywhere",
    "record_shards",
    "flat_state",
    "flat_metadata",
    "assert_same_flat_state",
    "EdgeParams",
    "bad_flat_inputs",
    "even_shards",
    "expected_shard",
    "zoo_flat",
    "SHARD_FLATS",
    "golden_table",
    "inside_container",
    "bad_keys",
    "reshaped",
    "under_wrapper_segments",
    "wrap_across_a_wrapper",
    "FAILED_LOAD_KEYS",
    "COPIES",
]


SHARD_COUNTS = (1, 2, 3, 4, 5)


#: What must never appear in a key or a message: the shared wrapper segments, and this section's
#: flat parameters under any name (``flat_param``, fairscale's ``flat_param_0``).
FP_SEGMENTS: tuple[str, ...] = (*WRAPPER_SEGMENTS, "flat_param")


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shard_or_skip(ops: FlatParamOps, flat: nn.Parameter, start: int, end: int, num_padded: int) -> ShardInfo:
    try:
        return ops.shard(flat, start, end, num_padded)
    except Unsupported as exc:
        pytest.skip(f"shard metadata: {exc}")


def flatten_all(ops: FlatParamOps, module: nn.Module) -> nn.Module:
    return ops.wrap(module, list(module.parameters()))


def _wrap_nested(ops: FlatParamOps, model: nn.Module) -> nn.Module:
    """The "nested" zoo model with wrappers three deep: model > block "1" > block "1".inner."""
    block = getattr(model, "1")
    block.inner = ops.wrap(block.inner, list(block.inner.parameters()))
    model.add_module("1", ops.wrap(block, list(block.proj.parameters())))
    return ops.wrap(model, list(getattr(model, "10").parameters()))


def wrap_across_a_wrapper(ops: FlatParamOps, model: nn.Module) -> nn.Module:
    """The "nested" zoo model with block "1" wrapped around its ``proj`` alone, and the root wrapper
    listing ``1.inner``'s parameters, which then sit inside block "1"'s wrapper (under its wrapped
    module's path segment), beside block "10"'s."""
    block = getattr(model, "1")
    across = list(block.inner.parameters())
    model.add_module("1", ops.wrap(block, list(block.proj.parameters())))
    return ops.wrap(model, across + list(getattr(model, "10").parameters()))


def _wrap_by_requires_grad(ops: FlatParamOps, model: nn.Module) -> nn.Module:
    """One wrapper per requires_grad group: trainable inside, frozen outside."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return ops.wrap(ops.wrap(model, trainable), frozen)


#: How each zoo model is wrapped for the model-level tests.
WRAPPINGS: dict[str, Callable[[FlatParamOps, nn.Module], nn.Module]] = {
    name: flatten_all for name in models.ZOO
}


WRAPPINGS["nested"] = _wrap_nested


WRAPPINGS["frozen"] = _wrap_by_requires_grad


def pair(ops: FlatParamOps, name: str, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(unwrapped, wrapped) zoo models built from the same seed."""
    return models.build(name, seed=seed), WRAPPINGS[name](ops, models.build(name, seed=seed))


def flat_params(ops: FlatParamOps, model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if ops.is_flat_param(p)]


def flat_of(ops: FlatParamOps, wrapper: nn.Module) -> nn.Parameter:
    """The wrapper's flat parameter, which it must have (it flattened something)."""
    flat = ops.flat_param(wrapper)
    if flat is None:
        fail("the wrapper has no flat parameter", None, "its flat parameter")
    return flat


def wrapped_module(wrapper: nn.Module) -> nn.Module:
    """The module a wrapper wraps, as its ``module`` attribute gives it."""
    inner = wrapper.module
    assert isinstance(inner, nn.Module), f"the wrapper's module is a {type(inner).__name__}"
    return inner


def tensor_at(module: nn.Module, path: str) -> torch.Tensor:
    """The tensor attribute at the dotted ``path`` of ``module``: a parameter, or the view that a
    wrapper puts in a flattened parameter's place."""
    owner, _, name = path.rpartition(".")
    value = getattr(module.get_submodule(owner), name)
    assert isinstance(value, torch.Tensor), f"{path} is a {type(value).__name__}"
    return value


def grad_of(param: torch.Tensor, name: str) -> torch.Tensor:
    """``param.grad``, which a backward must have given it."""
    if param.grad is None:
        fail("no gradient reached the parameter", None, "a gradient", name)
    return param.grad


def plain_name(name: str) -> str:
    """A name as the unwrapped model has it: without the wrapped-module segment both shipped
    implementations use (``_fpw_module``)."""
    return name.replace("_fpw_module.", "")


def flats_with_prefix(ops: FlatParamOps, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Each flat parameter of ``model`` with the path of the module its names are relative to."""
    found = []
    for name, param in model.named_parameters():
        if ops.is_flat_param(param):
            # The wrapper's path; its wrapped module has the same path once the segment is removed.
            found.append((name.rsplit(".", 1)[0] + "." if "." in name else "", param))
    return found


def flat_keys_of(ops: FlatParamOps, model: nn.Module) -> list[list[str]]:
    """Per flat parameter of ``model``, the unwrapped keys of the parameters it holds, in flat order."""
    return [[plain_name(prefix + n) for n in ops.info(flat).names] for prefix, flat in flats_with_prefix(ops, model)]


def quoted(message: str) -> set[str]:
    return set(re.findall(r'"([^"]+)"', message))


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, weight_decay=0.01)


def unlike(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``state`` with every entry replaced by one that differs from it in every element's bits."""
    return {key: different_like(value) for key, value in state.items()}


def target_unlike(name: str, source: dict[str, Any], seed: int) -> nn.Module:
    """An unwrapped zoo model built from ``seed`` whose every state entry differs bitwise from ``source``
    (another seed alone is not enough: BatchNorm statistics, counters and edge buffers agree)."""
    model = models.build(name, seed=seed)
    model.load_state_dict(unlike(source))
    return model


def assert_differs_everywhere(got: dict[str, Any], source: dict[str, Any], what: str) -> None:
    """Precondition of a load test: every element of every entry of ``got`` differs from ``source``."""
    __tracebackhide__ = True
    for key, value in source.items():
        same = (bits(got[key]) == bits(value)).reshape(-1)
        if bool(same.any()):
            fail(f"{what}: the load target already holds source values", f"{int(same.sum())} equal elements",
                 "every element different before the load", f"[{key!r}]")


class _FlatState(NamedTuple):
    """What a "changes nothing" check needs of a flat parameter beyond its values and grad."""

    identity: int
    info: FlatParamInfo
    shard: ShardInfo | None  # None: the implementation has no shard metadata


def record_shards(ops: FlatParamOps, model: nn.Module) -> None:
    """Record a non-default shard (the second of two) on every flat parameter, where supported."""
    for flat in flat_params(ops, model):
        numel = sum(ops.info(flat).numels)
        start, end, pad = even_shards(numel, 2)[1]
        try:
            ops.shard(flat, start, end, pad)
        except Unsupported:
            return


def flat_state(ops: FlatParamOps, model: nn.Module) -> list[_FlatState]:
    states = []
    for flat in flat_params(ops, model):
        try:
            shard: ShardInfo | None = ops.shard_info(flat)
        except Unsupported:
            shard = None
        states.append(_FlatState(id(flat), ops.info(flat), shard))
    return states


def flat_metadata(ops: FlatParamOps, model: nn.Module) -> list[tuple[FlatParamInfo, ShardInfo | None]]:
    """Each flat parameter's metadata and recorded shard (what a copy or a move must keep)."""
    return [(state.info, state.shard) for state in flat_state(ops, model)]


def assert_same_flat_state(got: list[_FlatState], expected: list[_FlatState], what: str) -> None:
    __tracebackhide__ = True
    if [s.identity for s in got] != [s.identity for s in expected]:
        fail(f"{what}: the registered flat parameters are other objects (an optimizer over them is cut off)",
             [hex(s.identity) for s in got], [hex(s.identity) for s in expected])
    for i, (g, e) in enumerate(zip(got, expected)):
        if g.info != e.info:
            fail(f"{what}: flat parameter metadata changed", g.info, e.info, f"flat parameter {i}")
        if g.shard != e.shard:
            fail(f"{what}: the recorded shard changed", g.shard, e.shard, f"flat parameter {i}")


# -- parameters of one dtype holding its edge values, in the layouts that break flattening -------------


class EdgeParams(nn.Module):
    """Parameters of one dtype holding its edge values (NaN payloads, -0.0, inf, subnormals, float64
    beyond float32, int64 beyond 2**53) in every layout: a vector, a transposed (non-contiguous)
    matrix, a view at a storage offset, a 0-dim scalar and a 0-element matrix. ``forward`` returns the
    parameters' elements concatenated (pure copies), so outputs compare bit for bit."""

    def __init__(self, dtype: torch.dtype, seed: int = 0) -> None:
        super().__init__()
        values = edge_tensors(seed)[dtype_id(dtype)]  # edge values, then seeded noise
        grad = dtype.is_floating_point

        def param(data: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(data, requires_grad=grad)

        self.vector = param(values.clone())
        self.matrix = param(values.roll(3)[:12].reshape(3, 4).t())  # shape (4, 3), strides (1, 4)
        self.offset = param(torch.cat([values.flip(0), values])[5:16])  # storage offset 5
        edge = 10 if dtype.is_floating_point else 3  # an edge value: a NaN payload for floating dtypes
        self.scalar = param(values[edge].clone().reshape(()))
        self.empty = param(torch.empty(0, 2, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.vector, self.matrix.reshape(-1), self.offset, self.scalar.reshape(1), self.empty.reshape(-1)])


def bad_flat_inputs() -> list[Any]:
    p = nn.Parameter(torch.randn(3))
    return [
        pytest.param(lambda ops: [], ValueError, id="empty"),
        pytest.param(lambda ops: [p, nn.Parameter(torch.randn(2, dtype=torch.float64))], ValueError, id="mixed-dtype"),
        pytest.param(lambda ops: [p, ops.make_flat_param([nn.Parameter(torch.randn(2))])], ValueError, id="nesting"),
        pytest.param(lambda ops: (q for q in [p]), TypeError, id="generator"),
        pytest.param(lambda ops: [p, "weight"], TypeError, id="not-a-tensor"),
    ]


# -- FP-3, FP-4: shards --------------------------------------------------------------------------


def even_shards(numel: int, count: int) -> list[tuple[int, int, int]]:
    """(start, end, num_padded) of each of ``count`` equal shards, padded at the end (independent oracle)."""
    size = max(1, math.ceil(numel / count))
    shards = []
    for rank in range(count):
        start, end = rank * size, rank * size + size - 1
        real_end = min(end, numel - 1)
        shards.append((start, end, end - max(real_end, start - 1)))
    return shards


def expected_shard(names: list[str], shapes: list[torch.Size], start: int, end: int, pad: int) -> ShardInfo:
    """What a shard holds, by walking its elements one by one (no offset arithmetic shared with impls)."""
    owner: list[tuple[int, int]] = []  # flat index -> (parameter, param index)
    for i, shape in enumerate(shapes):
        owner += [(i, j) for j in range(shape.numel())]
    held: dict[int, list[int]] = {}
    for flat_index in range(start, end + 1 - pad):
        i, j = owner[flat_index]
        held.setdefault(i, []).append(j)
    order = sorted(held)
    return ShardInfo(
        tuple(names[i] for i in order),
        tuple(shapes[i] for i in order),
        tuple(shapes[i].numel() for i in order),
        tuple((min(held[i]), max(held[i])) for i in order),
        pad,
    )


def zoo_flat(ops: FlatParamOps, name: str, submodule: str = "") -> nn.Parameter:
    """The flat parameter of the trainable parameters (all but "frozen"'s stem) of a zoo model or one
    of its submodules."""
    model = models.build(name).get_submodule(submodule)
    flat = ops.flat_param(ops.wrap(model, [p for p in model.parameters() if p.requires_grad]))
    assert flat is not None
    return flat


def _flat_with_empties(ops: FlatParamOps) -> nn.Parameter:
    """A bare flat parameter with 0-element parameters between real ones: flat 0..5, (none), 6..9,
    (none), 10. An empty parameter occupies no flat index and is held by no shard."""
    shapes = [(2, 3), (0,), (4,), (3, 0), (1,)]
    return ops.make_flat_param([nn.Parameter(torch.randn(*s)) for s in shapes])


#: Flat parameters for the element-walk tests, by id.
SHARD_FLATS: dict[str, Callable[[FlatParamOps], nn.Parameter]] = {
    **{name: functools.partial(zoo_flat, name=name) for name in models.ZOO},
    "with-empty-params": _flat_with_empties,
}


def golden_table(ops: FlatParamOps, name: str, submodule: str = "") -> str:
    flat = zoo_flat(ops, name, submodule)
    numel = sum(ops.info(flat).numels)
    lines = [f"{name}{'.' + submodule if submodule else ''}: {numel} elements; param[first:last] inclusive"]
    for count in SHARD_COUNTS:
        for rank, (start, end, pad) in enumerate(even_shards(numel, count)):
            got = shard_or_skip(ops, flat, start, end, pad)
            held = ", ".join(f"{n}[{a}:{b}]" for n, (a, b) in zip(got.names, got.offsets)) or "-"
            lines.append(f"{count}x r{rank} [{start}, {end}] pad {pad}: {held}")
    return "\n".join(lines) + "\n"


def inside_container(model: nn.Module) -> nn.Module:
    """``model`` as the child ``m`` of a plain container: wrappers below the root of a load."""
    return nn.ModuleDict({"m": model})


def bad_keys(ops: FlatParamOps, model: nn.Module, prefix: str) -> tuple[list[str], list[str]]:
    """Keys to drop (the last parameter of each flat parameter, so every wrapper level has one) and
    surplus keys to add (one beside each dropped key, and one at ``prefix``, the wrappers' top)."""
    dropped = [keys[-1] for keys in flat_keys_of(ops, model)]
    beside = [key.rsplit(".", 1)[0] + ".surplus" if "." in key else "surplus" for key in dropped]
    return dropped, list(dict.fromkeys([prefix + "surplus", *beside]))


def under_wrapper_segments(key: str) -> list[str]:
    """``key`` with a wrapper's path segment (each one the suite knows) put in at every depth:
    ``1.proj.w`` -> ``_fpw_module.1.proj.w``, ``1._fpw_module.proj.w``, ``1.proj._fpw_module.w``. The
    unwrapped model has no such key, so a wrapped one must report it unexpected too, not load it into
    the module it wraps."""
    parts = key.split(".")
    return [".".join([*parts[:i], segment, *parts[i:]]) for segment in fqn.WRAPPER_SEGMENTS for i in range(len(parts))]


def reshaped(value: torch.Tensor) -> torch.Tensor:
    """``value`` with its elements in another shape: a loader that writes by element count (straight
    into the flat parameter) accepts it, one that checks shapes does not."""
    shapes = [tuple(reversed(value.shape)), (1, value.numel()), (value.numel(),)]
    return value.reshape(next(shape for shape in shapes if shape != tuple(value.shape)))


#: Per model, the entry a failed load is about: a parameter of a wrapper at the root ("mlp"), a
#: buffer ("buffers"), a parameter of the innermost of three nested wrappers ("nested"), a float64
#: parameter beside edge-value buffers ("dtypes").
FAILED_LOAD_KEYS = {
    "mlp": "net.2.weight",
    "buffers": "norm.running_var",
    "nested": "1.inner.0.bias",
    "dtypes": "proj.weight",
}


COPIES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda model: pickle.loads(pickle.dumps(model)),
    "to-float64": lambda model: model.to(torch.float64),
}


def check_views_after_unflatten(ops: FlatParamOps, wrapped: nn.Module, plain: nn.Module, *, when: str) -> None:
    """Every parameter of ``plain`` is, at its path in ``wrapped``'s module, a tensor with ``plain``'s
    values in the memory of the wrapper's flat parameter (FP-16: on exit the views are back)."""
    flat = flat_of(ops, wrapped)
    inner = wrapped_module(wrapped)
    for path, expected in plain.named_parameters():
        try:
            value = tensor_at(inner, path)
        except (AttributeError, AssertionError) as exc:
            fail(f"{path} {when}", f"{type(exc).__name__}: {exc}", "a view of the flat parameter")
        if value.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
            fail(f"{path} {when}", "a tensor outside the flat parameter's memory", "a view of the flat parameter")
        assert_bitwise_equal(value.detach(), expected.detach(), what=when, where=path)


def assert_same_versions(got: dict[str, Any], expected: dict[str, Any], *, what: str) -> None:
    """``got``'s ``_metadata`` (each module's entry, with its ``version``, by path) is ``expected``'s:
    ``load_state_dict`` hands a module the entry at its path, and modules whose saved format changed
    (``BatchNorm``'s ``num_batches_tracked``, ``MultiheadAttention``) read their version there to
    convert an older checkpoint. An entry left under a wrapper's internal path reaches no module."""
    have, want = getattr(got, "_metadata", None), getattr(expected, "_metadata", None)
    if have is None or want is None:
        if (have is None) != (want is None):
            fail(f"{what}: the state_dict's _metadata", "absent" if have is None else "present", "present" if want is not None else "absent")
        return
    if dict(have) != dict(want):
        fail(f"{what}: the state_dict's _metadata (version entries by module path)", sorted(have), sorted(want))
