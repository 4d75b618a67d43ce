"""Prometheus metrics of a mounted pool: ``kvfs mount --metrics HOST:PORT``.

The socket is bound before the daemon forks (a taken port is a one-line error, not a
daemon that dies later) and served inside the mount's trio loop, so a scrape reads the
store's counters on the thread that changes them: no lock, no torn figures, and no
request ever waits behind it for longer than building one page (its cost grows with
devices, FUSE operations and top-level directories, never with files; the first
scrape sums each top-level directory once, as ``kvfs stats`` does).

``prometheus_client`` formats the page from a private registry whose one collector
reads :meth:`Store.all_statistics` and the FUSE adapter's request counters
(:class:`~kvfs.fuse.counters.RequestCounters`, handed in by the caller) at scrape
time; kvfs's own counters stay plain integers on the data path. Names follow the
Prometheus conventions (``kvfs_`` prefix, base units, ``_total`` counters); each is
listed in docs/operations.md.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import trio

from kvfs.common.errors import UserError
from kvfs.common.timing import Histogram

if TYPE_CHECKING:
    from kvfs.fuse.counters import RequestCounters
    from kvfs.store.facade import Store

log = logging.getLogger(__name__)

REQUEST_LIMIT = 8192
"""Bytes of request head read at most; a longer one is answered 431."""
REQUEST_TIMEOUT = 10.0
"""Seconds a client has to send its request head."""


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``:PORT`` (all interfaces) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--metrics {address}: expected HOST:PORT, e.g. 127.0.0.1:9480")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def bind(address: str) -> Exporter:
    """A listening socket on ``address``; a clear :class:`UserError` if it cannot be had."""
    host, port = parse_address(address)
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise UserError(f"--metrics {address}: cannot resolve {host!r} ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(16)
    except OSError as e:
        sock.close()
        why = "already in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise UserError(f"--metrics {address}: cannot listen ({why})") from None
    sock.set_inheritable(False)
    return Exporter(sock)


class Exporter:
    """A bound listening socket; :meth:`serve` answers ``GET /metrics`` on it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    async def serve(self, store: Store, requests: RequestCounters) -> None:
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        registry.register(StoreCollector(store, requests))
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self.sock))

        async def handle(stream: trio.SocketStream) -> None:
            async with stream:
                try:
                    await _answer(stream, registry)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
                    log.debug("metrics client went away: %s", e)

        await trio.serve_listeners(handle, [listener])

    def close(self) -> None:
        self.sock.close()


async def _answer(stream: trio.SocketStream, registry: Any) -> None:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    head = b""
    with trio.move_on_after(REQUEST_TIMEOUT):
        while b"\r\n\r\n" not in head and b"\n\n" not in head and len(head) <= REQUEST_LIMIT:
            data = await stream.receive_some(4096)
            if not data:
                break
            head += data
    words = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0].split()
    if len(head) > REQUEST_LIMIT:
        await _send(stream, 431, "text/plain", b"request header too large\n")
    elif len(words) < 2:
        await _send(stream, 400, "text/plain", b"bad request\n")
    elif words[0] not in (b"GET", b"HEAD"):
        await _send(stream, 405, "text/plain", b"only GET\n", head_only=False)
    else:
        path = words[1].split(b"?", 1)[0]
        only_head = words[0] == b"HEAD"
        if path == b"/metrics":
            await _send(stream, 200, CONTENT_TYPE_LATEST, generate_latest(registry), only_head)
        elif path == b"/":
            page = b'<html><body><a href="/metrics">kvfs metrics</a></body></html>\n'
            await _send(stream, 200, "text/html", page, only_head)
        else:
            await _send(stream, 404, "text/plain", b"not found: try /metrics\n", only_head)


REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
REASONS[431] = "Request Header Fields Too Large"


