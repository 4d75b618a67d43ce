"""Writers against a full pool: what the eviction headroom costs and buys.

Formats a pool on an image file (``--dir``, /dev/shm by default, so the device is
not the limit), mounts it with each watermark setting in turn, and has ``--writers``
threads store ``--file-size`` files (open, write, close: an engine's store) until
``--passes`` times the pool has been written. For each setting it reports the
store rate, the share of stores that found the pool full and waited for eviction
to make room (``room_waits``), their median and 99th-percentile latency, and the
pool's mean fill once it was first full (sampled with statvfs every 20 ms): the
share of the pool that holds chunks, which is what the hit rate sees.

    .venv/bin/python tools/headroom_bench.py --pool 2G --reps 3 \\
        --settings default 0.97/0.94 0.99/0.98 0.995/0.99 [--json]

Settings run interleaved (rep 1 of each, then rep 2, ...): medians of paired runs
on a noisy machine. ``default`` mounts with no watermark options.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfs.common.sizes import parse_size
from kvfs.testing.harness import make_image, mounted

META = 64 << 20


def run_one(
    setting: str, pool: int, file_size: int, writers: int, passes: float, where: str
) -> dict[str, object]:
    extra: list[str] = []
    if setting != "default":
        high, low = setting.split("/")
        extra = ["--high-watermark", high, "--low-watermark", low]
    with tempfile.TemporaryDirectory(prefix="kvheadroom-", dir=where) as tmp:
        img = make_image(Path(tmp) / "dev.img", (1 << 20) + META + pool)
        mnt = Path(tmp) / "mnt"
        with mounted(
            mnt,
            [img],
            "--format",
            "--meta-size",
            str(META),
            *extra,
            log_file=Path(tmp) / "kvfs.log",
        ):
            root = mnt / "kv"
            root.mkdir()
            files = int(passes * pool // file_size)
            payload = os.urandom(file_size)
            lat: list[float] = []
            errors: list[str] = []
            fills: list[float] = []
            full_at: list[int] = []
            counter = iter(range(files))
            lock = threading.Lock()
            done = threading.Event()

            def writer() -> None:
                while True:
                    with lock:
                        i = next(counter, None)
                    if i is None:
                        return
                    t0 = time.perf_counter()
                    try:
                        fd = os.open(root / f"c{i:08d}", os.O_WRONLY | os.O_CREAT, 0o644)
                        try:
                            os.write(fd, payload)
                        finally:
                            os.close(fd)
                    except OSError as e:
                        errors.append(str(e))
                        continue
                    lat.append(time.perf_counter() - t0)

            def sampler() -> None:
                while not done.wait(0.02):
                    st = os.statvfs(mnt)
                    fill = 1 - st.f_bfree / st.f_blocks
                    if not full_at and len(lat) * file_size >= pool:
                        full_at.append(len(fills))
                    fills.append(fill)

            probe = threading.Thread(target=sampler)
            probe.start()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(writers) as executor:
                for future in [executor.submit(writer) for _ in range(writers)]:
                    future.result()
            seconds = time.perf_counter() - t0
            done.set()
            probe.join()
            stats = json.loads(os.getxattr(mnt, "user.kvfs.stats"))["store"]
    steady = fills[full_at[0] :] if full_at else []
    lat.sort()
    return {
        "setting": setting,
        "stores": len(lat),
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
        "gb_per_s": round(len(lat) * file_size / seconds / 1e9, 3),
        "room_wait_share": round(stats["room_waits"] / max(stats["writes"], 1), 4),
        "room_waits": stats["room_waits"],
        "room_wait_seconds": stats["room_wait_seconds"],
        "p50_ms": round(lat[len(lat) // 2] * 1e3, 2) if lat else None,
        "p99_ms": round(lat[int(len(lat) * 0.99)] * 1e3, 2) if lat else None,
        "mean_fill": round(statistics.fmean(steady), 4) if steady else None,
        "evictions": stats["evictions"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", type=parse_size, default=parse_size("2G"), help="data bytes")
    ap.add_argument("--file-size", type=parse_size, default=parse_size("4M"))
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--passes", type=float, default=3.0, help="pool sizes written per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm", help="where the image lives")
    ap.add_argument("--settings", nargs="+", default=["default", "0.97/0.94"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for rep in range(args.reps):
        for setting in args.settings:
            row = run_one(setting, args.pool, args.file_size, args.writers, args.passes, args.dir)
            row["rep"] = rep
            rows.append(row)
            if not args.json:
                print(json.dumps(row), flush=True)
    summary = {}
    for setting in args.settings:
        mine = [r for r in rows if r["setting"] == setting]
        summary[setting] = {
            k: statistics.median(r[k] for r in mine if r[k] is not None)
            for k in ("gb_per_s", "room_wait_share", "p50_ms", "p99_ms", "mean_fill")
            if any(r[k] is not None for r in mine)
        }
        summary[setting]["errors"] = sum(int(r["errors"]) for r in mine)
    out = {"pool": args.pool, "file_size": args.file_size, "writers": args.writers}
    out |= {"runs": rows, "medians": summary}
    print(json.dumps(out if args.json else summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
