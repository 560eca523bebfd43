"""The pytest plugin of the conformance suite: options, axes, rank dispatch, xfails, the JSON result.

Loaded by ``conformance/conftest.py`` and ``tests/conftest.py`` (``pytest_plugins``; registered once),
and by the self-tests' subprocess runs with ``-p conformance.harness.plugin``.
How tests use it is in :mod:`conformance.harness`.
"""

from __future__ import annotations

import atexit
import inspect
import itertools
import json
import shutil
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

from conformance.adapters.base import SHIPPED, Adapter, capability_of, load_adapter
from conformance.harness.failures import DIED, HUNG, Failure
from conformance.harness.pool import PoolManager, PoolRun, PoolStartError
from conformance.harness.requirements import load_spec
from conformance.harness.worker import DIST_ARG
from conformance.harness.xfails import XfailEntry, as_run_by, matches_at_any_world_size, parse_xfails

__all__ = ["DistSpec", "Pools", "StaleXfailWarning", "selected_world_sizes", "suite_test_id"]

# The torchrun mode (every rank of a launched job a pytest process): its hooks, and the three hooks
# here that consult it (the manager, the default world sizes, the GPUs per rank).
pytest_plugins = ("conformance.harness.torchrun",)

_CONFORMANCE_DIR = Path(__file__).resolve().parent.parent
_MANAGER = pytest.StashKey[PoolManager]()
#: The expected-failures entries of the session (loaded once, at configure).
_ENTRIES = pytest.StashKey[list[XfailEntry]]()
#: The known-deviation entry applied to a test, for the pin check after it ran.
_ENTRY = pytest.StashKey[XfailEntry]()
#: The exclusions (``exclude=`` entries) that apply to a test, for the ``excluded_cases`` fixture.
_EXCLUSIONS = pytest.StashKey[tuple[XfailEntry, ...]]()
#: (world size, failures) of a test's last rank run.
_RANK_FAILURES = pytest.StashKey[tuple[int, list[Failure]]]()


class StaleXfailWarning(UserWarning):
    """An expected-failures entry matched no collected test of its file."""


@dataclass(frozen=True)
class DistSpec:
    """The value the controller holds for ``dist`` until the body runs on the ranks."""

    world_size: int
    backend: str

    def __repr__(self) -> str:
        return f"ws{self.world_size}"


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


def selected_world_sizes(config: pytest.Config) -> list[int]:
    """The world sizes ``--world-size`` selects (the default when it is not given), sorted, each once; a
    usage error for anything but positive integers. Tests that pick their own world sizes read them here."""
    raw = config.getoption("--world-size")
    try:
        sizes = sorted({int(part) for part in str(raw).split(",") if part.strip()})
    except ValueError:
        raise pytest.UsageError(f"--world-size expects integers like 1,2,4; got {raw!r}") from None
    if not sizes or min(sizes) < 1:
        raise pytest.UsageError(f"--world-size expects positive integers; got {raw!r}")
    return sizes


def _impl_specs(config: pytest.Config) -> list[str]:
    specs = [s.strip() for opt in config.getoption("--impl") for s in opt.split(",") if s.strip()]
    return list(dict.fromkeys(specs)) or list(SHIPPED)


def _cuda_count() -> int:
    """CUDA devices for the ranks: this machine's; under torchrun, how many of the job's first ranks drive one."""
    import torch

    from conformance.harness.torchrun import job_cuda_count

    launched = job_cuda_count()
    if launched is not None:
        return launched

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _backend_for(config: pytest.Config, world_size: int) -> str:
    choice = config.getoption("--backend")
    if choice == "auto":
        return "nccl" if _cuda_count() >= world_size else "gloo"
    return choice


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
        "case_families(*names): the families of generated cases this test draws, which an expected-failures entry "
        "may leave out for an adapter (exclude=NAME); the test reads them with the excluded_cases fixture",
    )
    from conformance.harness.torchrun import SESSION_FINISH, default_world_sizes, manager_for

    config.stash[SESSION_FINISH] = pytest_sessionfinish
    config.option.world_size = config.option.world_size or default_world_sizes() or "1,2"
    config.stash[_ENTRIES] = _load_xfail_entries(config)
    manager = manager_for(config) or PoolManager(pg_timeout_s=max(60.0, config.getoption("--rank-timeout") * 2))
    config.stash[_MANAGER] = manager
    _SESSION_RESULTS.clear()
    atexit.register(manager.stop_all)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _MANAGER in config.stash:
        config.stash[_MANAGER].stop_all()


