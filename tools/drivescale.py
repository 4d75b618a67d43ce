"""Drive scale: FUSE request latency beside stats calls, scrapes and checkpoints.

    python tools/drivescale.py --dir /var/tmp/kvfs-scale --created 1000000 --offline 10000000

Two pools, each mounted for real with ``--metrics 127.0.0.1:PORT``:

- ``--created N``: a fresh pool, and N files created *through the mount* by
  ``--threads`` threads, in directories ``d00000``.. of 1000 files: each file one
  ``mknod`` (FUSE MKNOD: a committed empty file), or with ``--file-bytes B`` an
  ``open(O_CREAT)`` + B bytes written + ``close`` (a durable commit each: group commit
  batches the threads' closes, but ~300 files/s on the 2-core VM);
- ``--offline N``: a pool of N one-unit files built offline (``tools/mounttime.py``'s
  builder: ``harness.fill_namespace`` + a checkpoint written directly), the same layout.

On each, for ``--seconds``: one thread probes the daemon with requests it must answer
itself, recording each one's latency: ``os.stat`` of a random existing file (a fresh
lookup; the kernel caches attributes 5 s) and ``getxattr`` of one file (never cached);
meanwhile a Prometheus scrape (HTTP GET of ``/metrics``) and a ``kvfs stats --json``
(the root's ``user.kvfs.stats`` xattr it reads: the same one getxattr, timed in this
process) run once per second each, and ``--checkpoints`` checkpoints are forced one after
the other (``setfattr -n user.kvfs.checkpoint`` on the root; completion read from the
daemon's log). Reported, as JSON and one markdown table row per pool: the probe's
worst / p99.9 / p99 latency, the scrapes' and stats calls' worst and median durations,
the checkpoints' durations. ``--steps`` (offline pool): before mounting it, the same
pool is loaded in this process and the trio thread's parts of a stats call, a scrape
and each step of a checkpoint are timed alone, in CPU time of the thread (on a
loaded machine the wall-clock probe carries other processes' scheduling delays). The
target (issue 26): no request waits more than 50 ms
because of a stats call, a scrape or a checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import stat
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from kvfs.testing import harness  # noqa: E402

TRIGGER = "user.kvfs.checkpoint"
PER_DIR = 1000
UNIT = 1 << 20


def path_of(mnt: Path, i: int) -> Path:
    """File ``i`` of either pool (``harness.fill_namespace``'s names)."""
    return mnt / f"d{i // PER_DIR:05d}" / f"chunk-{i:08d}.pt"


def kvfs(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvfs", *args]


def mount(image: Path, mnt: Path, log: Path, port: int) -> subprocess.Popen[bytes]:
    mnt.mkdir(parents=True, exist_ok=True)
    cmd = kvfs("mount", "--foreground", str(mnt), str(image), "--log-file", str(log))
    cmd += ["--metrics", f"127.0.0.1:{port}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    harness.wait_mounted(proc, mnt, 3600)
    return proc


def fresh_pool(image: Path, files: int, file_bytes: int) -> None:
    """A sparse pool with room for ``files`` files (metadata ~400 B per file)."""
    meta = max(64 << 20, -(-files * 400 // UNIT) * UNIT)
    data = (files * max(file_bytes, 1) * 2 // UNIT + 1024) * UNIT
    image.unlink(missing_ok=True)
    harness.make_image(image, (2 << 20) + meta + data)
    subprocess.run(kvfs("format", str(image), "--meta-size", str(meta)), check=True)


def create_files(mnt: Path, files: int, threads: int, file_bytes: int) -> float:
    """``files`` files through the mount, by ``threads`` threads; returns files/s."""
    for d in range(-(-files // PER_DIR)):
        (mnt / f"d{d:05d}").mkdir()
    payload = os.urandom(file_bytes)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL

    def make(start: int) -> None:
        for i in range(start, files, threads):
            if not payload:  # FUSE MKNOD: a committed empty file, no close to commit
                os.mknod(path_of(mnt, i), 0o644 | stat.S_IFREG)
                continue
            fd = os.open(path_of(mnt, i), flags, 0o644)
            try:
                os.write(fd, payload)
            finally:
                os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        for f in [ex.submit(make, k) for k in range(threads)]:
            f.result()
    return files / (time.perf_counter() - t0)


def checkpoint_times(log: Path) -> list[float]:
    """Durations of the checkpoints the daemon logged, in order."""
    pattern = re.compile(r"checkpoint generation \d+: .*?([0-9.]+) s$")
    return [
        float(m.group(1)) for line in log.read_text().splitlines() if (m := pattern.search(line))
    ]


class Loop(threading.Thread):
    """Runs ``fn`` every ``every`` seconds (0: back to back) until stopped, recording
    each call's duration."""

    def __init__(self, fn: Callable[[], object], every: float) -> None:
        super().__init__(daemon=True)
        self.fn, self.every = fn, every
        self.took: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            self.fn()
            took = time.perf_counter() - t0
            self.took.append(took)
            if self.every:
                self.stop.wait(max(0.0, self.every - took))


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))] if s else 0.0


def summary(xs: list[float]) -> dict[str, float]:
    """ms: worst, p99.9, p99, median; and the sample count."""
    return {
        "n": len(xs),
        "max_ms": max(xs, default=0) * 1e3,
        "p999_ms": quantile(xs, 0.999) * 1e3,
        "p99_ms": quantile(xs, 0.99) * 1e3,
        "median_ms": (statistics.median(xs) if xs else 0) * 1e3,
    }


def probe(
    mnt: Path, log: Path, port: int, files: int, seconds: float, ckpts: int
) -> dict[str, Any]:
    """The probe, scrapes, stats calls and forced checkpoints of one mounted pool."""
    rng = random.Random(26)
    fixed = path_of(mnt, 0)
    took: list[float] = []  # every probe request, each one timed alone

    def request() -> None:
        t0 = time.perf_counter()
        with contextlib.suppress(FileNotFoundError):  # evicted (metadata pressure)
            os.stat(path_of(mnt, rng.randrange(files)))
        t1 = time.perf_counter()
        with contextlib.suppress(OSError):  # ENODATA: the daemon answered
            os.getxattr(fixed, "user.none")
        took.extend((t1 - t0, time.perf_counter() - t1))

    url = f"http://127.0.0.1:{port}/metrics"

    def scrape() -> None:
        with urllib.request.urlopen(url, timeout=60) as r:
            r.read()

    def stats() -> None:
        json.loads(os.getxattr(mnt, "user.kvfs.stats"))

    loops = {"request": Loop(request, 0), "scrape": Loop(scrape, 1.0), "stats": Loop(stats, 1.0)}
    before = len(checkpoint_times(log))
    t0 = time.monotonic()
    for loop in loops.values():
        loop.start()
    for k in range(ckpts):
        os.setxattr(mnt, TRIGGER, b"1")
        deadline = time.monotonic() + 1800
        while len(checkpoint_times(log)) <= before + k:
            assert time.monotonic() < deadline, "checkpoint did not complete"
            time.sleep(0.05)
    time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
    for loop in loops.values():
        loop.stop.set()
    for loop in loops.values():
        loop.join()
    out: dict[str, Any] = {name: summary(loop.took) for name, loop in loops.items()}
    out["request"] = summary(took)
    out["checkpoints_s"] = checkpoint_times(log)[before : before + ckpts]
    out["seconds"] = time.monotonic() - t0
    return out


def row(label: str, r: dict[str, Any]) -> str:
    q, sc, st = r["request"], r["scrape"], r["stats"]
    ck = r["checkpoints_s"]
    return (
        f"| {label} | {q['max_ms']:.1f} / {q['p999_ms']:.1f} / {q['p99_ms']:.1f} ms ({q['n']:,}) "
        f"| {sc['max_ms']:.1f} / {sc['median_ms']:.1f} ms ({sc['n']}) "
        f"| {st['max_ms']:.1f} / {st['median_ms']:.1f} ms ({st['n']}) "
        f"| {', '.join(f'{c:.2f}' for c in ck)} s |"
    )


def run_created(args: argparse.Namespace, n: int) -> dict[str, Any]:
    image, mnt, log = args.dir / "created.img", args.dir / "mnt", args.dir / "created.log"
    log.unlink(missing_ok=True)
    fresh_pool(image, n, args.file_bytes)
    proc = mount(image, mnt, log, args.port)
    try:
        rate = create_files(mnt, n, args.threads, args.file_bytes)
        print(f"created {n:,} files through the mount: {rate:,.0f} files/s", file=sys.stderr)
        r = probe(mnt, log, args.port, n, args.seconds, args.checkpoints)
    finally:
        harness.stop(proc, mnt, timeout=3600)
        image.unlink(missing_ok=True)
    r.update(files=n, source="created through the mount", create_rate=rate)
    return r


def cpu_steps(image: Path) -> dict[str, Any]:
    """What the daemon's trio thread runs for a stats call, a scrape and a checkpoint,
    timed in this process on the same pool (``Store.load()`` without FUSE): each
    step's CPU time of this thread (``time.thread_time``: what other processes on a
    loaded machine add to wall time is not in it) and wall time, in ms."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvfs.devices.pool import open_pool
    from kvfs.fuse.metrics import StoreCollector
    from kvfs.fuse.ops import Operations
    from kvfs.store.facade import Store

    def timed(fn: Callable[[], object]) -> tuple[float, float]:
        c0, w0 = time.thread_time(), time.perf_counter()
        fn()
        return (time.thread_time() - c0) * 1e3, (time.perf_counter() - w0) * 1e3

    pool = open_pool([str(image)])
    try:
        store = Store(pool)
        load = timed(store.load)
        ops = Operations(store)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StoreCollector(store, ops.requests))
        stats = [timed(ops.stats_json) for _ in range(5)]
        scrape = [timed(lambda: generate_latest(registry)) for _ in range(5)]
        pieces = iter(store._snapshot())  # a checkpoint's steps on the trio thread
        steps = [timed(lambda: next(pieces, None)) for _ in range(3)]  # the freeze first
        while True:
            c0, w0 = time.thread_time(), time.perf_counter()
            if next(pieces, None) is None:
                break
            steps.append(((time.thread_time() - c0) * 1e3, (time.perf_counter() - w0) * 1e3))
    finally:
        pool.close()

    def worst(xs: list[tuple[float, float]]) -> dict[str, float]:
        return {"cpu_ms": max(x[0] for x in xs), "wall_ms": max(x[1] for x in xs)}

    return {
        "load_s": load[1] / 1e3,
        "stats_call": worst(stats),
        "scrape": worst(scrape),
        "checkpoint_step": worst(steps),
        "checkpoint_steps": len(steps),
    }


def run_offline(args: argparse.Namespace, n: int) -> dict[str, Any]:
    import mounttime

    image, mnt, log = args.dir / "offline.img", args.dir / "mnt", args.dir / "offline.log"
    log.unlink(missing_ok=True)
    mounttime.build(image, n)
    steps = cpu_steps(image) if args.steps else None
    proc = mount(image, mnt, log, args.port)
    try:
        r = probe(mnt, log, args.port, n, args.seconds, args.checkpoints)
    finally:
        harness.stop(proc, mnt, timeout=3600)
        image.unlink(missing_ok=True)
    r.update(files=n, source="built offline")
    if steps is not None:
        r["in_process"] = steps
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/kvfs-scale"))
    ap.add_argument("--created", type=int, default=1_000_000, help="files made through a mount")
    ap.add_argument("--offline", type=int, default=10_000_000, help="files of an offline pool")
    ap.add_argument("--threads", type=int, default=32, help="creating threads")
    ap.add_argument("--file-bytes", type=int, default=0, help="bytes written to each file")
    ap.add_argument("--seconds", type=float, default=60, help="probe duration per pool")
    ap.add_argument("--checkpoints", type=int, default=3, help="checkpoints forced per pool")
    ap.add_argument("--port", type=int, default=harness.free_port())
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument(
        "--steps",
        action="store_true",
        help="offline pool: also time the trio thread's steps in this process (CPU time)",
    )
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    results = []
    if args.created:
        results.append(run_created(args, args.created))
    if args.offline:
        results.append(run_offline(args, args.offline))
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    print(
        "| files | request worst / p99.9 / p99 | scrape worst / median | stats worst / median "
        "| forced checkpoints |"
    )
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(row(f"{r['files']:,} ({r['source']})", r))
    for r in results:
        if "in_process" in r:
            st = r["in_process"]
            print(
                f"in process, {r['files']:,} files (CPU / wall ms, worst): "
                + ", ".join(
                    f"{k} {st[k]['cpu_ms']:.1f} / {st[k]['wall_ms']:.1f}"
                    for k in ("stats_call", "scrape", "checkpoint_step")
                )
                + f" ({st['checkpoint_steps']} checkpoint steps; load {st['load_s']:.1f} s)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
