"""The suite against torch releases, each in a bare environment of its own, and the compatibility table.

    python -m tools.matrix run [--release 2.14.1 ...] [--impl reference,torch,torch-fsdp2] [--world-size 1,2]
    python -m tools.matrix run --release 2.10.0 --merge -- -k "other-mesh"   # rerun some tests, merge them in
    python -m tools.matrix render [--doc docs/compatibility.md]

``run`` builds this checkout's wheel once; then, per release, it makes a new venv, installs
``torch==<release>`` from the package registry and the wheel with only its declared dependencies (what
``pip install statedict-conformance`` gives a fork: no extras, no numpy unless declared), and runs the
installed suite from a directory that is not a checkout (``pytest --pyargs conformance``), writing
``<out>/results/torch-<release>.json`` (``--report-json``) and the log beside it. A missing dependency
or an API a release lacks therefore shows as what it is. The venv is removed afterwards (several GB
each: the registry's builds are CUDA builds, which run on the CPU) unless ``--keep``.

``render`` reads every result there and writes the requirement x release table and the known
deviations per release (``docs/compatibility.md``). It exits 1 if a release's run had a failure, an
error or a strict pass (a known deviation that no longer deviates), so ``make matrix`` fails where a
release is not green.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.mutation import checkout_files, make_scratch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / ".matrix"
DEFAULT_DOC = REPO_ROOT / "docs" / "compatibility.md"
#: The newest patch of every minor release from ``pyproject.toml``'s lower bound to the newest here.
RELEASES = ("2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1")
DEFAULT_IMPLS = "reference,torch,torch-fsdp2"
#: Outcomes that make a release red.
RED = ("failed", "error")


def _log(message: str) -> None:
    print(f"[matrix] {message}", file=sys.stderr, flush=True)


def build_wheel(out: Path) -> Path:
    """This checkout as a wheel in ``out/dist`` (rebuilt every run: it is what the releases install).
    Built from a copy of :func:`checkout_files`: setuptools reuses the checkout's ``build/`` directory,
    where a file removed from the checkout stays and would be packaged (a deleted test module ran on
    every release)."""
    dist = out / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="sdc-wheel-") as tmp:
        source = Path(tmp) / "src"
        make_scratch(REPO_ROOT, source, checkout_files(REPO_ROOT))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(source)],
                       check=True, timeout=600)
    (wheel,) = dist.glob("statedict_conformance-*.whl")
    return wheel


def suite_commit() -> str:
    """The checkout's commit, with ``+dirty`` when its tracked files differ from it: what a result
    measured. The compatibility page itself, which ``render`` rewrites, does not count."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", f":!{DEFAULT_DOC.relative_to(REPO_ROOT)}")
    return commit + ("+dirty" if changed else "")


def pip_install(venv: Path, *args: str, log: Path) -> None:
    """``pip install -q ARGS`` in ``venv``, its output appended to ``log``; raises on failure."""
    with log.open("a") as sink:
        sink.write(f"$ pip {' '.join(args)}\n")
        sink.flush()
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-cache-dir", *args],
                       check=True, stdout=sink, stderr=subprocess.STDOUT, timeout=3600)


def merge_rerun(whole: dict[str, Any], rerun: dict[str, Any]) -> dict[str, Any]:
    """A release's results with the tests of a rerun of some of them (``run --merge``) replaced by the
    rerun's outcomes; the rerun's run description (its known deviations) is the current one."""
    merged = {**whole, **{k: v for k, v in rerun.items() if k != "tests"}}
    merged["tests"] = {**whole.get("tests", {}), **rerun.get("tests", {})}
    return merged