def pytest_report_header(config: pytest.Config) -> list[str]:
    import torch

    sizes = selected_world_sizes(config)
    backends = ", ".join(f"ws{ws}={_backend_for(config, ws)}" for ws in sizes)
    return [
        f"conformance: torch {torch.__version__}, cuda devices {_cuda_count()}",
        f"conformance: world sizes {sizes}, backends {backends}, rank timeout {config.getoption('--rank-timeout')}s",
        f"conformance: implementations {', '.join(_impl_specs(config))}",
        *_entries_header(config),
    ]


def _entries_header(config: pytest.Config) -> list[str]:
    """One line per expected-failures file: its entries, how many are active for this torch and
    which backends/devices they need; then every entry that is not active everywhere, by name."""
    import torch

    by_file: dict[str, list[XfailEntry]] = {}
    for entry in config.stash.get(_ENTRIES, []):
        by_file.setdefault(entry.source.rsplit(":", 1)[0], []).append(entry)
    lines = []
    for path, entries in by_file.items():
        inactive = [e for e in entries if not e.when.holds_for_torch(torch.__version__)]
        conditional = [e for e in entries if e not in inactive and (e.when.backend or e.when.device)]
        pinned = sum(1 for e in entries if e.pin)
        excluded = sum(1 for e in entries if e.exclude and not e.removes)
        flaky = sum(1 for e in entries if e.flaky)
        counts = Counter(e.when.describe() for e in inactive)
        lines.append(
            f"conformance: known deviations {path}: {len(entries)} entries, {len(entries) - len(inactive)} active for torch "
            f"{torch.__version__} ({len(conditional)} of them only on some backends/devices), {pinned} pinned"
            + (f", {flaky} flaky" if flaky else "")
            + (f", {excluded} exclusions of generated cases" if excluded else "")
            + (f"; inactive: {', '.join(f'{n} x {c}' for c, n in counts.items())}" if inactive else "")
        )
        for entry in inactive:
            lines.append(f"conformance:   inactive ({entry.when.describe()}): {entry.source} {entry.pattern}")
        for entry in conditional:
            lines.append(f"conformance:   only where {entry.when.describe()}: {entry.source} {entry.pattern}")
    return lines


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
            specs = [DistSpec(ws, _backend_for(config, ws)) for ws in allowed]
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
        for spec in _impl_specs(config):
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


def _item_impl(item: pytest.Item) -> Adapter | None:
    callspec = getattr(item, "callspec", None)
    value = callspec.params.get("impl") if callspec is not None else None
    return value if isinstance(value, Adapter) else None


@dataclass(frozen=True)
class AdapterFile:
    """One expected-failures file of an adapter's class hierarchy."""

    name: str  #: the ``name`` of the class that sets ``xfails_file``: its patterns are written with it
    path: Path
    cls: str  #: that class, ``module.QualName``, for messages
    #: the names of the adapters that class derives from: its patterns may be written with those too
    aliases: tuple[str, ...]


#: adapter class -> its expected-failures files (resolved once: the plugin asks for every test).
_XFAIL_FILES: dict[type, tuple[AdapterFile, ...]] = {}


def adapter_xfail_files(adapter: Adapter) -> list[AdapterFile]:
    adapter_cls = type(adapter)
    if adapter_cls not in _XFAIL_FILES:
        _XFAIL_FILES[adapter_cls] = _xfail_files_of(adapter_cls, adapter.name)
    return list(_XFAIL_FILES[adapter_cls])


def _adapter_names(adapter_cls: type) -> list[str]:
    """The names of the adapter classes in ``adapter_cls``'s MRO that set one, in MRO order."""
    names: list[str] = []
    for cls in adapter_cls.__mro__:
        name = cls.__dict__.get("name")
        if isinstance(name, str) and cls is not Adapter and name not in names:
            names.append(name)
    return names


