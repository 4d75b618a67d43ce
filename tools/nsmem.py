"""Memory of the namespace alone: N one-unit files (``chunk-%08d.pt``, directories of
1000) built with ``Namespace.add_files``, optionally vLLM's 8-byte
``user.vllm.kv_crc32c`` xattr on each; prints the RSS growth per file and the bytes
per file of each structure, the image size, and freeze / image-load times.

    python tools/nsmem.py 1000000
    python tools/nsmem.py 1000000 --xattr
    python tools/nsmem.py 1000000 --drop 0.5   # then the image after a random half went
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvfs.format.records import Xattr
from kvfs.index.namespace import Namespace
from kvfs.testing.harness import fill_namespace

PER_DIR = 1000


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def build(n: int, xattr: bool) -> Namespace:
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    for _, first, count in fill_namespace(ns, n, PER_DIR):
        if xattr:
            for ino in range(first, first + count):
                ns.apply(Xattr(ino, b"user.vllm.kv_crc32c", b"%08x" % ino))
    return ns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=int)
    ap.add_argument("--xattr", action="store_true")
    ap.add_argument("--drop", type=float, default=0.0, help="then drop this fraction, at random")
    args = ap.parse_args()
    n = args.files
    r0 = rss()
    t = time.perf_counter()
    ns = build(n, args.xattr)
    built = time.perf_counter() - t
    gc.collect()
    grown = rss() - r0
    columns = sum(c.nbytes() for c in ns.persisted_columns) + ns._lookups.nbytes()
    listing = sum(len(d.children) * 4 for d in ns._dirs.values())
    t = time.perf_counter()
    payloads = ns.snapshot_payloads()
    froze = time.perf_counter() - t
    image = sum(map(len, payloads))
    t = time.perf_counter()
    fresh = Namespace(lambda ops: None)
    for payload in ns.snapshot_payloads():
        fresh.load_payload(payload)
    fresh.finish_load()
    loaded = time.perf_counter() - t
    print(
        f"files {n:,} xattr {args.xattr}: RSS {grown / n:.1f} B/file (columns "
        f"{columns / n:.1f}, arena {ns._arena.nbytes() / n:.1f}, name index "
        f"{ns._index.nbytes() / n:.1f}, listing arrays {listing / n:.1f}); image "
        f"{image / n:.1f} B/file; build {built:.1f} s, freeze {froze * 1e3:.1f} ms, "
        f"image load {loaded:.2f} s"
    )
    if args.drop:
        rng = random.Random(1)
        files = [i for i in ns.inodes if not ns.inodes[i].is_dir]
        gone = rng.sample(files, int(len(files) * args.drop))
        t = time.perf_counter()
        for ino in gone:
            inode = ns.inodes[ino]
            ns.drop(ns.remove(inode.parent, inode.name, want_dir=False))
        dropped = time.perf_counter() - t
        del inode
        t = time.perf_counter()
        after = sum(map(len, ns.snapshot_payloads()))
        encoded = time.perf_counter() - t
        print(
            f"dropped {len(gone):,} at random ({dropped:.1f} s): image {after / n:.1f} B per "
            f"file built ({after / image:.3f} of the full image; {len(files) - len(gone):,} "
            f"left), encoded in {encoded:.2f} s"
        )


if __name__ == "__main__":
    main()
