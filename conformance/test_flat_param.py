"""FP: FlatParameter wrapping (``conformance/SPEC.md``, section FP).

Every test goes through :class:`~conformance.adapters.flat_param.FlatParamOps` (``ops``) and compares
against the oracle the SPEC names: the unwrapped zoo model built from the same seed, an independent
element-by-element computation of shard contents, or expecttest goldens for structure. All tests are
single-process: a FlatParameter is a local mechanism.
"""

from __future__ import annotations

import copy
import math
import pickle
import re
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline

from conformance import models
from conformance.adapters.base import Unsupported
from conformance.adapters.flat_param import FlatParamOps, ShardInfo

SHARD_COUNTS = (1, 2, 3, 4, 5)


# -- helpers ------------------------------------------------------------------------------------


@pytest.fixture
def ops(impl: Any) -> FlatParamOps:
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


def _assert_same_state(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert list(got) == list(want), f"{what}: keys {list(got)}, expected (unwrapped) {list(want)}"
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{what}: value of {key!r} differs from the unwrapped model"


def _quoted(message: str) -> set[str]:
    return set(re.findall(r'"([^"]+)"', message))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, weight_decay=0.01)


# -- FP-1, FP-2, FP-5: the flat parameter on its own -----------------------------------------------


@pytest.mark.req("FP-1")
@pytest.mark.parametrize("requires_grad", [True, False], ids=["grad", "nograd"])
def test_flat_param_concatenates_params_in_order(ops: FlatParamOps, requires_grad: bool) -> None:
    params = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(2, 1, 3))]
    flat = ops.make_flat_param(params, requires_grad)
    assert isinstance(flat, nn.Parameter) and ops.is_flat_param(flat)
    assert flat.dim() == 1 and flat.numel() == 12 + 5 + 6
    assert flat.requires_grad is requires_grad
    assert torch.equal(flat.detach(), torch.cat([p.detach().reshape(-1) for p in params]))
    info = ops.info(flat)
    assert info.shapes == (torch.Size([3, 4]), torch.Size([5]), torch.Size([2, 1, 3]))
    assert info.numels == (12, 5, 6)


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


@pytest.mark.req("FP-3")
@pytest.mark.parametrize("name", list(models.ZOO))
@pytest.mark.parametrize("count", SHARD_COUNTS, ids=[f"{c}shards" for c in SHARD_COUNTS])
def test_even_shards_match_element_walk(ops: FlatParamOps, name: str, count: int) -> None:
    flat = _zoo_flat(ops, name)
    info = ops.info(flat)
    numel = sum(info.numels)
    covered = {n: 0 for n in info.names}
    for start, end, pad in _even_shards(numel, count):
        got = _shard(ops, flat, start, end, pad)
        want = _expected_shard(list(info.names), list(info.shapes), start, end, pad)
        assert got == want, f"shard [{start}, {end}] pad {pad} of {name}: got {got}, expected {want}"
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


@pytest.mark.req("FP-3")
@pytest.mark.parametrize(
    "start, end, pad",
    [(0, 0, 0), (5, 5, 0), (3, 8, 0), (9, 9, 0), (9, 12, 3), (10, 13, 4), (0, 11, 2), (2, 3, 0)],
    ids=lambda v: str(v),
)
def test_irregular_shards_of_tiny_match_element_walk(ops: FlatParamOps, start: int, end: int, pad: int) -> None:
    # tiny: a.weight (6 elements, flat 0..5), b.weight (3, flat 6..8), b.bias (1, flat 9)
    flat = _zoo_flat(ops, "tiny")
    info = ops.info(flat)
    got = _shard(ops, flat, start, end, pad)
    assert got == _expected_shard(list(info.names), list(info.shapes), start, end, pad)


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
        pytest.param((0.0, 3, 0), TypeError, id="float-start"),
    ],
)
def test_bad_shard_is_rejected_and_changes_nothing(ops: FlatParamOps, args: tuple, error: type) -> None:
    flat = _zoo_flat(ops, "tiny")
    before = _shard(ops, flat, 4, 7, 0)
    with pytest.raises(error):
        ops.shard(flat, *args)
    assert ops.shard_info(flat) == before, "a rejected shard_by_offsets changed the recorded shard"


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
    assert torch.equal(wrapped(x), plain(x))


