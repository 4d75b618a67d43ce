#!/usr/bin/env python3
"""The aware path as an ordinary user vs raw O_DIRECT vs ext4 (O_DIRECT app), paired.

Reproduce (root; loop devices, ext4, FUSE; ~10 min on the 2-core VM)::

    .venv/bin/python tools/aware_bench.py --backing /dev/shm --out docs/bench/aware-shm.json
    .venv/bin/python tools/aware_bench.py --backing /var/tmp --out docs/bench/aware-disk.json

Per backing directory, identical sparse images attached as loop devices with
``--direct-io=on``: one raw, one ext4 (``mkfs.ext4``, ``-o noatime``), one kvfs pool
(``--allow-other``; ``--members 2`` adds a pool on two more). Every phase runs the
same worker script in its own process, ``--streams`` threads moving ``--files`` files
of ``--size-mib``:

- **raw**: ``pwrite`` of a whole file at its slot of the O_DIRECT device, then
  ``fdatasync`` (durable on return, as a ``write_from``); cold reads ``preadv``;
- **ext4**: ``open(O_CREAT|O_TRUNC|O_DIRECT)``, one ``write``, ``fdatasync``,
  ``close``; reads ``open(O_DIRECT)``, ``preadv``;
- **ring**: ``kvfs.direct.write_from`` / ``read_into`` into ``kvfs.direct.aligned``
  memory, **as uid 65534** (it may not open the devices: the daemon's ring);
- **batch**: the same, in batches of 64 MiB per stream: ``write_many`` and
  ``read_many`` (on the ring one message of paths per batch: the daemon opens the
  files), as engines load a request's blocks (vLLM's jobs, SGLang's ``batch_get``);
- **fuse**: the same user's ``open/write/close`` and reads through the mount.

Reads are cold (``drop_caches``; kvfs remounted). ``--gil-hog`` runs a spinning
Python thread in every client process (all backends alike), as an engine's
scheduler loop keeps the GIL busy: each return from a system call may then wait
for the GIL. Repetitions interleave the
backends; each ratio is taken within a repetition and the median reported. The
kvfs daemon's CPU seconds per GiB moved (``/proc/PID/stat``, all its threads) are
recorded for each kvfs phase.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MiB = 1 << 20
NOBODY = 65534


# --------------------------------------------------------------------- worker
def worker(backend: str, target: str, op: str, size: int, streams: int, files: int) -> None:
    """One timed phase (in its own process); prints MB/s and the client's stats."""
    import kvfs.direct as direct

    if backend in ("ring", "batch", "fuse"):
        os.chdir(target)  # as root: the user may not walk the bench's directories
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        target = "."
    src = direct.aligned(size)
    src[:size] = random.Random(size).randbytes(size)  # the same in the read phase
    fd = os.open(target, os.O_RDWR | os.O_DIRECT) if backend == "raw" else -1
    errors: list[BaseException] = []

    def batches(i: int) -> None:
        """``batch``: this stream's files in batches of 64 MiB: ``write_many``, and
        ``read_many`` (on the ring: one message of paths per batch)."""
        per = max(1, (64 << 20) // size)
        bufs = [direct.aligned(size) for _ in range(per)]
        mine = list(range(i, files, streams))
        for k in range(0, len(mine), per):
            names = [os.path.join(target, f"f{j}") for j in mine[k : k + per]]
            if op == "write":
                direct.write_many([(name, src) for name in names])
                continue
            got = direct.read_many(list(zip(names, bufs, strict=False)))
            for n, b in zip(got, bufs, strict=False):
                if n != size or b[-4096:] != src[-4096:]:
                    raise OSError("short or wrong batch read")

    def one(i: int) -> None:
        if backend == "batch":
            batches(i)
            return
        buf = direct.aligned(size)
        for j in range(i, files, streams):
            name = os.path.join(target, f"f{j}")
            if backend == "raw":
                if op == "write":
                    os.pwrite(fd, src, j * size)
                    os.fdatasync(fd)
                elif os.preadv(fd, [buf], j * size) != size:
                    raise OSError("short raw read")
            elif backend == "ext4":
                if op == "write":
                    f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
                    os.write(f, src)
                    os.fdatasync(f)
                else:
                    f = os.open(name, os.O_RDONLY | os.O_DIRECT)
                    if os.preadv(f, [buf], 0) != size:
                        raise OSError("short ext4 read")
                os.close(f)
            elif backend == "ring":
                if op == "write":
                    direct.write_from(name, src)
                elif direct.read_into(name, buf) != size or buf[-4096:] != src[-4096:]:
                    raise OSError("short or wrong ring read")
            elif op == "write":
                with open(name, "wb") as fw:
                    fw.write(src)
            else:
                with open(name, "rb", buffering=0) as fr:
                    if fr.readinto(buf) != size:
                        raise OSError("short fuse read")

    def guarded(i: int) -> None:
        try:
            one(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(streams)]
    spinning = [bool(os.environ.get("AWARE_BENCH_GIL_HOG"))]

    def hog() -> None:  # an engine's busy Python thread (its scheduler loop)
        x = 0
        while spinning[0]:
            x += 1

    hogs = [threading.Thread(target=hog)] if spinning[0] else []
    for h in hogs:
        h.start()
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    seconds = time.perf_counter() - t
    spinning[0] = False
    for h in hogs:
        h.join()
    if errors:
        raise errors[0]
    print(json.dumps({"MBps": files * size / seconds / 1e6, "stats": direct.stats()}))


# --------------------------------------------------------------------- driver
def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def phase(backend: str, target: str, op: str, size: int, streams: int, files: int) -> dict:
    cmd = [sys.executable, __file__, "worker", backend, target, op]
    cmd += [str(size), str(streams), str(files)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(f"{backend} {op} failed: {out.stderr.strip()[-2000:]}")
    result: dict = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backing", default="/dev/shm", help="directory of the image files")
    p.add_argument("--sizes", default="2,32", help="file sizes, MiB")
    p.add_argument("--streams", default="1,4")
    p.add_argument("--bytes-mib", type=int, default=1024, help="moved per phase")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--members", type=int, default=1, help="kvfs pool members (1 or 2)")
    p.add_argument("--backends", default="raw,ext4,ring,batch,fuse")
    p.add_argument(
        "--gil-hog",
        action="store_true",
        help="a spinning Python thread in every client process (as an engine's loop)",
    )
    p.add_argument("--out")
    args = p.parse_args()
    if args.gil_hog:
        os.environ["AWARE_BENCH_GIL_HOG"] = "1"
    from kvfs.testing import harness

    backends = args.backends.split(",")
    image = 3 << 30
    work = Path(args.backing) / f"kvfs-aware-bench-{os.getpid()}"
    work.mkdir()
    rows: list[dict] = []
    try:
        with ExitStack() as stack:

            def loop(name: str) -> str:
                img = harness.make_image(work / name, image)
                os.chmod(img, 0o600)
                return stack.enter_context(harness.loop_device(img, direct_io=True))

            raw = loop("raw.img")
            ext4dev = loop("ext4.img")
            kvdevs = [loop(f"kv{i}.img") for i in range(args.members)]
            subprocess.run(["mkfs.ext4", "-q", "-F", ext4dev], check=True)
            ext4 = work / "ext4"
            ext4.mkdir()
            subprocess.run(["mount", "-o", "noatime", ext4dev, str(ext4)], check=True)
            stack.callback(subprocess.run, ["umount", str(ext4)], check=False)
            mnt = work / "mnt"
            log = work / "kvfs.log"
            fmt = ("--format", "--force", "--meta-size", "64M", "--allow-other")
            for rep in range(args.reps):
                for size_mib in map(int, args.sizes.split(",")):
                    size = size_mib * MiB
                    files = max(args.bytes_mib // size_mib, 4)
                    for k in map(int, args.streams.split(",")):
                        row: dict = {"rep": rep, "size_mib": size_mib, "streams": k}
                        for b in backends:
                            if b == "raw":
                                row["raw write"] = phase("raw", raw, "write", size, k, files)
                                drop_caches()
                                row["raw read"] = phase("raw", raw, "read", size, k, files)
                            elif b == "ext4":
                                for f in ext4.glob("f*"):
                                    f.unlink()
                                row["ext4 write"] = phase(
                                    "ext4", str(ext4), "write", size, k, files
                                )
                                drop_caches()
                                row["ext4 read"] = phase("ext4", str(ext4), "read", size, k, files)
                            else:
                                with harness.mounted(mnt, kvdevs, *fmt, log_file=log) as proc:
                                    os.chmod(mnt, 0o777)
                                    c = cpu_seconds(proc.pid)
                                    row[f"{b} write"] = phase(b, str(mnt), "write", size, k, files)
                                    row[f"{b} write"]["daemon_cpu_s"] = cpu_seconds(proc.pid) - c
                                drop_caches()
                                with harness.mounted(
                                    mnt, kvdevs, "--allow-other", log_file=log
                                ) as proc:
                                    c = cpu_seconds(proc.pid)
                                    row[f"{b} read"] = phase(b, str(mnt), "read", size, k, files)
                                    row[f"{b} read"]["daemon_cpu_s"] = cpu_seconds(proc.pid) - c
                            for op in ("write", "read"):
                                r = row.get(f"{b} {op}")
                                if r is not None and "daemon_cpu_s" in r:
                                    r["cpu_s_per_gib"] = r["daemon_cpu_s"] / (
                                        files * size / (1 << 30)
                                    )
                        rows.append(row)
                        short = {n: round(v["MBps"]) for n, v in row.items() if isinstance(v, dict)}
                        print(rep, size_mib, k, short, flush=True)
    finally:
        harness.unmount(work / "mnt")
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(rows, backends)
    for key, v in summary.items():
        print(f"{key}: {v:.3g}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        doc = {"args": vars(args), "runs": rows, "medians": summary}
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


def summarize(rows: list[dict], backends: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    cells = sorted({(r["size_mib"], r["streams"]) for r in rows})
    med: Callable[[list[float]], float] = statistics.median
    for size_mib, k in cells:
        mine = [r for r in rows if r["size_mib"] == size_mib and r["streams"] == k]
        for op in ("write", "read"):
            cell = f"{size_mib} MiB x{k} {op}"
            for b in backends:
                if f"{b} {op}" in mine[0]:
                    out[f"{cell} {b} MB/s"] = med([r[f"{b} {op}"]["MBps"] for r in mine])
            for b in ("ring", "batch", "fuse"):
                if f"{b} {op}" not in mine[0]:
                    continue
                for ref in ("raw", "ext4"):
                    if f"{ref} {op}" in mine[0]:
                        ratios = [r[f"{b} {op}"]["MBps"] / r[f"{ref} {op}"]["MBps"] for r in mine]
                        out[f"{cell} {b}/{ref}"] = med(ratios)
                out[f"{cell} {b} daemon cpu-s/GiB"] = med(
                    [r[f"{b} {op}"]["cpu_s_per_gib"] for r in mine]
                )
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        b, tgt, o, sz, k, n = sys.argv[2:8]
        worker(b, tgt, o, int(sz), int(k), int(n))
    else:
        sys.exit(main())
