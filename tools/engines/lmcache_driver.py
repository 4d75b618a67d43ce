"""Drive LMCache's real LMCacheEngine + StorageManager + LocalDiskBackend (lmcache 0.5.6)
against a directory, with a CPU stand-in for the GPU copy step only.

Runs inside the engines venv (tools/engines_env.sh); the kvfs mount itself is run by the
test from the main venv. Prints one JSON object on stdout (last line).

    python lmcache_driver.py SCENARIO --dir D [--odirect] [--world-size W --worker-id I] ...

Scenarios:
  roundtrip  store N chunks (realistic Llama-3-8B shape, 256 tokens = 32 MiB each) in
             R requests, wait for the disk writes, lookup, retrieve bit-identical,
             then restart (new engine, same directory): LMCache forgets its index,
             stores the same prefixes again (O_DIRECT: overwrite in place, no O_TRUNC)
             and retrieves them bit-identical.
  evict      max_local_disk_size smaller than the data: LMCache's own LRU must unlink
             its oldest files; the newest stay retrievable.
  bench      timed store (incl. waiting for the disk writes) and retrieve loops.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
import uuid

import torch

# Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16; LMCache chunk = 256 tokens
LAYERS, KV_HEADS, HEAD_DIM, CHUNK = 32, 8, 128, 256
DTYPE = torch.bfloat16
MODEL = "meta-llama/Meta-Llama-3-8B"
CHUNK_BYTES = 2 * LAYERS * CHUNK * KV_HEADS * HEAD_DIM * 2  # 33,554,432


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402


class CPUConnector(GPUConnectorInterface):
    """The only stand-in: the "GPU" KV cache is a CPU tensor [2, layers, tokens, hidden]
    passed as kwargs['kvcache']; from_gpu/to_gpu copy token ranges between it and
    LMCache's MemoryObj (format KV_2LTD, the same layout the CUDA kernels produce)."""

    def _view(self, memory_obj, start: int, end: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
        t = memory_obj.tensor
        assert t is not None
        return t.view(2, LAYERS, end - start, KV_HEADS * HEAD_DIM)

    def from_gpu(self, memory_obj, start, end, **kwargs):  # type: ignore[no-untyped-def]
        self._view(memory_obj, start, end).copy_(kwargs["kvcache"][:, :, start:end, :])

    def to_gpu(self, memory_obj, start, end, **kwargs):  # type: ignore[no-untyped-def]
        kwargs["kvcache"][:, :, start:end, :].copy_(self._view(memory_obj, start, end))

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):  # type: ignore[no-untyped-def]
        for m, s, e in zip(memory_objs, starts, ends, strict=False):
            self.from_gpu(m, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):  # type: ignore[no-untyped-def]
        for m, s, e in zip(memory_objs, starts, ends, strict=False):
            self.to_gpu(m, s, e, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, KV_HEADS * HEAD_DIM])


def make_engine(args: argparse.Namespace, max_disk_gib: float) -> LMCacheEngine:
    extra = {"use_odirect": True} if args.odirect else None
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=False,  # the CPU tier is only the staging allocator: every hit is a disk read
        max_local_cpu_size=args.cpu_gib,
        local_disk=f"file://{args.dir}",
        max_local_disk_size=max_disk_gib,
        extra_config=extra,
        lmcache_instance_id=f"kvfs-test-{uuid.uuid4().hex[:8]}",
    )
    return build_engine(config, args.world_size, args.worker_id)


def build_engine(
    config: LMCacheEngineConfig, world_size: int = 1, worker_id: int = 0
) -> LMCacheEngine:
    """LMCache's engine for ``config``, over this file's model shape and CPU connector."""
    metadata = LMCacheMetadata(
        model_name=MODEL,
        world_size=world_size,
        local_world_size=world_size,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=DTYPE,
        kv_shape=(LAYERS, 2, CHUNK, KV_HEADS, HEAD_DIM),
    )
    engine = LMCacheEngineBuilder.get_or_create(
        config.lmcache_instance_id,
        config,
        metadata,
        CPUConnector(),
        lambda *a: None,
        lambda *a: None,
    )
    engine.post_init()
    return engine


def close_engine(engine: LMCacheEngine) -> None:
    LMCacheEngineBuilder.destroy(engine.config.lmcache_instance_id)


def request(seed: int, n_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their KV (distinct per seed and per TP rank via the seed)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128000, (n_chunks * CHUNK,), generator=g)
    kv = torch.randint(
        -32768,
        32767,
        (2, LAYERS, n_chunks * CHUNK, KV_HEADS * HEAD_DIM),
        dtype=torch.int16,
        generator=g,
    ).view(DTYPE)
    return tokens, kv


def wait_stored(engine: LMCacheEngine, tokens: torch.Tensor, timeout: float = 120) -> float:
    """Stores are asynchronous (4 disk writer threads); LMCache indexes a chunk only
    after its write() returned. Poll lookup until the whole prefix is on disk."""
    t0 = time.monotonic()
    while engine.lookup(tokens) < len(tokens):
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"only {engine.lookup(tokens)}/{len(tokens)} tokens stored")
        time.sleep(0.002)
    return time.monotonic() - t0


