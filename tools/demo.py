"""The README's first command: kvfs on a file-backed device, written the LMCache way.

Creates a sparse image (the embedded default device when no NVMe is named), formats
and mounts it, stores a few 32 MiB KV chunks exactly as LMCache's local_disk backend
does (open O_WRONLY|O_CREAT|O_TRUNC, one write of the whole chunk, close), reads one
back, shows ``ls -l``, ``stat``, ``df`` and ``kvfs stats``, then unmounts.

    python tools/demo.py [--dir /tmp/kvfs-demo] [--device /dev/nvme0n1 ...] [--keep]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from kvfs.harness import kvfs_command, make_image, mounted

CHUNK = 2 * 32 * 256 * 8 * 128 * 2  # Llama-3-8B bf16, 256 tokens: 32 MiB
MODEL = "meta-llama-Meta-Llama-3-8B"


def lmcache_name(i: int) -> str:
    h = int.from_bytes(hashlib.sha256(f"prefix-{i}".encode()).digest()[:8], "little", signed=True)
    return f"{MODEL}@1@0@{h:x}@bfloat16.pt"


def store_chunk(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def show(cmd: list[str]) -> None:
    print(f"$ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/kvfs-demo", help="where the image and mount go")
    ap.add_argument("--device", action="append", help="use these devices (DESTROYS DATA)")
    ap.add_argument("--size", default="4G", help="image size when no device is given")
    ap.add_argument("--chunks", type=int, default=4)
    args = ap.parse_args(argv)
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    mnt = base / "mnt"
    devices = args.device or [str(base / "kvfs-dev0.img")]
    if not args.device:
        size = int(args.size.rstrip("G")) << 30
        make_image(devices[0], size)
        print(f"device: sparse image {devices[0]} ({args.size})")
    subprocess.run([*kvfs_command(), "format", "--force", *devices], check=True)
    with mounted(mnt, devices, log_file=base / "kvfs.log"):
        root = mnt / "lmcache"
        root.mkdir()
        payloads = [os.urandom(CHUNK) for _ in range(args.chunks)]
        for i, data in enumerate(payloads):
            store_chunk(root / lmcache_name(i), data)
        with open(root / lmcache_name(0), "rb", buffering=0) as f:
            back = bytearray(CHUNK)
            n = f.readinto(back)
        print(f"read back chunk 0: {n} bytes, identical: {bytes(back) == payloads[0]}")
        show(["ls", "-l", str(root)])
        show(["stat", str(root / lmcache_name(0))])
        show(["df", "-h", str(mnt)])
        show([*kvfs_command(), "stats", str(mnt)])
    print(f"unmounted {mnt}; the pool persists in {devices[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
