"""FP: FlatParameter wrapping (``conformance/SPEC.md``, section FP).

Every test goes through :class:`~conformance.adapters.flat_param.FlatParamOps` (``ops``) and compares
against the oracle the SPEC names: the unwrapped zoo model built from the same seed, an independent
element-by-element computation of shard contents, or expecttest goldens for structure. All tests are
single-process: a FlatParameter is a local mechanism.

Habits that make these tests catch a wrong implementation (see ``conformance/asserts.py``):

- values are compared bit for bit (:func:`~conformance.asserts.assert_same_state`), so a NaN payload,
  a ``-0.0`` or a float64 squeezed through float32 is a failure;
- a load goes into a target whose every entry differs bitwise from the source
  (:func:`~conformance.values.different_like`), so "loaded" cannot pass for "left as it was";
- "changes nothing" is a deep :func:`~conformance.asserts.snapshot` (parameters, every buffer, grads)
  plus each flat parameter's identity, metadata and recorded shard;
- an error that must name a key is checked for the whole unwrapped key and for the absence of every
  wrapper segment (:func:`~conformance.asserts.assert_names_key`).
"""

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
from expecttest import assert_expected_inline

from conformance import models
from conformance.adapters.base import Adapter, Unsupported
from conformance.adapters.flat_param import FlatParamInfo, FlatParamOps, ShardInfo
from conformance.asserts import (
    WRAPPER_SEGMENTS,
    assert_bitwise_equal,
    assert_names_key,
    assert_same_state,
    assert_unchanged,
    bits,
    check_each,
    expect_error,
    fail,
    raised,
    reraise,
    snapshot,
)
from conformance.values import EDGE_DTYPES, different_like, edge_tensors

SHARD_COUNTS = (1, 2, 3, 4, 5)

#: What must never appear in a key or a message: the shared wrapper segments, and this section's
#: flat parameters under any name (``flat_param``, fairscale's ``flat_param_0``).
FP_SEGMENTS: tuple[str, ...] = (*WRAPPER_SEGMENTS, "flat_param")


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- helpers ------------------------------------------------------------------------------------


@pytest.fixture
def ops(impl: Adapter) -> FlatParamOps:
    return impl.require("flat_param")


def _shard(ops: FlatParamOps, flat: nn.Parameter, start: int, end: int, num_padded: int) -> ShardInfo:
    try:
        return ops.shard(flat, start, end, num_padded)
    except Unsupported as exc:
        pytest.skip(f"shard metadata: {exc}")


def _flatten_all(ops: FlatParamOps, module: nn.Module) -> nn.Module:
    return ops.wrap(module, list(module.parameters()))


def _wrap_nested(ops: FlatParamOps, model: nn.Module) -> nn.Module:
    """The "nested" zoo model with wrappers three deep: model > block "1" > block "1".inner."""
    block = getattr(model, "1")
    block.inner = ops.wrap(block.inner, list(block.inner.parameters()))
    model.add_module("1", ops.wrap(block, list(block.proj.parameters())))
    return ops.wrap(model, list(getattr(model, "10").parameters()))


def _wrap_by_requires_grad(ops: FlatParamOps, model: nn.Module) -> nn.Module:
    """One wrapper per requires_grad group: trainable inside, frozen outside."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return ops.wrap(ops.wrap(model, trainable), frozen)


#: How each zoo model is wrapped for the model-level tests.
WRAPPINGS: dict[str, Callable[[FlatParamOps, nn.Module], nn.Module]] = {
    name: _flatten_all for name in models.ZOO
}
WRAPPINGS["nested"] = _wrap_nested
WRAPPINGS["frozen"] = _wrap_by_requires_grad


def _pair(ops: FlatParamOps, name: str, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(unwrapped, wrapped) zoo models built from the same seed."""
    return models.build(name, seed=seed), WRAPPINGS[name](ops, models.build(name, seed=seed))


def _flat_params(ops: FlatParamOps, model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if ops.is_flat_param(p)]


def _flat(ops: FlatParamOps, wrapper: nn.Module) -> nn.Parameter:
    """The wrapper's flat parameter, which it must have (it flattened something)."""
    flat = ops.flat_param(wrapper)
    if flat is None:
        fail("the wrapper has no flat parameter", None, "its flat parameter")
    return flat


def _inner(wrapper: nn.Module) -> nn.Module:
    """The module a wrapper wraps, as its ``module`` attribute gives it."""
    inner = wrapper.module
    assert isinstance(inner, nn.Module), f"the wrapper's module is a {type(inner).__name__}"
    return inner


def _tensor(module: nn.Module, path: str) -> torch.Tensor:
    """The tensor attribute at the dotted ``path`` of ``module``: a parameter, or the view that a
    wrapper puts in a flattened parameter's place."""
    owner, _, name = path.rpartition(".")
    value = getattr(module.get_submodule(owner), name)
    assert isinstance(value, torch.Tensor), f"{path} is a {type(value).__name__}"
    return value


def _grad(param: torch.Tensor, name: str) -> torch.Tensor:
    """``param.grad``, which a backward must have given it."""
    if param.grad is None:
        fail("no gradient reached the parameter", None, "a gradient", name)
    return param.grad


def _plain_name(name: str) -> str:
    """A name as the unwrapped model has it: without the wrapped-module segment both shipped
    implementations use (``_fpw_module``)."""
    return name.replace("_fpw_module.", "")


def _flats_with_prefix(ops: FlatParamOps, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Each flat parameter of ``model`` with the path of the module its names are relative to."""
    found = []
    for name, param in model.named_parameters():
        if ops.is_flat_param(param):
            # The wrapper's path; its wrapped module has the same path once the segment is removed.
            found.append((name.rsplit(".", 1)[0] + "." if "." in name else "", param))
    return found


def _flat_keys(ops: FlatParamOps, model: nn.Module) -> list[list[str]]:
    """Per flat parameter of ``model``, the unwrapped keys of the parameters it holds, in flat order."""
    return [[_plain_name(prefix + n) for n in ops.info(flat).names] for prefix, flat in _flats_with_prefix(ops, model)]


def _quoted(message: str) -> set[str]:
    return set(re.findall(r'"([^"]+)"', message))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, weight_decay=0.01)


def _unlike(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``state`` with every entry replaced by one that differs from it in every element's bits."""
    return {key: different_like(value) for key, value in state.items()}


def _target_unlike(name: str, source: dict[str, Any], seed: int) -> nn.Module:
    """An unwrapped zoo model built from ``seed`` whose every state entry differs bitwise from ``source``
    (another seed alone is not enough: BatchNorm statistics, counters and edge buffers agree)."""
    model = models.build(name, seed=seed)
    model.load_state_dict(_unlike(source))
    return model


def _assert_differs_everywhere(got: dict[str, Any], source: dict[str, Any], what: str) -> None:
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


def _record_shards(ops: FlatParamOps, model: nn.Module) -> None:
    """Record a non-default shard (the second of two) on every flat parameter, where supported."""
    for flat in _flat_params(ops, model):
        numel = sum(ops.info(flat).numels)
        start, end, pad = _even_shards(numel, 2)[1]
        try:
            ops.shard(flat, start, end, pad)
        except Unsupported:
            return


def _flat_state(ops: FlatParamOps, model: nn.Module) -> list[_FlatState]:
    states = []
    for flat in _flat_params(ops, model):
        try:
            shard: ShardInfo | None = ops.shard_info(flat)
        except Unsupported:
            shard = None
        states.append(_FlatState(id(flat), ops.info(flat), shard))
    return states


def _flat_metadata(ops: FlatParamOps, model: nn.Module) -> list[tuple[FlatParamInfo, ShardInfo | None]]:
    """Each flat parameter's metadata and recorded shard (what a copy or a move must keep)."""
    return [(state.info, state.shard) for state in _flat_state(ops, model)]


def _assert_same_flat_state(got: list[_FlatState], expected: list[_FlatState], what: str) -> None:
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


class _EdgeParams(nn.Module):
    """Parameters of one dtype holding its edge values (NaN payloads, -0.0, inf, subnormals, float64
    beyond float32, int64 beyond 2**53) in every layout: a vector, a transposed (non-contiguous)
    matrix, a view at a storage offset, a 0-dim scalar and a 0-element matrix. ``forward`` returns the
    parameters' elements concatenated (pure copies), so outputs compare bit for bit."""

    def __init__(self, dtype: torch.dtype, seed: int = 0) -> None:
        super().__init__()
        values = edge_tensors(seed)[_dtype_id(dtype)]  # edge values, then seeded noise
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


# -- FP-1, FP-2, FP-5: the flat parameter on its own -----------------------------------------------


@pytest.mark.req("FP-1")
@pytest.mark.parametrize("requires_grad", [True, False], ids=["grad", "nograd"])
def test_flat_param_concatenates_params_in_order(ops: FlatParamOps, requires_grad: bool) -> None:
    params = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(2, 1, 3))]
    flat = ops.make_flat_param(params, requires_grad)
    assert isinstance(flat, nn.Parameter) and ops.is_flat_param(flat)
    assert flat.dim() == 1 and flat.numel() == 12 + 5 + 6
    assert flat.requires_grad is requires_grad
    assert_bitwise_equal(flat.detach(), torch.cat([p.detach().reshape(-1) for p in params]), what="flat parameter")
    info = ops.info(flat)
    assert info.shapes == (torch.Size([3, 4]), torch.Size([5]), torch.Size([2, 1, 3]))
    assert info.numels == (12, 5, 6)


