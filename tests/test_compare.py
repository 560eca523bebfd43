"""Unit tests of conformance.compare, in one process (the DTensor branches run in the suite's ranks)."""

from __future__ import annotations

import torch
from torch import nn

from conformance import models
from conformance.compare import fqn_keyed_optim, full_on_cpu, full_tensor, local_tensor


def _trained(name: str, model: nn.Module | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = model or models.build(name)
    optim = torch.optim.Adam(models.param_groups(model))
    models.train_step(model, optim, models.batch(name))
    return model, optim


def test_fqn_keyed_optim_names_tied_parameters_once() -> None:
    model, optim = _trained("tied")
    osd = fqn_keyed_optim(model, optim)
    raw = optim.state_dict()
    params = [fqn for group in osd["param_groups"] for fqn in group["params"]]
    assert "embed.weight" in params and "head.weight" not in params, params
    assert sorted(params) == sorted(n for n, _ in model.named_parameters())
    assert sorted(osd["state"]) == sorted(params)
    for got, want in zip(osd["param_groups"], raw["param_groups"]):
        assert {k: v for k, v in got.items() if k != "params"} == {k: v for k, v in want.items() if k != "params"}
    assert osd["state"]["embed.weight"]["exp_avg"] is raw["state"][params.index("embed.weight")]["exp_avg"]


def test_fqn_keyed_optim_hides_the_checkpoint_wrapper_segment() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = models.build("mlp")
    model.net = checkpoint_wrapper(model.get_submodule("net"))
    model, optim = _trained("mlp", model)
    osd = fqn_keyed_optim(model, optim)
    assert sorted(osd["state"]) == sorted(model.state_dict()), sorted(osd["state"])


def test_full_on_cpu_rebuilds_containers_with_detached_tensors() -> None:
    weight = nn.Parameter(torch.ones(2, 3))
    value = {"w": weight, "groups": [{"betas": (0.9, 0.99), "ids": (torch.tensor(1),)}], "name": "x"}
    got = full_on_cpu(value)
    assert isinstance(got["groups"], list) and isinstance(got["groups"][0]["ids"], tuple)
    assert got["groups"][0]["betas"] == (0.9, 0.99) and got["name"] == "x"
    assert type(got["w"]) is torch.Tensor and not got["w"].requires_grad and torch.equal(got["w"], weight.detach())
    assert got["w"].device.type == "cpu"


def test_plain_values_pass_through_full_and_local_tensor() -> None:
    t = torch.arange(3.0)
    assert full_tensor(t) is t and local_tensor(t) is t
    assert full_tensor(0.5) == 0.5 and local_tensor("step") == "step"
