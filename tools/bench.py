#!/usr/bin/env python3
"""kvfs vs the raw device vs ext4, side by side, on identical loop devices.

Reproduce (root; loop devices and FUSE needed; ~3-4 min on the 2-core VM, ``--quick`` <1 min)::

    .venv/bin/python tools/bench.py --out docs/bench

Three same-size images on the same host filesystem, each attached as a loop device
with ``--direct-io=on`` (so the host page cache never serves a "device" read):

- **raw**: one ``O_DIRECT`` descriptor on the loop device; a file is an offset; one
  ``pwrite``/``preadv`` of the whole file from an aligned buffer; one ``fdatasync``
  at the end of each write phase (counted).
- **ext4**: ``mkfs.ext4`` on the second device; files written the LMCache way
  (``open(O_WRONLY|O_CREAT|O_TRUNC)``, one ``write()``, ``close``: lands in the page
  cache) and read with one buffered ``read`` of the whole file. ``write`` is that
  phase; ``write+sync`` also counts the ``syncfs`` that makes it durable. Cold reads
  follow ``drop_caches``.
- **kvfs**: mounted on the third device, same calls as ext4 (close is durable in
  kvfs). Cold reads follow an unmount + remount (kvfs has its own unit cache) and
  ``drop_caches``.
- **ceiling** (``--ceiling``, or ``--backends`` naming it): the binding ceiling,
  ``tools/ceiling_fs.py`` on a fourth identical device: a minimal pyfuse3 + trio
  filesystem (1 MiB units at fixed device offsets, one O_DIRECT ``preadv``/``pwritev``
  per FUSE request in ``trio.to_thread``, aligned buffers, no checksums, cache, index
  or journal; close does one ``fdatasync``). What kvfs's own work costs is kvfs over
  this, per cell. Cold reads follow ``drop_caches`` (it has no cache of its own).

App modes (``--modes``): ``buffered`` (the calls above) and ``direct`` (the
application opens the files on ext4/ceiling/kvfs with ``O_DIRECT`` and reads and
writes from page-aligned buffers; raw is O_DIRECT either way and is measured once
per repetition, its numbers serve both modes). Every phase also records the
backing loop device's request counts (``/sys/block/loopN/stat`` deltas) and, for
the FUSE daemons, their FUSE READ count, so device requests per FUSE request and
bytes per request are in the JSON.

``--ceiling`` runs raw, ext4, ceiling and kvfs in both modes (1/4/16 streams x
1/8/32 MiB; ``--quick`` 1/4 x 1/32) into ``ceiling.json`` with the ratios
kvfs/ceiling per cell (target >= 0.9) and kvfs/ext4 cold reads at 4+ streams
(target >= 1.0)::

    .venv/bin/python tools/bench.py --ceiling --out docs/bench

Per (file size, streams): write, cold read, warm re-read; each stream is a thread
with its own files; throughput = bytes / phase wall time, latency = per file (open
to close). Then a lookup storm (``stat`` of N names, half missing, after
``drop_caches``, then again warm). Every measurement is repeated ``--reps`` times;
the JSON holds every repetition and the medians, and the ratios kvfs/raw and
kvfs/ext4 against the targets. kvfs daemon CPU seconds per GiB moved come from
``/proc/<pid>/stat`` (utime + stime), its RSS from ``/proc/<pid>/status``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvfs.testing.harness import kvfs_command, loop_device, make_image, stop, unmount, wait_mounted

MiB = 1 << 20
GiB = 1 << 30
CLK_TCK = os.sysconf("SC_CLK_TCK")
TARGETS = {  # (phase, streams) -> minimum kvfs/raw ratio, for 32 MiB files
    ("write", 1): 0.9,
    ("write", 4): 0.9,
    ("cold", 1): 0.9,
    ("cold", 4): 0.9,
}
LOOKUP_TARGET = 0.5  # kvfs/ext4 cold lookup-storm throughput
CEILING_TARGET = 0.9  # kvfs/ceiling, every cell (issue 11, part 1)
COLD_VS_EXT4_TARGET = 1.0  # kvfs/ext4 cold reads at 4+ streams
CEILING_FS = Path(__file__).resolve().parent / "ceiling_fs.py"


@dataclass(frozen=True)
class Plan:
    image_bytes: int
    moved_bytes: int
    sizes: tuple[int, ...]
    streams: tuple[int, ...]
    reps: int
    lookup_names: int
    backends: tuple[str, ...]
    modes: tuple[str, ...] = ("buffered",)


# ---------------------------------------------------------------- measurements
@dataclass
class PhaseResult:
    seconds: float
    nbytes: int
    latencies: list[float]
    cpu_s: float | None = None
    rss_bytes: int | None = None
    extra: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        out: dict[str, Any] = {
            "mbps": self.nbytes / self.seconds / 1e6,
            "p50_ms": _percentile(lat, 50) * 1e3,
            "p99_ms": _percentile(lat, 99) * 1e3,
            "seconds": self.seconds,
            "bytes": self.nbytes,
        }
        if self.cpu_s is not None:
            out["daemon_cpu_s_per_gib"] = self.cpu_s / (self.nbytes / GiB)
        if self.rss_bytes is not None:
            out["daemon_rss_mib"] = self.rss_bytes / MiB
        out.update(self.extra)
        ios, fuse = self.extra.get("dev_read_ios"), self.extra.get("fuse_reads")
        if ios is not None:  # 0 when there was nothing to divide (warm phases)
            out["dev_read_kib_per_io"] = self.extra["dev_read_bytes"] / 1024 / ios if ios else 0.0
            out["dev_read_bytes_per_byte"] = self.extra["dev_read_bytes"] / self.nbytes
        if fuse is not None:
            out["fuse_read_kib"] = self.nbytes / 1024 / fuse if fuse else 0.0
            out["dev_reads_per_fuse_read"] = ios / fuse if fuse and ios is not None else 0.0
        return out


def _percentile(sorted_values: list[float], pct: float) -> float:
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * pct / 100
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def run_streams(nstreams: int, per_stream: Callable[[int, list[float]], None]) -> PhaseResult:
    """Run ``per_stream(i, latencies)`` in ``nstreams`` threads; wall time of all."""
    lats: list[list[float]] = [[] for _ in range(nstreams)]
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            per_stream(i, lats[i])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(nstreams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return PhaseResult(seconds, 0, [x for lat in lats for x in lat])


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def aligned(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size)


def pattern(size: int) -> mmap.mmap:
    """The bytes every file holds: 1 MiB of seeded noise, tiled (aligned, shared)."""
    block = random.Random(42).randbytes(min(size, MiB))
    buf = aligned(size)
    for off in range(0, size, len(block)):
        buf[off : off + len(block)] = block[: size - off]
    return buf


def check_sample(buf: mmap.mmap | memoryview, src: mmap.mmap, size: int) -> None:
    """Cheap content check: first, middle and last 4 KiB match what was written."""
    for off in (0, (size // 2) & ~4095, max(size - 4096, 0)):
        if buf[off : off + 4096] != src[off : off + 4096]:
            raise AssertionError(f"read-back mismatch at offset {off}")


# ---------------------------------------------------------------- backends
class Backend(Protocol):
    name: str
    dev: str
    direct: bool

    def write(self, files: list[list[int]], size: int, src: mmap.mmap) -> PhaseResult: ...
    def read(
        self, files: list[list[int]], size: int, src: mmap.mmap, cold: bool
    ) -> PhaseResult: ...
    def make_cold(self) -> None: ...
    def counters(self) -> dict[str, int]: ...
    def clear(self, files: list[list[int]]) -> None: ...


def device_counters(dev: str) -> dict[str, int]:
    """Completed requests and bytes of a block device (``/sys/block/NAME/stat``)."""
    with open(f"/sys/block/{os.path.basename(os.path.realpath(dev))}/stat") as f:
        v = [int(x) for x in f.read().split()]
    return {
        "dev_read_ios": v[0],
        "dev_read_bytes": v[2] * 512,
        "dev_write_ios": v[4],
        "dev_write_bytes": v[6] * 512,
    }


class RawBackend:
    """Files are offsets on an O_DIRECT descriptor of the loop device."""

    name = "raw"
    direct = True  # O_DIRECT whatever the app mode

    def __init__(self, dev: str, dev_bytes: int) -> None:
        self.dev = dev
        self.fd = os.open(dev, os.O_RDWR | os.O_DIRECT)
        self.slots = dev_bytes // MiB

    def make_cold(self) -> None:
        drop_caches()

    def counters(self) -> dict[str, int]:
        return device_counters(self.dev)

    def close(self) -> None:
        os.close(self.fd)

    def _offset(self, file_id: int, size: int) -> int:
        # file ids never repeat in a run: repetitions walk over the device like an
        # allocator's next-fit cursor would
        per = size // MiB
        return (file_id % (self.slots // per)) * size

    def write(self, files: list[list[int]], size: int, src: mmap.mmap) -> PhaseResult:
        view = memoryview(src)[:size]

        def stream(i: int, lat: list[float]) -> None:
            for f in files[i]:
                t = time.perf_counter()
                if os.pwrite(self.fd, view, self._offset(f, size)) != size:
                    raise OSError("short raw write")
                lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        res = run_streams(len(files), stream)
        os.fdatasync(self.fd)
        res.seconds = time.perf_counter() - t0
        return res

    def read(self, files: list[list[int]], size: int, src: mmap.mmap, cold: bool) -> PhaseResult:
        bufs = [aligned(size) for _ in files]

        def stream(i: int, lat: list[float]) -> None:
            for f in files[i]:
                t = time.perf_counter()
                if os.preadv(self.fd, [bufs[i]], self._offset(f, size)) != size:
                    raise OSError("short raw read")
                lat.append(time.perf_counter() - t)
                check_sample(bufs[i], src, size)

        if cold:
            drop_caches()
        return run_streams(len(files), stream)

    def clear(self, files: list[list[int]]) -> None:
        pass


class FileBackend:
    """A directory of a mounted filesystem, used the LMCache way; with ``direct``
    the files are opened with O_DIRECT (the buffers are page-aligned)."""

    def __init__(self, name: str, root: Path, dev: str = "") -> None:
        self.name = name
        self.root = root
        self.dev = dev
        self.direct = False

    @property
    def _odirect(self) -> int:
        return os.O_DIRECT if self.direct else 0

    def counters(self) -> dict[str, int]:
        return device_counters(self.dev) if self.dev else {}

    def path(self, f: int) -> str:
        return str(self.root / f"model@1@0@{f:016x}@bfloat16.pt")

    def write(self, files: list[list[int]], size: int, src: mmap.mmap) -> PhaseResult:
        view = memoryview(src)[:size]

        def stream(i: int, lat: list[float]) -> None:
            for f in files[i]:
                t = time.perf_counter()
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self._odirect
                fd = os.open(self.path(f), flags, 0o644)
                try:
                    done = 0
                    while done < size:
                        done += os.write(fd, view[done:])
                finally:
                    os.close(fd)
                lat.append(time.perf_counter() - t)

        return run_streams(len(files), stream)

    def read(self, files: list[list[int]], size: int, src: mmap.mmap, cold: bool) -> PhaseResult:
        bufs = [aligned(size) for _ in files]

        def stream(i: int, lat: list[float]) -> None:
            view = memoryview(bufs[i])
            for f in files[i]:
                t = time.perf_counter()
                fd = os.open(self.path(f), os.O_RDONLY | self._odirect)
                try:
                    got = 0
                    while got < size:
                        n = os.readv(fd, [view[got:]])
                        if n == 0:
                            raise OSError(f"short read of {self.path(f)}: {got}/{size}")
                        got += n
                finally:
                    os.close(fd)
                lat.append(time.perf_counter() - t)
                check_sample(bufs[i], src, size)

        if cold:
            self.make_cold()
        return run_streams(len(files), stream)

    def make_cold(self) -> None:
        drop_caches()

    def clear(self, files: list[list[int]]) -> None:
        for stream in files:
            for f in stream:
                os.unlink(self.path(f))


class Ext4Backend(FileBackend):
    def __init__(self, root: Path, dev: str = "") -> None:
        super().__init__("ext4", root, dev)

    def write(self, files: list[list[int]], size: int, src: mmap.mmap) -> PhaseResult:
        res = super().write(files, size, src)
        t = time.perf_counter()
        os.sync()  # covers syncfs of this filesystem (os has no syncfs)
        res.extra["write_sync_mbps"] = 0.0
        res.extra["sync_seconds"] = time.perf_counter() - t
        return res


class DaemonBackend(FileBackend):
    """A FUSE filesystem on a loop device, served by a foreground daemon this
    process started; its CPU time and RSS are measured per phase."""

    stats_xattr = ""
    """Root xattr holding the daemon's counters as JSON (FUSE READs served)."""

    def __init__(self, name: str, mountpoint: Path, dev: str, log_file: Path) -> None:
        super().__init__(name, mountpoint, dev)
        self.log_file = log_file
        self.proc: subprocess.Popen[bytes] | None = None
        self.peak_rss = 0

    def command(self) -> list[str]:
        raise NotImplementedError

    def mount(self) -> None:
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=log)
        wait_mounted(self.proc, self.root, 30.0)

    def unmount(self) -> None:
        if self.proc is not None:
            self.peak_rss = max(self.peak_rss, _proc_status(self.proc.pid, "VmHWM"))
            code = stop(self.proc, self.root)
            self.proc = None
            if code != 0:
                raise RuntimeError(f"{self.name} daemon exited with {code}; see {self.log_file}")

    def fuse_reads(self) -> int:
        stats = json.loads(os.getxattr(self.root, self.stats_xattr))
        return int(stats.get("store", stats).get("reads", 0))

    def counters(self) -> dict[str, int]:
        return {**super().counters(), "fuse_reads": self.fuse_reads()}

    def write(self, files: list[list[int]], size: int, src: mmap.mmap) -> PhaseResult:
        assert self.proc is not None
        before = _proc_cpu(self.proc.pid)
        res = FileBackend.write(self, files, size, src)
        res.cpu_s = _proc_cpu(self.proc.pid) - before
        res.rss_bytes = _proc_status(self.proc.pid, "VmRSS")
        return res

    def read(self, files: list[list[int]], size: int, src: mmap.mmap, cold: bool) -> PhaseResult:
        if cold:
            self.make_cold()
        assert self.proc is not None
        before = _proc_cpu(self.proc.pid)
        res = FileBackend.read(self, files, size, src, False)
        res.cpu_s = _proc_cpu(self.proc.pid) - before
        res.rss_bytes = _proc_status(self.proc.pid, "VmRSS")
        return res


