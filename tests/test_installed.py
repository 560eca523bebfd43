"""Self-tests of the installed suite (HX-21, HX-25): installed into a directory of its own (as ``pip
install statedict-conformance`` would put it into a fork's environment), the suite runs from any
directory with ``pytest --pyargs conformance``, the shipped known deviations apply there too, the ids it
prints name the suite's files, and the tools a fork's CI needs are console commands."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT
from tools.mutation import checkout_files, make_scratch


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout installed (no dependencies: they are this environment's) into a fresh directory,
    from a copy of its files: setuptools would package what an earlier build left in ``build/``."""
    target = tmp_path_factory.mktemp("site")
    source = tmp_path_factory.mktemp("source") / "checkout"
    make_scratch(REPO_ROOT, source, checkout_files(REPO_ROOT))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(source)],
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
    assert (installed / "conformance" / "harness" / "shard_costs.json").is_file()  # the parts of an installed run deal by it too


def _env(installed: Path, *extra: Path) -> dict[str, str]:
    """An environment that imports the installed copy (and ``extra``, e.g. a fork's package), never this checkout."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (installed, *extra))}


def _tool(installed: Path, name: str, *args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the console command ``name`` as pip installed it (``<target>/bin/<name>``)."""
    return subprocess.run([str(installed / "bin" / name), *args], cwd=cwd, env=env or _env(installed), capture_output=True, text=True, timeout=600)


def _result(tests: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"SD-1": ""}, "impls": ["myfork"], "tests": tests}


@pytest.mark.req("HX-25")
def test_the_fork_ci_tools_are_installed_commands(installed: Path, tmp_path: Path) -> None:
    """``statedict-report`` (diff, show, run), ``statedict-pin-deviations`` and ``statedict-ckpt-inspect``
    run from a directory that is not a checkout, with only the installed copy importable; ``python -m
    tools.report`` is not what a fork has there."""
    elsewhere = tmp_path / "fork-repo"
    elsewhere.mkdir()
    assert "No module named 'tools'" in subprocess.run(
        [sys.executable, "-m", "tools.report", "--help"], cwd=elsewhere, env=_env(installed), capture_output=True, text=True
    ).stderr
    base, new = elsewhere / "last-good.json", elsewhere / "new.json"
    test = {"reqs": ["SD-1"], "impl": "myfork", "reason": ""}
    base.write_text(json.dumps(_result({"conformance/t.py::a[myfork]": {**test, "outcome": "passed"}})))
    new.write_text(json.dumps(_result({"conformance/t.py::a[myfork]": {**test, "outcome": "failed", "reason": "keys differ"}})))
    diff = _tool(installed, "statedict-report", "diff", str(base), str(new), cwd=elsewhere)
    assert diff.returncode == 1 and "newly failing: conformance/t.py::a[myfork] (passed -> failed)" in diff.stdout, diff.stdout + diff.stderr
    same = _tool(installed, "statedict-report", "diff", str(base), str(base), cwd=elsewhere)
    assert same.returncode == 0, same.stdout + same.stderr
    show = _tool(installed, "statedict-report", "show", str(new), cwd=elsewhere)
    assert show.returncode == 0 and "FAIL 1/1" in show.stdout, show.stdout + show.stderr
    xfails = elsewhere / "mine.txt"
    xfails.write_text("conformance/t.py::a  # keys differ\n")
    pins = _tool(installed, "statedict-pin-deviations", str(new), str(xfails), cwd=elsewhere)
    assert pins.returncode == 2 and f"none of the entries of {xfails} is an entry of the run" in pins.stderr, pins.stdout + pins.stderr
    inspect = _tool(installed, "statedict-ckpt-inspect", str(elsewhere / "no-checkpoint"), cwd=elsewhere)
    assert inspect.returncode == 1 and ".metadata" in inspect.stderr, inspect.stdout + inspect.stderr
    run = _tool(installed, "statedict-report", "run", "--impl", "reference", "--world-size", "1", "--save", "run.json",
                "--", "-k", "test_model_keys_are_canonical_fqns and mlp and plain", cwd=elsewhere)
    assert run.returncode == 0, run.stdout + run.stderr
    saved = json.loads((elsewhere / "run.json").read_text())
    assert list(saved["tests"]) == ["conformance/test_state_dict.py::test_model_keys_are_canonical_fqns[reference-mlp-plain]"], saved["tests"]
    assert "SD-1" in run.stdout and "pass (1)" in run.stdout, run.stdout


#: A fork of torch with one regression (the model state dict's keys come back in reverse order) and
#: one fix (a submodule that is not part of the model is an error naming it): its own file cancels
#: torch's entry for that test with a line copied from torch's file (written with "torch").
FORK = '''
from conformance.adapters.impls import TorchAdapter
from conformance.adapters.state_dict import TorchStateDictOps


class ForkStateDictOps(TorchStateDictOps):
    def get_model_state_dict(self, model, *, submodules=None, options=None):
        state = super().get_model_state_dict(model, submodules=submodules, options=options)
        for module in submodules or ():
            if not any(module is m for m in model.modules()):
                raise ValueError(f"submodule {module} is not part of the model")
        return dict(reversed(list(state.items())))


class MyFork(TorchAdapter):
    name = "myfork"
    xfails_file = "myfork.txt"

    def state_dict(self):
        return ForkStateDictOps()
'''


