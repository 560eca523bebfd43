"""Single-process unit tests of the sharding arithmetic and construction checks of ``reference.fsdp``."""

from __future__ import annotations

import pytest
import torch.nn as nn

from reference.fsdp import _as_policy, _check_no_param_shared_across_units
from reference.sharding import SlotShard, slot_shard


@pytest.mark.parametrize(
    ("slot", "shard", "expected"),
    [
        ((0, 6), (0, 2), SlotShard(0, 2, 0)),  # the shard starts inside the slot
        ((0, 6), (4, 2), SlotShard(4, 6, 0)),  # ... ends the slot
        ((6, 3), (4, 4), SlotShard(0, 2, 2)),  # the slot starts inside the shard
        ((0, 6), (6, 2), SlotShard(0, 0, 0)),  # no overlap: empty, at the shard's start
        ((6, 3), (0, 2), SlotShard(0, 0, 2)),  # no overlap, slot after the shard: empty at its end
        ((2, 0), (0, 4), SlotShard(0, 0, 2)),  # an empty parameter holds nothing anywhere
    ],
)
def test_shard_range(slot: tuple[int, int], shard: tuple[int, int], expected: SlotShard) -> None:
    got = slot_shard(slot[0], slot[1], shard[0], shard[1])
    assert got == expected
    assert 0 <= got.shard_offset <= shard[1] and got.shard_offset + got.numel <= shard[1]


def test_shard_ranges_cover_every_element_once() -> None:
    """Over all shards of a padded flat parameter, each slot's elements are held exactly once."""
    numels = [6, 3, 1]
    offsets = [0, 6, 9]
    for world in (1, 2, 3, 4, 7):
        chunk = -(-sum(numels) // world)
        for offset, numel in zip(offsets, numels):
            held = []
            for rank in range(world):
                r = slot_shard(offset, numel, rank * chunk, chunk)
                held.extend(range(r.start, r.end))
            assert held == list(range(numel)), (world, offset, held)


def test_policy_from_classes_and_callables() -> None:
    assert _as_policy({nn.Linear})(nn.Linear(1, 1)) and not _as_policy({nn.Linear})(nn.ReLU())
    assert _as_policy(lambda m: True)(nn.ReLU())
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        _as_policy({"Linear"})


def test_a_parameter_shared_by_two_units_is_refused_by_name() -> None:
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    with pytest.raises(ValueError, match=r"'1.weight' \(unit '1'\) is the same parameter as '0.weight' \(unit '<root>'\)"):
        _check_no_param_shared_across_units(model, lambda m: m is model[1])
    _check_no_param_shared_across_units(model, lambda m: False)  # both in the root unit: fine
