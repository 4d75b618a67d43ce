"""How ``v1-clean.img.gz`` and ``v1-dirty.img.gz`` were made: pools written by kvfs
0.2.0 (journal entry version 1, commit 1c85602), kept so that every later release is
tested against the bytes of a real old log. Run from a checkout of that release:

    cd <kvfs 0.2.0 checkout> && .venv/bin/python <this file> OUTDIR

Both pools: a directory, 12 files f0..f11 and an xattr on the root, a checkpoint, 8
more files g12..g19 durable in the journal; "clean" then unmounts (final checkpoint),
"dirty" stops without one (a crash image). File contents: :func:`content`.
"""

from __future__ import annotations

import gzip
import hashlib
import stat
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path.cwd() / "tests"))

FILES = {b"f%d" % i: 1000 + i * 30000 for i in range(12)}
LATER = {b"g%d" % i: 5000 + i * 7000 for i in range(12, 20)}


def content(name: bytes, size: int) -> bytes:
    """Compressible but distinct per file (the images are stored gzipped)."""
    unit = name + b":" + hashlib.sha256(name).hexdigest().encode() + b";"
    return (unit * (size // len(unit) + 1))[:size]


async def build(kind: str, out: Path) -> None:
    from kvfs.device import MemoryDevice
    from kvfs.namespace import ROOT_INO
    from test_store import CFG, memory_pool, put

    from kvfs.store import Store

    pool = memory_pool(size=16 << 20)
    store = Store(pool, CFG)
    store.load()
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        await store.make(ROOT_INO, b"dir", stat.S_IFDIR | 0o755)
        for name, size in FILES.items():
            await put(store, name, content(name, size))
        store.ns.set_xattr(ROOT_INO, b"user.x", b"value")
        await store.journal.checkpoint()
        for name, size in LATER.items():
            await put(store, name, content(name, size))
        await store.journal.wait_durable()
        if kind == "clean":
            await store.close()
        nursery.cancel_scope.cancel()
    dev = pool.devices[0]
    assert isinstance(dev, MemoryDevice)
    with gzip.open(out / f"v1-{kind}.img.gz", "wb", compresslevel=9) as f:
        f.write(bytes(dev.data))


if __name__ == "__main__":
    for kind in ("clean", "dirty"):
        trio.run(build, kind, Path(sys.argv[1]))
