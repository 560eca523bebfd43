"""Expected-failures files: the known deviations of an implementation, as data.

Format: one entry a line, ``<pattern> [word ...]  # reason``; blank lines and lines starting with
``#`` are ignored. The pattern is a test id, an id prefix or an fnmatch glob; a pattern starting with
``!`` *removes* entries inherited from a base adapter (below). The words between the pattern and the
reason (shell quoting, so a regex may hold spaces or ``#`` inside quotes):

Strictness. A test an entry marks must fail: one that passes is a failure of the run ("known deviation
no longer deviates"), naming the entry (file, line, pattern) to remove, or to cancel with a ``!`` line
in the derived adapter's own file (or a ``--xfails`` file), like pytest's ``xfail_strict``. So a
regression that happens to make a known deviation pass (another bug cancelling it) is never read as
a fix.

``flaky``
    The deviation depends on timing (a race): the test may pass. A pass is reported as XPASS and does
    not fail the run. Only for deviations that really come and go between runs of the same build.
``hangs``
    The deviation leaves ranks waiting until the rank timeout cuts them. The test is reported as an
    expected failure without being run (``--run-known-hangs`` runs it, strictly). Only for hangs: a
    test that fails promptly is run, so that it is seen to pass once the deviation is fixed.

Exclusions: ``exclude=NAME`` (instead of flags and pins) leaves the family of generated cases ``NAME``
out of the test's drawn domain for this adapter (:data:`conformance.generated.CASE_FAMILIES`; the test
names the families it draws with ``@pytest.mark.case_families(...)``): the test still runs, and checks
every other case. Every exclusion that matches a test applies (not only the first entry), and they are
inherited, overridden and ``!``-cancelled like any entry; ``!pattern exclude=NAME`` cancels only that
exclusion, a plain ``!pattern`` every inherited entry of the tests it matches.

Pins: what failure is expected. A test that fails otherwise is reported as a failure ("known
deviation failed differently: expected ..., got ..."), so that a known deviation cannot hide another
regression in the same test.

``clauses=ML-13.b,ML-13.c``
    Every failure is of one of these clauses of SPEC.md: the clause its assertion named
    (:func:`conformance.asserts.clause`, :func:`conformance.asserts.check_each`), else the test's
    requirement (``ML-5``; several joined by ``+``: ``ML-2+ML-8``). A test checks each clause even
    when another failed, so a deviation pinned to one clause does not hide a regression in another.
    A rank that died or hung failed no clause: ``raises=DIED``/``raises=HUNG`` (or ``ranks=``) pins it.
``raises=Name``
    Every failing rank's exception is of class ``Name`` (or derives from it). ``Failed`` is the
    suite's own assertion; ``HUNG`` and ``DIED`` are a rank that did not answer or died.
``match="regex"``
    Every failing rank's message contains a match of ``regex`` (``re.search``, ``re.DOTALL``). Kept so
    that older files keep working; a message is the suite's wording, which may change: pin
    ``clauses=`` instead (``statedict-pin-deviations RESULTS FILE --repin --write`` rewrites a file's
    pins from a run). The shipped files use none.
``ranks=all|last|not-last|0,2``
    Exactly these ranks fail: every rank of the test's world, the last one, all but the last, or a
    list. (A test run on the controller has no ranks: ``ranks=`` is an error there.)

Conditions: where the deviation holds. An entry whose conditions do not hold is inactive: it marks
nothing and is not reported stale; the report header counts active and inactive entries.

``torch<2.13`` (any PEP 440 specifier set after ``torch``: ``torch>=2.11,<2.13``)
    The installed torch's version (pre-releases and local builds included: ``2.14.0a0+git`` is 2.14).
``backend=gloo|nccl``
    The test's process-group backend (a test on the controller has none, so such an entry does not
    apply to it).
``device=cpu|cuda``
    The device the test's ranks use (``cuda`` with nccl).

Whom an entry applies to. A ``--xfails`` file applies to every test. An adapter's file
(``Adapter.xfails_file``) applies to the tests run against that adapter *and against adapters derived
from it*: its patterns are written with the adapter's own name in test ids (``[ws2-torch-...]``), and
for a derived adapter (``class MyFork(TorchAdapter): name = "myfork"``) that segment of the test id is
read as the base adapter's name before matching. A derived adapter's own file comes first: its entries
override inherited ones for the tests they match, and its ``!pattern`` lines make inherited entries
not apply to the tests they match (the fork fixed that deviation). The patterns of a derived adapter's own
file may be written with its own name or with the name of any adapter it derives from (a line copied
from ``torch.txt`` works in ``class MyFork(TorchAdapter)``'s file as it is).
"""

