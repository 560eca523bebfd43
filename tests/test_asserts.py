"""Self-tests of the suite's assertion helpers (conformance/asserts.py) and value domains
(conformance/values.py): each helper passes on equal input and fails, with the one message shape,
for every way the compared thing can differ."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from conformance import asserts
from conformance.asserts import (
    assert_bitwise_equal,
    assert_names_key,
    assert_planned_shard,
    assert_same_error_on_every_rank,
    assert_same_state,
    assert_unchanged,
    bits,
    check_each,
    expect_error,
    expected_local_chunk,
    fail,
    raised,
    snapshot,
)
from conformance.harness.failures import Failure, PropertiesFailed
from conformance.values import EDGE_DTYPES, different_like, edge_tensors, edge_values, perturb_hyperparameters

Failed = pytest.fail.Exception


def _fails(fn: Any, *needles: str) -> str:
    """``fn()`` fails the test through :func:`conformance.asserts.fail`; the message has the one shape."""
    with pytest.raises(Failed) as info:
        fn()
    text = str(info.value)
    assert "\n  got:      " in text and "\n  expected: " in text, text
    for needle in needles:
        assert needle in text, f"{needle!r} not in:\n{text}"
    return text


# -- bits and single tensors ------------------------------------------------------------------------


def test_bits_tell_negative_zero_and_nan_payloads_apart() -> None:
    assert not torch.equal(bits(torch.tensor([0.0])), bits(torch.tensor([-0.0])))
    nans = edge_values(torch.float32)[-5:-3]  # the two payload NaNs
    assert torch.isnan(nans).all() and not torch.equal(bits(nans[:1]), bits(nans[1:]))
    assert torch.equal(bits(nans.clone()), bits(nans))
    assert torch.equal(bits(torch.tensor([True, False])), torch.tensor([1, 0], dtype=torch.uint8))


@pytest.mark.parametrize(
    "got, needle",
    [
        (torch.tensor([1.0, -0.0]), "values differ"),
        (torch.tensor([1.0, 0.0], dtype=torch.float64), "dtype differs"),
        (torch.tensor([[1.0, 0.0]]), "shape differs"),
        ([1.0, 0.0], "not a tensor"),
    ],
    ids=["negative-zero", "dtype", "shape", "list"],
)
def test_assert_bitwise_equal_fails_for_each_difference(got: Any, needle: str) -> None:
    expected = torch.tensor([1.0, 0.0])
    _fails(lambda: assert_bitwise_equal(got, expected, what="w", where="here"), needle, "where:    here")


def test_assert_bitwise_equal_passes_nan_and_views() -> None:
    for name, value in edge_tensors(3).items():
        assert_bitwise_equal(value.clone(), value, where=name)
    base = torch.arange(12.0).reshape(3, 4)
    assert_bitwise_equal(base.t().contiguous(), base.t())
    text = _fails(lambda: assert_bitwise_equal(base.t().contiguous() + 0.5, base.t()), "first at index (0, 0)")
    assert "12 of 12 elements differ" in text


# -- nested state -------------------------------------------------------------------------------


def _state() -> dict[str, Any]:
    return {"a": torch.tensor([1.0, float("nan")]), "b": {"step": 3, "lr": 0.5, "betas": (0.9, 0.99)}, "c": [1, "x"]}


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda s: s.pop("c"), "keys differ"),
        (lambda s: s.update(extra=1), "keys differ"),
        (lambda s: s.update(a=s.pop("a")), "key order differs"),
        (lambda s: s["b"].update(step=3.0), "type differs"),
        (lambda s: s["b"].update(step=True), "type differs"),
        (lambda s: s["b"].update(betas=[0.9, 0.99]), "sequence differs"),
        (lambda s: s["b"].update(lr=0.25), "value differs"),
        (lambda s: s.update(a=torch.tensor([1.0, 0.0])), "values differ"),
        (lambda s: s["c"].append(2), "sequence differs"),
    ],
    ids=["missing", "unexpected", "order", "int-vs-float", "int-vs-bool", "tuple-vs-list", "float", "tensor", "length"],
)
def test_assert_same_state_fails_for_each_difference(change: Any, needle: str) -> None:
    got = _state()
    change(got)
    _fails(lambda: assert_same_state(got, _state(), what="sd"), needle)


def test_assert_same_state_passes_equal_state_and_names_the_path() -> None:
    assert_same_state(_state(), _state())
    got = _state()
    got["b"]["lr"] = 0.75
    assert "['b']['lr']" in _fails(lambda: assert_same_state(got, _state()))
    reordered = dict(reversed(list(_state().items())))
    assert_same_state(reordered, _state(), check_order=False)


@pytest.mark.parametrize(
    "got, expected",
    [(-0.0, 0.0), (0.0, -0.0), (float("nan"), struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0])],
    ids=["negative-zero", "positive-zero", "nan-payload"],
)
def test_assert_same_state_compares_float_leaves_bit_for_bit(got: float, expected: float) -> None:
    """A hyperparameter round-trips exactly: ``==`` would take -0.0 for 0.0 and cannot compare NaNs."""
    text = _fails(lambda: assert_same_state({"lr": got}, {"lr": expected}), "value differs", "(bits 0x")
    assert "['lr']" in text
    assert_same_state({"lr": expected}, {"lr": struct.unpack("<d", struct.pack("<d", expected))[0]})


def test_first_difference_shows_bits_where_values_print_alike() -> None:
    nans = edge_values(torch.float32)[-5:-3]  # two NaNs with different payloads
    _fails(lambda: assert_bitwise_equal(nans[:1].clone(), nans[1:].clone()), "nan (bits 0x")


def test_tolerance_applies_to_floats_only() -> None:
    expected = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor([5])}
    assert_same_state({"w": torch.tensor([1.0 + 1e-7, 2.0]), "n": torch.tensor([5])}, expected, atol=1e-6)
    _fails(lambda: assert_same_state({"w": torch.tensor([1.1, 2.0]), "n": torch.tensor([5])}, expected, atol=1e-6), "beyond atol")
    _fails(lambda: assert_same_state({"w": torch.tensor([1.0, 2.0]), "n": torch.tensor([6])}, expected, atol=1e-6), "values differ")


# -- per-rank layout ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, placements, mesh, coord, want_shape, want_offsets",
    [
        ((5, 3), [Shard(0)], (2,), (1,), (2, 3), [3, 0]),  # chunk of ceil(5/2)=3: rank 1 gets rows 3..4
        ((3,), [Shard(0)], (4,), (3,), (0,), [3]),  # rank 3 of 4 holds nothing
        ((3,), [Shard(0)], (4,), (2,), (1,), [2]),
        ((10, 3), [Replicate(), Shard(0)], (2, 2), (1, 1), (5, 3), [5, 0]),
        ((15, 2), [Shard(0), Shard(0)], (2, 2), (1, 0), (4, 2), [8, 0]),  # 15 -> 8|7, then 7 -> 4|3
        ((5, 15), [Shard(0), Shard(1)], (2, 2), (0, 1), (3, 7), [0, 8]),
    ],
)
def test_expected_local_chunk_follows_torch_chunk(shape, placements, mesh, coord, want_shape, want_offsets) -> None:
    full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    piece, offsets = expected_local_chunk(full, placements, mesh, coord)
    assert tuple(piece.shape) == want_shape and offsets == want_offsets
    index = tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))
    assert torch.equal(piece, full[index])


_PLANNED_MESHES: dict[tuple[int, ...], Any] = {}


def _planned_mesh(dist: Any, ranks: list[Any]) -> Any:
    """A DeviceMesh over ``ranks`` (nested lists of global ranks), one per layout per rank process:
    building one creates process groups, collectively."""
    from torch.distributed.device_mesh import DeviceMesh

    key = tuple(torch.tensor(ranks).reshape(-1).tolist()) + tuple(torch.tensor(ranks).shape)
    if key not in _PLANNED_MESHES:
        _PLANNED_MESHES[key] = DeviceMesh(dist.device.type, torch.tensor(ranks))
    return _PLANNED_MESHES[key]


def _on_mesh(full: torch.Tensor, mesh: Any, placements: tuple[Any, ...], coordinate: tuple[int, ...] | None = None) -> Any:
    """A DTensor of ``full`` on ``mesh`` holding the piece of ``coordinate`` (default: this rank's own)."""
    from torch.distributed.tensor import DTensor

    where = tuple(mesh.get_coordinate()) if coordinate is None else coordinate
    piece, _ = expected_local_chunk(full, placements, tuple(mesh.shape), where)
    return DTensor.from_local(piece.clone(), mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "HYBRID_SHARD"])
