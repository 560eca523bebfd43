"""The conformance report: requirement ID x implementation, from a run of the suite or its JSON.

    statedict-report run [--world-size 1,2] [--impl reference,torch] [--jobs 2] [--format table] [-- PYTEST_ARGS]
    torchrun --nproc-per-node 8 -m conformance.cli.report run --impl torch   # a job's ranks; rank 0 prints
    statedict-report show RESULTS.json [--format table|markdown|json]
    statedict-report diff BASE.json NEW.json [--impl NAME] [--base-impl NAME]

(``python -m conformance.cli.report``; in a checkout also ``python -m tools.report``.)

``run`` runs ``pytest --pyargs conformance`` (the suite this module belongs to, installed or in a
checkout) with ``--report-json``, prints the table and exits with pytest's status; ``--jobs N`` runs N
pytest processes at once, each a part of the tests (``--shard K/N``), and reports them as one run. A cell says what
the tests naming that ID did against that implementation: ``pass (n)``, ``FAIL m/n``, ``XPASS m/n``
(known deviations that passed, a failure of a strict run), ``xfail (n)``, ``skip``; ``-`` when no test
of the run covered it. Reasons are numbered and listed whole under the table, never cut.

``diff`` compares two saved runs test by test and prints, per requirement ID, what changed: newly
failing, failing differently (another outcome, exception or SPEC clause on some rank), no longer deviates
(a known deviation that passed: check it and remove or ``!``-cancel its entry), fixed (a failing test
that passes with no entry marking it) and newly skipped, with the messages. It exits 1 when anything
newly fails, fails differently, or no longer deviates in a strict run (the run itself failed for it:
``"strict": true`` in its result; an entry flagged ``flaky`` may pass without failing the run, and is
listed but does not fail the diff), so a fork's CI can run it against its last good run, or (``--impl
myfork --base-impl torch``) against the torch column of a run of upstream.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate

__all__ = ["Cell", "Legend", "Change", "KINDS", "GATE_KINDS", "summarize", "render", "diff", "render_diff", "gate_fails", "merge_payloads",
           "combined_status", "main"]


class Legend:
    """The numbered reasons of one table: each distinct reason gets one number, in order of first use."""

    def __init__(self) -> None:
        self._numbers: dict[str, int] = {}

    def ref(self, reason: str) -> str:
        """`` [n]`` for ``reason`` (numbered on first use); empty for no reason."""
        if not reason:
            return ""
        number = self._numbers.setdefault(reason, len(self._numbers) + 1)
        return f" [{number}]"

    def lines(self, width: int, markdown: bool = False) -> list[str]:
        """Every reason whole, wrapped at spaces to ``width`` columns (a word longer than that stays whole)."""
        out = []
        for reason, number in self._numbers.items():
            label = f"[{number}] "
            if markdown:
                out.append(f"- {label}{reason}")
                continue
            out += textwrap.wrap(reason, width=max(width, len(label) + 20), initial_indent=label,
                                 subsequent_indent=" " * len(label), break_long_words=False, break_on_hyphens=False)
        return out


@dataclass
class Cell:
    """What the tests naming one requirement did against one implementation."""

    counts: Counter = field(default_factory=Counter)
    reasons: dict[str, Counter] = field(default_factory=dict)

    def add(self, outcome: str, reason: str) -> None:
        """Count one test; ``outcome`` is the result's outcome, with ``xpassed-strict`` for a known
        deviation that passed in a strict run (a failure of that run)."""
        self.counts[outcome] += 1
        if reason:
            self.reasons.setdefault(outcome, Counter())[reason] += 1

    @property
    def status(self) -> str:
        """fail, xpass, pass, partial, xfail, skip: the worst outcome wins, then the one that says most."""
        c = self.counts
        if c["failed"] or c["error"]:
            return "fail"
        if c["xpassed-strict"]:
            return "xpass"
        if c["passed"] or c["xpassed"]:
            return "pass" if not c["xfailed"] else "partial"
        if c["xfailed"]:
            return "xfail"
        return "skip"

    def _reason(self, outcome: str) -> str:
        reasons = self.reasons.get(outcome)
        return reasons.most_common(1)[0][0] if reasons else ""

    def text(self, legend: Legend | None = None) -> str:
        """The cell: counts, and a reference to the most common reason in ``legend`` (a new legend, whose
        numbers are then lost, when none is given)."""
        legend = legend if legend is not None else Legend()
        c = self.counts
        total = sum(c.values())
        status = self.status
        if status == "fail":
            return f"FAIL {c['failed'] + c['error']}/{total}"
        if status == "xpass":
            return f"XPASS {c['xpassed-strict']}/{total}{legend.ref(self._reason('xpassed-strict'))}"
        if status == "pass":
            return f"pass ({c['passed'] + c['xpassed']})"
        if status == "partial":
            return f"pass ({c['passed'] + c['xpassed']}), xfail ({c['xfailed']}){legend.ref(self._reason('xfailed'))}"
        if status == "xfail":
            return f"xfail ({c['xfailed']}){legend.ref(self._reason('xfailed'))}"
        return f"skip{legend.ref(self._reason('skipped'))}"

    def as_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "counts": dict(self.counts),
            "reasons": {k: dict(v) for k, v in self.reasons.items()},
        }


def _outcome(test: dict[str, Any]) -> str:
    """A result's outcome, ``xpassed-strict`` for a known deviation that passed and failed the run."""
    outcome = str(test["outcome"])
    return "xpassed-strict" if outcome == "xpassed" and test.get("strict") else outcome


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
                cells.setdefault((req, impl), Cell()).add(_outcome(test), test["reason"])
    return list(spec), impls, cells


