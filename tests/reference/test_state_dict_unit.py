"""Unit tests of the helpers behind reference.state_dict: FQN resolution, optimizer-state flattening.

Single process, no process group. The behaviour users see is checked by conformance/test_state_dict.py.
"""

from __future__ import annotations

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
