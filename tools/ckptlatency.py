"""Stat latency while checkpoints are forced, and journal bytes per durable close.

    python tools/ckptlatency.py --dir /var/tmp/kvfs-ckpt --files 100000 1000000
    python tools/ckptlatency.py --tree /work/main ...     # the same run on another checkout

For each file count: a pool of N one-unit files is built offline (``tools/mounttime.py``'s
``build``, by the checked-out tree being measured, so its log format is that tree's),
mounted for real, and while ``--checkpoints`` checkpoints are forced one after the other
(``setfattr -n user.kvfs.checkpoint`` on the root), a thread loops over three requests:
``os.stat`` of one file (mostly answered from the kernel's attribute cache, 5 s), ``os.stat``
of a random existing file (a fresh lookup: the daemon answers) and ``getxattr`` of one
file (never cached: the daemon answers). Reported: the worst and p99 latency of each,
and the checkpoints' durations as the daemon logs them. Then, on a fresh small pool,
``--closes`` sequential small files (4 KiB, each closed = one durable commit) and the
journal bytes that added per close. ``--gaps N``: the same pool without FUSE, in this
process: what of a checkpoint runs on the trio thread, and the longest gaps of the
loop while one is written. Prints one markdown table row per measurement.

``--tree``: run the daemon and the builder from that checkout (to compare with an older
release). A tree without the ``user.kvfs.checkpoint`` trigger gets it added in the
daemon process only (``Journal.request_checkpoint``: the flusher's own checkpoint flag;
see :func:`_add_trigger`), so both are forced the same way.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
TRIGGER = "user.kvfs.checkpoint"


# ----------------------------------------------------------------------------- child modes
def _use_tree(tree: str) -> None:
    sys.path[:0] = [tree, str(Path(tree) / "tools")]


def _add_trigger() -> None:
    """Give an older tree the checkpoint trigger (daemon process only)."""
    import pyfuse3

    from kvfs.fuse import ops as fs
    from kvfs.log import journal

    if not hasattr(journal.Journal, "request_checkpoint"):

        def request_checkpoint(self: Any) -> None:
            self._want_checkpoint = True
            self._wake.set()

        journal.Journal.request_checkpoint = request_checkpoint  # type: ignore[attr-defined]
    if not hasattr(fs, "CHECKPOINT_XATTR"):
        original = fs.Operations.setxattr

        async def setxattr(self: Any, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
            if name == TRIGGER.encode() and inode == pyfuse3.ROOT_INODE:
                self.store.journal.request_checkpoint()
                return
            await original(self, inode, name, value, ctx)

        fs.Operations.setxattr = setxattr  # type: ignore[method-assign]


def _child(argv: list[str]) -> int:
    mode, tree, rest = argv[0], argv[1], argv[2:]
    _use_tree(tree)
    if mode == "--build":
        import mounttime

        print(mounttime.build(Path(rest[0]), int(rest[1])))
        return 0
    _add_trigger()
    from kvfs.cli import main

    return main(rest)


# ----------------------------------------------------------------------------- driver
def daemon(tree: str, mnt: Path, image: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    from kvfs.testing import harness

    mnt.mkdir(exist_ok=True)
    cmd = [sys.executable, str(HERE), "--daemon", tree, "mount", "--foreground", str(mnt)]
    cmd += [str(image), "--log-file", str(log), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    harness.wait_mounted(proc, mnt, 1800)
    return proc


def journal_stats(mnt: Path) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(os.getxattr(mnt, "user.kvfs.stats"))["journal"]
    return out


class Prober(threading.Thread):
    """Loops over the three requests, recording each one's latency."""

    def __init__(self, mnt: Path, files: int) -> None:
        super().__init__(daemon=True)
        self.mnt, self.files = mnt, files
        self.fixed = self.path(0)
        self.lat: dict[str, list[float]] = {"stat one file": [], "stat random file": []}
        self.lat["getxattr"] = []
        self.stop = threading.Event()

    def path(self, i: int) -> Path:
        return self.mnt / f"d{i // 1000:05d}" / f"chunk-{i:08d}.pt"

    def timed(self, what: str, fn: Any, *args: Any) -> None:
        t0 = time.perf_counter()
        try:
            fn(*args)
        except OSError as e:
            if e.errno != errno.ENODATA:
                raise
        self.lat[what].append(time.perf_counter() - t0)

    def run(self) -> None:
        rng = random.Random(1)
        while not self.stop.is_set():
            self.timed("stat one file", os.stat, self.fixed)
            self.timed("stat random file", os.stat, self.path(rng.randrange(self.files)))
            self.timed("getxattr", os.getxattr, self.fixed, "user.none")


def p99(xs: list[float]) -> float:
    return sorted(xs)[int(len(xs) * 0.99)] if xs else 0.0


def checkpoint_times(log: Path) -> list[float]:
    """Durations of the checkpoints the daemon logged, in order."""
    pattern = re.compile(r"checkpoint generation \d+: .*?([0-9.]+) s$")
    return [
        float(m.group(1)) for line in log.read_text().splitlines() if (m := pattern.search(line))
    ]


