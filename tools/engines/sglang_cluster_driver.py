"""SGLang's REAL HiCacheFile on one node of a kvfs cluster (kvfs mount --cluster).

The backend and the host pages are those of ``sglang_hicache_driver.py`` (imported
from it): a real ``HiCacheFile`` over one flat directory of a kvfs mount, pages
handed to its public ``batch_set`` / ``exists`` / ``batch_exists_v2`` /
``batch_get``. Page ``i`` always holds the same bytes (``page(i)``, seeded by ``i``),
so a node that never stored it can check it bit for bit. Prints one JSON object.

How HiCacheFile (sglang 0.5.23) asks whether a page exists -- all per name, so a
kvfs node answers a page it does not have from the cluster:
  - ``exists(key)``: ``os.path.exists(<dir>/<key>_<model>_<rank>_<size>.bin)``
    (after the metadata cache, when that is on);
  - ``batch_exists_v2(keys)``: ``os.path.isfile`` per page without the metadata
    cache; with it, cache then ``os.path.exists`` per page not in the cache;
  - only the metadata cache's start-up scan (``os.listdir``) and LRUFileEvictor's
    scan list the directory: they see this node's local files only.

Scenarios:
  set  batch_set pages FIRST..FIRST+N-1 (8 per batch); exists() of each.
  get  on a node that did not store them: batch_exists_v2 of the first half (isfile),
       exists() of the second half (os.path.exists), both timed; then batch_get of
       every page seen, compared with page(i). ``--metadata-cache``: the instance
       lists the directory at start-up (local files only) and falls back to
       os.path.exists for the rest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch
from sglang_hicache_driver import get_check, key, make, page, set_pages


def file_sha(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def scenario_set(a: argparse.Namespace) -> dict[str, object]:
    idx = list(range(a.first, a.first + a.pages))
    s = make(a.dir)
    res: dict[str, object] = {"set": set_pages(s, idx)}
    res["exists"] = [s.exists(key(i)) for i in idx]
    paths = [os.path.join(a.dir, f"{s._get_suffixed_key(key(i))}.bin") for i in idx]
    res["names"] = [os.path.basename(p) for p in paths]
    res["sha256"] = [file_sha(p) for p in paths]
    res["expected_sha256"] = [
        hashlib.sha256(page(i).view(torch.uint8).numpy().tobytes()).hexdigest() for i in idx
    ]
    return res


def scenario_get(a: argparse.Namespace) -> dict[str, object]:
    idx = list(range(a.first, a.first + a.pages))
    half = len(idx) // 2
    extra = {"enable_metadata_cache": True} if a.metadata_cache else None
    s = make(a.dir, extra=extra)
    res: dict[str, object] = {
        "listed_at_start": sorted(os.listdir(a.dir)),
        "cached_at_start": (
            sum(s.metadata_cache.contains(s._get_suffixed_key(key(i))) for i in idx)
            if s.metadata_cache is not None
            else None
        ),
    }
    t0 = time.monotonic()
    r = s.batch_exists_v2([key(i) for i in idx[:half]])
    res["batch_exists_v2_s"] = time.monotonic() - t0
    res["batch_exists_v2_pages"] = r.kv_hit_pages
    t0 = time.monotonic()
    res["exists"] = [s.exists(key(i)) for i in idx[half:]]
    res["exists_s"] = time.monotonic() - t0
    seen = idx[: r.kv_hit_pages] + [i for i, e in zip(idx[half:], res["exists"], strict=True) if e]
    got = dict(zip(seen, get_check(s, seen), strict=True))
    res["got"] = [got.get(i) for i in idx]  # None: not seen, or a clean miss
    paths = [os.path.join(a.dir, f"{s._get_suffixed_key(key(i))}.bin") for i in idx]
    res["sha256"] = [file_sha(p) if i in got else None for i, p in zip(idx, paths, strict=True)]
    res["exists_after"] = [s.exists(key(i)) for i in seen]  # local files now
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["set", "get"])
    p.add_argument("--dir", required=True)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--pages", type=int, default=8)
    p.add_argument("--metadata-cache", action="store_true")
    a = p.parse_args()
    a.dir = os.path.abspath(a.dir)
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    res = {"set": scenario_set, "get": scenario_get}[a.scenario](a)
    res["scenario"] = a.scenario
    print(json.dumps(res), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