@pytest.mark.req("FP-1", "FP-2", "FP-24")
@pytest.mark.parametrize("dtype", EDGE_DTYPES, ids=_dtype_id)
def test_flat_param_keeps_every_bit_and_element_order(ops: FlatParamOps, dtype: torch.dtype) -> None:
    """Flattening parameters of ``dtype`` that hold its edge values, one of them transposed and one a
    view at a storage offset: the flat parameter keeps the dtype and every bit, in each parameter's
    row-major order (``contiguous()`` order, not storage order), and its views give the parameters
    back bit for bit, over its own data and over external data."""
    module = _EdgeParams(dtype)
    # The layouts a fork's flattening gets wrong are really there.
    assert not module.matrix.is_contiguous() and module.offset.storage_offset() == 5 and module.scalar.dim() == 0
    params = list(module.parameters())
    flat = ops.make_flat_param(params, requires_grad=dtype.is_floating_point)
    # Row-major element order of each parameter, independently of how it is laid out in memory.
    expected = torch.cat([p.detach().contiguous().view(-1) for p in params])
    assert_bitwise_equal(flat.detach(), expected, what=f"flat parameter of {_dtype_id(dtype)} parameters")
    assert ops.info(flat).shapes == tuple(p.shape for p in params)
    views = ops.param_views(flat)
    for i, (view, param) in enumerate(zip(views, params)):
        assert_bitwise_equal(view.detach(), param.detach(), what="get_param_views()", where=f"view {i}")
    assert len(views) == len(params)
    external = different_like(flat)
    offset = 0
    for i, (view, param) in enumerate(zip(ops.param_views(flat, external), params)):
        piece = external[offset : offset + param.numel()].view(param.shape)
        assert_bitwise_equal(view, piece, what="get_param_views(external_data)", where=f"view {i}")
        offset += param.numel()


@pytest.mark.req("FP-2")
def test_param_views_alias_the_flat_param(ops: FlatParamOps) -> None:
    params = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5))]
    flat = ops.make_flat_param(params)
    views = ops.param_views(flat)
    assert [v.shape for v in views] == [p.shape for p in params]
    for view, param in zip(views, params):
        assert torch.equal(view, param)
    with torch.no_grad():
        flat.fill_(2.5)
    assert all(bool((v == 2.5).all()) for v in views), "views do not share the flat parameter's memory"
    external = torch.arange(17.0)
    ext_views = ops.param_views(flat, external)
    assert torch.equal(ext_views[0], external[:12].view(3, 4)) and torch.equal(ext_views[1], external[12:])
    assert ext_views[1].untyped_storage().data_ptr() == external.untyped_storage().data_ptr()


@pytest.mark.req("FP-2")
@pytest.mark.parametrize("numel", [16, 18, 0])
def test_param_views_of_wrong_size_is_value_error(ops: FlatParamOps, numel: int) -> None:
    flat = ops.make_flat_param([nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5))])
    with pytest.raises(ValueError, match="17"):
        ops.param_views(flat, torch.zeros(numel))


def _bad_flat_inputs() -> list[Any]:
    p = nn.Parameter(torch.randn(3))
    return [
        pytest.param(lambda ops: [], ValueError, id="empty"),
        pytest.param(lambda ops: [p, nn.Parameter(torch.randn(2, dtype=torch.float64))], ValueError, id="mixed-dtype"),
        pytest.param(lambda ops: [p, ops.make_flat_param([nn.Parameter(torch.randn(2))])], ValueError, id="nesting"),
        pytest.param(lambda ops: (q for q in [p]), TypeError, id="generator"),
        pytest.param(lambda ops: [p, "weight"], TypeError, id="not-a-tensor"),
    ]


@pytest.mark.req("FP-5")
@pytest.mark.parametrize("make_params, error", _bad_flat_inputs())
def test_bad_flat_param_input_is_rejected(ops: FlatParamOps, make_params: Callable, error: type) -> None:
    with pytest.raises(error) as info:
        ops.make_flat_param(make_params(ops))
    assert str(info.value), "the error has no message"


# -- FP-3, FP-4: shards --------------------------------------------------------------------------


def _even_shards(numel: int, count: int) -> list[tuple[int, int, int]]:
    """(start, end, num_padded) of each of ``count`` equal shards, padded at the end (independent oracle)."""
    size = max(1, math.ceil(numel / count))
    shards = []
    for rank in range(count):
        start, end = rank * size, rank * size + size - 1
        real_end = min(end, numel - 1)
        shards.append((start, end, end - max(real_end, start - 1)))
    return shards


def _expected_shard(names: list[str], shapes: list[torch.Size], start: int, end: int, pad: int) -> ShardInfo:
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


def _zoo_flat(ops: FlatParamOps, name: str, submodule: str = "") -> nn.Parameter:
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
    **{name: functools.partial(_zoo_flat, name=name) for name in models.ZOO},
    "with-empty-params": _flat_with_empties,
}


@pytest.mark.req("FP-3")
@pytest.mark.parametrize("name", list(SHARD_FLATS))
@pytest.mark.parametrize("count", SHARD_COUNTS, ids=[f"{c}shards" for c in SHARD_COUNTS])
def test_even_shards_match_element_walk(ops: FlatParamOps, name: str, count: int) -> None:
    flat = SHARD_FLATS[name](ops)
    info = ops.info(flat)
    numel = sum(info.numels)
    covered = {n: 0 for n in info.names}
    for start, end, pad in _even_shards(numel, count):
        got = _shard(ops, flat, start, end, pad)
        want = _expected_shard(list(info.names), list(info.shapes), start, end, pad)
        if got != want:
            fail("shard metadata differs from the element walk", got, want, f"shard [{start}, {end}] pad {pad} of {name}")
        for n, (first, last) in zip(got.names, got.offsets):
            covered[n] += last - first + 1
    assert covered == dict(zip(info.names, info.numels)), f"the {count} shards do not cover each parameter once"


@pytest.mark.req("FP-3")
def test_shard_defaults_to_whole_flat_param(ops: FlatParamOps) -> None:
    flat = _zoo_flat(ops, "mlp")
    info = ops.info(flat)
    try:
        got = ops.shard_info(flat)
    except Unsupported as exc:
        pytest.skip(f"shard metadata: {exc}")
    assert got == _expected_shard(list(info.names), list(info.shapes), 0, sum(info.numels) - 1, 0)


