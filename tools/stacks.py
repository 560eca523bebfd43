"""The suite against the checkpoint stacks built on torch, each in a venv of its own, and their verdicts.

    python -m tools.stacks run [--stack megatron-core ...] [--world-size 1,2] [-- PYTEST_ARGS]
    python -m tools.stacks render [--doc docs/stacks.md]

``run`` builds this checkout's wheel once; then, per stack of :data:`conformance.adapters.base.STACKS`,
it makes a new venv, installs the pinned torch (``--torch``, default the Makefile's ``TORCH_SPEC``), the
wheel with its declared dependencies and its ``models`` extra (transformers, for the real architectures),
and the stack as its adapter module says (``PIP_INSTALLS``: pip
argument lists, run in order), and runs the installed suite from a directory that is not a checkout
against that adapter alone, under the adapter module's ``ENVIRONMENT`` (``{venv}`` in a value is the
venv's path), writing ``<out>/results/<stack>.json`` and the log beside it. The venv is kept for
reruns (a stack's venv is 1-2 GB; ``--fresh`` rebuilds it, ``make clean`` removes ``.stacks``).

``render`` reads every result there and writes ``docs/stacks.md``: requirement x stack, each stack's
known deviations (its entries in ``conformance/xfails/<stack>.txt``: clauses, reason, upstream report
or reproduction), and what each stack does not provide (the skips, by reason). It exits 1 when a
stack's run has a failure that no entry explains, so ``make stacks`` fails where a verdict is not whole.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tools.matrix import RED, ReleaseRun, build_wheel, by_requirement, cell, pip_install, requirement_ids, suite_commit

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / ".stacks"
DEFAULT_DOC = REPO_ROOT / "docs" / "stacks.md"
DEFAULT_TORCH = "torch==2.13.0"


def _log(message: str) -> None:
    print(f"[stacks] {message}", file=sys.stderr, flush=True)


def stack_names() -> list[str]:
    from conformance.adapters.base import STACKS

    return list(STACKS)


def stack_module(name: str) -> Any:
    """The adapter module of stack ``name`` (importable without the stack installed)."""
    from conformance.adapters.base import STACKS

    return importlib.import_module(STACKS[name].partition(":")[0])


def stack_environment(name: str, venv: Path) -> dict[str, str]:
    """The environment variables stack ``name``'s adapter module asks its runs to have."""
    declared: dict[str, str] = getattr(stack_module(name), "ENVIRONMENT", {})
    return {key: value.replace("{venv}", str(venv)) for key, value in declared.items()}


def install(name: str, venv: Path, wheel: Path, torch_spec: str, log: Path, *, fresh: bool) -> None:
    """A venv at ``venv`` with ``torch_spec`` first (so that nothing else picks torch), this project's
    ``wheel`` and stack ``name``; an existing one is reused unless ``fresh`` (the wheel is reinstalled)."""
    if fresh:
        shutil.rmtree(venv, ignore_errors=True)
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        if torch_spec:
            pip_install(venv, torch_spec, log=log)
        for args in getattr(stack_module(name), "PIP_INSTALLS", ()):
            pip_install(venv, *args, log=log)
    pip_install(venv, "--force-reinstall", "--no-deps", str(wheel), log=log)
    # Its declared dependencies where the stack did not bring them, and the real architectures' configs
    # (the models extra: transformers), at the versions this checkout pins.
    pip_install(venv, "-c", str(REPO_ROOT / "constraints.txt"), f"{wheel}[models]", log=log)


