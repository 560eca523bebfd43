"""The conformance report: requirement ID x implementation, from a run of the suite or its JSON.

    python -m tools.report run [--world-size 1,2] [--impl reference,torch] [--format table] [-- PYTEST_ARGS]
    torchrun --nproc-per-node 8 -m tools.report run --impl torch      # the ranks of a job; rank 0 prints
    python -m tools.report show RESULTS.json [--format table|markdown|json]
    python -m tools.report diff BASE.json NEW.json [--impl NAME] [--base-impl NAME]

``run`` runs ``pytest conformance`` with ``--report-json``, prints the table and exits with pytest's
status. A cell says what the tests naming that ID did against that implementation: ``pass (n)``,
``FAIL m/n``, ``xfail (n): reason``, ``skip: reason``; ``-`` when no test of the run covered it.

``diff`` compares two saved runs test by test and prints, per requirement ID, what changed: newly
failing, fixed, failing differently (another exception or message on some rank) and newly skipped,
with the messages. It exits 1 when anything newly fails, so a fork's CI can run it against its last
good run, or (``--impl myfork --base-impl torch``) against the torch column of a run of upstream.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate

__all__ = ["Cell", "Change", "summarize", "render", "diff", "render_diff", "main"]

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


# -- diff of two runs ------------------------------------------------------------------------------

#: Outcomes that count as failing in a diff: a known deviation (xfailed) fails too, as it did.
_FAILING = {"failed", "error", "xfailed"}
_PASSING = {"passed", "xpassed"}
#: Parts of a message that change from run to run without meaning anything: addresses, temp dirs.
_NOISE = re.compile(r"0x[0-9a-fA-F]+|/tmp/[^\s'\"]+|\b\d+\.\d+s\b")


@dataclass(frozen=True)
class Change:
    """One test whose result differs between two runs."""

    kind: str  # "newly failing", "fixed", "failing differently", "newly skipped"
    nodeid: str  # as in the new run
    before: str  # the outcome in the base run ("absent" if it did not run there)
    after: str
    reqs: tuple[str, ...]
    messages: tuple[str, ...]  # what the new run's failing ranks said (or why it skipped)
    before_messages: tuple[str, ...] = ()


KINDS = ("newly failing", "failing differently", "fixed", "newly skipped")


def _failure_lines(test: dict[str, Any]) -> tuple[str, ...]:
    failures = test.get("failures") or []
    if failures:
        lines = []
        for failure in failures:
            where = "controller" if failure.get("rank") is None else f"rank {failure['rank']}"
            first = (failure.get("message") or "").strip().splitlines()
            lines.append(f"{where}: {failure.get('type')}: {first[0] if first else ''}")
        return tuple(lines)
    return (test.get("reason") or "",) if test.get("reason") else ()


def _signature(test: dict[str, Any]) -> tuple[str, ...]:
    return tuple(_NOISE.sub("<>", line) for line in _failure_lines(test))


def _translate(nodeid: str, impl: str | None, from_name: str | None, to_name: str | None) -> str:
    if impl is None or not from_name or not to_name or from_name == to_name:
        return nodeid
    from conformance.harness.xfails import as_run_by

    return as_run_by(nodeid, from_name, to_name)


def diff(base: dict[str, Any], new: dict[str, Any], *, impl: str | None = None, base_impl: str | None = None) -> list[Change]:
    """Tests whose result changed from ``base`` to ``new``. With ``impl``, only the new run's tests of
    that implementation (and of none: harness tests), matched to the base run's tests of ``base_impl``
    (default: the same name) by reading the adapter's id segment as ``base_impl``'s."""
    base_impl = base_impl or impl
    changes = []
    for nodeid, test in new["tests"].items():
        if test.get("outcome") is None or (impl is not None and test.get("impl") not in (impl, None)):
            continue
        base_id = _translate(nodeid, test.get("impl"), impl, base_impl)
        before_test = base["tests"].get(base_id)
        before = before_test["outcome"] if before_test and before_test.get("outcome") else "absent"
        after = test["outcome"]
        kind = None
        if after in _FAILING and before not in _FAILING:
            kind = "newly failing"
        elif after in _PASSING and before in _FAILING:
            kind = "fixed"
        elif after in _FAILING and before in _FAILING and _signature(test) != _signature(before_test or {}):
            kind = "failing differently"
        elif after == "skipped" and before not in ("skipped", "absent"):
            kind = "newly skipped"
        if kind is None:
            continue
        changes.append(
            Change(
                kind=kind, nodeid=nodeid, before=before, after=after, reqs=tuple(test.get("reqs") or ()),
                messages=_failure_lines(test), before_messages=_failure_lines(before_test or {}),
            )
        )
    return changes


def render_diff(changes: list[Change], spec_order: Sequence[str] = ()) -> str:
    """Changes grouped by requirement ID (SPEC order), then by kind; a summary line last."""
    order = {req: i for i, req in enumerate(spec_order)}
    by_req: dict[str, list[Change]] = {}
    for change in changes:
        for req in change.reqs or ("(no requirement)",):
            by_req.setdefault(req, []).append(change)
    lines = []
    for req in sorted(by_req, key=lambda r: (order.get(r, len(order)), r)):
        lines.append(req)
        for kind in KINDS:
            for change in (c for c in by_req[req] if c.kind == kind):
                lines.append(f"  {kind}: {change.nodeid} ({change.before} -> {change.after})")
                if kind == "failing differently":
                    lines += [f"      was: {m}" for m in change.before_messages]
                    lines += [f"      now: {m}" for m in change.messages]
                elif kind != "fixed":
                    lines += [f"      {m}" for m in change.messages]
    counts = Counter(c.kind for c in changes)
    lines.append(", ".join(f"{counts[k]} {k}" for k in KINDS) + f" ({len(changes)} tests changed)")
    return "\n".join(lines)


def _load(path: Path) -> dict[str, Any]:
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"cannot read results {path}: {exc}") from None
    if not isinstance(payload, dict) or "tests" not in payload:
        raise SystemExit(f"{path} is not a --report-json result (no 'tests')")
    return payload


def _run(args: argparse.Namespace, pytest_args: Sequence[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="sdc-report-") as tmp:
        json_path = Path(tmp) / "results.json"
        cmd = [sys.executable, "-m", "pytest", "conformance", "-q", "-p", "no:cacheprovider", "--report-json", str(json_path)]
        if args.world_size:
            cmd += ["--world-size", args.world_size]
        for impl in args.impl:
            cmd += ["--impl", impl]
        cmd += list(pytest_args)
        status = subprocess.call(cmd, cwd=REPO_ROOT)
        if not json_path.exists():
            if _launched_rank() not in (None, 0):
                # Under torchrun rank 0 writes the results and prints the table; its exit status is the
                # verdict. This rank does not fail the job for failed tests, which would make torchrun
                # stop rank 0 before it printed.
                return 0 if status in (0, 1) else status
            print(f"pytest exited with status {status} before writing results", file=sys.stderr)
            return status or 1
        payload = json.loads(json_path.read_text(encoding="utf-8"))
        if args.save:
            Path(args.save).write_text(json.dumps(payload, indent=1), encoding="utf-8")
    print()
    print(render(payload, args.format))
    return status


def _launched_rank() -> int | None:
    """This process's rank in a torchrun/srun job, None outside one."""
    from conformance.harness.launch_env import detect

    try:
        env = detect(os.environ)
    except ValueError:
        return None
    return env.rank if env is not None else None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, pytest_args = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(prog="python -m tools.report", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the suite, then print the report")
    run.add_argument("--world-size", default=None, help="default 1,2; under torchrun the job's world size")
    run.add_argument("--impl", action="append", default=[])
    run.add_argument("--save", help="also keep the run's JSON here")
    show = sub.add_parser("show", help="print the report of a saved JSON result (--report-json)")
    show.add_argument("results", type=Path)
    for p in (run, show):
        p.add_argument("--format", choices=("table", "markdown", "json"), default="table")
    compare = sub.add_parser("diff", help="what changed between two saved results; exit 1 if anything newly fails")
    compare.add_argument("base", type=Path)
    compare.add_argument("new", type=Path)
    compare.add_argument("--impl", help="compare only this implementation's tests of the new run")
    compare.add_argument("--base-impl", help="...against this implementation's tests of the base run (default: --impl)")
    args = parser.parse_args(argv)
    if args.command == "run":
        return _run(args, pytest_args)
    if args.command == "diff":
        base, new = _load(args.base), _load(args.new)
        changes = diff(base, new, impl=args.impl, base_impl=args.base_impl)
        print(render_diff(changes, list(new.get("spec", {}))))
        return 1 if any(c.kind == "newly failing" for c in changes) else 0
    try:
        payload = json.loads(args.results.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        print(f"cannot read results {args.results}: {exc}", file=sys.stderr)
        return 2
    print(render(payload, args.format))
    return 0


if __name__ == "__main__":
    sys.exit(main())