# tiny: a.weight (6 elements, flat 0..5), b.weight (3, flat 6..8), b.bias (1, flat 9); 10 elements.
TINY_SHARDS = [
    pytest.param("tiny", 0, 0, 0, id="tiny-single-first-element"),
    pytest.param("tiny", 5, 5, 0, id="tiny-single-last-element-of-a-param"),
    pytest.param("tiny", 6, 6, 0, id="tiny-single-first-element-of-a-param"),
    pytest.param("tiny", 9, 9, 0, id="tiny-single-last-element"),
    pytest.param("tiny", 0, 5, 0, id="tiny-ends-at-param-boundary"),
    pytest.param("tiny", 6, 8, 0, id="tiny-exactly-one-param"),
    pytest.param("tiny", 5, 6, 0, id="tiny-straddles-boundary"),
    pytest.param("tiny", 3, 8, 0, id="tiny-mid-param-to-boundary"),
    pytest.param("tiny", 4, 9, 0, id="tiny-mid-param-to-end"),
    pytest.param("tiny", 2, 3, 0, id="tiny-inside-one-param"),
    pytest.param("tiny", 9, 12, 3, id="tiny-last-element-then-padding"),
    pytest.param("tiny", 0, 11, 2, id="tiny-whole-then-padding"),
    pytest.param("tiny", 10, 13, 4, id="tiny-all-padding"),
    pytest.param("tiny", 10, 10, 1, id="tiny-single-padding-element"),
]
# with-empty-params: "0" flat 0..5, "1" empty, "2" flat 6..9, "3" empty, "4" flat 10; 11 elements.
EMPTY_PARAM_SHARDS = [
    pytest.param("with-empty-params", 0, 5, 0, id="empties-ends-before-empty-param"),
    pytest.param("with-empty-params", 5, 6, 0, id="empties-straddles-empty-param"),
    pytest.param("with-empty-params", 6, 9, 0, id="empties-starts-after-empty-param"),
    pytest.param("with-empty-params", 9, 10, 0, id="empties-straddles-second-empty-param"),
    pytest.param("with-empty-params", 10, 12, 2, id="empties-last-element-then-padding"),
]


@pytest.mark.req("FP-3")
@pytest.mark.parametrize("flat_name, start, end, pad", TINY_SHARDS + EMPTY_PARAM_SHARDS)
def test_irregular_shards_match_element_walk(ops: FlatParamOps, flat_name: str, start: int, end: int, pad: int) -> None:
    """Shards a fork's offset arithmetic gets wrong (off by one at a parameter boundary, a shard that
    starts mid-parameter, is one element, is all padding, or meets an empty parameter) hold exactly
    what walking their elements one by one says."""
    flat = SHARD_FLATS[flat_name](ops)
    info = ops.info(flat)
    got = _shard(ops, flat, start, end, pad)
    want = _expected_shard(list(info.names), list(info.shapes), start, end, pad)
    if got != want:
        fail("shard metadata differs from the element walk", got, want, f"shard [{start}, {end}] pad {pad} of {flat_name}")


def _golden_table(ops: FlatParamOps, name: str, submodule: str = "") -> str:
    flat = _zoo_flat(ops, name, submodule)
    numel = sum(ops.info(flat).numels)
    lines = [f"{name}{'.' + submodule if submodule else ''}: {numel} elements; param[first:last] inclusive"]
    for count in SHARD_COUNTS:
        for rank, (start, end, pad) in enumerate(_even_shards(numel, count)):
            got = _shard(ops, flat, start, end, pad)
            held = ", ".join(f"{n}[{a}:{b}]" for n, (a, b) in zip(got.names, got.offsets)) or "-"
            lines.append(f"{count}x r{rank} [{start}, {end}] pad {pad}: {held}")
    return "\n".join(lines) + "\n"


@pytest.mark.req("FP-3")
def test_shard_metadata_golden_tiny(ops: FlatParamOps) -> None:
    assert_expected_inline(
        _golden_table(ops, "tiny"),
        """\
tiny: 10 elements; param[first:last] inclusive
1x r0 [0, 9] pad 0: a.weight[0:5], b.weight[0:2], b.bias[0:0]
2x r0 [0, 4] pad 0: a.weight[0:4]
2x r1 [5, 9] pad 0: a.weight[5:5], b.weight[0:2], b.bias[0:0]
3x r0 [0, 3] pad 0: a.weight[0:3]
3x r1 [4, 7] pad 0: a.weight[4:5], b.weight[0:1]
3x r2 [8, 11] pad 2: b.weight[2:2], b.bias[0:0]
4x r0 [0, 2] pad 0: a.weight[0:2]
4x r1 [3, 5] pad 0: a.weight[3:5]
4x r2 [6, 8] pad 0: b.weight[0:2]
4x r3 [9, 11] pad 2: b.bias[0:0]
5x r0 [0, 1] pad 0: a.weight[0:1]
5x r1 [2, 3] pad 0: a.weight[2:3]
5x r2 [4, 5] pad 0: a.weight[4:5]
5x r3 [6, 7] pad 0: b.weight[0:1]
5x r4 [8, 9] pad 0: b.weight[2:2], b.bias[0:0]
""",
    )


@pytest.mark.req("FP-3")
def test_shard_metadata_golden_all_padding_shards(ops: FlatParamOps) -> None:
    # 4 elements: at 3 and 5 shards the last shards are all padding and hold no parameter.
    assert_expected_inline(
        _golden_table(ops, "tiny", "b"),
        """\
tiny.b: 4 elements; param[first:last] inclusive
1x r0 [0, 3] pad 0: weight[0:2], bias[0:0]
2x r0 [0, 1] pad 0: weight[0:1]
2x r1 [2, 3] pad 0: weight[2:2], bias[0:0]
3x r0 [0, 1] pad 0: weight[0:1]
3x r1 [2, 3] pad 0: weight[2:2], bias[0:0]
3x r2 [4, 5] pad 2: -
4x r0 [0, 0] pad 0: weight[0:0]
4x r1 [1, 1] pad 0: weight[1:1]
4x r2 [2, 2] pad 0: weight[2:2]
4x r3 [3, 3] pad 0: bias[0:0]
5x r0 [0, 0] pad 0: weight[0:0]
5x r1 [1, 1] pad 0: weight[1:1]
5x r2 [2, 2] pad 0: weight[2:2]
5x r3 [3, 3] pad 0: bias[0:0]
5x r4 [4, 4] pad 1: -
""",
    )


@pytest.mark.req("FP-3")
def test_shard_metadata_golden_tied(ops: FlatParamOps) -> None:
    assert_expected_inline(
        _golden_table(ops, "tied"),
        """\
tied: 108 elements; param[first:last] inclusive
1x r0 [0, 107] pad 0: embed.weight[0:65], body.weight[0:35], body.bias[0:5]
2x r0 [0, 53] pad 0: embed.weight[0:53]
2x r1 [54, 107] pad 0: embed.weight[54:65], body.weight[0:35], body.bias[0:5]
3x r0 [0, 35] pad 0: embed.weight[0:35]
3x r1 [36, 71] pad 0: embed.weight[36:65], body.weight[0:5]
3x r2 [72, 107] pad 0: body.weight[6:35], body.bias[0:5]
4x r0 [0, 26] pad 0: embed.weight[0:26]
4x r1 [27, 53] pad 0: embed.weight[27:53]
4x r2 [54, 80] pad 0: embed.weight[54:65], body.weight[0:14]
4x r3 [81, 107] pad 0: body.weight[15:35], body.bias[0:5]
5x r0 [0, 21] pad 0: embed.weight[0:21]
5x r1 [22, 43] pad 0: embed.weight[22:43]
5x r2 [44, 65] pad 0: embed.weight[44:65]
5x r3 [66, 87] pad 0: body.weight[0:21]
5x r4 [88, 109] pad 2: body.weight[22:35], body.bias[0:5]
""",
    )


