"""``kvfs stats``: a mounted pool's figures, once or refreshing (``--watch``).

The figures come from the root's ``user.kvfs.stats`` xattr (JSON, one getxattr: the
daemon builds it on its own thread, cost independent of the number of files). Every
figure printed here is explained in docs/operations.md ("What kvfs stats shows").
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from kvfs.cli import daemon
from kvfs.cli.args import parse_seconds
from kvfs.cli.outcome import EXIT_OK
from kvfs.common.errors import UserError
from kvfs.common.sizes import format_size
from kvfs.store.control import STATS_XATTR

HELP = "statistics of a mounted pool"
CLEAR = "\x1b[H\x1b[2J"
"""Cursor home, clear the screen (a terminal's refresh)."""
DIRECTORY_ROWS = 20
"""Top-level directories shown (largest first); the JSON has up to 256."""


def add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("mountpoint", help="a kvfs mount (its root or any path inside it)")
    s.add_argument("--json", action="store_true", help="every figure, as JSON")
    s.add_argument(
        "--watch",
        "-w",
        action="store_true",
        help="refresh until Ctrl-C, with rates (throughput, hit rate, evictions/s)",
    )
    s.add_argument(
        "--interval",
        type=_interval,
        default=2.0,
        metavar="SECONDS",
        help="seconds between refreshes of --watch (2)",
    )
    s.add_argument(
        "--count",
        type=_count,
        default=0,
        metavar="N",
        help="stop --watch after N refreshes (0: until Ctrl-C)",
    )


def _interval(text: str) -> float:
    value = parse_seconds(text)
    if value < 0.1:
        raise argparse.ArgumentTypeError(f"{text}: at least 0.1 seconds")
    return value


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text}: a whole number of refreshes")
    return int(text)


def read_stats(mountpoint: str) -> dict[str, Any]:
    """The mount's statistics; a one-line :class:`UserError` if it is not a kvfs mount."""
    root = _mount_root(mountpoint)
    try:
        raw = os.getxattr(root, STATS_XATTR.decode())
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise UserError(daemon.stale_mount_message(root)) from None
        raise UserError(f"{mountpoint}: not a kvfs mount ({e.strerror})") from None
    stats: dict[str, Any] = json.loads(raw)
    stats["mountpoint"] = root
    return stats


def _mount_root(path: str) -> str:
    """The mount point above ``path`` (``kvfs stats /mnt/kv/lmcache`` works too)."""
    path = os.path.realpath(path)
    stale = daemon.stale_kvfs_mount(path)
    if stale is not None:
        raise UserError(daemon.stale_mount_message(stale))
    if not os.path.exists(path):
        raise UserError(f"{path}: no such file or directory")
    while not os.path.ismount(path) and path != "/":
        path = os.path.dirname(path)
    return path


def run(args: argparse.Namespace) -> int:
    stats = read_stats(args.mountpoint)
    if args.json and args.watch:
        return watch_json(args.mountpoint, args.interval, args.count, sys.stdout, stats)
    if args.json:
        print(json.dumps(stats, indent=2))
        return EXIT_OK
    if not args.watch:
        print(render(stats), end="")
        return EXIT_OK
    return watch(args.mountpoint, args.interval, args.count, sys.stdout, stats)


