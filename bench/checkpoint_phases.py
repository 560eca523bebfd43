"""Where the time of a checkpoint load or save goes, phase by phase, for the reference and for torch's
DCP, beside the raw limits of the same bytes.

    python -m bench.checkpoint_phases                     # loads, then saves; 64 MB and 512 MB; world sizes 1 and 2
    python -m bench.checkpoint_phases --ops save --sizes 64MB --world-sizes 2 --layouts full --rounds 21

The workload is :mod:`bench.workloads.checkpoint`'s (model + Adam state, files in the page cache). In
each round every rank loads (or saves) once with ``raw``, once with ``raw-agreed`` (raw's I/O with the
one-integer collectives of DCP's protocol, see :mod:`bench.checkpoint_io`), once with the reference and
once with torch (the order rotates from round to round), each timed as ``bench.checkpoint_io`` times them (barrier to
barrier), after one round that warms up and is not counted. Loads by the reference and by torch read
the same files, the checkpoint the reference saved; each save writes a directory of its own, and the
last save of each implementation is loaded back and checked after the rounds. Each operation is the
implementation's public ``load``/``save`` given its own reader or writer and planner, whose calls time
themselves (the reference's ``FileSystemReader``/``FileSystemWriter`` and planners, torch's
``FileSystemReader``/``FileSystemWriter`` and ``DefaultLoadPlanner``/``DefaultSavePlanner``); the
reference's agreements are timed around :class:`reference.checkpoint.collective.Collective`'s steps.

The phases of a load, in order:

``metadata``
    ``read_metadata``: unpickling DCP's ``.metadata`` (torch's ``Metadata`` classes).
``set up``, ``local plan``
    the planner: the state dict flattened and checked against the metadata (ML-10), the read items.
``headers``
    the reader's ``prepare_local_plan``: for the reference, every file present and long enough and
    every tensor record's zip header parsed, before anything is read (ML-14); torch's does nothing
    (it parses each record inside ``read``, with ``torch.load``).
``read``
    ``read_data``: the bytes into the targets.
``agree``
    the reference's three agreements (ML-23/ML-24: after planning, reading and committing), each
    including the wait for the slowest rank; almost 0 at world size 1. Torch's collectives (plans
    gathered and scattered, reads all-gathered) are in its ``other``.
``commit``
    the reference planner's commit (torch has none).

The phases of a save, in order:

``set up``
    the planner's and the writer's ``set_up_*``: the state dict flattened and checked.
``local plan``
    the planner's ``create_local_plan`` and the writer's ``prepare_local_plan`` (the directory made).
``global plan``
    on the coordinator, the planner's and writer's global step: duplicates removed, the metadata
    built, data files named (and, for the reference, the directory's save lock taken).
``write``
    ``write_data``: every record written and its data file fsynced.
``finish``
    on the coordinator, the writer's ``finish``: the metadata written, fsynced and published, the
    directory fsynced, the files of earlier saves removed.
``agree``
    the reference's two agreements (plans gathered, decided and scattered; write results gathered, the
    metadata broadcast), without the global plan and the finish they run, each including the wait for
    the slowest rank. Torch's are in its ``other``.

Both operations also have:

``exchange``
    the part of ``agree`` that is the exchange itself: from the moment the last rank's step ended to
    the agreement's end on this rank (minus the coordinator's global step), summed over the agreements;
    ``agree`` minus ``exchange`` is waiting for slower ranks. Computed from every rank's
    ``time.perf_counter()`` stamps, one clock for the processes of one machine, as these ranks are.
``other``
    what is left of the whole operation (``exchange`` is part of ``agree``, not counted twice): the
    calls around the phases, and torch's collectives.

Figures: for each phase the median over the rounds of the slowest rank's time, in ms; the whole
operations are ``bench.ranks.timed``'s (slowest rank, barrier to barrier). The phases of one row need
not add up to its operation: each is the median of its own slowest rank.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from bench import config
from bench.checkpoint_io import rotated
from bench.ranks import RankGroup, timed
from bench.workloads import checkpoint as ck

__all__ = ["OPS", "PHASES", "EXCHANGE", "columns", "profile_round", "main"]

OPS: tuple[str, ...] = ("load", "save")
#: The phases of each operation, in order; "agree" sums the reference's agreements.
PHASES: dict[str, tuple[str, ...]] = {
    "load": ("metadata", "set up", "local plan", "headers", "read", "agree", "commit", "other"),
    "save": ("set up", "local plan", "global plan", "write", "finish", "agree", "other"),
}
#: Part of "agree" (its exchange once the last rank arrived), shown after it.
EXCHANGE = "exchange"

#: (role, method, phase): the calls of DCP's planner and storage protocols that time themselves.
_TIMED_CALLS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "load": (("storage", "read_metadata", "metadata"), ("planner", "set_up_planner", "set up"),
             ("planner", "create_local_plan", "local plan"), ("storage", "prepare_local_plan", "headers"),
             ("storage", "read_data", "read"), ("planner", "commit", "commit")),
    "save": (("planner", "set_up_planner", "set up"), ("storage", "set_up_storage_writer", "set up"),
             ("planner", "create_local_plan", "local plan"), ("storage", "prepare_local_plan", "local plan"),
             ("planner", "create_global_plan", "global plan"), ("storage", "prepare_global_plan", "global plan"),
             ("storage", "write_data", "write"), ("storage", "finish", "finish")),
}
#: Collective's steps, each (self, step, local_fn[, decide_fn]).
_AGREEMENTS = ("all_succeed", "gather_decide_scatter", "gather_decide_broadcast")


def columns(op: str) -> list[str]:
    """The figures of one row of ``op``'s table, after the workload and the implementation."""
    phases = [*PHASES[op]]
    phases.insert(phases.index("agree") + 1, EXCHANGE)
    return [*(f"{limit} {op}" for limit in ck.IO_LIMITS), op, *phases]