@pytest.mark.req("FP-4")
@pytest.mark.parametrize(
    "args, error",
    [
        pytest.param((-1, 3, 0), ValueError, id="negative-start"),
        pytest.param((5, 4, 0), ValueError, id="end-before-start"),
        pytest.param((0, 3, 5), ValueError, id="padding-larger-than-shard"),
        pytest.param((0, 3, -1), ValueError, id="negative-padding"),
        pytest.param((0, 3, 2), ValueError, id="padding-before-the-end"),
        pytest.param((8, 11, 1), ValueError, id="too-little-padding"),
        pytest.param((8, 11, 3), ValueError, id="too-much-padding"),
        pytest.param((10, 10, 0), ValueError, id="past-the-end-unpadded"),
        pytest.param((0.0, 3, 0), TypeError, id="float-start"),
        pytest.param((0, 3.0, 0), TypeError, id="float-end"),
        pytest.param((0, 3, "0"), TypeError, id="str-padding"),
    ],
)
def test_bad_shard_is_rejected_and_changes_nothing(ops: FlatParamOps, args: tuple, error: type) -> None:
    """A rejected ``shard_by_offsets`` raises the SPEC's type and leaves the flat parameter (values,
    grad, metadata) and its recorded shard exactly as they were."""
    wrapped = _flatten_all(ops, models.build("tiny"))
    flat = _flat(ops, wrapped)
    models.loss(wrapped(models.batch("tiny"))).backward()
    _shard(ops, flat, 4, 7, 0)
    before, flats_before = snapshot(model=wrapped), _flat_state(ops, wrapped)
    expect_error(lambda: ops.shard(flat, *args), error, what=f"shard_by_offsets{args}")
    assert_unchanged(before, model=wrapped, where=f"after shard_by_offsets{args}")
    _assert_same_flat_state(_flat_state(ops, wrapped), flats_before, f"after shard_by_offsets{args}")


# -- FP-6 .. FP-11: the wrapper ---------------------------------------------------------------------


@pytest.mark.req("FP-6")
@pytest.mark.parametrize("name", list(models.ZOO))
def test_wrapped_model_computes_the_same(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = _pair(ops, name)
    flats = _flat_params(ops, wrapped)
    assert flats, "no flat parameter registered"
    assert [p for p in wrapped.parameters() if not ops.is_flat_param(p)] == [], "a listed parameter is still registered"
    unique = {id(p): p for p in plain.parameters()}
    assert sum(f.numel() for f in flats) == sum(p.numel() for p in unique.values())
    x = models.batch(name)
    assert_bitwise_equal(wrapped(x), plain(x), what=f"output of wrapped {name}")


@pytest.mark.req("FP-6")
def test_unlisted_params_stay_registered(ops: FlatParamOps) -> None:
    model = models.build("mlp")
    head = model.get_submodule("net.4")
    listed = [p for n, p in model.named_parameters() if not n.startswith("net.4.")]
    wrapped = ops.wrap(model, listed)
    others = [p for p in wrapped.parameters() if not ops.is_flat_param(p)]
    assert len(others) == 2 and others[0] is head.weight and others[1] is head.bias
    x = models.batch("mlp")
    assert torch.equal(wrapped(x), models.build("mlp")(x))


@pytest.mark.req("FP-7")
def test_attributes_are_views_of_the_flat_param(ops: FlatParamOps) -> None:
    plain, wrapped = _pair(ops, "mlp")
    flat = _flat(ops, wrapped)
    first = _tensor(wrapped, "module.net.0.weight")
    assert first.shape == plain.get_parameter("net.0.weight").shape and torch.equal(first, plain.get_parameter("net.0.weight"))
    assert first.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    with torch.no_grad():
        flat.mul_(0.5)
        for p in plain.parameters():
            p.mul_(0.5)
    x = models.batch("mlp")
    assert torch.equal(wrapped(x), plain(x))
    assert torch.equal(_tensor(wrapped, "module.net.2.bias"), plain.get_parameter("net.2.bias"))


@pytest.mark.req("FP-8")
@pytest.mark.parametrize("name", ["mlp", "tied", "buffers", "nested", "tiny", "dtypes"])
def test_grad_reaches_flat_param(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = _pair(ops, name)
    x = models.batch(name)
    models.loss(plain(x)).backward()
    models.loss(wrapped(x)).backward()
    grads = dict(plain.named_parameters())
    for prefix, flat in _flats_with_prefix(ops, wrapped):
        assert flat.grad is not None, "no gradient reached the flat parameter"
        names = [_plain_name(prefix + n) for n in ops.info(flat).names]
        want = torch.cat([_grad(grads[n], n).reshape(-1) for n in names])
        assert_bitwise_equal(flat.grad, want, what=f"flat grad vs unwrapped grads of {names}")


@pytest.mark.req("FP-8")
@pytest.mark.parametrize("name", list(models.ZOO))
def test_training_matches_unwrapped(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = _pair(ops, name)
    opt_plain, opt_wrapped = _sgd(plain), _sgd(wrapped)
    for step in range(3):
        x = models.batch(name, seed=step)
        models.train_step(plain, opt_plain, x)
        models.train_step(wrapped, opt_wrapped, x)
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what=f"{name} after 3 SGD steps")


@pytest.mark.req("FP-9")
def test_tied_params_are_flattened_once(ops: FlatParamOps) -> None:
    plain, wrapped = _pair(ops, "tied")
    flat = _flat(ops, wrapped)
    names = ops.info(flat).names
    assert "embed.weight" in names and "head.weight" not in names, f"tied weight flattened as {names}"
    assert flat.numel() == sum(p.numel() for p in plain.parameters())  # parameters() yields a tied one once
    module = _inner(wrapped)
    assert _tensor(module, "embed.weight") is _tensor(module, "head.weight"), "the tied names do not share one view"
    with torch.no_grad():
        flat.add_(1.0)
    assert torch.equal(_tensor(module, "head.weight"), plain.get_parameter("embed.weight") + 1.0)
    sd = wrapped.state_dict()
    assert {"embed.weight", "head.weight"} <= set(sd) and torch.equal(sd["embed.weight"], sd["head.weight"])


@pytest.mark.req("FP-10")
@pytest.mark.parametrize("name", ["mlp", "buffers"])
def test_empty_param_list_is_transparent(ops: FlatParamOps, name: str) -> None:
    plain, model = models.build(name), models.build(name)
    before = list(model.named_parameters())
    wrapped = ops.wrap(model, [])
    assert ops.flat_param(wrapped) is None
    after = list(model.named_parameters())
    assert [n for n, _ in after] == [n for n, _ in before] and all(a is b for (_, a), (_, b) in zip(after, before))
    assert [p for p in wrapped.parameters()] == [p for _, p in before]
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what=f"{name} wrapped with no parameters")
    x = models.batch(name)
    assert torch.equal(wrapped(x), plain(x))


@pytest.mark.req("FP-11")
def test_attributes_and_indexing_fall_through(ops: FlatParamOps) -> None:
    model = models.build("mlp")
    wrapped = _flatten_all(ops, model)
    assert wrapped.module is model
    assert wrapped.net is model.net
    seq = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    wrapped_seq = _flatten_all(ops, seq)
    assert wrapped_seq[1] is seq[1]  # type: ignore[index]  # the wrapper's indexing is the test (nn.Module declares none)
    with pytest.raises(AttributeError):
        wrapped.no_such_attribute


# -- FP-12 .. FP-15: state_dict and load_state_dict -------------------------------------------------


@pytest.mark.req("FP-12")
@pytest.mark.parametrize("name", list(models.ZOO))
def test_state_dict_has_unwrapped_keys_and_values(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = _pair(ops, name)
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what=f"{name} state_dict")


@pytest.mark.req("FP-12")
@pytest.mark.parametrize("name", ["mlp", "nested", "frozen"])
def test_state_dict_of_model_containing_wrappers(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = _pair(ops, name)
    stem = nn.Linear(2, 2)
    outer_plain = nn.ModuleDict({"stem": stem, "body": plain})
    outer_wrapped = nn.ModuleDict({"stem": copy.deepcopy(stem), "body": wrapped})
    assert_same_state(outer_wrapped.state_dict(), outer_plain.state_dict(), what=f"{name} inside a ModuleDict")


def _inside(model: nn.Module) -> nn.Module:
    """``model`` as the child ``m`` of a plain container: wrappers below the root of a load."""
    return nn.ModuleDict({"m": model})


@pytest.mark.req("FP-13", "FP-25")
@pytest.mark.parametrize("name", list(models.ZOO))
@pytest.mark.parametrize("where", ["root", "inside"])
def test_load_round_trips_with_unwrapped(ops: FlatParamOps, name: str, where: str) -> None:
    """Both directions, strict and not, the wrapped model at the root of the load or inside a plain
    container, into a target whose every entry (parameters and buffers of every dtype) differs
    bitwise from the source: afterwards the target's state_dict is the source's bit for bit, each flat
    parameter holds the source values in flat order (the load wrote through), the outputs agree, and
    an optimizer built over the target before the load trains it as the source trains."""
    place = _inside if where == "inside" else (lambda model: model)
    for strict in (True, False):
        what = f"{name} ({where}, strict={strict})"
        source = models.build(name, seed=1)
        source_sd = place(source).state_dict()
        wrapped = WRAPPINGS[name](ops, _target_unlike(name, source.state_dict(), seed=0))
        target = place(wrapped)
        _assert_differs_everywhere(target.state_dict(), source_sd, f"wrapped {what}")
        optimizer = _sgd(wrapped)
        flats_before = _flat_state(ops, wrapped)

        result = target.load_state_dict(source_sd, strict=strict)
        assert (list(result.missing_keys), list(result.unexpected_keys)) == ([], []), f"load reported {result}"
        _assert_same_flat_state(_flat_state(ops, wrapped), flats_before, f"after a load ({what})")
        assert_same_state(target.state_dict(), source_sd, what=f"wrapped {what} after loading an unwrapped state_dict")
        values = dict(source.named_parameters(remove_duplicate=False))
        for keys, flat in zip(_flat_keys(ops, wrapped), _flat_params(ops, wrapped)):
            held = torch.cat([values[k].detach().reshape(-1) for k in keys])
            assert_bitwise_equal(flat.detach(), held, what=f"flat parameter after the load ({what})",
                                 where=f"holding {keys}")
        x = models.batch(name)
        assert_bitwise_equal(wrapped(x), source(x), what=f"output of wrapped {what} after the load")
        if strict:  # the optimizer's view of the load does not depend on strictness: one step is enough
            models.train_step(source, _sgd(source), x)
            models.train_step(wrapped, optimizer, x)
            assert_same_state(wrapped.state_dict(), source.state_dict(),
                              what=f"{what}: a step after the load (optimizer built before it)")

        unwrapped_source = models.build(name, seed=3)
        wrapped_sd = place(WRAPPINGS[name](ops, models.build(name, seed=3))).state_dict()
        back = _target_unlike(name, unwrapped_source.state_dict(), seed=2)
        result = place(back).load_state_dict(wrapped_sd, strict=strict)
        assert (list(result.missing_keys), list(result.unexpected_keys)) == ([], []), f"load reported {result}"
        assert_same_state(back.state_dict(), unwrapped_source.state_dict(), what=f"unwrapped {what} loaded from wrapped")


@pytest.mark.req("FP-7", "FP-12", "FP-13", "FP-16", "FP-24")
@pytest.mark.parametrize("dtype", EDGE_DTYPES, ids=_dtype_id)
def test_wrapper_round_trips_every_bit(ops: FlatParamOps, dtype: torch.dtype) -> None:
    """A module whose parameters of ``dtype`` hold its edge values in every layout (transposed, at a
    storage offset, 0-dim, 0-element), wrapped whole: the outputs, state_dict, the parameters inside
    ``unflatten_params()``, a load of bitwise-different values (both directions) and the state after
    leaving ``unflatten_params()`` all agree with the unwrapped module bit for bit."""
    plain, wrapped = _EdgeParams(dtype), _flatten_all(ops, _EdgeParams(dtype))
    what = f"{_dtype_id(dtype)} edge values"
    x = torch.zeros(1)
    assert_bitwise_equal(wrapped(x), plain(x), what=f"output ({what})")
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what=f"state_dict ({what})")

    before = snapshot(model=wrapped)
    with ops.unflatten_params(wrapped):
        inside = dict(_inner(wrapped).named_parameters())
        assert list(inside) == [n for n, _ in plain.named_parameters()], "parameter names inside unflatten_params()"
        for key, param in plain.named_parameters():
            assert type(inside[key]) is nn.Parameter, f"{key} inside unflatten_params() is a {type(inside[key]).__name__}"
            assert inside[key].requires_grad == param.requires_grad, f"{key} inside unflatten_params(): requires_grad"
            assert_bitwise_equal(inside[key].detach(), param.detach(), what=f"inside unflatten_params() ({what})", where=key)
    assert_unchanged(before, model=wrapped, where="after leaving unflatten_params()")

    source = _unlike(plain.state_dict())
    wrapped.load_state_dict(source)
    assert_same_state(wrapped.state_dict(), source, what=f"wrapped state_dict after a load ({what})")
    loaded = torch.cat([v.reshape(-1) for v in source.values()])
    assert_bitwise_equal(wrapped(x), loaded, what=f"output after a load ({what})")
    back = _EdgeParams(dtype)
    back.load_state_dict(wrapped.state_dict())
    assert_same_state(back.state_dict(), source, what=f"unwrapped state_dict loaded from the wrapped one ({what})")


@pytest.mark.req("FP-13")
@pytest.mark.parametrize("name", ["mlp", "nested", "buffers", "dtypes"])
def test_non_strict_load_reports_like_unwrapped(ops: FlatParamOps, name: str) -> None:
    """A partial, over-full non-strict load into targets unlike the source: the entries given are
    loaded, the others keep the target's values, exactly as in the unwrapped model."""
    source = models.build(name, seed=1).state_dict()
    partial = {k: v for i, (k, v) in enumerate(source.items()) if i % 2 == 0}
    partial["extra.weight"] = torch.zeros(1)
    plain = _target_unlike(name, source, seed=0)
    wrapped = WRAPPINGS[name](ops, _target_unlike(name, source, seed=0))
    want = plain.load_state_dict(dict(partial), strict=False)
    got = wrapped.load_state_dict(dict(partial), strict=False)
    assert sorted(got.missing_keys) == sorted(want.missing_keys)
    assert sorted(got.unexpected_keys) == sorted(want.unexpected_keys)
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what=f"{name} after a non-strict partial load")


