"""Self-tests of the checkpoint benchmark tools: ``bench.checkpoint_io`` (throughput against raw) and
``bench.checkpoint_phases`` (where a load's and a save's time goes), each run once on a small state dict."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from bench import checkpoint_io, checkpoint_phases, config
from bench.ranks import RankGroup
from bench.workloads import checkpoint as ck


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[RankGroup]:
    """One group of two ranks for this module's tests: each starts two fresh interpreters otherwise.
    Every test prepares its own state first (``ck.prepare``), so none sees another's."""
    with RankGroup(2) as group:
        yield group


def _rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]


@pytest.mark.parametrize("text, nbytes", [("64MB", 64 << 20), ("2GB", 2 << 30), ("1.5MB", 3 << 19), ("4096", 4096)])
def test_parse_size_is_the_inverse_of_size_label(text: str, nbytes: int) -> None:
    assert config.parse_size(text) == nbytes
    if text.endswith("B") and "." not in text:
        assert config.size_label(nbytes) == text


def test_checkpoint_io_prints_a_row_per_operation_with_ratios_to_both_limits(capsys: pytest.CaptureFixture[str]) -> None:
    assert checkpoint_io.main(["--sizes", "4MB", "--world-sizes", "1", "--layouts", "full", "--rounds", "1",
                               "--impls", "reference,raw"]) == 0
    header, *rows = _rows(capsys.readouterr().out)
    assert header == ["workload", "reference MB/s", "raw MB/s", "raw-agreed MB/s", "reference/raw", "reference/raw-agreed"]
    assert [row[0] for row in rows] == ["save 4MB ws1 full", "load 4MB ws1 full"]
    for row in rows:
        assert all(float(cell.replace(",", "")) > 0 for cell in row[1:]), row


_COUNTED = ("gather", "scatter", "broadcast", "all_reduce")


