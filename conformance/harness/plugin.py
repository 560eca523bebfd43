"""The pytest plugin of the conformance suite: options, axes, rank dispatch, xfails, the JSON result.

Loaded by ``conformance/conftest.py`` and ``tests/conftest.py`` (``pytest_plugins``; registered once),
and by the self-tests' subprocess runs with ``-p conformance.harness.plugin``.
How tests use it is in :mod:`conformance.harness`.

The hooks and fixtures are here; what they call lives in modules of its own: the axes and test ids
(:mod:`~conformance.harness.axes`), the expected-failures machinery
(:mod:`~conformance.harness.known_deviations`), the ``--report-json`` document
(:mod:`~conformance.harness.report_json`), the run's settings (:mod:`~conformance.harness.config`), and
what runs the bodies on ranks (a :class:`~conformance.harness.runner.Runner`: the pools of
:mod:`~conformance.harness.pool`, or the ranks of a torchrun job, :mod:`~conformance.harness.torchrun`),
chosen once at configure.
"""

from __future__ import annotations

import atexit
import inspect
import itertools
import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pytest

from conformance.adapters.base import SHIPPED, Adapter, capability_of, load_adapter
from conformance.adapters.unsupported import Unsupported, skip_reason
from conformance.harness.axes import (
    CONFORMANCE_DIR,
    DistSpec,
    below_the_largest_world_size,
    impl_specs,
    item_impl,
    selected_world_sizes,
    suite_test_id,
)
from conformance.harness.config import SETTINGS, HarnessConfig, harness_config
from conformance.harness.failures import DIED, HUNG, Failure
from conformance.harness.known_deviations import (
    AdapterFile,
    StaleXfailWarning,
    adapter_xfail_files,
    applicable_entries,
    check_exclusions,
    entries_header,
    entry_for,
    entry_json,
    exclusions_for,
    load_xfail_entries,
    no_longer_deviates,
    warn_stale,
)
from conformance.harness.pool import PoolRunner
from conformance.harness.report_json import SESSION_RESULTS, record_report, report_payload
from conformance.harness.requirements import load_spec
from conformance.harness.runner import RankRun, RanksNotStarted, Runner
from conformance.harness.shards import deal, load_costs
from conformance.harness.torchrun import launched, start_runner
from conformance.harness.worker import DIST_ARG, SUPPORT_MODULES
from conformance.harness.xfails import XfailEntry

# The support modules hold the tests' checks (moved out of the test files): their bare asserts get
# pytest's messages, as a test module's do (the harness imports none of them: this comes first).
pytest.register_assert_rewrite(*SUPPORT_MODULES)

__all__ = ["DistSpec", "Pools", "StaleXfailWarning", "selected_world_sizes", "suite_test_id", "AdapterFile", "adapter_xfail_files"]


@dataclass
class _Session:
    """What the plugin keeps for one pytest session (its settings are :data:`SETTINGS`)."""

    #: runs the rank bodies: the pools, or a torchrun job's ranks
    runner: Runner
    #: the expected-failures entries (loaded once, at configure)
    entries: list[XfailEntry]
    #: the crashes rerun in the session (``--rerun-crashes``), in order, for the terminal summary
    crashes: list[dict[str, Any]] = field(default_factory=list)


_SESSION = pytest.StashKey[_Session]()
#: The known-deviation entry applied to a test, for the pin check after it ran.
_ENTRY = pytest.StashKey[XfailEntry]()
#: The exclusions (``exclude=`` entries) that apply to a test, for the ``excluded_cases`` fixture.
_EXCLUSIONS = pytest.StashKey[tuple[XfailEntry, ...]]()
#: (world size, failures) of a test's last rank run.
_RANK_FAILURES = pytest.StashKey[tuple[int, list[Failure]]]()
#: The crashes rerun in one test, for its report.
_ITEM_CRASHES = pytest.StashKey[list[dict[str, Any]]]()
#: Signals of a native memory error (the only deaths ``--rerun-crashes`` reruns): a segfault is
#: the sign of a use-after-free or a race in native code, which another run may not meet; an exit
#: code, SIGKILL (the OOM killer) or SIGABRT (gloo's checks on a mismatched collective, an assertion)
#: is what the code decided, and repeats.
MEMORY_ERROR_SIGNALS = (signal.SIGSEGV, signal.SIGBUS)
#: Lines of a crashed rank's output kept with its record (faulthandler's stacks end there).
_CRASH_OUTPUT_LINES = 60


