"""Self-tests of the checkpoint benchmark tools: ``bench.checkpoint_io`` (throughput against raw) and
``bench.checkpoint_phases`` (where a reference load's time goes), each run once on a small state dict."""

from __future__ import annotations

import pytest

from bench import checkpoint_io, checkpoint_phases, config


def _rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]


@pytest.mark.parametrize("text, nbytes", [("64MB", 64 << 20), ("2GB", 2 << 30), ("1.5MB", 3 << 19), ("4096", 4096)])
def test_parse_size_is_the_inverse_of_size_label(text: str, nbytes: int) -> None:
    assert config.parse_size(text) == nbytes
    if text.endswith("B") and "." not in text:
        assert config.size_label(nbytes) == text


def test_checkpoint_io_prints_a_row_per_operation_with_ratios_to_raw(capsys: pytest.CaptureFixture[str]) -> None:
    assert checkpoint_io.main(["--sizes", "4MB", "--world-sizes", "1", "--layouts", "full", "--rounds", "1",
                               "--impls", "reference,raw"]) == 0
    header, *rows = _rows(capsys.readouterr().out)
    assert header == ["workload", "reference MB/s", "raw MB/s", "reference/raw"]
    assert [row[0] for row in rows] == ["save 4MB ws1 full", "load 4MB ws1 full"]
    for row in rows:
        assert all(float(cell.replace(",", "")) > 0 for cell in row[1:]), row


def test_checkpoint_phases_time_each_phase_of_the_reference_and_of_torch(capsys: pytest.CaptureFixture[str]) -> None:
    assert checkpoint_phases.main(["--sizes", "4MB", "--world-sizes", "1", "--layouts", "sharded", "--rounds", "3"]) == 0
    header, *rows = _rows(capsys.readouterr().out)
    assert header == ["workload", "impl", "raw load", "load", *checkpoint_phases.PHASES]
    assert [row[:2] for row in rows] == [["load 4MB ws1 sharded", "reference"], ["load 4MB ws1 sharded", "torch"]]
    reference, torch_ = (dict(zip(header[2:], row[2:])) for row in rows)
    # Every phase was seen (the instrumented calls ran), and none is more than the load itself.
    for figures in (reference, torch_):
        for phase in ("metadata", "set up", "local plan", "read"):
            assert 0 < float(figures[phase]) <= float(figures["load"]), (phase, figures)
    assert float(reference["headers"]) > 0
    assert torch_["agree"] == torch_["commit"] == "-"  # phases torch's load does not have
