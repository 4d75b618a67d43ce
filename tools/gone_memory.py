"""The gone table's cost per entry (``kvfs.evict.gone.GoneNames``), against a
baseline version of it in the same run.

    .venv/bin/python tools/gone_memory.py [--most 100000] [--clock-from 20,32] \\
        [--baseline fe35313 | --baseline-file PATH]

For each bound ``most`` and each start of the policy's event clock (2**k), the table
takes ``3 * most`` puts of random 62-bit names (each ghost as ``take_ghost`` packs
it: an eviction record, the last use = the clock, a successor, and a note of 0, as
``KvfsPolicy.remove`` leaves it; the clock advancing 50 events a put), so it is full
and has turned over twice. Through the last two turnovers it samples the memory
traced (tracemalloc) per entry kept, 20 times a turnover, and reports the median;
``kept_whole`` is how many ghosts the table held as whole Python ints at the end (a
field that did not fit 32 bits, or a note that was not 0). Then the put and
pop time per call, the tables built again without tracemalloc. The baseline is
another version of ``kvfs/evict/gone.py``, from a git revision of this checkout or
a file, run in the same process, interleaved. Prints JSON.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(os.environ.get("KVFS_SRC", str(Path(__file__).resolve().parent.parent)))
STEP = 50
"""Clock events between two puts (accesses per eviction)."""


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ghosts(most: int, clock_from: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    n = 3 * most
    names = [rng.getrandbits(62) for _ in range(n)]
    ghosts = [
        (1 << 21) | (clock_from + STEP * i) << 64 | (i % 100_003 + 1) << 128 for i in range(n)
    ]
    return names, ghosts


def bytes_per_entry(gone: ModuleType, most: int, clock_from: int) -> dict[str, Any]:
    names, ghosts = _ghosts(most, clock_from, seed=most)
    every = max(1, most // 20)
    gc.collect()
    tracemalloc.start()
    try:
        table = gone.GoneNames()
        samples = []
        for i, (name, ghost) in enumerate(zip(names, ghosts, strict=True)):
            table.put(name, ghost, most)
            if i >= most and i % every == 0:
                samples.append(tracemalloc.get_traced_memory()[0] / len(table))
    finally:
        tracemalloc.stop()
    whole = sum(len(s._wide) for s in table._shards if s is not None)
    return {
        "bytes_per_entry": round(statistics.median(samples), 1),
        "kept": len(table),
        "kept_whole": whole,
    }


def call_times(gone: ModuleType, most: int, clock_from: int) -> tuple[float, float]:
    """(µs a put, µs a pop) once the table is full."""
    names, ghosts = _ghosts(most, clock_from, seed=most + 1)
    table = gone.GoneNames()
    for i in range(most):
        table.put(names[i], ghosts[i], most)
    start = time.perf_counter()
    for i in range(most, len(names)):
        table.put(names[i], ghosts[i], most)
    put = (time.perf_counter() - start) / (len(names) - most)
    popped = names[-(most // 2) :]
    start = time.perf_counter()
    for name in popped:
        table.pop(name)
    pop = (time.perf_counter() - start) / max(1, len(popped))
    return round(put * 1e6, 2), round(pop * 1e6, 2)


def baseline_module(rev: str | None, path: str | None, tmp: Path) -> ModuleType | None:
    if path:
        return load(Path(path), "gone_baseline")
    if rev:
        text = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{rev}:kvfs/evict/gone.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        (tmp / "gone_baseline.py").write_text(text)
        return load(tmp / "gone_baseline.py", "gone_baseline")
    return None


def run(
    mosts: list[int], clock_bits: list[int], baseline: ModuleType | None, times: int = 3
) -> list[dict[str, Any]]:
    versions = {"this": load(REPO / "kvfs" / "evict" / "gone.py", "gone_this")}
    if baseline is not None:
        versions["baseline"] = baseline
    rows = []
    for most in mosts:
        for bits in clock_bits:
            row: dict[str, Any] = {"most": most, "clock_from": f"2**{bits}"}
            timed: dict[str, list[tuple[float, float]]] = {k: [] for k in versions}
            for _ in range(times):  # interleaved
                for key, module in versions.items():
                    timed[key].append(call_times(module, most, 1 << bits))
            for key, module in versions.items():
                row[key] = bytes_per_entry(module, most, 1 << bits)
                row[key]["put_us"] = statistics.median(t[0] for t in timed[key])
                row[key]["pop_us"] = statistics.median(t[1] for t in timed[key])
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--most", default="100000", help="bounds, comma-separated")
    ap.add_argument("--clock-from", default="20,32", help="clock starts 2**k, k comma-separated")
    ap.add_argument("--times", type=int, default=3, help="timed runs of each version")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--baseline", help="a git revision of this checkout")
    group.add_argument("--baseline-file", help="a gone.py to compare with")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = baseline_module(args.baseline, args.baseline_file, Path(tmp))
        rows = run(
            [int(m) for m in args.most.split(",")],
            [int(b) for b in args.clock_from.split(",")],
            base,
            args.times,
        )
    json.dump(
        {"step": STEP, "baseline": args.baseline or args.baseline_file, "rows": rows},
        sys.stdout,
        indent=1,
    )
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