@pytest.mark.req("FP-9", "FP-13")
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_load_of_differing_tied_entries_matches_unwrapped(ops: FlatParamOps, strict: bool) -> None:
    """A state_dict whose two entries of a tied parameter differ (written by hand, or by a model that
    was untied) loads into the wrapped model as into the unwrapped one: both names are loaded in
    order, so the later entry wins, for both names; a loader that reads one name per flat slot does not."""
    source = _unlike(models.build("tied", seed=1).state_dict())
    source["head.weight"] = different_like(source["embed.weight"])
    plain = models.build("tied")
    wrapped = WRAPPINGS["tied"](ops, models.build("tied"))
    plain.load_state_dict(dict(source), strict=strict)
    wrapped.load_state_dict(dict(source), strict=strict)
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what="tied model after loading differing tied entries")


def _bad_keys(ops: FlatParamOps, model: nn.Module, prefix: str) -> tuple[list[str], list[str]]:
    """Keys to drop (the last parameter of each flat parameter, so every wrapper level has one) and
    surplus keys to add (one beside each dropped key, and one at ``prefix``, the wrappers' top)."""
    dropped = [keys[-1] for keys in _flat_keys(ops, model)]
    beside = [key.rsplit(".", 1)[0] + ".surplus" if "." in key else "surplus" for key in dropped]
    return dropped, list(dict.fromkeys([prefix + "surplus", *beside]))


