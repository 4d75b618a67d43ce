"""vLLM's REAL fs secondary tier on one node of a kvfs cluster (kvfs mount --cluster).

The tier, the host buffer and the scheduler loop are those of ``vllm_fs_driver.py``
(imported from it): a real ``FileSystemTierManager`` (thread pool, async lookup
manager, C helper ``vllm.fs_io_C``) over a directory of a kvfs mount. Each run is a
new tier instance (a new vLLM process), so nothing is remembered between runs but the
files. Prints one JSON object (last stdout line).

Block ``i`` always holds the same bytes (``block_data(i)``: seeded by ``i``), so a
node that never stored block ``i`` can still check it bit for bit; the sha256 of
every block file as read back from the mount is reported too, so the test can also
compare node A's files with node B's.

Scenarios (on blocks FIRST..FIRST+N-1, or the list ``--idx 0,1,100``):
  store  store the blocks (one store job per 4 blocks), then look them up: they
         are local files now, so all must hit.
  load   look the blocks up (timed: the lookup of a block the node does not have
         is what goes to the cluster), then load every hit into a zeroed host slot
         and compare it with ``block_data(i)``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

from vllm_fs_driver import Driver, block_data, fs_io, fs_manager


def file_sha(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def blocks(a: argparse.Namespace) -> list[int]:
    if a.idx:
        return [int(i) for i in a.idx.split(",")]
    return list(range(a.first, a.first + a.blocks))


def scenario_store(a: argparse.Namespace) -> dict[str, object]:
    idx = blocks(a)
    d = Driver(a.dir, len(idx), a.threads)
    try:
        res: dict[str, object] = {
            "fs_io_C": fs_io._HAS_FSIO_C,
            "o_direct": d.tier._use_o_direct,
            "stored": d.store(idx),
        }
        res["lookup"] = d.lookup(idx, "store-check")
        res["paths"] = [os.path.relpath(d.path(i), a.dir) for i in idx]
        res["sha256"] = [file_sha(d.path(i)) for i in idx]
        res["expected_sha256"] = [hashlib.sha256(block_data(i).tobytes()).hexdigest() for i in idx]
    finally:
        d.close()
    return res


def scenario_load(a: argparse.Namespace) -> dict[str, object]:
    idx = blocks(a)
    d = Driver(a.dir, len(idx), a.threads)
    try:
        res: dict[str, object] = {"o_direct": d.tier._use_o_direct}
        t0 = time.monotonic()
        hits = d.lookup(idx, "load-lookup", timeout=a.lookup_timeout)
        res["lookup_s"] = time.monotonic() - t0
        res["lookup"] = hits
        hit_idx = [i for i, h in zip(idx, hits, strict=True) if h]
        loaded = d.load_check(hit_idx) if hit_idx else []
        by_block = dict(zip(hit_idx, loaded, strict=True))
        res["loaded"] = [by_block.get(i) for i in idx]  # None: not looked up as a hit
        res["paths"] = [os.path.relpath(d.path(i), a.dir) for i in idx]
        # only hits: opening a name this node lacks would ask the cluster once more
        res["sha256"] = [file_sha(d.path(i)) if i in by_block else None for i in idx]
    finally:
        d.close()
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["store", "load"])
    p.add_argument("--dir", required=True)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--idx", help="comma-separated block numbers (instead of --first/--blocks)")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--lookup-timeout", type=float, default=60.0)
    a = p.parse_args()
    a.dir = os.path.abspath(a.dir)
    res = {"store": scenario_store, "load": scenario_load}[a.scenario](a)
    res["scenario"] = a.scenario
    res["fs_io_C"] = fs_io._HAS_FSIO_C
    res["batch_lookup_C"] = fs_manager._HAS_BATCH_LOOKUP_C
    print(json.dumps(res), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
