"""The benchmark comparison table: one row per workload; the reference and each implementation under
test against upstream and the raw limit.

    python -m tools.bench_table                          # latest asv result in .asv/results
    python -m tools.bench_table .asv/results --commit 1a2b3c4d
    python -m tools.bench_table bench.json               # pytest --benchmark-json=bench.json (make bench)
    python -m tools.bench_table bench.json --format markdown   # or plain, github, json

Columns: ``reference``; one column per implementation under test (any other adapter, named as
``BENCH_IMPL`` / ``make bench IMPL=...`` named it); ``upstream`` (torch; fairscale for
FlattenParamsWrapper, which torch lacks; fresh processes per test for the harness pool); ``raw``
(plain file I/O / plain module calls) and ``memcpy`` where measured; then, for the reference and each
implementation under test, ``<impl>/upstream`` and ``<impl>/raw``: its *speed* relative to each
(throughput ratio, or inverse time ratio), so that above 1 always means it is faster, whatever the
unit. For peak memory, above 1 means it uses less.

What counts as a figure: an asv benchmark with an ``impl`` parameter and no ``baseline`` parameter
(its other parameters name the workload; the ``*_speedup`` benchmarks, asv's own record of the same
ratios across commits, are not repeated), or a pytest-benchmark entry whose ``extra_info`` has
``impl`` (its group names the workload; ``extra_info["bytes"]`` turns seconds into MB/s, and
``extra_info["rank_seconds"]``, when present, replaces the controller's time with the ranks' own).
pytest-benchmark figures are the median of the rounds.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Row", "Table", "column_of", "from_pytest_benchmark", "from_asv", "load", "headers", "render", "main"]

#: Which column each implementation name goes to; any other name (an adapter under test) is a column
#: of its own, named as the implementation.
ROLES: dict[str, str] = {
    "reference": "reference",
    "pool": "reference",
    "torch": "upstream",
    "fairscale": "upstream",
    "fresh": "upstream",
    "raw": "raw",
    "memcpy": "memcpy",
}
#: Units where more is better; every other unit (seconds, us/key, x bytes loaded) is less-is-better.
HIGHER_IS_BETTER = {"MB/s"}
#: The baseline columns, in table order; the reference and the implementations under test come first.
BASELINE_COLUMNS = ("upstream", "raw", "memcpy")


def column_of(impl: str) -> str:
    """The column of an implementation: its role, or its own name for an implementation under test."""
    return ROLES.get(impl, impl)


@dataclass
class Row:
    """One workload: its figure for each column that was measured, in ``unit``."""

    workload: str
    unit: str
    values: dict[str, float] = field(default_factory=dict)  # column -> figure
    upstream_name: str | None = None  # which implementation filled the upstream column

    def ratio(self, baseline: str, subject: str = "reference") -> float | None:
        """The speed (or frugality) of ``subject`` relative to ``baseline``; > 1: ``subject`` is better."""
        mine, base = self.values.get(subject), self.values.get(baseline)
        if mine is None or base is None or not (math.isfinite(mine) and math.isfinite(base)) or mine <= 0 or base <= 0:
            return None
        return mine / base if self.unit in HIGHER_IS_BETTER else base / mine


@dataclass
class Table:
    rows: list[Row]
    caption: str  # where and when it was measured

    @property
    def subjects(self) -> list[str]:
        """The columns whose ratios are shown: the reference, then the implementations under test in the
        order they first appear."""
        names = ["reference"]
        for row in self.rows:
            for column in row.values:
                if column not in names and column not in BASELINE_COLUMNS:
                    names.append(column)
        return names

    @property
    def columns(self) -> list[str]:
        return [*self.subjects, *BASELINE_COLUMNS]

    @property
    def ratio_columns(self) -> list[tuple[str, str]]:
        """(subject, baseline) of every ratio column."""
        return [(subject, baseline) for subject in self.subjects for baseline in ("upstream", "raw")]


# -- pytest-benchmark ----------------------------------------------------------------------------------


def from_pytest_benchmark(data: dict[str, Any]) -> Table:
    """Rows from the JSON that ``pytest --benchmark-json`` writes."""
    rows: dict[tuple[str, str], Row] = {}

    def put(workload: str, unit: str, impl: str, value: float) -> None:
        row = rows.setdefault((workload, unit), Row(workload, unit))
        column = column_of(impl)
        row.values[column] = value
        if column == "upstream":
            row.upstream_name = impl

    for bench in data.get("benchmarks", []):
        extra = bench.get("extra_info") or {}
        impl = extra.get("impl") or (bench.get("params") or {}).get("impl")
        if impl is None:
            continue
        workload = bench.get("group") or bench["name"]
        # A figure the ranks timed themselves (without the controller's messaging) wins.
        seconds = float(extra.get("rank_seconds") or bench["stats"]["median"])
        if "bytes" in extra:
            put(workload, "MB/s", impl, extra["bytes"] / 2**20 / seconds)
        else:
            put(workload, "seconds", impl, seconds)
        if "peak_rss_ratio" in extra:
            put(f"{workload} peak memory", "x bytes loaded", impl, float(extra["peak_rss_ratio"]))
    machine = data.get("machine_info") or {}
    cpu = (machine.get("cpu") or {}).get("brand_raw") or machine.get("processor") or "unknown CPU"
    count = (machine.get("cpu") or {}).get("count")
    when = (data.get("datetime") or "")[:16].replace("T", " ")
    commit = (data.get("commit_info") or {}).get("id", "")[:8]
    caption = f"pytest-benchmark, {when} UTC on {machine.get('node', 'unknown')} ({cpu}" + (
        f", {count} CPUs)" if count else ")") + (f", commit {commit}" if commit else "") + "; median of the rounds"
    return Table(list(rows.values()), caption)


# -- asv ----------------------------------------------------------------------------------------------


def _latest_result(results_dir: Path, commit: str | None) -> Path:
    candidates = [
        p for p in results_dir.glob("*/*.json") if p.name != "machine.json" and (commit is None or p.name.startswith(commit[:8]))
    ]
    if not candidates:
        raise FileNotFoundError(f"no asv result{' for commit ' + commit if commit else ''} under {results_dir}")

    def started(p: Path) -> float:
        return float(json.loads(p.read_text()).get("date") or 0)

    return max(candidates, key=started)


def _param_value(text: str) -> str:
    """asv stores parameter values as their repr: ``'reference'`` -> ``reference``, ``2`` -> ``2``."""
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def from_asv(result: dict[str, Any], benchmarks: dict[str, Any]) -> Table:
    """Rows from one asv result file (``.asv/results/<machine>/<commit>-<env>.json``) and the
    ``benchmarks.json`` beside the machine directories (names, parameter names, units)."""
    columns = result.get("result_columns") or ["result", "params"]
    rows: dict[tuple[str, str], Row] = {}
    for name, entry in sorted(result.get("results", {}).items()):
        info = benchmarks.get(name)
        if info is None:
            continue
        record = dict(zip(columns, entry))
        param_names = info.get("param_names") or []
        if "impl" not in param_names or "baseline" in param_names:
            continue
        values = record.get("result")
        if values is None:
            continue
        params = record.get("params") or info.get("params") or []
        combos = list(itertools.product(*params)) if params else [()]
        if not isinstance(values, list):
            values = [values]
        unit = "seconds" if info.get("type") == "time" else info.get("unit") or ""
        short = name.split(".")[-1].removeprefix("track_").removeprefix("time_")
        for combo, value in zip(combos, values):
            if value is None or not math.isfinite(float(value)):  # asv records a skip or failure as NaN/None
                continue
            named = dict(zip(param_names, (_param_value(p) for p in combo)))
            impl = named.pop("impl")
            label = f"{short} " + " ".join(f"{k}={v}" for k, v in named.items())
            row = rows.setdefault((label, unit), Row(label.strip(), unit))
            column = column_of(impl)
            row.values[column] = float(value)
            if column == "upstream":
                row.upstream_name = impl
    machine = result.get("params") or {}
    when = datetime.datetime.fromtimestamp((result.get("date") or 0) / 1000, datetime.timezone.utc)
    ram = machine.get("ram")
    ram_text = f", {int(str(ram)) / 2**30:.0f} GB RAM" if str(ram or "").isdigit() else ""
    caption = (
        f"asv, {when:%Y-%m-%d %H:%M} UTC on {machine.get('machine', 'unknown')} ({machine.get('cpu', 'unknown CPU')}, "
        f"{machine.get('num_cpu', '?')} CPUs{ram_text}), commit {str(result.get('commit_hash', ''))[:8]}, "
        f"{result.get('env_name', '')}"
    )
    return Table(list(rows.values()), caption)


def load(source: Path, commit: str | None = None) -> Table:
    """A :class:`Table` from a pytest-benchmark JSON, an asv result JSON, or an asv results directory."""
    if source.is_dir():
        path = _latest_result(source, commit)
        return from_asv(json.loads(path.read_text()), _asv_benchmarks(path.parent.parent))
    data = json.loads(source.read_text())
    if "benchmarks" in data and isinstance(data["benchmarks"], list):
        return from_pytest_benchmark(data)
    if "results" in data:
        return from_asv(data, _asv_benchmarks(source.parent.parent))
    raise ValueError(f"{source}: neither a pytest-benchmark JSON (no 'benchmarks' list) nor an asv result (no 'results')")


def _asv_benchmarks(results_dir: Path) -> dict[str, Any]:
    path = results_dir / "benchmarks.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: asv writes it with the results (run `asv run` first)")
    return json.loads(path.read_text())


# -- output -------------------------------------------------------------------------------------------


def _fmt(value: float | None) -> str:
    if value is None:
        return ""
    if value == 0 or not math.isfinite(value):
        return str(value)
    digits = max(0, 2 - int(math.floor(math.log10(abs(value)))))
    return f"{value:,.{digits}f}"


def _cells(table: Table, row: Row) -> list[str]:
    workload = row.workload
    if row.upstream_name not in (None, "torch"):
        workload += f" [upstream: {row.upstream_name}]"
    return [workload, row.unit, *(_fmt(row.values.get(c)) for c in table.columns),
            *(_fmt(row.ratio(baseline, subject)) for subject, baseline in table.ratio_columns)]


def headers(table: Table) -> list[str]:
    """The table's column headings: workload, unit, the figures, then ``<impl>/<baseline>`` ratios."""
    return ["workload", "unit", *table.columns, *(f"{subject}/{baseline}" for subject, baseline in table.ratio_columns)]


