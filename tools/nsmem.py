"""Memory of the namespace alone: N one-unit files (``chunk-%08d.pt``, directories of
1000) built with ``Namespace.add_files``, optionally vLLM's 8-byte
``user.vllm.kv_crc32c`` xattr on each; prints the RSS growth per file and the bytes
per file of each structure, the image size, and freeze / image-load times.

    python tools/nsmem.py 1000000
    python tools/nsmem.py 1000000 --xattr
    python tools/nsmem.py 1000000 --drop 0.5   # then the image after a random half went
    python tools/nsmem.py 1000000 --turnover   # then every file replaced, as eviction does
    python tools/nsmem.py 1000000 --names lmcache --turnover   # LMCache's names, one directory
    python tools/nsmem.py 1000000 --names lmcache --lookups 200000   # and their cost
    python tools/nsmem.py 1000000 --names lmcache --turnover --evictor adaptive   # the daemon's

``--turnover``: N times, a random file leaves as the store evicts one (its name
removed, its row dropped) and a new one-unit file is made in its directory (its
row the freed one, as a mount reuses it), written and committed; then the RSS and
structures again, per file, before and after a heap trim (what the daemon does
while serving, ``kvfs.common.heap``). ``--names lmcache``: LMCache ``local_disk``'s
names (~58 bytes, ``harness.lmcache_name``) in one flat directory, as LMCache keeps
them. ``--lookups K``: after the build, the time of K lookups of random files by
name and of listing the largest directory, per name (medians of 5 rounds).
``--evictor POLICY`` (with ``--turnover``): the daemon's eviction state beside the
namespace, as a mount keeps it: the files tracked as 64 writers' files, then each
victim the evictor's first candidate; its policy, ghosts by name, grace list and
owners are in the RSS figures, which are then the daemon's index and eviction state
together after the cache turned over; a last line gives the eviction state's bytes
by part and the namespace's whole (the objects' sizes, :func:`footprint`: its
rows' every column and table, where the figures before count its main
structures) and the RSS left over (the allocators' free blocks, the interpreter's
own objects), with the part of it that Python's small-object allocator holds in
its arenas for no object (:func:`small_object_slack`).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import re
import stat
import statistics
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from types import FunctionType, MethodType, ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvfs.common import heap
from kvfs.evict.evictor import Evictor
from kvfs.format.records import Xattr
from kvfs.index.namespace import Inode, Namespace
from kvfs.testing.harness import chunk_name, fill_namespace, lmcache_name

PER_DIR = 1000


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


_SLACK = re.compile(
    r"^(?:# bytes in available blocks|\d+ unused pools \* \d+ bytes"
    r"|# bytes lost to (?:pool headers|quantization|arena alignment))\s*=\s*([\d,]+)$",
    re.MULTILINE,
)


def small_object_slack() -> int | None:
    """Bytes Python's small-object allocator (objects of 512 B or less) holds in its
    arenas for no object: free blocks of pools in use, unused pools of arenas in
    use, and what its block sizes and alignment lose. An arena goes back to the
    system only once all of it is free, so objects that come and go (the shadows'
    keys, the sampled identities) leave it resident. Read from the interpreter's own
    report (``sys._debugmallocstats``, written to file descriptor 2); None where it
    gives none."""
    report = getattr(sys, "_debugmallocstats", None)
    if report is None:
        return None
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as out:
        try:
            os.dup2(out.fileno(), 2)
            report()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode(errors="replace")
    found = _SLACK.findall(text)
    return sum(int(n.replace(",", "")) for n in found) if found else None


NAMES = {"chunk": (chunk_name, PER_DIR), "lmcache": (lmcache_name, 0)}
"""Name style -> (file i's name, files per directory; 0: one directory of all)."""


def build(n: int, xattr: bool, names: str = "chunk") -> Namespace:
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    name, per_dir = NAMES[names]
    for _, first, count in fill_namespace(ns, n, per_dir or max(n, 1), name):
        if xattr:
            for ino in range(first, first + count):
                ns.apply(Xattr(ino, b"user.vllm.kv_crc32c", b"%08x" % ino))
    return ns


def structures(ns: Namespace) -> tuple[int, int]:
    """(bytes of the columns, of the directories' listing arrays)."""
    columns = sum(c.nbytes() for c in ns.persisted_columns) + ns._lookups.nbytes()
    return columns, sum(len(d.children) * 4 for d in ns._dirs.values())


def footprint(root: object, seen: set[int]) -> int:
    """Bytes of ``root`` and of what it holds (containers, arrays, instances' fields),
    each object once across calls sharing ``seen``; functions, classes and modules
    are not followed, and the small ints Python caches are free."""
    total = 0
    stack = [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, ModuleType, FunctionType, MethodType)):
            continue
        seen.add(id(o))
        if o is None or (isinstance(o, int) and -5 <= o <= 256):  # (bools among them)
            continue
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif not isinstance(o, (int, float, str, bytes, bytearray, array)):
            fields = getattr(o, "__dict__", None)
            if fields is not None:
                stack.append(fields)
            for cls in type(o).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if hasattr(o, slot):
                        stack.append(getattr(o, slot))
    return total