def _agreed_raw_collectives(directory: str) -> dict[str, dict[str, int]]:
    """On a rank: the collectives (by c10d call) of one ``raw-agreed`` save into ``directory`` and one
    load of it (which checks every value loaded)."""
    counts: dict[str, dict[str, int]] = {}
    originals = {name: getattr(dist, name) for name in _COUNTED}

    def counting(op: str, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[op][name] = counts[op].get(name, 0) + 1
            return originals[name](*args, **kwargs)
        return call

    try:
        for op, run in (("save", ck.save_once), ("load", ck.load_once)):
            counts[op] = {}
            for name in _COUNTED:
                setattr(dist, name, counting(op, name))
            run(ck.AGREED_RAW, directory)
            for name, original in originals.items():
                setattr(dist, name, original)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return counts


@pytest.mark.parametrize("layout", ck.LAYOUTS)
def test_raw_agreed_is_raw_between_the_collectives_of_a_dcp_save_and_of_specs_load_agreements(
    two_ranks: RankGroup, tmp_path: Any, layout: str,
) -> None:
    """Four one-integer collectives around a save (plans gathered and scattered before the writes,
    results gathered and the metadata broadcast after), three all-reduces in a load, on every rank; the
    bytes are raw's, loaded back whole."""
    two_ranks.run(ck.prepare, 4 << 20, layout)
    counts = two_ranks.run(_agreed_raw_collectives, str(tmp_path / "ckpt"))
    assert counts == [{"save": {"gather": 2, "scatter": 1, "broadcast": 1}, "load": {"all_reduce": 3}}] * 2
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["raw_rank0.bin", "raw_rank1.bin"]


class _ScriptedRanks:
    """Stands for a RankGroup of one rank: each save or load takes the next of ``seconds``."""

    def __init__(self, seconds: list[float]) -> None:
        self.seconds = iter(seconds)
        self.calls: list[str] = []

    def run(self, fn: Any, *args: Any) -> list[Any]:
        self.calls.append(fn.__name__)
        return [0] if fn.__name__ == "prepare" else [next(self.seconds)]


def test_checkpoint_io_drops_the_warm_up_rounds() -> None:
    """The first round (each implementation's first call: imports, threads) runs but is not kept."""
    ranks = _ScriptedRanks([100.0, 101.0, 1.0, 2.0, 3.0, 4.0])  # save, load per call, in call order
    _, series = checkpoint_io.measure_interleaved(ranks, ["reference"], 1 << 20, "full", "/unused", 2)  # type: ignore[arg-type]
    assert ranks.calls == ["prepare", "save_once", "load_once", "save_once", "load_once", "save_once", "load_once"]
    assert (series["reference"].save, series["reference"].load) == ([1.0, 3.0], [2.0, 4.0])


def _tables(text: str) -> dict[str, tuple[list[str], list[dict[str, str]]]]:
    """``bench.checkpoint_phases``' tables by operation: (header, rows as {column: cell})."""
    tables: dict[str, tuple[list[str], list[dict[str, str]]]] = {}
    for header, *rows in (_rows(block) for block in text.split("\n\n") if "| workload" in block):
        tables[header[2].split()[-1]] = (header, [dict(zip(header, row)) for row in rows])  # "raw load" -> "load"
    return tables


def test_checkpoint_phases_time_each_phase_of_loads_and_saves_of_the_reference_and_of_torch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert checkpoint_phases.main(["--sizes", "4MB", "--world-sizes", "1", "--layouts", "sharded", "--rounds", "2"]) == 0
    tables = _tables(capsys.readouterr().out)
    assert list(tables) == ["load", "save"]
    timed_phases = {"load": ("metadata", "set up", "local plan", "read"),
                    "save": ("set up", "local plan", "global plan", "write", "finish")}
    for op, (header, rows) in tables.items():
        assert header == ["workload", "impl", *checkpoint_phases.columns(op)]
        assert header[2:5] == [f"raw {op}", f"raw-agreed {op}", op]
        assert [(row["workload"], row["impl"]) for row in rows] == [(f"{op} 4MB ws1 sharded", "reference"),
                                                                     (f"{op} 4MB ws1 sharded", "torch")]
        reference, torch_ = rows
        # Every phase was seen (the instrumented calls ran), and none is more than the operation itself.
        for figures in (reference, torch_):
            assert float(figures[f"raw {op}"]) > 0 and float(figures[f"raw-agreed {op}"]) > 0
            for phase in timed_phases[op]:
                assert 0 < float(figures[phase]) <= float(figures[op]), (op, phase, figures)
        assert 0 <= float(reference["exchange"]) <= float(reference["agree"]) <= float(reference[op])
        assert torch_["agree"] == torch_["exchange"] == "-"  # torch's collectives are in its "other"
    assert float(tables["load"][1][0]["headers"]) > 0
    assert tables["load"][1][1]["commit"] == "-"  # a phase torch's load does not have


def test_checkpoint_phases_time_the_exchange_of_each_agreement_at_world_size_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert checkpoint_phases.main(["--sizes", "4MB", "--world-sizes", "2", "--layouts", "full", "--rounds", "1",
                                   "--impls", "reference"]) == 0
    for op, (_, rows) in _tables(capsys.readouterr().out).items():
        (reference,) = rows
        assert 0 < float(reference["exchange"]) <= float(reference["agree"]) < float(reference[op]), (op, reference)


def test_exchange_is_the_time_from_the_last_rank_arriving_to_each_agreement_ending_less_the_decision() -> None:
    # Two agreements. The first: rank 1's step ends last (3.0), the coordinator decides for 0.2 s,
    # rank 0 is done at 3.5 and rank 1 at 3.6. The second: both steps end at 5.0, both are done at 5.1.
    ranks: list[dict[str, dict[str, Any]]] = [{"reference": {"agreements": [(1.0, 3.5, 0.2), (5.0, 5.1, 0.0)]}, "torch": {"agreements": []}},
             {"reference": {"agreements": [(3.0, 3.6, 0.0), (5.0, 5.1, 0.0)]}, "torch": {"agreements": []}}]
    for impl in ("reference", "torch"):
        checkpoint_phases._add_exchange(ranks, impl)
    assert [rank["reference"][checkpoint_phases.EXCHANGE] for rank in ranks] == pytest.approx([0.4, 0.5])
    assert all("agreements" not in rank[impl] for rank in ranks for impl in ("reference", "torch"))
    assert all(checkpoint_phases.EXCHANGE not in rank["torch"] for rank in ranks)  # none timed: "-"


@pytest.mark.parametrize("impl", ["reference", "raw"])
def test_saves_over_the_previous_checkpoint_keep_the_directory_on_every_rank(two_ranks: RankGroup, tmp_path: Any, impl: str) -> None:
    """``save_once(..., over_previous=True)``: the first save makes the directory, later ones go over what
    is there (a file of the user's stays), and every rank makes the same collective calls whichever rank
    looks first (a rank deciding alone from what it sees hung the ranks)."""
    directory = tmp_path / "ckpt"
    group = two_ranks
    group.run(ck.prepare, 4 << 20, "sharded")
    for k in range(3):
        assert all(s > 0 for s in group.run(ck.save_once, impl, str(directory), True, timeout=120))
        if k == 0:
            (directory / "mine.txt").write_text("kept")
        assert all(s > 0 for s in group.run(ck.load_once, impl, str(directory), timeout=120))  # checks every value
    assert (directory / "mine.txt").read_text() == "kept"
    group.run(ck.save_once, impl, str(directory), timeout=120)  # not over the previous one: emptied first
    assert not (directory / "mine.txt").exists()
