"""A log-log plot of time against world size, as a small SVG written by hand (matplotlib is not a
dependency of this project): one line per (layout, implementation) of one figure."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["write_svg", "svg", "markdown_table"]

_W, _H, _LEFT, _RIGHT, _TOP, _BOTTOM = 760, 420, 70, 190, 30, 50
_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def svg(rows: Iterable[Mapping[str, Any]], figure: str = "global_plan_s", title: str = "") -> str:
    """The SVG text: ``figure`` (seconds) against ``world_size``, both log scales, a solid line per
    layout for the reference and a dashed one for torch, and a dotted N log N slope for reference."""
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for row in rows:
        value = row.get(figure)
        if isinstance(value, (int, float)) and value > 0 and math.isfinite(value):
            series.setdefault((row["layout"], row["impl"]), []).append((int(row["world_size"]), float(value)))
    if not series:
        raise ValueError(f"no positive values of {figure!r} to plot")
    xs = [x for points in series.values() for x, _ in points]
    ys = [y for points in series.values() for _, y in points]
    x0, x1 = math.log10(min(xs)), math.log10(max(xs)) + 1e-9
    y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    y1 = max(y1, y0 + 1)

    def px(x: float) -> float:
        return _LEFT + (math.log10(x) - x0) / (x1 - x0) * (_W - _LEFT - _RIGHT)

    def py(y: float) -> float:
        return _H - _BOTTOM - (math.log10(y) - y0) / (y1 - y0) * (_H - _TOP - _BOTTOM)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" font-family="sans-serif" font-size="11">',
           f'<rect width="{_W}" height="{_H}" fill="white"/>',
           f'<text x="{_LEFT}" y="18" font-size="13">{title or figure + " against world size (log-log)"}</text>']
    for e in range(y0, y1 + 1):
        y = py(10.0**e)
        out.append(f'<line x1="{_LEFT}" y1="{y:.1f}" x2="{_W - _RIGHT}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">1e{e} s</text>')
    for x in sorted(set(xs)):
        out.append(f'<line x1="{px(x):.1f}" y1="{_TOP}" x2="{px(x):.1f}" y2="{_H - _BOTTOM}" stroke="#eee"/>')
        out.append(f'<text x="{px(x):.1f}" y="{_H - _BOTTOM + 16}" text-anchor="middle">{x:,}</text>')
    out.append(f'<text x="{(_LEFT + _W - _RIGHT) / 2}" y="{_H - 12}" text-anchor="middle">world size N (ranks)</text>')
    layouts = sorted({layout for layout, _ in series})
    for i, layout in enumerate(layouts):
        color = _COLORS[i % len(_COLORS)]
        for impl, dash in (("reference", ""), ("torch", ' stroke-dasharray="5,3"')):
            points = sorted(series.get((layout, impl), []))
            if not points:
                continue
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.6"{dash}/>')
        ly = _TOP + 14 * i
        out.append(f'<line x1="{_W - _RIGHT + 12}" y1="{ly + 6}" x2="{_W - _RIGHT + 32}" y2="{ly + 6}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{_W - _RIGHT + 36}" y="{ly + 10}">{layout}</text>')
    ly = _TOP + 14 * len(layouts) + 8
    out.append(f'<text x="{_W - _RIGHT + 12}" y="{ly + 10}">solid: reference</text>')
    out.append(f'<text x="{_W - _RIGHT + 12}" y="{ly + 24}">dashed: torch</text>')
    ref = sorted(p for (layout, impl), points in series.items() if impl == "reference" for p in points)
    if ref:  # an N log N slope through the reference's smallest point, for the eye
        (xa, ya), xb = min(ref), max(xs)
        yb = ya * (xb * math.log(xb)) / (xa * math.log(xa))
        out.append(f'<line x1="{px(xa):.1f}" y1="{py(ya):.1f}" x2="{px(xb):.1f}" y2="{py(yb):.1f}" stroke="#000" stroke-dasharray="1,3"/>')
        out.append(f'<text x="{_W - _RIGHT + 12}" y="{ly + 38}">dotted: N log N</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_svg(rows: Iterable[Mapping[str, Any]], path: str, figure: str = "global_plan_s") -> None:
    """:func:`svg` of ``rows`` into the file ``path``."""
    with open(path, "w") as out:
        out.write(svg(list(rows), figure))


def markdown_table(rows: Iterable[Mapping[str, Any]]) -> str:
    """One row per (layout, world size): the reference's figure beside torch's (``ref / torch``)."""
    cases: dict[tuple[str, int], dict[str, Mapping[str, Any]]] = {}
    for row in rows:
        cases.setdefault((row["layout"], int(row["world_size"])), {})[row["impl"]] = row

    def pair(case: Mapping[str, Mapping[str, Any]], name: str, fmt: str) -> str:
        return " / ".join(format(case[i][name], fmt) if i in case and math.isfinite(case[i][name]) else "-"
                          for i in ("reference", "torch"))

    head = ("| layout | N | items | global plan s | local plan ms | gathered MB | metadata MB | load plan ms | "
            "reshard plan ms | 2nd save: global s | 2nd save: B/rank | write max/mean |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (layout, n), case in sorted(cases.items(), key=lambda c: (c[0][0], c[0][1])):
        any_row = next(iter(case.values()))
        scaled = {i: {**r, "local_plan_s": r["local_plan_s"] * 1e3, "load_plan_s": r["load_plan_s"] * 1e3,
                      "reshard_plan_s": r["reshard_plan_s"] * 1e3, "plan_bytes_total": r["plan_bytes_total"] / 1e6,
                      "metadata_bytes": r["metadata_bytes"] / 1e6} for i, r in case.items()}
        lines.append(
            f"| {layout} | {n:,} | {int(any_row['items']):,} | {pair(scaled, 'global_plan_s', '.2f')} | "
            f"{pair(scaled, 'local_plan_s', '.1f')} | {pair(scaled, 'plan_bytes_total', '.1f')} | "
            f"{pair(scaled, 'metadata_bytes', '.1f')} | {pair(scaled, 'load_plan_s', '.1f')} | "
            f"{pair(scaled, 'reshard_plan_s', '.1f')} | {pair(scaled, 'second_global_plan_s', '.3f')} | "
            f"{pair(scaled, 'second_plan_bytes_max', '.0f')} | {pair(scaled, 'write_balance', '.2f')} |"
        )
    return "\n".join(lines)