def _xfail_files_of(adapter_cls: type, adapter_name: str) -> tuple[AdapterFile, ...]:
    """The expected-failures files that apply to ``adapter``, its own first: one for each class in its
    MRO that sets ``xfails_file``. A relative path is resolved against the directory of the module that
    defines the class."""
    files = []
    for cls in adapter_cls.__mro__:
        raw = cls.__dict__.get("xfails_file")
        if not raw:
            continue
        path = Path(raw)
        if not path.is_absolute():
            module = sys.modules.get(cls.__module__)
            module_file = getattr(module, "__file__", None)
            if module_file is None:
                raise ValueError(f"{cls.__qualname__}.xfails_file {raw!r} is relative, but module {cls.__module__!r} has no file to resolve it against")
            path = (Path(module_file).resolve().parent / path).resolve()
        if not path.is_file():
            raise FileNotFoundError(
                f"expected-failures file {path} of adapter {adapter_name!r} ({cls.__module__}.{cls.__qualname__}.xfails_file = {raw!r}, "
                "relative to the directory of that module) does not exist"
            )
        name = str(getattr(cls, "name", adapter_name))
        aliases = tuple(n for n in _adapter_names(cls) if n != name)
        files.append(AdapterFile(name, path, f"{cls.__module__}.{cls.__qualname__}", aliases))
    return tuple(files)


def _load_xfail_entries(config: pytest.Config) -> list[XfailEntry]:
    """The entries of every ``--xfails`` file and adapter file (inherited ones included); a missing or
    malformed file is a usage error naming it."""
    entries: list[XfailEntry] = []
    seen: set[tuple[Path, str]] = set()
    try:
        for raw in config.getoption("--xfails"):
            entries += parse_xfails(Path(raw).resolve())
        for spec in _impl_specs(config):
            try:
                adapter = load_adapter(spec)
            except ValueError:
                continue  # reported as a usage error where the axes are built
            for depth, file in enumerate(adapter_xfail_files(adapter), start=1):
                if (file.path, file.name) not in seen:
                    seen.add((file.path, file.name))
                    entries += parse_xfails(file.path, impl=file.name, depth=depth, aliases=file.aliases)
    except (OSError, ValueError) as error:
        raise pytest.UsageError(str(error)) from None
    return entries


def _item_backend(item: pytest.Item) -> str | None:
    """The process-group backend a test runs with; None for a test on the controller."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    spec = callspec.params.get("dist")
    if isinstance(spec, DistSpec):
        return spec.backend
    pair = callspec.params.get("world_size_pair")
    if pair:
        return _backend_for(item.config, max(pair))
    return None


def _suite_file_id(path: Path) -> str | None:
    """``conformance/<file>`` for a file of the suite (wherever it is installed), else None."""
    resolved = path.resolve()
    if _CONFORMANCE_DIR not in resolved.parents:
        return None
    return f"conformance/{resolved.relative_to(_CONFORMANCE_DIR).as_posix()}"


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
    candidate = _CONFORMANCE_DIR / path_part[len("conformance/"):]
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


def suite_test_id(item: pytest.Item) -> str:
    """The id known-deviation entries and reports use: for a test of the suite,
    ``conformance/<file>::<name>[<params>]`` wherever the suite is (this checkout, or installed and run
    with ``--pyargs conformance`` from any directory); any other test's own node id."""
    path = Path(str(item.path)).resolve()
    if _CONFORMANCE_DIR not in path.parents or "::" not in item.nodeid:
        return item.nodeid
    return f"conformance/{path.relative_to(_CONFORMANCE_DIR).as_posix()}::{item.nodeid.split('::', 1)[1]}"


def _applicable(entries: list[XfailEntry], impl: Adapter | None) -> list[XfailEntry]:
    """The entries that may mark a test of ``impl``, in the order they are tried: ``--xfails`` entries
    first, then the adapter's own file, then the files of its base adapters."""
    mro_names = [file.name for file in adapter_xfail_files(impl)] if impl is not None else []
    applicable = [e for e in entries if e.impl is None or e.impl in mro_names]
    return sorted(applicable, key=lambda e: 0 if e.impl is None else 1 + mro_names.index(e.impl))


