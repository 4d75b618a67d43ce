#!/usr/bin/env python3
"""SGLang's HiCache storage loop, paired: kvfs's backend (``KvfsStorage``, through
:mod:`kvfs.direct`) on kvfs, against SGLang's ``HiCacheFile`` on ext4, and
``HiCacheFile`` on kvfs (through the mount). The figures the issue asks for: the
prefetch hit rate and the load time.

Reproduce (root, FUSE, loop devices, the engines venv from tools/engines_env.sh)::

    .venv/bin/python tools/engines/sglang_bench.py --out docs/bench/sglang_storage.json

Two images of the same size on the same host file system, each a loop device with
``--direct-io=on`` (no host page cache below, as tools/bench.py and
vllm_serve_bench.py). ext4: ``mkfs.ext4`` + ``mount -o noatime``. kvfs: ``kvfs format``
+ mount (defaults), directory policy kvfs-managed (SGLang never evicts). Per
repetition every variant once, in an order rotated by one each repetition; each run a
fresh engine process of the engines venv (tools/engines/sglang_hicache_driver.py
``bench``: sglang 0.5.23, Llama-3-8B bf16, 64-token pages of 8 MiB) in a fresh
directory:

1. store: ``--requests`` requests of ``--pages`` pages, keyed by SGLang's own page
   hashes of the request's tokens, one ``batch_set`` per request (as SGLang's
   write-back, up to 128 pages a call), timed; then a ``syncfs``, timed apart (store +
   syncfs is the durable store; KvfsStorage is durable when ``batch_set`` returns);
2. cold: ext4 ``sync`` + ``drop_caches``; kvfs unmount + remount + ``drop_caches``;
3. prefetch, in a new backend instance (a restarted engine): for each request, the
   steps of SGLang's ``HiCacheController._storage_hit_query`` (``batch_exists`` over
   the request's pages and the new page after them, which was never stored) and
   ``_page_transfer`` with ``_generic_page_get`` (``batch_get`` into dummy pages,
   copied into the host pool), timed; the host pool is then compared with the stored
   pages bit for bit. (cache_controller.py itself imports torchvision, which the
   engines venv lacks: the driver follows its steps instead of importing it.)

Reported per variant (medians over the repetitions): the prefetch hit rate (pages
transferred / pages stored), the load time per request (the transfer) and the whole
prefetch per request (hit query + transfer), load and store MB/s; and the median of
the per-repetition (paired) ratios of the load time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "engines"))
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))

from bench import drop_caches  # noqa: E402
from lmcache_bench import ext4_and_kvfs, run_paused  # noqa: E402

from kvfs.testing.harness import kvfs_command  # noqa: E402

ENGINES_PY = Path(os.environ.get("KVFS_ENGINES_VENV", REPO / ".venv-engines")) / "bin" / "python"
DRIVER = REPO / "tools" / "engines" / "sglang_hicache_driver.py"
VARIANTS = {
    # name: (file system, driver backend)
    "HiCacheFile/ext4": ("ext4", "file"),
    "KvfsStorage/kvfs": ("kvfs", "kvfs"),
    "HiCacheFile/kvfs": ("kvfs", "file"),
}
METRICS = (
    "hit_rate",
    "load_ms_per_request",
    "prefetch_ms_per_request",
    "load_MBps",
    "store_MBps",
    "store_durable_MBps",
)
RATIOS = {
    # name: (numerator variant, denominator variant), of load_ms_per_request
    "KvfsStorage on kvfs / HiCacheFile on ext4": ("KvfsStorage/kvfs", "HiCacheFile/ext4"),
    "HiCacheFile on kvfs / HiCacheFile on ext4": ("HiCacheFile/kvfs", "HiCacheFile/ext4"),
    "KvfsStorage / HiCacheFile, both on kvfs": ("KvfsStorage/kvfs", "HiCacheFile/kvfs"),
}


def one_run(root: Path, variant: str, a: argparse.Namespace, cold: Any) -> dict[str, Any]:
    """One engine process: store, (cold), prefetch; its JSON result."""
    cmd = [
        str(ENGINES_PY),
        str(DRIVER),
        "bench",
        "--dir",
        str(root),
        "--backend",
        VARIANTS[variant][1],
        "--requests",
        str(a.requests),
        "--pages",
        str(a.pages),
        "--pause",
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.pop("PYTHONPATH", None)
    env.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    res = run_paused(cmd, env, variant, cold)
    if not all(res["identical"]):
        raise RuntimeError(f"{variant}: a prefetched page differs from the stored one")
    return res


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    med: dict[str, Any] = {}
    for v, rs in runs.items():
        if rs:
            med[v] = {k: statistics.median(r[k] for r in rs) for k in METRICS}
    ratios = {}
    for name, (x, y) in RATIOS.items():
        n = min(len(runs.get(x, [])), len(runs.get(y, [])))
        if n:
            per_rep = [
                runs[x][i]["load_ms_per_request"] / runs[y][i]["load_ms_per_request"]
                for i in range(n)
            ]
            ratios[name] = {"median": statistics.median(per_rep), "per_rep": per_rep}
    return {"median": med, "paired_load_time_ratios": ratios}


def kvfs_dir(path: Path, policy: str) -> None:
    path.mkdir()
    subprocess.run(
        [*kvfs_command(), "policy", str(path), "--set", policy], check=True, capture_output=True
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "sglang_storage.json")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--pages", type=int, default=16, help="8 MiB pages per request")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--image", type=int, default=4 << 30)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--work", type=Path, default=None)
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v in VARIANTS]
    t_start = time.monotonic()
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="kvfs-sglang-bench-", dir=a.work))
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        with ExitStack() as stack:
            ext4, kv = ext4_and_kvfs(stack, work, a.image)
            kvfs_dir(work / "kvfs" / "sglang", "kvfs-managed")
            (ext4 / "sglang").mkdir()
            for rep in range(a.reps):
                k = rep % len(variants)
                for v in variants[k:] + variants[:k]:
                    fs = VARIANTS[v][0]
                    base = ext4 if fs == "ext4" else work / "kvfs"
                    root = base / "sglang" / f"run-{v.replace('/', '-')}-{rep}"
                    cold = drop_caches if fs == "ext4" else kv.cold
                    r = one_run(root, v, a, cold)
                    runs[v].append(r)
                    print(
                        f"rep {rep} {v:18s}: hit rate {r['hit_rate']:.2f}"
                        f"  load {r['load_ms_per_request']:7.1f} ms/request"
                        f" ({r['load_MBps']:5.0f} MB/s)"
                        f"  store {r['store_MBps']:5.0f} MB/s"
                        f" (durable {r['store_durable_MBps']:5.0f})",
                        flush=True,
                    )
                    shutil.rmtree(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    summary = summarize(runs)
    defaults = {"requests": 8, "pages": 16, "reps": 5}
    extra = "".join(f" --{k} {getattr(a, k)}" for k, d in defaults.items() if getattr(a, k) != d)
    doc = {
        "meta": {
            "command": f".venv/bin/python tools/engines/sglang_bench.py --out {a.out}{extra}",
            "engine": "sglang 0.5.23: HiCacheFile, or kvfs.sglang_storage.KvfsStorage built by "
            "StorageBackendFactory ('dynamic'); prefetch: the steps of HiCacheController's "
            "_storage_hit_query + _page_transfer; host pool pages stand-in (CPU tensors)",
            "page_bytes": 8 << 20,
            "requests": a.requests,
            "pages_per_request": a.pages,
            "reps": a.reps,
            "image_bytes": a.image,
            "loop": "--direct-io=on, same host file system",
            "cold_read": "ext4: sync + drop_caches; kvfs: remount + drop_caches",
            "durable_store": "store + syncfs of the directory's file system",
            "direct_path": "kvfs.direct as root: the pool's devices opened by the engine",
            "host": platform.node(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "loadavg_start_end": [load_start, os.getloadavg()],
            "seconds": round(time.monotonic() - t_start, 1),
        },
        **summary,
        "runs": runs,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary["median"], indent=1))
    print(
        json.dumps(
            {k: v["median"] for k, v in summary["paired_load_time_ratios"].items()}, indent=1
        )
    )


if __name__ == "__main__":
    main()