def evictor_parts(evictor: Evictor, seen: set[int]) -> dict[str, int]:
    """The eviction state's bytes by part (:func:`footprint`, sharing ``seen``): the
    adaptive policy's experts, shadows and sampled identities apart, then each of the
    evictor's own structures (the namespace, which it refers to, excluded)."""
    seen.add(id(evictor.ns))
    parts: dict[str, int] = {}
    policy = evictor.policy
    for name, label in (
        ("loop", "loop expert"),
        ("recency", "recency expert"),
        ("duel", "shadows"),
        ("_chunks", "sampled identities"),
    ):
        if hasattr(policy, name):
            parts[label] = footprint(getattr(policy, name), seen)
    parts["policy, other"] = footprint(policy, seen)
    for name, value in vars(evictor).items():
        if name not in ("ns", "policy"):
            parts[name.lstrip("_")] = footprint(value, seen)
    return parts


def write_unit(ns: Namespace, inode: Inode, unit: int) -> None:
    """A new file's one unit (``unit``, device 0) written and committed."""
    inode.size = 1 << 20
    units, sums = ns.edit_map(inode)
    units.append(unit)
    sums.append(unit * 2654435761 & ((1 << 64) - 1))
    ns.commit(inode)


def turnover(ns: Namespace, n: int, name: Callable[[int], bytes]) -> None:
    """Replace ``n`` files at random as the store's eviction and a writer do: the
    victim's name removed and its row dropped, then a new file (``name(n + k)``, a
    freed row) made in the same directory, one unit written and committed."""
    rng = random.Random(2)
    files = array("q", (i for i in ns.inodes if not ns.inodes[i].is_dir))  # no int objects
    for k in range(n):
        j = rng.randrange(len(files))
        victim = ns.inodes[files[j]]
        parent = victim.parent
        ns.drop(ns.remove(parent, victim.name, want_dir=False))
        inode = ns.make(parent, name(n + k), stat.S_IFREG | 0o644, 0, 0)
        write_unit(ns, inode, n + k)
        files[j] = inode.ino
        del victim, inode  # (views: the next drop frees its row at once)


def turnover_evicted(ns: Namespace, n: int, name: Callable[[int], bytes], evictor: Evictor) -> None:
    """:func:`turnover` with the daemon's eviction state beside the namespace: the
    files are tracked as 64 writers' (``created``, ``committed``), then ``n`` times
    the evictor's first candidate (orphans first, then the policy's order) is
    evicted as the store does (its name removed, ``Evictor.forget``: its ghost kept
    by name, the row dropped) and a new
    file is made in its directory by one of 64 writers (``created``, written,
    ``committed``: tracked, in its grace); a quarter of them after a read of a random
    file (``opened``)."""
    rng = random.Random(2)
    files = array("q", (i for i in ns.inodes if not ns.inodes[i].is_dir))  # no int objects
    for j, ino in enumerate(files):  # written by 64 writers, as on a mount
        inode = ns.inodes[ino]
        evictor.created(inode, 1000 + (j & 63))
        evictor.committed(inode, 1000 + (j & 63))
    where = array("q", bytes(8 * ns.next_ino))  # inode number -> position in files
    for j, ino in enumerate(files):
        where[ino] = j
    for k in range(n):
        pid = 1000 + (k & 63)
        if k & 3 == 0:
            evictor.opened(ns.inodes[files[rng.randrange(len(files))]], pid)
        victim, _ = next(iter(evictor.candidates(lambda inode: True)))
        parent, j = victim.parent, where[victim.ino]
        ns.remove(parent, victim.name, want_dir=False)
        evictor.forget(victim.ino)
        ns.drop(victim)
        inode = ns.make(parent, name(n + k), stat.S_IFREG | 0o644, 0, 0)
        evictor.created(inode, pid)
        write_unit(ns, inode, n + k)
        evictor.committed(inode, pid)
        if inode.ino >= len(where):
            where.extend(bytes(8 * (inode.ino + 1 - len(where))))
        files[j], where[inode.ino] = inode.ino, j
        del victim, inode  # (views: the next drop frees its row at once)


