"""Checkpoint save/load throughput against the raw limit, implementations interleaved round by round.

    python -m bench.checkpoint_io                                  # 64 MB and 512 MB, world sizes 1 and 2
    python -m bench.checkpoint_io --sizes 64MB --world-sizes 1 --rounds 9 --impls reference,raw
    python -m bench.checkpoint_io --over-previous                  # each save over the previous checkpoint
    BENCH_IMPL=mystack.adapter:MyAdapter python -m bench.checkpoint_io   # a fork beside the others

The same workload as ``bench/test_checkpoint.py`` and asv's ``bench_checkpoint.py``
(:mod:`bench.workloads.checkpoint`: model + Adam state, ``full`` and ``sharded`` layouts, files fsynced on
save and read back from the page cache), measured so that a ratio to raw means something on a shared
machine: in every round each implementation saves and then loads once, one after the other (the order
rotates from round to round), so the implementations of a round ran under the same load; the figure of
a round is the ranks' own time (``bench.ranks.timed``: barrier to barrier, the slowest rank). Reported:
the median MB/s over the rounds, and the median over the rounds of each round's ratio to raw (and to
torch), which cancels the load that moved between rounds.

Two limits are measured in every round: ``raw`` (plain file I/O of the same bytes, the ranks never
talking to each other) and ``raw-agreed`` (the same I/O with the collectives of DCP's protocol that
every implementation agreeing as SPEC says must run, each of one integer: four around a save, three
in a load). At world size 1 they are the same but for c10d's calls on a group of one. At world size 2
and above, ``<impl>/raw-agreed`` is how close an implementation comes to what the machine and c10d
allow once the ranks must agree, and the gap between the two limits is c10d's own cost on this
machine, which no implementation removes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench import config
from bench.ranks import RankGroup
from bench.workloads import checkpoint as ck

__all__ = ["Series", "measure_interleaved", "rotated", "ratio_of_rounds", "main"]


@dataclass
class Series:
    """Per-round seconds of one implementation on one workload."""

    save: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)


def measure_interleaved(group: RankGroup, impls: Sequence[str], nbytes: int, layout: str, root: str,
                        rounds: int, *, warmup: int = 1, over_previous: bool = False) -> tuple[int, dict[str, Series]]:
    """(global bytes, {impl: Series}): ``rounds`` rounds in which every implementation saves into its own
    directory under ``root`` and loads it back, in an order that rotates by one each round, after
    ``warmup`` rounds that are not kept: an implementation's first call in a rank process pays once for
    what later calls reuse (imports, its threads; docs/benchmark-results.md, "Why the benchmarks are
    shaped so"). With ``over_previous`` every save but the first of an implementation goes over
    its previous checkpoint (see ``bench.workloads.checkpoint.save_once``)."""
    total = group.run(ck.prepare, nbytes, layout, config.DEVICE)[0]
    series = {impl: Series() for impl in impls}
    for r in range(warmup + rounds):
        for impl in rotated(impls, r):
            directory = os.path.join(root, impl.replace(":", "-").replace("/", "-"))
            save = max(group.run(ck.save_once, impl, directory, over_previous))
            load = max(group.run(ck.load_once, impl, directory))
            if r >= warmup:
                series[impl].save.append(save)
                series[impl].load.append(load)
    return total, series


def rotated(impls: Sequence[str], round_index: int) -> list[str]:
    """``impls`` in the order of round ``round_index``: rotated by one per round, so that no
    implementation always runs first (or right after the same one)."""
    shift = round_index % len(impls)
    return [*impls[shift:], *impls[:shift]]


def ratio_of_rounds(mine: Sequence[float], base: Sequence[float]) -> float:
    """The median over the rounds of ``base / mine`` seconds: ``mine``'s speed relative to ``base``."""
    return statistics.median(b / m for m, b in zip(mine, base, strict=True))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint_io", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64MB,512MB", help="state dict sizes (default: 64MB,512MB)")
    parser.add_argument("--world-sizes", default="1,2", help="default: 1,2")
    parser.add_argument("--layouts", default=",".join(ck.LAYOUTS), help="full and/or sharded (default: both)")
    parser.add_argument("--impls", default=None,
                        help="comma-separated (default: the reference, torch, BENCH_IMPL's adapters; raw and raw-agreed always)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per workload (default: 7)")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp dir)")
    parser.add_argument("--over-previous", action="store_true",
                        help="each save over the implementation's previous checkpoint, not into an emptied directory")
    args = parser.parse_args(argv)
    impls = args.impls.split(",") if args.impls else [i for i in ck.impls() if i != "memcpy"]
    for limit in ck.IO_LIMITS:
        if limit not in impls:
            impls.append(limit)
    for impl in impls:
        reason = ck.available(impl)
        if reason:
            parser.error(reason)
    subjects = [i for i in impls if i not in (*ck.IO_LIMITS, "torch")]
    print(f"{args.rounds} rounds after a warm-up round, each implementation once per round in rotating order; median over the rounds "
          f"(ratios: median of the per-round ratios)" + ("; every save over the previous checkpoint" if args.over_previous else ""),
          flush=True)
    header = ["workload", *(f"{i} MB/s" for i in impls), *(f"{s}/{b}" for s in subjects for b in ck.IO_LIMITS),
              *(f"{s}/torch" for s in subjects if "torch" in impls)]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-io-", dir=args.dir) as root:
        for world_size in (int(w) for w in args.world_sizes.split(",")):
            with RankGroup(world_size, backend=config.backend(config.DEVICE)) as group:
                for nbytes in (config.parse_size(s) for s in args.sizes.split(",")):
                    for layout in args.layouts.split(","):
                        total, series = measure_interleaved(group, impls, nbytes, layout, root, args.rounds,
                                                            over_previous=args.over_previous)
                        for op in ("save", "load"):
                            per = {i: getattr(series[i], op) for i in impls}
                            mbps = [total / 2**20 / statistics.median(per[i]) for i in impls]
                            to_raw = [ratio_of_rounds(per[s], per[b]) for s in subjects for b in ck.IO_LIMITS]
                            to_torch = [ratio_of_rounds(per[s], per["torch"]) for s in subjects] if "torch" in impls else []
                            cells = [f"{op} {config.size_label(nbytes)} ws{world_size} {layout}",
                                     *(f"{v:,.0f}" for v in mbps), *(f"{v:.2f}" for v in to_raw + to_torch)]
                            print("| " + " | ".join(cells) + " |", flush=True)
                group.run(ck.release)
    return 0


if __name__ == "__main__":
    sys.exit(main())
