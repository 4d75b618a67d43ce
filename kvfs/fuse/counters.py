"""What the FUSE adapter counts per request, read by the metrics exporter: a module of
its own so that the adapter (:mod:`kvfs.fuse.ops`) and the exporter
(:mod:`kvfs.fuse.metrics`) share it without importing each other."""

from __future__ import annotations

import errno

from kvfs.common.timing import Histogram


class RequestCounters:
    """Per FUSE operation: a latency histogram and the errors answered, by errno name
    (the trio thread is the only writer)."""

    def __init__(self) -> None:
        self.latency: dict[str, Histogram] = {}
        self.errors: dict[tuple[str, str], int] = {}
        self.lookups = {"hit": 0, "miss": 0}
        """LOOKUPs that reached the daemon (the kernel caches both answers for the
        entry timeout), by outcome."""

    def observe(self, op: str, seconds: float) -> None:
        h = self.latency.get(op)
        if h is None:
            h = self.latency[op] = Histogram()
        h.observe(seconds)

    def error(self, op: str, code: int) -> None:
        key = (op, errno.errorcode.get(code, str(code)))
        self.errors[key] = self.errors.get(key, 0) + 1


__all__ = ["RequestCounters"]
