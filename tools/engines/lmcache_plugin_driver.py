"""Drive LMCache's real LMCacheEngine (lmcache 0.5.6) with kvfs's storage plugin
(kvfs.lmcache_plugin.KvfsDirectBackend, loaded by LMCache from ``storage_plugins``)
and with LMCache's own LocalDiskBackend, on one directory.

Runs inside the engines venv (tools/engines_env.sh) with this checkout's kvfs on
sys.path; the kvfs mount itself is run by the caller. The GPU copy step is the CPU
stand-in of lmcache_driver.py. Prints one JSON object on stdout (last line).

    python lmcache_plugin_driver.py interop --dir D [--odirect]
    python lmcache_plugin_driver.py bench --dir D --backend plugin|local_disk [--pause]

interop (one process, engines created and destroyed one after the other):
  A  plugin stores 2 requests x 2 chunks (+ 1 request to damage later), lookup,
     retrieve bit-identical; then: a file cut to half and a file removed are misses
     (a short read is never data)
  B  a new plugin engine (restart) finds the chunks on disk, retrieves them without
     storing, and a re-store writes nothing
  C  local_disk (``--odirect``: in its O_DIRECT mode, else buffered) stores 1 new
     request, and the requests of A again: it rewrites A's files, same names and bytes
  D  a new plugin engine retrieves local_disk's request bit-identical, directly
  E  plugin stores 1 new request; local_disk, its index told of those files by its
     own ``insert_key`` (its index lives in memory only: no LocalDiskBackend ever
     reads a file it did not write in this process), retrieves them bit-identical
     without rewriting them; local_disk in the other mode than in C
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # kvfs from this checkout (pip install kvfs, elsewhere)

import torch  # noqa: E402
from lmcache.v1.cache_engine import LMCacheEngine  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache_driver import (  # noqa: E402
    CHUNK,
    CHUNK_BYTES,
    build_engine,
    close_engine,
    files,
    request,
    retrieve_check,
    wait_stored,
)

import kvfs.direct  # noqa: E402

PLUGIN = {
    "storage_plugin.kvfs.module_path": "kvfs.lmcache_plugin",
    "storage_plugin.kvfs.class_name": "KvfsDirectBackend",
}


def make_engine(args: argparse.Namespace, backend: str, odirect: bool = False) -> LMCacheEngine:
    common: dict[str, Any] = {
        "chunk_size": CHUNK,
        "local_cpu": False,  # the CPU tier is only the staging allocator
        "max_local_cpu_size": args.cpu_gib,
        "lmcache_instance_id": f"kvfs-plugin-{uuid.uuid4().hex[:8]}",
    }
    if backend == "plugin":
        config = LMCacheEngineConfig.from_defaults(
            **common,
            local_disk=None,
            max_local_disk_size=0,
            storage_plugins=["kvfs"],
            extra_config={**PLUGIN, "kvfs.path": args.dir},
        )
    else:
        config = LMCacheEngineConfig.from_defaults(
            **common,
            local_disk=f"file://{args.dir}",
            max_local_disk_size=args.disk_gib,
            extra_config={"use_odirect": True} if odirect else None,
        )
    engine = build_engine(config)
    names = engine.storage_manager.storage_backends  # type: ignore[union-attr]
    want = "kvfs" if backend == "plugin" else "LocalDiskBackend"
    # LMCache only logs a plugin that failed to load: insist it is there
    if want not in names:
        raise RuntimeError(f"{want} not among LMCache's backends {list(names)}")
    return engine


def backend_of(engine: LMCacheEngine, name: str) -> Any:
    return engine.storage_manager.storage_backends[name]  # type: ignore[union-attr]


def keys_of(engine: LMCacheEngine, tokens: torch.Tensor) -> list[Any]:
    return [key for _, _, key in engine.token_database.process_tokens(tokens=tokens)]


def sha(d: str) -> dict[str, str]:
    return {n: hashlib.sha256(Path(d, n).read_bytes()).hexdigest() for n in sorted(files(d))}


def identity(d: str) -> dict[str, list[int]]:
    out = {}
    for n in sorted(files(d)):
        st = os.stat(os.path.join(d, n))
        out[n] = [st.st_ino, st.st_mtime_ns, st.st_size]
    return out


def delta(before: dict[str, int]) -> dict[str, int]:
    now = kvfs.direct.stats()
    return {k: now[k] - before[k] for k in now}


def store_all(engine: LMCacheEngine, reqs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for tokens, kv in reqs:
        engine.store(tokens, kvcache=kv)
    for tokens, _ in reqs:
        wait_stored(engine, tokens)


def scenario_interop(args: argparse.Namespace) -> dict[str, object]:
    res: dict[str, Any] = {"chunk_bytes": CHUNK_BYTES}
    reqs_a = [request(10 + i, 2) for i in range(2)]
    reqs_x = [request(20, 2)]  # damaged at the end of A
    reqs_c = [request(30, 2)]  # local_disk -> plugin
    reqs_e = [request(40, 2)]  # plugin -> local_disk

    # A: the plugin stores, looks up, retrieves
    s0 = kvfs.direct.stats()
    engine = make_engine(args, "plugin")
    try:
        plugin = backend_of(engine, "kvfs")
        res["plugin_class"] = type(plugin).__name__
        res["plugin_bases"] = [c.__name__ for c in type(plugin).__mro__]
        res["lookup_before"] = [engine.lookup(t) for t, _ in reqs_a]
        store_all(engine, reqs_a + reqs_x)
        res["A_stats_store"] = delta(s0)
        s1 = kvfs.direct.stats()
        res["A_lookup"] = [engine.lookup(t) for t, _ in reqs_a + reqs_x]
        res["A_retrieved"] = [retrieve_check(engine, t, kv) for t, kv in reqs_a + reqs_x]
        res["A_stats_retrieve"] = delta(s1)
        res["A_landing_in_use"] = plugin.landing_in_use()  # every object freed
        res["A_files"] = files(args.dir)
        res["A_sha"] = sha(args.dir)
        # damage: chunk 1 of X cut to half; lookup and retrieve stop after chunk 0
        kx = keys_of(engine, reqs_x[0][0])
        cut = plugin.key_path(kx[1])
        os.truncate(cut, CHUNK_BYTES // 2)
        res["A_lookup_cut"] = engine.lookup(reqs_x[0][0])
        res["A_retrieved_cut"] = retrieve_check(engine, *reqs_x[0])
        # the file changing between lookup and read: the short read is a miss
        meta = plugin._known[kx[1]]
        obj = plugin.local_cpu_backend.allocate(meta.shape, meta.dtype, meta.fmt)
        res["A_short_read_served"] = plugin._load(kx[1], obj) is not None
        os.unlink(plugin.key_path(kx[0]))
        res["A_lookup_removed"] = engine.lookup(reqs_x[0][0])
        res["A_retrieved_removed"] = retrieve_check(engine, *reqs_x[0])
        os.unlink(cut)
        res["A_counters"] = dict(plugin.counters)
        probe = plugin.local_cpu_backend.allocate(meta.shape, meta.dtype, meta.fmt)
        res["A_aligned"] = probe.data_ptr % 4096 == 0
        probe.ref_count_down()
    finally:
        close_engine(engine)

    # B: restart; the directory is the index
    s2 = kvfs.direct.stats()
    engine = make_engine(args, "plugin")
    try:
        res["B_lookup"] = [engine.lookup(t) for t, _ in reqs_a]
        res["B_retrieved"] = [retrieve_check(engine, t, kv) for t, kv in reqs_a]
        store_all(engine, reqs_a)
        res["B_stats"] = delta(s2)
        res["B_sha"] = sha(args.dir)
    finally:
        close_engine(engine)

    # C: local_disk writes a new request, and rewrites A's (its index is empty)
    before = identity(args.dir)
    engine = make_engine(args, "local_disk", args.odirect)
    try:
        disk = backend_of(engine, "LocalDiskBackend")
        res["C_use_odirect"] = bool(disk.use_odirect)
        res["C_f_bsize"] = disk.os_disk_bs
        res["C_lookup_before"] = [engine.lookup(t) for t, _ in reqs_a + reqs_c]
        store_all(engine, reqs_a + reqs_c)
        res["C_retrieved"] = [retrieve_check(engine, t, kv) for t, kv in reqs_a + reqs_c]
        res["C_files"] = files(args.dir)
        res["C_sha"] = sha(args.dir)
        after = identity(args.dir)
        res["C_rewrote_A"] = all(after[n][1] != before[n][1] for n in before)
    finally:
        close_engine(engine)

    # D: the plugin reads local_disk's files
    s3 = kvfs.direct.stats()
    engine = make_engine(args, "plugin")
    try:
        res["D_lookup"] = [engine.lookup(t) for t, _ in reqs_c]
        res["D_retrieved"] = [retrieve_check(engine, t, kv) for t, kv in reqs_c]
        res["D_stats"] = delta(s3)
        # E (first half): the plugin writes a request local_disk never saw
        s4 = kvfs.direct.stats()
        store_all(engine, reqs_e)
        res["E_stats_store"] = delta(s4)
        keys_e = keys_of(engine, reqs_e[0][0])
    finally:
        close_engine(engine)

    # E: local_disk reads the plugin's files
    before = identity(args.dir)
    engine = make_engine(args, "local_disk", not args.odirect)
    try:
        disk = backend_of(engine, "LocalDiskBackend")
        res["E_use_odirect"] = bool(disk.use_odirect)
        shape, dtype = engine.metadata.get_shapes()[0], engine.metadata.get_dtypes()[0]
        for key in keys_e:  # what LocalDiskBackend records after each of its writes
            disk.insert_key(key, CHUNK_BYTES, shape, dtype, MemoryFormat.KV_2LTD)
        new = set(files(args.dir)) - set(res["C_files"])
        res["E_paths_match"] = sorted(disk._key_to_path(k) for k in keys_e) == sorted(
            os.path.join(args.dir, n) for n in new
        )
        res["E_lookup"] = [engine.lookup(t) for t, _ in reqs_e]
        res["E_retrieved"] = [retrieve_check(engine, t, kv) for t, kv in reqs_e]
        res["E_untouched"] = identity(args.dir) == before
    finally:
        close_engine(engine)
    res["files"] = files(args.dir)
    res["direct_total"] = delta(s0)
    return res


def syncfs(d: str) -> float:
    """Seconds a syncfs(2) of ``d``'s file system takes (what makes local_disk's
    stores durable on ext4; kvfs and the plugin are durable at close already)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        t0 = time.monotonic()
        if libc.syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs")
        return time.monotonic() - t0
    finally:
        os.close(fd)


