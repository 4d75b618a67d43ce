"""Score every eviction policy on the trace suite; write the table, JSON and a plot.

    .venv/bin/python tools/trace_suite.py [--mooncake DIR] [--ablation | --adaptive-ablation]
        [--traces a,b] [--capacities 0.1,0.2,0.3,0.5] [--out docs/bench]

For each trace of ``tools/traces.py`` (train and held-out splits; Mooncake's real
traces too when ``--mooncake`` names the directory holding ``conversation_trace.jsonl``
and ``synthetic_trace.jsonl``) and each capacity (a fraction of the trace's distinct
chunks), simulate each policy with ``kvtrace.simulate`` (prefix rule, one engine
writing every request) and Belady with ``kvtrace.simulate_belady``.  Prints a
Markdown table per trace; writes ``trace_suite.json`` (rows) and ``trace_suite.svg``
(hit rate vs capacity per policy, Belady dashed) under ``--out``.  ``--ablation``
scores ``KvfsPolicy`` with each of its rules switched off instead, ``--adaptive-ablation``
the adaptive policy with other margins, without its shadows' prefix rule, without
its recency shadow's partial-chunk-first rule and with a lead that must last
``hold`` turnovers.

Chunks are 1000 bytes each here (eviction decisions do not depend on the size when
every chunk has the same one). ``--sized`` gives a prompt's partial last chunk its
tokens' share of those bytes, as the smaller file an engine stores for it (only
Mooncake's traces have such chunks; ``kvtrace.simulate(..., sized=True)``); the
outputs are then named ``*_sized``. Exit codes: 0 success, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvtrace
import traces

from kvfs.evict.policy import AdaptivePolicy, EvictionPolicy, KvfsPolicy, make_policy
from kvfs.evict.policy.prefix import RULES

CHUNK = 1000
POLICIES = ("lru", "fifo", "kvfs", "prefix-lru", "adaptive")
COLOURS = {
    "lru": "#1f77b4",
    "fifo": "#7f7f7f",
    "kvfs": "#ff7f0e",
    "prefix-lru": "#2ca02c",
    "adaptive": "#d62728",
    "belady": "#000000",
}


def factories(ablation: bool, adaptive: bool = False) -> dict[str, Callable[[], EvictionPolicy]]:
    """The policies to score: the registered ones, KvfsPolicy's ablations, or the
    adaptive policy's (its margin, its shadows' prefix rule)."""
    if adaptive:
        out = {"lru": lambda: make_policy("lru"), "adaptive": lambda: make_policy("adaptive")}
        for margin in (1.0, 1.25, 2.0):
            out[f"adaptive-margin-{margin}"] = lambda m=margin: AdaptivePolicy(margin=m)
        out["adaptive-no-prefix-rule"] = lambda: AdaptivePolicy(prefix_rule=False)
        out["adaptive-no-partial-first"] = lambda: AdaptivePolicy(partial_first=False)
        for hold in (0.5, 1.0, 2.0):
            out[f"adaptive-hold-{hold}"] = lambda h=hold: AdaptivePolicy(hold=h)
        return out
    if not ablation:
        return {name: (lambda name=name: make_policy(name)) for name in POLICIES}
    out: dict[str, Callable[[], EvictionPolicy]] = {"lru": lambda: make_policy("lru")}
    out["kvfs"] = KvfsPolicy
    for rule in sorted(RULES):
        out[f"kvfs-no-{rule}"] = lambda rule=rule: KvfsPolicy(without=frozenset({rule}))
    return out


def score(
    suite: Sequence[traces.Trace],
    policies: dict[str, Callable[[], EvictionPolicy]],
    fractions: Sequence[float],
    sized: bool = False,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for trace in suite:
        chunks = kvtrace.footprint_chunks(trace.requests)
        for fraction in fractions:
            capacity = int(chunks * fraction) * CHUNK
            for name, factory in policies.items():
                started = time.perf_counter()
                result = kvtrace.simulate(trace.requests, factory(), capacity, CHUNK, sized=sized)
                rows.append(_row(trace, chunks, fraction, name, result, started))
            started = time.perf_counter()
            result = kvtrace.simulate_belady(trace.requests, capacity, CHUNK, sized=sized)
            rows.append(_row(trace, chunks, fraction, "belady", result, started))
            print(f"  {trace.name} {fraction:.0%} done", file=sys.stderr, flush=True)
    return rows


def _row(
    trace: traces.Trace,
    chunks: int,
    fraction: float,
    name: str,
    result: kvtrace.SimResult,
    started: float,
) -> dict[str, Any]:
    served = result.hit_chunks * CHUNK
    return {
        "trace": trace.name,
        "split": trace.split,
        "source": trace.source,
        "requests": len(trace.requests),
        "footprint_chunks": chunks,
        "capacity_fraction": fraction,
        "policy": name,
        "hit_rate": round(result.hit_rate, 4),
        "bytes_written": result.bytes_written,
        "bytes_served": served,
        "written_per_served": round(result.bytes_written / served, 3) if served else None,
        "evictions": result.evictions,
        "seconds": round(time.perf_counter() - started, 2),
    }


def table(rows: Sequence[dict[str, Any]], names: Sequence[str]) -> str:
    """Markdown: one line per (trace, capacity): hit % per policy, adaptive - LRU,
    adaptive / Belady, device bytes written per byte served (adaptive, LRU)."""
    head = ["trace", "split", "cap", *names, "belady"]
    extra = "adaptive" in names
    if extra:
        head += ["adaptive-LRU", "adaptive/Belady", "written/served adaptive", "LRU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cells: dict[tuple[str, float], dict[str, dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault((row["trace"], row["capacity_fraction"]), {})[row["policy"]] = row
    for (trace, fraction), by in cells.items():
        rate = {name: 100 * by[name]["hit_rate"] for name in by}
        line = [trace, by["belady"]["split"], f"{fraction:.0%}"]
        line += [f"{rate[name]:.1f}" for name in (*names, "belady")]
        if extra:
            ratio = rate["adaptive"] / rate["belady"] if rate["belady"] else 1.0
            line += [f"{rate['adaptive'] - rate['lru']:+.1f}", f"{ratio:.2f}"]
            line += [_ratio(by["adaptive"]), _ratio(by["lru"])]
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def _ratio(row: dict[str, Any]) -> str:
    value = row["written_per_served"]
    return "-" if value is None else f"{value:.2f}"


def svg(rows: Sequence[dict[str, Any]], names: Sequence[str]) -> str:
    """Small multiples, one panel per trace: hit % (y) vs capacity (x) per policy."""
    order = list(dict.fromkeys(row["trace"] for row in rows))
    cols, width, height, pad = 4, 230, 170, 34
    rows_n = (len(order) + cols - 1) // cols
    total_w, total_h = cols * width + 10, rows_n * height + 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{total_h}" '
        'font-family="sans-serif" font-size="10">',
        f'<rect width="{total_w}" height="{total_h}" fill="white"/>',
    ]
    for index, trace in enumerate(order):
        x0, y0 = (index % cols) * width + pad, (index // cols) * height + 20
        w, h = width - pad - 10, height - 50
        mine = [row for row in rows if row["trace"] == trace]
        fracs = sorted({row["capacity_fraction"] for row in mine})
        split = mine[0]["split"]
        out.append(f'<text x="{x0}" y="{y0 - 6}" font-weight="bold">{trace} ({split})</text>')
        out.append(f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#999"/>')
        for tick in (0, 25, 50, 75, 100):
            ty = y0 + h - h * tick / 100
            out.append(f'<text x="{x0 - 4}" y="{ty + 3}" text-anchor="end">{tick}</text>')
        span = (fracs[-1] - fracs[0]) or 1.0

        def px(fraction: float, x0: float = x0, w: float = w, first: float = fracs[0]) -> float:
            return x0 + w * (fraction - first) / span  # noqa: B023

        for fraction in fracs:
            label = f"{fraction:.0%}"
            out.append(
                f'<text x="{px(fraction)}" y="{y0 + h + 12}" text-anchor="middle">{label}</text>'
            )
        for name in (*names, "belady"):
            points = [
                (px(row["capacity_fraction"]), y0 + h - h * row["hit_rate"])
                for row in sorted(mine, key=lambda r: r["capacity_fraction"])
                if row["policy"] == name
            ]
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            dash = ' stroke-dasharray="4 3"' if name == "belady" else ""
            colour = COLOURS.get(name, "#9467bd")
            style = f'fill="none" stroke="{colour}" stroke-width="1.5"{dash}'
            out.append(f'<polyline points="{path}" {style}/>')
    legend_y = total_h - 10
    for index, name in enumerate((*names, "belady")):
        colour = COLOURS.get(name, "#9467bd")
        lx = 10 + index * 110
        ends = f'x1="{lx}" y1="{legend_y - 3}" x2="{lx + 20}" y2="{legend_y - 3}"'
        out.append(f'<line {ends} stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{lx + 24}" y="{legend_y}">{name}</text>')
    caption = "token hit rate % (prefix rule) vs capacity (fraction of distinct chunks)"
    out.append(f'<text x="{total_w - 10}" y="{legend_y}" text-anchor="end">{caption}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mooncake", type=Path, default=os.environ.get("KVFS_MOONCAKE_DIR"))
    ap.add_argument("--traces", default="", help="comma-separated names (default: all)")
    ap.add_argument("--capacities", default="0.1,0.2,0.3,0.5")
    ap.add_argument("--ablation", action="store_true")
    ap.add_argument("--adaptive-ablation", action="store_true")
    ap.add_argument("--sized", action="store_true", help="partial chunks take their share")
    ap.add_argument("--out", type=Path, default=None, help="write JSON and SVG here")
    args = ap.parse_args(argv)
    try:
        fractions = [float(text) for text in args.capacities.split(",") if text]
        if not fractions or not all(0 < f <= 1 for f in fractions):
            raise ValueError("capacities must be fractions in (0, 1]")
    except ValueError as error:
        print(f"trace_suite: {error}", file=sys.stderr)
        return 2
    wanted = [name for name in args.traces.split(",") if name] or None
    mooncake = Path(args.mooncake) if args.mooncake else None
    suite = traces.suite(mooncake, wanted)
    policies = factories(args.ablation, args.adaptive_ablation)
    rows = score(suite, policies, fractions, args.sized)
    names = list(policies)
    print(table(rows, names))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = "trace_suite"
        if args.ablation or args.adaptive_ablation:
            stem = "trace_adaptive_ablation" if args.adaptive_ablation else "trace_ablation"
        if args.sized:
            stem += "_sized"
        (args.out / f"{stem}.json").write_text(json.dumps(rows, indent=1) + "\n")
        (args.out / f"{stem}.svg").write_text(svg(rows, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