from __future__ import annotations

import fnmatch
import functools
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from conformance.harness.failures import DIED, HUNG, Failure

__all__ = ["Pin", "Condition", "XfailEntry", "parse_xfails", "matches", "matches_at_any_world_size", "as_run_by", "split_reason"]

#: Flags (words without ``=``) an entry may carry, with what each means (for the error on an unknown one).
FLAGS = {
    "hangs": "the test leaves ranks waiting until the timeout; not run unless --run-known-hangs",
    "flaky": "the deviation depends on timing: a pass is an XPASS, not a failure of the run",
}
#: Keys of ``key=value`` words, with what each means.
KEYS = {
    "clauses": "the SPEC clauses the test fails, like ML-13.b,ML-13.c",
    "raises": "exception class name every failing rank raises",
    "match": "regex every failing rank's message contains",
    "ranks": "which ranks fail: all, last, not-last or a list like 0,2",
    "backend": "gloo or nccl",
    "device": "cpu or cuda",
    "exclude": "a family of generated cases not drawn for this adapter (conformance.generated.CASE_FAMILIES)",
}
_BACKENDS = ("gloo", "nccl")
_DEVICES = ("cpu", "cuda")
_RANK_SETS = ("all", "last", "not-last")
#: The name of a family of generated cases (``exclude=``).
_FAMILY = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
#: One clause of ``clauses=``: a clause ID (``ML-13.b``), a requirement (``ML-5``), or the requirements of
#: a test that names several, joined by ``+`` (``ML-2+ML-8``).
_CLAUSE = re.compile(r"[A-Z]{2}-\d+(\.[a-z])?(\+[A-Z]{2}-\d+)*")

#: A world-size id segment of a test id (``ws2``) or of a glob (``ws[2-9]``).
_WORLD_SIZE = re.compile(r"ws(\d+|\[[^\]]*\])")
#: A torch version condition: ``torch`` followed by a specifier set.
_TORCH_CONDITION = re.compile(r"torch\s*((?:[<>=!~]=?|===?)\s*\S+)")


@dataclass(frozen=True)
class Pin:
    """What failure a known deviation is: each part None when not pinned."""

    raises: str | None = None
    match: str | None = None
    ranks: str | None = None
    clauses: tuple[str, ...] | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.raises, self.match, self.ranks, self.clauses))

    def describe(self) -> str:
        parts = []
        if self.clauses is not None:
            parts.append("clauses=" + ",".join(self.clauses))
        if self.raises is not None:
            parts.append(f"raises={self.raises}")
        if self.match is not None:
            parts.append(f"match={self.match!r}")
        if self.ranks is not None:
            parts.append(f"ranks={self.ranks}")
        return " ".join(parts)

    def expected_ranks(self, world_size: int) -> list[int] | None:
        if self.ranks is None:
            return None
        if self.ranks == "all":
            return list(range(world_size))
        if self.ranks == "last":
            return [world_size - 1]
        if self.ranks == "not-last":
            return list(range(world_size - 1))
        return sorted(int(r) for r in self.ranks.split(","))

    def mismatch(self, failures: Sequence[Failure], world_size: int | None) -> str | None:
        """None when ``failures`` are the pinned failure; else what differs, as
        ``expected ..., got ...``. No failure at all is not a mismatch (the test passed)."""
        if not failures:
            return None
        problems = []
        if self.ranks is not None:
            got = sorted({f.rank for f in failures if f.rank is not None})
            want = self.expected_ranks(world_size) if world_size is not None else None
            if want is None:
                problems.append(f"ranks={self.ranks}, but the test ran on the controller")
            elif got != want:
                problems.append(f"failing ranks {want} ({self.ranks}), got {got}")
        for failure in failures:
            if self.clauses is not None and failure.clause not in self.clauses and not failure.is_a(DIED) and not failure.is_a(HUNG):
                problems.append(f"a failure of {' or '.join(self.clauses)}, got {failure.headline()}")
            elif self.raises is not None and not failure.is_a(self.raises):
                problems.append(f"{self.raises}, got {failure.headline()}")
            elif self.match is not None and not re.search(self.match, failure.message, re.DOTALL):
                problems.append(f"a message matching {self.match!r}, got {failure.headline()}")
        if not problems:
            return None
        return "expected " + "; expected ".join(problems)


