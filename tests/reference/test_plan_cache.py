"""Unit tests of the save plan cache (reference/checkpoint/plan_cache.py), in one process: plans as
plain values for the coordinator's global step, and whole saves without a process group.

Every test that reuses a plan checks the reused result against the same layouts planned with the cache
off: a cache is only right if what it serves is what would have been computed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.planner import SavePlan

from reference.checkpoint import CheckpointError, StateDictError, load, plan_cache, save
from reference.checkpoint.planner import ReferenceSavePlanner


@pytest.fixture(autouse=True)
def empty_cache() -> Iterator[None]:
    plan_cache.clear()
    yield
    plan_cache.clear()


def _local_plans(states: list[dict[str, Any]], *, cache: bool = True) -> list[SavePlan]:
    plans = []
    for sd in states:
        planner = ReferenceSavePlanner(cache_plans=cache)
        planner.set_up_planner(sd)
        plans.append(planner.create_local_plan())
    return plans


def _global(states: list[dict[str, Any]], *, cache: bool = True) -> tuple[list[SavePlan], Any]:
    return ReferenceSavePlanner(cache_plans=cache).create_global_plan(_local_plans(states, cache=cache))


def _comparable(result: tuple[list[SavePlan], Any]) -> tuple[Any, ...]:
    """What a global step decides: each rank's items (with their index hints) and the metadata."""
    plans, metadata = result
    return ([plan.items for plan in plans], metadata.state_dict_metadata, metadata.planner_data, metadata.version)


@pytest.fixture
def global_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the global steps computed (not taken from the cache)."""
    calls: list[int] = []
    original = ReferenceSavePlanner._plan_globally

    def counted(self: ReferenceSavePlanner, all_plans: list[SavePlan]) -> Any:
        calls.append(len(all_plans))
        return original(self, all_plans)

    monkeypatch.setattr(ReferenceSavePlanner, "_plan_globally", counted)
    return calls


def _ranks(step: int = 0, **extra: Any) -> list[dict[str, Any]]:
    """Two ranks' state dicts: replicated tensors, a rank-only tensor, non-tensor values, nesting;
    ``step`` changes every value but no layout."""
    states = []
    for rank in range(2):
        sd: dict[str, Any] = {
            "model": {"w": torch.full((64, 8), float(step)), "b": torch.arange(8.0) + step},
            "optim": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": [{"lr": 0.1 * (step + 1), "params": [0]}]},
            f"rank{rank}": torch.full((3,), float(rank + step)),
            "epoch": step,
        }
        sd.update(extra.get(f"rank{rank}", {}))
        states.append(sd)
    return states


def test_a_second_save_of_the_same_layouts_reuses_the_global_step(global_steps: list[int]) -> None:
    first = _global(_ranks(0))
    second = _global(_ranks(5))
    assert global_steps == [2], "the second save's global step was computed again"
    assert _comparable(second) == _comparable(first) == _comparable(_global(_ranks(5), cache=False))


_LAYOUT_CHANGES: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "key added on one rank": lambda: _ranks(1, rank1={"extra": torch.ones(2)}),
    "shape changed": lambda: _ranks(1, rank0={"rank0": torch.ones(4)}),
    "dtype changed": lambda: _ranks(1, rank1={"rank1": torch.ones(3, dtype=torch.float64)}),
    "non-tensor grew": lambda: [{**sd, "epoch": "x" * 100} for sd in _ranks(1)],
    "nesting changed": lambda: [{**sd, "model": {"w": sd["model"]["w"]}, "model.b": sd["model"]["b"]} for sd in _ranks(1)],
    "ranks swapped": lambda: _ranks(1)[::-1],
    "one rank fewer": lambda: _ranks(1)[:1],
}


@pytest.mark.parametrize("change", list(_LAYOUT_CHANGES))
def test_any_change_of_any_rank_s_layout_plans_anew(global_steps: list[int], change: str) -> None:
    _global(_ranks(0))
    states = _LAYOUT_CHANGES[change]()
    changed = _global(states)
    assert len(global_steps) == 2, f"{change}: the global step of another layout was reused"
    assert _comparable(changed) == _comparable(_global(states, cache=False))


def test_the_non_tensor_values_are_checked_on_every_save(global_steps: list[int]) -> None:
    """ML-9 on a reused plan: values of the same byte count that differ across ranks are an error."""
    _global(_ranks(0))
    states = _ranks(0)
    states[1]["epoch"] = 1  # pickles to as many bytes as 0: the layout is the same
    with pytest.raises(StateDictError, match="'epoch'.*differs across ranks"):
        _global(states)
    assert global_steps == [2]


def test_a_failed_global_step_keeps_nothing(global_steps: list[int]) -> None:
    """pytorch/pytorch PR #176289: a global step that failed must leave no entry behind."""
    bad = _ranks(0, rank1={"rank0": torch.ones(4)})  # rank 1 holds rank 0's key with another shape
    with pytest.raises(StateDictError, match="'rank0'"):
        _global(bad)
    assert len(plan_cache.GLOBAL_PLANS) == 0
    with pytest.raises(StateDictError, match="'rank0'"):
        _global(bad)
    assert global_steps == [2, 2], "the failed global step was not computed again"


def test_what_a_save_does_to_its_plans_and_metadata_does_not_reach_a_later_save() -> None:
    expected = _comparable(_global(_ranks(0), cache=False))
    plans, metadata = _global(_ranks(0))
    for plan in plans:
        plan.items.clear()
    for md in metadata.state_dict_metadata.values():
        getattr(md, "chunks", []).clear()
    metadata.state_dict_metadata.clear()
    metadata.planner_data.clear()
    assert _comparable(_global(_ranks(0))) == expected


