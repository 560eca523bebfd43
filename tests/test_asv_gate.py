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
        assert "reference" not in (getattr(cls, "params", None) or [[]])[0], cls.__name__
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


# What `asv continuous` printed here (abridged): one benchmark worse, one better.
TABLE = """
| Change   | Before [772b6ae3] <main~3>   | After [4e240a55] <perf~1>   |   Ratio | Benchmark (Parameter)               |
|----------|------------------------------|-----------------------------|---------|-------------------------------------|
| +        | 70.6±9ms                     | 226±60ms                    |    3.2  | bench_gate.GateCheckpoint.time_save |
| -        | 81.5±50ms                    | 37.1±8ms                    |    0.46 | bench_gate.GateOptimState.time_optim_state_dict_to_load |
|          | 10.7±1ms                     | 10.9±1ms                    |    1.02 | bench_gate.GateCheckpoint.time_load |
| !        | 10.7±1ms                     | failed                      |     n/a | bench_gate.GateFlatten.time_flatten |

SOME BENCHMARKS HAVE CHANGED SIGNIFICANTLY.
"""


def test_worsened_benchmarks_are_read_from_asvs_table() -> None:
    assert asv_gate.worsened_benchmarks(TABLE) == ["bench_gate.GateCheckpoint.time_save",
                                                   "bench_gate.GateFlatten.time_flatten"]
    assert asv_gate.worsened_benchmarks("BENCHMARKS NOT SIGNIFICANTLY CHANGED.") == []


def test_names_pattern_selects_exactly_the_named_benchmarks() -> None:
    pattern = asv_gate.names_pattern(["bench_gate.GateStateDict.time_get_state_dict"])
    assert _selected(pattern, GATED_NAMES) == ["bench_gate.GateStateDict.time_get_state_dict"]


def _fake(results: list[tuple[int, str]], baseline_status: int = 0):
    """A runner whose asv continuous calls return ``results`` in turn; records every command."""
    commands: list[list[str]] = []
    pending = list(results)

    def run(cmd: list[str]) -> tuple[int, str]:
        commands.append(cmd)
        if "continuous" in cmd:
            return pending.pop(0)
        if "run" in cmd:
            return baseline_status, ""
        return 0, ""

    return run, commands


def _flag(name: str) -> str:
    return f"| +        | 10ms | 20ms | 2.0 | {name} |"


GET = "bench_gate.GateStateDict.time_get_state_dict"
SAVE = "bench_gate.GateCheckpoint.time_save"


def test_a_clean_run_passes_and_ignores_the_baselines_outcome() -> None:
    run, commands = _fake([(0, "BENCHMARKS NOT SIGNIFICANTLY CHANGED.")], baseline_status=1)
    assert asv_gate.main(["--base", "abc", "--tip", "def"], run=run) == 0
    continuous = [c for c in commands if "continuous" in c]
    assert len(continuous) == 1
    assert "--interleave-rounds" in continuous[0] and continuous[0][-2:] == ["abc", "def"]
    assert continuous[0][continuous[0].index("--factor") + 1] == str(asv_gate.DEFAULT_FACTOR)
    assert continuous[0][continuous[0].index("--bench") + 1] == asv_gate.selection_pattern(bench_gate.GATED)
    baseline = next(c for c in commands if "run" in c)
    assert baseline[baseline.index("--bench") + 1] == asv_gate.selection_pattern(bench_gate.BASELINES)
    assert baseline[-1] == "def^!"


def test_a_slowdown_confirmed_by_the_second_run_fails() -> None:
    run, commands = _fake([(1, _flag(GET) + "\n" + _flag(SAVE)), (1, _flag(GET))], baseline_status=0)
    assert asv_gate.main(["--base", "abc", "--tip", "def"], run=run) == 1
    second = [c for c in commands if "continuous" in c][1]
    # The second run measures only what the first flagged.
    assert second[second.index("--bench") + 1] == asv_gate.names_pattern([GET, SAVE])


def test_a_slowdown_not_confirmed_passes() -> None:
    run, _ = _fake([(1, _flag(SAVE)), (0, "BENCHMARKS NOT SIGNIFICANTLY CHANGED.")])
    assert asv_gate.main(["--base", "abc", "--tip", "def", "--no-baselines"], run=run) == 0


def test_without_confirmation_the_first_flag_fails() -> None:
    run, commands = _fake([(1, _flag(SAVE))])
    assert asv_gate.main(["--no-confirm", "--no-baselines"], run=run) == 1
    assert len([c for c in commands if "continuous" in c]) == 1


def test_asv_failing_without_a_table_is_passed_on() -> None:
    run, commands = _fake([(2, "asv: error: unknown commit")])
    assert asv_gate.main(["--no-baselines"], run=run) == 2
    assert len([c for c in commands if "continuous" in c]) == 1


def test_main_without_baselines_runs_only_the_gate() -> None:
    run, commands = _fake([(0, "")])
    assert asv_gate.main(["--no-baselines"], run=run) == 0
    assert not any("run" in c for c in commands)


def test_factor_must_be_above_one() -> None:
    with pytest.raises(SystemExit):
        asv_gate.main(["--factor", "1.0"], run=lambda cmd: (0, ""))