@dataclass(frozen=True)
class Condition:
    """Where an entry holds; each part None when the entry holds everywhere in that respect."""

    torch: str | None = None  # a PEP 440 specifier set, e.g. "<2.13" or ">=2.11,<2.13"
    backend: str | None = None
    device: str | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.torch, self.backend, self.device))

    def describe(self) -> str:
        parts = []
        if self.torch is not None:
            parts.append(f"torch{self.torch}")
        if self.backend is not None:
            parts.append(f"backend={self.backend}")
        if self.device is not None:
            parts.append(f"device={self.device}")
        return " ".join(parts)

    def holds_for_torch(self, torch_version: str) -> bool:
        return self.torch is None or _release_in(torch_version, self.torch)

    def holds(self, torch_version: str, backend: str | None) -> bool:
        """Whether the entry applies to a test run with ``backend`` (None: on the controller)."""
        if not self.holds_for_torch(torch_version):
            return False
        if self.backend is not None and backend != self.backend:
            return False
        if self.device is not None:
            device = None if backend is None else ("cuda" if backend == "nccl" else "cpu")
            if device != self.device:
                return False
        return True


@dataclass(frozen=True)
class XfailEntry:
    pattern: str
    reason: str
    source: str  # "file:line", for messages and the stale-entry warning
    impl: str | None = None  # the adapter name its patterns are written for; None: every test
    hangs: bool = False  # see the ``hangs`` flag above
    pin: Pin = field(default_factory=Pin)
    when: Condition = field(default_factory=Condition)
    removes: bool = False  # a ``!pattern`` line: inherited entries do not apply to what it matches
    depth: int = 0  # 0: a --xfails file; 1 + the adapter class's distance from the adapter run (ordering)
    flaky: bool = False  # see the ``flaky`` flag above: a pass does not fail the run
    exclude: str | None = None  # ``exclude=NAME``: a family of generated cases, not an expected failure
    #: Names of the adapters ``impl`` derives from: its patterns may be written with them too.
    aliases: tuple[str, ...] = ()

    def matches(self, nodeid: str) -> bool:
        """Whether the entry's pattern matches ``nodeid`` (already read as run by ``impl``: :func:`as_run_by`)."""
        return matches(self.pattern, nodeid)

    def matches_test(self, test_id: str, run_name: str | None) -> bool:
        """Whether the entry applies to the test ``test_id`` run against the adapter named ``run_name``
        (None: a test of no adapter): the id is read as run by the entry's adapter, or by any adapter
        that one derives from (:attr:`aliases`)."""
        # Every test of a run is tried against every entry: most are ruled out here, by the pattern's
        # text before its first wildcard or bracket, which reading the id as run by another adapter
        # (only the part inside the brackets changes) leaves as it is.
        if not test_id.startswith(_literal_prefix(self.pattern)):
            return False
        if self.impl is None or run_name is None:
            return self.matches(test_id)
        return any(self.matches(as_run_by(test_id, run_name, name)) for name in (self.impl, *self.aliases))

    @property
    def kind(self) -> str:
        """How the entry reads: an expected failure, an exclusion, or a removal of either."""
        if self.removes:
            return f"removal of exclusion {self.exclude}" if self.exclude else "removal"
        return f"exclusion {self.exclude}" if self.exclude else "expected failure"

    @property
    def line(self) -> str:
        """The entry as a line of its file would start (pattern, flags, pins, exclusion): for messages."""
        words = [("!" if self.removes else "") + self.pattern]
        words += [flag for flag, on in (("hangs", self.hangs), ("flaky", self.flaky)) if on]
        if self.pin:
            words.append(self.pin.describe())
        if self.exclude:
            words.append(f"exclude={self.exclude}")
        if self.when:
            words.append(self.when.describe())
        return " ".join(words)

    @property
    def file_part(self) -> str:
        """The test file the entry is about (to tell a stale entry from an unselected one)."""
        return self.pattern.split("::", 1)[0]