def test_a_rank_holding_its_items_is_sent_their_digest_and_takes_them_from_its_store() -> None:
    ranks = _ranks(0)
    planners = [ReferenceSavePlanner() for _ in ranks]

    def step() -> list[SavePlan]:
        plans = []
        for planner, sd in zip(planners, ranks):
            planner.set_up_planner(sd)
            plans.append(planner.create_local_plan())
        return plans

    first, _ = ReferenceSavePlanner().create_global_plan(step())
    assert not any(plan.planner_data.held for plan in first)
    expected = [planner.finish_plan(plan).items for planner, plan in zip(planners, first)]
    second, _ = ReferenceSavePlanner().create_global_plan(step())
    assert all(plan.planner_data.held for plan in second)
    finished = [planner.finish_plan(plan.__class__(items=[], storage_data=plan.storage_data, planner_data=plan.planner_data))
                for planner, plan in zip(planners, second)]
    assert [plan.items for plan in finished] == expected


def test_a_rank_told_it_holds_items_it_does_not_hold_raises() -> None:
    planner = ReferenceSavePlanner()
    planner.set_up_planner(_ranks(0)[0])
    planner.create_local_plan()  # this rank holds nothing yet
    told = SavePlan([], planner_data=plan_cache.GlobalItems("f" * 64, held=True))
    with pytest.raises(CheckpointError, match="holds none"):
        planner.finish_plan(told)


def test_the_stores_keep_the_most_recently_used_entries() -> None:
    lru: plan_cache.LRU[int, str] = plan_cache.LRU(2)
    lru.put(1, "a")
    lru.put(2, "b")
    assert lru.get(1) == "a"  # 1 is now the most recent
    lru.put(3, "c")
    assert (lru.get(1), lru.get(2), lru.get(3)) == ("a", None, "c")


def test_alternating_layouts_each_keep_their_plan(global_steps: list[int]) -> None:
    """A job saving a model checkpoint and an optimizer checkpoint in turn (NVIDIA-NeMo/Automodel PR
    #3369's pattern) plans each layout once, and each save gets its own layout's plan."""
    model = [{"w": torch.ones(8, 8)} for _ in range(2)]
    optim = [{"state": {0: {"exp_avg": torch.ones(8, 8)}}, "param_groups": [{"lr": 0.1}]} for _ in range(2)]
    expected = {"model": _comparable(_global(model, cache=False)), "optim": _comparable(_global(optim, cache=False))}
    global_steps.clear()
    for _ in range(3):
        assert _comparable(_global(model)) == expected["model"]
        assert _comparable(_global(optim)) == expected["optim"]
    assert global_steps == [2, 2]


def _values(step: int) -> dict[str, Any]:
    return {"w": torch.arange(12.0).reshape(3, 4) * step, "nested": {"b": torch.full((2,), float(step))}, "step": step}


def test_successive_saves_to_other_and_the_same_directories_each_hold_their_own_values(tmp_path: Path, global_steps: list[int]) -> None:
    """Saves in one process (no process group) reuse the plan and still name each save's own files."""
    directories = [tmp_path / "a", tmp_path / "b", tmp_path / "a"]
    for step, directory in enumerate(directories, start=1):
        save(_values(step), checkpoint_id=directory)
        target = _values(-1)
        load(target, checkpoint_id=directory, allow_unexpected=False)
        assert torch.equal(target["w"], _values(step)["w"]) and torch.equal(target["nested"]["b"], _values(step)["nested"]["b"])
        assert target["step"] == step
    assert global_steps == [1]


@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(60)
def test_a_later_save_of_a_layout_scatters_each_rank_s_plan_without_its_items(dist: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first save of a layout scatters every rank's items; the next saves of it send each rank
    only the digest of the items it holds, and every rank writes the same items as the first time (and
    the checkpoint loads back that save's values on every rank)."""
    from torch.distributed.tensor import DTensor, Shard

    from reference.checkpoint import api

    sent: list[list[int]] = []
    real = api._without_held_items

    def recorded(plan: SavePlan) -> SavePlan:
        out = real(plan)
        sent[-1].append(len(out.items))
        return out

    monkeypatch.setattr(api, "_without_held_items", recorded)
    plan_cache.clear()  # on every rank: an earlier test in these rank processes may have saved this layout
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.world_size,))

    def state(step: float) -> dict[str, Any]:
        full = torch.arange(8.0 * dist.world_size).reshape(-1, 2) + step
        local = full.chunk(dist.world_size)[dist.rank].clone()
        return {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False), "b": torch.full((3,), step), "step": int(step)}

    written: list[list[Any]] = []
    for step in (1.0, 2.0, 3.0):
        sent.append([])
        planner = ReferenceSavePlanner()
        save(state(step), checkpoint_id=dist.tmp_dir / f"ckpt{int(step)}", process_group=dist.group, planner=planner)
        assert planner.plan is not None
        written.append(planner.plan.items)
        target = state(-step)
        load(target, checkpoint_id=dist.tmp_dir / f"ckpt{int(step)}", process_group=dist.group)
        expected = state(step)
        assert torch.equal(target["w"].to_local(), expected["w"].to_local()) and torch.equal(target["b"], expected["b"]), f"rank {dist.rank}"
        assert target["step"] == int(step)
    assert written[1] == written[2] == written[0], f"rank {dist.rank}: later saves wrote other items"
    if dist.rank == 0:
        assert all(n > 0 for n in sent[0]), f"the first save sent items counts {sent[0]}"
        assert sent[1] == sent[2] == [0] * dist.world_size, f"later saves sent item counts {sent[1]}, {sent[2]}"
