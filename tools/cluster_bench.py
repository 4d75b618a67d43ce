"""cluster_bench: what a cross-node hit costs next to a local hit, on real processes.

A real ``mooncake_master`` on loopback and two kvfs mounts on image files (node A and
node B, both ``--cluster``). Node A writes N chunk files (32 MiB by default, Llama-3-8B
bf16 256-token chunks) and the tool times until all are published. Then, chunk by
chunk, node B reads each one twice with O_DIRECT (as vLLM's fs tier loads): the first
read of a name B does not have is the cross-node hit (lookup, fetch, verify, written
locally), the second is a local hit; the pairs are interleaved, so the machine's noise
falls on both. Absent names are looked up too (the cluster is asked, then its answer
is cached). Medians and p90s; the transport is TCP over loopback on one host, so the
network is memory bandwidth and both nodes share the CPUs.

    .venv/bin/python tools/cluster_bench.py [--chunks 16] [--chunk-mib 32] [--json PATH]

Exit codes: 0 success, 1 a byte differed or a read failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfs.testing import harness

MiB = 1 << 20


def payload(i: int, size: int) -> bytes:
    seed = hashlib.sha256(f"chunk{i}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def read_direct(path: Path, size: int) -> bytes:
    buf = mmap.mmap(-1, max(size, mmap.PAGESIZE))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        got = os.readv(fd, [buf])
    finally:
        os.close(fd)
    return bytes(buf[:got])


def stats(name: str, seconds: Sequence[float], size: int = 0) -> dict[str, Any]:
    s = sorted(seconds)
    row = {
        "what": name,
        "n": len(s),
        "median_ms": statistics.median(s) * 1e3,
        "p90_ms": s[int(0.9 * (len(s) - 1))] * 1e3,
    }
    if size:
        row["median_MBps"] = size / statistics.median(s) / 1e6
    return row


def cluster(mnt: Path) -> dict[str, Any]:
    c: dict[str, Any] = json.loads(os.getxattr(mnt, "user.kvfs.stats"))["cluster"]
    return c


def wait(pred: Any, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise SystemExit(f"cluster_bench: not within {timeout} s")
        time.sleep(0.02)


def run(chunks: int, chunk: int, work: Path) -> dict[str, Any]:
    with ExitStack() as stack:
        master = stack.enter_context(harness.running_master(work / "master.log"))
        knobs = (
            f"&segment={max(256, 2 * chunks * chunk // MiB)}M&buffer={max(64, 2 * chunk // MiB)}M"
        )
        nodes = []
        for name in ("a", "b"):
            (work / name).mkdir()
            image = harness.make_image(work / name / "pool.img", 4 * chunks * chunk + (1 << 30))
            mnt = work / name / "mnt"
            mnt.mkdir()
            argv = ("--format", "--cluster", master.url + knobs)
            stack.enter_context(
                harness.mounted(mnt, [image], *argv, log_file=work / name / "kvfs.log")
            )
            wait(lambda m=mnt: cluster(m)["state"] == "up", 60)
            nodes.append(mnt)
        a, b = nodes
        (a / "kv").mkdir()
        t0 = time.monotonic()
        for i in range(chunks):
            harness.write_file(a / "kv" / f"{i:04d}.bin", payload(i, chunk))
        written = time.monotonic() - t0
        wait(lambda: cluster(a)["published"] >= chunks and not cluster(a)["publish_queue"], 600)
        published = time.monotonic() - t0
        remote, local, bad = [], [], 0
        for i in range(chunks):
            path = b / "kv" / f"{i:04d}.bin"
            for times in (remote, local):
                t = time.monotonic()
                data = read_direct(path, chunk)
                times.append(time.monotonic() - t)
                bad += data != payload(i, chunk)
        absent_first, absent_again = [], []
        for i in range(chunks):
            for times in (absent_first, absent_again):
                t = time.monotonic()
                exists = os.path.exists(b / "kv" / f"absent{i}.bin")
                times.append(time.monotonic() - t)
                bad += exists
        c = cluster(b)
        rows = [
            stats("cross-node hit (B lacks it: fetched, verified, made local)", remote, chunk),
            stats("local hit (the same file again, O_DIRECT)", local, chunk),
            stats("absent name, cluster asked", absent_first),
            stats("absent name again (the negative entry, for negative= s)", absent_again),
        ]
        return {
            "chunks": chunks,
            "chunk_bytes": chunk,
            "write_seconds_A": written,
            "published_seconds_A": published,
            "publish_MBps_A": chunks * chunk / published / 1e6,
            "rows": rows,
            "remote_over_local_median": statistics.median(
                r / lo for r, lo in zip(remote, local, strict=True)
            ),
            "cluster_B": {k: c[k] for k in ("hits", "misses", "negative_hits", "bytes_fetched")},
            "wrong": bad,
        }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--chunk-mib", type=int, default=32)
    p.add_argument("--json", type=Path)
    p.add_argument("--dir", type=Path, help="work directory (default: a temporary one)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        result = run(args.chunks, args.chunk_mib * MiB, Path(tmp))
    for row in result["rows"]:
        mbps = f"{row['median_MBps']:8.0f} MB/s" if "median_MBps" in row else " " * 13
        print(
            f"{row['what']:<62} median {row['median_ms']:8.2f} ms  "
            f"p90 {row['p90_ms']:8.2f} ms {mbps}"
        )
    print(
        f"cross-node / local (paired median): {result['remote_over_local_median']:.2f}x; "
        f"node A published {result['chunks']} x {result['chunk_bytes'] // MiB} MiB in "
        f"{result['published_seconds_A']:.2f} s ({result['publish_MBps_A']:.0f} MB/s, "
        f"writes took {result['write_seconds_A']:.2f} s)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if result["wrong"]:
        print(f"cluster_bench: {result['wrong']} wrong answers", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