# -- options and configuration ---------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
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
        "when a rank dies of SIGSEGV or SIGBUS that its known deviation does not pin (an intermittent crash in "
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


# First: a torchrun rank joins its job here, and other plugins' configure must see what that sets
# (hypothesis reads --hypothesis-seed, which every rank takes from rank 0).
@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
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
    _check_environment()
    settings, runner = _start(config)
    config.stash[SETTINGS] = settings
    config.stash[_SESSION] = _Session(runner=runner, entries=load_xfail_entries(config))
    SESSION_RESULTS.clear()
    atexit.register(runner.stop)


def _start(config: pytest.Config) -> tuple[HarnessConfig, Runner]:
    """The run's settings and its runner: a torchrun job's ranks when this process is one (they
    decide the default world size and the GPUs), else the pools."""
    settings = HarnessConfig.from_options(config)
    try:
        env = launched(settings.launcher, os.environ)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    if env is None:
        return settings, PoolRunner(pg_timeout_s=settings.pg_timeout_s)
    if settings.shard is not None:
        raise pytest.UsageError("--shard splits a run of rank pools on one machine; under torchrun every rank runs every test")
    runner = start_runner(config, env, rank_timeout_s=settings.rank_timeout_s, shared_tmp=settings.shared_tmp, write_report=_write_report)
    job = runner.job
    return HarnessConfig.from_options(config, default_world_sizes=str(job.world_size), cuda_devices=job.cuda_ranks, ranks=job.world_size), runner


#: Modules the harness needs that torch does not install: (module, what needs it).
_NEEDED_MODULES = (("numpy", "torch's object collectives (all_gather_object, broadcast_object_list), which the harness and torch's adapters call"),)


#: The lowest torch release the suite and the reference run on (pyproject.toml's lower bound).
MIN_TORCH = (2, 9)


