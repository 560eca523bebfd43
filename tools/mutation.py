"""Mutation testing of ``reference/`` against the conformance suite: how much of it the suite pins down.

    python -m tools.mutation [--sections FP,SD,OS,ML,AS] [--sample N|all] [--seed S] [--jobs J]
                             [--mutant KEY ...] [--list] [--show KEY] [--resume] [--fail-under PCT]
                             [--pytest-args ARGS] [--rank-timeout S]

Each mutant (see :mod:`tools.mutants`) is written into a scratch copy of the checkout under
``.mutation/work/job<i>/`` (one per parallel job; the working tree itself is never written, so an
interrupted run leaves nothing mutated), and the tests of its SPEC section (:data:`SECTIONS`) run on
that copy in a fresh pytest process (``--impl reference --world-size 1,2 -x``). The rank processes that
pytest spawns import ``reference`` from the same copy, so mutants reach the ranks. A mutant is *killed*
when the run fails, *survived* when it passes, *timed out* when the run outlives its limit (counted as
detected in the kill rate), *equivalent* when ``tools/mutation_equivalent.txt`` lists it with a reason
(it is then not run). Each section's unmutated run comes first and must pass: a suite that already
fails cannot judge a mutant.

By default a deterministic sample of ``--sample`` mutants per section is run: the ones whose keys hash
lowest with the seed, so the sample of a section changes only where its mutants change. The report
(markdown table, survivors with their original and mutated line) goes to stdout and
``.mutation/report.md``, everything per mutant to ``.mutation/report.json``. The exit status is 0
(this measures, it does not gate) unless ``--fail-under`` is given and a section's kill rate is lower.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from tools.mutants import Mutant, mutants_of_file

__all__ = [
    "SECTIONS",
    "Section",
    "Result",
    "Equivalents",
    "sample",
    "load_equivalents",
    "render_table",
    "render_report",
    "main",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / ".mutation"
DEFAULT_EQUIVALENTS = REPO_ROOT / "tools" / "mutation_equivalent.txt"
DEFAULT_SAMPLE = 40
#: Every mutant run: the reference only, both world sizes, stop at the first failure.
PYTEST_ARGS = ("--impl", "reference", "--world-size", "1,2", "-x", "-q", "-p", "no:cacheprovider")
#: A hung rank fails its test after this many seconds (the suite's default is 120); a mutant that makes
#: one rank skip a collective is then killed in a minute, not two.
DEFAULT_RANK_TIMEOUT = 60.0


@dataclass(frozen=True)
class Section:
    """One SPEC section: the files whose mutants it owns and the tests that must kill them.

    Both are globs relative to the checkout; ``tests`` starts with the section's conformance file
    (its directory's conftest registers ``--impl``)."""

    name: str
    sources: tuple[str, ...]
    tests: tuple[str, ...]
    #: Files the source globs match that another section owns.
    excludes: tuple[str, ...] = ()

    def source_files(self, root: Path) -> list[str]:
        excluded = set(_expand(root, self.excludes))
        return [path for path in _expand(root, self.sources) if path not in excluded]

    def test_files(self, root: Path) -> list[str]:
        return _expand(root, self.tests)


#: The async save's modules: the AS section's, not ML's (whose tests never start an async save).
_ASYNC_SOURCES = ("reference/checkpoint/async_save.py", "reference/checkpoint/staging.py", "reference/checkpoint/writer_process.py")

#: SPEC section -> what it mutates and what runs against it. Reference-only tests live in
#: tests/reference/ (the globs take the files the section's engineers add there).
SECTIONS: dict[str, Section] = {
    s.name: s
    for s in (
        Section(
            "FP",
            ("reference/flat_param/*.py",),
            ("conformance/test_flat_param.py", "tests/reference/test_flat_param*.py", "tests/reference/test_prefix_hooks*.py"),
        ),
        Section(
            "SD",
            ("reference/state_dict/*.py", "reference/fqn.py"),
            ("conformance/test_state_dict.py", "conformance/test_state_dict_options.py", "conformance/test_training_states.py",
             "tests/reference/test_state_dict*.py", "tests/reference/test_fqn*.py"),
        ),
        Section(
            "OS",
            ("reference/fsdp/*.py", "reference/comm.py"),
            (
                "conformance/test_optim_state.py",
                "conformance/test_real_models.py",
                "tests/reference/test_optim_state*.py",
                "tests/reference/test_sharding*.py",
                "tests/reference/test_fsdp*.py",
                "tests/reference/test_comm*.py",
                "tests/reference/test_coordinator*.py",
            ),
        ),
        Section(
            "ML",
            ("reference/checkpoint/*.py",),
            ("conformance/test_checkpoint.py", "tests/reference/test_checkpoint*.py"),
            excludes=_ASYNC_SOURCES,
        ),
        Section("AS", _ASYNC_SOURCES, ("conformance/test_async_save.py", "tests/reference/test_async*.py")),
    )
}

STATUSES = ("killed", "survived", "timeout", "equivalent", "error")


def _expand(root: Path, patterns: Iterable[str]) -> list[str]:
    out: list[str] = []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern, root_dir=root)):
            path = Path(path).as_posix()
            if path not in out and not path.endswith("__init__.py"):
                out.append(path)
    return out