def run_stack(name: str, wheel: Path, out: Path, *, torch_spec: str, world_sizes: str, pytest_args: Sequence[str], fresh: bool,
              commit: str) -> int:
    """Install stack ``name`` (see :func:`install`) and run the installed suite against its adapter.
    Returns the run's exit status (3 for a failed install, with its log)."""
    results = out / "results"
    results.mkdir(parents=True, exist_ok=True)
    log, report = results / f"{name}.log", results / f"{name}.json"
    log.write_text("")
    report.unlink(missing_ok=True)
    venv = out / "venvs" / name
    try:
        install(name, venv, wheel, torch_spec, log, fresh=fresh)
    except subprocess.CalledProcessError:
        _log(f"{name}: install failed, see {log}")
        return 3
    env = {**os.environ, **stack_environment(name, venv)}
    env.pop("PYTHONPATH", None)  # the installed suite, not this checkout
    with tempfile.TemporaryDirectory(prefix="stacks-cwd-") as elsewhere, log.open("a") as sink:
        command = [str(venv / "bin" / "python"), "-m", "conformance.cli.report", "run", "--impl", name,
                   "--world-size", world_sizes, "--jobs", "1", "--save", str(report), "--", *pytest_args]
        sink.write(f"$ {' '.join(command)}\n")
        sink.flush()
        done = subprocess.run(command, cwd=elsewhere, stdout=sink, stderr=subprocess.STDOUT, env=env)
    versions = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    (results / f"{name}.meta.json").write_text(json.dumps({"commit": commit, "freeze": versions.splitlines()}))
    return done.returncode


# -- render ---------------------------------------------------------------------------------------


def load_runs(results: Path) -> list[ReleaseRun]:
    """Every stack's results in ``results`` (a :class:`ReleaseRun` whose release is the stack's name)."""
    runs = []
    for name in stack_names():
        path = results / f"{name}.json"
        if not path.exists():
            continue
        meta_path = results / f"{name}.meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        data = json.loads(path.read_text())
        data["freeze"] = meta.get("freeze", [])
        runs.append(ReleaseRun(name, data, meta.get("commit", "?")))
    return runs


def _package_line(run: ReleaseRun) -> str:
    """The stack's own package and torch, as its venv had them."""
    module = stack_module(run.release)
    wanted = {args[-1].split("==")[0].lower() for args in getattr(module, "PIP_INSTALLS", ()) if args} | {"torch"}
    pins = [line for line in run.data.get("freeze", []) if line.split("==")[0].lower() in wanted]
    return ", ".join(pins) or "?"