@pytest.mark.req("FP-14")
@pytest.mark.parametrize("name", ["mlp", "nested", "frozen", "buffers"])
@pytest.mark.parametrize("where", ["root", "inside"])
def test_strict_load_names_original_keys(ops: FlatParamOps, name: str, where: str) -> None:
    """One key dropped inside every wrapper (nested ones too) and surplus keys beside them, with the
    wrapper at the root and inside a ModuleDict: the strict error names every one by its whole
    unwrapped key, names the same keys as the unwrapped model, and shows no wrapper segment; a
    non-strict load reports the same missing and unexpected keys as the unwrapped model."""
    plain, wrapped = _pair(ops, name)
    prefix = "m." if where == "inside" else ""
    if where == "inside":
        plain, wrapped = _inside(plain), _inside(wrapped)
    dropped, unexpected = _bad_keys(ops, wrapped, prefix)
    bad = {k: v for k, v in plain.state_dict().items() if k not in dropped}
    bad.update({k: torch.zeros(1) for k in unexpected})
    want = raised(lambda: plain.load_state_dict(dict(bad)))
    assert isinstance(want, RuntimeError), f"the unwrapped model did not reject the bad dict: {want!r}"
    got = expect_error(lambda: wrapped.load_state_dict(dict(bad)), RuntimeError, what="strict load")
    for key in dropped + unexpected:
        assert_names_key(str(got), key, what="strict load error", forbidden=FP_SEGMENTS)
    if _quoted(str(got)) != _quoted(str(want)):
        fail("the wrapped model names other keys than the unwrapped one",
             sorted(_quoted(str(got))), sorted(_quoted(str(want))))

    plain_result = plain.load_state_dict(dict(bad), strict=False)
    result = wrapped.load_state_dict(dict(bad), strict=False)
    assert_same_state(sorted(result.missing_keys), sorted(plain_result.missing_keys), what="non-strict missing_keys")
    assert_same_state(sorted(result.unexpected_keys), sorted(plain_result.unexpected_keys),
                      what="non-strict unexpected_keys")


def _reshaped(value: torch.Tensor) -> torch.Tensor:
    """``value`` with its elements in another shape: a loader that writes by element count (straight
    into the flat parameter) accepts it, one that checks shapes does not."""
    shapes = [tuple(reversed(value.shape)), (1, value.numel()), (value.numel(),)]
    return value.reshape(next(shape for shape in shapes if shape != tuple(value.shape)))


@pytest.mark.req("FP-26")
@pytest.mark.parametrize("name", ["mlp", "nested", "frozen", "buffers"])
@pytest.mark.parametrize("where", ["root", "inside"])
def test_wrong_shape_names_original_key(ops: FlatParamOps, name: str, where: str) -> None:
    """One entry of every flat parameter (nested wrappers too) given with the right number of
    elements in another shape, the wrapper at the root and inside a ModuleDict, strict and not: a
    RuntimeError names each of them by its whole unwrapped key, with no wrapper segment, as the
    unwrapped model does."""
    plain, wrapped = _pair(ops, name)
    if where == "inside":
        plain, wrapped = _inside(plain), _inside(wrapped)
    keys = [flat_keys[0] for flat_keys in _flat_keys(ops, wrapped)]
    bad = dict(plain.state_dict())
    bad.update({key: _reshaped(bad[key]) for key in keys})
    for strict in (True, False):
        want = raised(lambda: plain.load_state_dict(dict(bad), strict=strict))
        assert isinstance(want, RuntimeError), f"the unwrapped model did not reject the bad dict: {want!r}"
        got = expect_error(lambda: wrapped.load_state_dict(dict(bad), strict=strict), RuntimeError,
                           what=f"load with wrong shapes (strict={strict})")
        for key in keys:
            assert_names_key(str(got), key, what=f"wrong-shape load error (strict={strict})", forbidden=FP_SEGMENTS)


#: Per model, the entry a failed load is about: a parameter of a wrapper at the root ("mlp"), a
#: buffer ("buffers"), a parameter of the innermost of three nested wrappers ("nested"), a float64
#: parameter beside edge-value buffers ("dtypes").
FAILED_LOAD_KEYS = {
    "mlp": "net.2.weight",
    "buffers": "norm.running_var",
    "nested": "1.inner.0.bias",
    "dtypes": "proj.weight",
}


@pytest.mark.req("FP-15", "FP-25")
@pytest.mark.parametrize("problem", ["wrong-shape", "missing", "unexpected"])
@pytest.mark.parametrize("name", list(FAILED_LOAD_KEYS))
def test_failed_direct_load_changes_nothing(ops: FlatParamOps, name: str, problem: str) -> None:
    """A load whose every other entry differs bitwise from the model's fails on one key (a value of
    the right number of elements in another shape, a missing or a surplus key): a RuntimeError names
    that key whole, and the model is deeply unchanged (parameters, every buffer, grads, the same flat
    parameter objects with their metadata and recorded shard, the same outputs)."""
    wrapped = WRAPPINGS[name](ops, models.build(name))
    key = FAILED_LOAD_KEYS[name]
    x = models.batch(name)
    models.loss(wrapped(x)).backward()
    _record_shards(ops, wrapped)
    bad = _unlike(wrapped.state_dict())
    if problem == "wrong-shape":
        bad[key] = _reshaped(bad[key])
    elif problem == "missing":
        del bad[key]
    else:
        key = key.rsplit(".", 1)[0] + ".surplus"
        bad[key] = torch.zeros(1)
    with torch.no_grad():
        out_before = wrapped(x)
    before, flats_before = snapshot(model=wrapped), _flat_state(ops, wrapped)
    exc = raised(lambda: wrapped.load_state_dict(bad))

    def unchanged() -> None:
        assert_unchanged(before, model=wrapped, where=f"after a failed load ({problem} {key!r})")
        _assert_same_flat_state(_flat_state(ops, wrapped), flats_before, "after a failed load")

    check_each(raises=lambda: expect_error(lambda: reraise(exc), RuntimeError, keys=[key], what=f"load with a {problem} entry"),
               unchanged=unchanged)
    with torch.no_grad():
        assert_bitwise_equal(wrapped(x), out_before, what="output after a failed load")


# -- FP-16, FP-17: unflatten_params -------------------------------------------------------------------


@pytest.mark.req("FP-16")
@pytest.mark.parametrize("name", ["mlp", "tied", "nested"])
def test_unflatten_params_restores_real_params(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = _pair(ops, name)
    before = snapshot(model=wrapped)
    with ops.unflatten_params(wrapped):
        inner_flats = _flat_params(ops, _inner(wrapped))
        assert bool(inner_flats) == (name == "nested"), "only the wrappers nested inside stay flattened"
        outer_flats = [p for p in wrapped.parameters(recurse=False) if ops.is_flat_param(p)]
        assert outer_flats == [], "the flat parameter is still registered inside unflatten_params()"
        own = dict(_inner(wrapped).named_parameters())
        for key, param in plain.named_parameters():
            if key in own:
                assert type(own[key]) is nn.Parameter
                assert_bitwise_equal(own[key].detach(), param.detach(), what="inside unflatten_params()", where=key)
        if name == "mlp":
            assert [k for k, _ in _inner(wrapped).named_parameters()] == [k for k, _ in plain.named_parameters()]
    assert _flat_params(ops, wrapped)
    assert_unchanged(before, model=wrapped, where="after leaving unflatten_params() untouched")
    x = models.batch(name)
    assert torch.equal(wrapped(x), plain(x))


@pytest.mark.req("FP-16")
@pytest.mark.parametrize("how", ["in-place", "assigned"])
def test_changes_inside_unflatten_params_are_kept(ops: FlatParamOps, how: str) -> None:
    plain, wrapped = _pair(ops, "mlp")
    with ops.unflatten_params(wrapped):
        layer = _inner(wrapped).get_submodule("net.2")
        if how == "in-place":
            with torch.no_grad():
                _tensor(layer, "weight").mul_(3.0)
        else:
            layer.weight = nn.Parameter(_tensor(layer, "weight").detach() * 3.0)
    with torch.no_grad():
        plain.get_parameter("net.2.weight").mul_(3.0)
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what=f"after a change ({how}) inside unflatten_params")
    x = models.batch("mlp")
    assert torch.equal(wrapped(x), plain(x))


class _UnlistedFirst(nn.Module):
    """``kept`` is registered before the listed ``w`` and ``b``, and ``last`` after them."""

    def __init__(self) -> None:
        super().__init__()
        self.kept = nn.Parameter(torch.arange(3.0))
        self.w = nn.Parameter(torch.arange(4.0).reshape(2, 2) + 10)
        self.b = nn.Parameter(torch.arange(2.0) + 20)
        self.last = nn.Parameter(torch.arange(2.0) + 30)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + self.b + self.kept.sum() + self.last.sum()


