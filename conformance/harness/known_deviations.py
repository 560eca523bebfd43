"""The expected-failures machinery of the plugin: which files apply to an adapter (its own and its
base adapters', :func:`adapter_xfail_files`), their entries for a session (:func:`load_xfail_entries`),
the entry and the exclusions that apply to a test (:func:`entry_for`, :func:`exclusions_for`), the
warning about entries that match nothing (:func:`warn_stale`), and the messages of a pinned deviation
that no longer deviates (:func:`no_longer_deviates`). The grammar of the files is
:mod:`conformance.harness.xfails`'.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conformance.adapters.base import Adapter, load_adapter
from conformance.harness.axes import impl_specs, item_backend, item_impl, suite_test_id
from conformance.harness.xfails import XfailEntry, as_run_by, matches_at_any_world_size, parse_xfails

__all__ = [
    "StaleXfailWarning", "AdapterFile", "entries_header", "adapter_xfail_files", "adapter_names", "load_xfail_entries", "applicable_entries", "entry_for",
    "exclusions_for", "check_exclusions", "warn_stale", "no_longer_deviates", "entry_json",
]


class StaleXfailWarning(UserWarning):
    """An expected-failures entry matched no collected test of its file."""


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
    """The expected-failures files of ``adapter``'s class, its own first (resolved once per class)."""
    adapter_cls = type(adapter)
    if adapter_cls not in _XFAIL_FILES:
        _XFAIL_FILES[adapter_cls] = _xfail_files_of(adapter_cls, adapter.name)
    return list(_XFAIL_FILES[adapter_cls])


def adapter_names(adapter_cls: type) -> list[str]:
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
        aliases = tuple(n for n in adapter_names(cls) if n != name)
        files.append(AdapterFile(name, path, f"{cls.__module__}.{cls.__qualname__}", aliases))
    return tuple(files)


def load_xfail_entries(config: pytest.Config) -> list[XfailEntry]:
    """The entries of every ``--xfails`` file and adapter file (inherited ones included); a missing or
    malformed file is a usage error naming it."""
    entries: list[XfailEntry] = []
    seen: set[tuple[Path, str]] = set()
    try:
        for raw in config.getoption("--xfails"):
            entries += parse_xfails(Path(raw).resolve())
        for spec in impl_specs(config):
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


def applicable_entries(entries: list[XfailEntry], impl: Adapter | None) -> list[XfailEntry]:
    """The entries that may mark a test of ``impl``, in the order they are tried: ``--xfails`` entries
    first, then the adapter's own file, then the files of its base adapters."""
    mro_names = [file.name for file in adapter_xfail_files(impl)] if impl is not None else []
    applicable = [e for e in entries if e.impl is None or e.impl in mro_names]
    return sorted(applicable, key=lambda e: 0 if e.impl is None else 1 + mro_names.index(e.impl))


def entry_for(item: pytest.Item, test_id: str, candidates: list[XfailEntry], torch_version: str) -> XfailEntry | None:
    """The first expected-failure entry of ``candidates`` (:func:`applicable_entries`) whose conditions hold
    for ``item`` and whose pattern matches its ``test_id``; a removal (``!pattern``, not of one
    exclusion) that matches first means none."""
    impl = item_impl(item)
    backend = item_backend(item)
    for entry in candidates:
        if entry.exclude is not None or not entry.matches_test(test_id, impl.name if impl is not None else None):
            continue
        if entry.when.holds(torch_version, backend):
            return None if entry.removes else entry
    return None


def exclusions_for(item: pytest.Item, test_id: str, candidates: list[XfailEntry], torch_version: str) -> tuple[XfailEntry, ...]:
    """Every exclusion (``exclude=NAME``) of ``candidates`` whose conditions hold for ``item`` and whose
    pattern matches ``test_id``, one per name (the first in order), unless a removal earlier in order
    matches the test: ``!pattern`` cancels them all, ``!pattern exclude=NAME`` that one."""
    impl = item_impl(item)
    run_name = impl.name if impl is not None else None
    backend = item_backend(item)
    cancelled: set[str | None] = set()
    found: dict[str, XfailEntry] = {}
    for entry in candidates:
        if (entry.exclude is None and not entry.removes) or not entry.matches_test(test_id, run_name):
            continue
        if not entry.when.holds(torch_version, backend):
            continue
        if entry.removes:
            cancelled.add(entry.exclude)
        elif None not in cancelled and entry.exclude not in cancelled and entry.exclude is not None:
            found.setdefault(entry.exclude, entry)
    return tuple(found.values())


def check_exclusions(item: pytest.Item, test_id: str, exclusions: tuple[XfailEntry, ...]) -> list[str]:
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


def warn_stale(
    entries: list[XfailEntry], used: set[XfailEntry], items: list[pytest.Item], test_ids: dict[pytest.Item, str], torch_version: str
) -> None:
    """Warn about each active entry of a collected test file that would match no collected test at
    any world size (a removal: that would remove nothing). Entries conditioned on a backend or device
    are not judged: the run may not use it."""
    collected_files = {test_id.split("::", 1)[0] for test_id in test_ids.values()}
    run_names = {impl.name: impl for item in items if (impl := item_impl(item)) is not None}
    for entry in entries:
        if entry in used or entry.file_part not in collected_files:
            continue
        if not entry.when.holds_for_torch(torch_version) or entry.when.backend or entry.when.device:
            continue
        ids = []
        for item in items:
            impl = item_impl(item)
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
        for base in adapter_names(type(adapter))[1:]:
            for item in items:
                impl = item_impl(item)
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


def no_longer_deviates(item: pytest.Item, entry: XfailEntry) -> str:
    """The failure of a test that passed although a (strict) known-deviation entry marks it: which
    entry, and the two ways out."""
    impl = item_impl(item)
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


def entry_json(entry: XfailEntry) -> dict[str, Any]:
    """What ``--report-json`` records of the entry that marked a test."""
    return {"source": entry.source, "pattern": entry.pattern, "impl": entry.impl, "reason": entry.reason}


def entries_header(entries: list[XfailEntry]) -> list[str]:
    """The report header's lines about ``entries``: one line per expected-failures file (its entries,
    how many are active for this torch and which backends/devices they need), then every entry that is
    not active everywhere, by name."""
    import torch

    by_file: dict[str, list[XfailEntry]] = {}
    for entry in entries:
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
