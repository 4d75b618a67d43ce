"""Drive SGLang's REAL HiCacheFile storage backend (sglang 0.5.23,
sglang/srt/mem_cache/hicache_storage.py + storage/file/lru_file_evictor.py), or kvfs's
KvfsStorage (``--backend kvfs``: kvfs.sglang_storage, loaded as SGLang loads a dynamic
backend, through its StorageBackendFactory), against a directory. Only the host KV pool
is ours: pages are CPU tensors handed to the backend's public batch_set / batch_get /
exists / batch_exists_v2 API, as SGLang's HiCacheController does. Runs inside the
engines venv with this checkout's kvfs on sys.path. Prints one JSON object (last
stdout line).

Scenarios:
  roundtrip  set pages, exists/batch_exists_v2, get bit-identical, re-set (skipped),
             restart (new instance, with the metadata cache that lists the directory
             at start-up): pages still hit; a vanished page is a clean miss (None).
  evict      SGLang's own LRUFileEvictor (max_size): it scans, sizes and unlinks its
             own files; the newest pages stay readable.
  pressure   more pages than the directory can hold, no SGLang evictor (the default):
             every set must succeed (kvfs evicts); survivors read back identical.
  interop    (KvfsStorage against HiCacheFile; --backend is ignored) KvfsStorage stores
             pages in DIR/kvfs and HiCacheFile the same pages in DIR/file: same names,
             same bytes; each backend reads the other's directory bit-identical; both
             write one directory; a removed page is a clean miss, a file shorter or
             longer than its page is a failure, never data. kvfs.direct.stats() per step.
  bench      the store and prefetch loop of sglang_bench.py: --requests requests of
             --pages pages (real SGLang page hashes of their tokens), one batch_set
             each, timed; "STORED" on stdout, then (--pause) waits for a line on stdin
             while the caller makes the reads cold; then, in a new backend instance,
             each request's prefetch I/O as SGLang's HiCacheController runs it
             (batch_exists per 128 pages up to the first miss, then batch_get into
             dummy pages copied into the host pool), timed; the host pool is compared
             with what was stored.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # kvfs from this checkout (pip install kvfs, elsewhere)

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

import kvfs.direct  # noqa: E402

# Llama-3-8B, page of 64 tokens, tp 1: 2*32*64*8*128*2 = 8 MiB per page
PAGE_TOKENS = 64
PAGE_ELEMS = 2 * 32 * PAGE_TOKENS * 8 * 128
PAGE_BYTES = PAGE_ELEMS * 2
MODEL = "meta-llama/Meta-Llama-3-8B"
KVFS = {"backend_name": "kvfs", "module_path": "kvfs.sglang_storage", "class_name": "KvfsStorage"}
"""The extra config that makes SGLang load kvfs's backend (--hicache-storage-backend dynamic)."""


def make(
    root: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    extra: dict | None = None,
    backend: str = "file",
) -> HiCacheFile:
    """HiCacheFile on ``root``, or (backend ``kvfs``) KvfsStorage made by SGLang's
    StorageBackendFactory from the dynamic-backend config, as SGLang makes it."""
    if backend == "kvfs":
        extra = {**KVFS, "file_storage_path": root, **(extra or {})}
    cfg = HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=MODEL,
        extra_config=extra,
    )
    if backend == "kvfs":
        s = StorageBackendFactory.create_backend("dynamic", cfg, None)
        assert type(s).__name__ == "KvfsStorage", type(s)
        return s
    return HiCacheFile(cfg, file_path=root)


