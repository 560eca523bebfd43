"""Unit tests of the helpers behind reference.state_dict: FQN resolution, optimizer-state flattening.

Single process, no process group. The behaviour users see is checked by conformance/test_state_dict.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from reference.fqn import FQNResolver, ResolvedPath, named_parameter_fqns, submodule_paths
from reference.state_dict import optim_fqn as optim_sd


def _nested() -> nn.Module:
    root = nn.Module()
    root.add_module("1", nn.Sequential(nn.Linear(2, 2)))
    root.add_module("10", nn.Sequential(nn.Linear(2, 2)))
    return root


def _sequential(model: nn.Module, path: str) -> nn.Sequential:
    """The ``nn.Sequential`` at ``path`` of a :func:`_nested` model."""
    module = model.get_submodule(path)
    assert isinstance(module, nn.Sequential), (path, type(module).__name__)
    return module


def _owner(resolver: FQNResolver, raw_key: str) -> ResolvedPath:
    """The resolution of the module that owns ``raw_key``."""
    resolved = resolver.resolve_key(raw_key)
    assert resolved is not None, f"{raw_key!r} resolves to no module"
    return resolved[1]


def test_wrapper_segments_are_optional_in_raw_paths() -> None:
    model = _nested()
    inner = model.get_submodule("1")
    model.add_module("1", checkpoint_wrapper(inner))
    compiled = torch.compile(model)
    assert isinstance(compiled, nn.Module)  # an OptimizedModule; torch.compile's stubs say a callable
    resolver = FQNResolver(compiled)
    for raw in ("_orig_mod.1._checkpoint_wrapped_module.0.weight", "_orig_mod.1.0.weight", "1.0.weight"):
        assert resolver.clean_key(raw) == "1.0.weight", raw
    assert resolver.resolve("_orig_mod.2") is None
    with pytest.raises(RuntimeError, match="nope.weight"):
        resolver.clean_key("nope.weight")


def test_selection_matches_at_dot_boundaries_and_through_wrappers() -> None:
    model = _nested()
    one = model.get_submodule("1")
    model.add_module("1", checkpoint_wrapper(one))
    resolver = FQNResolver(model, frozenset({id(one)}))  # the inner module, not the wrapper
    assert _owner(resolver, "1.0.weight").selected == ("1",)
    assert _owner(resolver, "10.0.weight").selected == ()


def test_submodule_paths_of_a_shared_module_and_of_a_stranger() -> None:
    model = _nested()
    shared = nn.Linear(2, 2)
    _sequential(model, "1").append(shared)
    _sequential(model, "10").append(shared)
    assert submodule_paths(model, [shared])[id(shared)] == {"1.1", "10.1"}
    with pytest.raises(ValueError, match="Linear"):
        submodule_paths(model, [nn.Linear(1, 1)])


def test_tied_parameter_is_keyed_by_its_first_fqn() -> None:
    model = _nested()
    model.get_submodule("10")[0].weight = model.get_submodule("1")[0].weight
    fqns = named_parameter_fqns(model)
    assert fqns[model.get_submodule("1")[0].weight] == ["1.0.weight", "10.0.weight"]


def test_flatten_unflatten_round_trip() -> None:
    model = _nested()
    opt = torch.optim.Adam([{"params": model.get_submodule("1").parameters(), "lr": 0.1},
                            {"params": model.get_submodule("10").parameters(), "lr": 0.2}])
    optim_sd.init_state(opt)  # a zero-lr step on zero grads creates the Adam state
    fqns = named_parameter_fqns(model)
    nested = optim_sd.to_fqn_keyed((opt,), fqns)
    flat = optim_sd.flatten(nested)
    assert "state.1.0.weight.exp_avg" in flat and flat["param_groups.10.0.bias.lr"] == 0.2
    back = optim_sd.unflatten(flat, fqns)
    assert sorted(back["state"]) == sorted(nested["state"])
    assert [g["params"] for g in back["param_groups"]] == [g["params"] for g in nested["param_groups"]]
    with pytest.raises(ValueError, match="state.9.weight"):
        optim_sd.unflatten({"state.9.weight.step": 1}, fqns)


def _stepped(optim_class: Any, **hyper: Any) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    groups = [{"params": list(model[0].parameters()), "sdc_key": "a"}, {"params": list(model[1].parameters())}]
    optim: torch.optim.Optimizer = optim_class(groups, lr=0.1, **hyper)
    model(torch.randn(4, 3)).sum().backward()
    optim.step()
    model(torch.randn(4, 3)).sum().backward()  # gradients held while the helper runs
    return model, optim


def _everything(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[object, ...]:
    state = [(id(p), {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}) for p, s in optim.state.items()]
    groups = [{k: (list(map(id, v)) if k == "params" else v) for k, v in g.items()} for g in optim.param_groups]
    return state, groups, [p.grad.clone() for p in model.parameters()], [p.detach().clone() for p in model.parameters()]


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize(("optim_class", "hyper", "loaded", "holds"), [
    (torch.optim.AdamW, {}, {}, True),
    (torch.optim.SGD, {"momentum": 0.9}, {}, True),
    (torch.optim.SGD, {}, {}, False),
    (torch.optim.SGD, {}, {"momentum": 0.9}, True),  # the loaded hyperparameters decide
    (torch.optim.SGD, {"momentum": 0.9}, {"momentum": 0.0}, False),
])
def test_stateful_after_load_decides_by_the_loaded_hyperparameters_and_changes_nothing(
        optim_class: Any, hyper: dict[str, Any], loaded: dict[str, Any], holds: bool) -> None:
    model, optim = _stepped(optim_class, **hyper)
    before = _everything(model, optim)
    weight = optim.param_groups[1]["params"][0]  # 1.weight
    group = {**{k: v for k, v in optim.param_groups[1].items() if k != "params"}, **loaded}
    assert optim_sd.stateful_after_load(optim, {weight: group}) == ({weight} if holds else set())
    assert _same(_everything(model, optim), before), "the optimizer, its gradients or the parameters changed"


def test_from_ids_reads_groups_by_position_and_refuses_what_does_not_fit() -> None:
    model, optim = _stepped(torch.optim.AdamW)
    fqns = named_parameter_fqns(model)
    got = optim_sd.from_ids((optim,), optim.state_dict(), fqns)
    assert [g["params"] for g in got["param_groups"]] == [["0.weight", "0.bias"], ["1.weight", "1.bias"]]
    assert sorted(got["state"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    one_group = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="2 param groups"):
        optim_sd.from_ids((one_group,), optim.state_dict(), fqns)
    with pytest.raises(ValueError, match="2 optimizers"):
        optim_sd.from_ids((optim, one_group), optim.state_dict(), fqns)
