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
import pickle
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline

from conformance import models
from conformance.adapters.base import Adapter, Unsupported
from conformance.adapters.flat_param import FlatParamOps
from conformance.asserts import (
    assert_bitwise_equal,
    assert_names_key,
    assert_same_state,
    assert_unchanged,
    check_each,
    expect_error,
    fail,
    raised,
    reraise,
    snapshot,
)
from conformance.flat_param_modules_support import (
    Boom,
    BufferTied,
    EmptyViewOfUnlisted,
    ReadsItsChild,
    SharedStorage,
    StorageTied,
    ThreeViews,
    UnlistedFirst,
    listed_flat_param,
    mixed_dtype,
)
from conformance.flat_param_support import (
    COPIES,
    FAILED_LOAD_KEYS,
    FP_SEGMENTS,
    SHARD_COUNTS,
    SHARD_FLATS,
    WRAPPINGS,
    EdgeParams,
    assert_differs_everywhere,
    assert_same_flat_state,
    assert_same_versions,
    bad_flat_inputs,
    bad_keys,
    check_views_after_unflatten,
    dtype_id,
    even_shards,
    expected_shard,
    flat_keys_of,
    flat_metadata,
    flat_of,
    flat_params,
    flat_state,
    flats_with_prefix,
    flatten_all,
    golden_table,
    grad_of,
    inside_container,
    pair,
    plain_name,
    quoted,
    record_shards,
    reshaped,
    sgd,
    shard_or_skip,
    target_unlike,
    tensor_at,
    under_wrapper_segments,
    unlike,
    wrap_across_a_wrapper,
    wrapped_module,
    zoo_flat,
)
from conformance.values import EDGE_DTYPES, different_like


@pytest.fixture
def ops(impl: Adapter) -> FlatParamOps:
    return impl.require("flat_param")


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


@pytest.mark.req("FP-1", "FP-6", "FP-12")
def test_parameters_inside_a_nested_wrapper_are_named_as_unwrapped(ops: FlatParamOps) -> None:
    """A wrapper that lists parameters inside another wrapper names them as the unwrapped model does,
    without the inner wrapper's path segment, each name the parameter its view holds."""
    plain, wrapped = models.build("nested", seed=0), wrap_across_a_wrapper(ops, models.build("nested", seed=0))
    flat = flat_of(ops, wrapped)
    names = ops.info(flat).names
    expected = {n for n, _ in plain.named_parameters() if n.startswith(("1.inner.", "10."))}
    assert set(names) == expected and len(names) == len(expected), f"flat parameter names {names}, expected {sorted(expected)}"
    for name, view in zip(names, ops.param_views(flat)):
        assert_bitwise_equal(view.detach(), plain.get_parameter(name).detach(), what=f"the view named {name}")
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what="state_dict of a wrapper listing parameters inside another")
    x = models.batch("nested")
    assert_bitwise_equal(wrapped(x), plain(x), what="output")


@pytest.mark.req("FP-1", "FP-2", "FP-24")
@pytest.mark.parametrize("dtype", EDGE_DTYPES, ids=dtype_id)
def test_flat_param_keeps_every_bit_and_element_order(ops: FlatParamOps, dtype: torch.dtype) -> None:
    """Flattening parameters of ``dtype`` that hold its edge values, one of them transposed and one a
    view at a storage offset: the flat parameter keeps the dtype and every bit, in each parameter's
    row-major order (``contiguous()`` order, not storage order), and its views give the parameters
    back bit for bit, over its own data and over external data."""
    module = EdgeParams(dtype)
    # The layouts a fork's flattening gets wrong are really there.
    assert not module.matrix.is_contiguous() and module.offset.storage_offset() == 5 and module.scalar.dim() == 0
    params = list(module.parameters())
    flat = ops.make_flat_param(params, requires_grad=dtype.is_floating_point)
    # Row-major element order of each parameter, independently of how it is laid out in memory.
    expected = torch.cat([p.detach().contiguous().view(-1) for p in params])
    assert_bitwise_equal(flat.detach(), expected, what=f"flat parameter of {dtype_id(dtype)} parameters")
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


@pytest.mark.req("FP-3")
@pytest.mark.parametrize("name", list(SHARD_FLATS))
@pytest.mark.parametrize("count", SHARD_COUNTS, ids=[f"{c}shards" for c in SHARD_COUNTS])
def test_even_shards_match_element_walk(ops: FlatParamOps, name: str, count: int) -> None:
    flat = SHARD_FLATS[name](ops)
    info = ops.info(flat)
    numel = sum(info.numels)
    covered = {n: 0 for n in info.names}
    for start, end, pad in even_shards(numel, count):
        got = shard_or_skip(ops, flat, start, end, pad)
        want = expected_shard(list(info.names), list(info.shapes), start, end, pad)
        if got != want:
            fail("shard metadata differs from the element walk", got, want, f"shard [{start}, {end}] pad {pad} of {name}")
        for n, (first, last) in zip(got.names, got.offsets):
            covered[n] += last - first + 1
    assert covered == dict(zip(info.names, info.numels)), f"the {count} shards do not cover each parameter once"