def lookups(ns: Namespace, k: int) -> None:
    """Print the median time of a lookup by name (K random files) and of a listed
    name (the largest directory), over 5 rounds."""
    rng = random.Random(3)
    files = [i for i in ns.inodes if not ns.inodes[i].is_dir]
    keys = [(ns.inodes[i].parent, ns.inodes[i].name) for i in rng.sample(files, min(k, len(files)))]
    big = max(ns._dirs, key=lambda d: len(ns._dirs[d].children))
    per_lookup, per_listed = [], []
    for _ in range(5):
        t = time.perf_counter()
        for parent, name in keys:
            ns.lookup(parent, name)
        per_lookup.append((time.perf_counter() - t) / len(keys))
        t = time.perf_counter()
        listed = ns.directory(big).items()
        per_listed.append((time.perf_counter() - t) / len(listed))
    print(
        f"lookup {statistics.median(per_lookup) * 1e6:.2f} µs per name ({len(keys):,} "
        f"names), listing {statistics.median(per_listed) * 1e6:.3f} µs per name "
        f"({len(listed):,} in the largest directory)"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=int)
    ap.add_argument("--xattr", action="store_true")
    ap.add_argument("--drop", type=float, default=0.0, help="then drop this fraction, at random")
    ap.add_argument("--turnover", action="store_true", help="then replace N files as evicted")
    ap.add_argument("--names", choices=sorted(NAMES), default="chunk")
    ap.add_argument("--lookups", type=int, default=0, help="then time K lookups and a listing")
    ap.add_argument(
        "--evictor",
        metavar="POLICY",
        help="with --turnover: the daemon's eviction state too (its victims, its policy)",
    )
    args = ap.parse_args(argv)
    n = args.files
    r0, s0 = rss(), small_object_slack()
    t = time.perf_counter()
    ns = build(n, args.xattr, args.names)
    built = time.perf_counter() - t
    gc.collect()
    grown = rss() - r0
    columns, listing = structures(ns)
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
    del fresh, payload, payloads  # (their memory is not the namespace's)
    print(
        f"files {n:,} names {args.names} xattr {args.xattr}: RSS {grown / n:.1f} B/file (columns "
        f"{columns / n:.1f}, arena {ns._arena.nbytes() / n:.1f}, name index "
        f"{ns._index.nbytes() / n:.1f}, listing arrays {listing / n:.1f}); image "
        f"{image / n:.1f} B/file; build {built:.1f} s, freeze {froze * 1e3:.1f} ms, "
        f"image load {loaded:.2f} s"
    )
    if args.lookups:
        lookups(ns, args.lookups)
    if args.turnover:
        t = time.perf_counter()
        evictor = None
        if args.evictor:
            evictor = Evictor(
                ns,
                policy=args.evictor,
                alive=lambda pid: 7,
                thread_group=lambda tid: tid,
                grace_bytes=(n << 20) // 64,
            )
            turnover_evicted(ns, n, NAMES[args.names][0], evictor)
        else:
            turnover(ns, n, NAMES[args.names][0])
        turned = time.perf_counter() - t
        tracked = (
            ""
            if evictor is None
            else f"; the evictor ({args.evictor}): {len(evictor.policy):,} tracked, "
            f"{len(evictor._gone):,} ghosts by name, {evictor.fresh():,} in their grace"
        )
        gc.collect()
        columns, listing = structures(ns)
        untrimmed, free = rss() - r0, heap.free_heap_bytes()
        t = time.perf_counter()
        heap.release_free_heap()
        trim = time.perf_counter() - t
        print(
            f"after a turnover ({n:,} files replaced, {turned:.1f} s): RSS "
            f"{untrimmed / n:.1f} B/file ({(free or 0) / n:.1f} free in the heap), "
            f"{(rss() - r0) / n:.1f} after a heap trim ({trim * 1e3:.0f} ms) (columns "
            f"{columns / n:.1f}, arena {ns._arena.nbytes() / n:.1f}, name index "
            f"{ns._index.nbytes() / n:.1f}, listing arrays {listing / n:.1f}); "
            f"{ns.file_count:,} files{tracked}"
        )
        if evictor is not None:
            resident = rss() - r0  # (before the walk, whose set of ids takes memory)
            slack = small_object_slack()  # (grown since the start, as the RSS)
            if slack is not None and s0 is not None:
                slack -= s0
            seen: set[int] = set()
            namespace = footprint(ns, seen)  # first: what both hold is the namespace's
            parts = evictor_parts(evictor, seen)
            del seen
            shown = ", ".join(
                f"{name} {size / n:.1f}"
                for name, size in sorted(parts.items(), key=lambda kv: -kv[1])
                if size / n >= 0.05
            )
            rest = resident - sum(parts.values()) - namespace
            of_it = (
                "" if slack is None else f" (the small-object allocator's slack {slack / n:.1f})"
            )
            print(
                f"the eviction state by part, B/file: {sum(parts.values()) / n:.1f} in all "
                f"({shown}); the namespace whole {namespace / n:.1f}; RSS in neither: "
                f"{rest / n:.1f}{of_it}"
            )
    if args.drop:
        rng = random.Random(1)
        files = array("q", (i for i in ns.inodes if not ns.inodes[i].is_dir))  # no int objects
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