def _targets(impl: str | None, impls: list[str]) -> list[str]:
    """The columns a test's outcome counts in: its implementation; a test of no implementation checks
    the harness (HX-*: the plugin refuses a capability test without ``impl`` in the suite) and counts
    for every column."""
    return [impl] if impl else impls


def render(payload: dict[str, Any], fmt: str = "table", width: int | None = None) -> str:
    """The report of one run in ``fmt`` (table, markdown or json); the reasons' legend is wrapped to
    ``width`` columns (default: the terminal's)."""
    req_ids, impls, cells = summarize(payload)
    crashes = {test_id: test["crashes"] for test_id, test in sorted(payload.get("tests", {}).items()) if test.get("crashes")}
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
                "rerun_after_crash": {test_id: [c["died"] for c in runs] for test_id, runs in crashes.items()},
            },
            indent=1,
        )
    width = width if width is not None else shutil.get_terminal_size((100, 24)).columns
    legend = Legend()
    rows = [[req] + [cells[(req, impl)].text(legend) if (req, impl) in cells else "-" for impl in impls] for req in req_ids]
    totals = Counter(cell.status for cell in cells.values())
    table = tabulate(rows, headers=["requirement", *impls], tablefmt="github" if fmt == "markdown" else "simple")
    header = (
        f"torch {payload.get('torch')}, world sizes {payload.get('world_sizes')}, backend {payload.get('backend')}"
    )
    footer = ", ".join(f"{n} {status}" for status, n in sorted(totals.items()))
    notes = [
        "'-': no test of this run names it (some, like HX-*, are checked by the self-tests in tests/, run by `make test`)",
        "XPASS: a known deviation that passed, which fails a strict run: remove its entry, or cancel it with a `!` line",
    ]
    crashed = [
        f"{test_id} ({', '.join(f'rank {rank} {how}' for crash in runs for rank, how in crash['died'].items())})"
        for test_id, runs in crashes.items()
    ]
    if crashed:
        notes.append(f"run again after a crash (--rerun-crashes; the cells count the second run): {'; '.join(crashed)}")
    reasons = legend.lines(width, markdown=fmt == "markdown")
    legend_text = "\n\nreasons:\n" + "\n".join(reasons) if reasons else ""
    return f"{header}\n\n{table}{legend_text}\n\ncells: {footer}\n" + "\n".join(notes)


# -- diff of two runs ------------------------------------------------------------------------------

#: Outcomes that count as failing in a diff: a known deviation (xfailed) fails too, as it did.
_FAILING = {"failed", "error", "xfailed"}
#: Parts of a message that change from run to run without meaning anything: addresses, temp dirs.
_NOISE = re.compile(r"0x[0-9a-fA-F]+|/tmp/[^\s'\"]+|\b\d+\.\d+s\b")

NEWLY_FAILING = "newly failing"
FAILING_DIFFERENTLY = "failing differently"
NO_LONGER_DEVIATES = "no longer deviates (check)"
FIXED = "fixed"
NEWLY_SKIPPED = "newly skipped"
KINDS = (NEWLY_FAILING, FAILING_DIFFERENTLY, NO_LONGER_DEVIATES, FIXED, NEWLY_SKIPPED)
#: The kinds that fail the gate (exit 1); a no-longer-deviates change only where the new run was strict for it.
GATE_KINDS = (NEWLY_FAILING, FAILING_DIFFERENTLY, NO_LONGER_DEVIATES)


