"""The plugin's command-line options and markers, and the check of the environment at configure (HX-34):
what :mod:`conformance.harness.plugin`'s ``pytest_addoption`` and ``pytest_configure`` hooks register
and refuse to start without (the hooks stay in the plugin, where pytest finds them)."""

from __future__ import annotations

import re

import pytest

from conformance.adapters.base import SHIPPED

__all__ = ["add_options", "add_markers", "NEEDED_MODULES", "MIN_TORCH", "check_environment"]


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "statedict-conformance")
    group.addoption(
        "--world-size", default=None, help="world sizes to run rank tests at, e.g. 1,2,4 (default 1,2; under torchrun the job's world size)"
    )
    group.addoption(
        "--backend",
        default="auto",
        choices=("auto", "gloo", "nccl"),
        help="process-group backend: nccl with one GPU per rank, gloo on CPU; auto picks nccl when a world size has enough GPUs",
    )
    group.addoption(
        "--impl",
        action="append",
        default=[],
        help=f"implementation(s) under test: {', '.join(SHIPPED)} or package.module:AdapterClass; comma-separated or repeated (default: all shipped)",
    )
    group.addoption("--xfails", action="append", default=[], help="expected-failures file (one test id a line); repeatable")
    group.addoption(
        "--run-known-hangs",
        action="store_true",
        help="also run the tests an expected-failures entry flags `hangs` (each costs its rank timeout while the deviation lasts)",
    )
    group.addoption("--rank-timeout", type=float, default=120.0, help="seconds a rank test may run before it is cut (default 120)")
    group.addoption("--report-json", default=None, help="write each test's outcome, requirement IDs and axes to this JSON file")
    group.addoption(
        "--rerun-crashes",
        action="append",
        default=[],
        metavar="NAMES",
        help="adapter names (Adapter.name; comma-separated or repeated) whose rank tests are run once more on a fresh pool "
        "when a rank dies of SIGSEGV, SIGBUS or glibc's abort on a corrupt heap that its known deviation does not pin "
        "(an intermittent crash in "
        "native code the suite does not test, e.g. upstream torch's); every such crash is still listed in the "
        "summary and the JSON report. Default none: every crash fails its test",
    )
    group.addoption(
        "--shard",
        default=None,
        metavar="K/N",
        help="run the K-th of N parts of the selected tests (K from 1), for N concurrent runs of one selection on one machine "
        "(`statedict-report run --jobs N`, `make test`): every test is in exactly one part",
    )
    group.addoption(
        "--launcher",
        default="auto",
        choices=("auto", "pool", "env"),
        help="auto: the ranks of a torchrun/srun job when its environment is set (RANK, WORLD_SIZE, ...), else rank pools; "
        "pool: always rank pools; env: the launcher's ranks, an error without its environment",
    )
    group.addoption(
        "--shared-tmp",
        default=None,
        help="torchrun mode: a directory every node sees (e.g. on Lustre/NFS) for the tests' checkpoints and the ranks' logs "
        "(default: the system temporary directory, enough on one node)",
    )


def add_markers(config: pytest.Config) -> None:
    """The suite's markers (``--strict-markers`` accepts them)."""
    config.addinivalue_line("markers", "req(*ids): the SPEC.md requirement IDs this test checks")
    config.addinivalue_line(
        "markers", "world_size(*sizes, min=None): restrict a rank test to these world sizes (or at least min)"
    )
    config.addinivalue_line(
        "markers",
        "rank_timeout(seconds): cut this rank test after `seconds` (at most --rank-timeout): for tests where a wrong "
        "implementation leaves ranks waiting",
    )
    config.addinivalue_line(
        "markers",
        "largest_world_size: run this rank test (or parameter of one) at the largest selected world size only, "
        "unless the hypothesis profile is thorough; at a smaller one it is a skip that says so",
    )
    config.addinivalue_line(
        "markers",
        "case_families(*names): the families of generated cases this test draws, which an expected-failures entry "
        "may leave out for an adapter (exclude=NAME); the test reads them with the excluded_cases fixture",
    )
    config.addinivalue_line(
        "markers",
        "dcp_format(why): this test loads a checkpoint of one implementation with another (upstream DCP, the "
        "reference): a skip, saying why, for an adapter whose checkpoint_format is not 'dcp'",
    )
    config.addinivalue_line(
        "markers",
        "dcp_files(why): this test reads DCP's metadata of the checkpoint or places a fault by it: a skip, saying "
        "why, for an adapter whose checkpoints hold no DCP files (Adapter.dcp_files)",
    )


#: Modules the harness needs that torch does not install: (module, what needs it).
NEEDED_MODULES = (("numpy", "torch's object collectives (all_gather_object, broadcast_object_list), which the harness and torch's adapters call"),)


#: The lowest torch release the suite and the reference run on (pyproject.toml's lower bound).
MIN_TORCH = (2, 9)


def check_environment() -> None:
    """Refuse to start, naming what is missing, in an environment where every rank test would fail
    for a reason that is the environment's, not the implementation's (HX-34)."""
    import importlib

    import torch

    release = tuple(int(part) for part in re.findall(r"\d+", torch.__version__.split("+")[0])[:2])
    if release < MIN_TORCH:
        raise pytest.UsageError(
            f"torch {torch.__version__} is older than the lowest release the suite runs on "
            f"({'.'.join(map(str, MIN_TORCH))}; see docs/compatibility.md): its APIs lack what the suite and the reference use"
        )
    missing = []
    for name, why in NEEDED_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(f"{name} ({why})")
    if missing:
        raise pytest.UsageError(
            "this environment lacks what the suite needs, so every verdict would blame the implementation for it: "
            + "; ".join(missing) + ". Install it (pip install " + " ".join(m.split()[0] for m in missing) + ")"
        )
