"""HX-11: every requirement in SPEC.md is checked by a test, and every ID a test names exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.harness.requirements import REQ_ID, SPEC_PATH, clause_letters, clauses_named_in, ids_named_by_tests, load_clauses, load_spec
from conformance.harness.xfails import parse_xfails

ROOT = Path(__file__).resolve().parent.parent
TEST_FILES = sorted(ROOT.glob("conformance/**/test_*.py")) + sorted(ROOT.glob("tests/**/test_*.py"))
#: Where the suite names clauses: its tests and their support modules (a check may live in a helper).
SUITE_FILES = sorted(p for p in ROOT.glob("conformance/*.py"))
XFAILS_FILES = sorted(ROOT.glob("conformance/xfails/*.txt"))


@pytest.mark.req("HX-11")
def test_every_requirement_has_a_test() -> None:
    spec = load_spec()
    named = ids_named_by_tests(TEST_FILES)
    untested = [req for req in spec if req not in named]
    assert not untested, f"requirements in {SPEC_PATH.name} that no test names: {untested}"


@pytest.mark.req("HX-11")
def test_every_named_id_is_in_the_spec() -> None:
    spec = load_spec()
    named = ids_named_by_tests(TEST_FILES)
    unknown = {req: files for req, files in named.items() if req not in spec}
    assert not unknown, f"IDs named by tests but missing from {SPEC_PATH.name}: {unknown}"


@pytest.mark.req("HX-11")
def test_spec_ids_are_well_formed_and_unique(tmp_path: Path) -> None:
    spec = load_spec()
    assert spec and all(REQ_ID.match(req) for req in spec)
    dup = tmp_path / "SPEC.md"
    dup.write_text("- **SD-1** one.\n- **SD-1** again.\n")
    with pytest.raises(ValueError, match="SD-1 is listed twice"):
        load_spec(dup)


@pytest.mark.req("HX-11")
def test_every_lettered_clause_is_checked_by_the_suite() -> None:
    clauses = [c for ids in load_clauses().values() for c in ids]
    named = clauses_named_in(SUITE_FILES)
    assert clauses and not [c for c in clauses if c not in named], (
        f"clauses in {SPEC_PATH.name} that no check of the suite names: {[c for c in clauses if c not in named]}")


def _known_clause(clause_id: str, clauses: dict[str, list[str]]) -> bool:
    """A lettered clause of SPEC, or a requirement (several joined by ``+``: a test's requirements)."""
    if "." in clause_id:
        return clause_id in clauses.get(clause_id.split(".")[0], [])
    return all(req in clauses for req in clause_id.split("+"))


@pytest.mark.req("HX-11")
def test_every_clause_the_suite_or_a_pin_names_is_in_the_spec() -> None:
    clauses = load_clauses()
    named = clauses_named_in(SUITE_FILES)
    unknown = {c: files for c, files in named.items() if not _known_clause(c, clauses)}
    assert not unknown, f"clauses named by the suite but missing from {SPEC_PATH.name}: {unknown}"
    pinned = {(e.source, c) for path in XFAILS_FILES for e in parse_xfails(path) if e.pin.clauses for c in e.pin.clauses}
    assert pinned or not XFAILS_FILES
    bad = sorted((source, c) for source, c in pinned if not _known_clause(c, clauses))
    assert not bad, f"pins naming clauses that are not in {SPEC_PATH.name}: {bad}"


@pytest.mark.req("HX-18")
def test_the_shipped_pins_read_no_message_text() -> None:
    """A message is the suite's wording: a pin on it breaks when an assertion is reworded."""
    matching = [e.source for path in XFAILS_FILES for e in parse_xfails(path) if e.pin.match is not None]
    assert not matching, f"entries pinned with match= (pin clauses=): {matching}"


@pytest.mark.req("HX-11")
def test_clause_letters_run_from_a_without_gaps() -> None:
    assert clause_letters("one (a) thing, (b) another, and (c) a third") == ["a", "b", "c"]
    assert clause_letters("no letters (not one), f(a) is not one") == []
    for bad in ("(a) one (c) three", "(b) two", "(a) one (a) again"):
        with pytest.raises(ValueError, match="clause letters"):
            clause_letters(bad)
