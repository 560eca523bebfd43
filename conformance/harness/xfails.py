"""Expected-failures files: the known deviations of an implementation, as data.

Format: one entry a line, ``<test id, id prefix or glob> [flag ...]  # reason``; blank lines and lines
starting with ``#`` are ignored. An entry matches a test whose node id equals it, starts with it, or
matches it as an fnmatch glob. An adapter's own file applies only to the tests run against that adapter.

Flags (between the pattern and the reason):

``hangs``
    The deviation leaves ranks waiting until the rank timeout cuts them. The test is reported as an
    expected failure without being run (``--run-known-hangs`` runs it), so a known hang does not cost
    every run its timeout. Only for hangs: a test that fails promptly is run, so that it is seen to
    pass once the deviation is fixed.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["XfailEntry", "parse_xfails", "matches", "matches_at_any_world_size"]

#: The flags an entry may carry, with what each means (for the error on an unknown one).
FLAGS = {"hangs": "the test leaves ranks waiting until the timeout; not run unless --run-known-hangs"}

#: A world-size id segment of a test id (``ws2``) or of a glob (``ws[2-9]``).
_WORLD_SIZE = re.compile(r"ws(\d+|\[[^\]]*\])")


@dataclass(frozen=True)
class XfailEntry:
    pattern: str
    reason: str
    source: str  # "file:line", for the stale-entry warning
    impl: str | None = None  # only tests run against this adapter; None for all
    hangs: bool = False  # see the ``hangs`` flag above

    def matches(self, nodeid: str, impl: str | None) -> bool:
        if self.impl is not None and impl != self.impl:
            return False
        return matches(self.pattern, nodeid)

    @property
    def file_part(self) -> str:
        """The test file the entry is about (to tell a stale entry from an unselected one)."""
        return self.pattern.split("::", 1)[0]


def matches(pattern: str, nodeid: str) -> bool:
    return nodeid == pattern or nodeid.startswith(pattern) or fnmatch.fnmatchcase(nodeid, pattern)


def matches_at_any_world_size(pattern: str, nodeid: str) -> bool:
    """Whether ``pattern`` would match ``nodeid`` run at some world size.

    An entry for ``ws4`` tests is not stale in a run at ``--world-size 1,2``: it is only unselected.
    """
    return matches(_WORLD_SIZE.sub("ws*", pattern), _WORLD_SIZE.sub("ws*", nodeid))


def parse_xfails(path: Path, *, impl: str | None = None) -> list[XfailEntry]:
    """The entries of ``path``. A missing file is an error naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"expected-failures file {path} does not exist")
    entries = []
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        head, _, reason = line.partition("#")
        words = head.split()
        if not words:
            continue
        pattern, flags = words[0], words[1:]
        unknown = [flag for flag in flags if flag not in FLAGS]
        if unknown:
            known = "; ".join(f"{name}: {meaning}" for name, meaning in FLAGS.items())
            raise ValueError(f"{path}:{lineno}: unknown flag(s) {', '.join(map(repr, unknown))} after {pattern!r} (known: {known})")
        entries.append(
            XfailEntry(
                pattern=pattern,
                reason=reason.strip() or "listed in " + path.name,
                source=f"{path}:{lineno}",
                impl=impl,
                hangs="hangs" in flags,
            )
        )
    return entries