@pytest.mark.req("HX-21", "HX-17")
def test_ids_under_pyargs_name_the_suites_files_and_rerun(installed: Path, tmp_path: Path) -> None:
    """Run as a fork's CI runs it (``--pyargs``, from its own repository, a module given by name too),
    every id printed (the short summary, the report) is ``conformance/<file>::<test>[...]``; pasted back
    as an argument it reruns that test. The fork's ``!`` line copied from torch's file applies."""
    fork = tmp_path / "forkpkg"
    fork.mkdir()
    (fork / "myfork.py").write_text(FORK)
    (fork / "myfork.txt").write_text("!conformance/test_state_dict.py::test_submodule_not_in_model_is_an_error[torch]  # fixed in myfork\n")
    repo = tmp_path / "fork-repo"
    repo.mkdir()
    env = _env(installed, fork)
    common = ["--impl", "myfork:MyFork", "--world-size", "1", "-p", "no:cacheprovider", "-rfEX"]
    selection = "test_submodule_not_in_model_is_an_error or test_model_keys_are_canonical_fqns and mlp and plain"
    report = repo / "new.json"
    for target in ("conformance", "conformance.test_state_dict"):
        result = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", target, *common, "-k", selection, "--report-json=new.json"],
                                cwd=repo, env=env, capture_output=True, text=True, timeout=600)
        out = result.stdout + result.stderr
        assert result.returncode == 1, out
        assert "FAILED conformance/test_state_dict.py::test_model_keys_are_canonical_fqns[myfork-mlp-plain]" in out, out
        assert "\nFAILED ::" not in out and "FAILED test_state_dict.py" not in out, out
        outcomes = {k: v["outcome"] for k, v in json.loads(report.read_text())["tests"].items()}
        assert outcomes == {
            "conformance/test_state_dict.py::test_model_keys_are_canonical_fqns[myfork-mlp-plain]": "failed",
            "conformance/test_state_dict.py::test_submodule_not_in_model_is_an_error[myfork]": "passed",
        }, outcomes
    rerun = subprocess.run([sys.executable, "-m", "pytest", "conformance/test_state_dict.py::test_model_keys_are_canonical_fqns[myfork-mlp-plain]",
                            *common], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    out = rerun.stdout + rerun.stderr
    assert rerun.returncode == 1 and "1 failed" in out, out
    assert "FAILED conformance/test_state_dict.py::test_model_keys_are_canonical_fqns[myfork-mlp-plain]" in out, out


#: Put first on PYTHONPATH, this makes the process an environment without numpy (as a venv with only
#: ``pip install torch`` is: torch's CPU wheel does not pull numpy in): every import of it fails.
_WITHOUT_NUMPY = '''
import sys


class _NoNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoNumpy())
'''


@pytest.mark.req("HX-34")
def test_a_bare_environment_is_a_usage_error_naming_what_is_missing(installed: Path, tmp_path: Path) -> None:
    """The installed suite where numpy cannot be imported: the run stops before any test, with pytest's
    usage-error status and a message naming numpy and what needs it; no test is reported as the
    adapter's failure. (The package declares numpy, so ``pip install`` brings it; this is the
    ``--no-deps`` install.)"""
    blocker = tmp_path / "bare"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(_WITHOUT_NUMPY)
    elsewhere = tmp_path / "fork-repo"
    elsewhere.mkdir()
    report = tmp_path / "report.json"
    env = {**_env(installed), "PYTHONPATH": os.pathsep.join((str(blocker), str(installed)))}
    probe = subprocess.run([sys.executable, "-c", "import numpy"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0, "the blocker did not hide numpy"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "conformance", "--impl", "torch", "--world-size", "1", "-p", "no:cacheprovider",
         "-q", "-k", "test_model_keys_are_canonical_fqns", "--report-json", str(report)],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600,
    )
    out = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert "numpy" in out and "object collectives" in out, out
    assert "failed" not in result.stdout and not report.exists(), out


@pytest.mark.req("HX-34")
def test_the_package_declares_what_the_harness_needs() -> None:
    """Every module the harness refuses to start without is a dependency of the package (not an
    extra): ``pip install statedict-conformance`` into a venv with only torch brings it."""
    from conformance.harness.options import NEEDED_MODULES

    block = re.search(r"^dependencies = \[(.*?)^\]", (REPO_ROOT / "pyproject.toml").read_text(), re.S | re.M)
    assert block is not None, "pyproject.toml has no [project] dependencies list"
    names = {m.lower() for m in re.findall(r'^\s*"([A-Za-z0-9_.-]+)', block.group(1), re.M)}
    for module, _ in NEEDED_MODULES:
        assert module in names, f"{module} is needed by the harness but not a dependency in pyproject.toml: {sorted(names)}"


@pytest.mark.req("HX-34")
def test_the_harness_lower_bound_is_the_packages() -> None:
    """The release the plugin refuses to start below is the lower bound ``pip`` enforces."""
    from conformance.harness.options import MIN_TORCH

    bound = re.search(r'"torch>=([0-9]+)\.([0-9]+)"', (REPO_ROOT / "pyproject.toml").read_text())
    assert bound is not None, "pyproject.toml names no torch lower bound"
    assert (int(bound.group(1)), int(bound.group(2))) == MIN_TORCH


@pytest.mark.req("HX-34")
def test_a_torch_below_the_lower_bound_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a torch that reports an older release than the lower bound, the run stops before any test
    with a usage error naming the release found and the one needed."""
    import torch

    monkeypatch.setattr(torch, "__version__", "2.7.1+cu126")
    from conformance.harness.options import check_environment

    with pytest.raises(pytest.UsageError, match=r"torch 2\.7\.1\+cu126 is older than the lowest release the suite runs on \(2\.9"):
        check_environment()