def page(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(-32768, 32767, (PAGE_ELEMS,), dtype=torch.int16, generator=g).view(
        torch.bfloat16
    )


def key(i: int) -> str:
    return f"{i:064x}"  # SGLang keys are hex page hashes


def get_check(s: HiCacheFile, idx: list[int]) -> list[bool | str | None]:
    """True = identical, None = clean miss, 'CORRUPT' = returned but wrong bytes."""
    targets = [torch.zeros(PAGE_ELEMS, dtype=torch.bfloat16) for _ in idx]
    out: list[bool | str | None] = []
    for i, got in zip(idx, s.batch_get([key(i) for i in idx], targets), strict=False):
        if got is None:
            out.append(None)
        else:
            out.append(
                True if torch.equal(got.view(torch.int16), page(i).view(torch.int16)) else "CORRUPT"
            )
    return out


def set_pages(s: HiCacheFile, idx: list[int], batch: int = 8) -> list[bool]:
    ok = []
    for b in range(0, len(idx), batch):
        part = idx[b : b + batch]
        ok.append(s.batch_set([key(i) for i in part], [page(i) for i in part]))
    return ok


def scenario_roundtrip(a: argparse.Namespace) -> dict[str, object]:
    n = a.pages
    idx = list(range(n))
    res: dict[str, object] = {}
    s = make(a.dir, backend=a.backend)
    res["exists_before"] = sum(s.exists(key(i)) for i in idx)
    res["set"] = set_pages(s, idx)
    res["exists"] = sum(s.exists(key(i)) for i in idx)
    r = s.batch_exists_v2([key(i) for i in idx] + [key(n + 1)])
    res["batch_exists_v2_pages"] = (
        r.final_pages if hasattr(r, "final_pages") else next(iter(vars(r).values()))
    )
    res["got"] = get_check(s, idx)
    res["reset"] = set_pages(s, [0])  # exists -> skipped
    names = os.listdir(a.dir)
    res["n_files"] = len(names)
    res["example"] = sorted(names)[0]
    res["sizes"] = sorted({os.stat(os.path.join(a.dir, f)).st_size for f in names})
    res["tmp_leftovers"] = [f for f in names if f.endswith(".tmp")]
    # restart with the metadata cache on: it lists the directory at start-up
    s2 = make(a.dir, extra={"enable_metadata_cache": True}, backend=a.backend)
    res["cached_after_restart"] = sum(
        s2.metadata_cache.contains(s2._get_suffixed_key(key(i))) for i in idx
    )
    res["got_after_restart"] = get_check(s2, idx)
    s3 = make(a.dir, backend=a.backend)
    os.remove(os.path.join(a.dir, f"{s3._get_suffixed_key(key(0))}.bin"))
    res["vanished_exists"] = s3.exists(key(0))
    res["vanished_get"] = get_check(s3, [0])[0]
    return res


def scenario_evict(a: argparse.Namespace) -> dict[str, object]:
    n, keep = a.pages, a.keep
    lru = {"max_size": keep * PAGE_BYTES, "eviction_ratio": 1.0}
    s = make(a.dir, extra=lru, backend=a.backend)
    res: dict[str, object] = {"set": set_pages(s, list(range(n)), batch=1)}
    res["exists"] = [s.exists(key(i)) for i in range(n)]
    res["n_files"] = len([f for f in os.listdir(a.dir) if f.endswith(".bin")])
    res["got_newest"] = get_check(s, list(range(n - keep, n)))
    # restart: the evictor re-scans its own files (mtime order) and keeps the cap
    s2 = make(a.dir, extra=lru, backend=a.backend)
    res["set_after_restart"] = set_pages(s2, [n + 100], batch=1)
    res["n_files_after_restart"] = len([f for f in os.listdir(a.dir) if f.endswith(".bin")])
    return res


def scenario_pressure(a: argparse.Namespace) -> dict[str, object]:
    n = a.pages
    s = make(a.dir, backend=a.backend)
    t0 = time.monotonic()
    ok = set_pages(s, list(range(n)))
    res: dict[str, object] = {
        "set_ok": sum(ok),
        "set_batches": len(ok),
        "store_s": time.monotonic() - t0,
    }
    present = [s.exists(key(i)) for i in range(n)]
    res["present"] = sum(present)
    t0 = time.monotonic()
    scan = {e.name for e in os.scandir(a.dir)}
    res["scandir_s"] = time.monotonic() - t0
    in_scan = [f"{s._get_suffixed_key(key(i))}.bin" in scan for i in range(n)]
    # kvfs may still be evicting (down to its low watermark) between the two looks:
    # a page exists() saw may be gone from the scan, but then it must be gone for good
    res["scandir_matches_exists"] = all(
        sc == pr or (pr and not sc and not s.exists(key(i)))
        for i, (sc, pr) in enumerate(zip(in_scan, present, strict=True))
    )
    got = get_check(s, [i for i in range(n) if present[i]])
    res["got_ok"] = got.count(True)
    res["got_miss"] = got.count(None)
    res["got_corrupt"] = got.count("CORRUPT")
    res["newest_present"] = sum(present[-4:])
    return res


# ---------------------------------------------------------------------- KvfsStorage
def direct_delta(before: dict[str, int]) -> dict[str, int]:
    """kvfs.direct.stats() of this process since ``before``."""
    return {k: v - before[k] for k, v in kvfs.direct.stats().items()}


def listing(d: str) -> dict[str, str]:
    """Every file of ``d``: name -> sha256 of its bytes (read through the file system)."""
    out = {}
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def outcome(s: HiCacheFile, i: int) -> str:
    """What a single get() of page i does: 'ok', 'CORRUPT', 'miss', or the exception."""
    target = torch.zeros(PAGE_ELEMS, dtype=torch.bfloat16)
    try:
        got = s.get(key(i), target)
    except Exception as e:
        return f"raised {type(e).__name__}"
    if got is None:
        return "miss"
    return "ok" if torch.equal(got.view(torch.int16), page(i).view(torch.int16)) else "CORRUPT"


def scenario_interop(a: argparse.Namespace) -> dict[str, object]:
    n = a.pages
    idx = list(range(n))
    dk, df = os.path.join(a.dir, "kvfs"), os.path.join(a.dir, "file")
    res: dict[str, Any] = {}
    k = make(dk, backend="kvfs")
    res["class"] = f"{type(k).__module__}.{type(k).__name__}"
    res["mro"] = [c.__name__ for c in type(k).__mro__]
    res["file_path"] = k.file_path
    s0 = kvfs.direct.stats()
    res["exists_before"] = sum(k.exists(key(i)) for i in idx)
    res["set"] = k.batch_set([key(i) for i in idx], [page(i) for i in idx])  # one batch
    res["stats_set"] = direct_delta(s0)
    res["exists"] = sum(k.exists(key(i)) for i in idx)
    res["batch_exists"] = k.batch_exists([key(i) for i in idx] + [key(n + 1)])
    res["batch_exists_v2"] = k.batch_exists_v2([key(i) for i in idx] + [key(n + 1)]).kv_hit_pages
    s1 = kvfs.direct.stats()
    res["got"] = get_check(k, idx)
    res["get_one"] = outcome(k, n - 1)
    res["stats_get"] = direct_delta(s1)
    s2 = kvfs.direct.stats()
    res["reset"] = k.batch_set([key(0), key(1)], [page(0), page(1)])  # here already: skipped
    res["stats_reset"] = direct_delta(s2)
    # HiCacheFile stores the same pages in its own directory: same names, same bytes
    f = make(df)
    res["file_set"] = set_pages(f, idx)
    lk, lf = listing(dk), listing(df)
    res["names_kvfs"], res["names_file"] = sorted(lk), sorted(lf)
    res["same_bytes"] = lk == lf
    res["sizes"] = sorted({os.stat(os.path.join(dk, x)).st_size for x in lk})
    res["suffix"] = k._get_suffixed_key("") == f._get_suffixed_key("")
    # each reads the other's directory
    s3 = kvfs.direct.stats()
    res["kvfs_reads_file_dir"] = get_check(make(df, backend="kvfs"), idx)
    res["stats_kvfs_reads_file_dir"] = direct_delta(s3)
    res["file_reads_kvfs_dir"] = get_check(make(dk), idx)
    # one directory written by both; a restart (metadata cache: listdir) finds all
    make(dk).batch_set([key(n), key(n + 1)], [page(n), page(n + 1)])
    k2 = make(dk, backend="kvfs", extra={"enable_metadata_cache": True})
    both = [*idx, n, n + 1]
    res["restart_cached"] = sum(
        k2.metadata_cache.contains(k2._get_suffixed_key(key(i))) for i in both
    )
    res["restart_got"] = get_check(k2, both)
    # misses and failures (a fresh instance: no metadata cache)
    k3 = make(dk, backend="kvfs")
    os.remove(k3.page_path(key(0)))
    res["removed_exists"] = k3.exists(key(0))
    res["removed_batch_exists"] = k3.batch_exists([key(i) for i in idx])
    res["removed_get"] = outcome(k3, 0)
    res["never_stored_get"] = outcome(k3, 10**6)
    os.truncate(k3.page_path(key(1)), PAGE_BYTES // 2)  # shorter than its page
    with open(k3.page_path(key(2)), "ab") as fh:  # longer than its page
        fh.write(b"\0" * 4096)
    res["damaged_batch_get"] = get_check(k3, [0, 1, 2, 3])
    res["short_get"] = outcome(k3, 1)
    res["long_get"] = outcome(k3, 2)
    res["counters"] = k3.counters
    res["tmp_leftovers"] = [x for d in (dk, df) for x in os.listdir(d) if not x.endswith(".bin")]
    res["stats_total"] = kvfs.direct.stats()
    for s in (k, k2, k3):
        s.close()
    return res


class HostPages:
    """The host KV pool's part a prefetch touches (an MHA pool's flat pages)."""

    def __init__(self, pages: int) -> None:
        self.buf = torch.zeros((pages, PAGE_ELEMS), dtype=torch.bfloat16)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(PAGE_ELEMS, dtype=torch.bfloat16)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.buf[int(index) // PAGE_TOKENS].copy_(data_page)


def prefetch(storage: HiCacheFile, pool: HostPages, tokens: list[int]) -> dict[str, Any]:
    """One request's prefetch I/O as SGLang's HiCacheController runs it
    (managers/cache_controller.py ``_storage_hit_query``, then ``_page_transfer`` with
    ``_generic_page_get``; that module imports torchvision, which the engines venv
    lacks, so its steps are followed here): ``batch_exists`` per 128 pages up to the
    first miss, then ``batch_get`` per 128 pages into dummy pages, each page up to the
    first None copied into the host pool."""
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    hashes = get_storage_hash_str(tokens, None, page_size=PAGE_TOKENS)
    t0 = time.perf_counter()
    hit: list[str] = []
    for start in range(0, len(hashes), STORAGE_BATCH_SIZE):
        batch = hashes[start : start + STORAGE_BATCH_SIZE]
        n = storage.batch_exists(batch, HiCacheStorageExtraInfo(prefix_keys=None))
        hit.extend(batch[:n])
        if n < len(batch):
            break
    t1 = time.perf_counter()
    done = 0
    for start in range(0, len(hit), STORAGE_BATCH_SIZE):
        batch = hit[start : start + STORAGE_BATCH_SIZE]
        data = storage.batch_get(batch, [pool.get_dummy_flat_data_page() for _ in batch])
        count = 0
        for i, got in enumerate(data or []):
            if got is None:
                break
            pool.set_from_flat_data_page((start + i) * PAGE_TOKENS, got)
            count += 1
        done += count
        if count != len(batch):
            break
    t2 = time.perf_counter()
    return {"found": len(hit), "loaded": done, "query_s": t1 - t0, "load_s": t2 - t1}


def request_tokens(r: int, pages: int) -> list[int]:
    """Request r's prompt: ``pages`` stored pages and one more (the new turn: never stored)."""
    g = torch.Generator().manual_seed(1000 + r)
    return torch.randint(0, 128000, ((pages + 1) * PAGE_TOKENS,), generator=g).tolist()


def bench_page(base: torch.Tensor, r: int, p: int) -> torch.Tensor:
    """Page p of request r: seeded noise with the request and page numbers on top."""
    out = base.clone()
    out.view(torch.int16)[:2] = torch.tensor([r, p], dtype=torch.int16)
    return out


def syncfs(d: str) -> float:
    """Seconds a syncfs(2) of ``d``'s file system takes (what makes HiCacheFile's
    stores durable on ext4; KvfsStorage's are durable when batch_set returns)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        t0 = time.perf_counter()
        if libc.syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs")
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def scenario_bench(a: argparse.Namespace) -> dict[str, object]:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    s = make(a.dir, backend=a.backend)
    base = page(7)
    reqs = [request_tokens(r, a.pages) for r in range(a.requests)]
    full = a.pages * PAGE_TOKENS
    res: dict[str, Any] = {"backend": type(s).__name__, "page_bytes": PAGE_BYTES}
    d0 = kvfs.direct.stats()
    store_s = []
    for r, tokens in enumerate(reqs):
        keys = get_storage_hash_str(tokens[:full], None, page_size=PAGE_TOKENS)
        data = [bench_page(base, r, p) for p in range(a.pages)]
        t0 = time.perf_counter()
        ok = s.batch_set(keys, data)  # SGLang's write-back: one batch_set per <= 128 pages
        store_s.append(time.perf_counter() - t0)
        assert ok, f"batch_set of request {r} failed"
    res["syncfs_s"] = syncfs(a.dir)
    res["store_s"] = store_s
    res["stats_store"] = direct_delta(d0)
    if a.pause:
        print("STORED", flush=True)
        sys.stdin.readline()
    pool = HostPages(a.pages + 1)
    s2 = make(a.dir, backend=a.backend)  # a new backend: a restarted engine
    d1 = kvfs.direct.stats()
    steps, identical = [], []
    for r, tokens in enumerate(reqs):
        step = prefetch(s2, pool, tokens)
        steps.append(step)
        identical.append(
            all(
                torch.equal(pool.buf[p].view(torch.int16), bench_page(base, r, p).view(torch.int16))
                for p in range(step["loaded"])
            )
        )
        pool.buf.zero_()
    res["stats_prefetch"] = direct_delta(d1)
    res["prefetch"], res["identical"] = steps, identical
    loaded = sum(x["loaded"] for x in steps)
    stored = a.requests * a.pages
    load_s = [x["load_s"] for x in steps]
    res["hit_rate"] = loaded / stored
    res["store_MBps"] = stored * PAGE_BYTES / sum(store_s) / 1e6
    res["store_durable_MBps"] = stored * PAGE_BYTES / (sum(store_s) + res["syncfs_s"]) / 1e6
    res["load_MBps"] = loaded * PAGE_BYTES / sum(load_s) / 1e6 if loaded else 0.0
    res["load_ms_per_request"] = statistics.median(load_s) * 1e3
    res["prefetch_ms_per_request"] = (
        statistics.median(x["query_s"] + x["load_s"] for x in steps) * 1e3
    )
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["roundtrip", "evict", "pressure", "interop", "bench"])
    p.add_argument("--dir", required=True)
    p.add_argument("--backend", choices=["file", "kvfs"], default="file")
    p.add_argument("--pages", type=int, default=8, help="pages (bench: per request)")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--requests", type=int, default=8, help="bench: requests")
    p.add_argument("--pause", action="store_true", help="bench: wait for stdin after storing")
    a = p.parse_args()
    a.dir = os.path.abspath(a.dir)
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    scenarios = {
        "roundtrip": scenario_roundtrip,
        "evict": scenario_evict,
        "pressure": scenario_pressure,
        "interop": scenario_interop,
        "bench": scenario_bench,
    }
    res = scenarios[a.scenario](a)
    res["scenario"] = a.scenario
    print(json.dumps(res), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