@pytest.mark.req("FP-16")
def test_unflatten_params_keeps_unlisted_params_in_their_place(ops: FlatParamOps) -> None:
    """Parameters that were not listed keep their place among the listed ones inside
    ``unflatten_params()``: an implementation that appends them after the restored ones changes
    ``named_parameters()`` order, and with it an optimizer built inside the context."""
    plain, model = _UnlistedFirst(), _UnlistedFirst()
    wrapped = ops.wrap(model, [model.w, model.b])
    with ops.unflatten_params(wrapped):
        inside = [name for name, _ in _inner(wrapped).named_parameters()]
        values = {name: p.detach().clone() for name, p in _inner(wrapped).named_parameters()}
    assert inside == [name for name, _ in plain.named_parameters()], f"order inside unflatten_params(): {inside}"
    assert_same_state(values, {n: p.detach() for n, p in plain.named_parameters()}, what="values inside unflatten_params()")


@pytest.mark.req("FP-16")
def test_unflatten_params_keeps_requires_grad(ops: FlatParamOps) -> None:
    """A frozen submodule wrapped alone: inside ``unflatten_params()``, and in ``state_dict(keep_vars=True)``,
    its parameters are real parameters that are still frozen (as every parameter keeps its own
    ``requires_grad``), and the flat parameter is still frozen afterwards."""
    plain, model = models.build("frozen"), models.build("frozen")
    stem = ops.wrap(model.get_submodule("stem"), list(model.get_submodule("stem").parameters()))
    model.stem = stem
    with ops.unflatten_params(stem):
        inside = {name: (type(p).__name__, p.requires_grad) for name, p in _inner(stem).named_parameters()}
    want = {name: ("Parameter", p.requires_grad) for name, p in plain.get_submodule("stem").named_parameters()}
    assert_same_state(inside, want, what="(type, requires_grad) of the parameters inside unflatten_params()")
    kept = {key: value.requires_grad for key, value in model.state_dict(keep_vars=True).items()}
    assert_same_state(kept, {key: value.requires_grad for key, value in plain.state_dict(keep_vars=True).items()},
                      what="requires_grad of state_dict(keep_vars=True) values")
    assert _flat(ops, stem).requires_grad is False, "the frozen flat parameter requires grad afterwards"


class _Boom(Exception):
    pass


@pytest.mark.req("FP-17")
def test_unflatten_params_reflattens_on_error(ops: FlatParamOps) -> None:
    plain, wrapped = _pair(ops, "mlp")
    names_before = [n for n, _ in wrapped.named_parameters()]
    with pytest.raises(_Boom):
        with ops.unflatten_params(wrapped):
            with torch.no_grad():
                _tensor(wrapped, "module.net.0.bias").add_(1.0)
            raise _Boom()
    assert [n for n, _ in wrapped.named_parameters()] == names_before
    assert ops.is_flat_param(ops.flat_param(wrapped))
    with torch.no_grad():
        plain.get_parameter("net.0.bias").add_(1.0)
    x = models.batch("mlp")
    assert torch.equal(wrapped(x), plain(x))


@pytest.mark.req("FP-17", "FP-25")
@pytest.mark.parametrize("name", ["mlp", "nested", "dtypes"])
def test_error_inside_unflatten_params_changes_nothing(ops: FlatParamOps, name: str) -> None:
    """A body that changes nothing and raises: the exception propagates and the wrapper is deeply as
    before (parameters, every buffer, grads, the same flat parameter objects with their metadata and
    recorded shard), and computes what the unwrapped model computes."""
    plain, wrapped = _pair(ops, name)
    x = models.batch(name)
    models.loss(wrapped(x)).backward()
    _record_shards(ops, wrapped)
    before, flats_before = snapshot(model=wrapped), _flat_state(ops, wrapped)
    with pytest.raises(_Boom):
        with ops.unflatten_params(wrapped):
            raise _Boom()
    assert_unchanged(before, model=wrapped, where="after an error inside unflatten_params()")
    _assert_same_flat_state(_flat_state(ops, wrapped), flats_before, "after an error inside unflatten_params()")
    assert_bitwise_equal(wrapped(x), plain(x), what="output after an error inside unflatten_params()")


# -- FP-18, FP-19: bad wrapper input ------------------------------------------------------------------


def _mixed_dtype(ops: FlatParamOps) -> Any:
    model = models.build("mlp")
    model.get_submodule("net.2").double()
    return ops.wrap(model, list(model.parameters()))


def _listed_flat_param(ops: FlatParamOps) -> Any:
    model = models.build("mlp")
    first = model.get_submodule("net.0")
    model.get_submodule("net").register_module("0", ops.wrap(first, list(first.parameters())))
    return ops.wrap(model, list(model.parameters()))


BAD_WRAPS = [
    pytest.param(lambda ops: ops.wrap(object(), []), TypeError, "Module", id="module-not-a-module"),
    pytest.param(lambda ops: ops.wrap(models.build("mlp"), [torch.zeros(3)]), TypeError, "Parameter", id="tensor-item"),
    pytest.param(
        lambda ops: ops.wrap(models.build("mlp"), [nn.Parameter(torch.zeros(3))]), ValueError, "not a parameter",
        id="param-not-in-module",
    ),
    pytest.param(_listed_flat_param, ValueError, "FlatParameter", id="nested-flat-param"),
    pytest.param(_mixed_dtype, ValueError, "dtype", id="mixed-dtype"),
    pytest.param(
        lambda ops: _flatten_all(ops, models.build("frozen")), ValueError, "requires_grad", id="mixed-requires-grad"
    ),
]


@pytest.mark.req("FP-18")
@pytest.mark.parametrize("make, error, mentions", BAD_WRAPS)
def test_bad_wrapper_input_is_rejected(ops: FlatParamOps, make: Callable, error: type, mentions: str) -> None:
    with pytest.raises(error, match=mentions):
        make(ops)


class _StorageTied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        # Two Parameter objects over one memory: a tie by storage, not by identity.
        self.b.weight = nn.Parameter(self.a.weight.detach())


@pytest.mark.req("FP-19")
@pytest.mark.parametrize("listed", ["all-tied", "some-tied"])
def test_listed_param_tied_by_storage_to_unlisted_is_rejected(ops: FlatParamOps, listed: str) -> None:
    model = _StorageTied()
    params = [model.a.get_parameter("weight")] if listed == "all-tied" else [model.a.get_parameter("weight"), model.a.get_parameter("bias")]
    with pytest.raises(ValueError, match=r"a\.weight.*b\.weight|b\.weight.*a\.weight"):
        ops.wrap(model, params)


@pytest.mark.req("FP-19")
def test_params_tied_by_storage_may_be_listed_together(ops: FlatParamOps) -> None:
    model = _StorageTied()
    wrapped = ops.wrap(model, [model.a.get_parameter("weight"), model.b.get_parameter("weight")])
    flat = ops.flat_param(wrapped)
    assert flat is not None and flat.numel() == 18


class _SharedStorage(nn.Module):
    """``head`` and ``tail`` are views of one 10-element storage, ``head`` over ``[0, split)`` and
    ``tail`` over ``[start, 10)``: they overlap when ``start < split`` and only touch when equal."""

    def __init__(self, split: int, start: int) -> None:
        super().__init__()
        storage = torch.arange(10.0)
        self.head = nn.Parameter(storage[:split])
        self.tail = nn.Parameter(storage[start:])


@pytest.mark.req("FP-19")
@pytest.mark.parametrize("split, start, tied", [(10, 6, True), (7, 6, True), (6, 6, False), (3, 6, False)],
                         ids=["tail-inside-head", "last-element-shared", "adjacent", "apart"])