def matches(pattern: str, nodeid: str) -> bool:
    return nodeid == pattern or nodeid.startswith(pattern) or fnmatch.fnmatchcase(nodeid, pattern)


@functools.cache
def _literal_prefix(pattern: str) -> str:
    """The text every id ``pattern`` matches (:func:`matches`) starts with: up to its first ``*``, ``?``
    or ``[``."""
    return re.split(r"[*?\[]", pattern, maxsplit=1)[0]


@functools.cache
def _release_in(torch_version: str, specifier: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    # A local build (2.13.0+cu130) and a pre-release (2.14.0a0) count as their release.
    return Version(Version(torch_version).base_version) in SpecifierSet(specifier)


def matches_at_any_world_size(pattern: str, nodeid: str) -> bool:
    """Whether ``pattern`` would match ``nodeid`` run at some world size.

    An entry for ``ws4`` tests is not stale in a run at ``--world-size 1,2``: it is only unselected.
    """
    return matches(_WORLD_SIZE.sub("ws*", pattern), _WORLD_SIZE.sub("ws*", nodeid))


def as_run_by(nodeid: str, run_name: str, entry_name: str) -> str:
    """``nodeid`` of a test run against adapter ``run_name``, with that adapter's id segment read as
    ``entry_name`` (the base adapter an inherited entry was written for). The adapter's id is the
    first ``-``-separated segment inside the brackets that equals its name."""
    if run_name == entry_name or "[" not in nodeid:
        return nodeid
    head, _, params = nodeid.partition("[")
    found = re.search(rf"(?:^|-){re.escape(run_name)}(?=-|\]$)", params)
    if found is None:
        return nodeid
    start = found.start() + (1 if found.group(0).startswith("-") else 0)
    return f"{head}[{params[:start]}{entry_name}{params[found.end():]}"


def split_reason(line: str) -> tuple[str, str]:
    """``line`` cut at its first ``#`` outside quotes: (words, reason)."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            if char == quote:
                quote = None
        elif char in "\"'":
            quote = char
        elif char == "#":
            return line[:index], line[index + 1 :].strip()
    return line, ""


def _parse_words(words: list[str], where: str) -> tuple[set[str], Pin, Condition, str | None]:
    flags: set[str] = set()
    exclude: str | None = None
    pin: dict[str, str] = {}
    cond: dict[str, str] = {}
    for word in words:
        torch_condition = _TORCH_CONDITION.fullmatch(word)
        if word in FLAGS:
            flags.add(word)
        elif torch_condition is not None:
            spec = torch_condition.group(1).replace(" ", "")
            try:
                from packaging.specifiers import SpecifierSet

                SpecifierSet(spec)
            except Exception as exc:  # packaging's InvalidSpecifier
                raise ValueError(f"{where}: {word!r} is not a torch version condition like torch<2.13 ({exc})") from None
            cond["torch"] = spec
        elif "=" in word:
            key, _, value = word.partition("=")
            if key not in KEYS:
                known = "; ".join(f"{k}=: {v}" for k, v in KEYS.items())
                raise ValueError(f"{where}: unknown key {key!r} in {word!r} (known: {known}; and torch<version)")
            if not value:
                raise ValueError(f"{where}: {word!r} has no value")
            if key == "match":
                try:
                    re.compile(value)
                except re.error as exc:
                    raise ValueError(f"{where}: match={value!r} is not a regex: {exc}") from None
            if key == "clauses":
                bad = [c for c in value.split(",") if not _CLAUSE.fullmatch(c)]
                if bad:
                    raise ValueError(f"{where}: clauses={value!r}: {', '.join(map(repr, bad))} is not a clause ID like ML-13.b, ML-5 or ML-2+ML-8")
            if key == "ranks" and value not in _RANK_SETS and not re.fullmatch(r"\d+(,\d+)*", value):
                raise ValueError(f"{where}: ranks={value!r}: expected all, last, not-last or a list like 0,2")
            if key == "backend" and value not in _BACKENDS:
                raise ValueError(f"{where}: backend={value!r}: expected one of {', '.join(_BACKENDS)}")
            if key == "device" and value not in _DEVICES:
                raise ValueError(f"{where}: device={value!r}: expected one of {', '.join(_DEVICES)}")
            if key == "exclude":
                if not _FAMILY.fullmatch(value):
                    raise ValueError(f"{where}: exclude={value!r}: expected the name of a family of generated cases, like hybrid-shard-replicas")
                exclude = value
                continue
            (pin if key in ("raises", "match", "ranks", "clauses") else cond)[key] = value
        else:
            known = "; ".join(f"{name}: {meaning}" for name, meaning in FLAGS.items())
            raise ValueError(f"{where}: unknown flag {word!r} (known: {known}; or key=value: {', '.join(KEYS)}; or torch<version)")
    clauses = pin.pop("clauses", None)
    return flags, Pin(**pin, clauses=tuple(clauses.split(",")) if clauses is not None else None), Condition(**cond), exclude


def parse_xfails(path: Path, *, impl: str | None = None, depth: int = 0, aliases: Sequence[str] = ()) -> list[XfailEntry]:
    """The entries of ``path``, written for adapter ``impl`` (None: for every test) or, in test ids,
    for any of the adapters ``impl`` derives from (``aliases``). A missing file or a malformed line is
    an error naming the file (and line)."""
    if not path.is_file():
        raise FileNotFoundError(f"expected-failures file {path} does not exist")
    entries = []
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{lineno}"
        head, reason = split_reason(line)
        try:
            words = shlex.split(head)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc} in {head.strip()!r}") from None
        if not words:
            continue
        pattern, rest = words[0], words[1:]
        removes = pattern.startswith("!")
        pattern = pattern[1:] if removes else pattern
        if not pattern:
            raise ValueError(f"{where}: '!' needs a pattern after it")
        flags, pin, when, exclude = _parse_words(rest, where)
        if removes and (flags or pin):
            raise ValueError(f"{where}: a removal (!{pattern}) takes no flags or pins, only conditions (and exclude=NAME to cancel one exclusion)")
        if exclude is not None and (flags or pin) and not removes:
            raise ValueError(f"{where}: an exclusion (exclude={exclude}) takes no flags or pins: its cases are not drawn, nothing fails")
        entries.append(
            XfailEntry(
                pattern=pattern,
                reason=reason or "listed in " + path.name,
                source=where,
                impl=impl,
                hangs="hangs" in flags,
                pin=pin,
                when=when,
                removes=removes,
                depth=depth,
                flaky="flaky" in flags,
                exclude=exclude,
                aliases=tuple(a for a in aliases if a != impl) if impl is not None else (),
            )
        )
    return entries
