"""The model zoo is deterministic (HX-13): the suite's oracles compare models built on different ranks."""

from __future__ import annotations

import pytest
import torch

from conformance import models


def _checksum(model: torch.nn.Module) -> list[tuple[str, float]]:
    return [(k, float(v.double().sum())) for k, v in model.state_dict().items()]


@pytest.mark.req("HX-13")
@pytest.mark.parametrize("name", list(models.ZOO))
def test_zoo_models_are_equal_on_every_rank(dist, name: str) -> None:
    model = models.build(name, seed=3)
    gathered = dist.all_gather_object(_checksum(model))
    assert all(g == gathered[0] for g in gathered), f"{name}: ranks built different models: {gathered}"
    other = models.build(name, seed=4)
    assert _checksum(other) != _checksum(model), f"{name}: the seed does not change the model"
    out = model(models.batch(name, seed=0, batch_size=4))
    assert torch.isfinite(models.loss(out))