@dataclass(frozen=True)
class Change:
    """One test whose result differs between two runs."""

    kind: str  # one of KINDS
    nodeid: str  # as in the new run
    before: str  # the outcome in the base run ("absent" if it did not run there)
    after: str
    reqs: tuple[str, ...]
    messages: tuple[str, ...]  # what the new run's failing ranks said (or why it skipped, or which entry passed)
    before_messages: tuple[str, ...] = ()
    strict: bool = False  # a known deviation that passed in a run that failed for it (NO_LONGER_DEVIATES)


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


def _entry_lines(test: dict[str, Any]) -> tuple[str, ...]:
    """Which known-deviation entry marked a test that passed, and what to do about it."""
    entry = test.get("entry") or {}
    if not entry:
        return (test.get("reason") or "",) if test.get("reason") else ()
    how = "the run failed for it (strict)" if test.get("strict") else "allowed to pass (flaky entry)"
    return (f"listed by {entry.get('source')}: {entry.get('pattern')}  # {entry.get('reason', '')}", how)


def _by_clause(test: dict[str, Any]) -> bool:
    failures = test.get("failures") or []
    return bool(failures) and all(f.get("clause") for f in failures if f.get("type") not in ("DIED", "HUNG"))


def _signature(test: dict[str, Any], by_clause: bool) -> tuple[str, ...]:
    """What a failure is, for telling "fails differently": each failing rank's exception type and the
    SPEC clause it failed, where both runs recorded clauses (a message's wording is the suite's and
    may change between its releases); else the messages, as older results have no clauses."""
    if by_clause:
        return tuple(
            f"{'controller' if f.get('rank') is None else 'rank ' + str(f['rank'])}: {f.get('type')} [{f.get('clause')}]"
            for f in test.get("failures") or []
        )
    return tuple(_NOISE.sub("<>", line) for line in _failure_lines(test))


def _translate(nodeid: str, impl: str | None, from_name: str | None, to_name: str | None) -> str:
    if impl is None or not from_name or not to_name or from_name == to_name:
        return nodeid
    from conformance.harness.xfails import as_run_by

    return as_run_by(nodeid, from_name, to_name)


def _kind(before: str, after: str, test: dict[str, Any], before_test: dict[str, Any]) -> str | None:
    if after == "xpassed":
        return NO_LONGER_DEVIATES if before != "xpassed" else None
    if after in _FAILING and before not in _FAILING:
        return NEWLY_FAILING
    if after in _FAILING and before in _FAILING:
        worse = before == "xfailed" and after != "xfailed"  # a known deviation that now fails otherwise
        by_clause = _by_clause(test) and _by_clause(before_test)
        return FAILING_DIFFERENTLY if worse or _signature(test, by_clause) != _signature(before_test, by_clause) else None
    if after == "passed" and before in _FAILING:
        return FIXED
    if after == "skipped" and before not in ("skipped", "absent"):
        return NEWLY_SKIPPED
    return None


def diff(base: dict[str, Any], new: dict[str, Any], *, impl: str | None = None, base_impl: str | None = None) -> list[Change]:
    """Tests whose result changed from ``base`` to ``new``. With ``impl``, only the new run's tests of
    that implementation (and of none: harness tests), matched to the base run's tests of ``base_impl``
    (default: the same name) by reading the adapter's id segment as ``base_impl``'s.

    Kinds: *newly failing* (failed, error or xfailed now, passing or absent before); *failing
    differently* (failing in both, with another exception or clause on some rank (another message,
    where a run recorded no clauses), or a known
    deviation before that now fails otherwise); *no longer deviates (check)* (a known deviation that
    passed: XPASS); *fixed* (a failing test that now passes with no entry marking it); *newly skipped*."""
    base_impl = base_impl or impl
    changes = []
    for nodeid, test in new["tests"].items():
        if test.get("outcome") is None or (impl is not None and test.get("impl") not in (impl, None)):
            continue
        base_id = _translate(nodeid, test.get("impl"), impl, base_impl)
        before_test = base["tests"].get(base_id) or {}
        before = before_test["outcome"] if before_test.get("outcome") else "absent"
        after = test["outcome"]
        kind = _kind(before, after, test, before_test)
        if kind is None:
            continue
        changes.append(
            Change(
                kind=kind, nodeid=nodeid, before=before, after=after, reqs=tuple(test.get("reqs") or ()),
                messages=_entry_lines(test) if kind == NO_LONGER_DEVIATES else _failure_lines(test),
                before_messages=_failure_lines(before_test), strict=bool(test.get("strict")),
            )
        )
    return changes


def gate_fails(changes: Sequence[Change]) -> bool:
    """Whether ``changes`` fail a CI gate: anything newly failing or failing differently, or a known
    deviation that passed in a run that was strict for it (that run failed too)."""
    return any(c.kind in GATE_KINDS and (c.kind != NO_LONGER_DEVIATES or c.strict) for c in changes)


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
                if kind == FAILING_DIFFERENTLY:
                    lines += [f"      was: {m}" for m in change.before_messages]
                    lines += [f"      now: {m}" for m in change.messages]
                elif kind != FIXED:
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


