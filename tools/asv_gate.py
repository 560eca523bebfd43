"""The benchmark regression gate: did the tip commit make a core call of the gated adapter slower?

    python -m tools.asv_gate --base main --tip HEAD        # what `make asv-gate BASE=main` runs
    python -m tools.asv_gate --base HEAD --tip HEAD        # the same code twice: the noise floor
    python -m tools.asv_gate --list                        # the gated benchmarks and the baselines

It runs ``asv continuous --interleave-rounds`` on the gated benchmarks only (``bench/bench_gate.py``:
``GATED``, one core call each, timed through the adapter ``BENCH_IMPL`` names, the reference by
default), reads the samples asv recorded for both commits, and decides itself:

- every round of a commit takes the same number of samples (the gated classes' ``repeat``), so the
  samples split into rounds; asv runs the rounds base, tip, tip, base, base, tip, ..., so round ``k``
  of the base and round ``k`` of the tip ran next to each other, under the same load;
- per round, the ratio of the medians (tip / base); the slowdown is the *median of those ratios*, and
  its noise is a distribution-free interval of that median (order statistics of the per-round
  ratios, at least 90%: ``[2nd lowest, 2nd highest]`` of 8 rounds, ``[5th, 12th]`` of 16);
- a benchmark is *slower* when the whole interval is at or above ``--factor`` (default 1.1); it is
  *suspect* when the slowdown is at least ``--factor`` and at most a quarter of the rounds (2 of 8)
  were not slower. Suspects (and benchmarks that failed on the tip only) are measured again, alone,
  by a second interleaved run whose samples asv appends to the first run's (``--append-samples``);
  on all the rounds together they are slower when the slowdown is at least ``--factor`` and the
  interval is above 1. ``--no-confirm`` counts suspects as slower without measuring them again.

Why: on a shared 2-core machine the CPU time of one call moves 4-9% from one process to the next
(sd of its log between consecutive processes, measured here under load 10-20), so one round's ratio
moves 5-20% between identical commits; the samples within a round hardly differ. A slowdown must
therefore show in most rounds and in the median of many; the second run doubles the rounds exactly
where it matters. Simulated with a process-to-process sd of 0.085 (``tests/test_asv_gate.py``): a
benchmark of identical code fails under 0.1% of gate runs, a 1.2x slowdown is caught in about 95%, a
1.4x one always.

Exit status: 0 when nothing is slower, 1 when something is, 2 when the gate cannot judge (asv failed,
or a gated benchmark has no samples on either commit). Then, unless ``--no-baselines``, it records
the baselines (``BASELINES``: upstream, raw and, for another adapter, the reference) for the tip with
``asv run``; their outcome never changes the exit status.

Comparing a commit with itself (``--base HEAD --tip HEAD``) measures a commit with the same tree made
for the purpose (``git commit-tree``, on no branch): asv needs two commits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BENCH_MODULE", "DEFAULT_FACTOR", "benchmark_names", "selection_pattern", "names_pattern", "split_rounds",
    "median_interval", "Comparison", "compare", "read_samples", "format_table", "gate_command",
    "baseline_command", "main",
]

#: The asv module (file ``bench/<name>.py``) that holds the gate's benchmarks.
BENCH_MODULE = "bench_gate"
#: The slowdown (median of the per-round tip/base ratios) at or above which a benchmark can be flagged.
DEFAULT_FACTOR = 1.1
#: The confidence the interval of the median per-round ratio aims at (reached from 5 rounds on).
CONFIDENCE = 0.9

_BENCHMARK_PREFIXES = ("time_", "timeraw_", "mem_", "peakmem_", "track_")


def benchmark_names(classes: Iterable[type], module: str = BENCH_MODULE) -> list[str]:
    """asv's names (``module.Class.method``) of the benchmarks of ``classes``."""
    return sorted(
        f"{module}.{cls.__name__}.{name}"
        for cls in classes
        for name in dir(cls)
        if name.startswith(_BENCHMARK_PREFIXES) and callable(getattr(cls, name))
    )


def selection_pattern(classes: Iterable[type], module: str = BENCH_MODULE) -> str:
    """The ``asv -b`` regular expression that selects exactly the benchmarks of ``classes``."""
    names = sorted({cls.__name__ for cls in classes})
    if not names:
        raise ValueError("no benchmark classes to select")
    return rf"^{re.escape(module)}\.(?:{'|'.join(map(re.escape, names))})\."