def run_release(release: str, wheel: Path, out: Path, *, impls: str, world_sizes: str, pytest_args: Sequence[str], keep: bool,
                jobs: int = 2, merge: bool = False, commit: str | None = None) -> int:
    """Install ``torch==release`` and ``wheel`` into a new venv and run the installed suite there (its
    ``statedict-report run``, in ``jobs`` parts at once). With ``merge``, the run is a rerun of a
    selection (``pytest_args``, e.g. ``-k``) whose outcomes replace those in the release's existing
    results, and the meta file lists it. ``commit``: the suite commit ``wheel`` was built from (default:
    the checkout's now; a wheel built earlier in a run of several releases measured that one). Returns pytest's exit status (a failed install is reported as
    status 3 with its log)."""
    results = out / "results"
    results.mkdir(parents=True, exist_ok=True)
    whole = results / f"torch-{release}.json"
    meta_path = results / f"torch-{release}.meta.json"
    if merge and not whole.exists():
        _log(f"torch {release}: --merge needs an earlier run's {whole}")
        return 4
    log = results / (f"torch-{release}.rerun.log" if merge else f"torch-{release}.log")
    report = results / f"torch-{release}.rerun.json" if merge else whole
    log.write_text("")
    report.unlink(missing_ok=True)
    if merge:
        meta: dict[str, Any] = json.loads(meta_path.read_text()) if meta_path.exists() else {"commit": "?"}
        meta.setdefault("reruns", []).append({"commit": commit or suite_commit(), "selection": " ".join(pytest_args)})
    else:
        meta = {"commit": commit or suite_commit()}
    status = _install_and_run(release, wheel, out, log, report, impls=impls, world_sizes=world_sizes, pytest_args=pytest_args,
                              keep=keep, jobs=jobs)
    if merge and report.exists():
        whole.write_text(json.dumps(merge_rerun(json.loads(whole.read_text()), json.loads(report.read_text())), indent=1))
        report.unlink()
        meta_path.write_text(json.dumps(meta))
    elif not merge:
        meta_path.write_text(json.dumps(meta))
    return status


