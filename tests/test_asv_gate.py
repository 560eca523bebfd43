"""Tests of tools.asv_gate: which benchmarks decide the gate, its statistics (rounds, the median of the
per-round ratios and its interval), reading asv's recorded samples, the commands it runs and the exit
status it returns. Nothing here is timed: samples are made up."""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Mapping
from pathlib import Path

import pytest

from bench import bench_gate
from tools import asv_gate

GATED_NAMES = asv_gate.benchmark_names(bench_gate.GATED)
BASELINE_NAMES = asv_gate.benchmark_names(bench_gate.BASELINES)
ROUNDS = bench_gate.ROUNDS
N = bench_gate.SAMPLES_PER_ROUND


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


def test_gate_times_one_call_per_class_of_the_gated_adapter_only() -> None:
    assert [cls.__name__ for cls in bench_gate.GATED] == [
        "GateFlatten", "GateGetStateDict", "GateSetStateDict", "GateOptimStateDict", "GateLoadOptimStateDict",
        "GateCheckpointSave", "GateCheckpointLoad", "GateAsyncStall"]
    for cls in bench_gate.GATED:
        assert "impl" not in (getattr(cls, "param_names", None) or []), cls.__name__
        assert len([n for n in dir(cls) if n.startswith("time_")]) == 1, cls.__name__
    # Every gated benchmark has a baseline of the same method, for the baselines only.
    assert {n.split(".", 2)[2] for n in GATED_NAMES} == {n.split(".", 2)[2] for n in BASELINE_NAMES}
    assert bench_gate.GATED_IMPL == "reference"  # BENCH_IMPL is not set under the tests
    for cls in bench_gate.BASELINES:
        impls = cls.params[0]
        assert impls and "reference" not in impls and "raw" in impls, cls.__name__


def test_gated_rounds_have_a_fixed_number_of_samples() -> None:
    # The gate cuts asv's samples into rounds: an adaptive repeat (a tuple) would make that impossible.
    for cls in bench_gate.GATED:
        assert isinstance(cls.repeat, int) and cls.repeat == N, cls.__name__
        assert cls.rounds == ROUNDS >= 5, cls.__name__
        assert cls.number == 1, cls.__name__


def test_baselines_of_another_adapter_include_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_gate, "GATED_IMPL", "mystack.adapter:MyAdapter")
    assert bench_gate._baseline_impls(("torch",)) == ["torch", "raw", "reference"]
    monkeypatch.setattr(bench_gate, "GATED_IMPL", "torch")
    assert bench_gate._baseline_impls(("torch",)) == ["raw", "reference"]


# -- the statistics --------------------------------------------------------------------------------


