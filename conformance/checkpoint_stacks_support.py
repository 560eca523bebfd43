"""Helpers of ``test_checkpoint_stacks.py`` (ML-31 to ML-33): state dicts whose lists mix tensors and
other values, and how long a process may outlive the call that started it."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Shard

from conformance.checkpoint_support import dtensor_of
from conformance.rank_context import RankContext

__all__ = ["GRACE_S", "mixed_lists"]


def mixed_lists(dist: RankContext, fill: float) -> tuple[dict[str, Any], dict[tuple[Any, ...], torch.Tensor]]:
    """A state dict whose lists and tuples mix tensors, a DTensor and other values, as trainers leave
    them (an LR scheduler's per-group lists, a sampler's ``(generator state, epoch)``, a metric's
    history), every value derived from ``fill``; and the full value of the DTensor by its path."""
    full = torch.arange(4.0 * dist.world_size * 2).reshape(-1, 2) + fill
    state = {
        "scheduler": {"last_lr": [fill, fill / 2], "base_lrs": [torch.tensor(fill), int(fill), "cosine", None]},
        "history": [torch.arange(3, dtype=torch.int64) + int(fill), f"step {fill}", [torch.full((2,), fill), fill], {"best": torch.tensor([fill])}],
        "sampler": (torch.arange(4, dtype=torch.uint8) + int(fill) % 7, int(fill)),
        "sharded": [dtensor_of(full, dist.mesh(), [Shard(0)]), "w", fill],
    }
    return state, {("sharded", 0): full}


#: How long a process a save or load started may take to end after the call returned.
GRACE_S = 5.0
