"""Drive SGLang's REAL HiCacheFile storage backend (sglang 0.5.23,
sglang/srt/mem_cache/hicache_storage.py + storage/file/lru_file_evictor.py) against a
directory. Only the host KV pool is ours: pages are CPU tensors handed to the
backend's public batch_set / batch_get / exists / batch_exists_v2 API, as SGLang's
HiCacheController does. Prints one JSON object (last stdout line).

Scenarios:
  roundtrip  set pages, exists/batch_exists_v2, get bit-identical, re-set (skipped),
             restart (new instance, with the metadata cache that lists the directory
             at start-up): pages still hit; a vanished page is a clean miss (None).
  evict      SGLang's own LRUFileEvictor (max_size): it scans, sizes and unlinks its
             own files; the newest pages stay readable.
  pressure   more pages than the directory can hold, no SGLang evictor (the default):
             every set must succeed (kvfs evicts); survivors read back identical.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

# Llama-3-8B, page of 64 tokens, tp 1: 2*32*64*8*128*2 = 8 MiB per page
PAGE_TOKENS = 64
PAGE_ELEMS = 2 * 32 * PAGE_TOKENS * 8 * 128
PAGE_BYTES = PAGE_ELEMS * 2
MODEL = "meta-llama/Meta-Llama-3-8B"


def make(root: str, tp_rank: int = 0, tp_size: int = 1, extra: dict | None = None) -> HiCacheFile:
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
    s = make(a.dir)
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
    s2 = make(a.dir, extra={"enable_metadata_cache": True})
    res["cached_after_restart"] = sum(
        s2.metadata_cache.contains(s2._get_suffixed_key(key(i))) for i in idx
    )
    res["got_after_restart"] = get_check(s2, idx)
    s3 = make(a.dir)
    os.remove(os.path.join(a.dir, f"{s3._get_suffixed_key(key(0))}.bin"))
    res["vanished_exists"] = s3.exists(key(0))
    res["vanished_get"] = get_check(s3, [0])[0]
    return res


def scenario_evict(a: argparse.Namespace) -> dict[str, object]:
    n, keep = a.pages, a.keep
    s = make(a.dir, extra={"max_size": keep * PAGE_BYTES, "eviction_ratio": 1.0})
    res: dict[str, object] = {"set": set_pages(s, list(range(n)), batch=1)}
    res["exists"] = [s.exists(key(i)) for i in range(n)]
    res["n_files"] = len([f for f in os.listdir(a.dir) if f.endswith(".bin")])
    res["got_newest"] = get_check(s, list(range(n - keep, n)))
    # restart: the evictor re-scans its own files (mtime order) and keeps the cap
    s2 = make(a.dir, extra={"max_size": keep * PAGE_BYTES, "eviction_ratio": 1.0})
    res["set_after_restart"] = set_pages(s2, [n + 100], batch=1)
    res["n_files_after_restart"] = len([f for f in os.listdir(a.dir) if f.endswith(".bin")])
    return res


def scenario_pressure(a: argparse.Namespace) -> dict[str, object]:
    n = a.pages
    s = make(a.dir)
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["roundtrip", "evict", "pressure"])
    p.add_argument("--dir", required=True)
    p.add_argument("--pages", type=int, default=8)
    p.add_argument("--keep", type=int, default=3)
    a = p.parse_args()
    a.dir = os.path.abspath(a.dir)
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    res = {"roundtrip": scenario_roundtrip, "evict": scenario_evict, "pressure": scenario_pressure}[
        a.scenario
    ](a)
    res["scenario"] = a.scenario
    print(json.dumps(res), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
