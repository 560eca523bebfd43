"""Where the time of a load goes, phase by phase, for the reference and for torch's DCP, beside the raw
limit of the same bytes.

    python -m bench.checkpoint_phases                                  # 64 MB and 512 MB, world sizes 1 and 2
    python -m bench.checkpoint_phases --sizes 64MB --world-sizes 2 --layouts sharded --rounds 21

The workload is :mod:`bench.workloads.checkpoint`'s (model + Adam state, files in the page cache). In
each round every rank loads once with ``raw``, once with the reference and once with torch (the order
rotates from round to round), each timed as ``bench.checkpoint_io`` times them (barrier to barrier);
the reference and torch read the same files, the checkpoint the reference saved. Each load is the
implementation's public ``load`` given its own reader and planner, whose calls time themselves (the
reference's ``FileSystemReader``/``ReferenceLoadPlanner``, torch's ``FileSystemReader``/
``DefaultLoadPlanner``); the reference's agreements are timed around
:class:`reference.checkpoint.collective.Collective`'s steps. The phases, in the order of a load:

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
``other``
    what is left of the whole load: the calls around the phases, and torch's collectives.

Figures: for each phase the median over the rounds of the slowest rank's time, in ms; the whole
loads are ``bench.ranks.timed``'s (slowest rank, barrier to barrier). The phases of one row need not
add up to its load: each is the median of its own slowest rank.
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

__all__ = ["PHASES", "profile_round", "main"]

#: The phases of a load, in order; "agree" sums the reference's three agreements.
PHASES: tuple[str, ...] = ("metadata", "set up", "local plan", "headers", "read", "agree", "commit", "other")


def _timing(phases: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed_call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] += time.perf_counter() - start

    return timed_call


def _instrumented(impl: str, directory: str, phases: dict[str, float]) -> tuple[Any, Any]:
    """``impl``'s reader and planner (the reference's, or torch's ``FileSystemReader`` and
    ``DefaultLoadPlanner``) whose calls add their seconds to ``phases``. Instance attributes shadow the
    methods, so the types stay the implementation's own and its ``load`` takes its usual path."""
    if impl == "reference":
        from reference.checkpoint.planner import ReferenceLoadPlanner
        from reference.checkpoint.storage import FileSystemReader

        reader: Any = FileSystemReader()
        planner: Any = ReferenceLoadPlanner()
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        reader, planner = dcp.FileSystemReader(directory), DefaultLoadPlanner()
    for obj, method, name in ((reader, "read_metadata", "metadata"), (planner, "set_up_planner", "set up"),
                              (planner, "create_local_plan", "local plan"), (reader, "prepare_local_plan", "headers"),
                              (reader, "read_data", "read"), (planner, "commit", "commit")):
        if hasattr(obj, method):
            setattr(obj, method, _timing(phases, name, getattr(obj, method)))
    return reader, planner


@contextlib.contextmanager
def _agreements_timed(phases: dict[str, float]) -> Iterator[None]:
    """Time each ``Collective.all_succeed`` minus the step it runs: the agreement and the wait for the
    other ranks. (A profiling patch of the class, undone on exit; the reference has no hook for it.)"""
    from reference.checkpoint.collective import Collective

    original = Collective.all_succeed

    def all_succeed(self: Collective, step: str, local_fn: Callable[[], Any]) -> Any:
        inner = [0.0]

        def local() -> Any:
            start = time.perf_counter()
            try:
                return local_fn()
            finally:
                inner[0] = time.perf_counter() - start

        start = time.perf_counter()
        try:
            return original(self, step, local)
        finally:
            phases["agree"] += time.perf_counter() - start - inner[0]

    Collective.all_succeed = all_succeed  # type: ignore[method-assign]
    try:
        yield
    finally:
        Collective.all_succeed = original  # type: ignore[method-assign]


def _instrumented_load(impl: str, dest: dict[str, Any], directory: str, phases: dict[str, float]) -> None:
    import torch.distributed.checkpoint as dcp

    from reference.checkpoint import load

    reader, planner = _instrumented(impl, directory, phases)
    if impl == "reference":
        with _agreements_timed(phases):
            load(dest, checkpoint_id=directory, storage_reader=reader, planner=planner)
    else:
        dcp.load(dest, checkpoint_id=directory, storage_reader=reader, planner=planner)


def profile_round(directory: str, raw_directory: str, order: Sequence[str]) -> dict[str, dict[str, float]]:
    """On every rank: one load of the prepared state dict (``ck.prepare``) by each implementation of
    ``order`` (``raw``, ``reference``, ``torch``), in that order; the reference's and torch's read the
    checkpoint the reference saved in ``directory``, raw its own in ``raw_directory``, all saved by
    ``ck.save_once``. Returns this rank's seconds: ``{impl: {"load": s, phase: s, ..., "other": s}}``."""
    dest = ck._CACHE["dest"]
    figures: dict[str, dict[str, float]] = {}
    for impl in order:
        if impl == "raw":
            figures[impl] = {"load": ck.load_once("raw", raw_directory)}
            continue
        phases: dict[str, float] = defaultdict(float)
        ck._zero(dest)
        total = timed(functools.partial(_instrumented_load, impl, dest, directory, phases))
        ck._check_loaded(dest, ck.state_bytes(ck._CACHE["source"]), impl)
        figures[impl] = {"load": total, **phases, "other": total - sum(phases.values())}
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint_phases", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64MB,512MB")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--layouts", default=",".join(ck.LAYOUTS))
    parser.add_argument("--impls", default="reference,torch", help="reference and/or torch (default: both)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    from bench import checkpoint_phases  # the ranks find profile_round by its module's name, not __main__

    impls = args.impls.split(",")
    for impl in impls:
        if impl not in ("reference", "torch"):
            parser.error(f"--impls: {impl!r} is not reference or torch")
    columns = ["raw load", "load", *PHASES]
    print(f"ms, median over {args.rounds} rounds of the slowest rank; '-': a phase the implementation does not have",
          flush=True)
    print("| workload | impl | " + " | ".join(columns) + " |\n|" + "---|" * (len(columns) + 2), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-phases-") as root:
        directory, raw_directory = os.path.join(root, "reference"), os.path.join(root, "raw")
        for world_size in (int(w) for w in args.world_sizes.split(",")):
            with RankGroup(world_size, backend=config.backend(config.DEVICE)) as group:
                for nbytes in (config.parse_size(s) for s in args.sizes.split(",")):
                    for layout in args.layouts.split(","):
                        group.run(ck.prepare, nbytes, layout, config.DEVICE)
                        group.run(ck.save_once, "reference", directory)
                        group.run(ck.save_once, "raw", raw_directory)
                        # The order rotates, so that no implementation always runs first after a save.
                        everyone = ["raw", *impls]
                        rounds = [group.run(checkpoint_phases.profile_round, directory, raw_directory,
                                            rotated(everyone, r))
                                  for r in range(args.rounds)]
                        label = f"load {config.size_label(nbytes)} ws{world_size} {layout}"
                        raw = _median_of_slowest(rounds, "raw", "load")
                        for impl in impls:
                            figures = [_median_of_slowest(rounds, impl, c) for c in columns[1:]]
                            cells = [f"{raw:.2f}", *("-" if f is None else f"{f:.2f}" for f in figures)]
                            print(f"| {label} | {impl} | " + " | ".join(cells) + " |", flush=True)
                group.run(ck.release)
    return 0


def _median_of_slowest(rounds: list[list[dict[str, dict[str, float]]]], impl: str, column: str) -> float | None:
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