def test_assert_planned_shard_passes_the_plan_and_fails_every_other_layout(dist: Any, strategy: str) -> None:
    """The planned layout passes (as a 2-D ``(replicate, shard)`` mesh, and as the 1-D mesh where one
    axis is trivial); a mesh read the wrong way round (transposed), other placements, another rank's
    piece, a plain tensor and a 1-D mesh where the plan needs two dims each fail, naming what differs."""
    from conformance.adapters.sharding import strategy_layout

    replicas, shards = strategy_layout(strategy, dist.world_size)
    plan = {"replicas": replicas, "shards": shards, "rank": dist.rank}
    full = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    grid = torch.arange(dist.world_size).reshape(replicas, shards)
    two_d = _planned_mesh(dist, grid.tolist())
    assert_planned_shard(_on_mesh(full, two_d, (Replicate(), Shard(0))), full, **plan)
    assert_planned_shard(_on_mesh(full, two_d, (Replicate(), Shard(0))), full + 1e-7, **plan, atol=1e-6)
    one_d = _planned_mesh(dist, list(range(dist.world_size)))
    if replicas == 1 or shards == 1:
        assert_planned_shard(_on_mesh(full, one_d, (Shard(0),) if shards > 1 else (Replicate(),)), full, **plan)
    else:
        _fails(lambda: assert_planned_shard(_on_mesh(full, one_d, (Shard(0),)), full, **plan), "mesh dimensions")
    _fails(lambda: assert_planned_shard(full.clone(), full, **plan), "not a DTensor")
    _fails(lambda: assert_planned_shard(_on_mesh(full, two_d, (Replicate(), Shard(0))), full * 2, **plan), "local shard")
    if shards > 1:
        # the piece of the next rank of the shard group: a self-consistent DTensor of another layout
        wrong = ((dist.rank // shards), (dist.rank + 1) % shards)
        _fails(lambda: assert_planned_shard(_on_mesh(full, two_d, (Replicate(), Shard(0)), wrong), full, **plan), "local shard")
        _fails(lambda: assert_planned_shard(_on_mesh(full, two_d, (Replicate(), Replicate())), full, **plan), "placements")
        _fails(lambda: assert_planned_shard(_on_mesh(full, one_d, (Replicate(),)), full, **plan), "placements")
    if dist.world_size > 1:
        transposed = _planned_mesh(dist, grid.t().tolist())  # dims swapped: shard groups are read as replicas
        _fails(lambda: assert_planned_shard(_on_mesh(full, transposed, (Replicate(), Shard(0))), full, **plan),
               "mesh")
    if replicas > 1:
        _fails(lambda: assert_planned_shard(_on_mesh(full, two_d, (Shard(0), Replicate())), full, **plan), "placements")


# -- changes nothing --------------------------------------------------------------------------------


class _WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("hidden", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.hidden


def _objects() -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(0)
    model = _WithBuffers()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    sd = {"w": torch.ones(2), "meta": torch.empty(3, device="meta"), "nested": {"k": [1, 2]}}
    return model, optim, sd


def _equal_copy(param: nn.Parameter) -> nn.Parameter:
    """A new Parameter equal to ``param`` in every value it carries, its grad included."""
    copy = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
    copy.grad = None if param.grad is None else param.grad.clone()
    return copy


@pytest.mark.parametrize(
    "change",
    [
        lambda m, o, sd: m.lin.weight.data.add_(1.0),
        lambda m, o, sd: m.hidden.fill_(1.0),
        lambda m, o, sd: setattr(m.lin.weight, "grad", None),
        lambda m, o, sd: o.param_groups[0].update(lr=0.2),
        lambda m, o, sd: o.param_groups[0].update(initial_lr=0.1),
        lambda m, o, sd: o.state[m.lin.weight]["exp_avg"].add_(1.0),
        lambda m, o, sd: o.param_groups[0]["params"].reverse(),
        lambda m, o, sd: sd.update(w=sd["w"].clone()),
        lambda m, o, sd: sd.update(meta=torch.empty(3)),
        lambda m, o, sd: sd["nested"]["k"].append(3),
        lambda m, o, sd: setattr(m.lin, "weight", _equal_copy(m.lin.weight)),
        lambda m, o, sd: setattr(m, "hidden", m.hidden.clone()),
    ],
    ids=["param", "non-persistent-buffer", "grad", "lr", "extra-key", "optim-state", "param-order", "entry-identity",
         "meta-built", "nested", "param-replaced-by-equal", "buffer-replaced-by-equal"],
)
def test_assert_unchanged_sees_every_change(change: Any) -> None:
    model, optim, sd = _objects()
    before = snapshot(model=model, optim=optim, sd=sd)
    assert_unchanged(before, model=model, optim=optim, sd=sd)
    change(model, optim, sd)
    _fails(lambda: assert_unchanged(before, model=model, optim=optim, sd=sd, where="after load"), "must change nothing")


def test_assert_unchanged_needs_the_snapshot_objects() -> None:
    model, optim, _ = _objects()
    before = snapshot(model=model)
    with pytest.raises(TypeError, match="pass the objects of the snapshot"):
        assert_unchanged(before, optim=optim)


# -- messages and errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "message, key, needle",
    [
        ("Missing key(s) in state_dict: 'net.0.weight'.", "weight", "does not name the key"),
        ("Missing key(s): 'net.0.weight_orig'", "net.0.weight", "does not name the key"),
        ("Missing key(s): 'x.net.0.weight'", "net.0.weight", "does not name the key"),
        ("Missing key(s): '_orig_mod.net.0.weight'", "net.0.weight", "internal path"),
        ("size mismatch for _fpw_module.net.0.weight", "net.0.weight", "internal path"),
    ],
    ids=["suffix-only", "longer-name", "longer-prefix", "compile-segment", "fpw-segment"],
)
def test_assert_names_key_wants_the_whole_canonical_key(message: str, key: str, needle: str) -> None:
    _fails(lambda: assert_names_key(message, key), needle)


def test_assert_names_key_passes_whole_keys() -> None:
    assert_names_key("Missing key(s) in state_dict: 'net.0.weight'.", "net.0.weight")
    assert_names_key("size mismatch for net.0.weight: copying a param with shape [2]", "net.0.weight")
    assert_names_key("unexpected key 10.proj.bias", "10.proj.bias")


class _NotAnException(BaseException):
    pass


def test_raised_and_expect_error() -> None:
    def boom() -> None:
        raise _NotAnException("bad key 'a.b'")

    assert isinstance(raised(boom), _NotAnException)  # DCP's CheckpointException is a BaseException
    assert raised(lambda: None) is None
    expect_error(boom, _NotAnException, keys=["a.b"], needles=["bad"])
    _fails(lambda: expect_error(lambda: None, ValueError), "no error raised")
    _fails(lambda: expect_error(boom, ValueError), "wrong exception type", "_NotAnException")
    _fails(lambda: expect_error(boom, _NotAnException, needles=["shape"]), "lacks ['shape']")
    _fails(lambda: expect_error(boom, _NotAnException, keys=["b"]), "does not name the key")
    with pytest.raises(pytest.skip.Exception):
        raised(lambda: pytest.skip("passes through"))


def test_a_long_message_keeps_its_last_lines() -> None:
    """A CheckpointException's message is a traceback per rank: the exception and what went wrong are
    in its last lines, past any head a message is cut to (seen with torch 2.11, whose 667-character
    message lost 'AssertionError: metadata is None' and with it the pin that names it)."""
    frames = "".join(f'  File "/site-packages/torch/distributed/checkpoint/f{i}.py", line {i}, in step\n' for i in range(12))

    def missing_metadata() -> None:
        raise _NotAnException(f"CheckpointException ranks:dict_keys([0])\n{frames}AssertionError: metadata is None")

    with pytest.raises(pytest.fail.Exception) as failed:
        expect_error(missing_metadata, _NotAnException, needles=[".metadata"])
    message = str(failed.value)
    assert "CheckpointException ranks:dict_keys([0])" in message and "AssertionError: metadata is None" in message, message
    assert "chars cut)" in message and len(message) < 1000, message

    def short_error() -> None:
        raise ValueError("x" * 100)

    with pytest.raises(pytest.fail.Exception) as whole:
        expect_error(short_error, ValueError, needles=["y"])
    assert "x" * 100 in str(whole.value) and "cut)" not in str(whole.value)


@dataclass
class _FakeRanks:
    """Stands for a RankContext: all_gather_object returns what the other ranks are scripted to send."""

    rank: int
    others: list[Any]

    @property
    def world_size(self) -> int:
        return len(self.others) + 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj, *self.others]


@pytest.mark.req("ML-10")
def test_error_agreement_across_ranks() -> None:
    """Ranks that raised differently, or some not at all, "did not raise the same error"; when no rank
    raised (at world size 1: the one rank) the message says that no error was raised."""
    err = ValueError("bad 'k'")
    same = ("builtins.ValueError", "bad 'k'")
    assert_same_error_on_every_rank(_FakeRanks(0, [same, same]), err)
    assert_same_error_on_every_rank(_FakeRanks(0, []), err)
    _fails(lambda: assert_same_error_on_every_rank(_FakeRanks(0, [None]), err), "ranks did not raise the same error", "rank 1: returned normally")
    _fails(lambda: assert_same_error_on_every_rank(_FakeRanks(0, [("builtins.RuntimeError", "bad 'k'")]), err), "rank 1: builtins.RuntimeError")
    _fails(lambda: assert_same_error_on_every_rank(_FakeRanks(0, [("builtins.ValueError", "bad 'j'")]), err), "bad 'j'")
    none_of_two = _fails(lambda: assert_same_error_on_every_rank(_FakeRanks(0, [None]), None, what="strict load"), "strict load: no error raised on any rank")
    alone = _fails(lambda: assert_same_error_on_every_rank(_FakeRanks(0, []), None, what="strict load"), "strict load: no error raised\n")
    assert "did not raise the same" not in none_of_two + alone, none_of_two + alone


# -- value domains -----------------------------------------------------------------------------------


def test_edge_values_hold_what_narrow_implementations_lose() -> None:
    f64 = edge_values(torch.float64)
    finite = f64[torch.isfinite(f64)]
    assert (finite.float().double() != finite).any(), "no float64 value that float32 cannot hold"
    i64 = edge_values(torch.int64)
    assert (i64.double().long() != i64).any(), "no int64 value that float64 cannot hold"
    for dtype in EDGE_DTYPES:
        values = edge_values(dtype)
        if dtype.is_floating_point:
            assert torch.isnan(values).sum() >= 2 and torch.isinf(values).sum() == 2
            assert (bits(values) == bits(torch.tensor([-0.0], dtype=dtype))).any()
    tensors = edge_tensors(0)
    assert {str(v.dtype) for v in tensors.values()} >= {str(d) for d in EDGE_DTYPES}
    assert any(v.dim() == 0 for v in tensors.values()) and any(v.numel() == 0 for v in tensors.values())
    assert any(not v.is_contiguous() for v in tensors.values()) and any(v.storage_offset() for v in tensors.values())


def test_different_like_differs_in_every_element() -> None:
    for name, value in edge_tensors(1).items():
        other = different_like(value)
        assert other.dtype == value.dtype and other.shape == value.shape, name
        assert bool((bits(other) != bits(value)).all()), name


def test_perturb_hyperparameters_changes_every_one() -> None:
    params = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))]
    groups: list[dict[str, Any]] = [{"params": params[:1]}, {"params": params[1:], "lr": 0.5}]
    for optim in (
        torch.optim.AdamW(groups),
        torch.optim.SGD(params, lr=0.1, momentum=0.9),
    ):
        before = [dict(g) for g in optim.param_groups]
        perturb_hyperparameters(optim)
        for old, new in zip(before, optim.param_groups):
            numeric = [k for k, v in old.items() if k != "params" and isinstance(v, (int, float, tuple)) and not isinstance(v, bool)]
            assert numeric and all(new[k] != old[k] for k in numeric), (old, new)
            assert "initial_lr" in new and "sdc_custom" in new
    assert asserts.WRAPPER_SEGMENTS  # the segments assert_names_key forbids by default


