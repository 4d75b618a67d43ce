#!/usr/bin/env python3
"""Metadata operations, kvfs vs ext4, on identical loop devices, in one interleaved run.

Reproduce (root; loop devices and FUSE; ~3-5 min for the default N = 10^5 on the
2-core VM)::

    /work/main/.venv/bin/python tools/metaops.py --files 100000 --reps 3 --out /tmp/metaops.json

Two images of ``--image-gib`` GiB (sparse, on the same host filesystem), each on a
loop device with ``--direct-io=on``: one gets ``mkfs.ext4`` and a real ``mount``
(``noatime``), the other ``kvfs format`` and a foreground ``kvfs mount`` started by
this tool. Per repetition, the backends take turns (their order alternates) through
the same phases, each timed on the wall clock:

- ``create``: N empty files in directory ``a`` (``open(O_CREAT|O_WRONLY)``, ``close``;
  empty, so the pool needs no unit per file).
- ``ls_cold``: ``ls -l a > /dev/null`` after ``drop_caches`` (kvfs: the kernel forgets
  its dentries, so the listing starts from READDIRPLUS); ``ls_warm``: the same again;
  ``ls_wc``: ``ls -l a | wc -l`` (checked to print N + 1 lines).
- ``stat_missing``: ``stat`` of N distinct names that do not exist in ``a``: on kvfs
  one LOOKUP round trip each, so the per-request floor of the FUSE binding in the
  same run as the operations that need several (rename: 3, unlink: 2-3).
- ``statvfs`` and ``df``: median of ``--calls`` ``os.statvfs`` calls (µs), and one
  ``df`` process; ``stats`` (kvfs only): median time of the ``user.kvfs.stats``
  ``getxattr`` that ``kvfs stats`` reads (µs). Taken while the N files exist.
- ``rename_same``: ``a/fI`` -> ``a/gI`` for every file; ``rename_cross``: ``a/gI`` ->
  ``b/gI``; ``unlink``: every ``b/gI``.

The report gives per phase the median over repetitions, µs per file, and the ratio
kvfs/ext4 of the medians (and the median of the per-repetition paired ratios, same
load window). ``--prefill M`` first fills both file systems with M more files in
directories of 1000 (kvfs: built offline, as ``tools/mounttime.py`` does, on a
sparse image of one unit per file; ext4: created through the mount, with ``-N``
inodes), so the measured operations run at M + N files. ``--count-requests`` runs the
kvfs daemon with its FUSE handlers wrapped to count requests per opcode (a few µs per
request: use it to see the request mix, not for the timings) and reports requests
per file per phase. The kvfs daemon's CPU time per file of each per-file phase
(``/proc/PID/stat``, user + system) is reported too: it moves far less with other
load than wall time. The machine is shared: quote medians and paired ratios.

Options: ``--files N`` (100000), ``--reps R`` (3), ``--calls K`` (200),
``--image-gib G`` (8), ``--prefill M`` (0), ``--count-requests``, ``--work DIR``
(a fresh temp dir under /tmp/kv by default), ``--out FILE`` (JSON), ``--keep``.

``--in-process N [N ...]`` (no root, no mount) times instead what ``df`` and ``kvfs
stats`` cost inside the daemon: ``Store.statistics()``, ``Operations.statfs`` and
``Operations.stats_json()`` over a memory pool whose index holds N files (made with
``Namespace.make``, directories of 1000), and the allocator's statistics of a
245 TB device of 1 MiB units (empty; after one allocation; full and fragmented)::

    /work/main/.venv/bin/python tools/metaops.py --in-process 1000 100000 1000000

``--handlers N [N ...]`` (no root, no mount) times the FUSE handlers themselves
(``getattr``, a LOOKUP miss, rename within and across directories, unlink) called
directly, per operation, with N files in the directory: the daemon's own CPU per
request, without the kernel round trip and pyfuse3's dispatch::

    /work/main/.venv/bin/python tools/metaops.py --handlers 20000 100000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvfs.testing.harness import kvfs_command, loop_device, make_image, stop, unmount, wait_mounted

GiB = 1 << 30
STATS_XATTR = "user.kvfs.stats"
PHASES = (
    "create",
    "ls_cold",
    "ls_warm",
    "ls_wc",
    "stat_missing",
    "statvfs_us",
    "df",
    "stats_us",
    "rename_same",
    "rename_cross",
    "unlink",
)
PER_FILE = {
    "create",
    "ls_cold",
    "ls_warm",
    "ls_wc",
    "stat_missing",
    "rename_same",
    "rename_cross",
    "unlink",
}
PER_DIR = 1000


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def loop_dev(image: Path) -> contextlib.AbstractContextManager[str]:
    return loop_device(image, direct_io=True)


# ---------------------------------------------------------------- request counting
def counting_daemon(argv: list[str]) -> int:
    """``kvfs`` with every FUSE handler wrapped to count calls per opcode (and the
    entries of batched FORGETs); SIGUSR1 writes the counts to $KVFS_COUNTS."""
    import functools

    from kvfs import cli
    from kvfs.fuse import ops as fs

    counts: dict[str, int] = {}
    out = os.environ["KVFS_COUNTS"]

    def wrap(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            if name == "forget":
                counts["forget_entries"] = counts.get("forget_entries", 0) + len(args[0])
            return await fn(self, *args, **kwargs)

        return counted

    import pyfuse3

    for name, fn in vars(fs.Operations).items():
        if name in vars(pyfuse3.Operations) and callable(fn) and not name.startswith("_"):
            setattr(fs.Operations, name, wrap(name, fn))
    seq = [0]

    def dump(signum: int, frame: Any) -> None:
        seq[0] += 1
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"seq": seq[0], "counts": counts}, f)
        os.replace(tmp, out)

    signal.signal(signal.SIGUSR1, dump)
    return cli.main(argv)


class Kvfs:
    """A foreground kvfs daemon on ``dev`` mounted at ``root``."""

    name = "kvfs"

    def __init__(self, root: Path, dev: str, log_file: Path, counts: Path | None) -> None:
        self.root, self.dev, self.log_file, self.counts_file = root, dev, log_file, counts
        self.proc: subprocess.Popen[bytes] | None = None
        self._seq = 0

    def mount(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        args = ["mount", "--foreground", str(self.root), self.dev, "--log-file", str(self.log_file)]
        env = dict(os.environ)
        if self.counts_file is not None:
            env["KVFS_COUNTS"] = str(self.counts_file)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--count-daemon", *args]
        else:
            cmd = [*kvfs_command(), *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        wait_mounted(self.proc, self.root, 600.0)

    def unmount(self) -> None:
        if self.proc is not None:
            code = stop(self.proc, self.root, timeout=600.0)
            self.proc = None
            if code != 0:
                raise RuntimeError(f"kvfs exited with {code}; see {self.log_file}")

    def cpu(self) -> float | None:
        """Seconds of CPU the daemon process has used so far (user + system, every
        thread; /proc/PID/stat): far less sensitive to other load than wall time."""
        if self.proc is None:
            return None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def counts(self) -> dict[str, int]:
        """The daemon's request counts so far (empty without --count-requests)."""
        if self.counts_file is None or self.proc is None:
            return {}
        self._seq += 1
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                data = json.loads(self.counts_file.read_text())
                if data["seq"] >= self._seq:
                    return dict(data["counts"])
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        raise RuntimeError("the counting daemon did not answer SIGUSR1")


