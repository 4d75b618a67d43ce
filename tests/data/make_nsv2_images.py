"""How ``nsv2-clean.img.gz`` and ``nsv2-dirty.img.gz`` were made: pools written by
the release whose namespace image is version 2 (full-width column chunks, absolute
atime and ctime; commit 3af337e), kept so that every later release is tested against
the bytes of a real image of that version. Run from a checkout of that release:

    cd <checkout of 3af337e> && .venv/bin/python <this file> OUTDIR

Both pools: a directory, files f0..f11 (f3 in the directory) with the times of
:func:`times`, an xattr on f1, a checkpoint (the version 2 image); then, durable in
the journal only, files g12..g15 with their times and new times for f0 (a record
replayed over the image); "clean" then unmounts (a final checkpoint, version 2 too),
"dirty" stops without one (a crash image). File contents: :func:`content`.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path.cwd() / "tests"))

FILES = {b"f%d" % i: 1000 + i * 30000 for i in range(12)}
LATER = {b"g%d" % i: 5000 + i * 7000 for i in range(12, 16)}
IN_DIR = b"f3"


def content(name: bytes, size: int) -> bytes:
    """Compressible but distinct per file (the images are stored gzipped)."""
    unit = name + b":" + hashlib.sha256(name).hexdigest().encode() + b";"
    return (unit * (size // len(unit) + 1))[:size]


def times(name: bytes, again: bool = False) -> tuple[int, int, int]:
    """(atime, mtime, ctime) in ns: far apart, before and after mtime, odd ns."""
    k = int(name[1:]) + (100 if again else 0)
    mtime = 1_700_000_000_000_000_000 + k * 1_000_000_007
    return mtime - k * 86_400_000_000_123, mtime, mtime + k * 3_600_000_000_001


async def build(kind: str, out: Path) -> None:
    from kvfs.device import MemoryDevice
    from kvfs.namespace import ROOT_INO
    from test_store import CFG, memory_pool

    from kvfs.store import Store

    pool = memory_pool(size=16 << 20)
    store = Store(pool, CFG)
    store.load()

    async def put(parent: int, name: bytes, size: int) -> None:
        inode = await store.create(parent, name, 0o100644)
        fh = await store.open(inode.ino, os.O_RDWR)
        await store.write(fh, 0, content(name, size))
        await store.release(fh)
        set_times(inode, name)

    def set_times(inode: object, name: bytes, again: bool = False) -> None:
        inode.atime_ns, inode.mtime_ns, inode.ctime_ns = times(name, again)  # type: ignore[attr-defined]
        store.ns.commit(inode)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        d = await store.make(ROOT_INO, b"dir", 0o40755)
        for name, size in FILES.items():
            await put(d.ino if name == IN_DIR else ROOT_INO, name, size)
        f1 = store.ns.lookup(ROOT_INO, b"f1")
        store.ns.set_xattr(f1.ino, b"user.x", b"value")
        set_times(f1, b"f1")
        await store.journal.checkpoint()
        for name, size in LATER.items():
            await put(ROOT_INO, name, size)
        set_times(store.ns.lookup(ROOT_INO, b"f0"), b"f0", again=True)
        await store.journal.wait_durable()
        if kind == "clean":
            await store.close()
        nursery.cancel_scope.cancel()
    dev = pool.devices[0]
    assert isinstance(dev, MemoryDevice)
    with gzip.open(out / f"nsv2-{kind}.img.gz", "wb", compresslevel=9) as f:
        f.write(bytes(dev.data))


if __name__ == "__main__":
    for kind in ("clean", "dirty"):
        trio.run(build, kind, Path(sys.argv[1]))