def test_partial_overlap_with_unlisted_is_a_tie(ops: FlatParamOps, split: int, start: int, tied: bool) -> None:
    """Memory is compared byte range by byte range: a listed view that overlaps an unlisted one in
    its last element only is a tie, and views that merely touch or lie apart in one storage are not."""
    model = _SharedStorage(split, start)
    if tied:
        with pytest.raises(ValueError, match=r"'tail'.*'head'|'head'.*'tail'"):
            ops.wrap(model, [model.tail])
        return
    wrapped = ops.wrap(model, [model.tail])
    assert_same_state(wrapped.state_dict(), _SharedStorage(split, start).state_dict(), what="state_dict of the wrapper")


class _EmptyViewOfUnlisted(nn.Module):
    """``empty`` is a 0-element view that starts inside ``weight``'s storage: it shares no memory."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(10.0))
        self.empty = nn.Parameter(self.weight.detach()[5:5])
        self.bias = nn.Parameter(torch.ones(2))


@pytest.mark.req("FP-19")
def test_empty_param_inside_unlisted_storage_is_not_a_tie(ops: FlatParamOps) -> None:
    """A 0-element parameter holds no memory, so it ties nothing: listing it without the parameter
    whose storage it points into is accepted, and nothing is lost."""
    model = _EmptyViewOfUnlisted()
    wrapped = ops.wrap(model, [model.empty, model.bias])
    flat = ops.flat_param(wrapped)
    assert flat is not None and flat.numel() == 2, f"flat parameter of {None if flat is None else flat.numel()} elements"
    assert_same_state(
        wrapped.state_dict(), _EmptyViewOfUnlisted().state_dict(), what="state_dict of the wrapper with an empty parameter"
    )


# -- FP-20 .. FP-22: copies and moves ----------------------------------------------------------------


@pytest.mark.req("FP-20")
@pytest.mark.parametrize("name", ["mlp", "tied", "nested", "dtypes"])
@pytest.mark.parametrize("after_forward", [False, True], ids=["fresh", "after-forward"])
def test_deepcopy_is_independent_and_equal(ops: FlatParamOps, name: str, after_forward: bool) -> None:
    plain, wrapped = _pair(ops, name)
    x = models.batch(name)
    if after_forward:
        models.loss(wrapped(x)).backward()
    _record_shards(ops, wrapped)
    clone = copy.deepcopy(wrapped)
    assert_same_state(clone.state_dict(), plain.state_dict(), what=f"deepcopy of {name}")
    for a, b in zip(_flat_params(ops, clone), _flat_params(ops, wrapped)):
        assert ops.is_flat_param(a) and a is not b
    if _flat_metadata(ops, clone) != _flat_metadata(ops, wrapped):
        fail("deepcopy: flat parameter metadata or recorded shard differs",
             _flat_metadata(ops, clone), _flat_metadata(ops, wrapped))
    before = snapshot(model=wrapped)
    with torch.no_grad():
        for flat in _flat_params(ops, clone):
            flat.copy_(different_like(flat))
    assert_unchanged(before, model=wrapped, where=f"original {name} after changing its copy")
    assert_bitwise_equal(wrapped(x), plain(x), what=f"output of the original {name} after changing its copy")
    first = _flat_keys(ops, clone)[0][0]
    assert_bitwise_equal(clone.state_dict()[first], different_like(plain.state_dict()[first]),
                         what="the copy's state_dict after changing its flat parameter", where=first)


@pytest.mark.req("FP-21")
@pytest.mark.parametrize("name", ["mlp", "tied", "nested", "dtypes"])
def test_pickle_round_trip(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = _pair(ops, name)
    x = models.batch(name)
    models.loss(wrapped(x)).backward()
    _record_shards(ops, wrapped)
    restored = pickle.loads(pickle.dumps(wrapped))
    assert_same_state(restored.state_dict(), plain.state_dict(), what=f"unpickled {name}")
    if _flat_metadata(ops, restored) != _flat_metadata(ops, wrapped):
        fail("pickle: flat parameter metadata or recorded shard differs",
             _flat_metadata(ops, restored), _flat_metadata(ops, wrapped))
    assert_bitwise_equal(restored(x), plain(x), what=f"output of unpickled {name}")


_COPIES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda model: pickle.loads(pickle.dumps(model)),
    "to-float64": lambda model: model.to(torch.float64),
}


@pytest.mark.req("FP-20", "FP-21", "FP-22")
@pytest.mark.parametrize(
    "first, second",
    [("deepcopy", "deepcopy"), ("pickle", "deepcopy"), ("deepcopy", "pickle"), ("pickle", "to-float64"),
     ("deepcopy", "to-float64")],
    ids=lambda name: name,
)
def test_copies_of_copies_keep_metadata_and_values(ops: FlatParamOps, first: str, second: str) -> None:
    """A copy is as good as the original: copying it again (or moving it) keeps the flat parameters'
    metadata and recorded shard, and its views. An implementation that restores only part of the
    metadata on a copy passes a single copy and loses the rest on the second."""
    plain, wrapped = _pair(ops, "nested")
    _record_shards(ops, wrapped)
    metadata = _flat_metadata(ops, wrapped)
    twice = _COPIES[second](_COPIES[first](wrapped))
    if second == "to-float64":
        plain = plain.to(torch.float64)
    if _flat_metadata(ops, twice) != metadata:
        fail(f"{first} then {second}: flat parameter metadata or recorded shard differs", _flat_metadata(ops, twice), metadata)
    assert_same_state(twice.state_dict(), plain.state_dict(), what=f"state_dict after {first} then {second}")
    # The views are the flat parameters' own: a change written into them is what the model computes.
    with torch.no_grad():
        for flat in _flat_params(ops, twice):
            flat.copy_(different_like(flat))
        changed = {key: different_like(value) for key, value in plain.state_dict().items()}
        plain.load_state_dict(changed)
    x = models.batch("nested").to(next(plain.parameters()).dtype)
    assert_bitwise_equal(twice(x), plain(x), what=f"output after {first} then {second} and a change to the flat parameters")


@pytest.mark.req("FP-22")
@pytest.mark.parametrize("name", ["mlp", "tied", "buffers"])
def test_to_dtype_moves_flat_param_and_views(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = _pair(ops, name)
    _record_shards(ops, wrapped)
    metadata = _flat_metadata(ops, wrapped)
    plain.to(torch.float64)
    wrapped.to(torch.float64)
    flats = _flat_params(ops, wrapped)
    assert all(ops.is_flat_param(f) and f.dtype == torch.float64 for f in flats)
    if _flat_metadata(ops, wrapped) != metadata:
        fail(".to(float64): flat parameter metadata or recorded shard differs", _flat_metadata(ops, wrapped), metadata)
    x = models.batch(name)
    x = x if name == "tied" else x.double()
    assert torch.equal(wrapped(x), plain(x))
    opt_plain, opt_wrapped = _sgd(plain), _sgd(wrapped)
    models.train_step(plain, opt_plain, x)
    models.train_step(wrapped, opt_wrapped, x)
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what=f"{name} trained after .to(float64)")


@pytest.mark.req("FP-22")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="moving to another device needs a CUDA device; none here")
def test_to_device_moves_flat_param_and_views(ops: FlatParamOps) -> None:
    plain, wrapped = _pair(ops, "mlp")
    plain.to("cuda")
    wrapped.to("cuda")
    flat = ops.flat_param(wrapped)
    assert flat is not None and ops.is_flat_param(flat) and flat.device.type == "cuda"
    x = models.batch("mlp", device="cuda")
    assert torch.equal(wrapped(x), plain(x))


# -- FP-23: one wrapper per requires_grad group --------------------------------------------------------


@pytest.mark.req("FP-23")
def test_frozen_group_gets_its_own_wrapper(ops: FlatParamOps) -> None:
    plain, wrapped = _pair(ops, "frozen")
    flats = _flat_params(ops, wrapped)
    assert sorted(f.requires_grad for f in flats) == [False, True]
    models.loss(wrapped(models.batch("frozen"))).backward()
    for flat in flats:
        assert (flat.grad is not None) == flat.requires_grad
    frozen_names = {n for n, p in plain.named_parameters() if not p.requires_grad}
    frozen_flat = next(f for f in flats if not f.requires_grad)
    assert {_plain_name(n) for n in ops.info(frozen_flat).names} == frozen_names
