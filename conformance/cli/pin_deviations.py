"""Propose pins for the entries of a known-deviations file from a run of the suite.

    statedict-pin-deviations RESULTS.json conformance/xfails/torch.txt [--write]

(``python -m conformance.cli.pin_deviations``; in a checkout also ``python -m tools.pin_deviations``.)

For each entry of the file that marked tests in the run (``--report-json``; its tests were expected
failures), the pin that every one of those failures satisfies (:mod:`conformance.harness.xfails`):
``clauses=`` the SPEC clauses they failed, ``raises=`` when every failing rank raised one exception
class, ``ranks=all`` or ``ranks=last`` when every test failed on exactly those ranks. It never pins
message text: with ``--repin`` it turns an older file's ``match=`` pins into ``clauses=``. Entries that are already pinned
(unless ``--repin``), flagged ``hangs`` in a run without ``--run-known-hangs``, removals, inactive or
that marked nothing are left as they are and listed. Prints
the proposals; ``--write`` rewrites the file in place with the pins between the pattern and the
reason. Review the result: a pin states what the deviation *is*, so it should be as narrow as the
deviation and no narrower.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conformance.harness.xfails import Pin, XfailEntry, parse_xfails, split_reason

__all__ = ["propose", "rewrite", "run_sources", "main"]

#: A world-size id segment, to know how many ranks a test ran on.
_WS = re.compile(r"[\[-]ws(\d+)[-\]]")


def _world_size(test_id: str) -> int | None:
    found = _WS.search(test_id)
    return int(found.group(1)) if found else None


def propose(entry: XfailEntry, tests: dict[str, dict[str, Any]]) -> Pin | None:
    """The pin that every failure of ``tests`` (the ones ``entry`` marked) satisfies; None if none can
    be stated (no failure recorded)."""
    failures = [(test_id, f) for test_id, test in tests.items() for f in test.get("failures", [])]
    if not failures:
        return None
    types = {f["type"] for _, f in failures}
    raises = types.pop() if len(types) == 1 else None
    clauses = sorted({f.get("clause") for _, f in failures}, key=str)
    # A failure of no clause (a rank that died or hung) is pinned by its type alone.
    pinned_clauses = tuple(clauses) if None not in clauses else None
    ranks = None
    sets = set()
    for test_id, test in tests.items():
        world = _world_size(test_id)
        failed = sorted(f["rank"] for f in test.get("failures", []) if f["rank"] is not None)
        if world is None or not failed:
            sets = {"controller"}
            break
        if world > 1:  # at world size 1 "all" and "last" are one rank: it tells them apart nowhere
            sets.add("all" if failed == list(range(world)) else "last" if failed == [world - 1] else "other")
    multi_rank = any((_world_size(t) or 1) > 1 for t in tests)
    if len(sets) == 1 and multi_rank and next(iter(sets)) in ("all", "last"):
        ranks = next(iter(sets))
    pin = Pin(raises=raises, ranks=ranks, clauses=pinned_clauses)
    return pin if pin else None


def _shell_word(text: str, *, quote: bool = False) -> str:
    """``text`` as one word of an entry line (shell quoting, as the parser reads it): bare when nothing
    in it needs quoting and ``quote`` is not asked for; else in single quotes (which keep everything),
    or double quotes (which keep a backslash unless it escapes \\ " $ or `), or shlex's own quoting."""
    if not quote and re.fullmatch(r"[^\s'\"#\\]+", text):
        return text
    if "'" not in text:
        return f"'{text}'"
    if '"' not in text and not re.search(r'\\[\\"$`]', text):
        return f'"{text}"'
    return shlex.quote(text)


def _pin_words(pin: Pin) -> str:
    words = []
    if pin.clauses:
        words.append("clauses=" + ",".join(pin.clauses))
    if pin.raises:
        words.append(f"raises={pin.raises}")
    if pin.match:
        words.append("match=" + _shell_word(pin.match, quote=True))
    if pin.ranks:
        words.append(f"ranks={pin.ranks}")
    return " ".join(words)


def rewrite(path: Path, pins: dict[int, Pin]) -> str:
    """The text of ``path`` with ``pins`` (by line number) in place of each line's pin words (any
    ``clauses=``/``raises=``/``match=``/``ranks=`` it had), before its reason; its flags and conditions kept."""
    lines = path.read_text(encoding="utf-8").splitlines()
    for lineno, pin in pins.items():
        line = lines[lineno - 1]
        head, _ = split_reason(line)
        tail = line[len(head):]
        words = shlex.split(head)
        kept = [words[0]] + [_shell_word(w) for w in words[1:] if not w.startswith(("clauses=", "raises=", "match=", "ranks="))]
        lines[lineno - 1] = f"{' '.join(kept[:1])}  {' '.join(kept[1:] + [_pin_words(pin)])}{'  ' + tail.lstrip() if tail else ''}"
    return "\n".join(lines) + "\n"


def _marking_source(test: dict[str, Any], repin: bool) -> str | None:
    """``path:line`` of the entry that marked ``test`` in its run (an expected failure; with ``repin``
    also a pinned entry whose test failed otherwise); None for a test no entry marked that way."""
    outcome = test.get("outcome")
    if outcome not in ("xfailed", "failed") or (outcome == "failed" and not repin):
        return None
    reason = test.get("reason") or ""
    if outcome == "failed" and not reason.startswith("known deviation failed differently"):
        return None
    recorded = (test.get("entry") or {}).get("source")
    if recorded:
        return str(recorded)
    found = (
        re.search(r"\[([^\[\]]+:\d+)(?:;[^\]]*)?\]$", reason) if outcome == "xfailed"
        else re.search(r"known deviation failed differently \(([^()]+?:\d+): ", reason)
    )
    return found.group(1) if found else None


def _same_path(source: str, path: Path) -> bool:
    return Path(source.rsplit(":", 1)[0]).resolve() == path.resolve()


def run_sources(entries: Sequence[XfailEntry], path: Path, payload: dict[str, Any], marked_sources: set[str]) -> tuple[dict[int, str], list[str]]:
    """For each entry of the file ``path`` (by line number), the source (``path:line``) the run recorded
    for it: the same path and line when the run read this file, else the run's entry with the same
    pattern (and the same line, when several files of the run hold that pattern), so that a copy of the
    file the run read is matched by content. Also the notes on entries that could not be matched."""
    run_entries = [e for e in payload.get("known_deviations") or [] if isinstance(e, dict)]
    known = {str(e.get("source")) for e in run_entries} | marked_sources
    found: dict[int, str] = {}
    notes: list[str] = []
    for entry in entries:
        lineno = int(entry.source.rsplit(":", 1)[1])
        own = next((s for s in known if _same_path(s, path) and s.rsplit(":", 1)[1] == str(lineno)), None)
        if own is not None:
            found[lineno] = own
            continue
        pattern = ("!" if entry.removes else "") + entry.pattern
        same = sorted({str(e["source"]) for e in run_entries if e.get("pattern") == pattern})
        if len(same) > 1:
            same = [s for s in same if s.rsplit(":", 1)[1] == str(lineno)] or same
        if len(same) == 1:
            found[lineno] = same[0]
        elif same:
            notes.append(f"{entry.source}: ambiguous: the run read this pattern at {', '.join(same)}; pass the file the run read")
    return found, notes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="statedict-pin-deviations", description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a --report-json result of a run that selected the file's adapter")
    parser.add_argument("xfails", type=Path, help="the known-deviations file (the one the run read, or a copy of it)")
    parser.add_argument("--write", action="store_true", help="rewrite the file with the proposed pins")
    parser.add_argument("--repin", action="store_true",
                        help="also re-derive the pins of pinned entries (from the tests they marked, and those that failed differently)")
    args = parser.parse_args(argv)
    try:
        payload = json.loads(args.results.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        print(f"cannot read results {args.results}: {exc}", file=sys.stderr)
        return 2
    try:
        entries = parse_xfails(args.xfails.resolve())
    except (OSError, ValueError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    by_source: dict[str, dict[str, dict[str, Any]]] = {}
    for test_id, test in payload.get("tests", {}).items():
        source = _marking_source(test, args.repin)
        if source is not None:
            by_source.setdefault(source, {})[test_id] = test
    sources, notes = run_sources(entries, args.xfails, payload, set(by_source))
    for note in notes:
        print(note)
    if entries and not sources:
        read = sorted({str(e.get("source", "")).rsplit(":", 1)[0] for e in payload.get("known_deviations") or []} |
                      {s.rsplit(":", 1)[0] for s in by_source})
        print(f"none of the entries of {args.xfails} is an entry of the run {args.results} (by path and line, or by pattern); "
              f"the run read: {', '.join(read) or 'no expected-failures file'}", file=sys.stderr)
        return 2
    pins: dict[int, Pin] = {}
    for entry in entries:
        lineno = int(entry.source.rsplit(":", 1)[1])
        tests = by_source.get(sources.get(lineno, ""), {})
        ran = any(test.get("failures") for test in tests.values())  # a hangs entry runs with --run-known-hangs only
        if (entry.pin and not args.repin) or (entry.hangs and not ran) or entry.removes or entry.exclude:
            why = (
                "pinned already" if entry.pin else "flagged hangs (not run: --run-known-hangs runs it)" if entry.hangs
                else "a removal" if entry.removes else "an exclusion of generated cases"
            )
            print(f"{entry.source}: left as it is: {why}")
            continue
        pin = propose(entry, tests) if tests else None
        if pin is None:
            why = "not an entry of this run" if lineno not in sources else "it marked no test that failed in this run" if not tests else "no failure recorded"
            print(f"{entry.source}: no pin: {why}")
            continue
        pins[lineno] = pin
        print(f"{entry.source}: {_pin_words(pin)}   ({len(tests)} tests)")
    if args.write:
        args.xfails.write_text(rewrite(args.xfails, pins), encoding="utf-8")
        print(f"wrote {len(pins)} pins into {args.xfails}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