class KvfsBackend(DaemonBackend):
    """kvfs on a loop device, in a foreground daemon this process started."""

    stats_xattr = "user.kvfs.stats"

    def __init__(self, mountpoint: Path, dev: str, log_file: Path) -> None:
        super().__init__("kvfs", mountpoint, dev, log_file)

    def command(self) -> list[str]:
        return [
            *kvfs_command(),
            "mount",
            "--foreground",
            str(self.root),
            self.dev,
            "--log-file",
            str(self.log_file),
        ]

    def make_cold(self) -> None:
        self.unmount()
        drop_caches()
        self.mount()


class CeilingBackend(DaemonBackend):
    """The binding ceiling, ``tools/ceiling_fs.py`` (no cache of its own: cold is
    ``drop_caches``, as for ext4)."""

    stats_xattr = "user.ceiling.stats"

    def __init__(self, mountpoint: Path, dev: str, log_file: Path) -> None:
        super().__init__("ceiling", mountpoint, dev, log_file)

    def command(self) -> list[str]:
        return [sys.executable, str(CEILING_FS), self.dev, str(self.root)]


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def _proc_status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------- setup / teardown
def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def loop_dev(image: Path) -> contextlib.AbstractContextManager[str]:
    """A loop device with direct I/O to its image (no host page cache below it)."""
    return loop_device(image, direct_io=True)


