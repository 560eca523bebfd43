"""The reference at simulated world sizes (ML-34 to ML-37): growth measured by counting, never by time.

Every simulated rank's state dict comes from :mod:`bench.scale.layouts` (DTensors as rank ``r`` sees
its mesh) and the reference's own planners run on it. Growth is the ratio of the operations a step
makes (Python lines executed and C functions called, counted with ``sys.settrace``/``sys.setprofile``)
at two world sizes: deterministic, and independent of the machine's load. A step that is linear in what it handles grows as that does; one
that compares every rank's chunk with every other rank's grows with its square, which a ratio between
world sizes 4x apart shows as 16x."""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.scale.layouts import LAYOUTS, RankStateDicts
from bench.scale.simulate import simulate
from reference.checkpoint import load, plan_cache, save
from reference.checkpoint.planner import ReferenceLoadPlanner, ReferenceSavePlanner

#: World sizes compared (4x apart) and the model's tensors: seconds, not minutes, on one CPU core.
SMALL, LARGE, TENSORS = 64, 256, 40
#: What a step's calls may grow by from SMALL to LARGE ranks: what N log N allows (4 x log(256)/log(64)
#: = 5.3), and a little for the dicts and sorts whose cost is not exactly proportional.
MAX_GROWTH = 4 * math.log(LARGE) / math.log(SMALL) * 1.15


@pytest.fixture(autouse=True)
def empty_cache() -> Iterator[None]:
    plan_cache.clear()
    yield
    plan_cache.clear()


