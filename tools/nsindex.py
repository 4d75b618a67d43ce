"""Latency of the namespace's name index while it grows: N one-unit files
(``chunk-%08d.pt``, directories of 1000) made with ``Namespace.add_files``, every
``NameIndex.insert`` timed on its own; then, with ``--remove``, every name removed
again (timing each ``NameIndex.remove``). Prints the worst single call (wall clock,
and the thread's CPU time, which other processes on a loaded machine do not
inflate), the count over 1 ms, wall-clock percentiles, and the index's bytes per
name at the end of each phase.

    python tools/nsindex.py 2000000
    python tools/nsindex.py 4000000 --remove
"""

from __future__ import annotations

import argparse
import sys
import time
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvfs.index.columns import NameIndex
from kvfs.index.namespace import Namespace
from kvfs.testing.harness import fill_namespace

PER_DIR = 1000


class TimedIndex(NameIndex):
    """A NameIndex that records the duration of every insert and remove."""

    __slots__ = ("cpu", "depth", "swept", "times")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.times = array("d")
        self.cpu = array("d")
        self.depth = 0
        self.swept = 0
        """The most old-table slots one call swept (incremental migration only)."""

    def insert(self, parent: int, name: bytes, ino: int) -> None:
        # the old one-loop rehash re-entered insert: time only the outer call
        self.depth += 1
        at = self._sweep_at()
        c, t = time.thread_time(), time.perf_counter()
        super().insert(parent, name, ino)
        self.depth -= 1
        if not self.depth:
            self.times.append(time.perf_counter() - t)
            self.cpu.append(time.thread_time() - c)
            self._swept(at)

    def remove(self, parent: int, name: bytes, ino: int) -> None:
        at = self._sweep_at()
        c, t = time.thread_time(), time.perf_counter()
        super().remove(parent, name, ino)
        self.times.append(time.perf_counter() - t)
        self.cpu.append(time.thread_time() - c)
        self._swept(at)

    def _sweep_at(self) -> tuple[object, int]:
        old = getattr(self, "old", None)
        return old, getattr(self, "cursor", 0)

    def _swept(self, at: tuple[object, int]) -> None:
        old, cursor = at
        if old is not None:
            end = self.cursor if self.old is old else old.size  # type: ignore[attr-defined]
            self.swept = max(self.swept, end - cursor)


def index_bytes(index: NameIndex) -> int:
    nbytes = getattr(index, "nbytes", None)
    if nbytes is not None:
        return int(nbytes())
    return int(index.slots.nbytes())  # type: ignore[attr-defined]  # before issue 10's change


def report(what: str, index: TimedIndex, names: int) -> None:
    ordered = sorted(index.times)
    cpu = sorted(index.cpu)
    n = len(ordered)
    pct = {p: ordered[min(n - 1, int(n * p / 100))] for p in (50, 99, 99.9, 99.99)}
    slow = sum(1 for t in ordered if t > 1e-3)
    per_name = index_bytes(index) / names if names else 0.0
    print(
        f"{what}: {n:,} calls, worst {ordered[-1] * 1e3:.2f} ms (CPU {cpu[-1] * 1e3:.2f} ms), "
        f"> 1 ms: {slow} (CPU {sum(1 for t in cpu if t > 1e-3)}), "
        f"p50 {pct[50] * 1e6:.1f} us, p99 {pct[99] * 1e6:.1f} us, p99.9 "
        f"{pct[99.9] * 1e6:.1f} us, p99.99 {pct[99.99] * 1e6:.1f} us, total "
        f"{sum(ordered):.2f} s; most old slots swept by one call {index.swept}; index "
        f"{index_bytes(index) / 2**20:.1f} MiB"
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
    dirs = fill_namespace(ns, n, PER_DIR)
    report("insert", index, n + len(dirs))
    if args.remove:
        index.times, index.cpu, index.swept = array("d"), array("d"), 0
        done = 0
        for dino, _, count in dirs:
            for i in range(done, done + count):
                ns.drop(ns.remove(dino, b"chunk-%08d.pt" % i, want_dir=False))
            done += count
        report("remove", index, len(dirs))


if __name__ == "__main__":
    main()