@pytest.mark.req("FP-3")
def test_shard_defaults_to_whole_flat_param(ops: FlatParamOps) -> None:
    flat = zoo_flat(ops, "mlp")
    info = ops.info(flat)
    try:
        got = ops.shard_info(flat)
    except Unsupported as exc:
        pytest.skip(f"shard metadata: {exc}")
    assert got == expected_shard(list(info.names), list(info.shapes), 0, sum(info.numels) - 1, 0)


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
    got = shard_or_skip(ops, flat, start, end, pad)
    want = expected_shard(list(info.names), list(info.shapes), start, end, pad)
    if got != want:
        fail("shard metadata differs from the element walk", got, want, f"shard [{start}, {end}] pad {pad} of {flat_name}")


@pytest.mark.req("FP-3")
def test_shard_metadata_golden_tiny(ops: FlatParamOps) -> None:
    assert_expected_inline(
        golden_table(ops, "tiny"),
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
        golden_table(ops, "tiny", "b"),
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
        golden_table(ops, "tied"),
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
        # Types the range arithmetic would accept without a check of its own.
        pytest.param((0, 3, 0.0), TypeError, id="float-padding"),
        pytest.param((0, 3, False), TypeError, id="bool-padding"),
        pytest.param((True, 3, 0), TypeError, id="bool-start"),
    ],
)
def test_bad_shard_is_rejected_and_changes_nothing(ops: FlatParamOps, args: tuple, error: type) -> None:
    """"Unchanged" is checked deeply: the flat parameter's values, grad and metadata, and its recorded shard."""
    wrapped = flatten_all(ops, models.build("tiny"))
    flat = flat_of(ops, wrapped)
    models.loss(wrapped(models.batch("tiny"))).backward()
    shard_or_skip(ops, flat, 4, 7, 0)
    before, flats_before = snapshot(model=wrapped), flat_state(ops, wrapped)
    expect_error(lambda: ops.shard(flat, *args), error, what=f"shard_by_offsets{args}")
    assert_unchanged(before, model=wrapped, where=f"after shard_by_offsets{args}")
    assert_same_flat_state(flat_state(ops, wrapped), flats_before, f"after shard_by_offsets{args}")


@pytest.mark.req("FP-5")
@pytest.mark.parametrize("make_params, error", bad_flat_inputs())
def test_bad_flat_param_input_is_rejected(ops: FlatParamOps, make_params: Callable, error: type) -> None:
    with pytest.raises(error) as info:
        ops.make_flat_param(make_params(ops))
    assert str(info.value), "the error has no message"


