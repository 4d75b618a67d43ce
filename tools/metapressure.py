"""Create storm under metadata pressure vs a roomy metadata area, on a real mount.

A writer process creates N small files (one 64 KiB unit each) in a kvfs-managed
directory of a 512 MiB sparse image; the tiny area (``--meta-size 1M``, ~1.8k files)
must evict for metadata as it goes, the roomy one (64M) never does. Variants are
interleaved, medians of the runs are printed (markdown, then one JSON line).

    python tools/metapressure.py --dir /tmp/kvfs-mp --files 4000 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvfs.testing import harness

WRITER = """
import os, sys
d, n = sys.argv[1], int(sys.argv[2])
data = os.urandom(1000)
for i in range(n):
    fd = os.open(os.path.join(d, f"blk-{i:06d}.bin"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
"""
VARIANTS = {"pressure (1M area)": "1M", "roomy (64M area)": "64M"}


def run_once(work: Path, meta: str, files: int) -> dict[str, float]:
    img = harness.make_image(work / "pool.img", 512 << 20)
    mnt = work / "mnt"
    try:
        opts = ("--format", "--unit-size", "64K", "--meta-size", meta)
        with harness.mounted(mnt, [img], *opts, log_file=work / "kvfs.log"):
            d = mnt / "vllm"
            d.mkdir()
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", WRITER, str(d), str(files)], check=True)
            took = time.perf_counter() - t0
            raw = json.loads(os.getxattr(mnt, "user.kvfs.stats"))
            return {
                "seconds": took,
                "creates_per_s": files / took,
                "metadata_evictions": raw["metadata"]["evictions"],
                "checkpoints": raw["journal"]["checkpoints"],
                "survivors": len(os.listdir(d)),
            }
    finally:
        img.unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/kvfs-metapressure")
    ap.add_argument("--files", type=int, default=4000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(args.runs):  # interleaved: the machine's load hits both alike
        for name, meta in VARIANTS.items():
            results[name].append(run_once(work, meta, args.files))
    print("| variant | creates/s | seconds | metadata evictions | checkpoints | files left |")
    print("|---|---:|---:|---:|---:|---:|")
    summary = {}
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        summary[name] = med
        print(
            f"| {name} | {med['creates_per_s']:.0f} | {med['seconds']:.1f} "
            f"| {med['metadata_evictions']:.0f} | {med['checkpoints']:.0f} "
            f"| {med['survivors']:.0f} |"
        )
    print(json.dumps({"files": args.files, "runs": args.runs, "median": summary}))


if __name__ == "__main__":
    main()