def _entry_for(item: pytest.Item, test_id: str, candidates: list[XfailEntry], torch_version: str) -> XfailEntry | None:
    """The first expected-failure entry of ``candidates`` (:func:`_applicable`) whose conditions hold
    for ``item`` and whose pattern matches its ``test_id``; a removal (``!pattern``, not of one
    exclusion) that matches first means none."""
    impl = _item_impl(item)
    backend = _item_backend(item)
    for entry in candidates:
        if entry.exclude is not None or not entry.when.holds(torch_version, backend):
            continue
        if entry.matches_test(test_id, impl.name if impl is not None else None):
            return None if entry.removes else entry
    return None


def _exclusions_for(item: pytest.Item, test_id: str, candidates: list[XfailEntry], torch_version: str) -> tuple[XfailEntry, ...]:
    """Every exclusion (``exclude=NAME``) of ``candidates`` whose conditions hold for ``item`` and whose
    pattern matches ``test_id``, one per name (the first in order), unless a removal earlier in order
    matches the test: ``!pattern`` cancels them all, ``!pattern exclude=NAME`` that one."""
    impl = _item_impl(item)
    run_name = impl.name if impl is not None else None
    backend = _item_backend(item)
    cancelled: set[str | None] = set()
    found: dict[str, XfailEntry] = {}
    for entry in candidates:
        if (entry.exclude is None and not entry.removes) or not entry.when.holds(torch_version, backend):
            continue
        if not entry.matches_test(test_id, run_name):
            continue
        if entry.removes:
            cancelled.add(entry.exclude)
        elif None not in cancelled and entry.exclude not in cancelled and entry.exclude is not None:
            found.setdefault(entry.exclude, entry)
    return tuple(found.values())


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
        in_suite = _CONFORMANCE_DIR in Path(str(item.path)).resolve().parents
        if in_suite and not reqs:
            untagged.append(item.nodeid)
        # A capability requirement is checked against an adapter; a test of the reference alone (no
        # `impl`) belongs in tests/reference/, where the report does not count it for any column.
        if in_suite and _item_impl(item) is None and any(capability_of(r) for r in reqs):
            without_impl.append(item.nodeid)
        _rank_timeout(config, item)  # a malformed rank_timeout marker is a usage error before anything runs
        impl = _item_impl(item)
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

    entries = config.stash.get(_ENTRIES, [])
    candidates: dict[str | None, list[XfailEntry]] = {}
    used: set[XfailEntry] = set()
    misplaced: list[str] = []
    for item in items:
        impl = _item_impl(item)
        key = impl.name if impl is not None else None
        if key not in candidates:
            candidates[key] = _applicable(entries, impl)
        exclusions = _exclusions_for(item, test_ids[item], candidates[key], torch.__version__)
        if exclusions:
            used.update(exclusions)
            misplaced += _check_exclusions(item, test_ids[item], exclusions)
            item.stash[_EXCLUSIONS] = exclusions
        entry = _entry_for(item, test_ids[item], candidates[key], torch.__version__)
        if entry is None:
            continue
        used.add(entry)
        item.stash[_ENTRY] = entry
        pinned = f"; pinned: {entry.pin.describe()}" if entry.pin else ""
        if entry.hangs and not config.getoption("--run-known-hangs"):
            reason = f"{entry.reason} [{entry.source}; a known hang, not run: --run-known-hangs runs it]"
            item.add_marker(pytest.mark.xfail(reason=reason, run=False))
        else:
            # Not pytest's strict: pytest_runtest_makereport turns a pass into a failure naming the entry
            # (unless it is flaky), which pytest's "[XPASS(strict)] reason" would not.
            item.add_marker(pytest.mark.xfail(reason=f"{entry.reason} [{entry.source}{pinned}]", strict=False))
    if misplaced:
        raise pytest.UsageError("; ".join(dict.fromkeys(misplaced)))
    _warn_stale(entries, used, items, test_ids, torch.__version__)