def render(table: Table, fmt: str = "plain") -> str:
    """The table as text (``plain``, ``github``, ``markdown``, any tabulate format) or ``json``."""
    if fmt == "json":
        return json.dumps(
            {"caption": table.caption, "rows": [
                {"workload": r.workload, "unit": r.unit, "upstream_impl": r.upstream_name, **r.values,
                 **{f"{subject}/{baseline}": r.ratio(baseline, subject) for subject, baseline in table.ratio_columns}}
                for r in table.rows]},
            indent=2,
        )
    from tabulate import tabulate

    tablefmt = "github" if fmt == "markdown" else fmt
    heads = headers(table)
    body = tabulate([_cells(table, r) for r in table.rows], headers=heads, tablefmt=tablefmt, disable_numparse=True,
                    colalign=("left", "left") + ("right",) * (len(heads) - 2))
    note = ("<impl>/upstream, <impl>/raw: the speed of the reference (or implementation under test) relative to "
            "each (> 1: faster; memory: uses less)")
    if fmt == "markdown":
        return f"{table.caption}\n\n{body}\n\n{note}\n"
    return f"{table.caption}\n{body}\n{note}\n"


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?", default=".asv/results", type=Path,
                        help="asv results directory or result JSON, or a pytest-benchmark JSON (default: .asv/results)")
    parser.add_argument("--commit", help="asv: the commit (hash prefix) to show; default: the latest result")
    parser.add_argument("--format", default="plain", help="plain, github, markdown, json, or any tabulate format")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        table = load(args.source, args.commit)
    except (OSError, ValueError) as exc:
        print(f"bench_table: {exc}", file=sys.stderr)
        return 2
    if not table.rows:
        print(f"bench_table: {args.source} holds no figures with an implementation (impl) to compare", file=sys.stderr)
        return 1
    sys.stdout.write(render(table, args.format))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
