"""tools/matrix: the compatibility table from per-release results, and what makes a release red."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tools.matrix import RELEASES, REPO_ROOT, load_runs, main, render


def _result(torch: str, tests: dict[str, Any]) -> dict[str, Any]:
    return {"torch": torch, "world_sizes": [1, 2], "impls": ["reference", "torch"], "spec": {"SD-1": "", "SD-2": "", "ML-3": ""},
            "known_deviations": [], "tests": tests}


def _write(results: Path, release: str, tests: dict[str, Any]) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / f"torch-{release}.json").write_text(json.dumps(_result(release, tests)))


ENTRY = {"pattern": "conformance/test_state_dict.py::test_a*", "reason": "pytorch/pytorch#1: it drops the key"}


def test_cells_per_requirement_and_release(tmp_path: Path) -> None:
    results = tmp_path / "results"
    _write(results, "2.10.0", {
        "a[torch]": {"outcome": "xfailed", "reqs": ["SD-1"], "impl": "torch", "entry": ENTRY},
        "a[reference]": {"outcome": "passed", "reqs": ["SD-1"], "impl": "reference"},
        "b[torch]": {"outcome": "skipped", "reqs": ["ML-3"], "impl": "torch", "reason": "torch 2.10.0 lacks X"},
    })
    _write(results, "2.9.1", {
        "a[torch]": {"outcome": "failed", "reqs": ["SD-1"], "impl": "torch", "reason": "boom"},
        "a[reference]": {"outcome": "passed", "reqs": ["SD-1"], "impl": "reference"},
    })
    runs = load_runs(results)
    assert [r.release for r in runs] == ["2.9.1", "2.10.0"]  # by version, not by name
    doc = render(runs)
    assert "| SD-1 | **1 failed** | 1 known |" in doc
    assert "| ML-3 | - | skip |" in doc
    assert "| SD-2 |" not in doc  # no test of the run names it
    assert "| torch | `conformance/test_state_dict.py::test_a*` | 2.10.0 | pytorch/pytorch#1: it drops the key |" in doc
    assert "- torch 2.9.1: `a[torch]` failed: boom" in doc


def test_render_exits_one_where_a_release_is_not_green(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _write(out / "results", "2.13.0", {"a[torch]": {"outcome": "xpassed", "strict": "no longer deviates", "reqs": ["SD-1"], "impl": "torch"}})
    doc = tmp_path / "compat.md"
    assert main(["render", "--out", str(out), "--doc", str(doc)]) == 1
    assert "| SD-1 | pass |" not in doc.read_text() and "strict" in doc.read_text()
    _write(out / "results", "2.13.0", {"a[torch]": {"outcome": "xpassed", "reqs": ["SD-1"], "impl": "torch"}})  # flaky: allowed
    assert main(["render", "--out", str(out), "--doc", str(doc)]) == 0


def test_releases_without_a_result_are_listed_as_not_run(tmp_path: Path) -> None:
    _write(tmp_path / "results", "2.13.0", {"a[torch]": {"outcome": "passed", "reqs": ["SD-1"], "impl": "torch"}})
    doc = render(load_runs(tmp_path / "results"), expected=("2.12.1", "2.13.0", "2.14.1"))
    assert "Releases the matrix covers that have no result here: 2.12.1, 2.14.1." in doc
    assert "MATRIX_RELEASES=2.12.1,2.14.1" in doc


def test_the_matrix_starts_at_the_declared_lower_bound() -> None:
    """The first release the matrix runs is the lowest that ``pyproject.toml`` admits: a release the
    package installs on is a release the matrix has a verdict for."""

    bound = re.search(r'"torch>=([0-9.]+)"', (REPO_ROOT / "pyproject.toml").read_text())
    assert bound is not None
    assert RELEASES[0].startswith(bound.group(1) + "."), (RELEASES[0], bound.group(1))
    assert [tuple(map(int, r.split(".")[:2])) for r in RELEASES] == sorted({tuple(map(int, r.split(".")[:2])) for r in RELEASES})


def test_each_run_names_the_suite_commit_it_measured(tmp_path: Path) -> None:
    results = tmp_path / "results"
    _write(results, "2.13.0", {"a[torch]": {"outcome": "passed", "reqs": ["SD-1"], "impl": "torch"}})
    (results / "torch-2.13.0.meta.json").write_text(json.dumps({"commit": "abc1234+dirty"}))
    _write(results, "2.14.1", {"a[torch]": {"outcome": "passed", "reqs": ["SD-1"], "impl": "torch"}})
    runs = load_runs(results)
    assert [(r.release, r.commit) for r in runs] == [("2.13.0", "abc1234+dirty"), ("2.14.1", "?")]
    doc = render(runs)
    assert "| 2.13.0 | abc1234+dirty | 1,2 |" in doc and "| 2.14.1 | ? | 1,2 |" in doc
    (results / "torch-2.13.0.meta.json").write_text(json.dumps({"commit": "abc1234", "reruns": [{"commit": "def5678", "selection": "-k mesh"}]}))
    assert "| 2.13.0 | abc1234, rerun `-k mesh` at def5678 | 1,2 |" in render(load_runs(results))


def test_runs_of_another_suite_are_named_as_such(tmp_path: Path) -> None:
    results = tmp_path / "results"
    _write(results, "2.13.0", {"a[torch]": {"outcome": "failed", "reqs": ["SD-1"], "impl": "torch", "reason": "x"}})
    (results / "torch-2.13.0.meta.json").write_text(json.dumps({"commit": "old1234"}))
    doc = render(load_runs(results), current="new5678")
    assert "Runs of another suite than the checkout this page was written from (new5678): 2.13.0 (old1234)." in doc
    assert "MATRIX_RELEASES=2.13.0` measures them again" in doc
    assert "Runs of another suite" not in render(load_runs(results), current="old1234")


def test_a_rerun_replaces_the_outcomes_of_its_tests_only() -> None:
    from tools.matrix import merge_rerun

    whole = {"torch": "2.10.0", "known_deviations": ["old"], "tests": {"a": {"outcome": "failed"}, "b": {"outcome": "passed"}}}
    rerun = {"torch": "2.10.0", "known_deviations": ["new"], "tests": {"a": {"outcome": "xfailed"}}}
    merged = merge_rerun(whole, rerun)
    assert merged["tests"] == {"a": {"outcome": "xfailed"}, "b": {"outcome": "passed"}}
    assert merged["known_deviations"] == ["new"]
    assert whole["tests"]["a"] == {"outcome": "failed"}


def test_the_wheel_holds_the_checkout_not_a_stale_build_directory(tmp_path: Path, monkeypatch: Any) -> None:
    """A module removed from the checkout but left in setuptools' ``build/lib`` by an earlier build is not
    packaged: every release would run it (a deleted test file ran on 2.14.1 this way)."""
    import subprocess
    import zipfile

    from tools import matrix

    checkout = tmp_path / "checkout"
    (checkout / "conformance").mkdir(parents=True)
    (checkout / "conformance" / "__init__.py").write_text("")
    (checkout / "README.md").write_text("tiny\n")
    (checkout / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "statedict-conformance"\nversion = "0.0.1"\nreadme = "README.md"\n'
        '[tool.setuptools.packages.find]\ninclude = ["conformance*"]\n'
    )
    (checkout / ".gitignore").write_text("build/\n")
    stale = checkout / "build" / "lib" / "conformance" / "test_removed.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("def test_gone(): pass\n")
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    monkeypatch.setattr(matrix, "REPO_ROOT", checkout)
    wheel = matrix.build_wheel(tmp_path / "out")
    names = zipfile.ZipFile(wheel).namelist()
    assert "conformance/__init__.py" in names, names
    assert not [n for n in names if "test_removed" in n], names