def latency_run(tree: str, work: Path, n: int, checkpoints: int) -> str:
    from kvfs.testing import harness

    image, mnt, log = work / f"pool-{n}.img", work / "mnt", work / f"kvfs-{n}.log"
    log.unlink(missing_ok=True)
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(HERE), "--build", tree, str(image), str(n)],
        check=True,
        capture_output=True,
        text=True,
    )
    size = int(out.stdout.split()[-1])
    built = time.perf_counter() - t0
    proc = daemon(tree, mnt, image, log)
    try:
        prober = Prober(mnt, n)
        prober.start()
        time.sleep(1)
        for k in range(checkpoints):
            os.setxattr(mnt, TRIGGER, b"1")
            # completion is read from the daemon's log, not user.kvfs.stats: that walks
            # every inode (0.3-0.5 s at 10^6 files), and polling it would stall the loop
            deadline = time.monotonic() + 900
            while len(checkpoint_times(log)) <= k:
                assert time.monotonic() < deadline, "checkpoint did not complete"
                time.sleep(0.05)
            time.sleep(0.5)
        prober.stop.set()
        prober.join()
    finally:
        harness.stop(proc, mnt, timeout=1800)
        image.unlink(missing_ok=True)
    # the built pool is clean (no mount-time checkpoint); the last one is the unmount's
    forced = checkpoint_times(log)[:checkpoints]
    cells = [f"{max(v) * 1e3:.1f} / {p99(v) * 1e3:.1f} ms ({len(v)})" for v in prober.lat.values()]
    return (
        f"| {n:,} | {size / 2**20:.0f} MiB | {built:.0f} s | "
        + " | ".join(cells)
        + f" | {statistics.median(forced):.2f} s (max {max(forced):.2f}) |"
    )


def bytes_per_close(tree: str, work: Path, closes: int) -> str:
    from kvfs.testing import harness

    image, mnt, log = work / "small.img", work / "mnt", work / "kvfs-small.log"
    image.unlink(missing_ok=True)
    harness.make_image(image, 1 << 30)
    fmt = [sys.executable, str(HERE), "--daemon", tree, "format", str(image), "--meta-size"]
    subprocess.run([*fmt, "64M"], check=True, capture_output=True)
    proc = daemon(tree, mnt, image, log)
    try:
        block = os.urandom(4096)
        before = journal_stats(mnt)
        t0 = time.perf_counter()
        for i in range(closes):
            with open(mnt / f"f{i}", "wb") as f:
                f.write(block)
        took = time.perf_counter() - t0
        after = journal_stats(mnt)
    finally:
        harness.stop(proc, mnt)
        image.unlink(missing_ok=True)
    assert after["generation"] == before["generation"], "a checkpoint came between"
    grown = after["used_bytes"] - before["used_bytes"]
    return f"| {closes} | {grown / closes:,.0f} B | {closes / took:,.0f} closes/s |"


def loop_gaps(tree: str, work: Path, n: int) -> str:
    """In-process, without FUSE: ``Store.load()`` of an N-file pool, then the parts of
    a checkpoint that run on the trio thread, and the longest gaps between the turns
    of a task that only yields, while a checkpoint is written."""
    _use_tree(tree)
    import mounttime
    import trio

    from kvfs.devices.pool import open_pool
    from kvfs.store.facade import Store

    image = work / f"gaps-{n}.img"
    mounttime.build(image, n)
    pool = open_pool([str(image)])
    try:
        store = Store(pool)
        store.load()
        t0 = time.perf_counter()
        freeze = getattr(store.evictor, "snapshot_payloads", None)
        if freeze is not None:  # the eviction state's part on the loop: a freeze
            freeze()
        else:  # an older tree: the whole policy image, encoded on the loop
            store.evictor.save()
        save = time.perf_counter() - t0
        t0 = time.perf_counter()
        list(store.ns.inodes)
        keys = time.perf_counter() - t0
        pieces, worst = store._snapshot(), 0.0
        while True:
            t0 = time.perf_counter()
            if next(pieces, None) is None:
                break
            worst = max(worst, time.perf_counter() - t0)
        gaps: list[float] = []

        async def run() -> None:
            done = False

            async def ticker() -> None:
                last = time.perf_counter()
                while not done:
                    await trio.lowlevel.checkpoint()
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now

            async with trio.open_nursery() as nursery:
                await nursery.start(store.run)
                nursery.start_soon(ticker)
                await store.journal.checkpoint()
                done = True
                nursery.cancel_scope.cancel()

        trio.run(run)
    finally:
        pool.close()
        image.unlink(missing_ok=True)
    top = ", ".join(f"{g * 1e3:.0f}" for g in sorted(gaps)[-4:][::-1])
    return (
        f"| {n:,} | {save:.2f} s | {keys * 1e3:.0f} ms | {worst * 1e3:.0f} ms "
        f"| {top} ms | {p99(gaps) * 1e3:.1f} ms |"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--build", "--daemon"):
        sys.exit(_child(sys.argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp/kvfs-ckptlatency")
    ap.add_argument("--tree", default=str(HERE.parents[1]), help="kvfs checkout to run")
    ap.add_argument("--files", type=int, nargs="*", default=[100_000, 1_000_000])
    ap.add_argument("--checkpoints", type=int, default=3)
    ap.add_argument("--closes", type=int, default=500, help="0: skip the bytes-per-close run")
    ap.add_argument("--gaps", type=int, nargs="*", default=[], help="loop gaps at N (in-process)")
    args = ap.parse_args()
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(HERE.parents[1]))
    print(f"tree: {args.tree}")
    if args.files:
        print(
            "| files | checkpoint | build | stat one file: worst / p99 (n) "
            "| stat random file | getxattr | forced checkpoint: median |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for n in args.files:
            print(latency_run(args.tree, work, n, args.checkpoints), flush=True)
    if args.gaps:
        print(
            "| files | eviction state on the loop | list(inodes) | worst next() of the snapshot "
            "| longest loop gaps | p99 gap |"
        )
        print("|---:|---:|---:|---:|---:|---:|")
        for n in args.gaps:
            print(loop_gaps(args.tree, work, n), flush=True)
    if args.closes:
        print("| sequential 4 KiB files closed | journal bytes per close | rate |")
        print("|---:|---:|---:|")
        print(bytes_per_close(args.tree, work, args.closes), flush=True)


if __name__ == "__main__":
    main()