def _timing(phases: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    # wraps: DCP inspects the signature of some planner methods (set_up_planner's storage_meta)
    @functools.wraps(fn)
    def timed_call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] += time.perf_counter() - start

    return timed_call


def _instrumented(op: str, impl: str, directory: str, phases: dict[str, float]) -> tuple[Any, Any]:
    """``impl``'s storage reader (load) or writer (save) and planner, whose calls add their seconds to
    ``phases``. Instance attributes shadow the methods, so the types stay the implementation's own and
    its ``load``/``save`` takes its usual path."""
    if impl == "reference":
        from reference.checkpoint.planner import ReferenceLoadPlanner, ReferenceSavePlanner
        from reference.checkpoint.storage import FileSystemReader, FileSystemWriter

        storage: Any = FileSystemReader() if op == "load" else FileSystemWriter()
        planner: Any = ReferenceLoadPlanner() if op == "load" else ReferenceSavePlanner()
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

        if op == "load":
            storage, planner = dcp.FileSystemReader(directory), DefaultLoadPlanner()
        else:
            storage, planner = dcp.FileSystemWriter(directory), DefaultSavePlanner()
    objects = {"storage": storage, "planner": planner}
    for role, method, name in _TIMED_CALLS[op]:
        obj = objects[role]
        if hasattr(obj, method):
            setattr(obj, method, _timing(phases, name, getattr(obj, method)))
    return storage, planner


