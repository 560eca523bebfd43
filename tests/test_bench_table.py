"""Tests of tools.bench_table: reading pytest-benchmark and asv results, the ratios, the output formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import bench_table
from tools.bench_table import Row


def _pytest_entry(group: str, impl: str, seconds: float, **extra: object) -> dict:
    # The table reads the median of the rounds; a min that differs shows it is not the one read.
    return {"group": group, "name": f"test_x[{impl}]", "params": {"impl": impl},
            "extra_info": {"impl": impl, **extra}, "stats": {"min": seconds / 2, "median": seconds}}


PYTEST_JSON = {
    "machine_info": {"node": "box", "processor": "x86_64", "cpu": {"brand_raw": "AMD EPYC", "count": 2}},
    "commit_info": {"id": "0123456789abcdef"},
    "datetime": "2026-11-22T02:30:00.000000",
    "benchmarks": [
        _pytest_entry("save 64MB ws1 full", "reference", 0.5, bytes=64 * 2**20),
        _pytest_entry("save 64MB ws1 full", "torch", 1.0, bytes=64 * 2**20),
        _pytest_entry("save 64MB ws1 full", "raw", 0.25, bytes=64 * 2**20),
        _pytest_entry("save 64MB ws1 full", "memcpy", 0.0625, bytes=64 * 2**20),
        _pytest_entry("flatten 100 params, depth 1", "reference", 0.002),
        _pytest_entry("flatten 100 params, depth 1", "fairscale", 0.004),
        _pytest_entry("meta-load 64MB ws1 full", "reference", 0.9, bytes=64 * 2**20, peak_rss_ratio=1.1, rank_seconds=0.5),
        _pytest_entry("meta-load 64MB ws1 full", "torch", 0.5, bytes=64 * 2**20, peak_rss_ratio=2.2),
        {"group": "no impl", "name": "test_other", "params": None, "extra_info": {}, "stats": {"min": 1.0}},
    ],
}


def _rows(table: bench_table.Table) -> dict[str, Row]:
    return {row.workload: row for row in table.rows}


def test_pytest_benchmark_rows_are_workloads_and_columns_are_roles() -> None:
    rows = _rows(bench_table.from_pytest_benchmark(PYTEST_JSON))
    assert sorted(rows) == [
        "flatten 100 params, depth 1", "meta-load 64MB ws1 full", "meta-load 64MB ws1 full peak memory",
        "save 64MB ws1 full",
    ]
    save = rows["save 64MB ws1 full"]
    assert save.unit == "MB/s"
    assert save.values == {"reference": 128.0, "upstream": 64.0, "raw": 256.0, "memcpy": 1024.0}
    flatten = rows["flatten 100 params, depth 1"]
    assert (flatten.unit, flatten.upstream_name, flatten.values) == (
        "seconds", "fairscale", {"reference": 0.002, "upstream": 0.004})


def test_ratio_is_the_reference_speed_whatever_the_unit() -> None:
    rows = _rows(bench_table.from_pytest_benchmark(PYTEST_JSON))
    # Throughput: reference 128 MB/s vs torch 64 and raw 256.
    assert rows["save 64MB ws1 full"].ratio("upstream") == pytest.approx(2.0)
    assert rows["save 64MB ws1 full"].ratio("raw") == pytest.approx(0.5)
    # Time: reference takes half fairscale's time, so it is twice as fast.
    assert rows["flatten 100 params, depth 1"].ratio("upstream") == pytest.approx(2.0)
    assert rows["flatten 100 params, depth 1"].ratio("raw") is None
    # Memory: the reference peaks at half of torch's.
    assert rows["meta-load 64MB ws1 full peak memory"].ratio("upstream") == pytest.approx(2.0)
    # The ranks' own time (0.5 s) wins over the controller's (0.9 s).
    assert rows["meta-load 64MB ws1 full"].values["reference"] == pytest.approx(128.0)


def test_ratio_of_missing_or_zero_figures_is_empty() -> None:
    assert Row("w", "seconds", {"reference": 0.0, "upstream": 1.0}).ratio("upstream") is None
    assert Row("w", "seconds", {"upstream": 1.0}).ratio("upstream") is None
    assert Row("w", "MB/s", {"reference": float("nan"), "raw": 1.0}).ratio("raw") is None


def _write_asv(root: Path) -> Path:
    results = root / "results"
    (results / "box").mkdir(parents=True)
    benchmarks = {
        "bench_checkpoint.CheckpointThroughput.track_save": {
            "name": "bench_checkpoint.CheckpointThroughput.track_save", "type": "track", "unit": "MB/s",
            "param_names": ["impl", "size", "world_size"],
            "params": [["'reference'", "'torch'", "'raw'"], ["'64MB'"], ["1", "2"]],
        },
        "bench_checkpoint.CheckpointSpeedup.track_save_speedup": {
            "name": "bench_checkpoint.CheckpointSpeedup.track_save_speedup", "type": "track", "unit": "ratio",
            "param_names": ["baseline"], "params": [["'torch'"]],
        },
        "bench_state_dict.GetStateDict.time_get_state_dict": {
            "name": "bench_state_dict.GetStateDict.time_get_state_dict", "type": "time", "unit": "seconds",
            "param_names": ["impl", "keys"], "params": [["'reference'", "'torch'"], ["100"]],
        },
        "version": 2,
    }
    (results / "benchmarks.json").write_text(json.dumps(benchmarks))
    result = {
        "commit_hash": "abcdef0123456789", "env_name": "virtualenv-py3.11-torch2.13.0", "date": 1795833000000,
        "params": {"machine": "box", "cpu": "AMD EPYC", "num_cpu": "2", "ram": str(24 * 2**30)},
        "result_columns": ["result", "params", "version"],
        "results": {
            # reference at ws2 failed (None), raw at ws2 skipped (NaN): those cells stay empty
            "bench_checkpoint.CheckpointThroughput.track_save": [
                [100.0, None, 50.0, 60.0, 400.0, float("nan")],
                [["'reference'", "'torch'", "'raw'"], ["'64MB'"], ["1", "2"]], "v"],
            "bench_checkpoint.CheckpointSpeedup.track_save_speedup": [[2.0], [["'torch'"]], "v"],
            "bench_state_dict.GetStateDict.time_get_state_dict": [[0.01, 0.04], [["'reference'", "'torch'"], ["100"]], "v"],
        },
        "version": 2,
    }
    path = results / "box" / "abcdef01-virtualenv-py3.11-torch2.13.0.json"
    path.write_text(json.dumps(result))
    return results


def test_asv_rows_from_the_latest_result(tmp_path: Path) -> None:
    table = bench_table.load(_write_asv(tmp_path))
    rows = _rows(table)
    assert sorted(rows) == ["get_state_dict keys=100", "save size=64MB world_size=1", "save size=64MB world_size=2"]
    assert rows["save size=64MB world_size=1"].values == {"reference": 100.0, "upstream": 50.0, "raw": 400.0}
    assert rows["save size=64MB world_size=2"].values == {"upstream": 60.0}
    assert rows["save size=64MB world_size=1"].ratio("raw") == pytest.approx(0.25)
    assert rows["get_state_dict keys=100"].ratio("upstream") == pytest.approx(4.0)
    assert "commit abcdef01" in table.caption and "24 GB RAM" in table.caption and "2 CPUs" in table.caption


def test_asv_commit_that_was_not_run_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no asv result for commit 99999999"):
        bench_table.load(_write_asv(tmp_path), commit="99999999")


@pytest.mark.parametrize("fmt", ["plain", "markdown"])
def test_render_text(fmt: str) -> None:
    text = bench_table.render(bench_table.from_pytest_benchmark(PYTEST_JSON), fmt)
    assert "2026-11-22 02:30 UTC on box (AMD EPYC, 2 CPUs), commit 01234567" in text
    header = next(line for line in text.splitlines() if "workload" in line)
    table = bench_table.from_pytest_benchmark(PYTEST_JSON)
    assert [h.strip() for h in header.strip("| ").split("|" if fmt == "markdown" else None)] == bench_table.headers(table)
    assert bench_table.headers(table) == ["workload", "unit", "reference", "upstream", "raw", "memcpy",
                                          "reference/upstream", "reference/raw"]
    assert "flatten 100 params, depth 1 [upstream: fairscale]" in text
    save_line = next(line for line in text.splitlines() if line.lstrip("| ").startswith("save 64MB"))
    assert "128" in save_line and "2.00" in save_line and "0.500" in save_line


def test_render_json_round_trips() -> None:
    data = json.loads(bench_table.render(bench_table.from_pytest_benchmark(PYTEST_JSON), "json"))
    save = next(r for r in data["rows"] if r["workload"] == "save 64MB ws1 full")
    assert save["reference/upstream"] == pytest.approx(2.0) and save["upstream_impl"] == "torch" and save["upstream"] == 64.0


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(PYTEST_JSON))
    assert bench_table.main([str(path), "--format", "markdown"]) == 0
    assert "| workload" in capsys.readouterr().out
    (tmp_path / "other.json").write_text("{}")
    assert bench_table.main([str(tmp_path / "other.json")]) == 2
    assert "neither a pytest-benchmark JSON" in capsys.readouterr().err
    assert bench_table.main([str(tmp_path / "missing.json")]) == 2


def test_an_implementation_under_test_gets_its_own_column_and_ratios() -> None:
    fork = "mystack.adapter:MyAdapter"
    data = {**PYTEST_JSON, "benchmarks": [
        _pytest_entry("save 64MB ws1 full", "reference", 0.5, bytes=64 * 2**20),
        _pytest_entry("save 64MB ws1 full", fork, 2.0, bytes=64 * 2**20),
        _pytest_entry("save 64MB ws1 full", "torch", 1.0, bytes=64 * 2**20),
        _pytest_entry("save 64MB ws1 full", "raw", 0.25, bytes=64 * 2**20),
    ]}
    table = bench_table.from_pytest_benchmark(data)
    assert table.subjects == ["reference", fork]
    assert bench_table.headers(table) == [
        "workload", "unit", "reference", fork, "upstream", "raw", "memcpy",
        "reference/upstream", "reference/raw", f"{fork}/upstream", f"{fork}/raw"]
    row = table.rows[0]
    assert row.values == {"reference": 128.0, fork: 32.0, "upstream": 64.0, "raw": 256.0}
    assert row.ratio("upstream", fork) == pytest.approx(0.5) and row.ratio("raw", fork) == pytest.approx(0.125)
    line = next(line for line in bench_table.render(table).splitlines() if line.startswith("save"))
    assert line.split()[-4:] == ["2.00", "0.500", "0.500", "0.125"]


def test_asv_speedups_with_an_impl_parameter_are_not_figures(tmp_path: Path) -> None:
    results = _write_asv(tmp_path)
    benchmarks = json.loads((results / "benchmarks.json").read_text())
    speedup = benchmarks["bench_checkpoint.CheckpointSpeedup.track_save_speedup"]
    speedup.update(param_names=["impl", "baseline"], params=[["'reference'"], ["'torch'"]])
    (results / "benchmarks.json").write_text(json.dumps(benchmarks))
    result_path = next((results / "box").glob("*.json"))
    result = json.loads(result_path.read_text())
    result["results"]["bench_checkpoint.CheckpointSpeedup.track_save_speedup"] = [[2.0], [["'reference'"], ["'torch'"]], "v"]
    result_path.write_text(json.dumps(result))
    rows = _rows(bench_table.load(results))
    assert sorted(rows) == ["get_state_dict keys=100", "save size=64MB world_size=1", "save size=64MB world_size=2"]