async def _send(
    stream: trio.SocketStream, code: int, kind: str, body: bytes, head_only: bool = False
) -> None:
    head = (
        f"HTTP/1.1 {code} {REASONS[code]}\r\nContent-Type: {kind}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    await stream.send_all(head if head_only else head + body)


class StoreCollector:
    """Builds every family from one :meth:`Store.all_statistics` per scrape, and the
    FUSE adapter's ``requests``."""

    def __init__(self, store: Store, requests: RequestCounters) -> None:
        self.store, self.requests = store, requests

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            InfoMetricFamily,
        )

        stats = self.store.all_statistics()
        s, c, j, m, e = (stats[k] for k in ("store", "cache", "journal", "metadata", "eviction"))
        d = stats["direct"]

        def gauge(name: str, doc: str, value: float) -> Any:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> Any:
            return CounterMetricFamily(name, doc, value=value)

        def labelled(family: Any, rows: Iterable[tuple[list[str], float]]) -> Any:
            for labels, value in rows:
                family.add_metric(labels, value)
            return family

        def histograms(family: Any, rows: Iterable[tuple[list[str], Histogram]]) -> Any:
            for labels, h in rows:
                family.add_metric(labels, h.cumulative(), sum_value=h.sum)
            return family

        info = InfoMetricFamily("kvfs_pool", "The mounted pool")
        info.add_metric([], {k: str(v) for k, v in self.store.describe().items()})
        yield info
        yield gauge(
            "kvfs_capacity_bytes", "Bytes the pool holds for file data", s["capacity_bytes"]
        )
        yield gauge("kvfs_used_bytes", "Bytes of file data space in use", s["used_bytes"])
        yield gauge("kvfs_free_bytes", "Bytes of file data space free", s["free_bytes"])
        yield gauge("kvfs_dirty_bytes", "Bytes written, not yet on a device", s["dirty_bytes"])
        yield gauge("kvfs_files", "Files in the index", s["files"])
        yield gauge("kvfs_directories", "Directories in the index", s["directories"])
        yield gauge("kvfs_open_handles", "Files open through the mount", s["open_handles"])
        yield counter("kvfs_read_requests", "FUSE reads answered", s["reads"])
        yield counter(
            "kvfs_stale_size_reads",
            "FUSE reads answered EIO: the kernel asked past a size it had not yet seen shrink",
            s["stale_size_reads"],
        )
        yield counter("kvfs_write_requests", "FUSE writes accepted", s["writes"])
        yield labelled(
            CounterMetricFamily(
                "kvfs_read_bytes",
                "Bytes read through the mount, by where they came from (memory: the "
                "daemon's cache, readahead or unflushed writes; device: waited for a read)",
                labels=["source"],
            ),
            [(["memory"], s["bytes_read_memory"]), (["device"], s["bytes_read_device"])],
        )
        yield counter("kvfs_written_bytes", "Bytes written through the mount", s["bytes_written"])
        yield labelled(
            CounterMetricFamily(
                "kvfs_lookups",
                "Name lookups that reached the daemon, by outcome (a miss is ENOENT)",
                labels=["result"],
            ),
            [([k], v) for k, v in self.requests.lookups.items()],
        )
        yield labelled(
            CounterMetricFamily(
                "kvfs_cache_lookups", "Unit cache lookups, by outcome", labels=["result"]
            ),
            [(["hit"], c["hits"]), (["miss"], c["misses"])],
        )
        yield gauge("kvfs_cache_bytes", "Bytes held by the unit cache", c["bytes"])
        yield gauge("kvfs_cache_capacity_bytes", "The unit cache's limit (--cache)", c["capacity"])
        yield labelled(
            CounterMetricFamily(
                "kvfs_evictions",
                "Files evicted, by reason (space, quota, metadata, orphan) and top-level directory",
                labels=["reason", "directory"],
            ),
            [([r["reason"], r["directory"]], r["files"]) for r in stats["evictions"]],
        )
        yield gauge("kvfs_orphans", "Files whose last writer process is gone", e["orphans"])
        yield counter(
            "kvfs_eviction_policy_faults",
            "Times the eviction policy raised and was rebuilt from the namespace (a bug: "
            "the order restarts, no file is lost; the daemon's log has the traceback)",
            e["policy_faults"],
        )
        yield gauge(
            "kvfs_headroom_bytes",
            "Bytes background eviction keeps free now (follows the writes in flight)",
            s["headroom_bytes"],
        )
        yield counter(
            "kvfs_room_waits",
            "Writes that found the pool full and waited for eviction to make room",
            s["room_waits"],
        )
        yield counter(
            "kvfs_room_wait_seconds",
            "Time writes waited for eviction to make room, summed",
            s["room_wait_seconds"],
        )
        dirs = stats["directories"]
        yield labelled(
            GaugeMetricFamily(
                "kvfs_directory_used_bytes",
                "Bytes mapped by each top-level directory's files (the largest 256)",
                labels=["directory"],
            ),
            [([r["name"]], r["used_bytes"]) for r in dirs],
        )
        yield labelled(
            GaugeMetricFamily(
                "kvfs_directory_quota_bytes",
                "Quota of each top-level directory that has one (user.kvfs.quota)",
                labels=["directory"],
            ),
            [([r["name"]], r["quota_bytes"]) for r in dirs if r["quota_bytes"]],
        )
        yield counter(
            "kvfs_checksum_failures", "Units that failed their checksum", s["corruptions"]
        )
        yield counter("kvfs_quarantined_files", "Files quarantined for bad data", s["quarantined"])
        yield gauge(
            "kvfs_unreadable_files", "Files with data on a missing member", s["unreadable_files"]
        )

        devices = [
            (st["path"], st, dev.latency(), space)
            for dev, st, space in zip(
                self.store.pool.devices, stats["devices"], stats["space"], strict=True
            )
        ]
        per_device = [
            ("kvfs_device_read_bytes", "Bytes read from each device", "bytes_read"),
            ("kvfs_device_written_bytes", "Bytes written to each device", "bytes_written"),
            ("kvfs_device_errors", "Failed or short requests on each device", "errors"),
            ("kvfs_device_discards", "TRIM requests that each device accepted", "discards"),
        ]
        for name, doc, field in per_device:
            yield labelled(
                CounterMetricFamily(name, doc, labels=["device"]),
                [([p], st[field]) for p, st, _, _ in devices],
            )
        yield labelled(
            GaugeMetricFamily(
                "kvfs_device_free_bytes", "Bytes free on each device", labels=["device"]
            ),
            [([p], sp["free_bytes"]) for p, _, _, sp in devices],
        )
        yield labelled(
            GaugeMetricFamily(
                "kvfs_device_writable",
                "1 while a device takes new data (0 after a failed write)",
                labels=["device"],
            ),
            [([p], int(sp["writable"])) for p, _, _, sp in devices],
        )
        yield histograms(
            HistogramMetricFamily(
                "kvfs_device_request_duration_seconds",
                "Completed device requests, by device and operation",
                labels=["device", "op"],
            ),
            [([p, op], h) for p, _, lat, _ in devices for op, h in lat.items()],
        )

        journal = self.store.journal
        yield counter("kvfs_journal_commits", "Group commits of the metadata journal", j["flushes"])
        yield counter(
            "kvfs_journal_written_bytes", "Bytes of journal written by commits", j["journal_bytes"]
        )
        yield histograms(
            HistogramMetricFamily(
                "kvfs_journal_commit_duration_seconds", "Group commit write and flush"
            ),
            [([], journal.commit_latency.copy())],
        )
        yield histograms(
            HistogramMetricFamily(
                "kvfs_checkpoint_duration_seconds", "Metadata checkpoints, snapshot to durable"
            ),
            [([], journal.checkpoint_latency.copy())],
        )
        yield gauge(
            "kvfs_metadata_checkpoint_bytes", "Size of the last checkpoint", m["checkpoint_bytes"]
        )
        yield gauge(
            "kvfs_metadata_limit_bytes", "Largest checkpoint the area allows", m["limit_bytes"]
        )

        req = self.requests
        yield histograms(
            HistogramMetricFamily(
                "kvfs_fuse_request_duration_seconds",
                "FUSE requests answered by the daemon, by operation",
                labels=["op"],
            ),
            [([op], h.copy()) for op, h in sorted(req.latency.items())],
        )
        yield labelled(
            CounterMetricFamily(
                "kvfs_fuse_errors", "FUSE requests answered with an error", labels=["op", "errno"]
            ),
            [([op, code], n) for (op, code), n in sorted(req.errors.items())],
        )
        yield counter("kvfs_direct_maps", "Zero-copy (kvfs.client.direct) read leases", d["maps"])
        yield counter("kvfs_direct_commits", "Zero-copy writes committed", d["commits"])
        yield counter("kvfs_direct_aborts", "Zero-copy writes abandoned", d["aborts"])
        yield counter("kvfs_direct_mapped_bytes", "Bytes leased to readers", d["bytes_mapped"])
        yield counter(
            "kvfs_direct_committed_bytes", "Bytes committed by writers", d["bytes_committed"]
        )
        yield gauge("kvfs_direct_leased_files", "Files held by read leases", d["leased_files"])
        tier = self.store.histograms().get("cluster")
        if tier is not None:
            yield from self._cluster(stats["cluster"], tier, gauge, counter, histograms)

    @staticmethod
    def _cluster(
        cl: dict[str, Any], tier: dict[str, Histogram], gauge: Any, counter: Any, histograms: Any
    ) -> Iterator[Any]:
        from prometheus_client.core import HistogramMetricFamily

        yield gauge("kvfs_cluster_up", "1 while the cluster tier answers", cl["state"] == "up")
        yield gauge(
            "kvfs_cluster_publish_queue", "Publishes and deletes queued", cl["publish_queue"]
        )
        for name, doc in (
            ("hits", "Lookups answered by fetching from the cluster"),
            ("misses", "Lookups the cluster did not have"),
            ("negative_hits", "Lookups answered by the cache of recent cluster misses"),
            ("skipped_down", "Local misses not asked: the cluster was down"),
            ("fetch_failed", "Fetches that failed (unreachable, late, did not verify)"),
            ("checksum_failures", "Fetched values that did not verify"),
            ("bytes_fetched", "Bytes fetched from the cluster"),
            ("published", "Files published"),
            ("bytes_published", "Bytes published"),
            ("publish_dropped", "Publishes dropped: queue full or cluster down"),
            ("publish_skipped", "Queued files that changed or went before their turn"),
            ("publish_failed", "Publishes the cluster refused"),
            ("deleted", "Names removed in the cluster after an unlink"),
            ("delete_failed", "Removals not done (cluster down, queue full, refused)"),
            ("failures", "Times the cluster went down"),
        ):
            yield counter(f"kvfs_cluster_{name}", doc, cl[name])
        for name, doc, h in (
            (
                "fetch",
                "A lookup's fetch of a file from the cluster, verified and made local",
                tier["fetch"],
            ),
            (
                "publish",
                "Publishing one file: read locally, sent, header last",
                tier["publish"],
            ),
        ):
            family = HistogramMetricFamily(f"kvfs_cluster_{name}_duration_seconds", doc, labels=[])
            yield histograms(family, [([], h.copy())])


__all__ = ["Exporter", "StoreCollector", "bind", "parse_address"]