def retrieve_check(engine: LMCacheEngine, tokens: torch.Tensor, kv: torch.Tensor) -> int:
    out = torch.zeros_like(kv)
    mask = engine.retrieve(tokens, kvcache=out)
    got = int(mask.sum())
    if got and not torch.equal(out[:, :, :got].view(torch.int16), kv[:, :, :got].view(torch.int16)):
        raise AssertionError("retrieved KV differs from what was stored")
    return got


def files(d: str) -> dict[str, int]:
    return {os.path.basename(p): os.stat(p).st_size for p in glob.glob(os.path.join(d, "*"))}


def seed_of(args: argparse.Namespace, i: int) -> int:
    return 1000 * args.worker_id + i + 7 * args.seed


def scenario_roundtrip(args: argparse.Namespace) -> dict[str, object]:
    res: dict[str, object] = {}
    reqs = [request(seed_of(args, i), args.chunks) for i in range(args.requests)]
    total = args.requests * args.chunks
    engine = make_engine(args, max_disk_gib=args.disk_gib)
    try:
        res["f_bsize"] = engine.storage_manager.storage_backends["LocalDiskBackend"].os_disk_bs  # type: ignore[union-attr]
        res["use_odirect"] = engine.storage_manager.storage_backends["LocalDiskBackend"].use_odirect  # type: ignore[union-attr]
        for tokens, kv in reqs:
            engine.store(tokens, kvcache=kv)
        for tokens, _ in reqs:
            wait_stored(engine, tokens)
        res["lookup"] = [engine.lookup(t) for t, _ in reqs]
        res["retrieved"] = [retrieve_check(engine, t, kv) for t, kv in reqs]
        res["files"] = files(args.dir)
    finally:
        close_engine(engine)
    # restart: a new engine on the same directory forgets everything on disk
    engine = make_engine(args, max_disk_gib=args.disk_gib)
    try:
        res["lookup_after_restart"] = [engine.lookup(t) for t, _ in reqs]
        for tokens, kv in reqs:
            engine.store(tokens, kvcache=kv)
        for tokens, _ in reqs:
            wait_stored(engine, tokens)
        res["retrieved_after_restart"] = [retrieve_check(engine, t, kv) for t, kv in reqs]
        res["files_after_restart"] = files(args.dir)
    finally:
        close_engine(engine)
    res["expected_tokens"] = args.chunks * CHUNK
    res["expected_files"] = total
    return res


def scenario_evict(args: argparse.Namespace) -> dict[str, object]:
    """Budget of `keep` chunks; store `requests` one-chunk... requests."""
    res: dict[str, object] = {}
    reqs = [request(seed_of(args, i), args.chunks) for i in range(args.requests)]
    budget = args.keep * CHUNK_BYTES / 1024**3
    engine = make_engine(args, max_disk_gib=budget)
    try:
        for tokens, kv in reqs:
            engine.store(tokens, kvcache=kv)
            wait_stored(engine, tokens)
        res["lookup"] = [engine.lookup(t) for t, _ in reqs]
        res["retrieved"] = [retrieve_check(engine, t, kv) for t, kv in reqs]
        res["files"] = files(args.dir)
    finally:
        close_engine(engine)
    return res


def scenario_bench(args: argparse.Namespace) -> dict[str, object]:
    reqs = [request(seed_of(args, i), args.chunks) for i in range(args.requests)]
    nbytes = args.requests * args.chunks * CHUNK_BYTES
    engine = make_engine(args, max_disk_gib=args.disk_gib)
    try:
        t0 = time.monotonic()
        for tokens, kv in reqs:
            engine.store(tokens, kvcache=kv)
        for tokens, _ in reqs:
            wait_stored(engine, tokens)
        t_store = time.monotonic() - t0
        outs = [torch.empty_like(kv) for _, kv in reqs]
        if args.pause:  # let the caller make the read cold (drop_caches, remount)
            print("STORED", flush=True)
            sys.stdin.readline()
        t0 = time.monotonic()
        for (tokens, _), out in zip(reqs, outs, strict=False):
            assert int(engine.retrieve(tokens, kvcache=out).sum()) == len(tokens)
        t_retrieve = time.monotonic() - t0
        for (_, kv), out in zip(reqs, outs, strict=False):
            assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
    finally:
        close_engine(engine)
    return {
        "bytes": nbytes,
        "store_s": t_store,
        "retrieve_s": t_retrieve,
        "store_MBps": nbytes / t_store / 1e6,
        "retrieve_MBps": nbytes / t_retrieve / 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["roundtrip", "evict", "bench"])
    p.add_argument("--dir", required=True)
    p.add_argument("--odirect", action="store_true")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--worker-id", type=int, default=0)
    p.add_argument("--chunks", type=int, default=2, help="chunks per request")
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--keep", type=int, default=2, help="evict: disk budget in chunks")
    p.add_argument("--disk-gib", type=float, default=4.0)
    p.add_argument("--cpu-gib", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--pause",
        action="store_true",
        help="bench: print STORED and wait for a stdin line before retrieving",
    )
    args = p.parse_args()
    args.dir = os.path.abspath(args.dir)
    fn = {"roundtrip": scenario_roundtrip, "evict": scenario_evict, "bench": scenario_bench}
    res = fn[args.scenario](args)
    res["scenario"] = args.scenario
    print(json.dumps(res), flush=True)
    os._exit(0)  # LMCache leaves non-daemon threads behind


if __name__ == "__main__":
    main()
