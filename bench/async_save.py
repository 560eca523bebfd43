"""The stall and the step rate of every way of saving, in one table (SPEC's AS section: what async
saving exists for).

    python -m bench.async_save [--sizes 64MB,512MB,2GB] [--world-sizes 1,2] [--savers reference/thread,...]
                               [--rounds 3] [--layout sharded] [--format plain|github|markdown]

For each size and world size, every saver (:data:`bench.workloads.async_save.SAVERS`: the reference's
and torch's async executors, torch's DefaultStager, the synchronous saves, and the adapters of
``BENCH_IMPL``) saves the model + Adam state while a training loop runs; raw's write of the same bytes
is measured in the same rank group, and ``raw/thread``, the limit of an async save here (a copy of
the tensors, then plain writes and an fsync on one background thread while the same training loop
runs). Columns: the stall (ms; over the same implementation's synchronous save; over raw/thread's
copy), the write (ms, call to completion; raw/thread's over it: 1 is the limit while training runs;
raw's synchronous write over it), and the step ratio (steps per second during the write over steps per
second without a save).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from tabulate import tabulate

from bench import config
from bench.ranks import RankGroup
from bench.workloads import async_save as aw
from bench.workloads import checkpoint as ck


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64MB,512MB,2GB")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--savers", default=",".join(aw.SAVERS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layout", default="sharded", choices=ck.LAYOUTS)
    parser.add_argument("--format", default="github")
    args = parser.parse_args(argv)
    savers = [s for s in args.savers.split(",") if s]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        directory = os.path.join(tmp, "ckpt")
        for world_size in [int(w) for w in args.world_sizes.split(",")]:
            with RankGroup(world_size, backend=config.backend(config.DEVICE)) as group:
                for nbytes in [config.parse_size(s) for s in args.sizes.split(",")]:
                    group.run(ck.prepare, nbytes, args.layout, config.DEVICE)
                    raw = min(max(group.run(ck.save_once, "raw", directory)) for _ in range(args.rounds))
                    figures: dict[str, aw.AsyncFigures] = {}
                    for saver in savers:
                        reason = aw.available(saver)
                        if reason is not None:
                            print(f"{saver}: skipped: {reason}", file=sys.stderr)
                            continue
                        figures[saver] = aw.measure(group, saver, nbytes, args.layout, directory, repeats=args.rounds)
                    limit = figures.get(aw.RAW_ASYNC)
                    for saver, fig in figures.items():
                        impl = saver.rpartition("/")[0]
                        sync = figures.get(f"{impl}/sync") or figures.get("torch/sync" if saver == aw.TORCH_STAGER else "")
                        rows.append([
                            config.size_label(nbytes), world_size, saver, f"{fig.stall_s * 1e3:.1f}",
                            f"{fig.stall_s / sync.stall_s:.3f}" if sync else "-",
                            f"{fig.stall_s / limit.stall_s:.2f}" if limit else "-", f"{fig.write_s * 1e3:.1f}",
                            f"{limit.write_s / fig.write_s:.2f}" if limit else "-", f"{raw / fig.write_s:.2f}",
                            f"{fig.step_ratio:.2f}" if not saver.endswith("/sync") else "-",
                        ])
                    group.run(aw.release)
    print(tabulate(rows, headers=["size", "ws", "saver", "stall ms", "stall/sync", "stall/copy", "write ms",
                                     "raw-bg/write", "raw/write", "steps during/without"],
                   tablefmt=args.format))
    return 0


if __name__ == "__main__":
    sys.exit(main())
