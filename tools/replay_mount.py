"""Replay kvtrace workloads against a real kvfs mount and score the mount's eviction.

For each workload and capacity (a fraction of the trace's footprint), format a pool
whose data area holds exactly that many chunk files, mount it with the eviction
order under test, replay the trace through the filesystem (kvtrace.replay: reads on
hits, LMCache-style writes on misses, no client-side eviction), and report the token
hit rate under the prefix rule, evictions and device bytes written, next to the
simulator's numbers for the same policy and capacity.

    .venv/bin/python tools/replay_mount.py [--workloads qa,agentic] [--capacities 0.3]
        [--policies kvfs,lru] [--scale 0.5] [--json] [--fresh-grace S]
        [--mount-options "--high-watermark 0.995 --low-watermark 0.99"]

Chunks are 64 KiB files on a pool with 64 KiB units (one unit per chunk), so a run
moves a few hundred MiB instead of the hundreds of GiB of real 32 MiB chunks; the
eviction decisions are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvtrace
import traces

from kvfs.testing.harness import make_image, mounted

UNIT = 64 * 1024
META = 16 << 20


def run_one(
    workload: str,
    fraction: float,
    policy: str,
    scale: float,
    seed: int,
    grace: float | None = None,
    extra: tuple[str, ...] = (),
) -> dict[str, object]:
    if workload in kvtrace.WORKLOADS:
        trace = kvtrace.make_trace(workload, scale=scale, seed=seed)
    else:  # a trace of the suite (tools/traces.py), at its own size
        trace = traces.SUITE[workload][2]()
    chunks = kvtrace.footprint_chunks(trace)
    units = max(int(chunks * fraction), 8)
    # data area = `units` units; 1 MiB head + metadata before it
    size = (1 << 20) + META + units * UNIT
    with tempfile.TemporaryDirectory(prefix="kvreplay-") as tmp:
        img = make_image(Path(tmp) / "dev.img", size)
        mnt = Path(tmp) / "mnt"
        # the mount's default grace unless one is named: 5 s of this replay's writes
        # exceed the whole (16-64 MiB) pool, and the grace's byte bound (a 64th of
        # the pool) is what keeps the order the policy's (docs/eviction.md)
        options = [] if grace is None else ["--fresh-grace", str(grace)]
        options += extra
        with mounted(
            mnt,
            [img],
            "--format",
            "--unit-size",
            "64K",
            "--meta-size",
            str(META),
            "--eviction",
            policy,
            *options,
            log_file=Path(tmp) / "kvfs.log",
        ):
            root = mnt / "kv"
            root.mkdir()
            result = kvtrace.replay(trace, root, UNIT)
            stats = json.loads(os.getxattr(mnt, "user.kvfs.stats"))
        sim = kvtrace.run_policy(policy, trace, units * UNIT, UNIT)
        # the mount's order of events: room made before the new chunk is tracked
        first = kvtrace.run_policy(policy, trace, units * UNIT, UNIT, evict_first=True)
    return {
        "workload": workload,
        "capacity_fraction": fraction,
        "policy": policy,
        "fresh_grace": "default" if grace is None else grace,
        "mount_options": " ".join(extra),
        "capacity_chunks": units,
        "footprint_chunks": chunks,
        "mount_hit_rate": round(result.hit_tokens / result.prompt_tokens, 4),
        "sim_hit_rate": round(sim.hit_tokens / sim.prompt_tokens, 4),
        "sim_evict_first_hit_rate": round(first.hit_tokens / first.prompt_tokens, 4),
        "errors": result.errors,
        "evictions": stats["store"]["evictions"],
        "room_waits": stats["store"]["room_waits"],
        "device_bytes_written": stats["store"]["device_bytes_written"],
        "seconds": round(result.seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--workloads", default="qa,agentic", help="kvtrace workloads or tools/traces.py names"
    )
    ap.add_argument("--capacities", default="0.3")
    ap.add_argument("--policies", default="kvfs,lru")
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--fresh-grace", type=float, default=None, help="the mount's (default: its own, 5 s)"
    )
    ap.add_argument(
        "--mount-options",
        default="",
        help='more options for `kvfs mount`, e.g. "--high-watermark 0.99 --low-watermark 0.98"',
    )
    args = ap.parse_args(argv)
    extra = tuple(args.mount_options.split())
    rows = []
    for workload in args.workloads.split(","):
        for fraction in map(float, args.capacities.split(",")):
            for policy in args.policies.split(","):
                row = run_one(
                    workload, fraction, policy, args.scale, args.seed, args.fresh_grace, extra
                )
                rows.append(row)
                if not args.json:
                    print(
                        f"{workload:8} {fraction:4.0%} {policy:5} mount {row['mount_hit_rate']:.1%}"
                        f"  sim {row['sim_hit_rate']:.1%}  evictions {row['evictions']:6}"
                        f"  errors {row['errors']}  {row['seconds']} s",
                        flush=True,
                    )
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
