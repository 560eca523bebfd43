"""Self-tests of the stack adapters' packaging and of ``make stacks`` (``tools/stacks.py``): each stack
adapter imports without its stack, says how to install it, and gives skips naming the missing package;
the verdict page lists requirements, deviations with their clauses and reasons, skips by reason, and
what no entry explains, and the run exits 1 while a failure is unexplained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.adapters.base import CAPABILITIES, STACKS, Unsupported, load_adapter
from tools import stacks


@pytest.mark.parametrize("name", sorted(STACKS))
def test_a_stack_adapter_imports_without_its_stack_and_says_how_to_install_it(name: str) -> None:
    module = stacks.stack_module(name)
    installs = module.PIP_INSTALLS
    assert installs and all(isinstance(args, tuple) and args and all(isinstance(a, str) for a in args) for args in installs)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in module.ENVIRONMENT.items())
    adapter = load_adapter(name)
    assert adapter.name == name
    assert adapter.checkpoint_format and adapter.devices


@pytest.mark.parametrize("name", sorted(STACKS))
def test_a_stack_not_installed_is_a_skip_naming_it(name: str) -> None:
    """In this project's own venv no stack is installed: every capability the adapter has is
    ``Unsupported`` with a reason (the missing package, or why the stack lacks it), never an ImportError."""
    adapter = load_adapter(name)
    for capability in [*CAPABILITIES, "sharding"]:
        try:
            getattr(adapter, capability)()
        except Unsupported as exc:
            assert str(exc), f"{name}.{capability}: Unsupported without a reason"
        except ImportError as exc:  # pragma: no cover - the failure this test is for
            pytest.fail(f"{name}.{capability} raised ImportError instead of Unsupported: {exc}")


def _result(tests: dict[str, dict[str, object]]) -> dict[str, object]:
    return {"world_sizes": [1, 2], "impls": ["torchtitan"], "spec": {"ML-1": "", "ML-13": "", "AS-2": ""}, "tests": tests}


def test_the_verdict_page_lists_requirements_deviations_and_skips(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    tests: dict[str, dict[str, object]] = {
        "conformance/test_checkpoint.py::test_round_trip[ws1-torchtitan-plain]": {"outcome": "passed", "impl": "torchtitan", "reqs": ["ML-1"]},
        "conformance/test_checkpoint.py::test_kill[torchtitan-open-1]": {
            "outcome": "xfailed", "impl": "torchtitan", "reqs": ["ML-13"],
            "entry": {"pattern": "conformance/test_checkpoint.py::test_kill*", "clauses": ["ML-13.f"],
                      "reason": "DCP removes the old metadata first (pytorch/pytorch#1)"},
        },
        "conformance/test_async_save.py::test_published[ws1-torchtitan-process]": {
            "outcome": "skipped", "impl": "torchtitan", "reqs": ["AS-2"], "reason": "no process executor on a CPU machine"},
    }
    (results / "torchtitan.json").write_text(json.dumps(_result(tests)))
    page = stacks.render(stacks.load_runs(results))
    assert "| ML-1 | pass |" in page
    assert "| ML-13 | 1 known |" in page
    assert "| AS-2 |" not in page and "Skipped by every stack" in page and "AS-2." in page
    assert "ML-13.f" in page and "pytorch/pytorch#1" in page
    assert "no process executor on a CPU machine" in page
    assert "Not whole" not in page


def test_an_unexplained_failure_makes_the_run_red(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    tests: dict[str, dict[str, object]] = {"conformance/test_checkpoint.py::test_round_trip[ws1-torchtitan-plain]": {
        "outcome": "failed", "impl": "torchtitan", "reqs": ["ML-1"], "reason": "rank 0: values differ"}}
    (results / "torchtitan.json").write_text(json.dumps(_result(tests)))
    doc = tmp_path / "stacks.md"
    assert stacks.main(["render", "--out", str(tmp_path), "--doc", str(doc)]) == 1
    text = doc.read_text()
    assert "| ML-1 | **1 failed** |" in text
    assert "Not whole" in text and "values differ" in text