class Ext4:
    name = "ext4"

    def __init__(self, root: Path) -> None:
        self.root = root

    def counts(self) -> dict[str, int]:
        return {}

    def cpu(self) -> float | None:
        return None  # in the kernel: no process to measure


# ---------------------------------------------------------------- phases
def timed(fn: Any, *args: Any) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def create(d: Path, n: int, prefix: str) -> None:
    flags = os.O_CREAT | os.O_WRONLY | os.O_EXCL
    for i in range(n):
        os.close(os.open(d / f"{prefix}{i:08d}", flags, 0o644))


def stat_missing(d: Path, n: int, prefix: str) -> None:
    """``stat`` of ``n`` distinct names that do not exist: on kvfs one LOOKUP round
    trip each (a negative entry, never asked again), the binding's floor per request."""
    for i in range(n):
        try:
            os.stat(d / f"{prefix}{i:08d}")
        except FileNotFoundError:
            continue
        raise RuntimeError(f"{d}/{prefix}{i:08d} exists")


def rename_all(src: Path, sp: str, dst: Path, dp: str, n: int) -> None:
    for i in range(n):
        os.rename(src / f"{sp}{i:08d}", dst / f"{dp}{i:08d}")


def unlink_all(d: Path, prefix: str, n: int) -> None:
    for i in range(n):
        os.unlink(d / f"{prefix}{i:08d}")


