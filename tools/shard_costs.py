"""Refresh the measured test costs the parts of a run are dealt by (``--shard K/N``,
:mod:`conformance.harness.shards`) from pytest's ``--durations`` output.

    make test PYTEST_ARGS="--durations=0 --durations-min=0" 2>&1 | tee run.log
    python -m tools.shard_costs run.log [more.log ...] [--update] [--out conformance/harness/shard_costs.json]

A test's cost is the sum of its phases (set-up, call, tear-down) in one log, and the mean over the
logs that list it. The table is written whole from the logs; ``--update`` keeps the entries of the
existing table that the logs do not measure (e.g. after a run of ``conformance/`` alone). Commit the
result: every part of a run deals by the same file. A stale table costs balance, never a test.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from conformance.harness.shards import COSTS_FILE, USUAL, load_costs, split_test_id

__all__ = ["dumps", "durations_of", "main", "table_of"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+::\S.*?)\s*$")


def durations_of(lines: Iterable[str]) -> dict[str, float]:
    """Seconds per test id in one run's ``--durations`` lines (``1.23s call     path::test[params]``),
    its phases summed; other lines are ignored."""
    seconds: dict[str, float] = {}
    for line in lines:
        found = _DURATION.match(line)
        if found:
            seconds[found.group(3)] = seconds.get(found.group(3), 0.0) + float(found.group(1))
    return seconds


def table_of(runs: Sequence[Mapping[str, float]], keep: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, object]:
    """The costs file's document from the seconds of several runs (a test's mean over the runs that
    measured it) over the entries ``keep`` (function -> params -> seconds) they do not measure:
    ``{"default_s": median cost, "tests": {function: {"*": its commonest cost, params: other costs}}}``,
    rounded to 10 ms, sorted."""
    totals: dict[str, list[float]] = {}
    for run in runs:
        for test_id, seconds in run.items():
            totals.setdefault(test_id, []).append(seconds)
    tests: dict[str, dict[str, float]] = {function: {p: s for p, s in params.items() if p != USUAL} for function, params in (keep or {}).items()}
    for test_id, measured in totals.items():
        function, params = split_test_id(test_id)
        tests.setdefault(function, {})[params] = round(sum(measured) / len(measured), 2)
    every = sorted(seconds for params in tests.values() for seconds in params.values())
    return {
        "default_s": every[len(every) // 2] if every else 1.0,
        "tests": {function: _with_usual(params) for function, params in sorted(tests.items()) if params},
    }


def _with_usual(params: Mapping[str, float]) -> dict[str, float]:
    """A function's costs as its commonest one under :data:`USUAL` and the others by their params."""
    usual = Counter(params.values()).most_common(1)[0][0]
    return {USUAL: usual, **{p: s for p, s in sorted(params.items()) if s != usual}}


def dumps(table: Mapping[str, object]) -> str:
    """The costs file's text: JSON with one line per test function (a refresh's diff shows what changed)."""
    tests = table["tests"]
    assert isinstance(tests, dict)
    lines = [f"{json.dumps(function)}: {json.dumps(params)}" for function, params in tests.items()]
    body = ",\n".join(lines)
    return f'{{"default_s": {json.dumps(table["default_s"])}, "tests": {{\n{body}\n}}}}\n'


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.shard_costs", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("logs", nargs="+", type=Path, help="pytest output with --durations=0 --durations-min=0 (one run per file)")
    parser.add_argument("--out", type=Path, default=COSTS_FILE, help="the table to write (default: the one the suite ships)")
    parser.add_argument("--update", action="store_true", help="keep the existing table's entries the logs do not measure")
    args = parser.parse_args(argv)
    runs = [durations_of(path.read_text(encoding="utf-8", errors="replace").splitlines()) for path in args.logs]
    empty = [str(path) for path, run in zip(args.logs, runs) if not run]
    if empty:
        raise SystemExit(f"no --durations lines in {', '.join(empty)} (run pytest with --durations=0 --durations-min=0)")
    keep = load_costs(args.out).tests if args.update else None
    table = table_of(runs, keep)
    args.out.write_text(dumps(table), encoding="utf-8")
    tests = table["tests"]
    assert isinstance(tests, dict)
    print(f"{args.out}: {sum(len(p) for p in tests.values())} tests of {len(tests)} functions, default {table['default_s']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