@pytest.mark.req("FP-6")
@pytest.mark.parametrize("name", list(models.ZOO))
def test_wrapped_model_computes_the_same(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = pair(ops, name)
    flats = flat_params(ops, wrapped)
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
    plain, wrapped = pair(ops, "mlp")
    flat = flat_of(ops, wrapped)
    first = tensor_at(wrapped, "module.net.0.weight")
    assert first.shape == plain.get_parameter("net.0.weight").shape and torch.equal(first, plain.get_parameter("net.0.weight"))
    assert first.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    with torch.no_grad():
        flat.mul_(0.5)
        for p in plain.parameters():
            p.mul_(0.5)
    x = models.batch("mlp")
    assert torch.equal(wrapped(x), plain(x))
    assert torch.equal(tensor_at(wrapped, "module.net.2.bias"), plain.get_parameter("net.2.bias"))


@pytest.mark.req("FP-7", "FP-12")
@pytest.mark.parametrize("change", ["data-replaced", "requires-grad-dropped"])
def test_state_dict_follows_the_flat_param_after_an_earlier_state_dict(ops: FlatParamOps, change: str) -> None:
    """``state_dict()`` reads the flat parameter as it is now, not as an earlier call saw it: after its
    ``.data`` is replaced by other values (as a sharding or loading step does) or its ``requires_grad``
    dropped, the next ``state_dict()`` (``keep_vars`` too) holds the new values and flag."""
    plain, wrapped = pair(ops, "mlp")
    # An implementation may keep what these calls built for the next one (the reference reuses the
    # Parameters of a call whose result held no Parameter, so the plain call comes last).
    wrapped.state_dict(keep_vars=True)
    wrapped.state_dict()
    flat = flat_of(ops, wrapped)
    if change == "data-replaced":
        new_values = torch.arange(flat.numel(), dtype=flat.dtype) / 7.0
        flat.data = new_values.clone()
        with torch.no_grad():
            offset = 0
            for p in plain.parameters():
                p.copy_(new_values[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
    else:
        flat.requires_grad_(False)
        plain.requires_grad_(False)
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what=f"state_dict after the flat parameter's {change}")
    kept = wrapped.state_dict(keep_vars=True)
    flags = {key: value.requires_grad for key, value in kept.items()}
    expected = {key: value.requires_grad for key, value in plain.state_dict(keep_vars=True).items()}
    if flags != expected:
        fail(f"requires_grad of state_dict(keep_vars=True) entries after the flat parameter's {change}", flags, expected)


@pytest.mark.req("FP-7", "FP-12", "FP-13", "FP-16", "FP-24")
@pytest.mark.parametrize("dtype", EDGE_DTYPES, ids=dtype_id)
def test_wrapper_round_trips_every_bit(ops: FlatParamOps, dtype: torch.dtype) -> None:
    """A module whose parameters of ``dtype`` hold its edge values in every layout (transposed, at a
    storage offset, 0-dim, 0-element), wrapped whole: the outputs, state_dict, the parameters inside
    ``unflatten_params()``, a load of bitwise-different values (both directions) and the state after
    leaving ``unflatten_params()`` all agree with the unwrapped module bit for bit."""
    plain, wrapped = EdgeParams(dtype), flatten_all(ops, EdgeParams(dtype))
    what = f"{dtype_id(dtype)} edge values"
    x = torch.zeros(1)
    assert_bitwise_equal(wrapped(x), plain(x), what=f"output ({what})")
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what=f"state_dict ({what})")

    before = snapshot(model=wrapped)
    with ops.unflatten_params(wrapped):
        inside = dict(wrapped_module(wrapped).named_parameters())
        assert list(inside) == [n for n, _ in plain.named_parameters()], "parameter names inside unflatten_params()"
        for key, param in plain.named_parameters():
            assert type(inside[key]) is nn.Parameter, f"{key} inside unflatten_params() is a {type(inside[key]).__name__}"
            assert inside[key].requires_grad == param.requires_grad, f"{key} inside unflatten_params(): requires_grad"
            assert_bitwise_equal(inside[key].detach(), param.detach(), what=f"inside unflatten_params() ({what})", where=key)
    assert_unchanged(before, model=wrapped, where="after leaving unflatten_params()")

    source = unlike(plain.state_dict())
    wrapped.load_state_dict(source)
    assert_same_state(wrapped.state_dict(), source, what=f"wrapped state_dict after a load ({what})")
    loaded = torch.cat([v.reshape(-1) for v in source.values()])
    assert_bitwise_equal(wrapped(x), loaded, what=f"output after a load ({what})")
    back = EdgeParams(dtype)
    back.load_state_dict(wrapped.state_dict())
    assert_same_state(back.state_dict(), source, what=f"unwrapped state_dict loaded from the wrapped one ({what})")


@pytest.mark.req("FP-8")
@pytest.mark.parametrize("name", ["mlp", "tied", "buffers", "nested", "tiny", "dtypes"])
def test_grad_reaches_flat_param(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = pair(ops, name)
    x = models.batch(name)
    models.loss(plain(x)).backward()
    models.loss(wrapped(x)).backward()
    grads = dict(plain.named_parameters())
    for prefix, flat in flats_with_prefix(ops, wrapped):
        assert flat.grad is not None, "no gradient reached the flat parameter"
        names = [plain_name(prefix + n) for n in ops.info(flat).names]
        want = torch.cat([grad_of(grads[n], n).reshape(-1) for n in names])
        assert_bitwise_equal(flat.grad, want, what=f"flat grad vs unwrapped grads of {names}")


@pytest.mark.req("FP-8")
@pytest.mark.parametrize("name", list(models.ZOO))
def test_training_matches_unwrapped(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = pair(ops, name)
    opt_plain, opt_wrapped = sgd(plain), sgd(wrapped)
    for step in range(3):
        x = models.batch(name, seed=step)
        models.train_step(plain, opt_plain, x)
        models.train_step(wrapped, opt_wrapped, x)
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what=f"{name} after 3 SGD steps")


@pytest.mark.req("FP-9")
def test_tied_params_are_flattened_once(ops: FlatParamOps) -> None:
    plain, wrapped = pair(ops, "tied")
    flat = flat_of(ops, wrapped)
    names = ops.info(flat).names
    assert "embed.weight" in names and "head.weight" not in names, f"tied weight flattened as {names}"
    assert flat.numel() == sum(p.numel() for p in plain.parameters())  # parameters() yields a tied one once
    module = wrapped_module(wrapped)
    assert tensor_at(module, "embed.weight") is tensor_at(module, "head.weight"), "the tied names do not share one view"
    with torch.no_grad():
        flat.add_(1.0)
    assert torch.equal(tensor_at(module, "head.weight"), plain.get_parameter("embed.weight") + 1.0)
    sd = wrapped.state_dict()
    assert {"embed.weight", "head.weight"} <= set(sd) and torch.equal(sd["embed.weight"], sd["head.weight"])


@pytest.mark.req("FP-9", "FP-13")
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_load_of_differing_tied_entries_matches_unwrapped(ops: FlatParamOps, strict: bool) -> None:
    """A state_dict whose two entries of a tied parameter differ (written by hand, or by a model that
    was untied) loads into the wrapped model as into the unwrapped one: both names are loaded in
    order, so the later entry wins, for both names; a loader that reads one name per flat slot does not."""
    source = unlike(models.build("tied", seed=1).state_dict())
    source["head.weight"] = different_like(source["embed.weight"])
    plain = models.build("tied")
    wrapped = WRAPPINGS["tied"](ops, models.build("tied"))
    plain.load_state_dict(dict(source), strict=strict)
    wrapped.load_state_dict(dict(source), strict=strict)
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what="tied model after loading differing tied entries")


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
    wrapped = flatten_all(ops, model)
    assert wrapped.module is model
    assert wrapped.net is model.net
    seq = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    wrapped_seq = flatten_all(ops, seq)
    assert wrapped_seq[1] is seq[1]  # type: ignore[index]  # the wrapper's indexing is the test (nn.Module declares none)
    with pytest.raises(AttributeError):
        wrapped.no_such_attribute


@pytest.mark.req("FP-12")
@pytest.mark.parametrize("name", list(models.ZOO))
def test_state_dict_has_unwrapped_keys_and_values(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = pair(ops, name)
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what=f"{name} state_dict")
    assert_same_versions(wrapped.state_dict(), plain.state_dict(), what=f"{name} state_dict")


@pytest.mark.req("FP-12")
@pytest.mark.parametrize("name", ["mlp", "nested", "frozen"])
def test_state_dict_of_model_containing_wrappers(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = pair(ops, name)
    stem = nn.Linear(2, 2)
    outer_plain = nn.ModuleDict({"stem": stem, "body": plain})
    outer_wrapped = nn.ModuleDict({"stem": copy.deepcopy(stem), "body": wrapped})
    assert_same_state(outer_wrapped.state_dict(), outer_plain.state_dict(), what=f"{name} inside a ModuleDict")
    assert_same_versions(outer_wrapped.state_dict(), outer_plain.state_dict(), what=f"{name} inside a ModuleDict")


@pytest.mark.req("FP-13", "FP-25")
@pytest.mark.parametrize("name", list(models.ZOO))
@pytest.mark.parametrize("where", ["root", "inside"])
def test_load_round_trips_with_unwrapped(ops: FlatParamOps, name: str, where: str) -> None:
    """Both directions, strict and not, the wrapped model at the root of the load or inside a plain
    container, into a target whose every entry (parameters and buffers of every dtype) differs
    bitwise from the source: afterwards the target's state_dict is the source's bit for bit, each flat
    parameter holds the source values in flat order (the load wrote through), the outputs agree, and
    an optimizer built over the target before the load trains it as the source trains."""
    place = inside_container if where == "inside" else (lambda model: model)
    for strict in (True, False):
        what = f"{name} ({where}, strict={strict})"
        source = models.build(name, seed=1)
        source_sd = place(source).state_dict()
        wrapped = WRAPPINGS[name](ops, target_unlike(name, source.state_dict(), seed=0))
        target = place(wrapped)
        assert_differs_everywhere(target.state_dict(), source_sd, f"wrapped {what}")
        optimizer = sgd(wrapped)
        flats_before = flat_state(ops, wrapped)

        result = target.load_state_dict(source_sd, strict=strict)
        assert (list(result.missing_keys), list(result.unexpected_keys)) == ([], []), f"load reported {result}"
        assert_same_flat_state(flat_state(ops, wrapped), flats_before, f"after a load ({what})")
        assert_same_state(target.state_dict(), source_sd, what=f"wrapped {what} after loading an unwrapped state_dict")
        values = dict(source.named_parameters(remove_duplicate=False))
        for keys, flat in zip(flat_keys_of(ops, wrapped), flat_params(ops, wrapped)):
            held = torch.cat([values[k].detach().reshape(-1) for k in keys])
            assert_bitwise_equal(flat.detach(), held, what=f"flat parameter after the load ({what})",
                                 where=f"holding {keys}")
        x = models.batch(name)
        assert_bitwise_equal(wrapped(x), source(x), what=f"output of wrapped {what} after the load")
        if strict:  # the optimizer's view of the load does not depend on strictness: one step is enough
            models.train_step(source, sgd(source), x)
            models.train_step(wrapped, optimizer, x)
            assert_same_state(wrapped.state_dict(), source.state_dict(),
                              what=f"{what}: a step after the load (optimizer built before it)")

        unwrapped_source = models.build(name, seed=3)
        wrapped_sd = place(WRAPPINGS[name](ops, models.build(name, seed=3))).state_dict()
        back = target_unlike(name, unwrapped_source.state_dict(), seed=2)
        result = place(back).load_state_dict(wrapped_sd, strict=strict)
        assert (list(result.missing_keys), list(result.unexpected_keys)) == ([], []), f"load reported {result}"
        assert_same_state(back.state_dict(), unwrapped_source.state_dict(), what=f"unwrapped {what} loaded from wrapped")


@pytest.mark.req("FP-12")
def test_a_state_dict_that_raised_inside_another_leaves_its_keys_unwrapped(ops: FlatParamOps) -> None:
    """A module's extra state tries a wrapped child's ``state_dict()``, which raises and is caught:
    the enclosing call, and the next ones, still have exactly the unwrapped model's keys and values.
    An implementation that tracks the running calls (to rename each key once) must not take the
    failed call's leftovers for an enclosing wrapper."""

    def build(wrap: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(ReadsItsChild(ops.wrap if wrap else None), nn.Linear(3, 2))
        return ops.wrap(model, list(model[1].parameters())) if wrap else model

    plain, wrapped = build(False), build(True)
    want = plain.state_dict()
    for call in range(2):
        reader = next(m for m in wrapped.modules() if isinstance(m, ReadsItsChild))
        got = wrapped.state_dict()
        assert reader.flaky.raised == call + 1, "the child's state_dict did not raise inside the call"
        assert_same_state(got, want, what=f"state_dict call {call + 1} after a state_dict inside it raised")


@pytest.mark.req("FP-13")
@pytest.mark.parametrize("name", ["mlp", "nested", "buffers", "dtypes"])
def test_non_strict_load_reports_like_unwrapped(ops: FlatParamOps, name: str) -> None:
    """A partial, over-full non-strict load into targets unlike the source: the entries given are
    loaded, the others keep the target's values, exactly as in the unwrapped model. The surplus
    includes each left-out entry under a wrapper's internal path (``1._fpw_module.proj.weight``):
    unexpected for the unwrapped model, so for the wrapped one too, and loaded nowhere."""
    source = models.build(name, seed=1).state_dict()
    partial = {k: v for i, (k, v) in enumerate(source.items()) if i % 2 == 0}
    partial["extra.weight"] = torch.zeros(1)
    for key in list(source)[1::2]:
        partial.update(dict.fromkeys(under_wrapper_segments(key), source[key]))
    plain = target_unlike(name, source, seed=0)
    wrapped = WRAPPINGS[name](ops, target_unlike(name, source, seed=0))
    want = plain.load_state_dict(dict(partial), strict=False)
    got = wrapped.load_state_dict(dict(partial), strict=False)
    assert sorted(got.missing_keys) == sorted(want.missing_keys)
    assert sorted(got.unexpected_keys) == sorted(want.unexpected_keys)
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what=f"{name} after a non-strict partial load")


@pytest.mark.req("FP-14")
@pytest.mark.parametrize("name", ["mlp", "nested", "frozen", "buffers"])
@pytest.mark.parametrize("where", ["root", "inside"])
def test_strict_load_names_original_keys(ops: FlatParamOps, name: str, where: str) -> None:
    """One key dropped inside every wrapper (nested ones too) and surplus keys beside them, with the
    wrapper at the root and inside a ModuleDict: the strict error names every one by its whole
    unwrapped key, names the same keys as the unwrapped model, and shows no wrapper segment; a
    non-strict load reports the same missing and unexpected keys as the unwrapped model."""
    plain, wrapped = pair(ops, name)
    prefix = "m." if where == "inside" else ""
    if where == "inside":
        plain, wrapped = inside_container(plain), inside_container(wrapped)
    dropped, unexpected = bad_keys(ops, wrapped, prefix)
    bad = {k: v for k, v in plain.state_dict().items() if k not in dropped}
    bad.update({k: torch.zeros(1) for k in unexpected})
    want = raised(lambda: plain.load_state_dict(dict(bad)))
    assert isinstance(want, RuntimeError), f"the unwrapped model did not reject the bad dict: {want!r}"
    got = expect_error(lambda: wrapped.load_state_dict(dict(bad)), RuntimeError, what="strict load")
    for key in dropped + unexpected:
        assert_names_key(str(got), key, what="strict load error", forbidden=FP_SEGMENTS)
    if quoted(str(got)) != quoted(str(want)):
        fail("the wrapped model names other keys than the unwrapped one",
             sorted(quoted(str(got))), sorted(quoted(str(want))))

    plain_result = plain.load_state_dict(dict(bad), strict=False)
    result = wrapped.load_state_dict(dict(bad), strict=False)
    assert_same_state(sorted(result.missing_keys), sorted(plain_result.missing_keys), what="non-strict missing_keys")
    assert_same_state(sorted(result.unexpected_keys), sorted(plain_result.unexpected_keys),
                      what="non-strict unexpected_keys")


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
    record_shards(ops, wrapped)
    bad = unlike(wrapped.state_dict())
    if problem == "wrong-shape":
        bad[key] = reshaped(bad[key])
    elif problem == "missing":
        del bad[key]
    else:
        key = key.rsplit(".", 1)[0] + ".surplus"
        bad[key] = torch.zeros(1)
    with torch.no_grad():
        out_before = wrapped(x)
    before, flats_before = snapshot(model=wrapped), flat_state(ops, wrapped)
    exc = raised(lambda: wrapped.load_state_dict(bad))

    def unchanged() -> None:
        assert_unchanged(before, model=wrapped, where=f"after a failed load ({problem} {key!r})")
        assert_same_flat_state(flat_state(ops, wrapped), flats_before, "after a failed load")

    check_each({"FP-15.a": lambda: expect_error(lambda: reraise(exc), RuntimeError, keys=[key], what=f"load with a {problem} entry"),
                "FP-15.b": unchanged})
    with torch.no_grad():
        assert_bitwise_equal(wrapped(x), out_before, what="output after a failed load")


@pytest.mark.req("FP-16")
@pytest.mark.parametrize("name", ["mlp", "tied", "nested"])
def test_unflatten_params_restores_real_params(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = pair(ops, name)
    before = snapshot(model=wrapped)
    registered = [(key, id(param)) for key, param in wrapped.named_parameters()]
    with ops.unflatten_params(wrapped):
        inner_flats = flat_params(ops, wrapped_module(wrapped))
        assert bool(inner_flats) == (name == "nested"), "only the wrappers nested inside stay flattened"
        outer_flats = [p for p in wrapped.parameters(recurse=False) if ops.is_flat_param(p)]
        assert outer_flats == [], "the flat parameter is still registered inside unflatten_params()"
        own = dict(wrapped_module(wrapped).named_parameters())
        for key, param in plain.named_parameters():
            if key in own:
                assert type(own[key]) is nn.Parameter
                assert_bitwise_equal(own[key].detach(), param.detach(), what="inside unflatten_params()", where=key)
        if name == "mlp":
            assert [k for k, _ in wrapped_module(wrapped).named_parameters()] == [k for k, _ in plain.named_parameters()]
    assert flat_params(ops, wrapped)
    # The Parameters the body saw are gone again: left registered, an optimizer built after the context
    # would step them as well as the flat parameter, and the key order of named_parameters() changes.
    after = [(key, id(param)) for key, param in wrapped.named_parameters()]
    if after != registered:
        fail("named_parameters() after leaving unflatten_params() untouched", [key for key, _ in after],
             f"as before it, the same objects: {[key for key, _ in registered]}")
    assert_unchanged(before, model=wrapped, where="after leaving unflatten_params() untouched")
    x = models.batch(name)
    assert torch.equal(wrapped(x), plain(x))


@pytest.mark.req("FP-16")
@pytest.mark.parametrize("how", ["in-place", "assigned", "converted"])
def test_changes_inside_unflatten_params_are_kept(ops: FlatParamOps, how: str) -> None:
    """A change made inside ``unflatten_params()`` is there after it: in place, by assigning a new
    parameter, or by converting the whole model (``.double()`` inside the body: the flat parameter
    that comes back is float64, holding the converted values)."""
    plain, wrapped = pair(ops, "mlp")
    with ops.unflatten_params(wrapped):
        layer = wrapped_module(wrapped).get_submodule("net.2")
        if how == "in-place":
            with torch.no_grad():
                tensor_at(layer, "weight").mul_(3.0)
        elif how == "assigned":
            layer.weight = nn.Parameter(tensor_at(layer, "weight").detach() * 3.0)
        else:
            wrapped.double()
    x = models.batch("mlp")
    if how == "converted":
        plain.double()
    else:
        with torch.no_grad():
            plain.get_parameter("net.2.weight").mul_(3.0)
    # Before any forward: every listed name is again a view of the flat parameter, with the change.
    check_views_after_unflatten(ops, wrapped, plain, when=f"after a change ({how}) inside unflatten_params, before a forward")
    # A second context sees the change too (an implementation that caches the Parameters it made for
    # the first would hand back the ones the body replaced).
    with ops.unflatten_params(wrapped):
        inside = {name: p.detach().clone() for name, p in wrapped_module(wrapped).named_parameters()}
    assert_same_state(inside, {n: p.detach() for n, p in plain.named_parameters()}, what=f"a second unflatten_params() after a change ({how})")
    if how == "converted":
        x = x.double()
        flat = flat_of(ops, wrapped)
        if not (ops.is_flat_param(flat) and flat.dtype == torch.float64):
            fail(".double() inside unflatten_params: the flat parameter after it", f"{type(flat).__name__} of {flat.dtype}",
                 "a flat parameter of torch.float64")
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what=f"after a change ({how}) inside unflatten_params")
    assert torch.equal(wrapped(x), plain(x))


@pytest.mark.req("FP-16")
def test_unflatten_params_keeps_unlisted_params_in_their_place(ops: FlatParamOps) -> None:
    """Parameters that were not listed keep their place among the listed ones inside
    ``unflatten_params()``: an implementation that appends them after the restored ones changes
    ``named_parameters()`` order, and with it an optimizer built inside the context."""
    plain, model = UnlistedFirst(), UnlistedFirst()
    wrapped = ops.wrap(model, [model.w, model.b])
    with ops.unflatten_params(wrapped):
        inside = [name for name, _ in wrapped_module(wrapped).named_parameters()]
        values = {name: p.detach().clone() for name, p in wrapped_module(wrapped).named_parameters()}
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
        inside = {name: (type(p).__name__, p.requires_grad) for name, p in wrapped_module(stem).named_parameters()}
    want = {name: ("Parameter", p.requires_grad) for name, p in plain.get_submodule("stem").named_parameters()}
    assert_same_state(inside, want, what="(type, requires_grad) of the parameters inside unflatten_params()")
    kept = {key: value.requires_grad for key, value in model.state_dict(keep_vars=True).items()}
    assert_same_state(kept, {key: value.requires_grad for key, value in plain.state_dict(keep_vars=True).items()},
                      what="requires_grad of state_dict(keep_vars=True) values")
    assert flat_of(ops, stem).requires_grad is False, "the frozen flat parameter requires grad afterwards"


@pytest.mark.req("FP-17")
def test_unflatten_params_reflattens_on_error(ops: FlatParamOps) -> None:
    plain, wrapped = pair(ops, "mlp")
    names_before = [n for n, _ in wrapped.named_parameters()]
    with pytest.raises(Boom):
        with ops.unflatten_params(wrapped):
            with torch.no_grad():
                tensor_at(wrapped, "module.net.0.bias").add_(1.0)
            raise Boom()
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
    plain, wrapped = pair(ops, name)
    x = models.batch(name)
    models.loss(wrapped(x)).backward()
    record_shards(ops, wrapped)
    before, flats_before = snapshot(model=wrapped), flat_state(ops, wrapped)
    with pytest.raises(Boom):
        with ops.unflatten_params(wrapped):
            raise Boom()
    assert_unchanged(before, model=wrapped, where="after an error inside unflatten_params()")
    assert_same_flat_state(flat_state(ops, wrapped), flats_before, "after an error inside unflatten_params()")
    assert_bitwise_equal(wrapped(x), plain(x), what="output after an error inside unflatten_params()")


BAD_WRAPS = [
    pytest.param(lambda ops: ops.wrap(object(), []), TypeError, "Module", id="module-not-a-module"),
    pytest.param(lambda ops: ops.wrap(models.build("mlp"), [torch.zeros(3)]), TypeError, "Parameter", id="tensor-item"),
    pytest.param(
        lambda ops: ops.wrap(models.build("mlp"), [nn.Parameter(torch.zeros(3))]), ValueError, "not a parameter",
        id="param-not-in-module",
    ),
    pytest.param(listed_flat_param, ValueError, "FlatParameter", id="nested-flat-param"),
    pytest.param(mixed_dtype, ValueError, "dtype", id="mixed-dtype"),
    pytest.param(
        lambda ops: flatten_all(ops, models.build("frozen")), ValueError, "requires_grad", id="mixed-requires-grad"
    ),
]


@pytest.mark.req("FP-18")
@pytest.mark.parametrize("make, error, mentions", BAD_WRAPS)
def test_bad_wrapper_input_is_rejected(ops: FlatParamOps, make: Callable, error: type, mentions: str) -> None:
    with pytest.raises(error, match=mentions):
        make(ops)


@pytest.mark.req("FP-19")
@pytest.mark.parametrize("listed", ["all-tied", "some-tied"])
def test_listed_param_tied_by_storage_to_unlisted_is_rejected(ops: FlatParamOps, listed: str) -> None:
    model = StorageTied()
    params = [model.a.get_parameter("weight")] if listed == "all-tied" else [model.a.get_parameter("weight"), model.a.get_parameter("bias")]
    with pytest.raises(ValueError, match=r"a\.weight.*b\.weight|b\.weight.*a\.weight"):
        ops.wrap(model, params)


@pytest.mark.req("FP-19")
def test_listed_param_tied_by_storage_to_a_buffer_is_rejected(ops: FlatParamOps) -> None:
    """The unlisted side of a tie may be a buffer: flattening the parameter would leave the buffer on
    memory the module no longer reads (a running statistic that stops following its weight)."""
    model = BufferTied()
    with pytest.raises(ValueError, match=r"weight.*running|running.*weight"):
        ops.wrap(model, [model.weight])


@pytest.mark.req("FP-19")
def test_a_tie_names_the_unlisted_parameter_it_overlaps(ops: FlatParamOps) -> None:
    """Among several unlisted parameters of one storage, the error names the one the listed parameter
    overlaps, not a neighbour: the name is what a user fixes the listing by."""
    model = ThreeViews()
    with pytest.raises(ValueError) as info:
        ops.wrap(model, [model.listed])
    message = str(info.value)
    if "'listed'" not in message or "'second'" not in message or "'first'" in message:
        fail("the error of a listed parameter overlapping 'second' (not 'first')", message[:400],
             "a message naming 'listed' and 'second' only")


@pytest.mark.req("FP-19")
def test_params_tied_by_storage_may_be_listed_together(ops: FlatParamOps) -> None:
    model = StorageTied()
    wrapped = ops.wrap(model, [model.a.get_parameter("weight"), model.b.get_parameter("weight")])
    flat = ops.flat_param(wrapped)
    assert flat is not None and flat.numel() == 18


@pytest.mark.req("FP-19")
@pytest.mark.parametrize("split, start, tied", [(10, 6, True), (7, 6, True), (1, 0, True), (6, 6, False), (3, 6, False)],
                         ids=["tail-inside-head", "last-element-shared", "one-element-unlisted", "adjacent", "apart"])
def test_partial_overlap_with_unlisted_is_a_tie(ops: FlatParamOps, split: int, start: int, tied: bool) -> None:
    """Memory is compared byte range by byte range: a listed view that overlaps an unlisted one in
    its last element only is a tie, and views that merely touch or lie apart in one storage are not."""
    model = SharedStorage(split, start)
    if tied:
        with pytest.raises(ValueError, match=r"'tail'.*'head'|'head'.*'tail'"):
            ops.wrap(model, [model.tail])
        return
    wrapped = ops.wrap(model, [model.tail])
    assert_same_state(wrapped.state_dict(), SharedStorage(split, start).state_dict(), what="state_dict of the wrapper")


@pytest.mark.req("FP-19")
def test_empty_param_inside_unlisted_storage_is_not_a_tie(ops: FlatParamOps) -> None:
    """A 0-element parameter holds no memory, so it ties nothing: listing it without the parameter
    whose storage it points into is accepted, and nothing is lost."""
    model = EmptyViewOfUnlisted()
    wrapped = ops.wrap(model, [model.empty, model.bias])
    flat = ops.flat_param(wrapped)
    assert flat is not None and flat.numel() == 2, f"flat parameter of {None if flat is None else flat.numel()} elements"
    assert_same_state(
        wrapped.state_dict(), EmptyViewOfUnlisted().state_dict(), what="state_dict of the wrapper with an empty parameter"
    )


@pytest.mark.req("FP-20")
@pytest.mark.parametrize("name", ["mlp", "tied", "nested", "dtypes"])
@pytest.mark.parametrize("after_forward", [False, True], ids=["fresh", "after-forward"])
def test_deepcopy_is_independent_and_equal(ops: FlatParamOps, name: str, after_forward: bool) -> None:
    plain, wrapped = pair(ops, name)
    x = models.batch(name)
    if after_forward:
        models.loss(wrapped(x)).backward()
    record_shards(ops, wrapped)
    clone = copy.deepcopy(wrapped)
    assert_same_state(clone.state_dict(), plain.state_dict(), what=f"deepcopy of {name}")
    for a, b in zip(flat_params(ops, clone), flat_params(ops, wrapped)):
        assert ops.is_flat_param(a) and a is not b
    if flat_metadata(ops, clone) != flat_metadata(ops, wrapped):
        fail("deepcopy: flat parameter metadata or recorded shard differs",
             flat_metadata(ops, clone), flat_metadata(ops, wrapped))
    before = snapshot(model=wrapped)
    with torch.no_grad():
        for flat in flat_params(ops, clone):
            flat.copy_(different_like(flat))
    assert_unchanged(before, model=wrapped, where=f"original {name} after changing its copy")
    assert_bitwise_equal(wrapped(x), plain(x), what=f"output of the original {name} after changing its copy")
    first = flat_keys_of(ops, clone)[0][0]
    assert_bitwise_equal(clone.state_dict()[first], different_like(plain.state_dict()[first]),
                         what="the copy's state_dict after changing its flat parameter", where=first)


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
    plain, wrapped = pair(ops, "nested")
    record_shards(ops, wrapped)
    metadata = flat_metadata(ops, wrapped)
    twice = COPIES[second](COPIES[first](wrapped))
    if second == "to-float64":
        plain = plain.to(torch.float64)
    if flat_metadata(ops, twice) != metadata:
        fail(f"{first} then {second}: flat parameter metadata or recorded shard differs", flat_metadata(ops, twice), metadata)
    assert_same_state(twice.state_dict(), plain.state_dict(), what=f"state_dict after {first} then {second}")
    # The views are the flat parameters' own: a change written into them is what the model computes.
    with torch.no_grad():
        for flat in flat_params(ops, twice):
            flat.copy_(different_like(flat))
        changed = {key: different_like(value) for key, value in plain.state_dict().items()}
        plain.load_state_dict(changed)
    x = models.batch("nested").to(next(plain.parameters()).dtype)
    assert_bitwise_equal(twice(x), plain(x), what=f"output after {first} then {second} and a change to the flat parameters")


@pytest.mark.req("FP-21")
@pytest.mark.parametrize("name", ["mlp", "tied", "nested", "dtypes"])
def test_pickle_round_trip(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = pair(ops, name)
    x = models.batch(name)
    models.loss(wrapped(x)).backward()
    record_shards(ops, wrapped)
    restored = pickle.loads(pickle.dumps(wrapped))
    assert_same_state(restored.state_dict(), plain.state_dict(), what=f"unpickled {name}")
    if flat_metadata(ops, restored) != flat_metadata(ops, wrapped):
        fail("pickle: flat parameter metadata or recorded shard differs",
             flat_metadata(ops, restored), flat_metadata(ops, wrapped))
    assert_bitwise_equal(restored(x), plain(x), what=f"output of unpickled {name}")


@pytest.mark.req("FP-22")
@pytest.mark.parametrize("name", ["mlp", "tied", "buffers"])
def test_to_dtype_moves_flat_param_and_views(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = pair(ops, name)
    record_shards(ops, wrapped)
    metadata = flat_metadata(ops, wrapped)
    plain.to(torch.float64)
    wrapped.to(torch.float64)
    flats = flat_params(ops, wrapped)
    assert all(ops.is_flat_param(f) and f.dtype == torch.float64 for f in flats)
    if flat_metadata(ops, wrapped) != metadata:
        fail(".to(float64): flat parameter metadata or recorded shard differs", flat_metadata(ops, wrapped), metadata)
    x = models.batch(name)
    x = x if name == "tied" else x.double()
    assert torch.equal(wrapped(x), plain(x))
    opt_plain, opt_wrapped = sgd(plain), sgd(wrapped)
    models.train_step(plain, opt_plain, x)
    models.train_step(wrapped, opt_wrapped, x)
    assert_same_state(wrapped.state_dict(), plain.state_dict(), what=f"{name} trained after .to(float64)")


@pytest.mark.req("FP-22")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="moving to another device needs a CUDA device; none here")
def test_to_device_moves_flat_param_and_views(ops: FlatParamOps) -> None:
    plain, wrapped = pair(ops, "mlp")
    plain.to("cuda")
    wrapped.to("cuda")
    flat = ops.flat_param(wrapped)
    assert flat is not None and ops.is_flat_param(flat) and flat.device.type == "cuda"
    x = models.batch("mlp", device="cuda")
    assert torch.equal(wrapped(x), plain(x))


@pytest.mark.req("FP-23")
def test_frozen_group_gets_its_own_wrapper(ops: FlatParamOps) -> None:
    plain, wrapped = pair(ops, "frozen")
    flats = flat_params(ops, wrapped)
    assert sorted(f.requires_grad for f in flats) == [False, True]
    models.loss(wrapped(models.batch("frozen"))).backward()
    for flat in flats:
        assert (flat.grad is not None) == flat.requires_grad
    frozen_names = {n for n, p in plain.named_parameters() if not p.requires_grad}
    frozen_flat = next(f for f in flats if not f.requires_grad)
    assert {plain_name(n) for n in ops.info(frozen_flat).names} == frozen_names


@pytest.mark.req("FP-26")
@pytest.mark.parametrize("name", ["mlp", "nested", "frozen", "buffers"])
@pytest.mark.parametrize("where", ["root", "inside"])
def test_wrong_shape_names_original_key(ops: FlatParamOps, name: str, where: str) -> None:
    """One entry of every flat parameter (nested wrappers too) given with the right number of
    elements in another shape, the wrapper at the root and inside a ModuleDict, strict and not: a
    RuntimeError names each of them by its whole unwrapped key, with no wrapper segment, as the
    unwrapped model does."""
    plain, wrapped = pair(ops, name)
    if where == "inside":
        plain, wrapped = inside_container(plain), inside_container(wrapped)
    keys = [flat_keys[0] for flat_keys in flat_keys_of(ops, wrapped)]
    bad = dict(plain.state_dict())
    bad.update({key: reshaped(bad[key]) for key in keys})
    for strict in (True, False):
        want = raised(lambda: plain.load_state_dict(dict(bad), strict=strict))
        assert isinstance(want, RuntimeError), f"the unwrapped model did not reject the bad dict: {want!r}"
        got = expect_error(lambda: wrapped.load_state_dict(dict(bad), strict=strict), RuntimeError,
                           what=f"load with wrong shapes (strict={strict})")
        for key in keys:
            assert_names_key(str(got), key, what=f"wrong-shape load error (strict={strict})", forbidden=FP_SEGMENTS)
