"""Self-test of the installed suite (HX-21): installed into a directory of its own (as ``pip install
statedict-conformance`` would put it into a fork's environment), the suite runs from any directory
with ``pytest --pyargs conformance``, and the shipped known deviations apply there too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout installed (no dependencies: they are this environment's) into a fresh directory."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(REPO_ROOT)],
        check=True, capture_output=True, timeout=300,
    )
    return target


@pytest.mark.req("HX-21")
def test_the_installed_suite_runs_from_any_directory(installed: Path, tmp_path: Path) -> None:
    """From an unrelated directory, against torch: a test with a shipped known deviation is an
    expected failure, its neighbours pass, the plugin's options are known, and the report keys tests by
    their suite id (``conformance/<file>::...``) as a run in the checkout does."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(installed)}  # before the checkout's editable install
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "conformance", "--impl", "torch", "--world-size", "1", "-p", "no:cacheprovider",
         "-q", "-k", "test_ignore_frozen_params or test_model_keys_are_canonical_fqns and mlp", "--report-json", str(report)],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    data = json.loads(report.read_text())
    outcomes = {test_id: test["outcome"] for test_id, test in data["tests"].items()}
    frozen = {k: v for k, v in outcomes.items() if "test_ignore_frozen_params" in k}
    assert frozen and set(frozen.values()) == {"xfailed"}, outcomes
    assert all(k.startswith("conformance/test_state_dict.py::") for k in outcomes), outcomes
    assert {v for k, v in outcomes.items() if "test_model_keys" in k} == {"passed"}, outcomes
    assert str(installed / "conformance" / "xfails" / "torch.txt") in out or "torch.txt" in json.dumps(data["known_deviations"]), out
    assert all(str(installed) in e["source"] for e in data["known_deviations"]), data["known_deviations"][:2]
