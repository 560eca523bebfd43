"""Self-tests of the conformance report (tools/report.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conformance.cli.report import Legend, combined_status, diff, gate_fails, main, merge_payloads, render, render_diff, summarize

PAYLOAD: dict[str, Any] = {
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
    legend = Legend()
    assert cells[("SD-1", "reference")].text(legend) == "pass (1)"
    assert cells[("SD-1", "torch")].text(legend) == "FAIL 1/1"
    assert cells[("SD-2", "torch")].text(legend) == "xfail (1) [1]"
    assert cells[("OS-1", "torch")].text(legend) == "skip [2]"
    assert cells[("SD-2", "torch")].text(legend) == "xfail (1) [1]"  # one number per reason
    assert legend.lines(80) == ["[1] keys differ", "[2] torch does not provide x"]
    # A harness test (no implementation) counts for every column.
    assert cells[("HX-1", "torch")].status == "pass" and cells[("HX-1", "reference")].status == "pass"
    assert cells[("OS-1", "reference")].text() == "pass (1)"


LONG_REASON = (
    "fairscale does not provide optim_state: fairscale has no sharded optimizer-state API here (its FlattenParamsWrapper "
    "only), so every OS requirement is a skip for it"
)


@pytest.mark.req("HX-12")
@pytest.mark.parametrize("width", [40, 100])
def test_long_reasons_are_never_cut(width: int) -> None:
    """A reason is printed whole, once, in a numbered legend under the table, wrapped at spaces to the
    width; the cells refer to it by number (no cell is cut mid-word, whatever the terminal)."""
    payload = {**PAYLOAD, "tests": {**PAYLOAD["tests"],
               "t.py::c[fairscale]": {"outcome": "skipped", "reason": LONG_REASON, "reqs": ["OS-1"], "impl": "fairscale"},
               "t.py::d[fairscale]": {"outcome": "skipped", "reason": LONG_REASON, "reqs": ["SD-2"], "impl": "fairscale"}},
               "impls": ["reference", "torch", "fairscale"]}
    text = render(payload, "table", width=width)
    table, _, rest = text.partition("\nreasons:\n")
    legend = rest.split("\n\n")[0].splitlines()
    assert " ".join(line.strip() for line in legend).count(LONG_REASON) == 1, legend
    assert all(len(line) <= width for line in legend), legend
    number = next(line.split()[0] for line in legend if line.startswith("[") and "fairscale" in line)
    for req in ("OS-1", "SD-2"):
        row = next(line for line in table.splitlines() if line.startswith(req))
        assert row.rstrip().endswith(f"skip {number}"), row
    markdown = render(payload, "markdown")
    assert f"- {number} {LONG_REASON}" in markdown


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


@pytest.mark.req("HX-12", "HX-33")
@pytest.mark.parametrize("fmt", ["table", "json"])
def test_a_test_run_again_after_a_crash_is_listed(fmt: str) -> None:
    """A cell counts the second run of a test rerun after a crash (--rerun-crashes), and the report
    says which tests were, with the dead ranks."""
    crash = {"died": {"0": "signal 11"}, "output": {"0": "Fatal Python error: Segmentation fault"}}
    payload = {**PAYLOAD, "tests": {**PAYLOAD["tests"], "t.py::b[torch]": {**PAYLOAD["tests"]["t.py::b[torch]"], "crashes": [crash]}}}
    text = render(payload, fmt)
    if fmt == "json":
        assert json.loads(text)["rerun_after_crash"] == {"t.py::b[torch]": [{"0": "signal 11"}]}
    else:
        assert "run again after a crash (--rerun-crashes; the cells count the second run): t.py::b[torch] (rank 0 signal 11)" in text
    assert "run again after a crash" not in render(PAYLOAD, "table") and "rerun_after_crash\": {}" in render(PAYLOAD, "json")


@pytest.mark.req("HX-12")
def test_show_reads_a_saved_result(tmp_path, capsys) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(PAYLOAD))
    assert main(["show", str(path), "--format", "markdown"]) == 0
    assert "FAIL 1/1" in capsys.readouterr().out
    assert main(["show", str(tmp_path / "missing.json")]) == 2


def _test(outcome: str, reqs: list[str], impl: str | None, *failures: tuple[Any, ...], reason: str = "") -> dict:
    """A test's result; a failure is (rank, type, message) as older results have it, or with its clause."""
    return {"outcome": outcome, "reason": reason, "reqs": reqs, "impl": impl,
            **({"failures": [{"rank": f[0], "type": f[1], "message": f[2], **({"clause": f[3]} if len(f) > 3 else {})}
                             for f in failures]} if failures else {})}