@pytest.mark.req("HX-18")
def test_check_each_runs_every_check_and_fails_with_one_part_per_clause() -> None:
    ran = []

    def broken() -> None:
        ran.append("b")
        raise KeyError("w")

    with pytest.raises(PropertiesFailed) as info:
        check_each({"ML-4.a": lambda: fail("a broke", 1, 2), "ML-4.b": broken, "ML-4.c": lambda: ran.append("c")})
    assert ran == ["b", "c"]
    assert info.value.parts == [("ML-4.a", "a broke\n  got:      1\n  expected: 2"), ("ML-4.b", "KeyError: 'w'")]
    assert str(info.value.msg) == "[ML-4.a] a broke\n  got:      1\n  expected: 2\n[ML-4.b] KeyError: 'w'"
    failures = Failure.all_of(info.value, 1)
    assert [(f.rank, f.type, f.clause) for f in failures] == [(1, "Failed", "ML-4.a"), (1, "Failed", "ML-4.b")]
    check_each({"ML-4.a": lambda: None})  # nothing failed: nothing raised
    with pytest.raises(pytest.skip.Exception):
        check_each({"ML-4.a": lambda: pytest.skip("not provided"), "ML-4.b": lambda: fail("b", 1, 2)})
    with pytest.raises(ValueError, match="'unchanged' is not a clause ID"):
        check_each({"unchanged": lambda: None})