def merge_payloads(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One ``--report-json`` document from those of the shards of one run (``--shard K/N``): the first
    part's run description, every part's tests."""
    merged = dict(parts[0])
    merged["tests"] = {}
    for part in parts:
        merged["tests"].update(part["tests"])
    return merged


def combined_status(statuses: Sequence[int]) -> int:
    """pytest's exit status of a run made of shards: the first that is neither 0 nor 5 (no tests
    selected, which one part of a narrow selection may be), else 0, or 5 if no part ran a test."""
    failing = [s for s in statuses if s not in (0, 5)]
    if failing:
        return failing[0]
    return 0 if 0 in statuses else 5


def _run_shards(commands: Sequence[list[str]], tmp: Path) -> int:
    """Run the shards' pytest commands at once: the first one's output as it comes, each other's whole
    when it has ended (in order)."""
    logs = [tmp / f"shard-{k}.log" for k in range(1, len(commands) + 1)]
    procs = [subprocess.Popen(commands[0])]
    for command, log in zip(commands[1:], logs[1:]):
        with log.open("wb") as out:
            procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT))
    statuses = [proc.wait() for proc in procs]
    for k, log in enumerate(logs[1:], start=2):
        print(f"\n=== shard {k}/{len(commands)} ===", flush=True)
        sys.stdout.write(log.read_text(errors="replace"))
    sys.stdout.flush()
    return combined_status(statuses)


def _run(args: argparse.Namespace, pytest_args: Sequence[str]) -> int:
    # Under torchrun every rank runs every test: one job.
    jobs = 1 if _launched_rank() is not None else max(1, args.jobs)
    with tempfile.TemporaryDirectory(prefix="sdc-report-") as tmp:
        json_paths = [Path(tmp) / f"results-{k}.json" for k in range(1, jobs + 1)]
        # --pyargs: the suite this module is part of, wherever it is installed (or this checkout, run from its root).
        base = [sys.executable, "-m", "pytest", "--pyargs", "conformance", "-q", "-p", "no:cacheprovider"]
        if args.world_size:
            base += ["--world-size", args.world_size]
        for impl in args.impl:
            base += ["--impl", impl]
        commands = [[*base, "--report-json", str(path), *(["--shard", f"{k}/{jobs}"] if jobs > 1 else []), *pytest_args]
                    for k, path in enumerate(json_paths, start=1)]
        status = subprocess.call(commands[0]) if jobs == 1 else _run_shards(commands, Path(tmp))
        missing = [path for path in json_paths if not path.exists()]
        if missing:
            if _launched_rank() not in (None, 0):
                # Under torchrun rank 0 writes the results and prints the table; its exit status is the
                # verdict. This rank does not fail the job for failed tests, which would make torchrun
                # stop rank 0 before it printed.
                return 0 if status in (0, 1) else status
            print(f"pytest exited with status {status} before writing results", file=sys.stderr)
            return status or 1
        payload = merge_payloads([json.loads(path.read_text(encoding="utf-8")) for path in json_paths])
        if args.save:
            Path(args.save).write_text(json.dumps(payload, indent=1), encoding="utf-8")
    print()
    print(render(payload, args.format))
    return status


def _launched_rank() -> int | None:
    """This process's rank in a torchrun/srun job, None outside one."""
    from conformance.harness.torchrun.launch_env import detect

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
    parser = argparse.ArgumentParser(prog="statedict-report", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the suite, then print the report")
    run.add_argument("--world-size", default=None, help="default 1,2; under torchrun the job's world size")
    run.add_argument("--impl", action="append", default=[])
    run.add_argument("--save", help="also keep the run's JSON here")
    run.add_argument("--jobs", type=int, default=1,
                     help="split the tests into this many parts (--shard K/N) run at once on this machine, one report (default 1)")
    show = sub.add_parser("show", help="print the report of a saved JSON result (--report-json)")
    show.add_argument("results", type=Path)
    for p in (run, show):
        p.add_argument("--format", choices=("table", "markdown", "json"), default="table")
    compare = sub.add_parser(
        "diff", help="what changed between two saved results; exit 1 if anything newly fails, fails differently, or no longer deviates in a strict run"
    )
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
        return 1 if gate_fails(changes) else 0
    try:
        payload = json.loads(args.results.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        print(f"cannot read results {args.results}: {exc}", file=sys.stderr)
        return 2
    print(render(payload, args.format))
    return 0


if __name__ == "__main__":
    sys.exit(main())