def render(runs: Sequence[ReleaseRun]) -> str:
    names = [run.release for run in runs]
    lines = [
        "# Stacks: the suite on checkpoint stacks built on torch",
        "",
        "Written by `make stacks` (`python -m tools.stacks`): each stack was installed from the package",
        "registry into a venv of its own beside the pinned torch and this project's wheel, and the installed",
        "suite ran against its shipped adapter (`--impl <stack>`) on the CPU with gloo. Each stack's page in",
        "[docs/stacks/](stacks/) says what the adapter maps to what, what cannot run here and why, and a",
        "reproduction of each deviation that upstream has not been told about. Do not edit by hand.",
        "",
        "A cell gives, for the tests that name the requirement: `pass`, `N known` (N tests fail as the stack's",
        "known-deviations file says: see below), `skip` (none ran: a capability or format the stack does not",
        "have, see *Not provided*), or `N failed` (a failure no entry explains: the verdict is not whole).",
        "",
        "## Runs",
        "",
        "| stack | packages | suite at | world sizes | passed | known deviations | skipped | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        counts = Counter(str(t.get("outcome")) for t in run.tests.values())
        ws = ",".join(str(w) for w in run.data.get("world_sizes", []))
        lines.append(f"| [{run.release}](stacks/{run.release}.md) | {_package_line(run)} | {run.commit} | {ws} | {counts['passed']} | "
                     f"{counts['xfailed']} | {counts['skipped']} | {counts['failed'] + counts['error']} |")
    lines += ["", "## Requirement x stack", "", "| requirement | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    per_stack = [by_requirement(run, run.release) for run in runs]
    skipped_by_all = []
    for req in requirement_ids(runs):
        cells = [cell(table.get(req, Counter())) for table in per_stack]
        if set(cells) <= {"-"}:
            continue
        if set(cells) <= {"-", "skip"}:
            skipped_by_all.append(req)
            continue
        lines.append(f"| {req} | " + " | ".join(cells) + " |")
    if skipped_by_all:
        lines += ["", "Skipped by every stack (a capability none of them has, e.g. FlatParameter wrapping): "
                  + ", ".join(skipped_by_all) + "."]
    for run in runs:
        lines += ["", f"## {run.release}: known deviations", "",
                  "Each entry of its known-deviations file that marked a failing test, the clauses it fails, and the",
                  "reason (the upstream report, or where the reproduction is).", "",
                  "| tests | clauses | marked | reason |", "|---|---|---|---|"]
        marked: Counter[str] = Counter()
        about: dict[str, tuple[str, str]] = {}
        for test in run.tests.values():
            entry = test.get("entry")
            if test.get("outcome") == "xfailed" and isinstance(entry, dict):
                pattern = str(entry.get("pattern"))
                marked[pattern] += 1
                about[pattern] = (",".join(entry.get("clauses") or []) or "-", str(entry.get("reason", "")))
        for pattern, count in sorted(marked.items()):
            clauses, reason = about[pattern]
            lines.append(f"| `{pattern}` | {clauses} | {count} | {reason.replace('|', '/')} |")
        if not marked:
            lines.append("| (none) | | | |")
        skips = Counter(str(t.get("reason", ""))[:220] for t in run.tests.values() if t.get("outcome") == "skipped")
        lines += ["", f"### {run.release}: not provided", "", "The skips of its tests, by reason (a capability, option or format the stack",
                  "does not have, or a declaration of its adapter).", "", "| tests | reason |", "|---|---|"]
        lines += [f"| {count} | {reason.replace('|', '/')} |" for reason, count in skips.most_common(25)]
    red = [(run.release, tid, t) for run in runs for tid, t in run.red()]
    if red:
        lines += ["", "## Not whole", "", "Failures no entry explains (a new deviation to pin, or a defect of the suite):", ""]
        lines += [f"- {stack}: `{tid}` {t.get('outcome')}: {str(t.get('reason', ''))[:200]}" for stack, tid, t in red]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the installed suite against each stack")
    run.add_argument("--stack", action="append", default=[], help=f"a stack (repeatable; default all: {', '.join(stack_names())})")
    run.add_argument("--torch", default=os.environ.get("TORCH_SPEC", DEFAULT_TORCH), help="the torch to install first (pip spec)")
    run.add_argument("--world-size", default="1,2")
    run.add_argument("--fresh", action="store_true", help="rebuild each stack's venv")
    run.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    for p in (run, sub.add_parser("render", help="write docs/stacks.md from the results")):
        p.add_argument("--out", type=Path, default=DEFAULT_OUT)
        p.add_argument("--doc", type=Path, default=DEFAULT_DOC)
    args = parser.parse_args(argv)
    if args.command == "run":
        unknown = [s for s in args.stack if s not in stack_names()]
        if unknown:
            parser.error(f"unknown stack {unknown}: expected {stack_names()}")
        commit = suite_commit()
        wheel = build_wheel(args.out)
        for name in args.stack or stack_names():
            _log(f"{name}: installing and running")
            status = run_stack(name, wheel, args.out, torch_spec=args.torch, world_sizes=args.world_size,
                               pytest_args=args.pytest_args, fresh=args.fresh, commit=commit)
            _log(f"{name}: pytest exit status {status}")
    runs = load_runs(args.out / "results")
    if not runs:
        _log(f"no results in {args.out / 'results'}")
        return 2
    args.doc.write_text(render(runs))
    _log(f"wrote {args.doc}")
    red = [(run.release, tid) for run in runs for tid, t in run.red() if t.get("outcome") in RED]
    for stack, tid in red:
        _log(f"not whole on {stack}: {tid}")
    return 1 if red else 0


if __name__ == "__main__":
    sys.exit(main())
