"""``kvfs stats``: a mounted pool's figures, once or refreshing (``--watch``)."""

from __future__ import annotations

import argparse
import json
import os

from kvfs.errors import UserError

EXIT_OK = 0


def add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from kvfs.fs import STATS_XATTR

    try:
        raw = os.getxattr(args.mountpoint, STATS_XATTR.decode())
    except OSError as e:
        raise UserError(f"{args.mountpoint}: not a kvfs mount ({e.strerror})") from None
    stats = json.loads(raw)
    if args.json:
        print(json.dumps(stats, indent=2))
        return EXIT_OK
    s = stats["store"]
    gib = 2**30
    print(f"files       {s['files']:>12}   directories {s['directories']:>10}")
    print(
        f"capacity    {s['capacity_bytes'] / gib:>10.2f} GiB   used {s['used_bytes'] / gib:.2f} GiB"
        f"   free {s['free_bytes'] / gib:.2f} GiB"
    )
    print(f"reads       {s['reads']:>12}   {s['bytes_read'] / gib:.2f} GiB served")
    print(f"writes      {s['writes']:>12}   {s['bytes_written'] / gib:.2f} GiB accepted")
    print(
        f"device I/O  read {s['device_bytes_read'] / gib:.2f} GiB, "
        f"written {s['device_bytes_written'] / gib:.2f} GiB"
    )
    c = stats["cache"]
    print(
        f"cache       {c['bytes'] >> 20} / {c['capacity'] >> 20} MiB, "
        f"{c['hits']} hits, {c['misses']} misses"
    )
    print(f"integrity   {s['corruptions']} checksum failures, {s['quarantined']} quarantined")
    print(f"eviction    {s['evictions']} files evicted ({s['orphan_evictions']} orphans)")
    m = stats["metadata"]
    print(
        f"metadata    checkpoint {m['checkpoint_bytes'] / 2**20:.1f} MiB of "
        f"{m['limit_bytes'] / 2**20:.1f} MiB allowed, journal {m['journal_bytes'] / 2**20:.1f} "
        f"MiB, area {m['area_bytes'] / 2**20:.0f} MiB; {m['evictions']} files evicted for room"
    )
    for d, space in zip(stats["devices"], stats["space"], strict=True):
        state = "" if space["writable"] else ", failed a write: no new data"
        print(
            f"device      {d['path']}: {space['data_bytes'] / gib:.2f} GiB of data, "
            f"{space['free_bytes'] / gib:.2f} GiB free, {d['errors']} errors{state}"
        )
    if len({space["data_bytes"] for space in stats["space"]}) > 1:
        print("            (members of different sizes: all of each is used)")
    return EXIT_OK
