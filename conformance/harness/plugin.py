"""The pytest plugin of the conformance suite: options, axes, rank dispatch, xfails, the JSON result.

Loaded by ``conformance/conftest.py`` and ``tests/conftest.py`` (``pytest_plugins``; registered once),
and by the self-tests' subprocess runs with ``-p conformance.harness.plugin``.
How tests use it is in :mod:`conformance.harness`.

The hooks and fixtures are here; what they call lives in modules of its own: the options, markers and
the environment check (:mod:`~conformance.harness.options`), the session's state, a body's run on the
ranks with its verdict and the ``pools`` fixture's :class:`~conformance.harness.dispatch.Pools`
(:mod:`~conformance.harness.dispatch`), the axes and test ids (:mod:`~conformance.harness.axes`), the
expected-failures machinery (:mod:`~conformance.harness.known_deviations`), the ``--report-json``
document (:mod:`~conformance.harness.report_json`), the run's settings (:mod:`~conformance.harness.config`),
and what runs the bodies on ranks (a :class:`~conformance.harness.runner.Runner`: the pools of
:mod:`~conformance.harness.pool`, or the ranks of a torchrun job, :mod:`~conformance.harness.torchrun`),
chosen once at configure.
"""

from __future__ import annotations

import atexit
import inspect
import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest

from conformance.adapters.base import Adapter, capability_of, load_adapter
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
from conformance.harness.dispatch import (
    ENTRY,
    ITEM_CRASHES,
    RANK_FAILURES,
    SESSION,
    Pools,
    Session,
    in_clauses,
    item_reqs,
    rank_timeout,
    run_on_ranks,
    skip_test,
)
from conformance.harness.failures import Failure
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
from conformance.harness.options import add_markers, add_options, check_environment
from conformance.harness.pool import PoolRunner
from conformance.harness.report_json import SESSION_RESULTS, record_report, report_payload
from conformance.harness.requirements import load_spec
from conformance.harness.runner import Runner
from conformance.harness.shards import deal_together, load_costs
from conformance.harness.torchrun import launched, start_runner
from conformance.harness.worker import DIST_ARG, SUPPORT_MODULES
from conformance.harness.xfails import XfailEntry

# The support modules hold the tests' checks (moved out of the test files): their bare asserts get
# pytest's messages, as a test module's do (the harness imports none of them: this comes first).
pytest.register_assert_rewrite(*SUPPORT_MODULES)

__all__ = ["DistSpec", "StaleXfailWarning", "selected_world_sizes", "suite_test_id", "AdapterFile", "adapter_xfail_files"]


#: The exclusions (``exclude=`` entries) that apply to a test, for the ``excluded_cases`` fixture.
_EXCLUSIONS = pytest.StashKey[tuple[XfailEntry, ...]]()


# -- options and configuration ---------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


# First: a torchrun rank joins its job here, and other plugins' configure must see what that sets
# (hypothesis reads --hypothesis-seed, which every rank takes from rank 0).
@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    add_markers(config)
    check_environment()
    settings, runner = _start(config)
    config.stash[SETTINGS] = settings
    config.stash[SESSION] = Session(runner=runner, entries=load_xfail_entries(config))
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


def pytest_unconfigure(config: pytest.Config) -> None:
    if SESSION in config.stash:
        config.stash[SESSION].runner.stop()