def _check_exclusions(item: pytest.Item, test_id: str, exclusions: tuple[XfailEntry, ...]) -> list[str]:
    """What is wrong with ``exclusions`` for ``item``: a test that draws no generated cases, or no family
    of that name (the ``case_families`` marker lists the ones it draws)."""
    marker = item.get_closest_marker("case_families")
    known = [str(name) for name in marker.args] if marker is not None else []
    problems = []
    for entry in exclusions:
        if marker is None:
            problems.append(
                f"{entry.source}: exclude={entry.exclude} matches {test_id}, which draws no generated cases (exclude= is for the tests of test_generated.py)"
            )
        elif entry.exclude not in known:
            problems.append(f"{entry.source}: exclude={entry.exclude}: {test_id} draws no family of that name (it draws: {', '.join(known)})")
    return problems


@pytest.fixture
def excluded_cases(request: pytest.FixtureRequest) -> tuple[XfailEntry, ...]:
    """The exclusions (expected-failures entries ``exclude=NAME``) that apply to this test for its
    adapter, inherited ones included, each with its source: the generated test leaves those families
    of cases out of its domain."""
    return request.node.stash.get(_EXCLUSIONS, ())


def _warn_stale(
    entries: list[XfailEntry], used: set[XfailEntry], items: list[pytest.Item], test_ids: dict[pytest.Item, str], torch_version: str
) -> None:
    """Warn about each active entry of a collected test file that would match no collected test at
    any world size (a removal: that would remove nothing). Entries conditioned on a backend or device
    are not judged: the run may not use it."""
    collected_files = {test_id.split("::", 1)[0] for test_id in test_ids.values()}
    run_names = {impl.name: impl for item in items if (impl := _item_impl(item)) is not None}
    for entry in entries:
        if entry in used or entry.file_part not in collected_files:
            continue
        if not entry.when.holds_for_torch(torch_version) or entry.when.backend or entry.when.device:
            continue
        ids = []
        for item in items:
            impl = _item_impl(item)
            names = (entry.impl, *entry.aliases) if impl is not None and entry.impl else (None,)
            ids += [as_run_by(test_ids[item], impl.name, name) if impl is not None and name else test_ids[item] for name in names]
        if any(matches_at_any_world_size(entry.pattern, nodeid) for nodeid in ids):
            continue
        hint = _base_name_hint(entry, test_ids, items, run_names)
        warnings.warn(
            StaleXfailWarning(f"expected-failures entry {entry.pattern!r} ({entry.source}) matches no collected test{hint}"),
            stacklevel=1,
        )


def _base_name_hint(entry: XfailEntry, test_ids: dict[pytest.Item, str], items: list[pytest.Item], run_names: dict[str, Adapter]) -> str:
    """For an entry that matches nothing: whether it would match a test of an adapter run here if its
    id segment were read as the name of an adapter that one derives from (a line written with
    ``torch`` where the tests run as ``myfork``), and what to write instead."""
    for name, adapter in run_names.items():
        for base in _adapter_names(type(adapter))[1:]:
            for item in items:
                impl = _item_impl(item)
                if impl is None or impl.name != name:
                    continue
                if matches_at_any_world_size(entry.pattern, as_run_by(test_ids[item], name, base)):
                    return (
                        f"; it is written with the name {base!r}, but these tests run against {name!r} "
                        f"(e.g. {test_ids[item]}): write the id with {name!r}, or put the line in the expected-failures "
                        f"file of {type(adapter).__module__}.{type(adapter).__qualname__} (its xfails_file), where "
                        f"{base!r} ids apply to {name!r}"
                    )
    return ""


# -- running: capability skips, backend checks, rank dispatch -------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return
    spec = callspec.params.get("dist")
    if isinstance(spec, DistSpec) and spec.backend == "nccl" and _cuda_count() < spec.world_size:
        _skip(f"nccl at world size {spec.world_size} needs {spec.world_size} CUDA devices; found {_cuda_count()}")
    pair = callspec.params.get("world_size_pair")
    if pair and item.config.getoption("--backend") == "nccl" and _cuda_count() < max(pair):
        _skip(f"nccl at world size {max(pair)} needs {max(pair)} CUDA devices; found {_cuda_count()}")
    impl = _item_impl(item)
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


