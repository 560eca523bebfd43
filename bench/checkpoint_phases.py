"""Where the time of a reference load goes, phase by phase, beside the raw limit of the same bytes.

    python -m bench.checkpoint_phases                                  # 64 MB and 512 MB, world sizes 1 and 2
    python -m bench.checkpoint_phases --sizes 64MB --world-sizes 2 --layouts sharded --rounds 21

The workload is :mod:`bench.workloads.checkpoint`'s (model + Adam state, files in the page cache).
Each round loads once with ``raw`` and once with the reference, in alternating order, each timed as
``bench.checkpoint_io`` times them (barrier to barrier). The reference's load is the public
:func:`reference.checkpoint.load` given a reader and a planner that time their own calls, and its
agreements are timed around :class:`reference.checkpoint.collective.Collective`'s steps, so the
phases are those of SPEC's load, in order:

``metadata``
    ``read_metadata``: unpickling DCP's ``.metadata`` (torch's ``Metadata`` classes). Beside it,
    ``torch metadata``: the same file read by torch's own ``FileSystemReader.read_metadata``, the
    floor of any reader of this format.
``set up``, ``local plan``
    the planner: the state dict flattened and checked against the metadata (ML-10), the read items.
``headers``
    the reader's ``prepare_local_plan``: every file present and long enough, every tensor record's
    zip header parsed, before anything is read (ML-14).
``read``
    ``read_data``: the bytes into the targets.
``agree``
    the three agreements of ML-23/ML-24 (after planning, reading and committing), each including
    the wait for the slowest rank; 0 at world size 1.
``commit``, ``other``
    the planner's commit, and what is left of the reference's whole load (the calls around the phases).

Figures: for each phase the median over the rounds of the slowest rank's time, in ms; the whole
loads are ``bench.ranks.timed``'s (slowest rank, barrier to barrier).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from bench import config
from bench.ranks import RankGroup, timed
from bench.workloads import checkpoint as ck

__all__ = ["PHASES", "profile_round", "main"]

#: The phases of a reference load, in order; "agree" sums the three agreements.
PHASES: tuple[str, ...] = ("metadata", "set up", "local plan", "headers", "read", "agree", "commit", "other")


def _timing(phases: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed_call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] += time.perf_counter() - start

    return timed_call


def _instrumented(phases: dict[str, float]) -> tuple[Any, Any]:
    """A reference reader and planner whose calls add their seconds to ``phases``. Instance attributes
    shadow the methods, so the types stay the reference's own and ``load`` takes its usual path."""
    from reference.checkpoint.planner import ReferenceLoadPlanner
    from reference.checkpoint.storage import FileSystemReader

    reader = FileSystemReader()
    planner = ReferenceLoadPlanner()
    for obj, method, name in ((reader, "read_metadata", "metadata"), (planner, "set_up_planner", "set up"),
                              (planner, "create_local_plan", "local plan"), (reader, "prepare_local_plan", "headers"),
                              (reader, "read_data", "read"), (planner, "commit", "commit")):
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


def profile_round(directory: str, raw_directory: str, raw_first: bool) -> dict[str, float]:
    """On every rank: one raw load and one instrumented reference load of the prepared state dict
    (``ck.prepare``) from checkpoints saved by ``ck.save_once``; this rank's seconds by name."""
    import torch.distributed.checkpoint as dcp

    from reference.checkpoint import load

    dest = ck._CACHE["dest"]
    phases: dict[str, float] = defaultdict(float)

    def reference_load() -> None:
        reader, planner = _instrumented(phases)
        with _agreements_timed(phases):
            load(dest, checkpoint_id=directory, storage_reader=reader, planner=planner)

    figures: dict[str, float] = {}
    for impl in (("raw", "reference") if raw_first else ("reference", "raw")):
        if impl == "raw":
            figures["raw load"] = ck.load_once("raw", raw_directory)
        else:
            ck._zero(dest)
            figures["reference load"] = timed(reference_load)
    figures.update(phases)
    figures["other"] = figures["reference load"] - sum(phases.values())
    start = time.perf_counter()
    dcp.FileSystemReader(directory).read_metadata()
    figures["torch metadata"] = time.perf_counter() - start
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint_phases", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64MB,512MB")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--layouts", default=",".join(ck.LAYOUTS))
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    from bench import checkpoint_phases  # the ranks find profile_round by its module's name, not __main__

    columns = ["raw load", "reference load", *PHASES, "torch metadata"]
    print(f"ms, median over {args.rounds} rounds of the slowest rank", flush=True)
    print("| workload | " + " | ".join(columns) + " |\n|" + "---|" * (len(columns) + 1), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-phases-") as root:
        directory, raw_directory = os.path.join(root, "reference"), os.path.join(root, "raw")
        for world_size in (int(w) for w in args.world_sizes.split(",")):
            with RankGroup(world_size, backend=config.backend(config.DEVICE)) as group:
                for nbytes in (config.parse_size(s) for s in args.sizes.split(",")):
                    for layout in args.layouts.split(","):
                        group.run(ck.prepare, nbytes, layout, config.DEVICE)
                        group.run(ck.save_once, "reference", directory)
                        group.run(ck.save_once, "raw", raw_directory)
                        rounds = [group.run(checkpoint_phases.profile_round, directory, raw_directory, r % 2 == 0)
                                  for r in range(args.rounds)]
                        cells = [statistics.median(max(rank[c] for rank in ranks) for ranks in rounds) * 1e3
                                 for c in columns]
                        label = f"load {config.size_label(nbytes)} ws{world_size} {layout}"
                        print(f"| {label} | " + " | ".join(f"{v:.2f}" for v in cells) + " |", flush=True)
                group.run(ck.release)
    return 0


if __name__ == "__main__":
    sys.exit(main())