def preallocate(image: Path, size: int) -> None:
    """Allocate every block of the image (fills holes a discard punched)."""
    _run("fallocate", "-l", str(size), str(image))


@contextmanager
def fs_mounted(dev: str, mnt: Path) -> Iterator[Path]:
    mnt.mkdir(parents=True, exist_ok=True)
    _run("mount", "-o", "noatime", dev, str(mnt))
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


@contextmanager
def backends(plan: Plan, work: Path) -> Iterator[dict[str, Any]]:
    """Attach three identical loop devices and set up each backend; always clean up."""
    with ExitStack() as stack:
        out: dict[str, Any] = {}
        devs = {}
        for name in plan.backends:
            img = make_image(work / f"{name}.img", plan.image_bytes)
            preallocate(img, plan.image_bytes)
            devs[name] = stack.enter_context(loop_dev(img))
        if "raw" in devs:
            raw = RawBackend(devs["raw"], plan.image_bytes)
            stack.callback(raw.close)
            out["raw"] = raw
        if "ext4" in devs:
            _run(
                "mkfs.ext4",
                "-q",
                "-F",
                "-E",
                "nodiscard,lazy_itable_init=0,lazy_journal_init=0",
                devs["ext4"],
            )
            mnt = stack.enter_context(fs_mounted(devs["ext4"], work / "ext4"))
            out["ext4"] = Ext4Backend(mnt, devs["ext4"])
        if "kvfs" in devs:
            _run(*kvfs_command(), "format", "--force", devs["kvfs"])
            preallocate(work / "kvfs.img", plan.image_bytes)  # format discarded it all
            kv = KvfsBackend(work / "kvfs", devs["kvfs"], work / "kvfs.log")
            (work / "kvfs").mkdir(exist_ok=True)
            stack.callback(unmount, work / "kvfs")
            stack.callback(kv.unmount)
            kv.mount()
            out["kvfs"] = kv
        if "ceiling" in devs:
            ce = CeilingBackend(work / "ceiling", devs["ceiling"], work / "ceiling.log")
            (work / "ceiling").mkdir(exist_ok=True)
            stack.callback(unmount, work / "ceiling")
            stack.callback(ce.unmount)
            ce.mount()
            out["ceiling"] = ce
        yield out