def watch_json(
    mountpoint: str,
    interval: float,
    count: int,
    out: TextIO,
    first: dict[str, Any],
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """``--watch --json``: one sample per line (JSON lines), the first at once, then
    one every ``interval`` s, each flushed as it is taken. Ctrl-C ends it (exit 0)."""
    cur, shown = first, 0
    try:
        while True:
            out.write(json.dumps(cur) + "\n")
            out.flush()
            shown += 1
            if count and shown >= count:
                return EXIT_OK
            sleep(interval)
            cur = read_stats(mountpoint)
    except KeyboardInterrupt:
        return EXIT_OK


def watch(
    mountpoint: str,
    interval: float,
    count: int,
    out: TextIO,
    first: dict[str, Any],
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Refresh every ``interval`` s: the rates since the last sample, then the figures.
    On a terminal each refresh redraws the screen, cut to fit it (:func:`fit`); in a
    pipe each is printed whole after the last. Ctrl-C ends it (exit 0)."""
    tty = out.isatty()
    prev, prev_t = first, time.monotonic()
    shown = 0
    try:
        while True:
            sleep(interval)
            cur, now = read_stats(mountpoint), time.monotonic()
            page = rates(prev, cur, now - prev_t) + render(cur)
            if tty:
                page = fit(page, shutil.get_terminal_size())
            out.write((CLEAR if tty else "\n") + page)
            out.flush()
            prev, prev_t = cur, now
            shown += 1
            if count and shown >= count:
                return EXIT_OK
    except KeyboardInterrupt:
        if tty:
            out.write("\n")
        return EXIT_OK


def fit(page: str, size: os.terminal_size) -> str:
    """``page`` cut to a terminal of ``size``: no line wider than it (a long line
    ends in ``~``), and its first rows only (the most important come first: the
    rates, then the summary, then the tables), the last of them saying how many
    lines did not fit. The cursor ends on the last row, so nothing scrolls."""
    width, height = max(size.columns, 20), max(size.lines, 3)
    lines = page.rstrip("\n").split("\n")
    if len(lines) > height - 1:
        hidden = len(lines) - (height - 2)
        lines = [*lines[: height - 2], f"... {hidden} more lines (a larger terminal shows them)"]
    return "\n".join(x if len(x) <= width else x[: width - 1] + "~" for x in lines) + "\n"


# ---------------------------------------------------------------------------- text
def _n(value: int) -> str:
    return f"{value:,}"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _rate(nbytes: float, seconds: float) -> str:
    return f"{format_size(max(nbytes, 0) / seconds)}/s"


def rates(prev: dict[str, Any], cur: dict[str, Any], seconds: float) -> str:
    """The watch view's top lines: what moved between two samples ``seconds`` apart."""
    seconds = max(seconds, 1e-6)
    a, b = prev["store"], cur["store"]
    ca, cb = prev["cache"], cur["cache"]
    la, lb = prev.get("lookups", {}), cur.get("lookups", {})
    hits = cb["hits"] - ca["hits"]
    misses = cb["misses"] - ca["misses"]
    found = lb.get("hit", 0) - la.get("hit", 0)
    absent = lb.get("miss", 0) - la.get("miss", 0)
    evicted = b["evictions"] - a["evictions"]
    lines = [
        f"kvfs stats --watch {cur['mountpoint']}   every {seconds:.1f} s   "
        f"{time.strftime('%H:%M:%S')}",
        f"throughput     read {_rate(b['bytes_read'] - a['bytes_read'], seconds)}"
        f" ({_rate(b['bytes_read_device'] - a['bytes_read_device'], seconds)} waited for a "
        f"device), written {_rate(b['bytes_written'] - a['bytes_written'], seconds)}",
        f"requests       {(b['reads'] - a['reads']) / seconds:.0f} reads/s, "
        f"{(b['writes'] - a['writes']) / seconds:.0f} writes/s",
        f"hit rate       cache {_pct(hits, hits + misses)} of {hits + misses} unit lookups, "
        f"names found {_pct(found, found + absent)} of {found + absent} lookups",
        f"evictions      {evicted / seconds:.1f} files/s",
        "",
    ]
    return "\n".join(lines) + "\n"


def render(stats: dict[str, Any]) -> str:
    """The figures of one sample, as ``kvfs stats`` prints them."""
    s, c, m, e = (stats[k] for k in ("store", "cache", "metadata", "eviction"))
    pool = stats.get("pool", {})
    name = f"kvfs:{pool['label']}" if pool.get("label") else "kvfs"
    ndev = len(stats["devices"])
    lines = [
        f"pool           {name} on {stats.get('mountpoint', '?')}: {ndev} device"
        f"{'s' if ndev != 1 else ''}, unit {format_size(s['unit_size'])}, "
        f"eviction {e['policy']}" + (f", uuid {pool['uuid']}" if pool.get("uuid") else ""),
        f"files          {_n(s['files'])} in {_n(s['directories'])} directories, "
        f"{_n(s['open_handles'])} open",
        f"space          {format_size(s['used_bytes'])} of {format_size(s['capacity_bytes'])} "
        f"used ({_pct(s['used_bytes'], s['capacity_bytes'])}), "
        f"{format_size(s['free_bytes'])} free, {format_size(s['dirty_bytes'])} not yet on a "
        "device",
        f"read           {_n(s['reads'])} requests, {format_size(s['bytes_read'])} "
        f"({format_size(s['bytes_read_memory'])} from memory, "
        f"{format_size(s['bytes_read_device'])} waited for a device)",
        f"written        {_n(s['writes'])} requests, {format_size(s['bytes_written'])}",
    ]
    if "lookups" in stats:
        lk = stats["lookups"]
        lines.append(f"lookups        {_n(lk['hit'])} found, {_n(lk['miss'])} not found")
    if "cluster" in stats:
        cl = stats["cluster"]
        lines.append(
            f"cluster        {cl['state']} ({cl['master']}, publish {cl['publish_mode']}): "
            f"{_n(cl['hits'])} hits, {_n(cl['misses'])} misses, "
            f"{format_size(cl['bytes_fetched'])} fetched; {_n(cl['published'])} published "
            f"({format_size(cl['bytes_published'])}), {_n(cl['publish_dropped'])} dropped, "
            f"{_n(cl['publish_queue'])} queued; {_n(cl['deleted'])} deleted; "
            f"{_n(cl['fetch_failed'])} fetches failed ({_n(cl['checksum_failures'])} did "
            "not verify)"
        )
    lines += [
        f"cache          {format_size(c['bytes'])} of {format_size(c['capacity'])}, "
        f"{_n(c['hits'])} hits, {_n(c['misses'])} misses "
        f"({_pct(c['hits'], c['hits'] + c['misses'])} hits)",
        f"eviction       {_n(s['evictions'])} files evicted ({_n(s['orphan_evictions'])} "
        f"orphans); {_n(e['orphans'])} orphans now (writer exited); headroom "
        f"{format_size(s.get('headroom_bytes', 0))}, {_n(s.get('room_waits', 0))} writes "
        f"waited for room ({s.get('room_wait_seconds', 0):.2f} s)"
        + (f"; policy rebuilt {_n(e['policy_faults'])} times" if e.get("policy_faults") else ""),
        f"integrity      {_n(s['corruptions'])} checksum failures, {_n(s['quarantined'])} "
        f"quarantined, {_n(s['unreadable_files'])} unreadable (member missing)",
        f"metadata       checkpoint {format_size(m['checkpoint_bytes'])} of "
        f"{format_size(m['limit_bytes'])} allowed, area {format_size(m['area_bytes'])}, "
        f"journal {format_size(m['journal_bytes'])}; {_n(m['evictions'])} files evicted "
        "for room",
        "",
        _table(
            ["DEVICE", "SIZE", "FREE", "READ", "WRITTEN", "ERRORS", "STATE"],
            [
                [
                    d["path"],
                    format_size(sp["data_bytes"]),
                    format_size(sp["free_bytes"]),
                    format_size(d["bytes_read"]),
                    format_size(d["bytes_written"]),
                    _n(d["errors"]),
                    "ok" if sp["writable"] else "failed a write: no new data",
                ]
                for d, sp in zip(stats["devices"], stats["space"], strict=True)
            ],
        ),
    ]
    if len({d["size"] for d in stats["devices"]}) > 1:  # data: the first holds metadata
        lines.append("(members of different sizes: all of each is used)")
    dirs = stats.get("directories", [])
    if dirs:
        rows = [
            [
                r["name"],
                format_size(r["used_bytes"]),
                format_size(r["quota_bytes"]) if r["quota_bytes"] else "-",
                _pct(r["used_bytes"], r["quota_bytes"]) if r["quota_bytes"] else "-",
                r["policy"],
            ]
            for r in dirs[:DIRECTORY_ROWS]
        ]
        lines += ["", _table(["DIRECTORY", "USED", "QUOTA", "OF QUOTA", "POLICY"], rows)]
        if len(dirs) > DIRECTORY_ROWS:
            lines.append(f"  ... and {len(dirs) - DIRECTORY_ROWS} more (kvfs stats --json)")
    ev = stats.get("evictions", [])
    if ev:
        rows = [[r["reason"], _n(r["files"]), r["directory"]] for r in ev[:DIRECTORY_ROWS]]
        lines += ["", _table(["EVICTED FOR", "FILES", "DIRECTORY"], rows)]
    return "\n".join(lines) + "\n"


def _table(head: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell; the first and last (names, words)
    left-aligned, the figures between right-aligned."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    last = len(head) - 1

    def line(cells: list[str]) -> str:
        parts = [
            cell.ljust(w) if i in (0, last) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return "\n".join(line(r) for r in [head, *rows])


__all__ = [
    "HELP",
    "add_arguments",
    "fit",
    "rates",
    "read_stats",
    "render",
    "run",
    "watch",
    "watch_json",
]