# -- which mutants ---------------------------------------------------------------------------------


def sample(mutants: Sequence[Mutant], size: int | None, seed: int | str = 0) -> list[Mutant]:
    """The ``size`` mutants whose keys hash lowest with ``seed`` (all when ``size`` is None), in file order.

    A mutant's rank depends only on its own key, so editing one function changes the sample only
    where that function's mutants come or go."""
    if size is None or size >= len(mutants):
        return list(mutants)

    def rank(m: Mutant) -> str:
        return hashlib.sha256(f"{seed}\0{m.key}".encode()).hexdigest()

    chosen = set(id(m) for m in sorted(mutants, key=rank)[:size])
    return [m for m in mutants if id(m) in chosen]


@dataclass
class Equivalents:
    """The mutants known to change no behaviour: key -> reason; plus the file's problems."""

    reasons: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def stale(self, keys: Iterable[str]) -> list[str]:
        """Entries that name no existing mutant (the line changed or went): to re-check or delete."""
        known = set(keys)
        return [k for k in self.reasons if k not in known]


def load_equivalents(path: Path) -> Equivalents:
    """Parse ``KEY  reason`` lines (``#`` starts a comment line). A key without a reason is an error."""
    out = Equivalents()
    if not path.exists():
        return out
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, _, reason = line.partition(" ")
        reason = reason.strip()
        if "::" not in key:
            out.errors.append(f"{path.name}:{number}: {key!r} is not a mutant key (path::operator:hash:index)")
        elif not reason:
            out.errors.append(f"{path.name}:{number}: {key} has no reason; say in one line why it is equivalent")
        elif key in out.reasons:
            out.errors.append(f"{path.name}:{number}: {key} is listed twice")
        else:
            out.reasons[key] = reason
    return out


# -- running ---------------------------------------------------------------------------------------


@dataclass
class Result:
    """What happened to one mutant."""

    key: str
    section: str
    path: str
    line: int
    operator: str
    description: str
    original: str
    mutated: str
    status: str  # one of STATUSES
    seconds: float = 0.0
    killed_by: str = ""  # the first failing test, or why the run failed
    reason: str = ""  # for an equivalent mutant
    fingerprint: str = ""  # of the tree it ran against (--resume reuses only identical ones)

    @classmethod
    def of(cls, mutant: Mutant, section: str, status: str, **kw: object) -> Result:
        return cls(
            key=mutant.key,
            section=section,
            path=mutant.path,
            line=mutant.line,
            operator=mutant.operator,
            description=mutant.description,
            original=mutant.original,
            mutated=mutant.mutated,
            status=status,
            **kw,  # type: ignore[arg-type]
        )


