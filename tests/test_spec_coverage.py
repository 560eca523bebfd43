"""HX-11: every requirement in SPEC.md is checked by a test, and every ID a test names exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.harness.requirements import REQ_ID, SPEC_PATH, ids_named_by_tests, load_spec

ROOT = Path(__file__).resolve().parent.parent
TEST_FILES = sorted(ROOT.glob("conformance/**/test_*.py")) + sorted(ROOT.glob("tests/**/test_*.py"))


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
