"""``reference.fqn``: the one rule for canonical FQNs, and its use by every path of the reference.

The rule goes by the module tree, not by spelling: a wrapper (DDP, ``torch.compile``, activation
checkpointing, the reference FSDP and FlattenParamsWrapper) inserts a segment that is not part of a
canonical FQN; a module that merely has a child *named* like such a segment keeps it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from conformance import models
from reference.fqn import FQNResolver
from reference.fsdp import FullyShardedDataParallel, get_fqn_to_fsdp_param_info, get_param_to_fqns, optim_state_dict
from reference.state_dict import StateDictOptions, get_state_dict


def test_wrapper_segments_are_dropped_by_module_not_by_name() -> None:
    """Segments of wrappers go; a child that is only named like one (``module``, ``_orig_mod``) stays."""
    inner = nn.Sequential(nn.Linear(2, 2))
    inner.add_module("module", nn.Linear(2, 2))
    inner.add_module("_orig_mod", nn.Linear(2, 2))
    root = nn.Sequential(checkpoint_wrapper(inner))
    resolver = FQNResolver(root)
    assert resolver.clean_key("0._checkpoint_wrapped_module.0.weight") == "0.0.weight"
    assert resolver.clean_key("0.0.weight") == "0.0.weight"  # the segment left out, as state_dict() does
    assert resolver.clean_key("0.module.weight") == "0.module.weight"
    assert resolver.clean_key("0._orig_mod.bias") == "0._orig_mod.bias"
    assert resolver.clean_path("0._checkpoint_wrapped_module") == "0"
    with pytest.raises(RuntimeError, match="'0.nothing'"):
        resolver.clean_path("0.nothing")


class _Forwarding(nn.Module):
    """An unregistered wrapper that forwards attribute access to the module it wraps (its own segment,
    ``inner``, shows in raw names; the keys its hooks would hide it from do not have it)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.note = "not a module"

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)


def test_unregistered_forwarding_wrapper_is_seen_through_by_attribute() -> None:
    """A segment that is no child is looked up as an attribute (as torch's get_state_dict does), so a
    wrapper nobody registered resolves both spellings; an attribute that is no module, or none at all,
    still names no module."""
    inner = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    root = nn.Sequential(_Forwarding(inner))
    resolver = FQNResolver(root)
    assert resolver.clean_key("0.inner.1.0.weight") == "0.inner.1.0.weight"  # the segment spelled out: a child
    assert resolver.clean_key("0.1.0.weight") == "0.1.0.weight"  # left out: found by attribute
    assert resolver.resolve("0.1.0") is not None and resolver.resolve("0.1.0").module is inner[1][0]
    assert resolver.resolve("0.note") is None
    assert resolver.resolve("0.absent") is None
    with pytest.raises(RuntimeError, match="no module at '0.absent'"):
        resolver.clean_key("0.absent.weight")


def _compiled_fsdp(dist: Any, use_orig_params: bool) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module]:
    """``torch.compile`` of a reference FSDP model with a nested checkpoint-wrapped unit, stepped once,
    and the unwrapped model it was built from (same seed)."""
    oracle = models.build("nested", device=dist.device)
    inner = models.build("nested", device=dist.device)
    setattr(inner, "1", checkpoint_wrapper(getattr(inner, "1")))
    sharded = FullyShardedDataParallel(
        inner, auto_wrap_policy=lambda m: m is getattr(inner, "1"), use_orig_params=use_orig_params, device_id=dist.device
    )
    model = torch.compile(sharded)
    assert isinstance(model, nn.Module)  # an OptimizedModule; torch.compile's stubs say a callable
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    models.loss(sharded(models.batch("nested", device=dist.device))).backward()  # eager: no compile cost
    optim.step()
    return model, optim, oracle


@pytest.mark.req("SD-1", "SD-2")
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_compiled_fsdp_keys_are_canonical(dist: Any, use_orig_params: bool) -> None:
    """Every key that the reference gives for ``torch.compile(FSDP(model))`` (model and optimizer, full
    and sharded, through get_state_dict and through the FSDP optimizer-state API and its maps) is a
    canonical FQN: the unwrapped model's names, in its order for the model state dict."""
    model, optim, oracle = _compiled_fsdp(dist, use_orig_params)
    keys = list(oracle.state_dict())
    params = [n for n, _ in oracle.named_parameters()]
    for full in (False, True):
        model_sd, optim_sd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=full))
        assert list(model_sd) == keys, (full, list(model_sd))
        assert sorted(optim_sd["state"]) == sorted(params), (full, sorted(optim_sd["state"]))
        assert sorted(p for g in optim_sd["param_groups"] for p in g["params"]) == sorted(params), optim_sd["param_groups"]
        fsdp_osd = optim_state_dict(model, optim, sharded=not full)
        assert sorted(fsdp_osd["state"]) == sorted(params), (full, sorted(fsdp_osd["state"]))
    assert sorted(get_fqn_to_fsdp_param_info(model)) == sorted(params)
    assert sorted(f for fqns in get_param_to_fqns(model).values() for f in fqns) == sorted(params)