@pytest.mark.req("FP-6")
def test_unlisted_params_stay_registered(ops: FlatParamOps) -> None:
    model = models.build("mlp")
    head = model.net[4]
    listed = [p for n, p in model.named_parameters() if not n.startswith("net.4.")]
    wrapped = ops.wrap(model, listed)
    others = [p for p in wrapped.parameters() if not ops.is_flat_param(p)]
    assert len(others) == 2 and others[0] is head.weight and others[1] is head.bias
    x = models.batch("mlp")
    assert torch.equal(wrapped(x), models.build("mlp")(x))


@pytest.mark.req("FP-7")
def test_attributes_are_views_of_the_flat_param(ops: FlatParamOps) -> None:
    plain, wrapped = _pair(ops, "mlp")
    flat = ops.flat_param(wrapped)
    first = wrapped.module.net[0].weight
    assert first.shape == plain.net[0].weight.shape and torch.equal(first, plain.net[0].weight)
    assert first.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    with torch.no_grad():
        flat.mul_(0.5)
        for p in plain.parameters():
            p.mul_(0.5)
    x = models.batch("mlp")
    assert torch.equal(wrapped(x), plain(x))
    assert torch.equal(wrapped.module.net[2].bias, plain.net[2].bias)


@pytest.mark.req("FP-8")
@pytest.mark.parametrize("name", ["mlp", "tied", "buffers", "nested", "tiny"])
def test_grad_reaches_flat_param(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = _pair(ops, name)
    x = models.batch(name)
    models.loss(plain(x)).backward()
    models.loss(wrapped(x)).backward()
    grads = dict(plain.named_parameters())
    for prefix, flat in _flats_with_prefix(ops, wrapped):
        assert flat.grad is not None, "no gradient reached the flat parameter"
        names = [_plain_name(prefix + n) for n in ops.info(flat).names]
        want = torch.cat([grads[n].grad.reshape(-1) for n in names])
        assert torch.equal(flat.grad, want), f"flat grad != unwrapped grads of {names}"


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


@pytest.mark.req("FP-8")
@pytest.mark.parametrize("name", list(models.ZOO))
def test_training_matches_unwrapped(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = _pair(ops, name)
    opt_plain, opt_wrapped = _sgd(plain), _sgd(wrapped)
    for step in range(3):
        x = models.batch(name, seed=step)
        models.train_step(plain, opt_plain, x)
        models.train_step(wrapped, opt_wrapped, x)
    _assert_same_state(wrapped.state_dict(), plain.state_dict(), f"{name} after 3 SGD steps")


@pytest.mark.req("FP-9")
def test_tied_params_are_flattened_once(ops: FlatParamOps) -> None:
    plain, wrapped = _pair(ops, "tied")
    flat = ops.flat_param(wrapped)
    names = ops.info(flat).names
    assert "embed.weight" in names and "head.weight" not in names, f"tied weight flattened as {names}"
    assert flat.numel() == sum(p.numel() for p in plain.parameters())  # parameters() yields a tied one once
    module = wrapped.module
    assert module.embed.weight is module.head.weight, "the tied names do not share one view"
    with torch.no_grad():
        flat.add_(1.0)
    assert torch.equal(module.head.weight, plain.embed.weight + 1.0)
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
    _assert_same_state(wrapped.state_dict(), plain.state_dict(), f"{name} wrapped with no parameters")
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
    assert wrapped_seq[1] is seq[1]
    with pytest.raises(AttributeError):
        wrapped.no_such_attribute


# -- FP-12 .. FP-15: state_dict and load_state_dict -------------------------------------------------


@pytest.mark.req("FP-12")
@pytest.mark.parametrize("name", list(models.ZOO))
def test_state_dict_has_unwrapped_keys_and_values(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = _pair(ops, name)
    _assert_same_state(wrapped.state_dict(), plain.state_dict(), f"{name} state_dict")


@pytest.mark.req("FP-12")
@pytest.mark.parametrize("name", ["mlp", "nested", "frozen"])
def test_state_dict_of_model_containing_wrappers(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = _pair(ops, name)
    stem = nn.Linear(2, 2)
    outer_plain = nn.ModuleDict({"stem": stem, "body": plain})
    outer_wrapped = nn.ModuleDict({"stem": copy.deepcopy(stem), "body": wrapped})
    _assert_same_state(outer_wrapped.state_dict(), outer_plain.state_dict(), f"{name} inside a ModuleDict")


@pytest.mark.req("FP-13")
@pytest.mark.parametrize("name", list(models.ZOO))
def test_load_round_trips_with_unwrapped(ops: FlatParamOps, name: str) -> None:
    source = models.build(name, seed=1)
    _, wrapped = _pair(ops, name, seed=0)
    wrapped.load_state_dict(source.state_dict())
    _assert_same_state(wrapped.state_dict(), source.state_dict(), f"{name} after loading an unwrapped state_dict")
    x = models.batch(name)
    assert torch.equal(wrapped(x), source(x))
    back = models.build(name, seed=2)
    back.load_state_dict(WRAPPINGS[name](ops, models.build(name, seed=3)).state_dict())
    _assert_same_state(back.state_dict(), models.build(name, seed=3).state_dict(), f"{name} loaded from wrapped")


@pytest.mark.req("FP-13")
@pytest.mark.parametrize("name", ["mlp", "nested", "buffers"])
def test_non_strict_load_reports_like_unwrapped(ops: FlatParamOps, name: str) -> None:
    source = models.build(name, seed=1).state_dict()
    partial = {k: v for i, (k, v) in enumerate(source.items()) if i % 2 == 0}
    partial["extra.weight"] = torch.zeros(1)
    plain, wrapped = _pair(ops, name)
    want = plain.load_state_dict(dict(partial), strict=False)
    got = wrapped.load_state_dict(dict(partial), strict=False)
    assert sorted(got.missing_keys) == sorted(want.missing_keys)
    assert sorted(got.unexpected_keys) == sorted(want.unexpected_keys)
    _assert_same_state(wrapped.state_dict(), plain.state_dict(), f"{name} after a non-strict partial load")


@pytest.mark.req("FP-14")
@pytest.mark.parametrize("name", ["mlp", "nested", "frozen"])
@pytest.mark.parametrize("where", ["top", "inside"])
def test_strict_load_names_original_keys(ops: FlatParamOps, name: str, where: str) -> None:
    plain, wrapped = _pair(ops, name)
    if where == "inside":
        plain, wrapped = nn.ModuleDict({"m": plain}), nn.ModuleDict({"m": wrapped})
    state = plain.state_dict()
    dropped = list(state)[-1]
    bad = {k: v for k, v in state.items() if k != dropped}
    bad[("m." if where == "inside" else "") + "surplus"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as want:
        plain.load_state_dict(dict(bad))
    with pytest.raises(RuntimeError) as got:
        wrapped.load_state_dict(dict(bad))
    assert _quoted(str(got.value)) == _quoted(str(want.value)), (
        f"the wrapped model names other keys:\n{got.value}\nunwrapped:\n{want.value}"
    )
    assert "_fpw_module" not in str(got.value) and "flat_param" not in str(got.value)


@pytest.mark.req("FP-15")
@pytest.mark.parametrize("problem", ["wrong-shape", "missing", "unexpected"])
@pytest.mark.parametrize("name", ["mlp", "buffers"])
def test_failed_direct_load_changes_nothing(ops: FlatParamOps, name: str, problem: str) -> None:
    _, wrapped = _pair(ops, name)
    before = {k: v.clone() for k, v in wrapped.state_dict().items()}
    bad = dict(models.build(name, seed=1).state_dict())
    key = list(bad)[2]
    if problem == "wrong-shape":
        bad[key] = torch.zeros(2, 2)
    elif problem == "missing":
        del bad[key]
    else:
        key = "surplus"
        bad[key] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=re.escape(key)):
        wrapped.load_state_dict(bad)
    _assert_same_state(wrapped.state_dict(), before, "state after a failed load")


# -- FP-16, FP-17: unflatten_params -------------------------------------------------------------------


@pytest.mark.req("FP-16")
@pytest.mark.parametrize("name", ["mlp", "tied", "nested"])
def test_unflatten_params_restores_real_params(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = _pair(ops, name)
    with ops.unflatten_params(wrapped):
        inner_flats = _flat_params(ops, wrapped.module)
        assert bool(inner_flats) == (name == "nested"), "only the wrappers nested inside stay flattened"
        outer_flats = [p for p in wrapped.parameters(recurse=False) if ops.is_flat_param(p)]
        assert outer_flats == [], "the flat parameter is still registered inside unflatten_params()"
        own = dict(wrapped.module.named_parameters())
        for key, param in plain.named_parameters():
            if key in own:
                assert type(own[key]) is nn.Parameter and torch.equal(own[key], param)
        if name == "mlp":
            assert [k for k, _ in wrapped.module.named_parameters()] == [k for k, _ in plain.named_parameters()]
    assert _flat_params(ops, wrapped)
    x = models.batch(name)
    assert torch.equal(wrapped(x), plain(x))


@pytest.mark.req("FP-16")
@pytest.mark.parametrize("how", ["in-place", "assigned"])
def test_changes_inside_unflatten_params_are_kept(ops: FlatParamOps, how: str) -> None:
    plain, wrapped = _pair(ops, "mlp")
    with ops.unflatten_params(wrapped):
        layer = wrapped.module.net[2]
        if how == "in-place":
            with torch.no_grad():
                layer.weight.mul_(3.0)
        else:
            layer.weight = nn.Parameter(layer.weight.detach() * 3.0)
    with torch.no_grad():
        plain.net[2].weight.mul_(3.0)
    _assert_same_state(wrapped.state_dict(), plain.state_dict(), f"after a change ({how}) inside unflatten_params")
    x = models.batch("mlp")
    assert torch.equal(wrapped(x), plain(x))


class _Boom(Exception):
    pass


@pytest.mark.req("FP-17")
def test_unflatten_params_reflattens_on_error(ops: FlatParamOps) -> None:
    plain, wrapped = _pair(ops, "mlp")
    names_before = [n for n, _ in wrapped.named_parameters()]
    with pytest.raises(_Boom):
        with ops.unflatten_params(wrapped):
            with torch.no_grad():
                wrapped.module.net[0].bias.add_(1.0)
            raise _Boom()
    assert [n for n, _ in wrapped.named_parameters()] == names_before
    assert ops.is_flat_param(ops.flat_param(wrapped))
    with torch.no_grad():
        plain.net[0].bias.add_(1.0)
    x = models.batch("mlp")
    assert torch.equal(wrapped(x), plain(x))


# -- FP-18, FP-19: bad wrapper input ------------------------------------------------------------------


def _mixed_dtype(ops: FlatParamOps) -> Any:
    model = models.build("mlp")
    model.net[2].double()
    return ops.wrap(model, list(model.parameters()))


def _listed_flat_param(ops: FlatParamOps) -> Any:
    model = models.build("mlp")
    model.net[0] = ops.wrap(model.net[0], list(model.net[0].parameters()))
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
    params = [model.a.weight] if listed == "all-tied" else [model.a.weight, model.a.bias]
    with pytest.raises(ValueError, match=r"a\.weight.*b\.weight|b\.weight.*a\.weight"):
        ops.wrap(model, params)


@pytest.mark.req("FP-19")
def test_params_tied_by_storage_may_be_listed_together(ops: FlatParamOps) -> None:
    model = _StorageTied()
    wrapped = ops.wrap(model, [model.a.weight, model.b.weight])
    flat = ops.flat_param(wrapped)
    assert flat is not None and flat.numel() == 18


# -- FP-20 .. FP-22: copies and moves ----------------------------------------------------------------


@pytest.mark.req("FP-20")
@pytest.mark.parametrize("name", ["mlp", "tied", "nested"])
@pytest.mark.parametrize("after_forward", [False, True], ids=["fresh", "after-forward"])
def test_deepcopy_is_independent_and_equal(ops: FlatParamOps, name: str, after_forward: bool) -> None:
    plain, wrapped = _pair(ops, name)
    x = models.batch(name)
    if after_forward:
        models.loss(wrapped(x)).backward()
    clone = copy.deepcopy(wrapped)
    _assert_same_state(clone.state_dict(), plain.state_dict(), f"deepcopy of {name}")
    for a, b in zip(_flat_params(ops, clone), _flat_params(ops, wrapped)):
        assert ops.is_flat_param(a) and a is not b and ops.info(a) == ops.info(b)
    with torch.no_grad():
        for flat in _flat_params(ops, clone):
            flat.zero_()
    _assert_same_state(wrapped.state_dict(), plain.state_dict(), f"original {name} after zeroing its copy")
    assert torch.equal(wrapped(x), plain(x))
    assert bool((clone.state_dict()[list(plain.state_dict())[0]] == 0).all()), "the copy does not use its own flat param"


@pytest.mark.req("FP-21")
@pytest.mark.parametrize("name", ["mlp", "tied", "nested"])
def test_pickle_round_trip(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = _pair(ops, name)
    x = models.batch(name)
    models.loss(wrapped(x)).backward()
    restored = pickle.loads(pickle.dumps(wrapped))
    _assert_same_state(restored.state_dict(), plain.state_dict(), f"unpickled {name}")
    assert [ops.info(f) for f in _flat_params(ops, restored)] == [ops.info(f) for f in _flat_params(ops, wrapped)]
    assert torch.equal(restored(x), plain(x))


@pytest.mark.req("FP-22")
@pytest.mark.parametrize("name", ["mlp", "tied", "buffers"])
def test_to_dtype_moves_flat_param_and_views(ops: FlatParamOps, name: str) -> None:
    plain, wrapped = _pair(ops, name)
    infos = [ops.info(f) for f in _flat_params(ops, wrapped)]
    plain.to(torch.float64)
    wrapped.to(torch.float64)
    flats = _flat_params(ops, wrapped)
    assert all(ops.is_flat_param(f) and f.dtype == torch.float64 for f in flats)
    assert [ops.info(f) for f in flats] == infos
    x = models.batch(name)
    x = x if name == "tied" else x.double()
    assert torch.equal(wrapped(x), plain(x))
    opt_plain, opt_wrapped = _sgd(plain), _sgd(wrapped)
    models.train_step(plain, opt_plain, x)
    models.train_step(wrapped, opt_wrapped, x)
    _assert_same_state(wrapped.state_dict(), plain.state_dict(), f"{name} trained after .to(float64)")


@pytest.mark.req("FP-22")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="moving to another device needs a CUDA device; none here")
def test_to_device_moves_flat_param_and_views(ops: FlatParamOps) -> None:
    plain, wrapped = _pair(ops, "mlp")
    plain.to("cuda")
    wrapped.to("cuda")
    flat = ops.flat_param(wrapped)
    assert ops.is_flat_param(flat) and flat.device.type == "cuda"
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