def ls_l(d: Path) -> None:
    subprocess.run(["ls", "-l", str(d)], check=True, stdout=subprocess.DEVNULL)


def ls_wc(d: Path, n: int) -> None:
    out = subprocess.run(f"ls -l '{d}' | wc -l", shell=True, check=True, capture_output=True)
    lines = int(out.stdout)
    if lines != n + 1:
        raise RuntimeError(f"ls -l {d} | wc -l printed {lines}, expected {n + 1}")


def median_us(fn: Any, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def one_rep(fs: Any, n: int, calls: int, rep: int) -> tuple[dict[str, float], dict[str, Any]]:
    """Every phase once on ``fs``; returns seconds (µs for *_us) and request deltas."""
    root: Path = fs.root
    a, b = root / f"a{rep}", root / f"b{rep}"
    a.mkdir()
    b.mkdir()
    res: dict[str, float] = {}
    reqs: dict[str, Any] = {}

    def phase(name: str, fn: Any, *args: Any) -> None:
        before = fs.counts()
        cpu = fs.cpu()
        res[name] = timed(fn, *args)
        if cpu is not None and name in PER_FILE:
            res[f"{name}_cpu_us"] = (fs.cpu() - cpu) / n * 1e6
        after = fs.counts()
        if after:
            reqs[name] = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k)}

    phase("create", create, a, n, "f")
    drop_caches()
    phase("ls_cold", ls_l, a)
    phase("ls_warm", ls_l, a)
    phase("ls_wc", ls_wc, a, n)
    phase("stat_missing", stat_missing, a, n, "m")
    res["statvfs_us"] = median_us(lambda: os.statvfs(root), calls)
    res["df"] = timed(_df, ["df", str(root)], {"stdout": subprocess.DEVNULL})
    if fs.name == "kvfs":
        res["stats_us"] = median_us(lambda: os.getxattr(root, STATS_XATTR), calls)
    phase("rename_same", rename_all, a, "f", a, "g", n)
    phase("rename_cross", rename_all, a, "g", b, "g", n)
    phase("unlink", unlink_all, b, "g", n)
    a.rmdir()
    b.rmdir()
    return res, reqs


def _df(cmd: list[str], kw: dict[str, Any]) -> None:
    subprocess.run(cmd, check=True, **kw)


# ---------------------------------------------------------------- setup
def prefill_ext4(root: Path, m: int) -> None:
    for start in range(0, m, PER_DIR):
        d = root / f"pre{start // PER_DIR:05d}"
        d.mkdir()
        create(d, min(PER_DIR, m - start), "chunk-")