def names_pattern(names: Iterable[str]) -> str:
    """The ``asv -b`` regular expression that selects exactly the benchmarks named ``names``."""
    names = sorted(set(names))
    if not names:
        raise ValueError("no benchmark names to select")
    return rf"^(?:{'|'.join(map(re.escape, names))})$"


# -- the statistics ---------------------------------------------------------------------------------


def split_rounds(samples: Sequence[float], rounds: int) -> list[list[float]]:
    """``samples`` (in the order asv recorded them: round after round) cut into ``rounds`` equal rounds.
    ValueError if they do not divide evenly (a benchmark whose samples per round vary cannot be paired)."""
    if rounds < 1 or not samples or len(samples) % rounds:
        raise ValueError(f"{len(samples)} samples do not split into {rounds} rounds of equal size")
    n = len(samples) // rounds
    return [list(samples[k * n:(k + 1) * n]) for k in range(rounds)]


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(low, high, achieved confidence): the widest-needed order-statistic interval ``[v_(k), v_(n+1-k)]``
    of the sorted ``values`` that holds their population median with at least ``confidence``
    (distribution-free: the count of values below the median is Binomial(n, 1/2)); ``[min, max]`` when
    even that falls short, with its own confidence ``1 - 2 / 2**n``."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("no values")

    def coverage(k: int) -> float:  # P(v_(k) <= median <= v_(n+1-k))
        tail = sum(math.comb(n, i) for i in range(k)) / 2**n
        return 1 - 2 * tail

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k], coverage(k)


@dataclass(frozen=True)
class Comparison:
    """One gated benchmark, base against tip."""

    name: str
    #: "slower", "suspect" (to be confirmed), "same", "faster", "failed on tip", "failed", "skipped", "new"
    status: str
    base: float | None = None  #: median of all the base's samples (seconds)
    tip: float | None = None
    ratio: float | None = None  #: median over the rounds of (tip median / base median) of the round
    low: float | None = None  #: the interval of that median (see median_interval)
    high: float | None = None
    confidence: float | None = None
    rounds: int = 0

    @property
    def flagged(self) -> bool:
        """Whether this benchmark counts against the tip as it stands."""
        return self.status in ("slower", "failed on tip")

    @property
    def to_confirm(self) -> bool:
        """Whether a second run should measure it again (a suspect, or a failure of the tip alone)."""
        return self.status in ("suspect", "failed on tip")


def compare(name: str, base: list[float] | float | None, tip: list[float] | float | None, rounds: int,
            factor: float, *, confirming: bool = False) -> Comparison:
    """Compare ``base`` and ``tip`` samples of one benchmark (a list: the samples; NaN: skipped; None:
    failed). See the module docstring for the rule; ``confirming``: these are the first run's rounds and
    the second's together, and a suspect is slower."""

    def state(samples: list[float] | float | None) -> str:
        if samples is None:
            return "failed"
        if isinstance(samples, float):
            return "skipped"
        return "ok" if samples else "failed"

    b_state, t_state = state(base), state(tip)
    if b_state == "skipped" and t_state == "skipped":
        return Comparison(name, "skipped")
    if t_state != "ok":
        return Comparison(name, "failed on tip" if b_state == "ok" else "failed")
    if b_state != "ok":
        return Comparison(name, "new")
    assert isinstance(base, list) and isinstance(tip, list)
    base_rounds, tip_rounds = split_rounds(base, rounds), split_rounds(tip, rounds)
    ratios = [statistics.median(t) / statistics.median(b) for b, t in zip(base_rounds, tip_rounds)]
    ratio = statistics.median(ratios)
    low, high, confidence = median_interval(ratios)
    if low >= factor:
        status = "slower"
    elif confirming and ratio >= factor and low > 1.0:
        status = "slower"
    elif not confirming and ratio >= factor and sum(r <= 1.0 for r in ratios) <= len(ratios) // 4:
        status = "suspect"
    elif high <= 1 / factor:
        status = "faster"
    else:
        status = "same"
    return Comparison(name, status, statistics.median(base), statistics.median(tip), ratio, low, high, confidence, rounds)


def _results_dir(config: str) -> Path:
    """The ``results_dir`` of the asv configuration file ``config`` (JSON with ``//`` comments)."""
    path = Path(config)
    text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("//"))
    return (path.parent / json.loads(text).get("results_dir", "results")).resolve()


