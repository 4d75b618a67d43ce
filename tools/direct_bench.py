#!/usr/bin/env python3
"""kvfs.client.direct vs raw O_DIRECT vs kvfs through FUSE, paired in one run (32 MiB files).

Reproduce (root; loop devices and FUSE; ~3 min on the 2-core VM)::

    .venv/bin/python tools/direct_bench.py --out docs/bench/direct.json

Two identical 2 GiB sparse images on the same host filesystem, each a loop device with
``--direct-io=on``. Per repetition and stream count, interleaved: **raw** (one
``pwrite``/``preadv`` of the whole file at a fixed offset of an O_DIRECT descriptor,
one ``fdatasync`` per write phase; **raw-sync**: one ``fdatasync`` per file, the
durability a ``write_from`` or a kvfs close gives), then a fresh kvfs pool on the
other device: **direct** (``kvfs.client.direct.write_from`` per file, durable per file; cold
``read_into`` after a remount and ``drop_caches``), **batch** (``kvfs.client.direct.write_many``
of each stream's files: all durable at its return, as raw's one ``fdatasync``) and
**fuse** (``open/write/close`` and buffered reads of the same size through the
mount). Ratios are taken within a repetition, then the median across repetitions is
reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import drop_caches, run_streams

import kvfs.client.direct as direct
from kvfs.testing import harness

MiB = 1 << 20


def streams(k: int, nbytes: int, fn: Callable[[int], None]) -> float:
    """MB/s of ``fn(i)`` run in ``k`` threads (bench.py's runner: a stream's error
    is raised here, not lost in its thread)."""
    return nbytes / run_streams(k, lambda i, _latencies: fn(i)).seconds / 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=16, help="files per phase")
    p.add_argument("--size-mib", type=int, default=32)
    p.add_argument("--streams", default="1,4")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workdir", default="/var/tmp")
    p.add_argument("--out", help="JSON file for every repetition and the medians")
    args = p.parse_args()
    size, nfiles = args.size_mib * MiB, args.files
    src = direct.aligned(size)
    src[:] = os.urandom(size)
    work = Path(args.workdir) / f"kvfs-direct-bench-{os.getpid()}"
    work.mkdir()
    mnt = work / "mnt"
    mnt.mkdir()
    res: dict[str, list[dict[str, float]]] = {}
    slots = (2 << 30) // size - 2
    try:
        with (
            harness.loop_device(harness.make_image(work / "raw.img", 2 << 30), True) as rawdev,
            harness.loop_device(harness.make_image(work / "kv.img", 2 << 30), True) as kvdev,
        ):
            rfd = os.open(rawdev, os.O_RDWR | os.O_DIRECT)
            try:
                for rep in range(args.reps):
                    for k in map(int, args.streams.split(",")):
                        per, row = nfiles // k, {}
                        moved = per * k * size

                        def raw_w(i: int, per: int = per) -> None:
                            for j in range(per):
                                os.pwrite(rfd, src, ((i * per + j) % slots) * size)

                        def raw_r(i: int, per: int = per) -> None:
                            b = direct.aligned(size)
                            for j in range(per):
                                os.preadv(rfd, [b], ((i * per + j) % slots) * size)

                        def raw_ws(i: int, per: int = per) -> None:
                            for j in range(per):
                                os.pwrite(rfd, src, ((i * per + j) % slots) * size)
                                os.fdatasync(rfd)

                        t = time.perf_counter()
                        streams(k, moved, raw_w)
                        os.fdatasync(rfd)
                        row["raw write"] = moved / (time.perf_counter() - t) / 1e6
                        row["raw-sync write"] = streams(k, moved, raw_ws)
                        drop_caches()
                        row["raw read"] = streams(k, moved, raw_r)

                        def d_w(i: int, per: int = per) -> None:
                            for j in range(per):
                                direct.write_from(mnt / f"d{i}-{j}", src)

                        def b_w(i: int, per: int = per) -> None:
                            direct.write_many((mnt / f"b{i}-{j}", src) for j in range(per))

                        def f_w(i: int, per: int = per) -> None:
                            for j in range(per):
                                with open(mnt / f"f{i}-{j}", "wb") as f:
                                    f.write(src)

                        def d_r(i: int, per: int = per) -> None:
                            b = direct.aligned(size)
                            for j in range(per):
                                if direct.read_into(mnt / f"d{i}-{j}", b) != size:
                                    raise OSError("short direct read")
                                if b[:4096] != src[:4096] or b[-4096:] != src[-4096:]:
                                    raise AssertionError("direct read-back mismatch")

                        def f_r(i: int, per: int = per) -> None:
                            b = memoryview(direct.aligned(size))
                            for j in range(per):
                                fd = os.open(mnt / f"f{i}-{j}", os.O_RDONLY)
                                got = 0
                                while got < size and (n := os.readv(fd, [b[got:]])):
                                    got += n
                                os.close(fd)
                                if got != size:
                                    raise OSError("short FUSE read")

                        log = work / "kvfs.log"
                        fmt = ("--format", "--force", "--meta-size", "8M")
                        with harness.mounted(mnt, [kvdev], *fmt, log_file=log):
                            row["direct write"] = streams(k, moved, d_w)
                            row["batch write"] = streams(k, moved, b_w)
                            row["fuse write"] = streams(k, moved, f_w)
                        drop_caches()
                        with harness.mounted(mnt, [kvdev], log_file=log):
                            row["direct read"] = streams(k, moved, d_r)
                            row["fuse read"] = streams(k, moved, f_r)
                        res.setdefault(str(k), []).append(row)
                        print(rep, k, {n: round(v) for n, v in row.items()}, flush=True)
            finally:
                os.close(rfd)
    finally:
        harness.unmount(mnt)
        shutil.rmtree(work)
    summary = {}
    pairs = [
        ("direct write", "raw write"),
        ("batch write", "raw write"),
        ("fuse write", "raw write"),
        ("direct write", "raw-sync write"),
        ("fuse write", "raw-sync write"),
        ("direct read", "raw read"),
        ("fuse read", "raw read"),
    ]
    for k, rows in res.items():
        for mine, raw in pairs:
            ratios = [r[mine] / r[raw] for r in rows]
            summary[f"{k} streams {mine} / {raw}"] = statistics.median(ratios)
        for phase in ("write", "read"):
            summary[f"{k} streams {phase} raw MB/s"] = statistics.median(
                r[f"raw {phase}"] for r in rows
            )
    for key, v in summary.items():
        print(f"{key}: {v:.2f}")
    print("client:", direct.stats())
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": res, "medians": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
