"""Measure the eviction state's memory per tracked file (tracemalloc), per component.

    .venv/bin/python tools/policy_memory.py [--files 1000000] [--policies kvfs,lru,...]

- policy: bytes per key of each policy after ``track`` of N dense inode-like keys
  (the keys themselves belong to the caller and are allocated before measuring),
  and after a mount's bulk ``adopt`` of them (``per_key_adopted``);
  then with a full ghost list (N more keys tracked while evicting down to N/2);
- evictor: bytes per file of ``kvfs.evict.evictor.Evictor``'s own per-file state (owners,
  the files of each owner, the grace list) after ``created`` + ``committed`` of N
  files by 64 live processes, minus the policy's share; and of the orphan list
  after a remount (``adopt_all``: every file starts as an orphan); ``owners_per_file``
  is the same without the grace list (every grace over).

``--speed`` times a track + evict pair per policy instead (5 000 resident keys);
``--upgrade`` times ``adaptive`` taking a ``kvfs`` image of ``--files`` keys;
``--turnover`` measures the evictor's whole state per file (policy, owners, grace
list, gone files' ghosts) after a first fill and after a full turnover, evicted
files' inode numbers reused by the next files as a mount's namespace does
(``--distinct-numbers``: 2N numbers, as this tool measured before), counting only
what was allocated under calls into ``kvfs/evict/``, by module; ``--clock-from 32``
starts the policy's event clock at 2**32, as on a mount that has run for a day.

Set ``KVFS_SRC`` to another checkout to measure its code (the "before" numbers in
docs/eviction.md come from the parent commit run this way). Prints JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import stat
import sys
import time
import tracemalloc
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, os.environ.get("KVFS_SRC", str(Path(__file__).resolve().parent.parent)))

from kvfs.evict.evictor import Evictor
from kvfs.evict.policy import make_policy
from kvfs.index.namespace import ROOT_INO, Inode, Namespace


def _measure(action: Any) -> int:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    keep = action()
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del keep
    return used


def policy_bytes(name: str, keys: list[int], churn: bool = True) -> dict[str, float]:
    n = len(keys)

    def fill() -> Any:
        policy = make_policy(name)
        for index, key in enumerate(keys):
            policy.track(key, 1 << 21, index & 63)
        return policy

    keys_q, sizes_q = array("q", keys), array("q", [1 << 21]) * n

    def adopt() -> Any:  # what a mount does with the files it finds
        policy = make_policy(name)
        policy.adopt(keys_q, sizes_q)
        return policy

    resident = _measure(fill) / n
    adopted = round(_measure(adopt) / n, 1)
    if not churn:
        return {"per_key": round(resident, 1), "per_key_adopted": adopted}
    extra = list(range(keys[-1] + 1, keys[-1] + 1 + n))

    def churn() -> Any:
        policy = make_policy(name)
        for index, key in enumerate(keys + extra):
            policy.track(key, 1 << 21, index & 63)
            while len(policy) > n // 2:
                policy.remove(next(policy.victims()))
        return policy

    return {
        "per_key": round(resident, 1),
        "per_key_adopted": adopted,
        "per_resident_key_with_ghosts": round(_measure(churn) / (n // 2), 1),
    }


def evictor_bytes(n: int) -> dict[str, float]:
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    if hasattr(ns, "add_files"):  # the columnar namespace
        names = [b"f%d" % i for i in range(n)]
        first = ns.add_files(
            ROOT_INO,
            names,
            stat.S_IFREG | 0o644,
            (0, 0),
            1 << 21,
            array("q", range(n)),
            array("Q", [0]) * n,
        )
        del names
    else:  # an older checkout: Inode objects
        first = ROOT_INO + 1
        for ino in range(first, first + n):
            ns.inodes[ino] = Inode(ino, stat.S_IFREG | 0o644, 0, 0, 1, size=1 << 21)
    inos = range(first, first + n)
    pids = list(range(1000, 1064))

    def fill(policy: str) -> Any:
        evictor = Evictor(
            ns, policy=policy, alive=lambda pid: 7, thread_group=lambda tid: tid, grace=1e9
        )
        for index, ino in enumerate(inos):
            inode = ns.inodes[ino]
            evictor.created(inode, pids[index & 63])
            evictor.committed(inode, pids[index & 63])
        return evictor

    def fill_expired(policy: str) -> Any:  # the same, every grace over
        evictor = fill(policy)
        evictor.grace = 0.0
        evictor._fresh.clear()
        return evictor

    with_policy = _measure(lambda: fill("fifo"))
    owners_only = _measure(lambda: fill_expired("fifo"))
    policy_only = _measure(lambda: _fifo(inos))

    def remount() -> Any:
        evictor = Evictor(ns, policy="fifo", alive=lambda pid: None)
        evictor.adopt_all()
        return evictor

    orphans = _measure(remount) - policy_only
    return {
        "owners_and_grace_per_file": round((with_policy - policy_only) / n, 1),
        "owners_per_file": round((owners_only - policy_only) / n, 1),
        "orphans_per_file_after_mount": round(orphans / n, 1),
    }


_FRAMES = 4
"""Frames kept per allocation (the innermost): an allocation is at most two calls
below the ``kvfs/evict`` code that asked for it (a slot column's chunk:
``columns.fit`` -> ``columns.narrowed``); each frame kept slows every allocation."""


def _evictor_live() -> tuple[int, dict[str, int]]:
    """(bytes, bytes by evictor module) live now, of what tracemalloc traced, that
    was allocated under a call into ``kvfs/evict/`` (by its traceback), so that the
    namespace's own growth is not counted. Each allocation is charged to the
    innermost ``kvfs/evict`` module on its stack (a slot column's chunk, made by
    ``kvfs/index/columns.py`` helpers, to ``evict/slots.py``)."""
    gc.collect()
    total, parts = 0, {}
    for trace in tracemalloc.take_snapshot().traces:
        part = None
        for frame in reversed(trace.traceback):  # innermost first
            name = frame.filename.replace(os.sep, "/")
            if "/kvfs/evict/" in name:
                part = name.rsplit("/kvfs/", 1)[1]
                break
        if part is not None:
            total += trace.size
            parts[part] = parts.get(part, 0) + trace.size
    return total, parts


def _evictor_share(action: Any) -> tuple[int, dict[str, int], Any]:
    """(bytes, bytes by evictor module, what ``action`` returned): what
    :func:`_evictor_live` counts once ``action`` has run."""
    gc.collect()
    tracemalloc.start(_FRAMES)
    try:
        keep = action()
        total, parts = _evictor_live()
    finally:
        tracemalloc.stop()
    return total, parts, keep


def _start_clock(policy: Any, at: int) -> None:
    """Start the event clock of ``policy`` (and of its experts) at ``at``: a mount
    that has run for a while (a clock past 2**32 is about a day at 50 000 accesses a
    second)."""
    for part in (policy, *(getattr(policy, name, None) for name in ("loop", "recency"))):
        if part is not None and hasattr(part, "_clock"):
            part._clock = at


def turnover_bytes(
    n: int, policy: str = "adaptive", reuse: bool = True, clock_from: int = 0
) -> dict[str, Any]:
    """The evictor's whole state (policy, owners, grace list, gone files' ghosts) per
    resident file: after N files were written by 64 writer threads, and after N more
    were written while the oldest by the policy's order were evicted (a full
    turnover: every resident file written since, every evicted one's ghost kept
    under its name, ``Evictor._gone``). A quarter of the writes follow a read of a
    random resident file (touches, chains).

    ``reuse`` (what a mount does): an evicted file leaves the namespace as the
    store removes it (its names, ``Evictor.forget``, ``Namespace.drop``) and the
    next file made takes its inode number, so the policy's tables span N numbers.
    Without it, the 2N files are made first and the policy sees 2N numbers (the
    tool's measurement before). Only memory allocated under calls into
    ``kvfs/evict/`` counts (:func:`_evictor_share`): the namespace is not.
    ``clock_from``: the policy's event clock starts there (:func:`_start_clock`)."""
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    made = n if reuse else 2 * n
    first = ns.add_files(
        ROOT_INO,
        [b"f%d" % i for i in range(made)],
        stat.S_IFREG | 0o644,
        (0, 0),
        1 << 21,
        array("q", range(made)),
        array("Q", [0]) * made,
    )
    numbers: set[int] = set()

    filled: list[int] = []

    def run() -> Any:
        rng = random.Random(3)
        evictor = Evictor(
            ns,
            policy=policy,
            alive=lambda pid: 7,
            thread_group=lambda tid: tid,
            grace_bytes=(n << 21) // 64,
        )
        _start_clock(evictor.policy, clock_from)
        resident = list(range(first, first + n))  # (the tool's, not counted)
        where = {ino: i for i, ino in enumerate(resident)}
        for index in range(2 * n):
            pid = 1000 + (index & 63)
            if index == n:  # the first fill is done
                filled.append(_evictor_live()[0])
            if index < n:
                inode = ns.inodes[first + index]
            else:
                if index & 3 == 0:  # a read of a resident file first
                    evictor.opened(ns.inodes[resident[rng.randrange(n)]], pid)
                victim = next(evictor.policy.victims())
                if reuse:  # as the store's eviction (``Lifetime.unlink_everywhere``)
                    gone = ns.inodes[victim]
                    ns.remove(ROOT_INO, gone.name, want_dir=False)
                    evictor.forget(victim)
                    ns.drop(gone)
                    del gone
                    inode = ns.make(ROOT_INO, b"f%d" % index, stat.S_IFREG | 0o644, 0, 0)
                    inode.size = 1 << 21
                else:
                    evictor.forget(victim)
                    inode = ns.inodes[first + index]
                slot = where.pop(victim)
                resident[slot] = inode.ino
                where[inode.ino] = slot
            numbers.add(inode.ino)
            evictor.created(inode, pid)
            evictor.committed(inode, pid)
        return evictor

    turned, parts, evictor = _evictor_share(run)
    return {
        "first_fill_per_file": round(filled[0] / n, 1),
        "after_turnover_per_file": round(turned / n, 1),
        "after_turnover_by_module": {
            name: round(size / n, 1) for name, size in sorted(parts.items(), key=lambda p: -p[1])
        },
        "inode_numbers": len(numbers),
        "tracked": len(evictor.policy),
    }


def _fifo(inos: range) -> Any:
    policy = make_policy("fifo")
    for ino in inos:
        policy.track(ino, 1 << 21, None)
    return policy


def speed(name: str, keys: int = 20_000, resident: int = 5_000) -> float:
    """Median of 3 runs: microseconds per track + evict pair at ``resident`` keys."""
    runs = []
    for _ in range(3):
        policy = make_policy(name)
        started = time.perf_counter()
        for key in range(keys):
            policy.track(key, 100, key % 8)
            while len(policy) > resident:
                policy.remove(next(policy.victims()))
        runs.append((time.perf_counter() - started) / keys * 1e6)
    return round(sorted(runs)[1], 1)


def upgrade(files: int, ops: int = 200_000) -> dict[str, float]:
    """Seconds (median of 3) to take a ``kvfs`` image of ``files`` adopted keys
    after ``ops`` random operations: ``kvfs`` recovering it, ``adaptive`` adopting
    it (a pool of the former default mounted with ``adaptive``)."""
    kvfs = make_policy("kvfs")
    kvfs.adopt(array("q", range(files)), array("q", [1 << 20]) * files)
    rng = random.Random(1)
    for _ in range(ops):
        key, stream = rng.randrange(files + files // 10), rng.randrange(16)
        if rng.random() < 0.5:
            kvfs.track(key, 1 << 20, stream)
        else:
            kvfs.touch(key, stream)
        while len(kvfs) > files:
            kvfs.remove(next(kvfs.victims()))
    image = kvfs.persist()
    times: dict[str, list[float]] = {"kvfs_recover": [], "adaptive_from_kvfs": []}
    for _ in range(3):
        started = time.perf_counter()
        make_policy("kvfs").recover(image)
        times["kvfs_recover"].append(time.perf_counter() - started)
        started = time.perf_counter()
        if not make_policy("adaptive").recover_foreign(image):
            raise SystemExit("adaptive refused the kvfs image")
        times["adaptive_from_kvfs"].append(time.perf_counter() - started)
    return {name: round(sorted(runs)[1], 3) for name, runs in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--policies", default="lru,fifo,kvfs,prefix-lru,adaptive")
    ap.add_argument("--no-churn", action="store_true", help="skip the ghost-list measurement")
    ap.add_argument("--speed", action="store_true", help="time track + evict instead")
    ap.add_argument("--upgrade", action="store_true", help="time adopting a kvfs image (adaptive)")
    ap.add_argument(
        "--turnover",
        action="store_true",
        help="the evictor's whole state per file before and after a full turnover",
    )
    ap.add_argument(
        "--distinct-numbers",
        action="store_true",
        help="--turnover with 2N inode numbers, none reused (as measured before)",
    )
    ap.add_argument(
        "--clock-from",
        type=int,
        default=0,
        metavar="BITS",
        help="--turnover with the policy's event clock started at 2**BITS (a long-lived mount)",
    )
    args = ap.parse_args(argv)
    if args.turnover:
        reuse = not args.distinct_numbers
        start = 1 << args.clock_from if args.clock_from else 0
        rows = {
            name: turnover_bytes(args.files, name, reuse, start)
            for name in args.policies.split(",")
        }
        out = {
            "files": args.files,
            "inode_numbers_reused": reuse,
            "clock_from": start,
            "evictor_state": rows,
        }
        print(json.dumps(out, indent=1))
        return 0
    if args.upgrade:
        print(json.dumps({"files": args.files, "seconds": upgrade(args.files)}, indent=1))
        return 0
    if args.speed:
        rates = {name: speed(name) for name in args.policies.split(",")}
        print(json.dumps({"us_per_track_and_evict": rates}, indent=1))
        return 0
    keys = list(range(2, args.files + 2))
    out: dict[str, Any] = {"files": args.files, "policy": {}}
    for name in args.policies.split(","):
        try:
            out["policy"][name] = policy_bytes(name, keys, not args.no_churn)
        except ValueError as error:  # a policy this checkout does not have
            out["policy"][name] = str(error)
    out["evictor"] = evictor_bytes(args.files)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