def checkout_files(root: Path) -> list[str]:
    """The files of the checkout as it is now: tracked and untracked-but-not-ignored (git), else a walk
    of what the suite and its package are built from."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        ).stdout.decode("utf-8")
        files = [f for f in listed.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = [
            p.relative_to(root).as_posix()
            for top in ("reference", "conformance", "tests", "tools", "pyproject.toml", "README.md")
            for p in ([root / top] if (root / top).is_file() else (root / top).rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts
        ]
    return sorted(f for f in files if (root / f).is_file() and not f.startswith(".mutation/"))


def make_scratch(root: Path, dest: Path, files: Sequence[str]) -> None:
    """A fresh copy of ``files`` of ``root`` at ``dest`` (no bytecode caches: every run compiles)."""
    if dest.exists():
        shutil.rmtree(dest)
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)


def tree_fingerprint(root: Path, files: Sequence[str], extra: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for rel in files:
        if rel.startswith(("reference/", "conformance/", "tests/")) or rel == "pyproject.toml":
            digest.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    digest.update("\0".join(extra).encode())
    return digest.hexdigest()[:16]


class Runner:
    """Runs pytest on scratch copies; keeps track of the live processes so Ctrl-C can end them."""

    def __init__(self, pytest_args: Sequence[str]) -> None:
        self.pytest_args = list(pytest_args)
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()
        self.stopping = threading.Event()

    def command(self, section: Section, scratch: Path) -> list[str]:
        return [sys.executable, "-m", "pytest", *section.test_files(scratch), *PYTEST_ARGS, *self.pytest_args]

    def pytest(self, section: Section, scratch: Path, timeout: float | None) -> tuple[int | None, str, float]:
        """(exit status or None on timeout, output, seconds) of the section's tests on ``scratch``."""
        env = dict(os.environ)
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant written in the same second must not hit a stale .pyc
        env["PYTHONPATH"] = os.pathsep.join([str(scratch), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        start = time.monotonic()
        log = scratch / ".mutation-run.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                self.command(section, scratch),
                cwd=scratch,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: a timeout kills the ranks too
            )
            with self._lock:
                self._procs.add(proc)
            if self.stopping.is_set():
                _kill_group(proc)
            try:
                rc: int | None = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc = None
            finally:
                with self._lock:
                    self._procs.discard(proc)
        return rc, log.read_text(encoding="utf-8", errors="replace"), time.monotonic() - start

    def kill_all(self) -> None:
        self.stopping.set()
        with self._lock:
            procs = list(self._procs)
        for proc in procs:
            _kill_group(proc)

    def run_mutant(self, mutant: Mutant, section: Section, scratch: Path, timeout: float, fingerprint: str) -> Result:
        target = (scratch / mutant.path).resolve()
        if scratch.resolve() not in target.parents:
            raise RuntimeError(f"refusing to write {target}: outside the scratch copy {scratch}")
        original = target.read_bytes()
        try:
            target.write_bytes(mutant.apply(original))
            rc, output, seconds = self.pytest(section, scratch, timeout)
        finally:
            target.write_bytes(original)
        if rc is None:
            return Result.of(mutant, section.name, "timeout", seconds=seconds, killed_by=f"no result in {timeout:.0f}s", fingerprint=fingerprint)
        if rc == 0:
            return Result.of(mutant, section.name, "survived", seconds=seconds, fingerprint=fingerprint)
        if rc in (1, 2, 3):  # tests failed, collection/import failed, internal error: the suite noticed
            return Result.of(mutant, section.name, "killed", seconds=seconds, killed_by=_first_failure(output), fingerprint=fingerprint)
        return Result.of(
            mutant, section.name, "error", seconds=seconds, killed_by=f"pytest exit {rc}: {output[-500:]}", fingerprint=fingerprint
        )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0][:200]
    for line in output.splitlines():
        if "Error" in line or "error" in line:
            return line.strip()[:200]
    return output.strip().splitlines()[-1][:200] if output.strip() else ""