@pytest.mark.req("HX-18")
def test_clause_names_what_fails_inside_it() -> None:
    """The suite's assertion and the implementation's own exception are both the clause's failure; the
    innermost clause wins; a skip passes through untagged; what fails outside has no clause."""
    with pytest.raises(pytest.fail.Exception) as failed:
        with asserts.clause("ML-4.b"):
            fail("values differ", 1, 2)
    with pytest.raises(KeyError) as foreign:
        with asserts.clause("ML-4"), asserts.clause("ML-4.c"):
            raise KeyError("w")
    with pytest.raises(pytest.skip.Exception) as skipped:
        with asserts.clause("ML-4.b"):
            pytest.skip("not provided")
    with pytest.raises(ValueError) as outside:
        raise ValueError("x")
    assert [Failure.of(e.value, 0).clause for e in (failed, foreign, skipped, outside)] == ["ML-4.b", "ML-4.c", None, None]
    with pytest.raises(ValueError, match="'4.b' is not a clause ID"):
        with asserts.clause("4.b"):
            pass


@pytest.mark.req("ML-1")
def test_lazy_views_compare_and_differ_by_their_values() -> None:
    """A conjugated or negated view is compared by its values, not its raw storage, and
    ``different_like`` of one differs from it in every element."""
    from conformance.values import lazy_views

    for name, view in lazy_views(3).items():
        resolved = view.resolve_conj().resolve_neg().clone()
        assert_bitwise_equal(view, resolved, what=name)
        other = different_like(view)
        assert not (bits(other) == bits(resolved)).any(), name
    conj = lazy_views(3)["complex64.conj"]
    with pytest.raises(Failed, match="values differ"):
        assert_bitwise_equal(conj, conj.conj().resolve_conj(), what="a conjugate against its unconjugated values")
