"""Single-process unit tests of the sharding arithmetic and construction checks of ``reference.fsdp``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from reference.flat_param import FlatParameter, ParamRange, even_shard_range
from reference.fsdp.sharding import SlotShard, slot_shard
from reference.fsdp.unit import _as_policy, _check_no_param_shared_across_units


def _part(flat: FlatParameter, name: str) -> ParamRange | None:
    held = flat.shard_metadata()
    return dict(zip(held.param_names, held.param_offsets)).get(name)


@pytest.mark.parametrize(
    ("numels", "shard", "slot", "expected"),
    [
        ((6,), (0, 1), 0, SlotShard(ParamRange(0, 1), 0)),  # the shard starts inside the slot
        ((6,), (4, 5), 0, SlotShard(ParamRange(4, 5), 0)),  # ... ends the slot
        ((6, 3), (4, 7), 1, SlotShard(ParamRange(0, 1), 2)),  # the slot starts inside the shard
        ((6, 3), (0, 1), 1, SlotShard(ParamRange(0, -1), 2)),  # no overlap, slot after the shard: empty at its end
        ((6, 3), (6, 7), 0, SlotShard(ParamRange(0, -1), 0)),  # no overlap, slot before the shard: empty at its start
        ((2, 0, 2), (0, 3), 1, SlotShard(ParamRange(0, -1), 2)),  # an empty parameter holds nothing anywhere
    ],
)
def test_slot_shard(numels: tuple[int, ...], shard: tuple[int, int], slot: int, expected: SlotShard) -> None:
    """A slot's part of a shard, from the FlatParameter's own layout and shard metadata."""
    flat = FlatParameter([torch.zeros(n) for n in numels], names=[f"p{i}" for i in range(len(numels))])
    total = sum(numels)
    flat.shard_by_offsets(shard[0], shard[1], max(0, shard[1] + 1 - max(shard[0], total)))
    got = slot_shard(flat.param_offsets[slot], _part(flat, f"p{slot}"), flat.shard_range)
    assert got == expected
    size = shard[1] - shard[0] + 1
    assert 0 <= got.shard_offset <= size and got.shard_offset + got.numel <= size


def test_slot_shards_cover_every_element_once() -> None:
    """Over all shards of a padded flat parameter, each slot's elements are held exactly once."""
    numels = [6, 3, 1]
    for world in (1, 2, 3, 4, 7):
        held: dict[int, list[int]] = {i: [] for i in range(len(numels))}
        for rank in range(world):
            flat = FlatParameter([torch.zeros(n) for n in numels], names=["a", "b", "c"])
            flat.shard_by_offsets(*even_shard_range(sum(numels), rank, world))
            for i, name in enumerate("abc"):
                r = slot_shard(flat.param_offsets[i], _part(flat, name), flat.shard_range)
                held[i].extend(range(r.part.start, r.part.end + 1))
        assert held == {i: list(range(n)) for i, n in enumerate(numels)}, (world, held)


def test_policy_from_classes_and_callables() -> None:
    by_class, by_callable = _as_policy({nn.Linear}), _as_policy(lambda m: True)
    assert by_class is not None and by_callable is not None
    assert by_class(nn.Linear(1, 1)) and not by_class(nn.ReLU())
    assert by_callable(nn.ReLU())
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        _as_policy({"Linear"})  # type: ignore[arg-type]  # the wrong type on purpose: the error is the test


def test_a_parameter_shared_by_two_units_is_refused_by_name() -> None:
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    with pytest.raises(ValueError, match=r"'1.weight' \(unit '1'\) is the same parameter as '0.weight' \(unit '<root>'\)"):
        _check_no_param_shared_across_units(model, lambda m: m is model[1])
    _check_no_param_shared_across_units(model, lambda m: False)  # both in the root unit: fine