# -- the report --------------------------------------------------------------------------------------


@dataclass
class SectionSummary:
    """The counts of one section's mutants (by status) and the time they took."""

    name: str
    total: int  # every mutant of the section (the sample is drawn from these)
    counts: Counter = field(default_factory=Counter)
    baseline_s: float | None = None
    seconds: float = 0.0  # spent running its mutants

    @property
    def mutants(self) -> int:
        return sum(self.counts[s] for s in STATUSES)

    @property
    def kill_rate(self) -> float | None:
        judged = self.counts["killed"] + self.counts["timeout"] + self.counts["survived"] + self.counts["error"]
        return None if judged == 0 else 100.0 * (self.counts["killed"] + self.counts["timeout"]) / judged


def _pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:.1f}%"


def render_table(summaries: Sequence[SectionSummary]) -> str:
    """section | mutants | killed | survived | timed out | equivalent | kill rate, plus a total row."""
    rows = ["| section | mutants | killed | survived | timed out | equivalent | kill rate |", "|---|---|---|---|---|---|---|"]
    total = SectionSummary("all", sum(s.total for s in summaries))
    for s in summaries:
        total.counts.update(s.counts)
        rows.append(_row(s.name, s))
    if len(summaries) > 1:
        rows.append(_row("**all**", total))
    return "\n".join(rows)


def _row(name: str, s: SectionSummary) -> str:
    c = s.counts
    survived = c["survived"] + c["error"]
    return f"| {name} | {s.mutants} | {c['killed']} | {survived} | {c['timeout']} | {c['equivalent']} | {_pct(s.kill_rate)} |"


def render_report(summaries: Sequence[SectionSummary], results: Sequence[Result], header: str, notes: Sequence[str] = ()) -> str:
    """The markdown report: header, table, notes, and every survivor with its original and mutated line."""
    parts = [header, "", render_table(summaries), ""]
    parts += [f"- {n}" for n in notes]
    if notes:
        parts.append("")
    survivors = [r for r in results if r.status in ("survived", "error")]
    parts.append(f"## Survivors ({len(survivors)})")
    if not survivors:
        parts.append("\nNone.")
    for section in summaries:
        mine = sorted((r for r in survivors if r.section == section.name), key=lambda r: (r.path, r.line, r.key))
        if not mine:
            continue
        parts.append(f"\n### {section.name}\n")
        for r in mine:
            first = (r.killed_by.splitlines() or [""])[0]
            what = f" (pytest error, not a test failure: {first})" if r.status == "error" else ""
            parts.append(f"- `{r.path}:{r.line}` {r.operator}: {r.description}{what}  \n  key `{r.key}`")
            parts.append(f"  ```diff\n  - {r.original}\n  + {r.mutated}\n  ```")
    return "\n".join(parts) + "\n"


# -- the command -------------------------------------------------------------------------------------


def _env(name: str, default: str) -> str:
    value = os.environ.get(name, "").strip()
    return value or default


