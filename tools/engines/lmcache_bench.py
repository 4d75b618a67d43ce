#!/usr/bin/env python3
"""The REAL LMCache store/retrieve loop on kvfs vs on ext4, same-size loop devices:
LMCache's ``local_disk`` on ext4 and on kvfs, and kvfs's storage plugin
(:mod:`kvfs.lmcache_plugin`, through :mod:`kvfs.direct`) on kvfs, in one run.

Reproduce (root, FUSE, loop devices, the engines venv from tools/engines_env.sh)::

    .venv/bin/python tools/engines/lmcache_bench.py --out docs/bench/lmcache_plugin.json

Two images of the same size on the same host filesystem, each a loop device with
``--direct-io=on`` (no host page cache below, as tools/bench.py). ext4: ``mkfs.ext4``
+ ``mount -o noatime``. kvfs: ``kvfs format`` + mount (defaults), directory policy
engine-managed. Per repetition, every variant once, in an order rotated by one each
repetition: ``local_disk`` buffered and O_DIRECT (``extra_config: {use_odirect:
true}``) on ext4 and on kvfs, and the plugin on kvfs. Each is a fresh LMCache engine
(lmcache 0.5.6, tools/engines/lmcache_plugin_driver.py ``bench``: Llama-3-8B bf16,
256-token chunks of 32 MiB, ``local_cpu`` off so every hit is a disk read, 4 writer
threads, one ``engine.store`` per 2-chunk request) that stores N chunks — timed until
LMCache has indexed them all, i.e. every write returned; then a ``syncfs`` of the
directory's file system, timed apart: store + syncfs is the *durable* store (kvfs and
the plugin are durable at close, so their syncfs costs ~nothing) — then the read is
made cold (ext4: ``sync`` + ``drop_caches``; kvfs: unmount + remount +
``drop_caches``, since kvfs keeps its own unit cache), then every chunk is retrieved
(timed, and per request) and compared bit for bit. Throughput = bytes / phase wall
time. Reported: the median of ``--reps`` runs per variant, and the median of the
per-repetition (paired) ratios.
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
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))

from bench import drop_caches, fs_mounted, loop_dev, preallocate  # noqa: E402

from kvfs.testing.harness import kvfs_command, make_image, stop, unmount, wait_mounted  # noqa: E402

ENGINES_PY = Path(os.environ.get("KVFS_ENGINES_VENV", REPO / ".venv-engines")) / "bin" / "python"
DRIVER = REPO / "tools" / "engines" / "lmcache_plugin_driver.py"


class Kvfs:
    def __init__(self, dev: str, mnt: Path, log: Path) -> None:
        self.dev, self.mnt, self.log = dev, mnt, log
        self.proc: subprocess.Popen[bytes] | None = None

    def mount(self) -> None:
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                *kvfs_command(),
                "mount",
                "--foreground",
                str(self.mnt),
                self.dev,
                "--log-file",
                str(self.log),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        wait_mounted(self.proc, self.mnt, 30.0)

    def unmount(self) -> None:
        if self.proc is not None:
            code = stop(self.proc, self.mnt)
            self.proc = None
            if code != 0:
                raise RuntimeError(f"kvfs exited {code}; see {self.log}")

    def cold(self) -> None:
        self.unmount()
        drop_caches()
        self.mount()


DRIVER_STDERR_TAIL = 20000
"""Characters of a failed driver's stderr the error shows (the end: its traceback)."""


def _tail(err: IO[bytes]) -> str:
    """The end of a failed driver's stderr (a file), to show with its failure."""
    err.seek(0)
    text: str = err.read().decode(errors="replace")
    if not text.strip():
        return "; its stderr was empty"
    return f"; its stderr ends:\n{text[-DRIVER_STDERR_TAIL:]}"


def one_run(root: Path, variant: str, chunks: int, cold: Any) -> dict[str, Any]:
    if root.exists():
        shutil.rmtree(root)
    mode, _, _ = variant.split("/")
    cmd = [
        str(ENGINES_PY),
        str(DRIVER),
        "bench",
        "--dir",
        str(root),
        "--backend",
        "plugin" if mode in ("plugin", "ring") else "local_disk",
        "--chunks",
        "2",
        "--requests",
        str(chunks // 2),
        "--cpu-gib",
        "1.0",
        "--disk-gib",
        "64",
        "--pause",
    ]
    if mode == "odirect":
        cmd.append("--odirect")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.pop("PYTHONPATH", None)
    if mode == "ring":  # the plugin as a process that may not open the devices gets it
        env["KVFS_DIRECT_ROUTE"] = "ring"
    return run_paused(cmd, env, variant, cold)


def run_paused(cmd: list[str], env: dict[str, str], variant: str, cold: Any) -> dict[str, Any]:
    """Run a driver that stores, says STORED and waits: make the read cold
    (``cold()``), let it go on, and return the JSON of its last line."""
    with tempfile.TemporaryFile() as err:  # the driver's stderr: shown if it fails
        p = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            cwd="/",
        )
        assert p.stdin and p.stdout
        line = p.stdout.readline()
        if line.strip() != "STORED":
            p.kill()
            p.wait()
            raise RuntimeError(f"{variant}: driver said {line!r}{_tail(err)}")
        cold()
        p.stdin.write("go\n")
        p.stdin.flush()
        out = p.stdout.read()
        if p.wait() != 0:
            raise RuntimeError(f"{variant}: driver exited {p.returncode}{_tail(err)}")
    res: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return res