def _format_run(run: PoolRun, backend: str, timeout_s: float, headline: str) -> str:
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
        from conformance.harness.torchrun import after_unhealthy_run

        lines.append(f"  {after_unhealthy_run() or 'the pool was killed and is restarted for the next test'}")
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


def _judge(run: PoolRun, backend: str, timeout_s: float) -> list[Any]:
    """Turn what the ranks did into one pytest outcome; return per-rank values when all passed."""
    statuses = {r: o.status for r, o in run.outcomes.items()}
    kinds = set(statuses.values())
    if not run.healthy or "fail" in kinds:
        culprits = sorted([r for r, s in statuses.items() if s == "fail"] + list(run.died) + run.hung)
        pytest.fail(_format_run(run, backend, timeout_s, f"rank test failed on rank(s) {culprits}"), pytrace=False)
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
    pytest.fail(_format_run(run, backend, timeout_s, "ranks disagree"), pytrace=False)


def rank_failures(run: PoolRun, timeout_s: float) -> list[Failure]:
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
    limit = float(config.getoption("--rank-timeout"))
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
) -> list[Any]:
    manager = config.stash[_MANAGER]
    timeout_s = _rank_timeout(config, node)
    tmp_dir = tempfile.mkdtemp(prefix="sdc-test-")
    try:
        try:
            run = manager.run(world_size, backend, fn, args, kwargs, tmp_dir=tmp_dir, timeout_s=timeout_s)
        except PoolStartError as exc:
            pytest.fail(str(exc), pytrace=False)
        if node is not None:
            node.stash[_RANK_FAILURES] = (world_size, rank_failures(run, timeout_s))
        if run.healthy and len({o.status for o in run.outcomes.values()}) > 1:
            manager.run(world_size, backend, health_check_body, (DIST_ARG,), {}, tmp_dir=tmp_dir, timeout_s=30.0)
        return _judge(run, backend, timeout_s)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    spec = pyfuncitem.funcargs.get("dist")
    if not isinstance(spec, DistSpec):
        return None
    names = list(inspect.signature(pyfuncitem.obj).parameters)
    kwargs = {name: (DIST_ARG if name == "dist" else pyfuncitem.funcargs[name]) for name in names}
    _run_on_ranks(pyfuncitem.config, spec.world_size, spec.backend, pyfuncitem.obj, (), kwargs, pyfuncitem)
    return True