# ---------------------------------------------------------------- the plan
def file_sets(size: int, streams: int, moved: int, base: int) -> list[list[int]]:
    per = max(1, moved // size // streams)
    return [[base + s * per + k for k in range(per)] for s in range(streams)]


Log = Callable[[str], None]


def run_transfers(plan: Plan, bks: dict[str, Any], log: Log) -> list[dict[str, Any]]:
    """Every (size, streams) point, the backends interleaved repetition by repetition
    (raw, ext4, kvfs, raw, ...; with two app modes raw, ext4, kvfs, ext4 O_DIRECT,
    kvfs O_DIRECT, raw, ...) so that load from other jobs hits them alike. Raw is the
    same in every mode: measured once per repetition, its rows are mode "buffered"."""
    rows: list[dict[str, Any]] = []
    src = pattern(max(plan.sizes))
    serial = 0
    runs = [
        (mode, name)
        for i, mode in enumerate(plan.modes)
        for name in plan.backends
        if name != "raw" or i == 0
    ]
    points = [(size, streams) for size in plan.sizes for streams in plan.streams]
    t0 = time.monotonic()
    for k, (size, streams) in enumerate(points):
        if k:  # progress: the points left, at the pace so far
            left = (time.monotonic() - t0) / k * (len(points) - k)
            log(f"point {k + 1}/{len(points)} ({size >> 20} MiB x{streams}), ~{left:.0f} s left")
        reps: dict[tuple[str, str], dict[str, list[Any]]] = {
            run: {"write": [], "cold": [], "warm": []} for run in runs
        }
        for _ in range(plan.reps):
            for mode, name in runs:
                files = file_sets(size, streams, plan.moved_bytes, serial)
                serial += sum(len(f) for f in files)
                bks[name].direct = mode == "direct" or name == "raw"
                _measure(bks[name], files, size, src, reps[(mode, name)])
        for mode, name in runs:
            for phase, got in reps[(mode, name)].items():
                rows.append(_row(name, size, streams, phase, got, log, mode))
    return rows


def _measure(
    bk: Backend, files: list[list[int]], size: int, src: mmap.mmap, into: dict[str, list[Any]]
) -> None:
    nbytes = sum(len(f) for f in files) * size
    for phase, res in _one_rep(bk, files, size, src).items():
        res.nbytes = nbytes
        if "sync_seconds" in res.extra:
            res.extra["write_sync_mbps"] = nbytes / (res.seconds + res.extra["sync_seconds"]) / 1e6
        into[phase].append(res.summary())
    bk.clear(files)


def _row(
    name: str,
    size: int,
    streams: int,
    phase: str,
    got: list[dict[str, Any]],
    log: Log,
    mode: str = "buffered",
) -> dict[str, Any]:
    m = _medians(got)
    tag = "" if mode == "buffered" else " O_DIRECT"
    log(
        f"{name:7} {size // MiB:3} MiB x{streams:<2} {phase:5}{tag:9} "
        f"{m['mbps']:8.0f} MB/s  p50 {m['p50_ms']:7.1f} ms  p99 {m['p99_ms']:7.1f} ms"
    )
    return {
        "backend": name,
        "mode": mode,
        "size_mib": size // MiB,
        "streams": streams,
        "phase": phase,
        "median": m,
        "reps": got,
    }


def _one_rep(
    bk: Backend, files: list[list[int]], size: int, src: mmap.mmap
) -> dict[str, PhaseResult]:
    """Write, then read cold, then re-read warm (in this order: dict order is kept);
    each with the device's (and a FUSE daemon's) request counts over the phase alone
    (a cold read's remount or ``drop_caches`` is not in them)."""
    out = {"write": _counted(bk, lambda: bk.write(files, size, src))}
    bk.make_cold()
    out["cold"] = _counted(bk, lambda: bk.read(files, size, src, False))
    out["warm"] = _counted(bk, lambda: bk.read(files, size, src, False))
    return out


def _counted(bk: Backend, phase: Callable[[], PhaseResult]) -> PhaseResult:
    before = bk.counters()
    res = phase()
    after = bk.counters()
    res.extra.update({k: float(after[k] - v) for k, v in before.items()})
    return res


def _medians(reps: list[dict[str, Any]]) -> dict[str, float]:
    keys = [k for k in reps[0] if isinstance(reps[0][k], int | float)]
    return {k: statistics.median(r[k] for r in reps) for k in keys}


def lookup_storm(root: Path, n: int, cold: Callable[[], None]) -> tuple[float, float]:
    """stat n names in a shuffled order, half of them missing: (ops/s, p99 µs)."""
    names = [str(root / f"blk{i:08x}.bin") for i in range(n)]
    order = list(range(n))
    random.Random(7).shuffle(order)
    cold()
    lat = []
    t0 = time.perf_counter()
    for i in order:
        t = time.perf_counter()
        try:
            os.stat(names[i])
        except FileNotFoundError:
            if i % 2 == 0:
                raise
        lat.append(time.perf_counter() - t)
    seconds = time.perf_counter() - t0
    lat.sort()
    return n / seconds, _percentile(lat, 99) * 1e6


def run_lookups(plan: Plan, bks: dict[str, Any], log: Log) -> list[dict[str, Any]]:
    """Cold storm (after drop_caches, kvfs also remounted) then a warm one right after
    (dentries cached), repetition by repetition, ext4 and kvfs interleaved."""
    names: list[str] = [n for n in ("ext4", "kvfs") if n in bks]
    reps: dict[tuple[str, str], list[dict[str, float]]] = {}
    for name in names:
        root = bks[name].root / "lookup"
        root.mkdir()
        for i in range(0, plan.lookup_names, 2):  # even names exist (empty files)
            os.close(os.open(root / f"blk{i:08x}.bin", os.O_WRONLY | os.O_CREAT, 0o644))
    for _ in range(plan.reps):
        for name in names:
            bk: FileBackend = bks[name]
            for kind, cold in (("cold", bk.make_cold), ("warm", lambda: None)):
                ops, p99 = lookup_storm(bk.root / "lookup", plan.lookup_names, cold)
                reps.setdefault((name, kind), []).append({"ops_per_s": ops, "p99_us": p99})
    rows = []
    for (name, kind), got in reps.items():
        med = _medians(got)
        rows.append(
            {"backend": name, "kind": kind, "names": plan.lookup_names, "median": med, "reps": got}
        )
        log(
            f"{name:5} lookup storm {kind:4} {med['ops_per_s']:9.0f} stat/s  "
            f"p99 {med['p99_us']:7.1f} us"
        )
    for name in names:
        shutil.rmtree(bks[name].root / "lookup")
    return rows


def ratios(rows: list[dict[str, Any]], lookups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kvfs over raw and over ext4 for every point: the median over repetitions of the
    paired ratio (repetition i of each backend ran back to back, under the same load)."""
    by = {
        (r["backend"], r["size_mib"], r["streams"], r["phase"]): r
        for r in rows
        if r.get("mode", "buffered") == "buffered"
    }
    out = []
    for (bk, size, streams, phase), r in sorted(by.items()):
        if bk != "kvfs":
            continue
        row: dict[str, Any] = {
            "size_mib": size,
            "streams": streams,
            "phase": phase,
            "kvfs_mbps": r["median"]["mbps"],
        }
        for other in ("raw", "ext4"):
            o = by.get((other, size, streams, phase))
            if o is not None:
                row[f"{other}_mbps"] = o["median"]["mbps"]
                row[f"kvfs_over_{other}"] = _paired(r["reps"], o["reps"], "mbps", "mbps")
        if phase == "write" and ("ext4", size, streams, phase) in by:
            o = by[("ext4", size, streams, phase)]
            row["kvfs_over_ext4_synced"] = _paired(r["reps"], o["reps"], "mbps", "write_sync_mbps")
        target = TARGETS.get((phase, streams)) if size == 32 else None
        if target is not None and "kvfs_over_raw" in row:
            row["target_vs_raw"] = target
            row["meets_target"] = row["kvfs_over_raw"] >= target
        out.append(row)
    lk = {(r["backend"], r["kind"]): r["reps"] for r in lookups}
    for kind in ("cold", "warm"):
        if ("kvfs", kind) in lk and ("ext4", kind) in lk:
            q = _paired(lk[("kvfs", kind)], lk[("ext4", kind)], "ops_per_s", "ops_per_s")
            out.append(
                {
                    "lookup_storm": kind,
                    "kvfs_over_ext4": q,
                    "target_vs_ext4": LOOKUP_TARGET,
                    "meets_target": q >= LOOKUP_TARGET,
                }
            )
    return out


def _paired(mine: list[dict[str, Any]], theirs: list[dict[str, Any]], k1: str, k2: str) -> float:
    return float(statistics.median(a[k1] / b[k2] for a, b in zip(mine, theirs, strict=True)))


def ceiling_ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (mode, size, streams, phase): kvfs over the binding ceiling (target
    ``CEILING_TARGET`` on every cell), both over raw, kvfs over ext4; cold reads at
    4+ streams also against ext4 (``COLD_VS_EXT4_TARGET``). Paired ratios: the
    median over repetitions of kvfs rep i / other rep i (run back to back)."""
    by = {(r["backend"], r["mode"], r["size_mib"], r["streams"], r["phase"]): r for r in rows}
    cells: list[dict[str, Any]] = []
    for (bk, mode, size, streams, phase), r in sorted(by.items()):
        ce = by.get(("ceiling", mode, size, streams, phase))
        if bk != "kvfs" or ce is None:
            continue
        cell: dict[str, Any] = {
            "mode": mode,
            "size_mib": size,
            "streams": streams,
            "phase": phase,
            "kvfs_mbps": r["median"]["mbps"],
            "ceiling_mbps": ce["median"]["mbps"],
            "kvfs_over_ceiling": _paired(r["reps"], ce["reps"], "mbps", "mbps"),
        }
        cell["meets_ceiling_target"] = cell["kvfs_over_ceiling"] >= CEILING_TARGET
        raw = by.get(("raw", "buffered", size, streams, phase))
        if raw is not None:
            cell["raw_mbps"] = raw["median"]["mbps"]
            cell["kvfs_over_raw"] = _paired(r["reps"], raw["reps"], "mbps", "mbps")
            cell["ceiling_over_raw"] = _paired(ce["reps"], raw["reps"], "mbps", "mbps")
        ext4 = by.get(("ext4", mode, size, streams, phase))
        if ext4 is not None:
            cell["ext4_mbps"] = ext4["median"]["mbps"]
            cell["kvfs_over_ext4"] = _paired(r["reps"], ext4["reps"], "mbps", "mbps")
            if phase == "cold" and streams >= 4:
                cell["meets_cold_vs_ext4_target"] = cell["kvfs_over_ext4"] >= COLD_VS_EXT4_TARGET
        for k in ("daemon_cpu_s_per_gib", "dev_read_kib_per_io", "dev_reads_per_fuse_read"):
            if k in r["median"]:
                cell[f"kvfs_{k}"] = r["median"][k]
                cell[f"ceiling_{k}"] = ce["median"].get(k)
        cells.append(cell)
    cold4 = [c for c in cells if "meets_cold_vs_ext4_target" in c]
    return {
        "ceiling_target": CEILING_TARGET,
        "cold_vs_ext4_target": COLD_VS_EXT4_TARGET,
        "cells": cells,
        "cells_meeting_ceiling_target": sum(c["meets_ceiling_target"] for c in cells),
        "cold_4plus_meeting_ext4_target": sum(c["meets_cold_vs_ext4_target"] for c in cold4),
        "cold_4plus_cells": len(cold4),
        "all_met": bool(cells)
        and all(c["meets_ceiling_target"] for c in cells)
        and all(c["meets_cold_vs_ext4_target"] for c in cold4),
    }


# ---------------------------------------------------------------- plot
def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in result["transfers"] if r.get("mode", "buffered") == "buffered"]
    sizes = sorted({r["size_mib"] for r in rows})
    streams = sorted({r["streams"] for r in rows})
    bks = [b for b in ("raw", "ext4", "ceiling", "kvfs") if any(r["backend"] == b for r in rows)]
    colors = {"raw": "#888888", "ext4": "#4C72B0", "ceiling": "#55A868", "kvfs": "#DD8452"}
    phases = ("write", "cold", "warm")
    fig, axes = plt.subplots(
        len(phases), len(sizes), figsize=(4 * len(sizes), 8), squeeze=False, sharey="row"
    )
    by = {
        (r["backend"], r["size_mib"], r["streams"], r["phase"]): r["median"]["mbps"] for r in rows
    }
    width = 0.8 / len(bks)
    for i, phase in enumerate(phases):
        for j, size in enumerate(sizes):
            ax = axes[i][j]
            for k, bk in enumerate(bks):
                xs = [s + (k - (len(bks) - 1) / 2) * width for s in range(len(streams))]
                ax.bar(
                    xs,
                    [by.get((bk, size, s, phase), 0) for s in streams],
                    width,
                    label=bk,
                    color=colors[bk],
                )
            ax.set_xticks(range(len(streams)), [f"{s} str" for s in streams])
            ax.set_title(f"{phase}, {size} MiB files", fontsize=9)
            if j == 0:
                ax.set_ylabel("MB/s (median)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        "kvfs vs raw O_DIRECT vs ext4 (loop devices, direct-io); " + result["meta"]["started"],
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- main
def _plan(args: argparse.Namespace) -> Plan:
    backends = args.backends
    if backends is None:
        backends = ("raw", "ext4", "ceiling", "kvfs") if args.ceiling else ("raw", "ext4", "kvfs")
    if args.quick:
        plan = Plan(1 * GiB, 256 * MiB, (MiB, 32 * MiB), (1, 4), 3, 4000, backends)
    else:
        plan = Plan(2 * GiB, 512 * MiB, (MiB, 8 * MiB, 32 * MiB), (1, 4, 16), 3, 10000, backends)
    overrides: dict[str, Any] = {}
    if args.ceiling:  # the transfer matrix in both app modes; no lookup storm
        overrides["modes"] = ("buffered", "direct")
        overrides["lookup_names"] = 0
    if args.modes:
        overrides["modes"] = tuple(args.modes.split(","))
    if args.sizes:
        overrides["sizes"] = tuple(int(s) * MiB for s in args.sizes.split(","))
    if args.streams:
        overrides["streams"] = tuple(int(s) for s in args.streams.split(","))
    if args.moved_mib:
        overrides["moved_bytes"] = args.moved_mib * MiB
    if args.reps:
        overrides["reps"] = args.reps
    if args.lookup_names is not None:
        overrides["lookup_names"] = args.lookup_names
    return Plan(**{**asdict(plan), **overrides})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/bench", help="directory for JSON + PNG")
    p.add_argument(
        "--quick", action="store_true", help="<1 minute run (1 and 32 MiB, 1 and 4 streams)"
    )
    p.add_argument(
        "--backends",
        type=lambda s: tuple(s.split(",")),
        help="raw,ext4,kvfs (default) and/or ceiling (tools/ceiling_fs.py)",
    )
    p.add_argument(
        "--ceiling",
        action="store_true",
        help="issue 11's binding ceiling: raw,ext4,ceiling,kvfs in both app modes, "
        "no lookup storm, into ceiling.json (the ceiling_ratios section)",
    )
    p.add_argument("--modes", help="app modes, comma separated: buffered (default), direct")
    p.add_argument("--sizes", help="file sizes in MiB, comma separated (override)")
    p.add_argument("--streams", help="stream counts, comma separated (override)")
    p.add_argument("--moved-mib", type=int, help="MiB moved per measurement (override)")
    p.add_argument("--reps", type=int, help="repetitions per measurement (>= 3)")
    p.add_argument("--lookup-names", type=int, help="names in the lookup storm (0 = skip)")
    p.add_argument("--workdir", default="/var/tmp", help="where the images go (host fs)")
    p.add_argument("--tag", default="", help="suffix for the output file names")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench: needs root (loop devices, mkfs, drop_caches)", file=sys.stderr)
        return 2
    plan = _plan(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "quick" if args.quick else "bench"
    stem = ("ceiling-quick" if args.quick else "ceiling") if args.ceiling else stem
    stem += f"-{args.tag}" if args.tag else ""
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    load_start = os.getloadavg()  # other jobs share these CPUs: read the ratios
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="kvfs-bench-", dir=args.workdir))
    try:
        with backends(plan, work) as bks:
            transfers = run_transfers(plan, bks, log)
            lookups = run_lookups(plan, bks, log) if plan.lookup_names else []
            kv, ce = bks.get("kvfs"), bks.get("ceiling")
            for daemon in (kv, ce):
                if daemon is not None:
                    daemon.unmount()
            peak = kv.peak_rss if kv is not None else 0
            ceiling_peak = ce.peak_rss if ce is not None else 0
    finally:
        if (work / "kvfs.log").exists():  # keep the daemon's log for a post-mortem
            shutil.copy(work / "kvfs.log", Path(args.workdir) / "kvfs-bench-last.log")
        shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {
        "meta": {
            "command": " ".join([".venv/bin/python", "tools/bench.py", *(argv or sys.argv[1:])]),
            "started": started,
            "seconds": time.monotonic() - t0,
            "host": platform.node(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "plan": asdict(plan),
            "kvfs_daemon_peak_rss_mib": peak / MiB,
        },
        "transfers": transfers,
        "lookups": lookups,
        "ratios": ratios(transfers, lookups),
    }
    if "ceiling" in plan.backends:
        result["meta"]["ceiling_daemon_peak_rss_mib"] = ceiling_peak / MiB
        result["ceiling_ratios"] = ceiling_ratios(transfers)
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    png = out_dir / f"{stem}.png"
    drew = not args.ceiling and plot(result, png)  # --ceiling: the JSON only
    log(f"wrote {out_dir / (stem + '.json')}" + (f" and {png}" if drew else ""))
    for r in result["ratios"]:
        log(json.dumps(r))
    if "ceiling_ratios" in result:
        for c in result["ceiling_ratios"]["cells"]:
            vs_ext4 = f"  kvfs/ext4 {c['kvfs_over_ext4']:.2f}" if "kvfs_over_ext4" in c else ""
            log(
                f"{c['mode']:8} {c['size_mib']:2} MiB x{c['streams']:<2} {c['phase']:5} "
                f"kvfs/ceiling {c['kvfs_over_ceiling']:.2f}{vs_ext4}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
