"""The benchmark regression gate: is the tip commit's reference slower than the base commit's?

    python -m tools.asv_gate --base main --tip HEAD        # what `make asv-gate BASE=main` runs
    python -m tools.asv_gate --base main --list            # the gated benchmarks and the baselines

It runs ``asv continuous --interleave-rounds`` on the gated benchmarks only (``bench/bench_gate.py``:
``GATED``, reference code, one class per capability), with a slowdown factor and asv's significance
test, and exits with asv's verdict: 0 when no gated benchmark got significantly slower, non-zero when
one did (or failed). Then, unless ``--no-baselines``, it records the baselines (``BASELINES``: torch,
fairscale and raw on the same workloads) for the tip commit with ``asv run``; their outcome is printed
and never changes the exit status, since upstream and the raw limit do not change between two commits
of this project.

Why these settings: asv flags a benchmark when its median moved by more than ``--factor`` *and* the
two commits' samples differ by a Mann-Whitney U test at p < 0.002. That test can only reach p < 0.002
with at least 7 samples per commit (:func:`min_samples_for_significance`); the gated classes take 5
to 10 per round in 4 rounds. Interleaving the rounds (base, tip, tip, base, ...) spreads the machine's
load over both commits alike, so a busy minute does not land on one of them. The factor (1.5) is
what load swings on a shared 2-core machine still produced between identical commits; a 2x slowdown
clears it.

A benchmark flagged slower is measured again, alone, by a second interleaved run (``--no-confirm``
skips it): the gate fails only for benchmarks flagged by both. A burst of load from another job that
made one benchmark look slower once is unlikely to do it again, minutes later, to the same one; a
real slowdown is there every time.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "BENCH_MODULE", "benchmark_names", "selection_pattern", "names_pattern", "min_samples_for_significance",
    "samples_per_commit", "worsened_benchmarks", "gate_command", "baseline_command", "main",
]

#: The asv module (file ``bench/<name>.py``) that holds the gate's benchmarks.
BENCH_MODULE = "bench_gate"
#: The slowdown asv must see (median tip / median base) before it can flag a benchmark.
DEFAULT_FACTOR = 1.5
#: asv's significance threshold (``asv._stats.is_different``).
P_THRESHOLD = 0.002

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


def worsened_benchmarks(asv_output: str) -> list[str]:
    """The benchmarks that ``asv continuous``'s table marks as worse: ``+`` (slower by more than the
    factor, and significantly) or ``!`` (fails on the tip, not on the base)."""
    names = []
    for line in asv_output.splitlines():
        if not line.lstrip().startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0] in ("+", "!"):
            names.append(cells[-1].split(" ")[0])
    return names


def min_samples_for_significance(p_threshold: float = P_THRESHOLD) -> int:
    """The fewest samples per commit (equal on both sides) with which asv's two-sided Mann-Whitney U
    test can reach ``p < p_threshold`` (its smallest p is ``2 / C(2n, n)``): below it no difference is
    ever significant, however large."""
    n = 1
    while 2 / math.comb(2 * n, n) >= p_threshold:
        n += 1
    return n


def samples_per_commit(cls: type) -> int:
    """The fewest samples asv takes of each benchmark of ``cls`` for one commit (all rounds)."""
    repeat = getattr(cls, "repeat", 0)
    min_repeat = repeat[0] if isinstance(repeat, tuple) else (repeat or 1)
    return int(min_repeat) * int(getattr(cls, "rounds", 2))


def gate_command(asv: Sequence[str], base: str, tip: str, pattern: str, factor: float) -> list[str]:
    """``asv continuous`` of the gated benchmarks, base against tip, rounds interleaved."""
    return [*asv, "continuous", "--interleave-rounds", "--factor", str(factor), "--split", "--show-stderr",
            "--bench", pattern, base, tip]


def baseline_command(asv: Sequence[str], tip: str, pattern: str) -> list[str]:
    """``asv run`` of the baseline benchmarks for the tip commit only."""
    return [*asv, "run", "--show-stderr", "--bench", pattern, f"{tip}^!"]


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


Runner = Callable[[list[str]], "tuple[int, str]"]


def main(argv: Sequence[str] | None = None, run: Runner | None = None) -> int:
    """Run the gate; return its exit status: 0, or 1 when a gated benchmark got slower (confirmed), or
    asv's own status when it failed otherwise. ``run`` executes a command and returns (status, output)
    (tests pass a fake)."""
    from bench import bench_gate

    parser = argparse.ArgumentParser(prog="python -m tools.asv_gate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="main", help="the commit (or branch) to compare against (default: main)")
    parser.add_argument("--tip", default="HEAD", help="the commit measured against it (default: HEAD)")
    parser.add_argument("--factor", type=float, default=DEFAULT_FACTOR,
                        help=f"slowdown needed before a change can be flagged (default: {DEFAULT_FACTOR})")
    parser.add_argument("--no-baselines", action="store_true", help="do not record torch/raw baselines afterwards")
    parser.add_argument("--no-confirm", action="store_true",
                        help="fail on the first run's flags, without measuring flagged benchmarks again")
    parser.add_argument("--list", action="store_true", help="print the gated benchmarks and the baselines, run nothing")
    args = parser.parse_args(argv)
    if args.factor <= 1.0:
        parser.error(f"--factor must be above 1, got {args.factor}")

    too_few = [c.__name__ for c in bench_gate.GATED if samples_per_commit(c) < min_samples_for_significance()]
    if too_few:
        raise SystemExit(f"asv-gate: {', '.join(too_few)} take fewer than {min_samples_for_significance()} samples "
                         "per commit: asv's significance test could never flag them")
    gated = selection_pattern(bench_gate.GATED)
    baselines = selection_pattern(bench_gate.BASELINES)
    if args.list:
        print("gated (reference only; decide the exit status):")
        print("\n".join(f"  {name}" for name in benchmark_names(bench_gate.GATED)))
        print("baselines (recorded for the tip, outside the verdict):")
        print("\n".join(f"  {name}" for name in benchmark_names(bench_gate.BASELINES)))
        return 0

    run = run or _run_echoed
    asv = _asv_executable()
    run([*asv, "machine", "--yes"])
    status, output = run(gate_command(asv, args.base, args.tip, gated, args.factor))
    flagged = worsened_benchmarks(output)
    if status != 0 and flagged and not args.no_confirm:
        print(f"asv-gate: flagged {', '.join(flagged)}; measuring them again to confirm", flush=True)
        again, output = run(gate_command(asv, args.base, args.tip, names_pattern(flagged), args.factor))
        confirmed = sorted(set(flagged) & set(worsened_benchmarks(output)))
        if confirmed:
            status, flagged = 1, confirmed
        else:
            status = again if again != 1 else 0  # 1 is asv's "worse": here only for unflagged noise
            print(f"asv-gate: not confirmed by the second run: {', '.join(flagged)}", flush=True)
            flagged = []
    if status == 0:
        verdict = "no significant slowdown"
    elif flagged:
        verdict = f"slower: {', '.join(flagged)}"
    else:
        verdict = "asv failed"
    print(f"asv-gate: {args.base} -> {args.tip}: {verdict} (exit {status})", flush=True)
    if not args.no_baselines:
        baseline_status, _ = run(baseline_command(asv, args.tip, baselines))
        if baseline_status != 0:
            print(f"asv-gate: recording the baselines failed (exit {baseline_status}); the verdict stands", flush=True)
    return status


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
