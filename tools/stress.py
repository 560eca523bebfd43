"""``make stress``: run the suite several times with fresh random examples and glibc's heap checks, and
report every test that failed in any run (a flaky test, or memory corrupted at a moment that depends
on timing or layout, fails some runs only).

Each run is ``pytest conformance tests`` with the ``stress`` hypothesis profile and its own
``--hypothesis-seed``, under glibc's heap checks (:func:`heap_check_env`: abort on a detected heap
inconsistency, a write past a block's end among them) and ``MALLOC_PERTURB_`` set to a different byte
each run (freed and fresh memory filled with it, so a use after free or an uninitialised read sees
garbage). Rank processes inherit the environment. A rank killed by an abort shows as a failed test ("the rank
process died (signal 6)").

    python -m tools.stress --runs 5 [--world-size 1,2] [--impl reference] [--profile thorough] [-- pytest args]

Prints, per failing test, in how many runs it failed and the first line of each distinct message, and
exits 1 if any test failed in any run (0 otherwise). Each run's JUnit XML stays in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Failure", "failures_of", "heap_check_env", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent
#: glibc's per-thread cache hands a freed block back without looking at its neighbours, so a write
#: past a block's end goes unseen until the block's memory is consolidated, often at exit or never.
#: With the cache off every free checks the block and the next one's header, at the free. (Since
#: glibc 2.34 ``MALLOC_CHECK_`` does nothing unless ``libc_malloc_debug.so`` is preloaded, which was
#: no better here at finding an overflow and made the suite several times slower: the cache is the check.)
NO_TCACHE = "glibc.malloc.tcache_count=0"


@dataclass
class Failure:
    """One test that failed in some runs."""

    test: str
    runs: list[int] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)


def failures_of(junit_xml: Path) -> dict[str, str]:
    """Test id -> first line of its failure or error, from one run's JUnit XML."""
    out: dict[str, str] = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
                out[name] = (node.get("message") or (node.text or "")).strip().splitlines()[0][:200] if (node.get("message") or node.text) else tag
    return out


def heap_check_env(perturb: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) with glibc's heap checks on: the per-thread cache off
    (:data:`NO_TCACHE`, added to any other ``GLIBC_TUNABLES``), ``MALLOC_CHECK_=3`` (glibc before 2.34)
    and ``MALLOC_PERTURB_=perturb``."""
    env = dict(os.environ if environ is None else environ)
    env.update({"MALLOC_CHECK_": "3", "MALLOC_PERTURB_": str(perturb)})
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.tcache_count=")]
    env["GLIBC_TUNABLES"] = ":".join([*tunables, NO_TCACHE])
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.stress", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="how many runs (default 5)")
    parser.add_argument("--world-size", default="1,2")
    parser.add_argument("--impl", default=None)
    parser.add_argument("--seed", type=int, default=None, help="seeds the runs' hypothesis seeds and MALLOC_PERTURB_ bytes")
    parser.add_argument("--profile", default="stress", help="hypothesis profile (default stress; thorough draws more examples)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".stress")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments (default: conformance tests)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    seen: dict[str, Failure] = {}
    tests_per_run: list[int] = []
    for run in range(1, args.runs + 1):
        seed, perturb = rng.randrange(2**31), rng.randrange(1, 256)
        xml = args.out / f"run{run}.xml"
        command = [sys.executable, "-m", "pytest", *(args.pytest_args or ["conformance", "tests"]), "--world-size", args.world_size,
                   "--hypothesis-profile", args.profile, f"--hypothesis-seed={seed}", f"--junitxml={xml}", "-q", "-p", "no:cacheprovider"]
        if args.impl:
            command += ["--impl", args.impl]
        env = heap_check_env(perturb)
        print(f"run {run}/{args.runs}: hypothesis seed {seed}, MALLOC_PERTURB_={perturb}", flush=True)
        done = subprocess.run(command, cwd=REPO_ROOT, env=env)
        if not xml.exists():
            seen.setdefault("<the pytest run itself>", Failure("<the pytest run itself>")).runs.append(run)
            seen["<the pytest run itself>"].messages.append(f"exit status {done.returncode}, no report written")
            continue
        root = ET.parse(xml).getroot()
        tests_per_run.append(sum(int(s.get("tests", 0)) for s in root.iter("testsuite")))
        for test, message in failures_of(xml).items():
            failure = seen.setdefault(test, Failure(test))
            failure.runs.append(run)
            if message not in failure.messages:
                failure.messages.append(message)
    print(f"\n{args.runs} runs, {tests_per_run} tests per run, {len(seen)} test(s) failed in some run")
    for failure in sorted(seen.values(), key=lambda f: (-len(f.runs), f.test)):
        print(f"  {failure.test}: failed in runs {failure.runs} of {args.runs}")
        for message in failure.messages[:3]:
            print(f"      {message}")
    return 1 if seen else 0


if __name__ == "__main__":
    sys.exit(main())
