"""Space and device traffic of small files on a real mount, and large-file speed.

For each file size: format a pool, write N files of that size through the mount
(closed one by one, as an engine's block files are), then remount (cold caches) and
read them all back, checking every byte. Reports, per size: the data bytes, the used
bytes that ``df`` shows, the files' ``st_blocks`` in bytes, and the device bytes kvfs
wrote (data and metadata log) and read (the read phase only), each also as a ratio to
the data. ``--large`` adds a timing of 32 MiB files written and read back cold (MB/s).

The daemon runs from the current directory's ``kvfs`` (``python -m kvfs``), so the same
tool measures another tree by running it from there:

    cd /work/main && python /work/smallfiles/tools/smallfiles.py --dir /tmp/kv/sf  # before
    python tools/smallfiles.py --dir /tmp/kv/sf --files 200 --sizes 512K 100K 3M --large 8

Prints one JSON object per line (``"kind": "space"`` or ``"large"``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvfs.testing import harness

MiB = 1 << 20


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1].upper()] if text[-1].upper() in mult else int(text)


def stats(mnt: Path) -> dict[str, Any]:
    store: dict[str, Any] = json.loads(os.getxattr(mnt, "user.kvfs.stats"))["store"]
    return store


def content(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def read(path: Path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read()


def space_run(where: Path, files: int, size: int, pool_size: int) -> dict[str, Any]:
    image, mnt = where / "pool.img", where / "mnt"
    image.unlink(missing_ok=True)
    harness.make_image(image, pool_size)
    datas = [content(i, size) for i in range(files)]
    with harness.mounted(mnt, [image], "--format", "--meta-size", "32M"):
        base = stats(mnt)["device_bytes_written"]
        t0 = time.monotonic()
        for i, data in enumerate(datas):
            harness.write_file(mnt / f"blk{i}", data)
        write_s = time.monotonic() - t0
        written = stats(mnt)["device_bytes_written"] - base
        vfs = os.statvfs(mnt)
        used_df = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
        blocks = sum(os.stat(mnt / f"blk{i}").st_blocks * 512 for i in range(files))
    with harness.mounted(mnt, [image]):
        base = stats(mnt)["device_bytes_read"]
        t0 = time.monotonic()
        for i, data in enumerate(datas):
            assert read(mnt / f"blk{i}") == data, f"blk{i} read back wrong"
        read_s = time.monotonic() - t0
        device_read = stats(mnt)["device_bytes_read"] - base
    image.unlink()
    data_bytes = files * size
    return {
        "kind": "space",
        "files": files,
        "file_size": size,
        "data_bytes": data_bytes,
        "used_bytes_df": used_df,
        "st_blocks_bytes": blocks,
        "device_bytes_written": written,
        "device_bytes_read": device_read,
        "used_ratio": round(used_df / data_bytes, 3),
        "written_ratio": round(written / data_bytes, 3),
        "read_ratio": round(device_read / data_bytes, 3),
        "write_s": round(write_s, 3),
        "read_s": round(read_s, 3),
    }


def large_run(where: Path, files: int) -> dict[str, Any]:
    image, mnt = where / "pool.img", where / "mnt"
    image.unlink(missing_ok=True)
    harness.make_image(image, (files * 32 + 256) * MiB)
    data = content(7, 32 * MiB)
    with harness.mounted(mnt, [image], "--format", "--meta-size", "32M"):
        t0 = time.monotonic()
        for i in range(files):
            harness.write_file(mnt / f"chunk{i}", data)
        write_s = time.monotonic() - t0
    with harness.mounted(mnt, [image]):
        t0 = time.monotonic()
        for i in range(files):
            assert read(mnt / f"chunk{i}") == data
        read_s = time.monotonic() - t0
    image.unlink()
    total = files * 32 * MiB
    return {
        "kind": "large",
        "files": files,
        "file_size": 32 * MiB,
        "write_MBps": round(total / write_s / 1e6, 1),
        "read_MBps": round(total / read_s / 1e6, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="scratch directory (image, mount)")
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--sizes", nargs="*", default=["512K", "100K", "3M"])
    ap.add_argument("--large", type=int, default=0, help="32 MiB files to time (0: none)")
    args = ap.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        for text in args.sizes:
            size = parse_size(text)
            # twice the whole units the files could take, so nothing is ever evicted
            pool = max(256 * MiB, 2 * args.files * -(-size // MiB) * MiB + 64 * MiB)
            print(json.dumps(space_run(args.dir, args.files, size, pool)), flush=True)
        if args.large:
            print(json.dumps(large_run(args.dir, args.large)), flush=True)
    finally:
        shutil.rmtree(args.dir / "mnt", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