BASE: dict[str, Any] = {
    "spec": {"SD-1": "", "SD-2": "", "OS-1": "", "ML-1": ""},
    "tests": {
        "t.py::a[ws2-torch]": _test("passed", ["SD-1"], "torch"),
        "t.py::b[ws2-torch]": _test("xfailed", ["SD-2"], "torch", (1, "ValueError", "names no key at 0x7f00aa")),
        "t.py::c[ws2-torch]": _test("failed", ["OS-1"], "torch", (0, "KeyError", "'w'")),
        "t.py::d[torch]": _test("passed", ["ML-1"], "torch"),
        "t.py::e[torch]": _test("xfailed", ["ML-1"], "torch", (None, "Failed", "copies before raising")),
        "t.py::f[torch]": _test("passed", ["SD-1"], "torch"),
    },
}


def _new(impl: str) -> dict:
    return {
        "spec": BASE["spec"],
        "tests": {
            f"t.py::a[ws2-{impl}]": _test("failed", ["SD-1"], impl, (0, "Failed", "keys differ"), (1, "Failed", "keys differ")),
            f"t.py::b[ws2-{impl}]": _test("xfailed", ["SD-2"], impl, (1, "ValueError", "names no key at 0x55bb01")),  # same but the address
            f"t.py::c[ws2-{impl}]": _test("passed", ["OS-1"], impl),
            f"t.py::d[{impl}]": _test("skipped", ["ML-1"], impl, reason="no DCP"),
            f"t.py::e[{impl}]": _test("xfailed", ["ML-1"], impl, (None, "TypeError", "unsupported type")),
            f"t.py::f[{impl}]": _test("passed", ["SD-1"], impl),
            "t.py::new[reference]": _test("failed", ["SD-1"], "reference", (None, "Failed", "not ours")),
        },
    }


@pytest.mark.req("HX-20")
@pytest.mark.parametrize("name", ["torch", "myfork"])
def test_diff_says_what_changed_per_requirement(name: str) -> None:
    """Newly failing (with every rank's message), fixed, failing differently (an address alone is not a
    difference) and newly skipped; a fork's run is compared with the torch column by its own name."""
    changes = diff(BASE, _new(name), impl=name, base_impl="torch")
    assert {(c.kind, c.nodeid) for c in changes} == {
        ("newly failing", f"t.py::a[ws2-{name}]"),
        ("fixed", f"t.py::c[ws2-{name}]"),
        ("newly skipped", f"t.py::d[{name}]"),
        ("failing differently", f"t.py::e[{name}]"),
    }
    text = render_diff(changes, list(BASE["spec"]))
    assert text.splitlines()[0] == "SD-1" and text.index("OS-1") < text.index("ML-1")
    assert f"newly failing: t.py::a[ws2-{name}] (passed -> failed)\n      rank 0: Failed: keys differ\n      rank 1: Failed: keys differ" in text
    assert "was: controller: Failed: copies before raising\n      now: controller: TypeError: unsupported type" in text
    assert text.splitlines()[-1] == "1 newly failing, 1 failing differently, 0 no longer deviates (check), 1 fixed, 1 newly skipped (4 tests changed)"


def _one(outcome: str, *failures: tuple[Any, ...], **extra: object) -> dict:
    return {"spec": BASE["spec"], "tests": {"t.py::x[ws2-torch]": {**_test(outcome, ["SD-1"], "torch", *failures), **extra}}}


ENTRY = {"source": "/site/conformance/xfails/torch.txt:40", "pattern": "t.py::x", "impl": "torch", "reason": "keys differ"}


