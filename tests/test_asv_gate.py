"""Tests of tools.asv_gate: which benchmarks decide the gate, that asv can find them significant, the
commands it runs and the exit status it returns. Nothing here is timed."""

from __future__ import annotations

import re

import pytest

from bench import bench_gate
from tools import asv_gate

GATED_NAMES = asv_gate.benchmark_names(bench_gate.GATED)
BASELINE_NAMES = asv_gate.benchmark_names(bench_gate.BASELINES)


def _selected(pattern: str, names: list[str]) -> list[str]:
    return [name for name in names if re.search(pattern, name)]  # asv's -b is re.search on the name


def test_gate_selects_every_gated_benchmark_and_no_baseline() -> None:
    pattern = asv_gate.selection_pattern(bench_gate.GATED)
    assert _selected(pattern, GATED_NAMES) == GATED_NAMES
    assert _selected(pattern, BASELINE_NAMES) == []


def test_baseline_pattern_selects_only_baselines() -> None:
    pattern = asv_gate.selection_pattern(bench_gate.BASELINES)
    assert _selected(pattern, BASELINE_NAMES) == BASELINE_NAMES
    assert _selected(pattern, GATED_NAMES) == []


def test_pattern_does_not_select_a_class_whose_name_only_starts_alike() -> None:
    # GateFlatten must not pull in a GateFlattenSlow (or the gate would time what it does not list).
    class GateFlattenSlow:
        def time_x(self) -> None: ...

    names = asv_gate.benchmark_names([GateFlattenSlow])
    assert _selected(asv_gate.selection_pattern([bench_gate.GateFlatten]), names) == []


def test_gate_covers_every_capability_with_reference_only_benchmarks() -> None:
    # One class per capability; none of them is parametrized by an implementation.
    assert [cls.__name__ for cls in bench_gate.GATED] == ["GateFlatten", "GateStateDict", "GateOptimState",
                                                          "GateCheckpoint"]
    for cls in bench_gate.GATED:
        assert "impl" not in (getattr(cls, "param_names", None) or []), cls.__name__
    for cls in bench_gate.BASELINES:
        assert "reference" not in cls.params[0], cls.__name__
    # Every gated benchmark has a baseline of the same name, so the ratios can be formed.
    gated_methods = {name.split(".", 2)[2] for name in GATED_NAMES}
    baseline_methods = {name.split(".", 2)[2] for name in BASELINE_NAMES}
    assert gated_methods == baseline_methods


def test_min_samples_for_significance_matches_the_mann_whitney_bound() -> None:
    # Two-sided exact test with n samples per side: the smallest p is 2 / C(2n, n).
    assert asv_gate.min_samples_for_significance(0.002) == 7  # 2/3432 < 0.002 <= 2/924
    assert asv_gate.min_samples_for_significance(0.05) == 4  # 2/70 < 0.05 <= 2/20


def test_every_gated_class_takes_enough_samples_for_asvs_test() -> None:
    for cls in bench_gate.GATED:
        assert asv_gate.samples_per_commit(cls) >= asv_gate.min_samples_for_significance(), cls.__name__
        assert getattr(cls, "rounds", 1) >= 2, f"{cls.__name__}: interleaving needs at least 2 rounds"


def test_main_returns_asvs_verdict_and_ignores_the_baselines_outcome() -> None:
    for gate_status, baseline_status in [(0, 1), (1, 0), (2, 2)]:
        commands: list[list[str]] = []

        def run(cmd: list[str]) -> int:
            commands.append(cmd)
            if "continuous" in cmd:
                return gate_status
            if "run" in cmd:
                return baseline_status
            return 0

        assert asv_gate.main(["--base", "abc", "--tip", "def"], run=run) == gate_status
        continuous = next(c for c in commands if "continuous" in c)
        assert "--interleave-rounds" in continuous
        assert continuous[-2:] == ["abc", "def"]
        assert continuous[continuous.index("--factor") + 1] == str(asv_gate.DEFAULT_FACTOR)
        assert continuous[continuous.index("--bench") + 1] == asv_gate.selection_pattern(bench_gate.GATED)
        baseline = next(c for c in commands if "run" in c)
        assert baseline[baseline.index("--bench") + 1] == asv_gate.selection_pattern(bench_gate.BASELINES)
        assert baseline[-1] == "def^!"


def test_main_without_baselines_runs_only_the_gate() -> None:
    commands: list[list[str]] = []
    assert asv_gate.main(["--no-baselines"], run=lambda cmd: commands.append(cmd) or 0) == 0
    assert not any("run" in c for c in commands)


def test_factor_must_be_above_one() -> None:
    with pytest.raises(SystemExit):
        asv_gate.main(["--factor", "1.0"], run=lambda cmd: 0)