def _install_and_run(release: str, wheel: Path, out: Path, log: Path, report: Path, *, impls: str, world_sizes: str,
                     pytest_args: Sequence[str], keep: bool, jobs: int) -> int:
    venv = out / "venvs" / f"torch-{release}"
    shutil.rmtree(venv, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        try:
            pip_install(venv, f"torch=={release}", log=log)
            pip_install(venv, str(wheel), log=log)
        except subprocess.CalledProcessError:
            _log(f"torch {release}: install failed, see {log}")
            return 3
        with tempfile.TemporaryDirectory(prefix="matrix-cwd-") as elsewhere, log.open("a") as sink:
            command = [str(venv / "bin" / "python"), "-m", "conformance.cli.report", "run", "--impl", impls,
                       "--world-size", world_sizes, "--jobs", str(jobs), "--save", str(report), "--",
                       "--rerun-crashes", "torch,torch-fsdp2", *pytest_args]
            sink.write(f"$ {' '.join(command)}\n")
            sink.flush()
            done = subprocess.run(command, cwd=elsewhere, stdout=sink, stderr=subprocess.STDOUT)
        return done.returncode
    finally:
        if not keep:
            shutil.rmtree(venv, ignore_errors=True)


# -- render ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ReleaseRun:
    release: str
    data: dict[str, Any]
    commit: str = "?"  #: the suite's commit the run measured (``torch-<release>.meta.json``)
    #: reruns of selections merged into the results (``run --merge``): each ``{"commit", "selection"}``
    reruns: tuple[dict[str, str], ...] = ()

    @property
    def tests(self) -> dict[str, dict[str, Any]]:
        return self.data.get("tests", {})

    def red(self) -> list[tuple[str, dict[str, Any]]]:
        """Tests that make this release red: failures, errors, and strict passes of known deviations."""
        return [(tid, t) for tid, t in sorted(self.tests.items())
                if t.get("outcome") in RED or (t.get("outcome") == "xpassed" and t.get("strict"))]


def _version_key(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", release.split("+")[0])[:3])


def load_runs(results: Path) -> list[ReleaseRun]:
    runs = []
    for path in results.glob("torch-*.json"):
        if path.name.endswith(".meta.json"):
            continue
        release = path.stem[len("torch-"):]
        meta = path.with_name(f"torch-{release}.meta.json")
        info = json.loads(meta.read_text()) if meta.exists() else {}
        runs.append(ReleaseRun(release, json.loads(path.read_text()), info.get("commit", "?"), tuple(info.get("reruns", ()))))
    return sorted(runs, key=lambda r: _version_key(r.release))


def cell(outcomes: Counter[str]) -> str:
    """One requirement's outcomes on one release, for one adapter."""
    if not outcomes:
        return "-"
    red = outcomes["failed"] + outcomes["error"]
    if red:
        return f"**{red} failed**"
    ran = outcomes["passed"] + outcomes["xfailed"] + outcomes["xpassed"]
    if not ran:
        return "skip"
    known = outcomes["xfailed"]
    return f"{known} known" if known else "pass"


def by_requirement(run: ReleaseRun, impl: str) -> dict[str, Counter[str]]:
    """Requirement ID -> the outcomes of ``impl``'s tests naming it in ``run`` (a strict pass counts as failed)."""
    table: dict[str, Counter[str]] = defaultdict(Counter)
    for test in run.tests.values():
        if test.get("impl") != impl:
            continue
        outcome = str(test.get("outcome"))
        strict = outcome == "xpassed" and test.get("strict")
        for req in test.get("reqs", []):
            table[req]["failed" if strict else outcome] += 1  # a known deviation that no longer deviates is red
    return table


def requirement_ids(runs: Iterable[ReleaseRun]) -> list[str]:
    """Every requirement ID the runs' SPEC lists, in SPEC's section order."""
    ids: set[str] = set()
    for run in runs:
        ids.update(run.data.get("spec", {}))
    section_order = {s: i for i, s in enumerate(("HX", "FP", "SD", "OS", "ML", "AS"))}
    return sorted(ids, key=lambda r: (section_order.get(r.split("-")[0], 99), r.split("-")[0], int(re.sub(r"\D", "", r.split("-")[1]) or 0)))


def _skipped_apis(run: ReleaseRun, impl: str) -> list[str]:
    """Distinct skip reasons of ``impl``'s tests that name this release (an API the release lacks)."""
    version = run.data.get("torch", run.release).split("+")[0]
    reasons = {t.get("reason", "") for t in run.tests.values() if t.get("impl") == impl and t.get("outcome") == "skipped"}
    return sorted(r for r in reasons if version in r or "torch " in r and "lacks" in r)


def render(runs: Sequence[ReleaseRun], expected: Sequence[str] = RELEASES, current: str | None = None) -> str:
    releases = [r.release for r in runs]
    impls = sorted({i for r in runs for i in r.data.get("impls", [])}, key=lambda i: (i != "reference", i))
    lines = [
        "# Compatibility: the suite on each torch release",
        "",
        "Written by `make matrix` (`python -m tools.matrix`): every release below was installed from the",
        "package registry into a new venv together with this project's wheel and only its declared",
        "dependencies, and the installed suite ran there (`pytest --pyargs conformance`) on the CPU with gloo.",
        "Regenerate after a change to the suite or its known deviations; do not edit by hand.",
        "",
        "A cell gives, for the tests that name the requirement: `pass`, `N known` (N tests failed as a",
        "known deviation of that release says; see the list below), `skip` (none ran: an API the release",
        "lacks, or a capability the adapter does not have), or `N failed` (a release that is not green).",
        "",
        "## Runs",
        "",
        "| torch | suite at | world sizes | adapters | passed | known deviations | skipped | failed | strict passes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        counts = Counter(str(t.get("outcome")) for t in run.tests.values())
        strict = sum(1 for t in run.tests.values() if t.get("outcome") == "xpassed" and t.get("strict"))
        ws = ",".join(str(w) for w in run.data.get("world_sizes", []))
        suite_at = run.commit + "".join(f", rerun `{r.get('selection', '')}` at {r.get('commit', '?')}" for r in run.reruns)
        lines.append(f"| {run.data.get('torch', run.release)} | {suite_at} | {ws} | {', '.join(run.data.get('impls', []))} | {counts['passed']} | "
                     f"{counts['xfailed']} | {counts['skipped']} | {counts['failed'] + counts['error']} | {strict} |")
    stale = [run for run in runs if current is not None and run.commit != current]
    if stale:
        lines += ["", "Runs of another suite than the checkout this page was written from (" + str(current) + "): "
                  + ", ".join(f"{run.release} ({run.commit})" for run in stale)
                  + ". Their failures may have been pinned or fixed since; `make matrix MATRIX_RELEASES="
                  + ",".join(run.release for run in stale) + "` measures them again."]
    for impl in impls:
        lines += ["", f"## {impl}", "", "| requirement | " + " | ".join(releases) + " |", "|---|" + "---|" * len(releases)]
        per_release = [by_requirement(run, impl) for run in runs]
        for req in requirement_ids(runs):
            cells = [cell(table.get(req, Counter())) for table in per_release]
            if set(cells) == {"-"}:
                continue
            lines.append(f"| {req} | " + " | ".join(cells) + " |")
    lines += ["", "## Known deviations by release", "",
              "Each shipped entry that marked a failing test on some release, with the releases where it did",
              "(the entry's reason names the upstream report behind it).", ""]
    marked: dict[tuple[str, str], set[str]] = defaultdict(set)
    reasons: dict[tuple[str, str], str] = {}
    for run in runs:
        for test in run.tests.values():
            entry = test.get("entry")
            if test.get("outcome") == "xfailed" and isinstance(entry, dict):
                key = (str(test.get("impl")), str(entry.get("pattern")))
                marked[key].add(run.release)
                reasons[key] = str(entry.get("reason", ""))
    lines += ["| adapter | test pattern | releases | reason |", "|---|---|---|---|"]
    for (impl, pattern), held in sorted(marked.items()):
        span = ", ".join(r for r in releases if r in held)
        lines.append(f"| {impl} | `{pattern}` | {span} | {reasons[(impl, pattern)].replace('|', '/')} |")
    missing = [r for r in expected if r not in releases]
    if missing:
        lines += ["", "## Not yet run", "",
                  "Releases the matrix covers that have no result here: " + ", ".join(missing) + ".",
                  "`make matrix MATRIX_RELEASES=" + ",".join(missing) + "` runs them."]
    red = [(run.release, tid, t) for run in runs for tid, t in run.red()]
    if red:
        lines += ["", "## Not green", ""]
        lines += [f"- torch {release}: `{tid}` {t.get('outcome')}: {str(t.get('reason', ''))[:200]}" for release, tid, t in red]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the installed suite on each release")
    run.add_argument("--release", action="append", default=[], help=f"a torch release (repeatable; default {', '.join(RELEASES)})")
    run.add_argument("--impl", default=DEFAULT_IMPLS)
    run.add_argument("--world-size", default="1,2")
    run.add_argument("--keep", action="store_true", help="keep each release's venv")
    run.add_argument("--jobs", type=int, default=2, help="parts of the suite run at once per release (default 2)")
    run.add_argument("--merge", action="store_true",
                     help="rerun a selection (pytest args after --, e.g. -k) and merge its outcomes into the release's existing results")
    run.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    for p in (run, sub.add_parser("render", help="write the compatibility table from the results")):
        p.add_argument("--out", type=Path, default=DEFAULT_OUT)
        p.add_argument("--doc", type=Path, default=DEFAULT_DOC)
    args = parser.parse_args(argv)
    if args.command == "run":
        commit = suite_commit()  # what the wheel holds, whatever the checkout becomes during the runs
        wheel = build_wheel(args.out)
        for release in args.release or RELEASES:
            _log(f"torch {release}: installing and running")
            status = run_release(release, wheel, args.out, impls=args.impl, world_sizes=args.world_size,
                                 pytest_args=args.pytest_args, keep=args.keep, jobs=args.jobs, merge=args.merge, commit=commit)
            _log(f"torch {release}: pytest exit status {status}")
    runs = load_runs(args.out / "results")
    if not runs:
        _log(f"no results in {args.out / 'results'}")
        return 2
    args.doc.write_text(render(runs, current=suite_commit()))
    _log(f"wrote {args.doc}")
    red = [(run.release, tid) for run in runs for tid, _ in run.red()]
    for release, tid in red:
        _log(f"not green on torch {release}: {tid}")
    return 1 if red else 0


if __name__ == "__main__":
    sys.exit(main())
