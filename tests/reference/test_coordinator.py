"""One coordinator: "rank 0" of ``rank0_only``, ``cpu_offload`` with ``full_state_dict``, and
``broadcast_from_rank0`` is the first rank of the model's process group, whatever its global rank.

Four ranks split into two groups, ``[0, 1]`` and ``[2, 3]``, each sharding its own copy of the model:
the group ``[2, 3]`` does not contain global rank 0, so a reference that meant the global rank 0 would
give rank 2 nothing (and rank 0 two groups' worth), or broadcast from a rank outside the group."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as c10d

from conformance import models
from conformance.asserts import assert_same_state, fail
from reference.fsdp import FullyShardedDataParallel, full_state_dict, optim_state_dict
from reference.state_dict import StateDictOptions, get_optimizer_state_dict, get_state_dict, set_state_dict

#: The two groups of the test, by their global ranks.
GROUPS = ([0, 1], [2, 3])


@contextlib.contextmanager
def my_group(dist: Any) -> Iterator[c10d.ProcessGroup]:
    """This rank's group of :data:`GROUPS` (every rank creates both, in the same order; a rank body
    calls this: fixtures run on the controller)."""
    groups = [c10d.new_group(ranks) for ranks in GROUPS]
    try:
        yield groups[dist.rank // 2]
    finally:
        for group in groups:
            c10d.destroy_process_group(group)


def _sharded(dist: Any, group: c10d.ProcessGroup, seed: int) -> tuple[FullyShardedDataParallel, torch.optim.Optimizer]:
    inner = models.build("nested", seed=seed, device=dist.device)
    model = FullyShardedDataParallel(
        inner, process_group=group, auto_wrap_policy=lambda m: m is getattr(inner, "1"), device_id=dist.device
    )
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _by_fqn(osd: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with state, each entry and each group's params in name order (the sharded model's
    optimizer lists its parameters unit by unit, the unwrapped model's in module order)."""
    if not osd:
        return osd
    groups = [{**g, "params": sorted(g["params"])} for g in osd["param_groups"]]
    state = {fqn: dict(sorted(entry.items())) for fqn, entry in sorted(osd["state"].items())}
    return {"state": state, "param_groups": groups}


def _oracle(dist: Any, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The unwrapped model's state dict and its Adam's (state initialised, as a get does)."""
    model = models.build("nested", seed=seed, device=dist.device)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    return model.state_dict(), _by_fqn(get_optimizer_state_dict(model, optim))


@pytest.mark.req("SD-12", "OS-4")
@pytest.mark.world_size(4)
@pytest.mark.rank_timeout(60)
def test_rank0_only_results_land_on_the_first_rank_of_the_group(dist: Any) -> None:
    """``full_state_dict`` + ``cpu_offload`` (get_state_dict), ``full_state_dict(rank0_only=True)`` and
    ``optim_state_dict(rank0_only=True)``: the first rank of each group (global ranks 0 and 2) gets the
    unwrapped model's state, the others ``{}``."""
    with my_group(dist) as group:
        _check_rank0_only(dist, group)


def _check_rank0_only(dist: Any, my_group: c10d.ProcessGroup) -> None:
    model, optim = _sharded(dist, my_group, seed=0)
    expected_model, expected_optim = _oracle(dist, seed=0)
    first = dist.rank % 2 == 0
    where = f"rank {dist.rank} (group {GROUPS[dist.rank // 2]})"
    got_model, got_optim = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    results = {
        "get_state_dict model": (got_model, expected_model),
        "get_state_dict optimizer": (_by_fqn(got_optim), expected_optim),
        "full_state_dict(rank0_only=True)": (full_state_dict(model, rank0_only=True), expected_model),
        "optim_state_dict(rank0_only=True)": (_by_fqn(optim_state_dict(model, optim, rank0_only=True)), expected_optim),
    }
    for what, (got, expected) in results.items():
        if first:
            assert_same_state(got, expected, what=what, where=where)
        elif got != {}:
            fail(f"{what} on a rank that is not its group's first", sorted(got), "{}", where)


@pytest.mark.req("SD-14")
@pytest.mark.world_size(4)
@pytest.mark.rank_timeout(60)
def test_broadcast_from_rank0_sends_from_the_first_rank_of_the_group(dist: Any) -> None:
    """``broadcast_from_rank0`` where only each group's first rank holds the state (the two groups hold
    different states): every rank ends with its own group's first rank's state."""
    with my_group(dist) as group:
        _check_broadcast(dist, group)


def _check_broadcast(dist: Any, my_group: c10d.ProcessGroup) -> None:
    seed = 10 + dist.rank // 2  # one state per group
    expected_model, expected_optim = _oracle(dist, seed=seed)
    target, target_optim = _sharded(dist, my_group, seed=99)
    first = dist.rank % 2 == 0
    set_state_dict(
        target,
        target_optim,
        model_state_dict=dict(expected_model) if first else {},
        optim_state_dict=dict(expected_optim) if first else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    got_model, got_optim = get_state_dict(target, target_optim, options=StateDictOptions(full_state_dict=True))
    where = f"rank {dist.rank} (group {GROUPS[dist.rank // 2]})"
    assert_same_state(got_model, expected_model, what="model after the broadcast", where=where)
    assert_same_state(_by_fqn(got_optim), expected_optim, what="optimizer after the broadcast", where=where)
