"""Self-tests of the conformance report (tools/report.py)."""

from __future__ import annotations

import json

import pytest

from tools.report import main, render, summarize

PAYLOAD = {
    "torch": "2.13.0",
    "world_sizes": [1, 2],
    "backend": "auto",
    "impls": ["reference", "torch"],
    "spec": {"SD-1": "a", "SD-2": "b", "OS-1": "c", "HX-1": "d"},
    "tests": {
        "t.py::a[reference]": {"outcome": "passed", "reason": "", "reqs": ["SD-1"], "impl": "reference"},
        "t.py::a[torch]": {"outcome": "failed", "reason": "AssertionError", "reqs": ["SD-1"], "impl": "torch"},
        "t.py::b[reference]": {"outcome": "passed", "reason": "", "reqs": ["SD-2"], "impl": "reference"},
        "t.py::b[torch]": {"outcome": "xfailed", "reason": "keys differ", "reqs": ["SD-2"], "impl": "torch"},
        "t.py::c[reference]": {"outcome": "passed", "reason": "", "reqs": ["OS-1"], "impl": "reference"},
        "t.py::c[torch]": {"outcome": "skipped", "reason": "torch does not provide x", "reqs": ["OS-1"], "impl": "torch"},
        "t.py::h": {"outcome": "passed", "reason": "", "reqs": ["HX-1"], "impl": None},
    },
}


@pytest.mark.req("HX-12")
def test_cells_say_pass_fail_skip_and_xfail() -> None:
    req_ids, impls, cells = summarize(PAYLOAD)
    assert req_ids == ["SD-1", "SD-2", "OS-1", "HX-1"] and impls == ["reference", "torch"]
    assert cells[("SD-1", "reference")].text() == "pass (1)"
    assert cells[("SD-1", "torch")].text() == "FAIL 1/1"
    assert cells[("SD-2", "torch")].text() == "xfail (1): keys differ"
    assert cells[("OS-1", "torch")].text() == "skip: torch does not provide x"
    # A harness test (no implementation) counts for every column.
    assert cells[("HX-1", "torch")].status == "pass" and cells[("HX-1", "reference")].status == "pass"
    assert cells[("OS-1", "reference")].text() == "pass (1)"
    assert cells[("OS-1", "torch")].text() == "skip: torch does not provide x"


@pytest.mark.req("HX-12")
@pytest.mark.parametrize("fmt", ["table", "markdown", "json"])
def test_every_format_lists_every_requirement(fmt: str) -> None:
    text = render(PAYLOAD, fmt)
    for req in PAYLOAD["spec"]:
        assert req in text
    if fmt == "json":
        parsed = json.loads(text)
        assert parsed["requirements"]["SD-1"]["torch"]["status"] == "fail"
    if fmt == "markdown":
        assert "| requirement" in text


@pytest.mark.req("HX-12")
def test_show_reads_a_saved_result(tmp_path, capsys) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(PAYLOAD))
    assert main(["show", str(path), "--format", "markdown"]) == 0
    assert "FAIL 1/1" in capsys.readouterr().out
    assert main(["show", str(tmp_path / "missing.json")]) == 2
