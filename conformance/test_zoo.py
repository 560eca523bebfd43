"""The model zoo is deterministic (HX-13): the suite's oracles compare models built on different ranks."""

from __future__ import annotations

import pytest
import torch

from conformance import models
from conformance.asserts import assert_same_state, fail
from conformance.models import fingerprint


@pytest.mark.req("HX-13")
@pytest.mark.parametrize("name", list(models.ZOO))
def test_zoo_models_are_equal_on_every_rank(dist, name: str) -> None:
    """Built on the rank's device (a GPU under nccl), as the suite's oracles are."""
    model = models.build(name, seed=3, device=dist.device)
    gathered = dist.all_gather_object(fingerprint(model))
    for rank, theirs in enumerate(gathered):
        if theirs != gathered[0]:
            fail(f"{name}: ranks built different models from one seed", f"rank {rank}'s state", "rank 0's state", f"rank {dist.rank}")
    assert_same_state(models.build(name, seed=3, device=dist.device).state_dict(), model.state_dict(), what=f"{name}: a second build")
    other = models.build(name, seed=4, device=dist.device)
    changed = [k for (k, mine), (_, theirs) in zip(fingerprint(model), fingerprint(other)) if mine != theirs]
    if not changed:
        fail(f"{name}: the seed does not change the model", "seed 4 equal to seed 3", "different values")
    out = model(models.batch(name, seed=0, batch_size=4, device=dist.device))
    assert torch.isfinite(models.loss(out))