def pytest_report_header(config: pytest.Config) -> list[str]:
    import torch

    settings = harness_config(config)
    sizes = list(settings.world_sizes)
    backends = ", ".join(f"ws{ws}={settings.backend_for(ws)}" for ws in sizes)
    return [
        f"conformance: torch {torch.__version__}, cuda devices {settings.cuda_devices}",
        f"conformance: world sizes {sizes}, backends {backends}, rank timeout {settings.rank_timeout_s}s",
        f"conformance: implementations {', '.join(impl_specs(config))}",
        *entries_header(config.stash[SESSION].entries if SESSION in config.stash else []),
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
        reqs = item_reqs(item)
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
        rank_timeout(config, item)  # a malformed rank_timeout marker is a usage error before anything runs
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

    entries = config.stash[SESSION].entries
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
        item.stash[ENTRY] = entry
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
    owners = deal_together([costs.cost(test_ids[item]) for item in items], [_set_up_with(item) for item in items], n)
    keep = [item for item, owner in zip(items, owners) if owner == k - 1]
    other = [item for item, owner in zip(items, owners) if owner != k - 1]
    if other:
        config.hook.pytest_deselected(items=other)
    items[:] = keep


def _set_up_with(item: pytest.Item) -> object:
    """What ``item`` shares its set-up with, for the deal into parts: its module where it uses a fixture
    of module, package or class scope (set up once for the tests that share it: an installed copy of the
    suite, torchrun jobs, a group of ranks), else the test alone. Read from pytest's fixture info of the
    item (``_fixtureinfo``, not public: no public API says a test's fixtures' scopes)."""
    info = getattr(item, "_fixtureinfo", None)
    for definitions in getattr(info, "name2fixturedefs", {}).values():
        if definitions and definitions[-1].scope in ("module", "package", "class"):
            return ("module", item.nodeid.partition("::")[0])
    return ("test", item.nodeid)


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
        skip_test(reason)
    impl = item_impl(item)
    if impl is not None and sizes:
        device_reason = impl.why_not_on("cuda" if settings.backend_for(max(sizes)) == "nccl" else "cpu")
        if device_reason is not None:
            skip_test(device_reason)
    if impl is not None and impl.checkpoint_format != "dcp":
        for mark in item.iter_markers("dcp_format"):
            skip_test(f"{impl.name} writes its own checkpoint format ({impl.checkpoint_format!r}), not DCP's: {mark.args[0]}")
    if impl is not None and not impl.has_dcp_files:
        for mark in item.iter_markers("dcp_files"):
            skip_test(f"{impl.name}'s checkpoints ({impl.checkpoint_format!r}) hold no DCP files: {mark.args[0]}")
    if impl is not None:
        for capability in sorted({c for c in map(capability_of, item_reqs(item)) if c}):
            reason = impl.unsupported_reason(capability)
            if reason is not None:
                skip_test(f"{impl.name} does not provide {capability}: {reason}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """A test run on the controller (not on ranks) that meets an op its adapter lacks is a skip naming
    the op, as a rank test's is (:func:`conformance.harness.worker.run_task`): never a pass, never a failure."""
    try:
        return (yield)
    except Unsupported as exc:
        skip_test(skip_reason(exc))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    spec = pyfuncitem.funcargs.get("dist")
    if not isinstance(spec, DistSpec):
        return None
    names = list(inspect.signature(pyfuncitem.obj).parameters)
    kwargs = {name: (DIST_ARG if name == "dist" else pyfuncitem.funcargs[name]) for name in names}
    run_on_ranks(pyfuncitem.config, spec.world_size, spec.backend, pyfuncitem.obj, (), kwargs, pyfuncitem, rerun_crash=True)
    return True

def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    crashes = config.stash[SESSION].crashes if SESSION in config.stash else []
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

@pytest.fixture
def pools(request: pytest.FixtureRequest) -> Pools:
    """Run module-level functions on the rank pools of any world size (see :class:`Pools`)."""
    return Pools(request.config, request.node)


# -- pinned known deviations: a test that fails otherwise is a failure ------------------------------


def _test_failures(item: pytest.Item, call: pytest.CallInfo[None]) -> tuple[int | None, list[Failure]]:
    """(world size or None, failures) of the test's call phase: the ranks' own failures for a rank
    test, else the exception that ended it on the controller."""
    if RANK_FAILURES in item.stash:
        return item.stash[RANK_FAILURES]
    excinfo = call.excinfo
    if excinfo is None or isinstance(excinfo.value, (pytest.skip.Exception, pytest.xfail.Exception)):
        return None, []
    return None, in_clauses(Failure.all_of(excinfo.value, None), item)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if call.when != "call":
        return report
    world_size, failures = _test_failures(item, call)
    if failures and (report.failed or getattr(report, "wasxfail", None) is not None):
        report.user_properties = [*report.user_properties, ("failures", [f.to_json() for f in failures])]
    entry = item.stash.get(ENTRY, None)
    if entry is not None:
        report.user_properties = [*report.user_properties, ("entry", entry_json(entry))]
    crashes = item.stash.get(ITEM_CRASHES, [])
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
    if SESSION in config.stash:
        config.stash[SESSION].runner.stop()
    _write_report(session, exitstatus)


def _write_report(session: pytest.Session, exitstatus: int) -> None:
    """Write ``--report-json`` (where this process reports: under torchrun, the reporting rank). Also
    what the torchrun runner calls when the job ends while the reporting rank is stuck in a test."""
    config = session.config
    path = config.getoption("--report-json")
    if path:
        payload = report_payload(config, config.stash[SESSION].entries if SESSION in config.stash else [])
        Path(path).write_text(json.dumps(payload, indent=1), encoding="utf-8")