METRICS = ("store_MBps", "store_durable_MBps", "retrieve_MBps")
RATIOS = {
    # name: (numerator variant, numerator metric, denominator variant, its metric)
    "odirect: kvfs/ext4 retrieve": (
        "odirect/kvfs/local_disk",
        "retrieve_MBps",
        "odirect/ext4/local_disk",
        "retrieve_MBps",
    ),
    "buffered: kvfs/ext4 retrieve": (
        "buffered/kvfs/local_disk",
        "retrieve_MBps",
        "buffered/ext4/local_disk",
        "retrieve_MBps",
    ),
    "odirect: kvfs store / ext4 durable store": (
        "odirect/kvfs/local_disk",
        "store_MBps",
        "odirect/ext4/local_disk",
        "store_durable_MBps",
    ),
    "buffered: kvfs store / ext4 durable store": (
        "buffered/kvfs/local_disk",
        "store_MBps",
        "buffered/ext4/local_disk",
        "store_durable_MBps",
    ),
    "odirect: kvfs store / ext4 store": (
        "odirect/kvfs/local_disk",
        "store_MBps",
        "odirect/ext4/local_disk",
        "store_MBps",
    ),
    "buffered: kvfs store / ext4 store": (
        "buffered/kvfs/local_disk",
        "store_MBps",
        "buffered/ext4/local_disk",
        "store_MBps",
    ),
    "plugin/kvfs local_disk odirect retrieve": (
        "plugin/kvfs/plugin",
        "retrieve_MBps",
        "odirect/kvfs/local_disk",
        "retrieve_MBps",
    ),
    "plugin/kvfs local_disk odirect store": (
        "plugin/kvfs/plugin",
        "store_MBps",
        "odirect/kvfs/local_disk",
        "store_MBps",
    ),
    "plugin/ext4 odirect retrieve": (
        "plugin/kvfs/plugin",
        "retrieve_MBps",
        "odirect/ext4/local_disk",
        "retrieve_MBps",
    ),
    "plugin/ext4 buffered retrieve": (
        "plugin/kvfs/plugin",
        "retrieve_MBps",
        "buffered/ext4/local_disk",
        "retrieve_MBps",
    ),
    "plugin/ext4 odirect durable store": (
        "plugin/kvfs/plugin",
        "store_MBps",
        "odirect/ext4/local_disk",
        "store_durable_MBps",
    ),
    "ring plugin/ext4 odirect retrieve": (
        "ring/kvfs/plugin",
        "retrieve_MBps",
        "odirect/ext4/local_disk",
        "retrieve_MBps",
    ),
    "ring plugin/ext4 buffered retrieve": (
        "ring/kvfs/plugin",
        "retrieve_MBps",
        "buffered/ext4/local_disk",
        "retrieve_MBps",
    ),
    "ring plugin/ext4 odirect durable store": (
        "ring/kvfs/plugin",
        "store_MBps",
        "odirect/ext4/local_disk",
        "store_durable_MBps",
    ),
    "plugin/ext4 odirect store": (
        "plugin/kvfs/plugin",
        "store_MBps",
        "odirect/ext4/local_disk",
        "store_MBps",
    ),
}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    med: dict[str, Any] = {}
    for v, rs in runs.items():
        if not rs:
            continue
        med[v] = {k: statistics.median(r[k] for r in rs) for k in METRICS}
        med[v]["retrieve_ms_per_request"] = statistics.median(
            x for r in rs for x in r["retrieve_ms"]
        )
        med[v]["store_call_ms_per_request"] = statistics.median(
            x for r in rs for x in r["store_call_ms"]
        )
    ratios = {}
    for name, (a, ka, b, kb) in RATIOS.items():
        n = min(len(runs.get(a, [])), len(runs.get(b, [])))
        if n:
            per_rep = [runs[a][i][ka] / runs[b][i][kb] for i in range(n)]
            ratios[name] = {"median": statistics.median(per_rep), "per_rep": per_rep}
    return {"median": med, "paired_ratios": ratios}


