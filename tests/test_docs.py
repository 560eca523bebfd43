"""The user documentation holds together: README.md stays a short page for users whose first commands
are the two that work on a fresh machine, every relative link of README.md and docs/*.md resolves (file
and heading anchor), every docs/ page is reachable from the README, and no page carries work history
(dated measurements, issue numbers)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
MAX_README_LINES = 250

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (a link there is not a link)."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: inline markup dropped, lower case, punctuation removed, spaces to
    hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path`` (a repeated heading gets ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    """The targets of the links in ``path``'s prose that point into this repository."""
    return [t for t in _LINK.findall(_prose(path.read_text())) if not _EXTERNAL.match(t)]


def broken_links(path: Path) -> list[str]:
    """Each relative link of ``path`` whose file does not exist, or whose ``#anchor`` is no heading of
    the markdown file it names, with the reason."""
    bad = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            bad.append(f"{target}: {resolved} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            bad.append(f"{target}: no heading of {resolved.name} has the anchor #{anchor}")
    return bad


def test_there_are_docs_pages() -> None:
    names = {p.name for p in DOCS.glob("*.md")}
    assert {"forks.md", "benchmarks.md", "torchrun.md", "power.md", "design.md"} <= names, sorted(names)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert relative_links(page) or page != README, "README.md links to nothing"
    assert broken_links(page) == [], f"{page.relative_to(REPO_ROOT)}: broken links"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    unlinked = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert unlinked == [], f"docs pages the README's links do not reach: {unlinked}"


def test_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines < MAX_README_LINES, f"README.md has {lines} lines; keep it under {MAX_README_LINES} and move the rest to docs/"


def test_readme_first_commands_are_the_fresh_machine_ones() -> None:
    first = re.search(r"^```[^\n]*\n(.*?)^```", README.read_text(), re.M | re.S)
    assert first is not None, "README.md has no code block"
    commands = re.findall(r"^\s*(make \S+)", first.group(1), re.M)
    assert commands[:2] == ["make conformance", "make test"], f"the README's first code block runs {commands}"


#: Work history that does not belong in user documentation: dated measurements and this project's own
#: issue numbers (upstream citations are written ``owner/repo#N`` and stay).
_HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b[Ii]ssues? \d+\b|(?<![\w/])#\d+\b")


#: Pages a tool writes: their report names come from the shipped known deviations' reasons, spelled as
#: each tracker spells them ("SkyRL PR #1960"), which the history check cannot tell from an issue here.
GENERATED = {DOCS / "compatibility.md"}


@pytest.mark.parametrize("page", [p for p in PAGES if p not in GENERATED], ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_no_work_history(page: Path) -> None:
    found = [f"line {n}: {line.strip()}" for n, line in enumerate(page.read_text().splitlines(), 1) if _HISTORY.search(line)]
    assert found == [], f"{page.relative_to(REPO_ROOT)}: dates or issue numbers"


def test_the_link_checker_sees_broken_links(tmp_path: Path) -> None:
    """The checks above can fail: a missing file, a missing anchor, a link in a code span (ignored)."""
    (tmp_path / "other.md").write_text("# A heading: `with code`\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-heading-with-code) [ok](other.md#twice-1) [ok](#local) [web](https://example.com/x)\n"
        "[gone](missing.md) [bad anchor](other.md#nope) `[code](missing-too.md)`\n\n# Local\n"
        "```\n[fenced](fenced-missing.md)\n```\n"
    )
    assert broken_links(page) == [
        f"missing.md: {tmp_path / 'missing.md'} does not exist",
        "other.md#nope: no heading of other.md has the anchor #nope",
    ]
    number = "12"  # spelled apart, so that a grep of the repository for issue numbers does not find this test
    assert _HISTORY.search("measured on 2026-11-23") and _HISTORY.search(f"see issue {number}") and _HISTORY.search(f"fixed in #{number}")
    assert not _HISTORY.search("pytorch/pytorch#12345") and not _HISTORY.search("[link](#anchor)")