def _check_environment() -> None:
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
    for name, why in _NEEDED_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(f"{name} ({why})")
    if missing:
        raise pytest.UsageError(
            "this environment lacks what the suite needs, so every verdict would blame the implementation for it: "
            + "; ".join(missing) + ". Install it (pip install " + " ".join(m.split()[0] for m in missing) + ")"
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION in config.stash:
        config.stash[_SESSION].runner.stop()


def pytest_report_header(config: pytest.Config) -> list[str]:
    import torch

    settings = harness_config(config)
    sizes = list(settings.world_sizes)
    backends = ", ".join(f"ws{ws}={settings.backend_for(ws)}" for ws in sizes)
    return [
        f"conformance: torch {torch.__version__}, cuda devices {settings.cuda_devices}",
        f"conformance: world sizes {sizes}, backends {backends}, rank timeout {settings.rank_timeout_s}s",
        f"conformance: implementations {', '.join(impl_specs(config))}",
        *entries_header(config.stash[_SESSION].entries if _SESSION in config.stash else []),
    ]


# -- parametrization over the axes ----------------------------------------------------------------


def _allowed_sizes(metafunc: pytest.Metafunc, sizes: list[int]) -> tuple[list[int], str]:
    marker = metafunc.definition.get_closest_marker("world_size")
    if marker is None:
        return sizes, ""
    wanted = set(marker.args)
    minimum = marker.kwargs.get("min")
    allowed = [ws for ws in sizes if (not wanted or ws in wanted) and (minimum is None or ws >= minimum)]
    need = f"world size in {sorted(wanted)}" if wanted else ""
    if minimum is not None:
        need = f"{need} and >= {minimum}" if need else f"world size >= {minimum}"
    return allowed, need


def _parametrized_by_the_test(metafunc: pytest.Metafunc, name: str) -> bool:
    """Whether the test parametrizes ``name`` itself (then the plugin leaves that axis alone: its
    name is the test's own, e.g. a benchmark's ``impl``, not the suite's)."""
    for marker in metafunc.definition.iter_markers("parametrize"):
        argnames = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
        names = [n.strip() for n in argnames.split(",")] if isinstance(argnames, str) else list(argnames)
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    config = metafunc.config
    sizes = selected_world_sizes(config)
    if "dist" in metafunc.fixturenames and not _parametrized_by_the_test(metafunc, "dist"):
        allowed, need = _allowed_sizes(metafunc, sizes)
        if allowed:
            specs = [DistSpec(ws, harness_config(config).backend_for(ws)) for ws in allowed]
            metafunc.parametrize("dist", specs, ids=[f"ws{s.world_size}" for s in specs])
        else:
            reason = f"needs {need}; selected --world-size {','.join(map(str, sizes))}"
            metafunc.parametrize("dist", [pytest.param(None, marks=pytest.mark.skip(reason=reason))], ids=["ws-none"])
    if "world_size_pair" in metafunc.fixturenames and not _parametrized_by_the_test(metafunc, "world_size_pair"):
        allowed, need = _allowed_sizes(metafunc, sizes)
        pairs = list(itertools.permutations(allowed, 2))
        if pairs:
            metafunc.parametrize("world_size_pair", pairs, ids=[f"ws{a}-ws{b}" for a, b in pairs])
        else:
            reason = "needs two distinct world sizes" + (f" ({need})" if need else "") + f"; selected --world-size {','.join(map(str, sizes))}"
            metafunc.parametrize("world_size_pair", [pytest.param(None, marks=pytest.mark.skip(reason=reason))], ids=["ws-none"])
    if "impl" in metafunc.fixturenames and not _parametrized_by_the_test(metafunc, "impl"):
        adapters = []
        for spec in impl_specs(config):
            try:
                adapters.append(load_adapter(spec))
            except ValueError as exc:
                raise pytest.UsageError(str(exc)) from None
        metafunc.parametrize("impl", adapters, ids=[a.name for a in adapters])


@pytest.fixture
def reference_impl() -> Adapter:
    """The reference adapter, for differential checks of another implementation."""
    return load_adapter("reference")


# -- collection: requirement IDs and expected failures --------------------------------------------


def _item_reqs(item: pytest.Item) -> list[str]:
    return [req for marker in item.iter_markers("req") for req in marker.args]


def default_clause(item: pytest.Item | None) -> str | None:
    """The clause of a failure of ``item`` that named none: the requirement the test names, or its
    requirements joined by ``+`` (in the order the marks name them) when it names several."""
    if item is None:
        return None
    reqs = list(dict.fromkeys(_item_reqs(item)))
    return "+".join(reqs) or None


def _in_clauses(failures: list[Failure], item: pytest.Item | None) -> list[Failure]:
    default = default_clause(item)
    return [failure.in_clause(default) for failure in failures]


def _suite_file_id(path: Path) -> str | None:
    """``conformance/<file>`` for a file of the suite (wherever it is installed), else None."""
    resolved = path.resolve()
    if CONFORMANCE_DIR not in resolved.parents:
        return None
    return f"conformance/{resolved.relative_to(CONFORMANCE_DIR).as_posix()}"


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """A test file of the suite is collected with the id ``conformance/<file>`` wherever the suite
    lives, so that every id pytest and the harness print (``FAILED conformance/test_x.py::test_y[...]``,
    warnings, ``--report-json``, junit) names its file, also under ``--pyargs`` from another directory
    (where pytest's own id would be relative to the package, or empty for a module given by name).
    In a checkout run from its root that is pytest's own id."""
    file_id = _suite_file_id(module_path)
    if file_id is None:
        return None
    # from_parent's nodeid= is FSCollector's own parameter (given as a string, which pytest accepts).
    return pytest.Module.from_parent(parent, path=module_path, nodeid=file_id)


def suite_path_argument(arg: str, invocation_dir: Path) -> str | None:
    """The argument to use for ``arg`` when it is an id the suite printed, ``conformance/<file>[::...]``,
    that names no file under ``invocation_dir`` while the suite (installed, run from elsewhere) has that
    file: the same id with the suite's file; else None (``arg`` is used as it is)."""
    path_part, sep, rest = arg.partition("::")
    if not path_part.startswith("conformance/") or (invocation_dir / path_part).exists():
        return None
    candidate = CONFORMANCE_DIR / path_part[len("conformance/"):]
    return f"{candidate}{sep}{rest}" if candidate.exists() else None


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """Let an id the suite printed be pasted back to rerun it wherever the suite is installed
    (:func:`suite_path_argument`). Done before pytest picks the initial conftests from the arguments, so
    that the suite's conftest loads as it does for ``--pyargs conformance``. (Called for the plugin as
    an installed entry point or ``-p``; in a checkout the ids are paths that exist.)"""
    invocation = early_config.invocation_params.dir
    given = getattr(early_config.known_args_namespace, "file_or_dir", None) or []
    for index, arg in enumerate(given):
        resolved = suite_path_argument(arg, invocation)
        if resolved is None:
            continue
        given[index] = resolved
        args[:] = [resolved if a == arg else a for a in args]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    spec_ids = set(load_spec())
    unknown: dict[str, list[str]] = {}
    untagged: list[str] = []
    without_impl: list[str] = []
    test_ids = {item: suite_test_id(item) for item in items}  # the ids entries and reports use, once
    for item in items:
        reqs = _item_reqs(item)
        for req in reqs:
            if req not in spec_ids:
                unknown.setdefault(req, []).append(item.nodeid)
        in_suite = CONFORMANCE_DIR in Path(str(item.path)).resolve().parents
        if in_suite and not reqs:
            untagged.append(item.nodeid)
        # A capability requirement is checked against an adapter; a test of the reference alone (no
        # `impl`) belongs in tests/reference/, where the report does not count it for any column.
        if in_suite and item_impl(item) is None and any(capability_of(r) for r in reqs):
            without_impl.append(item.nodeid)
        _rank_timeout(config, item)  # a malformed rank_timeout marker is a usage error before anything runs
        covered = below_the_largest_world_size(item)
        if covered is not None:
            item.add_marker(pytest.mark.skip(reason=covered))
        impl = item_impl(item)
        item.user_properties.append(("reqs", reqs))
        item.user_properties.append(("impl", impl.name if impl else None))
        item.user_properties.append(("test_id", test_ids[item]))
    if unknown:
        listing = "; ".join(f"{req} (named by {nodes[0]})" for req, nodes in sorted(unknown.items()))
        raise pytest.UsageError(f"requirement IDs not in conformance/SPEC.md: {listing}")
    if untagged:
        raise pytest.UsageError(
            "conformance tests must name the requirement IDs they check with @pytest.mark.req(...): "
            + ", ".join(untagged[:10])
        )

    if without_impl:
        raise pytest.UsageError(
            "conformance tests of a capability (FP/SD/OS/ML) must take the `impl` fixture; tests of the "
            "reference alone belong in tests/reference/: " + ", ".join(without_impl[:10])
        )

    import torch

    entries = config.stash[_SESSION].entries
    candidates: dict[str | None, list[XfailEntry]] = {}
    used: set[XfailEntry] = set()
    misplaced: list[str] = []
    for item in items:
        impl = item_impl(item)
        key = impl.name if impl is not None else None
        if key not in candidates:
            candidates[key] = applicable_entries(entries, impl)
        exclusions = exclusions_for(item, test_ids[item], candidates[key], torch.__version__)
        if exclusions:
            used.update(exclusions)
            misplaced += check_exclusions(item, test_ids[item], exclusions)
            item.stash[_EXCLUSIONS] = exclusions
        entry = entry_for(item, test_ids[item], candidates[key], torch.__version__)
        if entry is None:
            continue
        used.add(entry)
        item.stash[_ENTRY] = entry
        pinned = f"; pinned: {entry.pin.describe()}" if entry.pin else ""
        if entry.hangs and not harness_config(config).run_known_hangs:
            reason = f"{entry.reason} [{entry.source}; a known hang, not run: --run-known-hangs runs it]"
            item.add_marker(pytest.mark.xfail(reason=reason, run=False))
        else:
            # Not pytest's strict: pytest_runtest_makereport turns a pass into a failure naming the entry
            # (unless it is flaky), which pytest's "[XPASS(strict)] reason" would not.
            item.add_marker(pytest.mark.xfail(reason=f"{entry.reason} [{entry.source}{pinned}]", strict=False))
    if misplaced:
        raise pytest.UsageError("; ".join(dict.fromkeys(misplaced)))
    warn_stale(entries, used, items, test_ids, torch.__version__)
    _deselect_other_shards(config, items, test_ids)


def _deselect_other_shards(config: pytest.Config, items: list[pytest.Item], test_ids: dict[pytest.Item, str]) -> None:
    """Keep the K-th of N parts of the tests (HX-35), after this plugin's checks of the whole collection
    (a stale known deviation is judged on all of it). Every part deals from the same collection and the
    same measured costs (:mod:`~conformance.harness.shards`), so a test is in exactly one part, whatever
    else deselects later (``-k``), and the parts cost about the same; a part keeps its tests in
    collection order."""
    shard = harness_config(config).shard
    if shard is None:
        return
    k, n = shard
    try:
        costs = load_costs()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    owners = deal([costs.cost(test_ids[item]) for item in items], n)
    keep = [item for item, owner in zip(items, owners) if owner == k - 1]
    other = [item for item, owner in zip(items, owners) if owner != k - 1]
    if other:
        config.hook.pytest_deselected(items=other)
    items[:] = keep


@pytest.fixture
def excluded_cases(request: pytest.FixtureRequest) -> tuple[XfailEntry, ...]:
    """The exclusions (expected-failures entries ``exclude=NAME``) that apply to this test for its
    adapter, inherited ones included, each with its source: the generated test leaves those families
    of cases out of its domain."""
    return request.node.stash.get(_EXCLUSIONS, ())


# -- running: capability skips, backend checks, rank dispatch -------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return
    settings = harness_config(item.config)
    spec = callspec.params.get("dist")
    sizes = [spec.world_size] if isinstance(spec, DistSpec) else []
    sizes += list(callspec.params.get("world_size_pair") or ())
    reason = settings.why_not_run(max(sizes)) if sizes else None
    if reason is not None:
        _skip(reason)
    impl = item_impl(item)
    if impl is not None and sizes:
        device_reason = impl.why_not_on("cuda" if settings.backend_for(max(sizes)) == "nccl" else "cpu")
        if device_reason is not None:
            _skip(device_reason)
    if impl is not None and impl.checkpoint_format != "dcp":
        for mark in item.iter_markers("dcp_format"):
            _skip(f"{impl.name} writes its own checkpoint format ({impl.checkpoint_format!r}), not DCP's: {mark.args[0]}")
    if impl is not None and not impl.has_dcp_files:
        for mark in item.iter_markers("dcp_files"):
            _skip(f"{impl.name}'s checkpoints ({impl.checkpoint_format!r}) hold no DCP files: {mark.args[0]}")
    if impl is not None:
        for capability in sorted({c for c in map(capability_of, _item_reqs(item)) if c}):
            reason = impl.unsupported_reason(capability)
            if reason is not None:
                _skip(f"{impl.name} does not provide {capability}: {reason}")


def _skip(reason: str) -> NoReturn:
    """Skip the current test, reported at the test's location rather than at this plugin's line."""
    # `_use_item_location` is pytest's own (private) switch for exactly this; without it every skip
    # of the suite would point at plugin.py.
    raise pytest.skip.Exception(reason, _use_item_location=True)


def _format_run(run: RankRun, backend: str, timeout_s: float, headline: str, runner: Runner) -> str:
    lines = [f"{headline} (world size {run.world_size}, {backend})"]
    for rank in range(run.world_size):
        outcome = run.outcomes.get(rank)
        if rank in run.died:
            lines.append(f"  rank {rank}: DIED ({_how_died(run.died[rank])})")
        elif rank in run.hung:
            lines.append(f"  rank {rank}: HUNG (no answer within {timeout_s:.0f}s; Python stacks in its output)")
        elif outcome is not None:
            status = {"ok": "passed", "fail": "FAILED", "skip": "skipped", "xfail": "xfailed"}[outcome.status]
            reason = f": {outcome.error}" if outcome.status in ("skip", "xfail") else ""
            lines.append(f"  rank {rank}: {status}{reason}")
    if not run.healthy:
        lines.append(f"  {runner.after_unhealthy_run()}")
    for rank in range(run.world_size):
        outcome = run.outcomes.get(rank)
        if outcome is not None and outcome.status == "fail":
            lines += ["", f"---------- rank {rank} traceback ----------", outcome.error.rstrip()]
    for rank in range(run.world_size):
        text = run.output.get(rank, "").rstrip()
        if text:
            lines += ["", f"---------- rank {rank} output ----------", text]
    return "\n".join(lines)


def _how_died(code: int | None) -> str:
    """A dead rank's exit status; None under torchrun, where only the launcher sees it."""
    if code is None:
        return "its process is gone; torchrun reports its exit status"
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def _judge(run: RankRun, backend: str, timeout_s: float, runner: Runner) -> list[Any]:
    """Turn what the ranks did into one pytest outcome; return per-rank values when all passed."""
    statuses = {r: o.status for r, o in run.outcomes.items()}
    kinds = set(statuses.values())
    if not run.healthy or "fail" in kinds:
        culprits = sorted([r for r, s in statuses.items() if s == "fail"] + list(run.died) + run.hung)
        pytest.fail(_format_run(run, backend, timeout_s, f"rank test failed on rank(s) {culprits}", runner), pytrace=False)
    if kinds == {"ok"}:
        return [run.outcomes[r].value for r in range(run.world_size)]
    if len(kinds) == 1:
        reasons = {o.error for o in run.outcomes.values()}
        if len(reasons) == 1:
            reason = reasons.pop()
        else:
            reason = "ranks gave different reasons: " + "; ".join(
                f"rank {r}: {run.outcomes[r].error}" for r in sorted(run.outcomes)
            )
        if kinds == {"skip"}:
            _skip(reason)
        pytest.xfail(reason)
    pytest.fail(_format_run(run, backend, timeout_s, "ranks disagree", runner), pytrace=False)


def rank_failures(run: RankRun, timeout_s: float) -> list[Failure]:
    """One :class:`Failure` per rank that failed, died or hung in ``run``, by rank."""
    failures = []
    for rank in range(run.world_size):
        outcome = run.outcomes.get(rank)
        if rank in run.died:
            failures.append(Failure(rank=rank, type=DIED, message=f"the rank process died ({_how_died(run.died[rank])})"))
        elif rank in run.hung:
            failures.append(Failure(rank=rank, type=HUNG, message=f"no answer within {timeout_s:.0f}s"))
        elif outcome is not None and outcome.status == "fail":
            lines = outcome.error.strip().splitlines()
            failures.extend(outcome.failures or [Failure(rank=rank, type="Error", message=lines[-1] if lines else "")])
    return failures


def health_check_body(ctx: Any) -> None:
    """Run after ranks ended a test differently: proves the group still completes a collective."""
    ctx.barrier()


def _rank_timeout(config: pytest.Config, node: pytest.Item | None) -> float:
    """Seconds a rank test may run: ``--rank-timeout``, or less where the test's ``rank_timeout``
    marker says so (a test that may leave ranks waiting fails in seconds, not minutes)."""
    limit = harness_config(config).rank_timeout_s
    marker = node.get_closest_marker("rank_timeout") if node is not None else None
    if marker is None or node is None:
        return limit
    if len(marker.args) != 1 or not isinstance(marker.args[0], (int, float)) or marker.args[0] <= 0:
        raise pytest.UsageError(f"{node.nodeid}: rank_timeout takes one positive number of seconds; got {marker.args}")
    return min(limit, float(marker.args[0]))


def _run_on_ranks(
    config: pytest.Config,
    world_size: int,
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    node: pytest.Item | None = None,
    *,
    rerun_crash: bool = False,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks of the session's runner and judge the outcomes (:func:`_judge`).
    ``rerun_crash``: the call is the whole test, which ``--rerun-crashes`` may run again (a phase of a
    ``pools`` test is not: the state its earlier phases left on the ranks died with them)."""
    runner = config.stash[_SESSION].runner
    timeout_s = _rank_timeout(config, node)
    tmp_dir = tempfile.mkdtemp(prefix="sdc-test-")
    try:
        try:
            run = runner.run(world_size, backend, fn, args, kwargs, tmp_dir=tmp_dir, timeout_s=timeout_s)
            if rerun_crash and node is not None and _crash_to_rerun(config, node, run, timeout_s):
                _record_crash(config, node, run, backend, timeout_s)
                # The crashed pool was stopped: the test runs again from the start on fresh ranks.
                shutil.rmtree(tmp_dir, ignore_errors=True)
                tmp_dir = tempfile.mkdtemp(prefix="sdc-test-")
                run = runner.run(world_size, backend, fn, args, kwargs, tmp_dir=tmp_dir, timeout_s=timeout_s)
        except RanksNotStarted as exc:
            pytest.fail(str(exc), pytrace=False)
        if node is not None:
            node.stash[_RANK_FAILURES] = (world_size, _in_clauses(rank_failures(run, timeout_s), node))
        if run.healthy and len({o.status for o in run.outcomes.values()}) > 1:
            runner.run(world_size, backend, health_check_body, (DIST_ARG,), {}, tmp_dir=tmp_dir, timeout_s=30.0)
        return _judge(run, backend, timeout_s, runner)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """A test run on the controller (not on ranks) that meets an op its adapter lacks is a skip naming
    the op, as a rank test's is (:func:`conformance.harness.worker.run_task`): never a pass, never a failure."""
    try:
        return (yield)
    except Unsupported as exc:
        _skip(skip_reason(exc))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    spec = pyfuncitem.funcargs.get("dist")
    if not isinstance(spec, DistSpec):
        return None
    names = list(inspect.signature(pyfuncitem.obj).parameters)
    kwargs = {name: (DIST_ARG if name == "dist" else pyfuncitem.funcargs[name]) for name in names}
    _run_on_ranks(pyfuncitem.config, spec.world_size, spec.backend, pyfuncitem.obj, (), kwargs, pyfuncitem, rerun_crash=True)
    return True


# -- --rerun-crashes: an intermittent native crash of an adapter the suite does not test -------------


def _memory_error(code: int | None) -> bool:
    return code is not None and code < 0 and -code in MEMORY_ERROR_SIGNALS


def _crash_to_rerun(config: pytest.Config, item: pytest.Item, run: RankRun, timeout_s: float) -> bool:
    """Whether ``run`` of ``item`` is a crash ``--rerun-crashes`` reruns: its adapter is named there
    (by its own name: an adapter derived from a named one is not), a rank died of a memory error, and
    that death is not the failure the test's known deviation expects (an entry with no pin, or one
    that the run matches, already accounts for it)."""
    impl = item_impl(item)
    if impl is None or impl.name not in harness_config(config).rerun_crashes:
        return False
    if not config.stash[_SESSION].runner.contains_crashes:  # a dead rank ended the run: nothing reruns
        return False
    if not any(_memory_error(code) for code in run.died.values()):
        return False
    entry = item.stash.get(_ENTRY, None)
    if entry is None:
        return True
    return bool(entry.pin) and entry.pin.mismatch(_in_clauses(rank_failures(run, timeout_s), item), run.world_size) is not None


def _record_crash(config: pytest.Config, item: pytest.Item, run: RankRun, backend: str, timeout_s: float) -> None:
    """Keep the crash of ``item``'s first run for the terminal summary and its report."""
    record = {
        "nodeid": item.nodeid,
        "died": {str(rank): _how_died(code) for rank, code in sorted(run.died.items())},
        "output": {
            str(rank): "\n".join(run.output.get(rank, "").rstrip().splitlines()[-_CRASH_OUTPUT_LINES:])
            for rank in sorted(run.died)
        },
        "first_run": _format_run(run, backend, timeout_s, "first run", config.stash[_SESSION].runner)[:4000],
    }
    config.stash[_SESSION].crashes.append(record)
    item.stash.setdefault(_ITEM_CRASHES, []).append(record)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    crashes = config.stash[_SESSION].crashes if _SESSION in config.stash else []
    if not crashes:
        return
    terminalreporter.section("crashes rerun (--rerun-crashes)")
    for record in crashes:
        deaths = ", ".join(f"rank {rank} {how}" for rank, how in record["died"].items())
        terminalreporter.line(f"{record['nodeid']}: {deaths}; run again on a fresh pool (its outcome is the second run's)")
        for rank, text in record["output"].items():
            if text:
                terminalreporter.line(f"---------- rank {rank} output (last lines) ----------")
                terminalreporter.line(text)


class Pools:
    """Controller-side access to the pools, for tests with several phases (``pools`` fixture)."""

    def __init__(self, config: pytest.Config, node: pytest.Item | None = None) -> None:
        self._config = config
        self._node = node

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank of the ``world_size`` pool; per-rank return values."""
        settings = harness_config(self._config)
        reason = settings.why_not_run(world_size)
        if reason is not None:
            _skip(reason)
        return _run_on_ranks(self._config, world_size, settings.backend_for(world_size), fn, (DIST_ARG, *args), kwargs, self._node)


@pytest.fixture
def pools(request: pytest.FixtureRequest) -> Pools:
    """Run module-level functions on the rank pools of any world size (see :class:`Pools`)."""
    return Pools(request.config, request.node)


# -- pinned known deviations: a test that fails otherwise is a failure ------------------------------


def _test_failures(item: pytest.Item, call: pytest.CallInfo[None]) -> tuple[int | None, list[Failure]]:
    """(world size or None, failures) of the test's call phase: the ranks' own failures for a rank
    test, else the exception that ended it on the controller."""
    if _RANK_FAILURES in item.stash:
        return item.stash[_RANK_FAILURES]
    excinfo = call.excinfo
    if excinfo is None or isinstance(excinfo.value, (pytest.skip.Exception, pytest.xfail.Exception)):
        return None, []
    return None, _in_clauses(Failure.all_of(excinfo.value, None), item)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if call.when != "call":
        return report
    world_size, failures = _test_failures(item, call)
    if failures and (report.failed or getattr(report, "wasxfail", None) is not None):
        report.user_properties = [*report.user_properties, ("failures", [f.to_json() for f in failures])]
    entry = item.stash.get(_ENTRY, None)
    if entry is not None:
        report.user_properties = [*report.user_properties, ("entry", entry_json(entry))]
    crashes = item.stash.get(_ITEM_CRASHES, [])
    if crashes:
        report.user_properties = [*report.user_properties, ("crashes", [{k: c[k] for k in ("died", "output")} for c in crashes])]
        if report.failed:
            report.longrepr = f"{report.longreprtext}\n\nthe test was run twice (--rerun-crashes): {crashes[0]['first_run']}"
    if entry is not None and report.passed and getattr(report, "wasxfail", None) is not None:
        report.user_properties = [*report.user_properties, ("strict", not entry.flaky)]
        if not entry.flaky:
            report.outcome = "failed"
            del report.wasxfail
            report.longrepr = no_longer_deviates(item, entry)
    if entry is not None and entry.pin and report.skipped and getattr(report, "wasxfail", None) is not None:
        problem = entry.pin.mismatch(failures, world_size)
        if problem is not None:
            got = "; ".join(f.headline() for f in failures) or "no failure recorded"
            original = report.longreprtext
            report.outcome = "failed"
            del report.wasxfail
            report.longrepr = (
                f"known deviation failed differently ({entry.source}: {entry.reason}): {problem}\n"
                f"  pinned: {entry.pin.describe()}\n  got:    {got}\n\n{original}"
            )
    return report


# -- the JSON result -------------------------------------------------------------------------------


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    record_report(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if _SESSION in config.stash:
        config.stash[_SESSION].runner.stop()
    _write_report(session, exitstatus)


def _write_report(session: pytest.Session, exitstatus: int) -> None:
    """Write ``--report-json`` (where this process reports: under torchrun, the reporting rank). Also
    what the torchrun runner calls when the job ends while the reporting rank is stuck in a test."""
    config = session.config
    path = config.getoption("--report-json")
    if path:
        payload = report_payload(config, config.stash[_SESSION].entries if _SESSION in config.stash else [])
        Path(path).write_text(json.dumps(payload, indent=1), encoding="utf-8")