@contextmanager
def backends(args: argparse.Namespace, work: Path) -> Iterator[list[Any]]:
    with ExitStack() as stack:
        size = args.image_gib * GiB
        ext4_img = make_image(work / "ext4.img", size)
        ext4_dev = stack.enter_context(loop_dev(ext4_img))
        inodes = max(args.files + args.prefill + args.prefill // PER_DIR + 1024, 1 << 16)
        _run("mkfs.ext4", "-q", "-F", "-N", str(inodes), "-E", "nodiscard", ext4_dev)
        ext4_root = work / "ext4"
        ext4_root.mkdir()
        _run("mount", "-o", "noatime", ext4_dev, str(ext4_root))
        stack.callback(subprocess.run, ["umount", str(ext4_root)], capture_output=True)
        if args.prefill:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import mounttime  # one unit per file, 60% full

            from kvfs.devices.pool import format_pool

            def roomy(paths: list[str], *, meta_size: int) -> None:
                # mounttime sizes the metadata area for its own files only; the N
                # created through the mount need room too (issue 10: it does not grow)
                format_pool(paths, meta_size=3 * meta_size)

            setattr(mounttime, "format_pool", roomy)  # noqa: B010 - not an export
            mounttime.build(work / "kvfs.img", args.prefill)
            kvfs_dev = stack.enter_context(loop_dev(work / "kvfs.img"))
            print(f"prefilling ext4 with {args.prefill} files", file=sys.stderr)
            prefill_ext4(ext4_root, args.prefill)
        else:
            kvfs_dev = stack.enter_context(loop_dev(make_image(work / "kvfs.img", size)))
            # room in the metadata area for N empty files, as ext4 gets -N inodes (the
            # default area counts one file per data unit; more files are metadata
            # pressure, which evicts)
            meta = max(64 << 20, args.files * 1024)
            _run(*kvfs_command(), "format", "--force", "--meta-size", str(meta), kvfs_dev)
        counts = work / "counts.json" if args.count_requests else None
        kv = Kvfs(work / "kvfs", kvfs_dev, work / "kvfs.log", counts)
        stack.callback(unmount, work / "kvfs")
        stack.callback(kv.unmount)
        kv.mount()
        yield [Ext4(ext4_root), kv]


# ---------------------------------------------------------------- report
def summarise(reps: dict[str, list[dict[str, float]]], n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in PHASES:
        row: dict[str, Any] = {}
        for name, runs in reps.items():
            vals = [r[phase] for r in runs if phase in r]
            if vals:
                row[name] = statistics.median(vals)
                if phase in PER_FILE:
                    row[f"{name}_us_per_file"] = row[name] / n * 1e6
        if "kvfs" in row and "ext4" in row and row["ext4"] > 0:
            row["ratio"] = row["kvfs"] / row["ext4"]
            pairs = [
                k[phase] / e[phase]
                for k, e in zip(reps["kvfs"], reps["ext4"], strict=True)
                if e[phase] > 0
            ]
            row["paired_ratio"] = statistics.median(pairs)
        out[phase] = row
    cpu = {
        phase: statistics.median(r[f"{phase}_cpu_us"] for r in reps.get("kvfs", []))
        for phase in PHASES
        if reps.get("kvfs") and all(f"{phase}_cpu_us" in r for r in reps["kvfs"])
    }
    if cpu:
        out["kvfs_daemon_cpu_us_per_file"] = cpu
    return out


def per_file_requests(reqs: list[dict[str, Any]], n: int) -> dict[str, dict[str, float]]:
    """Median over repetitions of requests per file, per phase and opcode."""
    out: dict[str, dict[str, float]] = {}
    for phase in PHASES:
        ops = sorted({op for r in reqs for op in r.get(phase, {})})
        if ops:
            out[phase] = {
                op: round(statistics.median(r.get(phase, {}).get(op, 0) for r in reqs) / n, 3)
                for op in ops
            }
    return out


def print_table(summary: dict[str, Any], requests: dict[str, Any]) -> None:
    print(f"{'phase':<14}{'ext4':>12}{'kvfs':>12}{'kvfs/ext4':>11}{'paired':>9}  unit")
    for phase, row in summary.items():
        if phase == "kvfs_daemon_cpu_us_per_file":
            continue
        unit = "µs" if phase.endswith("_us") else "s"
        e, k = row.get("ext4"), row.get("kvfs")
        print(
            f"{phase:<14}{'' if e is None else f'{e:.4g}':>12}{'' if k is None else f'{k:.4g}':>12}"
            f"{row.get('ratio', float('nan')):>11.2f}{row.get('paired_ratio', float('nan')):>9.2f}"
            f"  {unit}"
        )
    cpu = summary.get("kvfs_daemon_cpu_us_per_file", {})
    if cpu:
        print("kvfs daemon CPU per file (µs): " + ", ".join(f"{k} {v:.0f}" for k, v in cpu.items()))
    for phase, ops in requests.items():
        mix = ", ".join(f"{op} {v:g}" for op, v in ops.items())
        print(f"requests per file, {phase}: {mix}")


def in_process(counts: list[int]) -> None:
    """Daemon-side cost of statistics at each file count, and of the allocator's."""
    import functools
    import random
    import stat
    import timeit

    import trio

    from kvfs.devices import pool as pool_mod
    from kvfs.devices.alloc import Allocator
    from kvfs.devices.device import Device
    from kvfs.devices.pool import Pool
    from kvfs.format import geometry
    from kvfs.fuse.ops import Operations
    from kvfs.index.namespace import ROOT_INO
    from kvfs.store.facade import Store, StoreConfig
    from kvfs.testing.devices import MemoryDevice

    for n in counts:
        devs: list[Device] = [MemoryDevice(64 << 20, "mem0")]
        sbs = geometry.new_pool(devs, 64 << 10, 1 << 20, "metaops")
        pool_mod._write_empty_pool(devs, sbs)
        store = Store(Pool(devs, sbs), StoreConfig(cache_bytes=1 << 20))
        store.load()
        store.ns._log = lambda ops: None  # no journal: only the index is filled
        d = ROOT_INO
        for i in range(n):
            if i % PER_DIR == 0:
                d = store.ns.make(ROOT_INO, b"d%d" % i, stat.S_IFDIR | 0o755, 0, 0).ino
            store.ns.make(d, b"f%d" % i, stat.S_IFREG | 0o644, 0, 0)
        ops = Operations(store)
        k = 200
        st = timeit.timeit(store.statistics, number=k) / k * 1e6
        sj = timeit.timeit(ops.stats_json, number=k) / k * 1e6
        sf = timeit.timeit(functools.partial(trio.run, ops.statfs, None), number=k) / k * 1e6
        base = timeit.timeit(lambda: trio.run(trio.sleep, 0), number=k) / k * 1e6
        print(
            f"{n} files: statistics {st:.1f} µs, stats_json {sj:.1f} µs, "
            f"statfs {sf - base:.1f} µs (trio.run itself {base:.0f} µs subtracted)"
        )
    units = 245 * 10**12 // (1 << 20)
    alloc = Allocator([units])
    for label, change in (
        ("empty", lambda: None),
        ("unchanged", lambda: None),
        ("after one allocation", lambda: alloc.allocate(32, 0)),
    ):
        change()
        t = time.perf_counter()
        alloc.statistics()
        print(f"allocator, 245 TB, {label}: {(time.perf_counter() - t) * 1e3:.2f} ms")
    alloc = Allocator([units])
    alloc.mark_used(0, 0, units)
    rng = random.Random(1)
    for _ in range(20000):
        u = rng.randrange(units)
        if alloc.is_used(0, u):
            alloc.free(0, u)
    t = time.perf_counter()
    alloc.statistics()
    ms = (time.perf_counter() - t) * 1e3
    print(f"allocator, 245 TB full, 2x10^4 holes, every chunk changed: {ms:.1f} ms")
    t = time.perf_counter()
    old = [len(r) for r in alloc._maps[0].split(b"\x01") if r]
    print(
        f"(a whole-map split, as before: {(time.perf_counter() - t) * 1e3:.0f} ms, {len(old)} runs)"
    )


def handlers(counts: list[int], rounds: int = 3) -> None:
    """Daemon CPU of the handlers alone (no kernel, no pyfuse3 loop): ``Operations``
    called directly on a memory pool whose directory ``a`` holds N files (made one
    by one through ``mknod``, as the mount would), each phase once per file; best
    of ``rounds`` runs (the machine is shared). The journal queues what they log."""
    import stat

    import trio

    from kvfs.devices import pool as pool_mod
    from kvfs.devices.device import Device
    from kvfs.devices.pool import Pool
    from kvfs.format import geometry
    from kvfs.fuse.ops import Operations
    from kvfs.index.namespace import ROOT_INO
    from kvfs.store.facade import Store, StoreConfig
    from kvfs.testing.devices import MemoryDevice

    class Ctx:
        uid = gid = pid = 0
        umask = 0o022

    async def one(n: int) -> dict[str, float]:
        meta = max(64 << 20, n * 1024)  # room for N empty files, as the mount test has
        devs: list[Device] = [MemoryDevice(4 * meta + (64 << 20), "mem0")]
        sbs = geometry.new_pool(devs, 1 << 20, meta, "handlers")
        pool_mod._write_empty_pool(devs, sbs)
        store = Store(Pool(devs, sbs), StoreConfig(cache_bytes=1 << 20))
        store.load()
        ops, ctx = Operations(store), cast(Any, Ctx())  # the fields handlers read
        a = (await ops.mkdir(ROOT_INO, b"a", 0o755, ctx)).st_ino
        b = (await ops.mkdir(ROOT_INO, b"b", 0o755, ctx)).st_ino
        for i in range(n):
            await ops.mknod(a, b"f%08d" % i, stat.S_IFREG | 0o644, 0, ctx)
        out: dict[str, float] = {}
        for name, call in (
            ("getattr", lambda i: ops.getattr(a, ctx)),
            ("lookup_miss", lambda i: ops.lookup(a, b"g%08d" % i, ctx)),
            ("rename_same", lambda i: ops.rename(a, b"f%08d" % i, a, b"g%08d" % i, 0, ctx)),
            ("rename_cross", lambda i: ops.rename(a, b"g%08d" % i, b, b"g%08d" % i, 0, ctx)),
            ("unlink", lambda i: ops.unlink(b, b"g%08d" % i, ctx)),
        ):
            t = time.perf_counter()
            for i in range(n):
                await call(i)
            out[name] = (time.perf_counter() - t) / n * 1e6
        store.pool.close()
        return out

    for n in counts:
        runs = [trio.run(one, n) for _ in range(rounds)]
        best = {k: min(r[k] for r in runs) for k in runs[0]}
        print(f"{n} files: " + ", ".join(f"{k} {v:.1f} µs" for k, v in best.items()))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--handlers":
        handlers([int(a) for a in sys.argv[2:]] or [20_000, 100_000])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--count-daemon":
        return counting_daemon(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "--in-process":
        in_process([int(a) for a in sys.argv[2:]] or [1000, 100_000, 1_000_000])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--image-gib", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--count-requests", action="store_true")
    ap.add_argument("--work", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("metaops: needs root (loop devices, mount, drop_caches)", file=sys.stderr)
        return 2
    base = Path("/tmp/kv")
    base.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="metaops-", dir=base))
    work.mkdir(parents=True, exist_ok=True)
    reps: dict[str, list[dict[str, float]]] = {"ext4": [], "kvfs": []}
    reqs: list[dict[str, Any]] = []
    load = [os.getloadavg()[0]]
    try:
        with backends(args, work) as fss:
            for rep in range(args.reps):
                for fs in fss if rep % 2 == 0 else fss[::-1]:
                    res, rq = one_rep(fs, args.files, args.calls, rep)
                    reps[fs.name].append(res)
                    if rq:
                        reqs.append(rq)
                    print(f"rep {rep} {fs.name}: {json.dumps(res)}", file=sys.stderr)
            load.append(os.getloadavg()[0])
    finally:
        if not args.keep:
            for img in ("ext4.img", "kvfs.img"):
                (work / img).unlink(missing_ok=True)
    summary = summarise(reps, args.files)
    requests = per_file_requests(reqs, args.files)
    print_table(summary, requests)
    result = {
        "command": " ".join(sys.argv),
        "files": args.files,
        "prefill": args.prefill,
        "reps": reps,
        "summary": summary,
        "requests_per_file": requests,
        "requests": reqs,
        "load_before_after": load,
        "kernel": os.uname().release,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
