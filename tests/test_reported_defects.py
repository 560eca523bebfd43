"""tools/reported_defects: each defect still applies to the reference as it is (its text to replace
occurs exactly once), names a report that SPEC's table lists, and selects tests of a conformance file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools.reported_defects import DEFECTS, REPO_ROOT


@pytest.mark.parametrize("defect", DEFECTS, ids=[d.key for d in DEFECTS])
def test_each_defect_applies_to_the_reference_as_it_is(defect) -> None:
    text = (REPO_ROOT / defect.file).read_text()
    assert text.count(defect.old) == 1, f"{defect.key}: the text to replace occurs {text.count(defect.old)} times in {defect.file}"
    assert defect.new != defect.old


@pytest.mark.parametrize("defect", DEFECTS, ids=[d.key for d in DEFECTS])
def test_each_defect_answers_a_report_in_the_spec(defect) -> None:
    spec = Path(REPO_ROOT / "conformance" / "SPEC.md").read_text()
    first = defect.report.split(",")[0].strip()
    commit = re.search(r"\b[0-9a-f]{7,40}\b", defect.report)
    if commit is not None:  # a defect of the reference's own, named by the commit that fixed it
        assert commit.group() in spec, f"{defect.key}: the fix {commit.group()} is not named in SPEC"
    else:
        number = first.split("#")[-1]
        assert f"#{number}" in spec, f"{defect.key}: {first} is not in SPEC's reports"
    assert defect.tests.strip(), defect.key
    assert (REPO_ROOT / defect.test_file).is_file(), f"{defect.key}: {defect.test_file} does not exist"