def _parse_sample(text: str) -> int | None:
    if text.lower() == "all":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("--sample must be a positive number or 'all'")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.mutation", description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=_env("MUTATION_SECTIONS", ",".join(SECTIONS)), help="comma-separated: FP,SD,OS,ML,AS")
    p.add_argument(
        "--sample",
        type=_parse_sample,
        default=_parse_sample(_env("MUTATION_SAMPLE", str(DEFAULT_SAMPLE))),
        help=f"mutants per section, or 'all' (default {DEFAULT_SAMPLE}; env MUTATION_SAMPLE)",
    )
    p.add_argument("--seed", default=_env("MUTATION_SEED", "0"), help="the sample's seed (default 0)")
    p.add_argument("--jobs", type=int, default=int(_env("MUTATION_JOBS", "1")), help="mutants run at once (default 1)")
    p.add_argument("--mutant", action="append", default=[], metavar="KEY", help="run only these mutants (repeatable)")
    p.add_argument("--list", action="store_true", help="list the selected mutants, run nothing")
    p.add_argument("--show", metavar="KEY", help="print one mutant's edit as a diff, run nothing")
    p.add_argument("--resume", action="store_true", help="reuse results of an earlier run against an identical tree")
    p.add_argument("--fail-under", type=float, default=None, metavar="PCT", help="exit 1 if a section's kill rate is lower")
    p.add_argument(
        "--pytest-args", default=_env("MUTATION_PYTEST_ARGS", ""), help="extra pytest arguments, e.g. \"-k 'not slow'\""
    )
    p.add_argument("--rank-timeout", type=float, default=DEFAULT_RANK_TIMEOUT, help="the suite's --rank-timeout per test")
    p.add_argument("--timeout-factor", type=float, default=3.0, help="a mutant's time limit is this x the unmutated run ...")
    p.add_argument("--timeout-extra", type=float, default=None, help="... plus this (default: the rank timeout + 30s)")
    p.add_argument("--equivalents", type=Path, default=DEFAULT_EQUIVALENTS)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the scratch copies and reports go")
    p.add_argument("--root", type=Path, default=REPO_ROOT, help=argparse.SUPPRESS)
    return p


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    root: Path = args.root.resolve()
    names = [n.strip().upper() for n in args.sections.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        _log(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
        return 2
    sections = [SECTIONS[n] for n in names]
    equivalents = load_equivalents(args.equivalents)
    if equivalents.errors:
        _log("\n".join(equivalents.errors))
        return 2

    everything: dict[str, list[Mutant]] = {
        s.name: [m for path in s.source_files(root) for m in mutants_of_file(root, path)] for s in sections
    }
    by_key = {m.key: m for ms in everything.values() for m in ms}
    if args.show:
        mutant = by_key.get(args.show)
        if mutant is None:
            _log(f"no mutant {args.show} in sections {','.join(names)}")
            return 2
        print(f"{mutant.location} {mutant.operator}: {mutant.description}\n- {mutant.original}\n+ {mutant.mutated}")
        return 0
    if args.mutant:
        missing = [k for k in args.mutant if k not in by_key]
        if missing:
            _log(f"no such mutant(s) in sections {','.join(names)}: {', '.join(missing)}")
            return 2
        chosen = {s.name: [m for m in everything[s.name] if m.key in args.mutant] for s in sections}
    else:
        chosen = {s.name: sample(everything[s.name], args.sample, f"{args.seed}:{s.name}") for s in sections}
    if args.list:
        for s in sections:
            for m in chosen[s.name]:
                tag = "  [equivalent]" if m.key in equivalents.reasons else ""
                print(f"{s.name} {m.key} {m.location} {m.operator}: {m.description}{tag}\n    - {m.original}\n    + {m.mutated}")
        return 0
    return _run(args, root, sections, everything, chosen, equivalents)


def _previous_results(journal: Path, fingerprint: str, *, resume: bool) -> dict[str, Result]:
    """Mutant key -> its result from an earlier run of the same tree and arguments (``--resume``); the
    journal is removed otherwise, so a fresh run starts from nothing."""
    previous: dict[str, Result] = {}
    if resume and journal.exists():
        for line in journal.read_text().splitlines():
            try:
                r = Result(**json.loads(line))
            except (TypeError, ValueError):
                continue
            if r.fingerprint == fingerprint and r.status != "error":
                previous[r.key] = r
    elif journal.exists():
        journal.unlink()
    return previous


@dataclass
class _Plan:
    """What the unmutated runs decided: the mutants to run with their time limits, and the results
    already known (equivalent, or from the journal)."""

    todo: list[tuple[Mutant, Section, float]] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)  # sections whose unmutated run failed


def _plan(
    args: argparse.Namespace,
    runner: Runner,
    scratch: Path,
    sections: list[Section],
    chosen: dict[str, list[Mutant]],
    equivalents: Equivalents,
    previous: dict[str, Result],
    summaries: dict[str, SectionSummary],
) -> _Plan:
    """Run the unmutated suite once per section with mutants to run: it must pass, and its time sets
    the mutants' limit."""
    plan = _Plan()
    for s in sections:
        pending = [m for m in chosen[s.name] if m.key not in equivalents.reasons and m.key not in previous]
        for m in chosen[s.name]:
            if m.key in equivalents.reasons:
                plan.results.append(Result.of(m, s.name, "equivalent", reason=equivalents.reasons[m.key]))
            elif m.key in previous:
                plan.results.append(previous[m.key])
        if not pending:
            continue
        _log(f"[{s.name}] unmutated run: {' '.join(s.test_files(scratch))}")
        rc, output, seconds = runner.pytest(s, scratch, timeout=1800)
        summaries[s.name].baseline_s = seconds
        if rc != 0:
            tail = "\n".join(output.strip().splitlines()[-25:])
            _log(f"[{s.name}] the unmutated suite does not pass (exit {rc}); its mutants are not run:\n{tail}")
            plan.notes.append(f"{s.name}: the unmutated suite failed (exit {rc}); its {len(pending)} mutants were not run")
            plan.broken.append(s.name)
            continue
        extra = args.rank_timeout + 30 if args.timeout_extra is None else args.timeout_extra
        limit = args.timeout_factor * seconds + extra
        _log(f"[{s.name}] unmutated run passed in {seconds:.1f}s; {len(pending)} mutants, limit {limit:.0f}s each")
        plan.todo += [(m, s, limit) for m in pending]
    return plan


def _run_mutants(
    runner: Runner, todo: list[tuple[Mutant, Section, float]], scratches: list[Path], journal: Path, fingerprint: str
) -> Iterator[Result]:
    """Run ``todo``, one job per scratch copy at a time, yielding each result as it finishes (and
    appending it to ``journal``). A KeyboardInterrupt stops the running mutants before it propagates."""
    free = list(scratches)
    with ThreadPoolExecutor(max_workers=len(scratches)) as pool, open(journal, "a") as jf:
        running: dict[Future[Result], Path] = {}
        queue = list(todo)
        try:
            while queue or running:
                while queue and free:
                    mutant, section, limit = queue.pop(0)
                    scratch = free.pop(0)
                    running[pool.submit(runner.run_mutant, mutant, section, scratch, limit, fingerprint)] = scratch
                finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in finished:
                    free.append(running.pop(fut))
                    r = fut.result()
                    jf.write(json.dumps(asdict(r)) + "\n")
                    jf.flush()
                    yield r
        except KeyboardInterrupt:
            runner.kill_all()  # before the pool's exit waits for its threads
            raise


def _write_reports(
    args: argparse.Namespace,
    root: Path,
    out: Path,
    sections: list[Section],
    everything: dict[str, list[Mutant]],
    equivalents: Equivalents,
    summaries: dict[str, SectionSummary],
    results: list[Result],
    notes: list[str],
    *,
    jobs: int,
    seconds: float,
    interrupted: bool,
) -> list[SectionSummary]:
    """Count ``results`` into ``summaries``, write ``report.md`` and ``report.json`` under ``out``, print
    the report, and return the summaries in section order."""
    for r in results:
        summaries[r.section].counts[r.status] += 1
        summaries[r.section].seconds += r.seconds
    ordered = [summaries[s.name] for s in sections]
    if args.mutant:
        scope = "the mutants asked for"
    elif args.sample is None:
        scope = "every mutant"
    else:
        scope = f"a sample of up to {args.sample} mutants per section (seed {args.seed})"
    header = (
        f"# Mutation testing of reference/\n\n{scope}; {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{jobs} job(s), {seconds:.0f}s. Kill rate = (killed + timed out) / (mutants - equivalent)."
    )
    for summary in ordered:
        ran = sum(summary.counts[k] for k in ("killed", "survived", "timeout", "error"))
        if ran:
            baseline = f"unmutated run {summary.baseline_s:.1f}s, " if summary.baseline_s is not None else ""
            notes.append(f"{summary.name}: {summary.total} mutants in all; {baseline}{summary.seconds / ran:.1f}s per mutant run")
    stale = equivalents.stale(m.key for ms in everything.values() for m in ms)
    in_scope = [k for k in stale if any(k.startswith(p + "::") for s in sections for p in s.source_files(root))]
    if in_scope:
        notes.append(f"stale entries in {args.equivalents.name} (their line changed or went): {', '.join(in_scope)}")
    report = render_report(ordered, results, header, notes)
    (out / "report.md").write_text(report)
    sections_json = {
        s.name: {
            "total_mutants": s.total,
            "mutants": s.mutants,
            **{k: s.counts[k] for k in STATUSES},
            "kill_rate": s.kill_rate,
            "baseline_s": s.baseline_s,
            "mutant_seconds": s.seconds,
        }
        for s in ordered
    }
    document = {
        "scope": scope,
        "sample": args.sample,
        "seed": args.seed,
        "interrupted": interrupted,
        "sections": sections_json,
        "mutants": [asdict(r) for r in results],
    }
    (out / "report.json").write_text(json.dumps(document, indent=1))
    print(report)
    _log(f"written: {out / 'report.md'}, {out / 'report.json'}")
    return ordered


def _run(
    args: argparse.Namespace,
    root: Path,
    sections: list[Section],
    everything: dict[str, list[Mutant]],
    chosen: dict[str, list[Mutant]],
    equivalents: Equivalents,
) -> int:
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / ".gitignore").write_text("*\n")  # ignored even in a checkout whose .gitignore lacks it
    pytest_args = [*shlex.split(args.pytest_args), "--rank-timeout", f"{args.rank_timeout:g}"]
    files = checkout_files(root)
    fingerprint = tree_fingerprint(root, files, pytest_args)
    jobs = max(1, args.jobs)
    scratches = [out / "work" / f"job{i}" for i in range(jobs)]
    for scratch in scratches:
        make_scratch(root, scratch, files)
    journal = out / "results.jsonl"
    previous = _previous_results(journal, fingerprint, resume=args.resume)
    summaries = {s.name: SectionSummary(s.name, len(everything[s.name])) for s in sections}
    runner = Runner(pytest_args)
    interrupted = False
    started = time.monotonic()
    plan = _Plan()

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_signal)
    try:
        plan = _plan(args, runner, scratches[0], sections, chosen, equivalents, previous, summaries)
        for done, r in enumerate(_run_mutants(runner, plan.todo, scratches, journal, fingerprint), start=1):
            plan.results.append(r)
            _log(f"[{done}/{len(plan.todo)}] {r.section} {r.status:8} {r.seconds:5.1f}s {r.path}:{r.line} {r.operator}: {r.description}")
    except KeyboardInterrupt:
        interrupted = True
        runner.kill_all()
        plan.notes.append("interrupted: the counts cover the mutants finished before the interruption")
        _log("interrupted: stopping the running mutants (the scratch copies are restored; the working tree was never written)")
    finally:
        signal.signal(signal.SIGTERM, old_term)

    ordered = _write_reports(
        args, root, out, sections, everything, equivalents, summaries, plan.results, plan.notes,
        jobs=jobs, seconds=time.monotonic() - started, interrupted=interrupted,
    )
    if interrupted:
        return 130
    if plan.broken:
        return 1
    if args.fail_under is not None:
        low = [s for s in ordered if s.kill_rate is not None and s.kill_rate < args.fail_under]
        if low:
            _log("kill rate under " + f"{args.fail_under:g}%: " + ", ".join(f"{s.name} {_pct(s.kill_rate)}" for s in low))
            return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
