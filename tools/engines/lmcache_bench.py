#!/usr/bin/env python3
"""The REAL LMCache store/retrieve loop on kvfs vs on ext4, same-size loop devices.

Reproduce (root, FUSE, loop devices, the engines venv from tools/engines_env.sh)::

    .venv/bin/python tools/engines/lmcache_bench.py --out docs/bench/lmcache.json

Two images of the same size on the same host filesystem, each a loop device with
``--direct-io=on`` (no host page cache below, as tools/bench.py). ext4: ``mkfs.ext4``
+ ``mount -o noatime``. kvfs: ``kvfs format`` + mount (defaults), directory policy
engine-managed. On each, per repetition, a fresh LMCache engine (lmcache 0.5.6,
tools/engines/lmcache_driver.py ``bench``: Llama-3-8B bf16, 256-token chunks of
32 MiB, ``local_cpu`` off so every hit is a disk read, 4 writer threads, one
``engine.store`` per 2-chunk request) stores N chunks — timed until LMCache has
indexed them all, i.e. every ``write()`` returned — then the read is made cold
(ext4: ``sync`` + ``drop_caches``; kvfs: unmount + remount + ``drop_caches``, since
kvfs keeps its own unit cache), then every chunk is retrieved (timed) and compared
bit for bit. Throughput = bytes / phase wall time; the median of ``--reps`` runs is
reported, in buffered and in O_DIRECT (``extra_config: {use_odirect: true}``) mode.
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
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))

from bench import drop_caches, fs_mounted, loop_dev, preallocate  # noqa: E402

from kvfs.harness import kvfs_command, make_image, stop, unmount, wait_mounted  # noqa: E402

ENGINES_PY = Path(os.environ.get("KVFS_ENGINES_VENV", REPO / ".venv-engines")) / "bin" / "python"
DRIVER = REPO / "tools" / "engines" / "lmcache_driver.py"


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


def one_run(root: Path, mode: str, chunks: int, cold: Any) -> dict[str, Any]:
    if root.exists():
        shutil.rmtree(root)
    cmd = [
        str(ENGINES_PY),
        str(DRIVER),
        "bench",
        "--dir",
        str(root),
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
    p = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd="/",
    )
    assert p.stdin and p.stdout
    line = p.stdout.readline()
    if line.strip() != "STORED":
        p.kill()
        raise RuntimeError(f"driver said {line!r}")
    cold()
    p.stdin.write("go\n")
    p.stdin.flush()
    out = p.stdout.read()
    if p.wait() != 0:
        raise RuntimeError(f"driver exited {p.returncode}")
    res: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "lmcache.json")
    ap.add_argument("--chunks", type=int, default=16, help="32 MiB chunks per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--image", type=int, default=2 << 30)
    ap.add_argument("--modes", default="buffered,odirect")
    ap.add_argument("--work", type=Path, default=None)
    a = ap.parse_args()
    modes = a.modes.split(",")
    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kvfs-lmcache-bench-", dir=a.work))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {m: {"ext4": [], "kvfs": []} for m in modes}
    try:
        with ExitStack() as stack:
            devs = {}
            for name in ("ext4", "kvfs"):
                img = make_image(work / f"{name}.img", a.image)
                preallocate(img, a.image)
                devs[name] = stack.enter_context(loop_dev(img))
            subprocess.run(
                [
                    "mkfs.ext4",
                    "-q",
                    "-F",
                    "-E",
                    "nodiscard,lazy_itable_init=0,lazy_journal_init=0",
                    devs["ext4"],
                ],
                check=True,
                capture_output=True,
            )
            ext4 = stack.enter_context(fs_mounted(devs["ext4"], work / "ext4"))
            subprocess.run(
                [*kvfs_command(), "format", "--force", devs["kvfs"]],
                check=True,
                capture_output=True,
            )
            preallocate(work / "kvfs.img", a.image)
            kv = Kvfs(devs["kvfs"], work / "kvfs", work / "kvfs.log")
            stack.callback(unmount, work / "kvfs")
            stack.callback(kv.unmount)
            kv.mount()
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
                for mode in modes:
                    for name in ("ext4", "kvfs"):
                        root = (
                            (ext4 if name == "ext4" else work / "kvfs")
                            / "lmcache"
                            / f"run-{mode}-{rep}"
                        )
                        cold = drop_caches if name == "ext4" else kv.cold
                        r = one_run(root, mode, a.chunks, cold)
                        runs[mode][name].append(r)
                        print(
                            f"{mode:8s} {name:4s} rep {rep}: store {r['store_MBps']:7.0f} MB/s"
                            f"  retrieve {r['retrieve_MBps']:7.0f} MB/s",
                            flush=True,
                        )
                        shutil.rmtree(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    summary: dict[str, Any] = {}
    for mode in modes:
        s: dict[str, Any] = {}
        for name in ("ext4", "kvfs"):
            s[name] = {
                k: statistics.median(r[k] for r in runs[mode][name])
                for k in ("store_MBps", "retrieve_MBps")
            }
        s["kvfs_over_ext4"] = {
            k: s["kvfs"][k] / s["ext4"][k] for k in ("store_MBps", "retrieve_MBps")
        }
        summary[mode] = s
    doc = {
        "meta": {
            "command": ".venv/bin/python tools/engines/lmcache_bench.py --out docs/bench/lmcache.json",
            "engine": "lmcache 0.5.6 LMCacheEngine + LocalDiskBackend (CPU connector stand-in)",
            "chunk_bytes": 33554432,
            "chunks_per_run": a.chunks,
            "reps": a.reps,
            "image_bytes": a.image,
            "loop": "--direct-io=on, same host filesystem",
            "cold_read": "ext4: sync + drop_caches; kvfs: remount + drop_caches",
            "host": platform.node(),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "seconds": round(time.monotonic() - t_start, 1),
        },
        "median": summary,
        "runs": runs,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
