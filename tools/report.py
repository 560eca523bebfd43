"""The conformance report: requirement ID x implementation, from a run of the suite or its JSON.

    python -m tools.report run [--world-size 1,2] [--impl reference,torch] [--format table] [-- PYTEST_ARGS]
    python -m tools.report show RESULTS.json [--format table|markdown|json]

``run`` runs ``pytest conformance`` with ``--report-json``, prints the table and exits with pytest's
status. A cell says what the tests naming that ID did against that implementation: ``pass (n)``,
``FAIL m/n``, ``xfail (n): reason``, ``skip: reason``; ``-`` when no test of the run covered it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from tabulate import tabulate

__all__ = ["Cell", "summarize", "render", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Cell:
    """What the tests naming one requirement did against one implementation."""

    counts: Counter = field(default_factory=Counter)
    reasons: dict[str, Counter] = field(default_factory=dict)

    def add(self, outcome: str, reason: str) -> None:
        self.counts[outcome] += 1
        if reason:
            self.reasons.setdefault(outcome, Counter())[reason] += 1

    @property
    def status(self) -> str:
        """fail, xpass, pass, xfail, skip: the worst outcome wins, then the one that says most."""
        c = self.counts
        if c["failed"] or c["error"]:
            return "fail"
        if c["passed"] or c["xpassed"]:
            return "pass" if not c["xfailed"] else "partial"
        if c["xfailed"]:
            return "xfail"
        return "skip"

    def _reason(self, outcome: str) -> str:
        reasons = self.reasons.get(outcome)
        return reasons.most_common(1)[0][0] if reasons else ""

    def text(self, width: int = 45) -> str:
        c = self.counts
        total = sum(c.values())
        status = self.status
        if status == "fail":
            return f"FAIL {c['failed'] + c['error']}/{total}"
        if status == "pass":
            return f"pass ({c['passed'] + c['xpassed']})"
        if status == "partial":
            return f"pass ({c['passed']}), xfail ({c['xfailed']}): {self._reason('xfailed')[:width]}"
        if status == "xfail":
            return f"xfail ({c['xfailed']}): {self._reason('xfailed')[:width]}"
        return f"skip: {self._reason('skipped')[:width]}"

    def as_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "counts": dict(self.counts),
            "reasons": {k: dict(v) for k, v in self.reasons.items()},
        }


def summarize(payload: dict[str, Any]) -> tuple[list[str], list[str], dict[tuple[str, str], Cell]]:
    """(requirement IDs in SPEC order, implementation names, (id, impl) -> Cell) of one run's JSON."""
    spec: dict[str, str] = payload["spec"]
    impls: list[str] = list(payload["impls"])
    cells: dict[tuple[str, str], Cell] = {}
    for _nodeid, test in payload["tests"].items():
        if test["outcome"] is None:
            continue
        for req in test["reqs"]:
            for impl in _targets(test["impl"], impls):
                cells.setdefault((req, impl), Cell()).add(test["outcome"], test["reason"])
    return list(spec), impls, cells


def _targets(impl: str | None, impls: list[str]) -> list[str]:
    """The columns a test's outcome counts in: its implementation; a test of no implementation checks
    the harness (HX-*: the plugin refuses a capability test without ``impl`` in the suite) and counts
    for every column."""
    return [impl] if impl else impls


def render(payload: dict[str, Any], fmt: str = "table") -> str:
    """The report of one run in ``fmt`` (table, markdown or json)."""
    req_ids, impls, cells = summarize(payload)
    if fmt == "json":
        return json.dumps(
            {
                "torch": payload.get("torch"),
                "world_sizes": payload.get("world_sizes"),
                "impls": impls,
                "requirements": {
                    req: {impl: cells[(req, impl)].as_json() if (req, impl) in cells else None for impl in impls}
                    for req in req_ids
                },
            },
            indent=1,
        )
    rows = [[req] + [cells[(req, impl)].text() if (req, impl) in cells else "-" for impl in impls] for req in req_ids]
    totals = Counter(cell.status for cell in cells.values())
    table = tabulate(rows, headers=["requirement", *impls], tablefmt="github" if fmt == "markdown" else "simple")
    header = (
        f"torch {payload.get('torch')}, world sizes {payload.get('world_sizes')}, backend {payload.get('backend')}"
    )
    footer = ", ".join(f"{n} {status}" for status, n in sorted(totals.items()))
    note = "'-': no test of this run names it (some, like HX-*, are checked by the self-tests in tests/, run by `make test`)"
    return f"{header}\n\n{table}\n\ncells: {footer}\n{note}"


def _run(args: argparse.Namespace, pytest_args: Sequence[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="sdc-report-") as tmp:
        json_path = Path(tmp) / "results.json"
        cmd = [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider",
               "--world-size", args.world_size, "--report-json", str(json_path)]
        for impl in args.impl:
            cmd += ["--impl", impl]
        cmd += list(pytest_args)
        status = subprocess.call(cmd, cwd=REPO_ROOT)
        if not json_path.exists():
            print(f"pytest exited with status {status} before writing results", file=sys.stderr)
            return status or 1
        payload = json.loads(json_path.read_text(encoding="utf-8"))
        if args.save:
            Path(args.save).write_text(json.dumps(payload, indent=1), encoding="utf-8")
    print()
    print(render(payload, args.format))
    return status


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, pytest_args = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(prog="python -m tools.report", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the suite, then print the report")
    run.add_argument("--world-size", default="1,2")
    run.add_argument("--impl", action="append", default=[])
    run.add_argument("--save", help="also keep the run's JSON here")
    show = sub.add_parser("show", help="print the report of a saved JSON result (--report-json)")
    show.add_argument("results", type=Path)
    for p in (run, show):
        p.add_argument("--format", choices=("table", "markdown", "json"), default="table")
    args = parser.parse_args(argv)
    if args.command == "run":
        return _run(args, pytest_args)
    try:
        payload = json.loads(args.results.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        print(f"cannot read results {args.results}: {exc}", file=sys.stderr)
        return 2
    print(render(payload, args.format))
    return 0


if __name__ == "__main__":
    sys.exit(main())
