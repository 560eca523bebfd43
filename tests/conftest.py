"""Shared fixtures of the harness and tool self-tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.forked import run_forked_pytest

#: The conformance plugin, so that tests of the reference alone (tests/reference/) can take ``dist``
#: and run on rank pools. Also named by conformance/conftest.py: pytest registers it once.
pytest_plugins = ("conformance.harness.plugin",)

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytester whose subprocess runs load the conformance plugin from this checkout."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    return pytester


def run_suite(pytester: pytest.Pytester, *args: str, timeout: float = 240) -> pytest.RunResult:
    """Run pytest in a process of its own with the conformance plugin, verbose, on the files made by
    ``pytester``: forked from the torch-preloaded server (:mod:`tests.forked`), as a fresh
    ``python -m pytest`` there would run."""
    return run_forked_pytest(pytester, ("-p", "conformance.harness.plugin", "-v", "-rA", "-p", "no:cacheprovider", *args), timeout=timeout)
