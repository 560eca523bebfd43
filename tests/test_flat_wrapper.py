"""Self-tests of conformance/flat_wrapper.py, the suite's own flat-parameter wrapper (a test input)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conformance import models as zoo
from conformance.asserts import assert_same_state
from conformance.flat_wrapper import FLAT_PARAM, WRAPPED_MODULE, FlatParamsWrapper


def _wrapped(name: str, seed: int = 0) -> tuple[nn.Module, FlatParamsWrapper]:
    """A zoo model, and a copy of it wrapped over its trainable parameters."""
    plain = zoo.build(name, seed=seed)
    inner = copy.deepcopy(plain)
    return plain, FlatParamsWrapper(inner, [p for p in inner.parameters() if p.requires_grad])


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensor(module: nn.Module, path: str) -> torch.Tensor:
    """The tensor attribute at ``path`` (a flattened parameter's view is an attribute, not a parameter)."""
    owner, _, attr = path.rpartition(".")
    value = getattr(module.get_submodule(owner), attr)
    assert isinstance(value, torch.Tensor), path
    return value


@pytest.mark.parametrize("name", tuple(zoo.ZOO))
def test_state_dict_is_the_unwrapped_one(name: str) -> None:
    """Keys in order (ties under each name, no segment, no flat key), dtypes and bits; twice, and with keep_vars."""
    plain, wrapped = _wrapped(name)
    expected = plain.state_dict()
    assert_same_state(wrapped.state_dict(), expected, what=f"state dict of {name}")
    assert_same_state(wrapped.state_dict(), expected, what=f"second state dict of {name}")
    assert list(wrapped.state_dict(keep_vars=True)) == list(expected)
    assert [n for n, _ in wrapped.named_parameters()] == [FLAT_PARAM] + [
        f"{WRAPPED_MODULE}.{n}" for n, p in plain.named_parameters() if not p.requires_grad
    ]


def test_one_flat_parameter_whose_views_the_modules_read() -> None:
    plain, wrapped = _wrapped("tied")
    flat = wrapped.flat_param
    trainable = [p for p in plain.parameters() if p.requires_grad]
    assert torch.equal(flat.detach(), torch.cat([p.detach().reshape(-1) for p in trainable]))
    inner = wrapped.module
    for name in ("embed.weight", "body.weight", "head.weight"):
        value = _tensor(inner, name)
        assert not isinstance(value, nn.Parameter), name
        assert _storage(value) == _storage(flat), f"{name} is not a view of flat_param"
    assert _tensor(inner, "head.weight") is _tensor(inner, "embed.weight"), "a tied parameter: one view under both names"
    with torch.no_grad():
        flat.zero_()
    assert not _tensor(inner, "body.weight").any(), "a write into flat_param shows in the view"
    assert all(_storage(v) == _storage(flat) for k, v in wrapped.state_dict().items()), "state dict values share memory with flat_param"


def test_training_moves_the_flat_parameter_as_the_unwrapped_model_moves() -> None:
    plain, wrapped = _wrapped("mlp")
    for model in (plain, wrapped):
        zoo.loss(model(zoo.batch("mlp"))).backward()
    grad = wrapped.flat_param.grad
    assert grad is not None
    torch.testing.assert_close(grad, torch.cat([p.grad.reshape(-1) for p in plain.parameters()]), rtol=0, atol=0)
    assert wrapped.net is wrapped.module.net, "attributes fall through to the wrapped module"


def test_load_writes_the_original_keys_into_the_flat_parameter() -> None:
    source = zoo.build("buffers", seed=1)
    _, wrapped = _wrapped("buffers")
    flat = wrapped.flat_param
    result = wrapped.load_state_dict(source.state_dict())
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    assert wrapped.flat_param is flat, "loaded in place"
    assert torch.equal(flat.detach(), torch.cat([p.detach().reshape(-1) for p in source.parameters()]))
    assert_same_state(wrapped.state_dict(), source.state_dict(), what="state dict after the load")
    source.eval(), wrapped.eval()
    torch.testing.assert_close(wrapped(zoo.batch("buffers")), source(zoo.batch("buffers")), rtol=0, atol=0)


def test_load_with_assign_also_ends_in_the_flat_parameter() -> None:
    source = zoo.build("mlp", seed=1)
    _, wrapped = _wrapped("mlp")
    wrapped.load_state_dict({k: v.clone() for k, v in source.state_dict().items()}, assign=True)
    assert torch.equal(wrapped.flat_param.detach(), torch.cat([p.detach().reshape(-1) for p in source.parameters()]))
    assert [n for n, _ in wrapped.named_parameters()] == [FLAT_PARAM]


def test_strict_load_names_missing_unexpected_and_mis_shaped_keys_unwrapped() -> None:
    _, wrapped = _wrapped("mlp")
    good = wrapped.state_dict()
    before = wrapped.flat_param.detach().clone()
    missing = {k: v for k, v in good.items() if k != "net.2.bias"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "net\.2\.bias"'):
        wrapped.load_state_dict(missing)
    for extra in ("net.9.weight", FLAT_PARAM, f"{WRAPPED_MODULE}.net.0.weight"):
        with pytest.raises(RuntimeError, match=rf'Unexpected key\(s\) in state_dict: "{extra}"'):
            wrapped.load_state_dict({**good, extra: torch.zeros(1)})
    with pytest.raises(RuntimeError, match=r"size mismatch for net\.0\.weight") as info:
        wrapped.load_state_dict({**good, "net.0.weight": torch.zeros(3, 3)})
    assert WRAPPED_MODULE not in str(info.value)
    result = wrapped.load_state_dict({**missing, "net.9.weight": torch.zeros(1)}, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["net.2.bias"], ["net.9.weight"])
    assert torch.equal(wrapped.flat_param.detach(), before), "the loads wrote the values they had"
    assert [n for n, _ in wrapped.named_parameters()] == [FLAT_PARAM], "flattened again after every load"


def test_inside_a_larger_model_the_keys_are_the_unwrapped_model_s() -> None:
    plain, wrapped = _wrapped("nested")
    plain_outer, outer = nn.Sequential(nn.Linear(2, 2), plain), nn.Sequential(nn.Linear(2, 2), wrapped)
    outer[0].load_state_dict(plain_outer[0].state_dict())
    assert_same_state(outer.state_dict(), plain_outer.state_dict(), what="state dict of the outer model")
    source = nn.Sequential(nn.Linear(2, 2), zoo.build("nested", seed=1))
    outer.load_state_dict(source.state_dict())
    assert_same_state(outer.state_dict(), source.state_dict(), what="outer state dict after a load")


def test_registration_order_is_kept_when_only_some_parameters_are_flattened() -> None:
    layer = nn.Linear(3, 2)
    expected = copy.deepcopy(layer.state_dict())
    wrapped = FlatParamsWrapper(layer, [layer.bias])  # weight stays registered, before bias
    assert_same_state(wrapped.state_dict(), expected, what="state dict")
    assert [n for n, _ in wrapped.named_parameters()] == [FLAT_PARAM, f"{WRAPPED_MODULE}.weight"]


def test_bad_parameter_lists_are_refused() -> None:
    model = zoo.build("frozen")
    with pytest.raises(ValueError, match="empty"):
        FlatParamsWrapper(model, [])
    with pytest.raises(ValueError, match="requires_grad"):
        FlatParamsWrapper(model, list(model.parameters()))
    with pytest.raises(ValueError, match="not a parameter"):
        FlatParamsWrapper(model, [model.get_parameter("body.weight"), nn.Parameter(torch.zeros(2))])