def read_samples(results_dir: Path, commit: str) -> dict[str, list[float] | float | None]:
    """The samples asv recorded for ``commit`` (full hash) in its newest result file: benchmark name ->
    list of samples, NaN (skipped) or None (failed). {} when there is no result file. Parametrized
    benchmarks are not read (the gated ones have no parameters)."""
    files = sorted(results_dir.glob(f"*/{commit[:8]}-*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        return {}
    data = json.loads(files[-1].read_text())
    columns = data.get("result_columns") or []
    out: dict[str, list[float] | float | None] = {}
    for name, entry in data.get("results", {}).items():
        record = dict(zip(columns, entry))
        if record.get("params"):
            continue
        result, samples = record.get("result"), record.get("samples")
        value = result[0] if isinstance(result, list) and result else None
        if value is None:
            out[name] = None
        elif isinstance(value, float) and math.isnan(value):
            out[name] = math.nan
        else:
            out[name] = [float(s) for s in (samples[0] if samples and samples[0] else [])]
    return out


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.2f}"


def format_table(comparisons: Sequence[Comparison]) -> str:
    """A plain-text table of the comparisons."""
    header = ("benchmark", "base ms", "tip ms", "slowdown", "interval", "status")
    rows = [header]
    for c in comparisons:
        interval = "" if c.low is None else f"[{c.low:.3f}, {c.high:.3f}] @{c.confidence:.0%} of {c.rounds} rounds"
        rows.append((c.name, _ms(c.base), _ms(c.tip), "" if c.ratio is None else f"{c.ratio:.3f}x", interval, c.status))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


# -- running asv ------------------------------------------------------------------------------------


def gate_command(asv: Sequence[str], base: str, tip: str, pattern: str, factor: float, rounds: int,
                 append: bool = False) -> list[str]:
    """``asv continuous`` of the gated benchmarks, base against tip, rounds interleaved, samples recorded
    (``append``: added to the previous run's); the forkserver imports torch and the benchmarks once per
    round, not once per benchmark."""
    return [*asv, "continuous", "--interleave-rounds", *(["--append-samples"] if append else []), "--factor", str(factor),
            "--split", "--show-stderr", "--launch-method", "forkserver", "--attribute", f"rounds={rounds}", "--bench",
            pattern, base, tip]


def baseline_command(asv: Sequence[str], tip: str, pattern: str) -> list[str]:
    """``asv run`` of the baseline benchmarks for the tip commit only."""
    return [*asv, "run", "--show-stderr", "--launch-method", "forkserver", "--bench", pattern, f"{tip}^!"]


def _asv_executable() -> list[str]:
    return [sys.executable, "-m", "asv"]


def _run_echoed(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd``, echoing its output as it comes; (exit status, the output)."""
    lines = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
    return proc.returncode, "".join(lines)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout.strip()


def _resolve(base: str, tip: str) -> tuple[str, str, str | None]:
    """(base hash, tip hash, a note): the tip is replaced by a commit of the same tree when both name the
    same commit, since asv compares two commits."""
    base_hash, tip_hash = _git("rev-parse", f"{base}^{{commit}}"), _git("rev-parse", f"{tip}^{{commit}}")
    if base_hash != tip_hash:
        return base_hash, tip_hash, None
    copy = _git("commit-tree", f"{tip_hash}^{{tree}}", "-p", tip_hash, "-m", "asv-gate: the same tree, to compare a commit with itself")
    return base_hash, copy, f"{base} and {tip} are one commit: comparing {base_hash[:8]} with {copy[:8]}, a commit of the same tree"


Runner = Callable[[list[str]], "tuple[int, str]"]
Resolver = Callable[[str, str], "tuple[str, str, str | None]"]


def _compare_all(names: list[str], results_dir: Path, base: str, tip: str, rounds: int, factor: float,
                 confirming: bool = False) -> list[Comparison]:
    base_samples, tip_samples = read_samples(results_dir, base), read_samples(results_dir, tip)
    comparisons = []
    for name in names:
        b, t, r = base_samples.get(name), tip_samples.get(name), rounds
        if isinstance(b, list) and isinstance(t, list) and b and t and len(b) != len(t):
            # A side that failed in the first run has only the second run's rounds: compare those.
            keep = min(len(b), len(t))
            b, t, r = b[-keep:], t[-keep:], rounds * keep // max(len(b), len(t))
        try:
            comparisons.append(compare(name, b, t, r, factor, confirming=confirming))
        except ValueError as exc:  # samples that do not split into rounds: the gate cannot pair them
            print(f"asv-gate: {name}: {exc}", flush=True)
            comparisons.append(Comparison(name, "failed"))
    return comparisons


def main(argv: Sequence[str] | None = None, run: Runner | None = None, resolve: Resolver | None = None) -> int:
    """Run the gate; return its exit status (see the module docstring). ``run`` executes a command and
    returns (status, output), ``resolve`` turns the two commit names into hashes (tests pass fakes)."""
    from bench import bench_gate

    parser = argparse.ArgumentParser(prog="python -m tools.asv_gate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="main", help="the commit (or branch) to compare against (default: main)")
    parser.add_argument("--tip", default="HEAD", help="the commit measured against it (default: HEAD)")
    parser.add_argument("--factor", type=float, default=DEFAULT_FACTOR,
                        help=f"the slowdown (median per-round ratio) needed to flag a benchmark (default: {DEFAULT_FACTOR})")
    parser.add_argument("--rounds", type=int, default=bench_gate.ROUNDS,
                        help=f"interleaved rounds per commit (default: {bench_gate.ROUNDS})")
    parser.add_argument("--config", default="asv.conf.json", help="asv's configuration file (default: asv.conf.json)")
    parser.add_argument("--no-baselines", action="store_true", help="do not record the baselines afterwards")
    parser.add_argument("--no-confirm", action="store_true",
                        help="fail on the first run's flags, without measuring flagged benchmarks again")
    parser.add_argument("--list", action="store_true", help="print the gated benchmarks and the baselines, run nothing")
    args = parser.parse_args(argv)
    if args.factor <= 1.0:
        parser.error(f"--factor must be above 1, got {args.factor}")
    if args.rounds < 2:
        parser.error(f"--rounds must be at least 2 (rounds are what the gate pairs), got {args.rounds}")

    gated_names = benchmark_names(bench_gate.GATED)
    if args.list:
        print(f"gated (timing {bench_gate.GATED_IMPL}; decide the exit status):")
        print("\n".join(f"  {name}" for name in gated_names))
        print("baselines (recorded for the tip, outside the verdict):")
        print("\n".join(f"  {name}" for name in benchmark_names(bench_gate.BASELINES)))
        return 0

    run = run or _run_echoed
    base, tip, note = (resolve or _resolve)(args.base, args.tip)
    if note:
        print(f"asv-gate: {note}", flush=True)
    results_dir = _results_dir(args.config)
    asv = _asv_executable()
    run([*asv, "machine", "--yes"])
    print(f"asv-gate: timing {bench_gate.GATED_IMPL} ({os.environ.get('BENCH_IMPL') and 'BENCH_IMPL' or 'default'}), "
          f"{args.rounds} interleaved rounds of {bench_gate.SAMPLES_PER_ROUND} samples per commit", flush=True)
    status, _ = run(gate_command(asv, base, tip, selection_pattern(bench_gate.GATED), args.factor, args.rounds))
    comparisons = _compare_all(gated_names, results_dir, base, tip, args.rounds, args.factor, confirming=args.no_confirm)
    print("asv-gate: " + ("first run" if not args.no_confirm else "run") + "\n" + format_table(comparisons), flush=True)
    suspects = [c.name for c in comparisons if c.to_confirm]
    if suspects and not args.no_confirm:
        print(f"asv-gate: measuring {', '.join(suspects)} again; their samples are added to the first run's", flush=True)
        run(gate_command(asv, base, tip, names_pattern(suspects), args.factor, args.rounds, append=True))
        again = {c.name: c for c in _compare_all(suspects, results_dir, base, tip, 2 * args.rounds, args.factor, confirming=True)}
        print("asv-gate: both runs' rounds together\n" + format_table(list(again.values())), flush=True)
        comparisons = [again.get(c.name, c) for c in comparisons]
    flagged = [c.name for c in comparisons if c.flagged]
    failed = [c.name for c in comparisons if c.status == "failed"]
    if flagged:
        details = [f"{c.name} {c.ratio:.2f}x" if c.ratio is not None else f"{c.name} ({c.status})"
                   for c in comparisons if c.name in flagged]
        verdict, code = f"slower: {', '.join(details)}", 1
    elif failed:
        verdict, code = f"cannot judge (no samples on either commit: {', '.join(failed)}; asv exit {status})", 2
    else:
        verdict, code = f"no slowdown of {args.factor}x or more", 0
    print(f"asv-gate: {args.base} -> {args.tip}: {verdict} (exit {code})", flush=True)
    if not args.no_baselines:
        baseline_status, _ = run(baseline_command(asv, tip, selection_pattern(bench_gate.BASELINES)))
        if baseline_status != 0:
            print(f"asv-gate: recording the baselines failed (exit {baseline_status}); the verdict stands", flush=True)
    return code


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