def _calls(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the operations it made: Python lines executed (loop iterations included) and calls
    of C functions (counted with ``sys.settrace`` and ``sys.setprofile``)."""
    count = 0

    def line(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        count += event == "line"
        return line

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        count += event == "c_call"

    sys.settrace(line)
    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
        sys.settrace(None)
    return result, count


def _local_plans(states: RankStateDicts) -> list[Any]:
    plans = []
    for rank in range(states.world_size):
        planner = ReferenceSavePlanner()
        planner.set_up_planner(states.state_dict(rank), is_coordinator=rank == 0)
        plans.append(planner.create_local_plan())
    return plans


def _global_step(layout: str, world_size: int) -> tuple[Any, int, int]:
    """(metadata, calls of the coordinator's global plan, local items it was given)."""
    plans = _local_plans(RankStateDicts(LAYOUTS[layout], world_size, TENSORS))
    plan_cache.clear()
    (_, metadata), calls = _calls(lambda: ReferenceSavePlanner().create_global_plan(plans))
    return metadata, calls, sum(len(p.items) for p in plans)


@pytest.fixture(scope="module")
def global_step() -> Callable[[str, int], tuple[Any, int, int]]:
    """:func:`_global_step` with its results kept for this module's tests: three plan the same first
    saves (deterministic, and nothing mutates the metadata). A module fixture, so that a run in parts
    keeps those tests in one part and plans each save once."""
    return functools.cache(_global_step)


def _load_calls(layout: str, world_size: int, metadata: Any, rank: int) -> tuple[int, int]:
    """(calls of rank ``rank``'s load planning at ``world_size`` from ``metadata``, its read items)."""
    state_dict = RankStateDicts(LAYOUTS[layout], world_size, TENSORS).state_dict(rank)
    planner = ReferenceLoadPlanner()

    def plan() -> Any:
        planner.set_up_planner(state_dict, metadata, rank == 0)
        return planner.create_local_plan()

    plan_, calls = _calls(plan)
    return calls, len(plan_.items)


@pytest.mark.req("ML-34")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_global_plan_grows_no_faster_than_ranks_times_items(layout: str, global_step: Callable[[str, int], tuple[Any, int, int]]) -> None:
    """The coordinator's global plan of a first save, at 64 and 256 ranks of the same model: its calls
    grow at most as N log N does (the items it is given grow 4x). Catches a tiling check or dedup that
    compares every rank's chunk with every other's (the sweep along dim 0 on column shards, issue 47)."""
    _, small, small_items = global_step(layout, SMALL)
    _, large, large_items = global_step(layout, LARGE)
    items_growth = large_items / small_items
    assert large / small <= MAX_GROWTH * items_growth / 4, (
        f"layout {layout}: the global plan made {small:,} calls at {SMALL} ranks ({small_items:,} items) and "
        f"{large:,} at {LARGE} ({large_items:,} items): {large / small:.1f}x, expected at most "
        f"{MAX_GROWTH * items_growth / 4:.1f}x (N log N)"
    )


@pytest.mark.req("ML-34", "ML-37")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_rank_s_load_planning_grows_with_its_own_items_only(layout: str, global_step: Callable[[str, int], tuple[Any, int, int]]) -> None:
    """One rank's load planning from the metadata of a save at the same world size, at 64 and 256 ranks:
    its own items do not grow with the world (a FSDP rank holds one piece of each tensor), so its calls
    must not either (at most 1.5x, the binary searches' log). Catches a search of every rank's chunks for
    this rank's (a linear ``_same_chunk``; ``overlaps`` over all saved chunks). Rank 0 and the last rank
    (whose pieces may be empty) are both planned."""
    for rank_of in (lambda n: 0, lambda n: n - 1):
        metadata_small, _, _ = global_step(layout, SMALL)
        small, small_reads = _load_calls(layout, SMALL, metadata_small, rank_of(SMALL))
        metadata_large, _, _ = global_step(layout, LARGE)
        large, large_reads = _load_calls(layout, LARGE, metadata_large, rank_of(LARGE))
        allowed = 1.5 * max(large_reads, 1) / max(small_reads, 1)
        assert large / small <= max(allowed, 1.5), (
            f"layout {layout}, rank {rank_of(LARGE)}: load planning made {small:,} calls at {SMALL} ranks "
            f"({small_reads} reads) and {large:,} at {LARGE} ({large_reads} reads): {large / small:.1f}x"
        )


@pytest.mark.req("ML-34", "ML-37")
@pytest.mark.parametrize("layout", ["fsdp", "tp", "fsdp-tp", "hsdp"])
def test_a_resharding_load_plans_in_proportion_to_what_it_reads(layout: str, global_step: Callable[[str, int], tuple[Any, int, int]]) -> None:
    """A rank of half the world loading a save of the whole: its calls per read item stay within 1.5x
    from 64 to 256 saving ranks. Catches a reshard that intersects the wanted piece with every saved
    chunk of the tensor."""
    per_read = []
    for world_size in (SMALL, LARGE):
        metadata, _, _ = global_step(layout, world_size)
        calls, reads = _load_calls(layout, world_size // 2, metadata, 0)
        per_read.append(calls / max(reads, 1))
    assert per_read[1] / per_read[0] <= 1.5, (
        f"layout {layout}: resharded load planning made {per_read[0]:.0f} calls per read from {SMALL} saving ranks and "
        f"{per_read[1]:.0f} from {LARGE}"
    )


@pytest.mark.req("ML-35")
@pytest.mark.parametrize("layout", ["fsdp", "3d", "replicated"])
def test_a_later_save_of_a_layout_sends_each_rank_s_plan_as_a_constant_size_key(layout: str) -> None:
    """The second save of an unchanged layout, simulated: each rank's local plan is the same size
    whatever the model's tensors (40 or 120) and world size (64 or 128), and what the coordinator
    receives and scatters is that times the ranks. Catches a rank that sends its items (or paths) again."""
    figures = {(n, t): simulate(LAYOUTS[layout], n, t, "reference", load_ranks=1, reshard=False)
               for n, t in ((SMALL, TENSORS), (SMALL, 3 * TENSORS), (2 * SMALL, TENSORS))}
    per_rank = {key: fig["second_plan_bytes_max"] for key, fig in figures.items()}
    assert len(set(per_rank.values())) == 1, f"layout {layout}: a rank's second plan took {per_rank} bytes (ranks, tensors)"
    for (n, _), fig in figures.items():
        assert fig["second_plan_bytes_total"] == n * per_rank[(n, TENSORS if n != SMALL else TENSORS)], fig
        assert fig["second_scatter_bytes_total"] / n == figures[(SMALL, TENSORS)]["second_scatter_bytes_total"] / SMALL
    assert max(per_rank.values()) < 2048, f"a key-only plan took {max(per_rank.values())} bytes"


@pytest.mark.req("ML-35")
def test_a_coordinator_without_the_layout_asks_every_rank_for_its_whole_plan(tmp_path: Path) -> None:
    """A rank holds the global items of its layout, sends its plan as the key, and the coordinator no
    longer holds that layout (dropped, or another process): the save still plans, from whole plans sent
    in a second round, and loads back its own values."""

    def state(step: float) -> dict[str, Any]:
        return {"w": torch.full((8, 4), step), "b": torch.arange(3.0) + step, "step": int(step)}

    save(state(1.0), checkpoint_id=tmp_path / "a")
    save(state(2.0), checkpoint_id=tmp_path / "b")  # this rank now holds its items for the layout
    sent: list[Any] = []
    real = ReferenceSavePlanner.create_local_plan

    def recorded(self: ReferenceSavePlanner) -> Any:
        plan = real(self)
        sent.append(plan)
        return plan

    plan_cache.GLOBAL_PLANS.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ReferenceSavePlanner, "create_local_plan", recorded)
        save(state(3.0), checkpoint_id=tmp_path / "c")
    assert sent and not sent[-1].items and sent[-1].planner_data.whole is False, "the rank sent its items again"
    target = state(0.0)
    load(target, checkpoint_id=tmp_path / "c")
    assert torch.equal(target["w"], state(3.0)["w"]) and torch.equal(target["b"], state(3.0)["b"]) and target["step"] == 3


@pytest.mark.req("ML-36")
@pytest.mark.parametrize(("layout", "world_size"), [("replicated", SMALL), ("hsdp", 2 * SMALL), ("moe", SMALL)])
def test_replicated_data_is_written_by_its_holders_in_turn(layout: str, world_size: int) -> None:
    """The bytes each rank writes, with replicated data (a DDP model whose embedding alone is 1.8x the
    mean per rank; HSDP's replicas; MoE's dense weights replicated over the expert axis), are within 10%
    of the mean, and every rank writes some of the replicated data. Catches the lowest rank writing
    every replicated item, and whole-tensor assignment (one rank left writing the embedding)."""
    fig = simulate(LAYOUTS[layout], world_size, 200, "reference", load_ranks=1, reshard=False)
    assert fig["write_balance"] <= 1.1, f"layout {layout} at {world_size} ranks: max/mean bytes written {fig['write_balance']:.2f}"
    assert fig["replicated_writers"] == world_size, f"{fig['replicated_writers']} of {world_size} ranks write replicated data"


@pytest.mark.req("ML-37")
def test_a_load_reads_the_metadata_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank's load opens the checkpoint's ``.metadata`` once (a load that re-reads it per key, or per
    step, costs its bytes again: megabytes at thousands of ranks)."""
    save({"w": torch.ones(4, 4), "n": 3}, checkpoint_id=tmp_path)
    opened: list[str] = []
    real_read = Path.read_bytes

    def read_bytes(self: Path) -> bytes:
        opened.append(self.name)
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    real_open = open

    def counted_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(Path(str(file)).name)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counted_open)
    load({"w": torch.zeros(4, 4), "n": 0}, checkpoint_id=tmp_path)
    assert opened.count(".metadata") == 1, f"the load opened .metadata {opened.count('.metadata')} times"



@pytest.mark.req("ML-36")
@pytest.mark.world_size(min=2)
@pytest.mark.rank_timeout(120)
@pytest.mark.parametrize("path_kind", ["fast", "plain"])
def test_a_large_replicated_tensor_is_written_in_pieces_by_its_holders_and_loads_back(dist: Any, path_kind: str) -> None:
    """A 24 MiB plain tensor every rank holds: each rank writes a piece of it (its records are in every
    rank's data files), and the checkpoint loads back bit for bit with the reference and with torch's
    DCP; on the plain path and the fast paths alike."""
    import re
    from contextlib import nullcontext

    import torch.distributed.checkpoint as dcp

    from reference.checkpoint import fast_paths

    big = torch.arange(float(6 << 20)).reshape(6 << 10, 1 << 10)
    directory = dist.tmp_dir / f"ckpt-{path_kind}"
    with fast_paths.disabled() if path_kind == "plain" else nullcontext():
        save({"big": big.clone(), "small": torch.ones(3)}, checkpoint_id=directory, process_group=dist.group)
        metadata = dcp.FileSystemReader(str(directory)).read_metadata()
        names = [info.relative_path for index, info in metadata.storage_data.items() if index.fqn == "big"]
        writers = {match.group(1) for name in names if (match := re.match(r"__(\d+)_", name)) is not None}
        assert len(writers) == dist.world_size, f"the pieces of 'big' were written by ranks {sorted(writers)}"
        target = {"big": torch.zeros_like(big), "small": torch.zeros(3)}
        load(target, checkpoint_id=directory, process_group=dist.group)
        assert torch.equal(target["big"], big) and torch.equal(target["small"], torch.ones(3))
    upstream = {"big": torch.zeros_like(big), "small": torch.zeros(3)}
    dcp.load(upstream, checkpoint_id=str(directory), process_group=dist.group)
    assert torch.equal(upstream["big"], big), "torch's DCP read the pieces back wrong"
