"""The README's first command: kvfs on a file-backed device, written the LMCache way.

The first run creates a sparse image (the embedded default device when no NVMe is
named), formats and mounts it, stores a few 32 MiB KV chunks exactly as LMCache's
local_disk backend does (open O_WRONLY|O_CREAT|O_TRUNC, one write of the whole chunk,
close), reads one back, shows ``ls -l``, ``stat``, ``df`` and ``kvfs stats``, then
unmounts. The pool persists: the next run mounts the same pool without formatting it
and first checks, byte for byte, the chunks the previous run left.

    python tools/demo.py [--dir /tmp/kvfs-demo] [--device /dev/nvme0n1 ...]
                         [--fresh] [--keep]

``--fresh`` formats again (the old chunks are gone); ``--keep`` leaves the pool
mounted at DIR/mnt (``kvfs umount DIR/mnt`` unmounts it).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

from kvfs.common.sizes import parse_size
from kvfs.testing.harness import kvfs_command, make_image, mounted

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


def chunk(i: int) -> bytes:
    """Chunk ``i``'s bytes: the same in every run, so a later run can check them."""
    return random.Random(i).randbytes(CHUNK)


def is_pool(devices: list[str]) -> bool:
    from kvfs.common.errors import UserError
    from kvfs.devices.pool import inspect_pool

    try:
        inspect_pool(devices).close()
    except (UserError, OSError):
        return False
    return True


def check_previous(root: Path, chunks: int) -> None:
    """What the previous run stored must read back exactly (or be gone: evicted)."""
    found = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    if not found:
        return
    good = 0
    for i in range(chunks):
        path = root / lmcache_name(i)
        if path.exists():
            if path.read_bytes() != chunk(i):
                raise SystemExit(f"demo: {path}: WRONG BYTES after a remount")
            good += 1
    print(f"the previous run's chunks, after a remount: {good} present, all bytes identical")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/kvfs-demo", help="where the image and mount go")
    ap.add_argument("--device", action="append", help="use these devices (DESTROYS DATA)")
    ap.add_argument("--size", default="4G", help="image size when no device is given (4G)")
    ap.add_argument("--chunks", type=int, default=4, help="chunks to store (4)")
    ap.add_argument("--fresh", action="store_true", help="format again, dropping the pool")
    ap.add_argument("--keep", action="store_true", help="leave the pool mounted")
    args = ap.parse_args(argv)
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    mnt = base / "mnt"
    devices = args.device or [str(base / "kvfs-dev0.img")]
    if not args.device and (args.fresh or not os.path.exists(devices[0])):
        make_image(devices[0], parse_size(args.size))
        print(f"device: new sparse image {devices[0]} ({args.size})")
    if args.fresh or not is_pool(devices):
        force = ["--force"] if args.fresh else []
        label = ["--label", "demo"]
        subprocess.run([*kvfs_command(), "format", *force, *label, *devices], check=True)
    else:
        print(f"device: {' '.join(devices)} holds a kvfs pool already: mounting it as it is")
    log = base / "kvfs.log"
    if args.keep:
        mnt.mkdir(exist_ok=True)
        subprocess.run([*kvfs_command(), "mount", str(mnt), *devices, "--log-file", str(log)])
        session: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    else:
        session = mounted(mnt, devices, log_file=log)
    with session:
        root = mnt / "lmcache"
        check_previous(root, args.chunks)
        root.mkdir(exist_ok=True)
        for i in range(args.chunks):
            store_chunk(root / lmcache_name(i), chunk(i))
        with open(root / lmcache_name(0), "rb", buffering=0) as f:
            back = bytearray(CHUNK)
            n = f.readinto(back)
        print(f"read back chunk 0: {n} bytes, identical: {bytes(back) == chunk(0)}")
        show(["ls", "-l", str(root)])
        show(["stat", str(root / lmcache_name(0))])
        show(["df", "-h", str(mnt)])
        show([*kvfs_command(), "stats", str(mnt)])
    if args.keep:
        print(f"still mounted at {mnt}: unmount with `kvfs umount {mnt}`")
    else:
        print(f"unmounted {mnt}; the pool persists in {' '.join(devices)}: run the demo again")
        print("to remount it and check its chunks (--fresh formats it anew)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
