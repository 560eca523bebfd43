"""Mutation testing of ``reference/`` against the conformance suite: how much of it the suite pins down.

    python -m tools.mutation [--sections FP,SD,OS,ML,AS] [--sample N|all] [--seed S] [--jobs J]
                             [--mutant KEY ...] [--list] [--show KEY] [--resume] [--fail-under PCT]
                             [--pytest-args ARGS] [--rank-timeout S]

Each mutant (see :mod:`tools.mutants`) is written into a scratch copy of the checkout under
``.mutation/work/job<i>/`` (one per parallel job; the working tree itself is never written, so an
interrupted run leaves nothing mutated) and judged twice:

1. by its SPEC section's ``conformance/`` tests alone (:data:`SECTIONS`; ``--impl reference
   --world-size 1,2 -x``), in a fresh pytest process: what a fork running the suite would see. This is
   the suite's power, the figure the report leads with;
   When they pass, the conformance tests of every other section whose code imports the mutated module
   (:mod:`tools.mutation_reach`) run too: a fork runs all of ``conformance/``, and the FlatParameter
   wrapper's registration with the canonical-FQN rule matters only to SD's submodule selection;
2. when those pass, by the section's self-tests under ``tests/reference/`` too: what the project's own
   tests add. A mutant the conformance tests catch needs no second run.

The rank processes that pytest spawns import ``reference`` from the same copy, so mutants reach the
ranks. A mutant is *killed* when a run fails, *survived* when it passes, *timed out* when the run
outlives its limit (counted as detected in the kill rate), *equivalent* when
``tools/mutation_equivalent.txt`` lists it with a reason (it is then not run). Each section's unmutated
runs come first and must pass: a suite that already fails cannot judge a mutant.

The conformance tests that killed earlier mutants of a section (in this run or a journal kept by
``--resume``) run first (:mod:`tools.mutation_order`): with ``-x`` a mutant like one seen before is
killed in seconds, while a survivor still runs every test.

By default a deterministic sample of ``--sample`` mutants per section is run: the ones whose keys hash
lowest with the seed, so the sample of a section changes only where its mutants change. The report
(markdown tables, survivors with their original and mutated line) goes to stdout and
``.mutation/report.md``, everything per mutant to ``.mutation/report.json``. The exit status is 0
(this measures, it does not gate) unless ``--fail-under`` is given and a section's conformance-only
kill rate is lower.
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
from tools.mutation_order import FIRST_ENV
from tools.mutation_reach import import_graph, module_of, reaches

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
DEFAULT_SAMPLE = 150
#: Every mutant run: the reference only, both world sizes, stop at the first failure.
PYTEST_ARGS = ("--impl", "reference", "--world-size", "1,2", "-x", "-q", "-p", "no:cacheprovider")
#: A hung rank fails its test after this many seconds (the suite's default is 120); a mutant that makes
#: one rank skip a collective is then killed in a minute, not two.
DEFAULT_RANK_TIMEOUT = 60.0


@dataclass(frozen=True)
class Section:
    """One SPEC section: the files whose mutants it owns, the conformance tests that must kill them,
    and the project's self-tests that may kill what those miss.

    All are globs relative to the checkout; ``conformance`` starts with the section's conformance file
    (its directory's conftest registers ``--impl``)."""

    name: str
    sources: tuple[str, ...]
    conformance: tuple[str, ...]
    self_tests: tuple[str, ...] = ()
    #: Files the source globs match that another section owns.
    excludes: tuple[str, ...] = ()
    #: The section's code has the reference's plain path beside its fast paths
    #: (:mod:`reference.checkpoint.fast_paths`): a mutant the conformance tests let survive with the
    #: fast paths on (the default) is judged by them once more with the plain path, which is also an
    #: implementation of the spec, and the one a reviewer reads against it.
    plain_path: bool = False

    def source_files(self, root: Path) -> list[str]:
        excluded = set(_expand(root, self.excludes))
        return [path for path in _expand(root, self.sources) if path not in excluded]

    def test_files(self, root: Path, stage: str = "conformance") -> list[str]:
        """The test files of one stage of judging: ``"conformance"`` or ``"self-tests"``."""
        return _expand(root, self.conformance if stage == "conformance" else self.self_tests)


#: The async save's modules: the AS section's, not ML's (whose tests never start an async save).
_ASYNC_SOURCES = ("reference/checkpoint/async_save.py", "reference/checkpoint/staging.py", "reference/checkpoint/writer_process.py")

#: SPEC section -> what it mutates, the conformance tests that judge it (every file with a test that
#: names one of the section's IDs: a fork runs them all; tests/test_mutation.py checks the list), and
#: the self-tests (under tests/reference/; the globs take the files the section's engineers add there).
SECTIONS: dict[str, Section] = {
    s.name: s
    for s in (
        Section(
            "FP",
            ("reference/flat_param/*.py",),
            ("conformance/test_flat_param.py", "conformance/test_generated.py", "conformance/test_module_state.py"),
            ("tests/reference/test_flat_param*.py", "tests/reference/test_prefix_hooks*.py"),
        ),
        Section(
            "SD",
            ("reference/state_dict/*.py", "reference/fqn.py"),
            ("conformance/test_state_dict.py", "conformance/test_state_dict_options.py", "conformance/test_training_states.py",
             "conformance/test_module_state.py", "conformance/test_generated.py", "conformance/test_real_models.py"),
            ("tests/reference/test_state_dict*.py", "tests/reference/test_fqn*.py"),
        ),
        Section(
            "OS",
            ("reference/fsdp/*.py", "reference/comm.py"),
            # test_module_state.py holds OS-25 and OS-26 (extra state, dtype changes) beside SD's.
            ("conformance/test_optim_state.py", "conformance/test_real_models.py", "conformance/test_module_state.py",
             "conformance/test_generated.py"),
            (
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
            ("conformance/test_checkpoint.py", "conformance/test_checkpoint_stacks.py", "conformance/test_scale.py",
             "conformance/test_generated.py", "conformance/test_module_state.py", "conformance/test_real_models.py",
             "conformance/test_async_save.py"),
            ("tests/reference/test_checkpoint*.py", "tests/reference/test_scale*.py"),
            excludes=_ASYNC_SOURCES,
            plain_path=True,
        ),
        Section("AS", _ASYNC_SOURCES, ("conformance/test_async_save.py",), ("tests/reference/test_async*.py",), plain_path=True),
    )
}

#: The two stages of judging a mutant, in order.
STAGES = ("conformance", "self-tests")

#: What :attr:`Section.plain_path` sets for the conformance tests' second run.
PLAIN_PATH_ENV = {"SDC_REFERENCE_FAST_PATHS": "0"}

STATUSES = ("killed", "survived", "timeout", "equivalent", "error")


def reaching_tests(root: Path, section: Section, path: str, sections: Iterable[Section] | None = None,
                   graph: dict[str, set[str]] | None = None) -> list[str]:
    """The conformance files of the other sections whose code imports ``path`` (directly or not), less
    ``section``'s own: the rest of ``conformance/`` that can run a mutant of ``path``. ``graph``: the
    import graph of ``root`` when the caller has it (:func:`tools.mutation_reach.import_graph`)."""
    graph = import_graph(root) if graph is None else graph
    target = module_of(path)
    own = set(section.test_files(root))
    out: list[str] = []
    for other in SECTIONS.values() if sections is None else sections:
        if other.name != section.name and reaches(graph, (module_of(p) for p in other.source_files(root)), target):
            out += [f for f in other.test_files(root) if f not in own and f not in out]
    return out


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
    status: str  # one of STATUSES: judged by the section's conformance tests alone
    seconds: float = 0.0
    killed_by: str = ""  # the first failing test, or why the run failed
    reason: str = ""  # for an equivalent mutant
    fingerprint: str = ""  # of the tree the conformance run judged (--resume reuses only identical ones)
    #: Judged with the self-tests added: ``status`` where the conformance tests detected the mutant,
    #: else the self-tests' verdict ("" until they ran).
    with_self_tests: str = ""
    self_killed_by: str = ""
    self_seconds: float = 0.0
    self_fingerprint: str = ""  # of the tree the self-tests judged

    @property
    def detected(self) -> bool:
        """Whether the conformance tests alone caught it (a time-out counts)."""
        return self.status in ("killed", "timeout")

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


def tree_fingerprint(root: Path, files: Sequence[str], extra: Sequence[str], *, tops: tuple[str, ...]) -> str:
    """A hash of the files under ``tops`` (and pyproject.toml) and of ``extra``: two runs with one
    fingerprint judged the same code with the same tests."""
    digest = hashlib.sha256()
    for rel in files:
        if rel.startswith(tops) or rel == "pyproject.toml":
            digest.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    digest.update("\0".join(extra).encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Fingerprints:
    """What each stage's verdict depends on: the conformance verdict on ``reference/`` and
    ``conformance/``; the self-tests' on ``tests/`` too. Editing a self-test re-judges only the
    conformance survivors (``--resume``)."""

    conformance: str
    self_tests: str

    @classmethod
    def of(cls, root: Path, files: Sequence[str], extra: Sequence[str]) -> Fingerprints:
        return cls(
            tree_fingerprint(root, files, extra, tops=("reference/", "conformance/")),
            tree_fingerprint(root, files, extra, tops=("reference/", "conformance/", "tests/")),
        )


#: A run's exit status -> its verdict (pytest: 0 passed; 1 tests failed, 2 interrupted or collection
#: failed, 3 internal error: the suite noticed; anything else is an error of the run, not a verdict).
def _verdict(rc: int | None) -> str:
    if rc is None:
        return "timeout"
    if rc == 0:
        return "survived"
    return "killed" if rc in (1, 2, 3) else "error"


class Runner:
    """Runs pytest on scratch copies; keeps track of the live processes so Ctrl-C can end them."""

    def __init__(self, pytest_args: Sequence[str]) -> None:
        self.pytest_args = list(pytest_args)
        self._procs: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()
        self.stopping = threading.Event()
        #: Section -> its conformance tests that killed mutants, with how many (tools.mutation_order).
        self.killers: dict[str, Counter[str]] = {}

    def command(self, section: Section, scratch: Path, stage: str = "conformance", files: Sequence[str] | None = None) -> list[str]:
        """The pytest command of one stage of ``section`` (or of ``files``, run as that section's)."""
        # The ordering plugin comes from the scratch copy, like everything the run imports (a checkout
        # without it runs its tests in collection order).
        order = ["-p", "tools.mutation_order"] if (scratch / "tools" / "mutation_order.py").is_file() else []
        tests = section.test_files(scratch, stage) if files is None else list(files)
        return [sys.executable, "-m", "pytest", *tests, *PYTEST_ARGS, *order, *self.pytest_args]

    def learn(self, result: Result) -> None:
        """Remember the test that killed ``result`` (a ``FAILED <nodeid>`` line) so it runs first next time."""
        if result.status == "killed" and result.killed_by.startswith(("FAILED ", "ERROR ")):
            nodeid = result.killed_by.split(" ", 1)[1].strip()
            with self._lock:
                self.killers.setdefault(result.section, Counter())[nodeid] += 1

    def _first_file(self, section: Section, scratch: Path) -> Path:
        path = scratch / ".mutation-first.txt"
        with self._lock:
            known = self.killers.get(section.name, Counter())
            path.write_text("".join(f"{nodeid}\n" for nodeid, _ in known.most_common()), encoding="utf-8")
        return path

    def pytest(
        self,
        section: Section,
        scratch: Path,
        timeout: float | None,
        stage: str = "conformance",
        extra_env: dict[str, str] | None = None,
        files: Sequence[str] | None = None,
    ) -> tuple[int | None, str, float]:
        """(exit status or None on timeout, output, seconds) of one stage of the section's tests (or of
        ``files``) on ``scratch``."""
        env = {**os.environ, **(extra_env or {})}
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant written in the same second must not hit a stale .pyc
        env["PYTHONPATH"] = os.pathsep.join([str(scratch), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env[FIRST_ENV] = str(self._first_file(section, scratch))
        start = time.monotonic()
        log = scratch / ".mutation-run.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                self.command(section, scratch, stage, files),
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

    def run_mutant(
        self,
        mutant: Mutant,
        section: Section,
        scratch: Path,
        limits: dict[str, float] | float,
        fingerprints: Fingerprints | str,
        known: Result | None = None,
        reaching: Sequence[str] = (),
    ) -> Result:
        """Judge ``mutant`` by the section's conformance tests (unless ``known`` is that verdict already)
        and, if they pass, by ``reaching`` (other sections' conformance files that run its code, limited
        by ``limits["reaching"]``), then, if those pass too, by its self-tests. ``limits``: seconds per
        stage (one number: every stage)."""
        if not isinstance(limits, dict):
            limits = {stage: limits for stage in (*STAGES, "reaching")}
        if not isinstance(fingerprints, Fingerprints):
            fingerprints = Fingerprints(fingerprints, fingerprints)
        target = (scratch / mutant.path).resolve()
        if scratch.resolve() not in target.parents:
            raise RuntimeError(f"refusing to write {target}: outside the scratch copy {scratch}")
        original = target.read_bytes()
        try:
            target.write_bytes(mutant.apply(original))
            if known is None:
                rc, output, seconds = self.pytest(section, scratch, limits["conformance"])
                killed_by = _why(rc, output, limits["conformance"])
                if rc == 0 and section.plain_path:
                    rc, output, plain_seconds = self.pytest(section, scratch, limits["conformance"], extra_env=PLAIN_PATH_ENV)
                    seconds += plain_seconds
                    killed_by = f"plain path: {_why(rc, output, limits['conformance'])}" if rc != 0 else ""
                if rc == 0 and reaching:
                    rc, output, reach_seconds = self.pytest(section, scratch, limits["reaching"], files=reaching)
                    seconds += reach_seconds
                    killed_by = f"other sections' tests: {_why(rc, output, limits['reaching'])}" if rc != 0 else ""
                result = Result.of(mutant, section.name, _verdict(rc), seconds=seconds, fingerprint=fingerprints.conformance,
                                   killed_by=killed_by)  # fmt: skip
            else:
                result = Result(**{**asdict(known), "with_self_tests": "", "self_killed_by": "", "self_seconds": 0.0})
            if result.detected or not section.test_files(scratch, "self-tests"):
                result.with_self_tests = result.status
            else:
                rc, output, seconds = self.pytest(section, scratch, limits["self-tests"], "self-tests")
                result.with_self_tests = _verdict(rc)
                result.self_killed_by = _why(rc, output, limits["self-tests"])
                result.self_seconds = seconds
            result.self_fingerprint = fingerprints.self_tests
        finally:
            target.write_bytes(original)
        self.learn(result)
        return result


def _why(rc: int | None, output: str, limit: float) -> str:
    """What a run's verdict rests on: the first failing test, the time limit, or the run's error."""
    if rc is None:
        return f"no result in {limit:.0f}s"
    if rc == 0:
        return ""
    if rc in (1, 2, 3):
        return _first_failure(output)
    return f"pytest exit {rc}: {output[-500:]}"


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
    """The counts of one section's mutants by status, judged by the conformance tests alone
    (``counts``) and with the self-tests added (``with_self_tests``), and the time they took."""

    name: str
    total: int  # every mutant of the section (the sample is drawn from these)
    counts: Counter[str] = field(default_factory=Counter)
    with_self_tests: Counter[str] = field(default_factory=Counter)
    baseline_s: float | None = None  # the unmutated conformance run
    self_baseline_s: float | None = None  # the unmutated self-tests run
    seconds: float = 0.0  # spent running its mutants, both stages

    def add(self, result: Result) -> None:
        self.counts[result.status] += 1
        self.with_self_tests[result.with_self_tests or result.status] += 1
        self.seconds += result.seconds + result.self_seconds

    @property
    def mutants(self) -> int:
        return sum(self.counts[s] for s in STATUSES)

    @property
    def kill_rate(self) -> float | None:
        """The conformance tests' kill rate: the suite's power as a fork sees it."""
        return _rate(self.counts)

    @property
    def kill_rate_with_self_tests(self) -> float | None:
        return _rate(self.with_self_tests)


def _rate(counts: Counter[str]) -> float | None:
    judged = counts["killed"] + counts["timeout"] + counts["survived"] + counts["error"]
    return None if judged == 0 else 100.0 * (counts["killed"] + counts["timeout"]) / judged


def _pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:.1f}%"


def render_table(summaries: Sequence[SectionSummary], stage: str = "conformance") -> str:
    """section | mutants | killed | survived | timed out | equivalent | kill rate, plus a total row, for
    the verdicts of one stage (``"conformance"``: the conformance tests alone; ``"self-tests"``: with
    the self-tests added)."""
    rows = ["| section | mutants | killed | survived | timed out | equivalent | kill rate |", "|---|---|---|---|---|---|---|"]
    total: Counter[str] = Counter()
    for s in summaries:
        counts = s.counts if stage == "conformance" else s.with_self_tests
        total.update(counts)
        rows.append(_row(s.name, counts))
    if len(summaries) > 1:
        rows.append(_row("**all**", total))
    return "\n".join(rows)


def _row(name: str, c: Counter[str]) -> str:
    mutants = sum(c[s] for s in STATUSES)
    survived = c["survived"] + c["error"]
    return f"| {name} | {mutants} | {c['killed']} | {survived} | {c['timeout']} | {c['equivalent']} | {_pct(_rate(c))} |"


def render_report(summaries: Sequence[SectionSummary], results: Sequence[Result], header: str, notes: Sequence[str] = ()) -> str:
    """The markdown report: header, the conformance-only table (the suite's power), the table with the
    self-tests added, notes, and every conformance survivor with its original and mutated line and
    whether a self-test kills it."""
    parts = [header, "", "## Judged by conformance/ alone", "", render_table(summaries), "",
             "## With the self-tests (tests/reference/) added", "", render_table(summaries, "self-tests"), ""]  # fmt: skip
    parts += [f"- {n}" for n in notes]
    if notes:
        parts.append("")
    survivors = [r for r in results if r.status in ("survived", "error")]
    parts.append(f"## Survivors of the conformance tests ({len(survivors)})")
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
            if r.with_self_tests in ("killed", "timeout"):
                what += f"; a self-test kills it: {(r.self_killed_by.splitlines() or [''])[0]}"
            elif r.with_self_tests:
                what += "; the self-tests miss it too"
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
    p.add_argument("--resume", action="store_true", help="reuse verdicts of an earlier run that judged the same tree (see Fingerprints)")
    p.add_argument("--fail-under", type=float, default=None, metavar="PCT", help="exit 1 if a section's conformance-only kill rate is lower")
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


def _previous_results(journal: Path, fingerprints: Fingerprints, *, resume: bool) -> dict[str, Result]:
    """Mutant key -> its result from an earlier run whose conformance tests judged the same tree with
    the same arguments (``--resume``); the journal is removed otherwise, so a fresh run starts from
    nothing. The last line of a key wins."""
    previous: dict[str, Result] = {}
    if resume and journal.exists():
        for line in journal.read_text().splitlines():
            try:
                r = Result(**json.loads(line))
            except (TypeError, ValueError):
                continue
            if r.fingerprint == fingerprints.conformance and r.status != "error":
                previous[r.key] = r
    elif journal.exists():
        journal.unlink()
    return previous


@dataclass
class _Plan:
    """What the unmutated runs decided: the mutants to run with their time limits (and the conformance
    verdict already known, when only the self-tests are to run), and the results already known
    (equivalent, or from the journal)."""

    #: (mutant, its section, seconds per stage, its conformance verdict if known, other sections' files)
    todo: list[tuple[Mutant, Section, dict[str, float], Result | None, tuple[str, ...]]] = field(default_factory=list)
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
    fingerprints: Fingerprints,
    summaries: dict[str, SectionSummary],
) -> _Plan:
    """Run each stage of the unmutated suite once per section with mutants to run: it must pass, and its
    time sets the mutants' limit for that stage."""
    plan = _Plan()
    extra = args.rank_timeout + 30 if args.timeout_extra is None else args.timeout_extra
    for s in sections:
        pending: list[tuple[Mutant, Result | None]] = []
        for m in chosen[s.name]:
            known = previous.get(m.key)
            if m.key in equivalents.reasons:
                plan.results.append(Result.of(m, s.name, "equivalent", reason=equivalents.reasons[m.key], with_self_tests="equivalent"))
            elif known is not None and (known.detected or known.self_fingerprint == fingerprints.self_tests):
                plan.results.append(known)
                runner.learn(known)
            else:
                pending.append((m, known))
        if not pending:
            continue
        limits: dict[str, float] = {}
        # The conformance tests' unmutated run only where a mutant still needs their verdict (a resumed
        # run after a self-test changed needs the self-tests' alone).
        stages = STAGES if any(known is None for _, known in pending) else STAGES[1:]
        for stage in stages:
            files = s.test_files(scratch, stage)
            if not files:
                continue
            _log(f"[{s.name}] unmutated run of the {stage}: {' '.join(files)}")
            rc, output, seconds = runner.pytest(s, scratch, timeout=1800, stage=stage)
            if rc == 0 and stage == "conformance" and s.plain_path:
                _log(f"[{s.name}] unmutated run of the {stage} on the plain path ({' '.join(f'{k}={v}' for k, v in PLAIN_PATH_ENV.items())})")
                rc, output, plain_seconds = runner.pytest(s, scratch, timeout=1800, stage=stage, extra_env=PLAIN_PATH_ENV)
                seconds = max(seconds, plain_seconds)
            if stage == "conformance":
                summaries[s.name].baseline_s = seconds
            else:
                summaries[s.name].self_baseline_s = seconds
            if rc != 0:
                tail = "\n".join(output.strip().splitlines()[-25:])
                _log(f"[{s.name}] the unmutated {stage} do not pass (exit {rc}); its mutants are not run:\n{tail}")
                plan.notes.append(f"{s.name}: the unmutated {stage} failed (exit {rc}); its {len(pending)} mutants were not run")
                plan.broken.append(s.name)
                break
            limits[stage] = args.timeout_factor * seconds + extra
        else:
            # One parse of reference/ for the section, one lookup per mutated file (not per mutant).
            graph = import_graph(scratch)
            paths = {m.path for m, known in pending if known is None}
            reaching = {path: tuple(reaching_tests(scratch, s, path, graph=graph)) for path in paths}
            union = sorted({f for files in reaching.values() for f in files})
            if union:
                _log(f"[{s.name}] unmutated run of the other sections' conformance tests that reach its code: {' '.join(union)}")
                rc, output, seconds = runner.pytest(s, scratch, timeout=1800, files=union)
                if rc == 0:
                    limits["reaching"] = args.timeout_factor * seconds + extra
                else:
                    tail = "\n".join(output.strip().splitlines()[-25:])
                    _log(f"[{s.name}] the other sections' conformance tests do not pass unmutated (exit {rc}):\n{tail}")
                    plan.notes.append(f"{s.name}: the other sections' conformance tests failed unmutated (exit {rc}); "
                                      "its mutants were judged by its own alone")  # fmt: skip
                    reaching = {}
            shown = ", ".join(f"{stage} {limit:.0f}s" for stage, limit in limits.items())
            _log(f"[{s.name}] unmutated runs passed; {len(pending)} mutants, limits: {shown}")
            plan.todo += [(m, s, limits, known, reaching.get(m.path, ())) for m, known in pending]
    return plan


def _run_mutants(
    runner: Runner,
    todo: list[tuple[Mutant, Section, dict[str, float], Result | None, tuple[str, ...]]],
    scratches: list[Path],
    journal: Path,
    fingerprints: Fingerprints,
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
                    mutant, section, limits, known, reaching = queue.pop(0)
                    scratch = free.pop(0)
                    job = pool.submit(runner.run_mutant, mutant, section, scratch, limits, fingerprints, known, reaching)
                    running[job] = scratch
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
        summaries[r.section].add(r)
    ordered = [summaries[s.name] for s in sections]
    if args.mutant:
        scope = "the mutants asked for"
    elif args.sample is None:
        scope = "every mutant"
    else:
        scope = f"a sample of up to {args.sample} mutants per section (seed {args.seed})"
    header = (
        f"# Mutation testing of reference/\n\n{scope}; {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{jobs} job(s), {seconds:.0f}s. Kill rate = (killed + timed out) / (mutants - equivalent). Each mutant is "
        "judged by its section's conformance tests alone (what a fork running the suite sees), then, if it survives "
        "them, with the section's self-tests added."
    )
    for summary in ordered:
        ran = sum(summary.counts[k] for k in ("killed", "survived", "timeout", "error"))
        if ran:
            baseline = f"unmutated conformance run {summary.baseline_s:.1f}s, " if summary.baseline_s is not None else ""
            if summary.self_baseline_s is not None:
                baseline += f"self-tests {summary.self_baseline_s:.1f}s, "
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
            "with_self_tests": {k: s.with_self_tests[k] for k in STATUSES},
            "kill_rate_with_self_tests": s.kill_rate_with_self_tests,
            "baseline_s": s.baseline_s,
            "self_baseline_s": s.self_baseline_s,
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
    fingerprints = Fingerprints.of(root, files, pytest_args)
    jobs = max(1, args.jobs)
    scratches = [out / "work" / f"job{i}" for i in range(jobs)]
    for scratch in scratches:
        make_scratch(root, scratch, files)
    journal = out / "results.jsonl"
    previous = _previous_results(journal, fingerprints, resume=args.resume)
    summaries = {s.name: SectionSummary(s.name, len(everything[s.name])) for s in sections}
    runner = Runner(pytest_args)
    interrupted = False
    started = time.monotonic()
    plan = _Plan()

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_signal)
    try:
        plan = _plan(args, runner, scratches[0], sections, chosen, equivalents, previous, fingerprints, summaries)
        for done, r in enumerate(_run_mutants(runner, plan.todo, scratches, journal, fingerprints), start=1):
            plan.results.append(r)
            also = "" if r.detected else f" (with self-tests: {r.with_self_tests})"
            _log(f"[{done}/{len(plan.todo)}] {r.section} {r.status:8} {r.seconds + r.self_seconds:5.1f}s {r.path}:{r.line} "
                 f"{r.operator}: {r.description}{also}")
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