@contextlib.contextmanager
def _agreements_timed(phases: dict[str, float], stamps: list[tuple[float, float, float]]) -> Iterator[None]:
    """Time each of ``Collective``'s steps minus the local step and the coordinator's decision it runs
    (the agreement and the wait for the other ranks) into ``phases["agree"]``, and append to ``stamps``
    (when this rank's local step ended, when the agreement ended, seconds of the decision here) for
    :func:`_add_exchange`. (A profiling patch of the class, undone on exit; the reference has no hook
    for it.)"""
    from reference.checkpoint.collective import Collective

    originals = {name: getattr(Collective, name) for name in _AGREEMENTS}

    def timing(original: Callable[..., Any]) -> Callable[..., Any]:
        def agreement(self: Collective, step: str, local_fn: Callable[[], Any], *decide_fn: Callable[[Any], Any]) -> Any:
            inner = {"local": 0.0, "ended": 0.0, "decide": 0.0}

            def local() -> Any:
                start = time.perf_counter()
                try:
                    return local_fn()
                finally:
                    inner["ended"] = time.perf_counter()
                    inner["local"] = inner["ended"] - start

            def decide(results: Any) -> Any:
                start = time.perf_counter()
                try:
                    return decide_fn[0](results)
                finally:
                    inner["decide"] = time.perf_counter() - start

            start = time.perf_counter()
            try:
                return original(self, step, local, *((decide,) if decide_fn else ()))
            finally:
                end = time.perf_counter()
                phases["agree"] += end - start - inner["local"] - inner["decide"]
                stamps.append((inner["ended"], end, inner["decide"]))

        return agreement

    for name, original in originals.items():
        setattr(Collective, name, timing(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(Collective, name, original)


def _instrumented_op(op: str, impl: str, state_dict: dict[str, Any], directory: str, phases: dict[str, float],
                     stamps: list[tuple[float, float, float]]) -> None:
    import torch.distributed.checkpoint as dcp

    from reference import checkpoint as reference

    storage, planner = _instrumented(op, impl, directory, phases)
    if impl == "reference":
        with _agreements_timed(phases, stamps):
            if op == "load":
                reference.load(state_dict, checkpoint_id=directory, storage_reader=storage, planner=planner)
            else:
                reference.save(state_dict, checkpoint_id=directory, storage_writer=storage, planner=planner)
    elif op == "load":
        dcp.load(state_dict, checkpoint_id=directory, storage_reader=storage, planner=planner)
    else:
        dcp.save(state_dict, checkpoint_id=directory, storage_writer=storage, planner=planner)


def directories(root: str) -> dict[str, str]:
    """Where each implementation's checkpoint lives under ``root``."""
    return {impl: os.path.join(root, impl) for impl in ("raw", "reference", "torch")}


def profile_round(op: str, root: str, order: Sequence[str]) -> dict[str, dict[str, Any]]:
    """On every rank: one ``op`` (``load`` or ``save``) of the prepared state dict (``ck.prepare``) by
    each implementation of ``order`` (``raw``, ``raw-agreed``, ``reference``, ``torch``), in that order, in the
    directories of :func:`directories`. A load by the reference or by torch reads the reference's
    checkpoint, raw its own, both saved by ``ck.save_once`` before; a save empties its implementation's
    directory first. Returns this rank's ``{impl: {op: s, phase: s, ..., "other": s, "agreements":
    stamps}}`` (seconds; the stamps of :func:`_agreements_timed`, empty for torch)."""
    where = directories(root)
    source, dest = ck._CACHE["source"], ck._CACHE["dest"]
    figures: dict[str, dict[str, Any]] = {}
    for impl in order:
        if impl in ck.IO_LIMITS:  # raw's own files, which both limits write and read alike
            seconds = ck.load_once(impl, where["raw"]) if op == "load" else ck.save_once(impl, where["raw"])
            figures[impl] = {op: seconds}
            continue
        phases: dict[str, float] = defaultdict(float)
        stamps: list[tuple[float, float, float]] = []
        if op == "load":
            ck._zero(dest)
            total = timed(functools.partial(_instrumented_op, op, impl, dest, where["reference"], phases, stamps))
            ck._check_loaded(dest, ck.state_bytes(source), impl)
        else:
            ck.fresh_dir(where[impl])
            total = timed(functools.partial(_instrumented_op, op, impl, source, where[impl], phases, stamps))
        figures[impl] = {op: total, **phases, "other": total - sum(phases.values()), "agreements": stamps}
    return figures


def _add_exchange(ranks: list[dict[str, dict[str, Any]]], impl: str) -> None:
    """Replace the agreement stamps of ``impl`` in every rank's figures of one round by ``exchange``:
    for each agreement, the time from the last rank's step ending to the agreement ending on this rank,
    less the coordinator's decision in between (only the coordinator decides)."""
    stamps = [rank[impl].pop("agreements") for rank in ranks]
    if not any(stamps):
        return  # torch: none timed
    for mine, rank in zip(stamps, ranks):
        seconds = 0.0
        for k, (_, agreed, _) in enumerate(mine):
            last_step_ended = max(theirs[k][0] for theirs in stamps)
            decision = max(theirs[k][2] for theirs in stamps)
            seconds += max(0.0, agreed - last_step_ended - decision)
        rank[impl][EXCHANGE] = seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint_phases", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(OPS), help="load and/or save (default: both, loads first)")
    parser.add_argument("--sizes", default="64MB,512MB")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--layouts", default=",".join(ck.LAYOUTS))
    parser.add_argument("--impls", default="reference,torch", help="reference and/or torch (default: both)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    from bench import checkpoint_phases  # the ranks find profile_round by its module's name, not __main__

    impls, ops = args.impls.split(","), args.ops.split(",")
    for impl in impls:
        if impl not in ("reference", "torch"):
            parser.error(f"--impls: {impl!r} is not reference or torch")
    for op in ops:
        if op not in OPS:
            parser.error(f"--ops: {op!r} is not load or save")
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-phases-") as root:
        where = directories(root)
        for op in ops:
            names = columns(op)
            print(f"\n{op}: ms, median over {args.rounds} rounds of the slowest rank; "
                  "'-': a phase the implementation does not have", flush=True)
            print("| workload | impl | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 2), flush=True)
            for world_size in (int(w) for w in args.world_sizes.split(",")):
                with RankGroup(world_size, backend=config.backend(config.DEVICE)) as group:
                    for nbytes in (config.parse_size(s) for s in args.sizes.split(",")):
                        for layout in args.layouts.split(","):
                            group.run(ck.prepare, nbytes, layout, config.DEVICE)
                            if op == "load":
                                group.run(ck.save_once, "reference", where["reference"])
                                group.run(ck.save_once, "raw", where["raw"])
                            # The order rotates, so that no implementation always runs first after a save.
                            everyone = [*ck.IO_LIMITS, *impls]
                            # Round 0 warms up (first calls, imports, the files' first reads) and is dropped.
                            rounds = [group.run(checkpoint_phases.profile_round, op, root, rotated(everyone, r))
                                      for r in range(args.rounds + 1)][1:]
                            if op == "save":  # what each saved is what a load reads back
                                for impl in impls:
                                    group.run(ck.load_once, "reference", where[impl])
                            for ranks in rounds:
                                for impl in impls:
                                    _add_exchange(ranks, impl)
                            label = f"{op} {config.size_label(nbytes)} ws{world_size} {layout}"
                            limits = [_median_of_slowest(rounds, limit, op) for limit in ck.IO_LIMITS]
                            for impl in impls:
                                figures = [_median_of_slowest(rounds, impl, c) for c in names[len(ck.IO_LIMITS):]]
                                cells = ["-" if f is None else f"{f:.2f}" for f in [*limits, *figures]]
                                print(f"| {label} | {impl} | " + " | ".join(cells) + " |", flush=True)
                    group.run(ck.release)
    return 0


def _median_of_slowest(rounds: list[list[dict[str, dict[str, Any]]]], impl: str, column: str) -> float | None:
    """Milliseconds: the median over ``rounds`` of the slowest rank's ``column`` for ``impl``; None if
    ``impl`` has no such phase."""
    per_round = []
    for ranks in rounds:
        values = [rank[impl][column] for rank in ranks if column in rank[impl]]
        if not values:
            return None
        per_round.append(max(values))
    return statistics.median(per_round) * 1e3


if __name__ == "__main__":
    sys.exit(main())
