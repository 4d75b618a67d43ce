"""Mount time vs file count: build pools of 10^4..10^6 one-unit files without FUSE,
then time ``Store.load()`` and a full ``kvfs mount`` (until mounted, which includes the
mount-time checkpoint), and the daemon's RSS. Median of N runs.

    python tools/mounttime.py --dir /var/tmp/kvfs-mt --files 10000 100000 1000000
    python tools/mounttime.py --dir ... --files 1000000 --profile   # cProfile hot spots
    python tools/mounttime.py --dir ... --files 1000000 --runs 1 --crash 1000  # + kill -9
    python tools/mounttime.py --dir ... --files 10000000 --runs 2 --each  # first mount, remount

A pool is a sparse image (one 1 MiB unit per file, 60% full: ~1.6 TiB for 10^6 files) formatted
with ``format_pool``; a checkpoint of a namespace filled programmatically (directories
of 1000 files, each file mapping a distinct unit) is written straight into the second
log half as generation 2. Data units are never written: mounting reads only metadata.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvfs.devices.pool import _write, format_pool, open_pool
from kvfs.format.halves import encode_checkpoint, half_bounds
from kvfs.format.records import Xattr
from kvfs.index.namespace import Namespace
from kvfs.store.facade import Store
from kvfs.testing import harness

UNIT = 1 << 20
PER_DIR = 1000


def build(image: Path, files: int, legacy: bool = False, xattr: bool = False) -> int:
    """Format a sparse pool and write a checkpoint holding ``files`` files; returns the
    checkpoint's size in bytes. ``legacy``: the checkpoint as releases before the
    columnar index wrote it (op records); ``xattr``: each file gets the 8-byte
    ``user.vllm.kv_crc32c`` xattr vLLM sets."""
    meta_size = max(8 << 20, -(-files * 400 // UNIT) * UNIT)
    # 60% full: below the eviction watermarks, or remounts would evict (all orphans)
    size = (2 << 20) + meta_size + (files * 5 // 3 + 64) * UNIT
    image.unlink(missing_ok=True)
    harness.make_image(image, size)
    format_pool([str(image)], meta_size=meta_size)
    pool = open_pool([str(image)])
    try:
        ns = Namespace(lambda ops: None)
        ns.init_root(0, 0)
        for _, first, count in harness.fill_namespace(ns, files, PER_DIR):
            if xattr:
                for ino in range(first, first + count):
                    value = b"%08x" % (ino * 40503 & 0xFFFFFFFF)
                    ns.apply(Xattr(ino, b"user.vllm.kv_crc32c", value))
        ops = ns.legacy_ops() if legacy else ns.snapshot()
        data, _, _ = encode_checkpoint(ops, 2, 0, pool.seed)
        meta, start, msize = pool.meta
        base, half = half_bounds(start, msize, 1)
        assert len(data) <= half, (len(data), half)
        _write(meta, base, data)
        meta.flush()
        return len(data)
    finally:
        pool.close()


def time_load(image: Path, profile: bool = False) -> tuple[float, str]:
    pool = open_pool([str(image)])
    try:
        store = Store(pool)
        prof = cProfile.Profile() if profile else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        store.load()
        if prof:
            # the mount-time checkpoint's CPU part: snapshot + encode (no device write)
            encode_checkpoint(store.ns.snapshot(), 99, 0, pool.seed)
            prof.disable()
        took = time.perf_counter() - t0
        out = ""
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
            out = s.getvalue()
        return took, out
    finally:
        pool.close()


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def time_mount(image: Path, mnt: Path) -> tuple[float, float, int, int]:
    """(seconds until mounted, seconds for the clean unmount, daemon RSS and peak
    RSS (VmHWM: recovery and the mount-time checkpoint) in KiB)."""
    mnt.mkdir(exist_ok=True)
    cmd = [*harness.kvfs_command(), "mount", "--foreground", str(mnt), str(image)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        harness.wait_mounted(proc, mnt, 900)
        mounted = time.perf_counter() - t0
        rss, peak = rss_kib(proc.pid), rss_kib(proc.pid, "VmHWM")
        t1 = time.perf_counter()
        harness.stop(proc, mnt, timeout=900)
        return mounted, time.perf_counter() - t1, rss, peak
    finally:
        if proc.poll() is None:
            harness.stop(proc, mnt)


def time_crash_mount(image: Path, mnt: Path, writes: int) -> tuple[float, int, int]:
    """Mount, make ``writes`` durable files through the mount (each fsynced: the
    journal behind the checkpoint), kill -9 the daemon, then time the next mount:
    a crash mount replays that journal and writes a fresh checkpoint before it
    answers. Returns (seconds until mounted, RSS, peak RSS in KiB)."""
    mnt.mkdir(exist_ok=True)
    cmd = [*harness.kvfs_command(), "mount", "--foreground", str(mnt), str(image)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        harness.wait_mounted(proc, mnt, 900)
        (mnt / "crash").mkdir(exist_ok=True)
        for i in range(writes):
            with open(mnt / "crash" / f"c{i:06d}", "wb") as f:
                f.write(b"x" * 4096)
                os.fsync(f.fileno())
    finally:
        harness.kill(proc, mnt)
    mounted, _, rss, peak = time_mount(image, mnt)
    return mounted, rss, peak


def memory_cells(rss: int, peak: int, files: int) -> str:
    """The table's RSS, RSS per file and peak cells (KiB in)."""
    return (
        f"{rss / 1024:.0f} MiB | {rss * 1024 / files:.0f} B "
        f"| {peak / 1024:.0f} MiB ({peak / max(rss, 1):.2f}x)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp/kvfs-mounttime")
    ap.add_argument("--files", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile one load + checkpoint")
    ap.add_argument("--keep", action="store_true", help="keep the images")
    ap.add_argument("--legacy", action="store_true", help="checkpoint in the pre-0.3 op format")
    ap.add_argument("--xattr", action="store_true", help="an 8-byte xattr on every file")
    ap.add_argument("--each", action="store_true", help="a row per mount (the first, remounts)")
    ap.add_argument(
        "--crash",
        type=int,
        default=0,
        metavar="WRITES",
        help="also time a mount after kill -9 of a mount that made WRITES durable files",
    )
    args = ap.parse_args()
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    print(
        "| files | checkpoint | build | Store.load() | mount (incl. checkpoint) "
        "| clean unmount | daemon RSS | RSS per file | peak RSS |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.files:
        image = work / f"pool-{n}.img"
        t0 = time.perf_counter()
        ckpt = build(image, n, args.legacy, args.xattr)
        built = time.perf_counter() - t0
        loads = [time_load(image)[0] for _ in range(args.runs)]
        mounts = [time_mount(image, work / "mnt") for _ in range(args.runs)]
        if args.each:
            for i, (took, unmount, rss, peak) in enumerate(mounts):
                kind = "first mount" if i == 0 else "clean remount"
                print(
                    f"| {n:,} | {kind} {i + 1} | - | - | {took:.2f} s | {unmount:.2f} s "
                    f"| {memory_cells(rss, peak, n)} |",
                    flush=True,
                )
        print(
            f"| {n:,} | {ckpt / 2**20:.1f} MiB | {built:.1f} s "
            f"| {statistics.median(loads):.2f} s "
            f"| {statistics.median(m[0] for m in mounts):.2f} s "
            f"| {statistics.median(m[1] for m in mounts):.2f} s "
            f"| {statistics.median(m[2] for m in mounts) / 1024:.0f} MiB "
            f"| {statistics.median(m[2] for m in mounts) * 1024 / n:.0f} B "
            f"| {statistics.median(m[3] for m in mounts) / 1024:.0f} MiB |",
            flush=True,
        )
        if args.crash:
            took, rss, peak = time_crash_mount(image, work / "mnt", args.crash)
            print(
                f"| {n:,} | crash mount after {args.crash} durable creates | - | - "
                f"| {took:.2f} s | - | {memory_cells(rss, peak, n)} |",
                flush=True,
            )
        if args.profile:
            _, text = time_load(image, profile=True)
            print(text)
        if not args.keep:
            image.unlink()


if __name__ == "__main__":
    main()