class Pools:
    """Controller-side access to the pools, for tests with several phases (``pools`` fixture)."""

    def __init__(self, config: pytest.Config, node: pytest.Item | None = None) -> None:
        self._config = config
        self._node = node

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank of the ``world_size`` pool; per-rank return values."""
        backend = _backend_for(self._config, world_size)
        if backend == "nccl" and _cuda_count() < world_size:
            _skip(f"nccl at world size {world_size} needs {world_size} CUDA devices; found {_cuda_count()}")
        return _run_on_ranks(self._config, world_size, backend, fn, (DIST_ARG, *args), kwargs, self._node)


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
    return None, Failure.all_of(excinfo.value, None)


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
        report.user_properties = [*report.user_properties, ("entry", _entry_json(entry))]
    if entry is not None and report.passed and getattr(report, "wasxfail", None) is not None:
        report.user_properties = [*report.user_properties, ("strict", not entry.flaky)]
        if not entry.flaky:
            report.outcome = "failed"
            del report.wasxfail
            report.longrepr = _no_longer_deviates(item, entry)
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


def _no_longer_deviates(item: pytest.Item, entry: XfailEntry) -> str:
    """The failure of a test that passed although a (strict) known-deviation entry marks it: which
    entry, and the two ways out."""
    impl = _item_impl(item)
    test_id = suite_test_id(item)
    path = entry.source.rsplit(":", 1)[0]
    lines = [
        f"known deviation no longer deviates: {test_id} passed, but {entry.source} expects it to fail:",
        f"    {entry.line}  # {entry.reason}",
    ]
    own = adapter_xfail_files(impl)[0] if impl is not None and adapter_xfail_files(impl) else None
    inherited = impl is not None and entry.impl is not None and entry.impl != impl.name
    if not inherited:
        lines.append(f"If this is a fix, remove that entry from {path} (or narrow its pattern to the tests that still fail).")
        if entry.impl is not None:
            lines.append(f"(A file you do not maintain, e.g. a shipped one: cancel the entry with the line `!{test_id}` in a file given with --xfails.)")
    else:
        assert impl is not None
        where = (
            f"its own expected-failures file, {own.path}" if own is not None and own.name == impl.name
            else f"an expected-failures file of its own (set xfails_file on {type(impl).__module__}.{type(impl).__qualname__})"
        )
        lines.append(
            f"The entry is inherited from the {entry.impl!r} adapter: if {impl.name!r} fixed it, cancel it in {where} with the line"
        )
        lines.append(f"    !{test_id}  # fixed in {impl.name}")
    lines.append(
        "If it is not a fix (another change made the deviation pass by accident), this pass is the regression to look at. "
        "If the deviation depends on timing and comes and goes between runs, flag the entry `flaky`."
    )
    return "\n".join(lines)


def _entry_json(entry: XfailEntry) -> dict[str, Any]:
    """What ``--report-json`` records of the entry that marked a test."""
    return {"source": entry.source, "pattern": entry.pattern, "impl": entry.impl, "reason": entry.reason}


# -- the JSON result -------------------------------------------------------------------------------


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
        return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
    return str(longrepr) if longrepr else ""


def _failure_line(report: pytest.TestReport) -> str:
    text = (report.longreprtext or "").strip()
    if text.startswith(("known deviation failed differently", "known deviation no longer deviates")):
        return text.splitlines()[0][:600]
    error_lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    first = error_lines[0] if error_lines else (text.splitlines()[0] if text else "")
    return first[:300]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    props = dict(report.user_properties)
    entry = _SESSION_RESULTS.setdefault(
        str(props.get("test_id", report.nodeid)), {"outcome": None, "reason": "", "reqs": props.get("reqs", []), "impl": props.get("impl")}
    )
    if "failures" in props:
        entry["failures"] = props["failures"]
    if "entry" in props:
        entry["entry"] = props["entry"]
    xfail_reason = getattr(report, "wasxfail", None)
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if "strict" in props:  # a known deviation that passed: a failure of the run unless its entry is flaky
            entry["outcome"], entry["strict"] = "xpassed", props["strict"]
            entry["reason"] = _failure_line(report) if report.failed else str(xfail_reason or "")
        elif xfail_reason is not None:
            entry["outcome"] = "xfailed" if report.skipped else "xpassed"
            entry["reason"] = xfail_reason
        elif report.skipped:
            entry["outcome"], entry["reason"] = "skipped", _skip_reason(report)
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["reason"] = _failure_line(report)
        else:
            entry["outcome"] = "passed"
    elif report.when == "teardown" and report.failed:
        entry["outcome"], entry["reason"] = "error", "teardown: " + _failure_line(report)


#: nodeid -> outcome, reason, reqs, impl; written by --report-json at the end of the session.
_SESSION_RESULTS: dict[str, dict[str, Any]] = {}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if _MANAGER in config.stash:
        config.stash[_MANAGER].stop_all()
    path = config.getoption("--report-json")
    if path:
        import torch

        payload = {
            "torch": torch.__version__,
            "world_sizes": selected_world_sizes(config),
            "backend": config.getoption("--backend"),
            "impls": [load_adapter(s).name for s in _impl_specs(config)],
            "spec": load_spec(),
            "known_deviations": [
                {
                    "source": e.source,
                    "pattern": ("!" if e.removes else "") + e.pattern,
                    "impl": e.impl,
                    "reason": e.reason,
                    "pin": e.pin.describe(),
                    "flags": [flag for flag, on in (("hangs", e.hangs), ("flaky", e.flaky)) if on],
                    "exclude": e.exclude,
                    "when": e.when.describe(),
                    "active": e.when.holds_for_torch(torch.__version__),
                }
                for e in config.stash.get(_ENTRIES, [])
            ],
            "tests": _SESSION_RESULTS,
        }
        Path(path).write_text(json.dumps(payload, indent=1), encoding="utf-8")
