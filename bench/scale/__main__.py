"""``python -m bench.scale``: the scale figures, reference beside torch, as a table and JSON; ``--svg`` draws
the plot of docs/benchmarks.md. See bench.scale."""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench.scale import grid, plot
from bench.scale.layouts import LAYOUTS, RankStateDicts
from bench.scale.simulate import IMPLS, simulate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    parser.add_argument("--world-sizes", default=",".join(map(str, grid.WORLD_SIZES)))
    parser.add_argument("--tensors", type=int, default=grid.TENSORS)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--max-items", type=int, default=grid.MAX_ITEMS,
                        help="skip a case whose ranks hold more write items than this in all (memory)")
    parser.add_argument("--json", help="append each case's figures to this JSON-lines file")
    parser.add_argument("--svg", help="draw time against world size from the --json file into this SVG")
    parser.add_argument("--table", action="store_true", help="print the markdown table of the --json file and exit")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.json) as src:
            print(plot.markdown_table([json.loads(line) for line in src if line.strip()]))
        return 0
    rows = []
    for name in args.layouts.split(","):
        layout = LAYOUTS[name]
        for n in [int(w) for w in args.world_sizes.split(",") if w]:
            if n < layout.min_world_size:
                continue
            per_rank = len(RankStateDicts(layout, layout.min_world_size, args.tensors).specs) + 4
            if n * per_rank > args.max_items:
                print(f"# {name} at {n}: about {n * per_rank:,} items > --max-items {args.max_items:,}: skipped", flush=True)
                continue
            for impl in args.impls.split(","):
                start = time.time()
                fig = simulate(layout, n, args.tensors, impl)
                row = {"layout": name, "world_size": n, "tensors": args.tensors, "impl": impl, **fig,
                       "wall_s": time.time() - start}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.json:
                    with open(args.json, "a") as out:
                        out.write(json.dumps(row) + "\n")
    if args.svg and args.json:
        with open(args.json) as src:
            plot.write_svg([json.loads(line) for line in src if line.strip()], args.svg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