@pytest.mark.req("HX-23")
@pytest.mark.parametrize(
    ("before", "after", "kind", "exit"),
    [
        # the same known deviation, failing as before: nothing changed
        (_one("xfailed", (1, "Failed", "keys differ at 0x7f01")), _one("xfailed", (1, "Failed", "keys differ at 0x5501")), None, 0),
        # a known deviation that now fails another way (another message, another rank, or past its pin)
        (_one("xfailed", (1, "Failed", "keys differ")), _one("xfailed", (1, "Failed", "values differ")), "failing differently", 1),
        (_one("xfailed", (1, "Failed", "keys differ")), _one("xfailed", (0, "Failed", "keys differ")), "failing differently", 1),
        (_one("xfailed", (1, "Failed", "keys differ")), _one("failed", (1, "Failed", "keys differ")), "failing differently", 1),
        (_one("failed", (1, "KeyError", "'w'")), _one("failed", (1, "KeyError", "'b'")), "failing differently", 1),
        # where both runs recorded clauses, a failure is its type and clause: a reworded message is the same
        # failure, another clause (or type) is not; a run without clauses is compared by messages
        (_one("xfailed", (1, "Failed", "keys differ", "ML-4.b")), _one("xfailed", (1, "Failed", "the keys differ", "ML-4.b")), None, 0),
        (_one("xfailed", (1, "Failed", "keys differ", "ML-4.b")), _one("xfailed", (1, "Failed", "keys differ", "ML-4.a")), "failing differently", 1),
        (_one("xfailed", (1, "Failed", "keys differ", "ML-4.b")), _one("xfailed", (1, "KeyError", "keys differ", "ML-4.b")), "failing differently", 1),
        (_one("xfailed", (1, "Failed", "keys differ")), _one("xfailed", (1, "Failed", "the keys differ", "ML-4.b")), "failing differently", 1),
        # a known deviation that passed: strict (the run failed for it) fails the gate; flaky is listed only
        (_one("xfailed", (1, "Failed", "keys differ")), _one("xpassed", strict=True, entry=ENTRY), "no longer deviates (check)", 1),
        (_one("xfailed", (1, "Failed", "keys differ")), _one("xpassed", strict=False, entry=ENTRY), "no longer deviates (check)", 0),
        # a deviation whose entry was removed (or !-cancelled) and that passes: a fix
        (_one("xfailed", (1, "Failed", "keys differ")), _one("passed"), "fixed", 0),
        (_one("passed"), _one("failed", (1, "Failed", "keys differ")), "newly failing", 1),
    ],
)
def test_any_change_of_failure_fails_the_gate(tmp_path, capsys, before: dict, after: dict, kind: str | None, exit: int) -> None:
    """``diff`` exits 1 for anything newly failing, any change of a failure (another exception, message,
    failing ranks, or a known deviation that now fails past its pin), and a known deviation that passed in a
    strict run; an XPASS is never called fixed."""
    changes = diff(before, after)
    assert [c.kind for c in changes] == ([kind] if kind else [])
    assert gate_fails(changes) is bool(exit)
    base, new = tmp_path / "base.json", tmp_path / "new.json"
    base.write_text(json.dumps(before))
    new.write_text(json.dumps(after))
    assert main(["diff", str(base), str(new)]) == exit
    out = capsys.readouterr().out
    assert "fixed: " not in out or kind == "fixed"
    if kind == "no longer deviates (check)":
        assert "no longer deviates (check): t.py::x[ws2-torch] (xfailed -> xpassed)" in out, out
        assert f"listed by {ENTRY['source']}: t.py::x  # keys differ" in out, out
        assert ("the run failed for it (strict)" if exit else "allowed to pass (flaky entry)") in out, out


@pytest.mark.req("HX-20", "HX-23")
def test_diff_exit_status(tmp_path, capsys) -> None:
    base, new, same = tmp_path / "base.json", tmp_path / "new.json", tmp_path / "same.json"
    base.write_text(json.dumps(BASE))
    new.write_text(json.dumps(_new("myfork")))
    same.write_text(json.dumps(BASE))
    assert main(["diff", str(base), str(new), "--impl", "myfork", "--base-impl", "torch"]) == 1
    assert "newly failing: t.py::a[ws2-myfork]" in capsys.readouterr().out
    assert main(["diff", str(base), str(same)]) == 0
    assert capsys.readouterr().out.strip() == (
        "0 newly failing, 0 failing differently, 0 no longer deviates (check), 0 fixed, 0 newly skipped (0 tests changed)"
    )
    only_different = {"spec": BASE["spec"], "tests": {"t.py::e[torch]": _test("xfailed", ["ML-1"], "torch", (None, "TypeError", "unsupported type"))}}
    new.write_text(json.dumps(only_different))
    assert main(["diff", str(base), str(new)]) == 1  # "1 failing differently" alone fails the gate
    assert "1 failing differently" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=f"cannot read results {tmp_path}: "):
        main(["diff", str(base), str(tmp_path)])  # a directory
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmarks": []}))
    with pytest.raises(SystemExit, match=f"{other} is not a --report-json result"):
        main(["diff", str(other), str(base)])


@pytest.mark.req("HX-35")
def test_the_parts_of_a_run_report_as_one() -> None:
    first = {**PAYLOAD, "tests": {"a::t[reference]": {"outcome": "passed", "reason": "", "reqs": ["SD-1"], "impl": "reference"}}}
    second = {**PAYLOAD, "tests": {"a::u[reference]": {"outcome": "failed", "reason": "boom", "reqs": ["SD-2"], "impl": "reference"}}}
    merged = merge_payloads([first, second])
    assert set(merged["tests"]) == {"a::t[reference]", "a::u[reference]"}
    assert merged["tests"]["a::u[reference]"]["outcome"] == "failed"
    assert list(first["tests"]) == ["a::t[reference]"]  # the parts are left as they were
    assert "FAIL" in render(merged)


@pytest.mark.req("HX-35")
@pytest.mark.parametrize(("statuses", "expected"), [((0, 0), 0), ((0, 5), 0), ((5, 5), 5), ((0, 1), 1), ((1, 4), 1), ((5, 2), 2)])
def test_the_parts_exit_status_is_the_runs(statuses: tuple[int, ...], expected: int) -> None:
    assert combined_status(statuses) == expected
