"""Latency of the namespace's name index while it grows: N one-unit files
(``chunk-%08d.pt``, directories of 1000) made with ``Namespace.add_files``, every
``NameIndex.insert`` timed on its own; then, with ``--remove``, every name removed
again (timing each ``NameIndex.remove``). Prints the worst single call, the count
over 1 ms, percentiles, and the index's bytes per name at the end of each phase.

    python tools/nsindex.py 2000000
    python tools/nsindex.py 4000000 --remove
"""

from __future__ import annotations

import argparse
import stat
import sys
import time
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvfs.columns import NameIndex
from kvfs.namespace import ROOT_INO, Namespace

PER_DIR = 1000


class TimedIndex(NameIndex):
    """A NameIndex that records the duration of every insert and remove."""

    __slots__ = ("depth", "times")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.times = array("d")
        self.depth = 0

    def insert(self, parent: int, name: bytes, ino: int) -> None:
        # the old one-loop rehash re-entered insert: time only the outer call
        self.depth += 1
        t = time.perf_counter()
        super().insert(parent, name, ino)
        self.depth -= 1
        if not self.depth:
            self.times.append(time.perf_counter() - t)

    def remove(self, parent: int, name: bytes, ino: int) -> None:
        t = time.perf_counter()
        super().remove(parent, name, ino)
        self.times.append(time.perf_counter() - t)


def index_bytes(index: NameIndex) -> int:
    nbytes = getattr(index, "nbytes", None)
    if nbytes is not None:
        return int(nbytes())
    return int(index.slots.nbytes())  # type: ignore[attr-defined]  # before issue 10's change


def report(what: str, times: array[float], names: int, index: NameIndex) -> None:
    ordered = sorted(times)
    n = len(ordered)
    pct = {p: ordered[min(n - 1, int(n * p / 100))] for p in (50, 99, 99.9, 99.99)}
    slow = sum(1 for t in ordered if t > 1e-3)
    per_name = index_bytes(index) / names if names else 0.0
    print(
        f"{what}: {n:,} calls, worst {ordered[-1] * 1e3:.2f} ms, > 1 ms: {slow}, "
        f"p50 {pct[50] * 1e6:.1f} us, p99 {pct[99] * 1e6:.1f} us, p99.9 "
        f"{pct[99.9] * 1e6:.1f} us, p99.99 {pct[99.99] * 1e6:.1f} us, total "
        f"{sum(ordered):.2f} s; index {index_bytes(index) / 2**20:.1f} MiB"
        + (f" = {per_name:.1f} B/name ({names:,} names)" if names else ""),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=int)
    ap.add_argument("--remove", action="store_true", help="then remove every file")
    args = ap.parse_args()
    n = args.files
    ns = Namespace(lambda ops: None)
    index = ns._index = TimedIndex(ns._matches, ns._key_of)
    ns.init_root(0, 0)
    dirs = []
    for d, first in enumerate(range(0, n, PER_DIR)):
        count = min(PER_DIR, n - first)
        dino = ns.make(ROOT_INO, b"d%05d" % d, stat.S_IFDIR | 0o755, 0, 0).ino
        dirs.append((dino, first, count))
        ns.add_files(
            dino,
            [b"chunk-%08d.pt" % i for i in range(first, first + count)],
            stat.S_IFREG | 0o644,
            (0, 0),
            1 << 20,
            array("q", range(first, first + count)),
            array("Q", range(first, first + count)),
        )
    report("insert", index.times, n + len(dirs), index)
    if args.remove:
        index.times = array("d")
        for dino, first, count in dirs:
            for i in range(first, first + count):
                ns.drop(ns.remove(dino, b"chunk-%08d.pt" % i, want_dir=False))
        report("remove", index.times, len(dirs), index)


if __name__ == "__main__":
    main()