def test_split_rounds_cuts_in_recorded_order() -> None:
    assert asv_gate.split_rounds([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 3) == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    with pytest.raises(ValueError, match="7 samples do not split into 3 rounds"):
        asv_gate.split_rounds([1.0] * 7, 3)
    with pytest.raises(ValueError):
        asv_gate.split_rounds([], 3)


def test_median_interval_is_the_order_statistic_interval() -> None:
    # 6 values: only [min, max] reaches 90% (1 - 2/64 = 0.969); [2nd, 5th] has 1 - 2*7/64 = 0.78.
    low, high, conf = asv_gate.median_interval([1.3, 0.9, 1.1, 1.0, 1.2, 0.95])
    assert (low, high) == (0.9, 1.3) and conf == pytest.approx(1 - 2 / 64)
    # 10 values: [2nd, 9th] has 1 - 2*11/1024 = 0.979, [3rd, 8th] 1 - 2*56/1024 = 0.891 < 0.9.
    low, high, conf = asv_gate.median_interval([float(v) for v in range(10)])
    assert (low, high) == (1.0, 8.0) and conf == pytest.approx(1 - 22 / 1024)
    # Too few values for 90%: [min, max] with what it does reach.
    low, high, conf = asv_gate.median_interval([2.0, 1.0, 3.0])
    assert (low, high) == (1.0, 3.0) and conf == pytest.approx(0.75)


def _samples(base_ms: float, factor: float, *, noise: float, seed: int, drift: bool = True,
             process_sd: float = 0.0) -> tuple[list[float], list[float]]:
    """Made-up samples of ROUNDS rounds: each round on a machine of its own speed (drift), the same for
    base and tip in a round (they ran side by side), each round's process a little faster or slower
    than another (``process_sd``: sd of the log), with per-sample noise."""
    rng = random.Random(seed)
    base, tip = [], []
    for _ in range(ROUNDS):
        speed = rng.uniform(0.7, 1.6) if drift else 1.0
        b, t = (speed * math.exp(rng.gauss(0, process_sd)) for _ in range(2))
        base += [base_ms * b * (1 + rng.gauss(0, noise)) for _ in range(N)]
        tip += [base_ms * factor * t * (1 + rng.gauss(0, noise)) for _ in range(N)]
    return base, tip


@pytest.mark.parametrize("seed", range(20))
def test_a_1_2x_slowdown_under_drifting_load_is_flagged(seed: int) -> None:
    # The machine's speed moves by up to 2.3x between rounds: the pairing by round cancels it.
    base, tip = _samples(40.0, 1.2, noise=0.05, seed=seed)
    c = asv_gate.compare("x", base, tip, ROUNDS, asv_gate.DEFAULT_FACTOR)
    assert c.status in ("slower", "suspect") and c.ratio == pytest.approx(1.2, rel=0.05), c
    assert asv_gate.compare("x", base, tip, ROUNDS, asv_gate.DEFAULT_FACTOR, confirming=True).flagged


@pytest.mark.parametrize("seed", range(20))
def test_identical_code_under_drifting_load_is_not_flagged(seed: int) -> None:
    base, tip = _samples(40.0, 1.0, noise=0.05, seed=seed)
    c = asv_gate.compare("x", base, tip, ROUNDS, asv_gate.DEFAULT_FACTOR)
    assert c.status == "same" and not c.flagged and not c.to_confirm and c.ratio == pytest.approx(1.0, abs=0.05), c


def test_a_slowdown_below_the_factor_or_not_in_enough_rounds_is_not_flagged() -> None:
    base, tip = _samples(40.0, 1.05, noise=0.01, seed=1)
    assert asv_gate.compare("x", base, tip, ROUNDS, 1.1).status == "same"  # consistent, but below 1.1x
    # 1.5x in 5 of 8 rounds only (bursts of load that the pairing did not cancel): not even suspect.
    base, tip = [40.0] * (ROUNDS * N), []
    for k in range(ROUNDS):
        tip += [60.0 if k % 8 in (0, 2, 4, 5, 7) else 40.0] * N
    assert asv_gate.compare("x", base, tip, ROUNDS, 1.1).status == "same"
    # In 6 of 8 it is suspect (measured again), not slower.
    tip = []
    for k in range(ROUNDS):
        tip += [60.0 if k % 8 in (0, 2, 3, 4, 5, 7) else 40.0] * N
    assert asv_gate.compare("x", base, tip, ROUNDS, 1.1).status == "suspect"


def test_strong_evidence_needs_no_confirmation() -> None:
    base, tip = _samples(40.0, 1.5, noise=0.02, seed=4)
    c = asv_gate.compare("x", base, tip, ROUNDS, 1.1)
    assert c.status == "slower" and c.low is not None and c.low >= 1.1 and c.flagged and not c.to_confirm


def test_a_speedup_is_reported_and_never_flagged() -> None:
    base, tip = _samples(40.0, 0.7, noise=0.02, seed=3)
    c = asv_gate.compare("x", base, tip, ROUNDS, 1.1)
    assert c.status == "faster" and not c.flagged


def _gate_once(rng: random.Random, factor: float, process_sd: float) -> bool:
    """The gate's two stages on made-up rounds whose per-process speed varies by ``process_sd`` (the sd of
    the log of one process's median CPU time): True if it fails the tip."""

    def rounds(n: int) -> tuple[list[float], list[float]]:
        base, tip = [], []
        for _ in range(n):
            b, t = (20.0 * math.exp(rng.gauss(0, process_sd)) for _ in range(2))
            base += [b * (1 + rng.gauss(0, 0.02)) for _ in range(N)]
            tip += [factor * t * (1 + rng.gauss(0, 0.02)) for _ in range(N)]
        return base, tip

    base, tip = rounds(ROUNDS)
    first = asv_gate.compare("x", base, tip, ROUNDS, asv_gate.DEFAULT_FACTOR)
    if not first.to_confirm:
        return first.flagged
    more_base, more_tip = rounds(ROUNDS)
    return asv_gate.compare("x", base + more_base, tip + more_tip, 2 * ROUNDS, asv_gate.DEFAULT_FACTOR, confirming=True).flagged


def test_simulated_gate_false_alarms_and_catches_at_the_noise_measured_here() -> None:
    # sd 0.085 per process: what identical code measured here between processes for get_state_dict
    # (0.077) and the optimizer state dict (0.088), under load 10-20 on 2 cores.
    rng = random.Random(0)
    runs = 2000
    false_alarms = sum(_gate_once(rng, 1.0, 0.085) for _ in range(runs))
    caught_12 = sum(_gate_once(rng, 1.2, 0.085) for _ in range(runs))
    caught_14 = sum(_gate_once(rng, 1.4, 0.085) for _ in range(runs))
    # Per benchmark; the gate has 7, so a run of identical commits fails 7x as often.
    assert false_alarms / runs < 0.003, false_alarms
    assert caught_12 / runs > 0.93, caught_12
    assert caught_14 / runs > 0.999, caught_14


def test_failures_and_skips() -> None:
    ok = [1.0] * (ROUNDS * N)
    assert asv_gate.compare("x", ok, None, ROUNDS, 1.1).status == "failed on tip"
    assert asv_gate.compare("x", ok, None, ROUNDS, 1.1).flagged
    assert asv_gate.compare("x", None, None, ROUNDS, 1.1).status == "failed"
    assert asv_gate.compare("x", None, ok, ROUNDS, 1.1).status == "new"
    assert asv_gate.compare("x", math.nan, math.nan, ROUNDS, 1.1).status == "skipped"
    assert not any(asv_gate.compare("x", b, t, ROUNDS, 1.1).flagged for b, t in [(None, None), (None, ok), (math.nan, math.nan)])


# -- asv's result files ------------------------------------------------------------------------------


COLUMNS = ["result", "params", "version", "started_at", "duration", "stats_ci_99_a", "stats_ci_99_b", "stats_q_25",
           "stats_q_75", "stats_number", "stats_repeat", "samples", "profile"]


def _result_file(results: Path, commit: str, entries: Mapping[str, list[float] | float | None]) -> None:
    machine = results / "box"
    machine.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, samples in entries.items():
        if isinstance(samples, list):
            rows[name] = [[sorted(samples)[len(samples) // 2]], [], "v", 0, 1.0, [0], [0], [0], [0], [1], [len(samples)], [samples]]
        elif samples is None:
            rows[name] = [None, [], "v", 0, 1.0]
        else:
            rows[name] = [[samples], [], "v", 0, 1.0]
    rows["bench_x.Param.time_y"] = [[1.0, 2.0], [["'a'", "'b'"]], "v", 0, 1.0]  # parametrized: not read
    data = {"commit_hash": commit, "env_name": "env", "result_columns": COLUMNS, "results": rows, "version": 2}
    (machine / f"{commit[:8]}-env.json").write_text(json.dumps(data))


def test_read_samples(tmp_path: Path) -> None:
    _result_file(tmp_path, "a" * 40, {"m.C.time_a": [3.0, 1.0, 2.0], "m.C.time_failed": None, "m.C.time_skipped": math.nan})
    samples = asv_gate.read_samples(tmp_path, "a" * 40)
    assert samples["m.C.time_a"] == [3.0, 1.0, 2.0]  # recorded order kept: it is the rounds' order
    assert samples["m.C.time_failed"] is None
    assert isinstance(samples["m.C.time_skipped"], float) and math.isnan(samples["m.C.time_skipped"])
    assert "bench_x.Param.time_y" not in samples
    assert asv_gate.read_samples(tmp_path, "b" * 40) == {}


def test_results_dir_is_read_from_asv_conf_with_comments(tmp_path: Path) -> None:
    (tmp_path / "asv.conf.json").write_text('{\n  // a comment\n  "version": 1,\n  "results_dir": "out/results"\n}\n')
    assert asv_gate._results_dir(str(tmp_path / "asv.conf.json")) == (tmp_path / "out" / "results").resolve()


# -- main: commands, confirmation, exit status --------------------------------------------------------


BASE, TIP = "b" * 40, "t" * 40
GET = "bench_gate.GateGetStateDict.time_get_state_dict"
SAVE = "bench_gate.GateCheckpointSave.time_save"


#: Per-round process noise of the fake runs: identical code moves a few % from round to round.
PATTERN = [0.93, 1.0, 1.05, 0.97, 1.02, 0.95, 1.03, 1.0]


def _patterned(base_ms: float, factor: float) -> tuple[list[float], list[float]]:
    """Samples of ROUNDS rounds whose per-round tip/base ratio is ``factor`` times PATTERN: 1.12x gives
    ratios 1.04..1.18 (a suspect), 1.4x ratios 1.30..1.47 (clearly slower), 1.0 is identical code."""
    base, tip = [], []
    for k in range(ROUNDS):
        base += [base_ms] * N
        tip += [base_ms * factor * PATTERN[k % len(PATTERN)]] * N
    return base, tip


def _fake(tmp_path: Path, runs: list[dict[str, float]], baseline_status: int = 0, asv_status: int = 0):
    """A runner whose asv continuous calls write result files: each run maps benchmark -> tip slowdown
    (benchmarks not named run at 1.0x; -1 makes it fail on the tip); with --append-samples the samples
    are added to the previous run's, as asv does. Records every command."""
    results = tmp_path / "results"
    (tmp_path / "asv.conf.json").write_text(json.dumps({"results_dir": str(results)}))
    commands: list[list[str]] = []
    pending = list(runs)
    recorded: dict[str, dict[str, list[float] | None]] = {"base": {}, "tip": {}}

    def run(cmd: list[str]) -> tuple[int, str]:
        commands.append(cmd)
        if "continuous" in cmd:
            factors = pending.pop(0)
            pattern = cmd[cmd.index("--bench") + 1]
            append = "--append-samples" in cmd
            for name in (n for n in GATED_NAMES if re.search(pattern, n)):
                b, t = _patterned(10.0, max(factors.get(name, 1.0), 0.0))
                new_tip = None if factors.get(name) == -1 else t
                old_b, old_t = recorded["base"].get(name), recorded["tip"].get(name)
                recorded["base"][name] = (old_b or []) + b if append and old_b else b
                recorded["tip"][name] = (old_t + new_tip) if append and old_t and new_tip else new_tip
            _result_file(results, BASE, recorded["base"])
            _result_file(results, TIP, recorded["tip"])
            return asv_status, ""
        if "run" in cmd:
            return baseline_status, ""
        return 0, ""

    return run, commands, ["--config", str(tmp_path / "asv.conf.json")]


def _resolve(base: str, tip: str) -> tuple[str, str, None]:
    return BASE, TIP, None


def test_a_clean_run_passes_and_ignores_the_baselines_outcome(tmp_path: Path) -> None:
    run, commands, conf = _fake(tmp_path, [{}], baseline_status=1)
    assert asv_gate.main(["--base", "abc", "--tip", "def", *conf], run=run, resolve=_resolve) == 0
    continuous = [c for c in commands if "continuous" in c]
    assert len(continuous) == 1
    cmd = continuous[0]
    assert "--interleave-rounds" in cmd and cmd[-2:] == [BASE, TIP]
    assert cmd[cmd.index("--attribute") + 1] == f"rounds={ROUNDS}"
    assert cmd[cmd.index("--bench") + 1] == asv_gate.selection_pattern(bench_gate.GATED)
    baseline = next(c for c in commands if "run" in c)
    assert baseline[baseline.index("--bench") + 1] == asv_gate.selection_pattern(bench_gate.BASELINES)
    assert baseline[-1] == f"{TIP}^!"


def test_a_suspect_confirmed_by_both_runs_together_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 1.12x: above the factor but not clear of it in the first run's interval, so it is measured again.
    run, commands, conf = _fake(tmp_path, [{GET: 1.12, SAVE: 1.12}, {GET: 1.12}])
    assert asv_gate.main([*conf, "--no-baselines"], run=run, resolve=_resolve) == 1
    second = [c for c in commands if "continuous" in c][1]
    assert second[second.index("--bench") + 1] == asv_gate.names_pattern([GET, SAVE])  # only what was suspect
    assert "--append-samples" in second
    out = capsys.readouterr().out
    assert re.search(rf"slower: {re.escape(GET)} 1\.1\dx \(exit 1\)", out), out
    assert "of 16 rounds" in out  # the second verdict is on both runs' rounds


def test_a_clear_slowdown_fails_without_a_second_run(tmp_path: Path) -> None:
    run, commands, conf = _fake(tmp_path, [{GET: 1.4}])
    assert asv_gate.main([*conf, "--no-baselines"], run=run, resolve=_resolve) == 1
    assert len([c for c in commands if "continuous" in c]) == 1


def test_a_suspect_not_confirmed_passes(tmp_path: Path) -> None:
    run, _, conf = _fake(tmp_path, [{SAVE: 1.12}, {SAVE: 0.9}])
    assert asv_gate.main([*conf, "--no-baselines"], run=run, resolve=_resolve) == 0


def test_without_confirmation_a_suspect_fails(tmp_path: Path) -> None:
    run, commands, conf = _fake(tmp_path, [{SAVE: 1.12}])
    assert asv_gate.main([*conf, "--no-confirm", "--no-baselines"], run=run, resolve=_resolve) == 1
    assert len([c for c in commands if "continuous" in c]) == 1


def test_failing_on_the_tip_fails(tmp_path: Path) -> None:
    run, _, conf = _fake(tmp_path, [{SAVE: -1}, {SAVE: -1}])
    assert asv_gate.main([*conf, "--no-baselines"], run=run, resolve=_resolve) == 1


def test_no_results_at_all_cannot_be_judged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "asv.conf.json").write_text(json.dumps({"results_dir": str(tmp_path / "none")}))

    def run(cmd: list[str]) -> tuple[int, str]:
        return (2, "asv: error: unknown commit") if "continuous" in cmd else (0, "")

    assert asv_gate.main(["--config", str(tmp_path / "asv.conf.json"), "--no-baselines"], run=run, resolve=_resolve) == 2
    assert "cannot judge" in capsys.readouterr().out


def test_factor_and_rounds_are_checked() -> None:
    with pytest.raises(SystemExit):
        asv_gate.main(["--factor", "1.0"], run=lambda cmd: (0, ""), resolve=_resolve)
    with pytest.raises(SystemExit):
        asv_gate.main(["--rounds", "1"], run=lambda cmd: (0, ""), resolve=_resolve)