def scenario_bench(args: argparse.Namespace) -> dict[str, object]:
    """Timed store (until LMCache indexes every chunk; then a syncfs, timed apart) and
    retrieve, as lmcache_driver.py bench, through ``--backend``; per request: how long
    ``engine.store`` blocked the caller, and the retrieve's latency."""
    reqs = [request(i, args.chunks) for i in range(args.requests)]
    nbytes = args.requests * args.chunks * CHUNK_BYTES
    s0 = kvfs.direct.stats()
    engine = make_engine(args, args.backend, args.odirect)
    store_call, retrieve_lat = [], []
    try:
        t0 = time.monotonic()
        for tokens, kv in reqs:
            t = time.monotonic()
            engine.store(tokens, kvcache=kv)
            store_call.append(time.monotonic() - t)
        for tokens, _ in reqs:
            wait_stored(engine, tokens)
        t_store = time.monotonic() - t0
        t_sync = syncfs(args.dir)
        outs = [torch.empty_like(kv) for _, kv in reqs]
        if args.pause:  # let the caller make the read cold (drop_caches, remount)
            print("STORED", flush=True)
            sys.stdin.readline()
        s1 = kvfs.direct.stats()
        t0 = time.monotonic()
        for (tokens, _), out in zip(reqs, outs, strict=True):
            t = time.monotonic()
            assert int(engine.retrieve(tokens, kvcache=out).sum()) == len(tokens)
            retrieve_lat.append(time.monotonic() - t)
        t_retrieve = time.monotonic() - t0
        for (_, kv), out in zip(reqs, outs, strict=True):
            assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
    finally:
        close_engine(engine)
    s2 = kvfs.direct.stats()
    return {
        "backend": args.backend,
        "odirect": args.odirect,
        "bytes": nbytes,
        "request_bytes": args.chunks * CHUNK_BYTES,
        "store_s": t_store,
        "sync_s": t_sync,
        "retrieve_s": t_retrieve,
        "store_MBps": nbytes / t_store / 1e6,
        "store_durable_MBps": nbytes / (t_store + t_sync) / 1e6,
        "retrieve_MBps": nbytes / t_retrieve / 1e6,
        "store_call_ms": [x * 1e3 for x in store_call],
        "retrieve_ms": [x * 1e3 for x in retrieve_lat],
        "direct_store": {k: s1[k] - s0[k] for k in s0},
        "direct_retrieve": {k: s2[k] - s1[k] for k in s0},
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["interop", "bench"])
    p.add_argument("--dir", required=True)
    p.add_argument("--backend", choices=["plugin", "local_disk"], default="plugin")
    p.add_argument("--odirect", action="store_true", help="local_disk's O_DIRECT mode (C; E: not)")
    p.add_argument("--chunks", type=int, default=2, help="bench: chunks per request")
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--disk-gib", type=float, default=4.0)
    p.add_argument("--cpu-gib", type=float, default=0.5)
    p.add_argument("--pause", action="store_true")
    args = p.parse_args()
    args.dir = os.path.abspath(args.dir)
    res = scenario_interop(args) if args.scenario == "interop" else scenario_bench(args)
    res["scenario"] = args.scenario
    print(json.dumps(res), flush=True)
    os._exit(0)  # LMCache leaves non-daemon threads behind


if __name__ == "__main__":
    main()