def ext4_and_kvfs(stack: ExitStack, work: Path, image: int) -> tuple[Path, Kvfs]:
    """Two preallocated images of ``image`` bytes as loop devices under ``work``: one
    ext4 (mounted at ``work/ext4``), one kvfs pool (mounted at ``work/kvfs``); both
    unmounted and detached by ``stack``."""
    devs = {}
    for name in ("ext4", "kvfs"):
        img = make_image(work / f"{name}.img", image)
        preallocate(img, image)
        devs[name] = stack.enter_context(loop_dev(img))
    mkfs = ["mkfs.ext4", "-q", "-F", "-E", "nodiscard,lazy_itable_init=0,lazy_journal_init=0"]
    subprocess.run([*mkfs, devs["ext4"]], check=True, capture_output=True)
    ext4 = stack.enter_context(fs_mounted(devs["ext4"], work / "ext4"))
    subprocess.run(
        [*kvfs_command(), "format", "--force", devs["kvfs"]], check=True, capture_output=True
    )
    preallocate(work / "kvfs.img", image)  # fill the holes the format's discard punched
    kv = Kvfs(devs["kvfs"], work / "kvfs", work / "kvfs.log")
    stack.callback(unmount, work / "kvfs")
    stack.callback(kv.unmount)
    kv.mount()
    return ext4, kv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "lmcache_plugin.json")
    ap.add_argument("--chunks", type=int, default=16, help="32 MiB chunks per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--image", type=int, default=2 << 30)
    ap.add_argument("--modes", default="buffered,odirect,plugin,ring")
    ap.add_argument("--work", type=Path, default=None)
    a = ap.parse_args()
    modes = a.modes.split(",")
    disk_modes = [m for m in modes if m not in ("plugin", "ring")]
    variants = [f"{m}/{fs}/local_disk" for m in disk_modes for fs in ("ext4", "kvfs")]
    if "plugin" in modes:
        variants.append("plugin/kvfs/plugin")
    if "ring" in modes:  # the plugin through the daemon's ring (KVFS_DIRECT_ROUTE=ring)
        variants.append("ring/kvfs/plugin")
    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kvfs-lmcache-bench-", dir=a.work))
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        with ExitStack() as stack:
            ext4, kv = ext4_and_kvfs(stack, work, a.image)
            (work / "kvfs" / "lmcache").mkdir()
            subprocess.run(
                [
                    *kvfs_command(),
                    "policy",
                    str(work / "kvfs" / "lmcache"),
                    "--set",
                    "engine-managed",
                ],
                check=True,
                capture_output=True,
            )
            for rep in range(a.reps):
                k = rep % len(variants)
                for v in variants[k:] + variants[:k]:
                    fs = v.split("/")[1]
                    base = ext4 if fs == "ext4" else work / "kvfs"
                    root = base / "lmcache" / f"run-{v.replace('/', '-')}-{rep}"
                    cold = drop_caches if fs == "ext4" else kv.cold
                    r = one_run(root, v, a.chunks, cold)
                    runs[v].append(r)
                    print(
                        f"rep {rep} {v:24s}: store {r['store_MBps']:6.0f} MB/s"
                        f" (durable {r['store_durable_MBps']:6.0f})"
                        f"  retrieve {r['retrieve_MBps']:6.0f} MB/s",
                        flush=True,
                    )
                    shutil.rmtree(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    summary = summarize(runs)
    doc = {
        "meta": {
            "command": f".venv/bin/python tools/engines/lmcache_bench.py --out {a.out}"
            + (f" --reps {a.reps}" if a.reps != 3 else "")
            + (f" --chunks {a.chunks}" if a.chunks != 16 else ""),
            "engine": "lmcache 0.5.6 LMCacheEngine; LocalDiskBackend or the kvfs storage "
            "plugin (kvfs.lmcache_plugin.KvfsDirectBackend); CPU connector stand-in",
            "chunk_bytes": 33554432,
            "chunks_per_run": a.chunks,
            "reps": a.reps,
            "image_bytes": a.image,
            "loop": "--direct-io=on, same host filesystem",
            "cold_read": "ext4: sync + drop_caches; kvfs: remount + drop_caches",
            "durable_store": "store + syncfs of the directory's file system",
            "host": platform.node(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "seconds": round(time.monotonic() - t_start, 1),
        },
        **summary,
        "runs": runs,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary["median"], indent=1))
    print(json.dumps({k: v["median"] for k, v in summary["paired_ratios"].items()}, indent=1))


if __name__ == "__main__":
    main()
