"""Latency histograms cheap enough for every device request and FUSE request.

A :class:`Histogram` is a fixed list of bucket counts and a sum: one ``bisect`` and
two additions per observation, no allocation, no lock of its own (the owner's lock or
the trio thread serialises observations). ``kvfs.fuse.metrics`` turns them into
Prometheus histograms at scrape time.
"""

from __future__ import annotations

from bisect import bisect_left

BOUNDS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
"""Upper bounds in seconds (50 us, a cache hit, to 30 s, the default device deadline)."""


class Histogram:
    """Counts of observations per bucket (``counts[i]``: ``BOUNDS[i-1] < s <= BOUNDS[i]``,
    the last one above every bound) and their sum in seconds."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BOUNDS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(BOUNDS, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> Histogram:
        h = Histogram()
        h.counts, h.sum = list(self.counts), self.sum
        return h

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, observations <= le)`` pairs ending with ``+Inf``, as Prometheus wants."""
        out, total = [], 0
        for bound, n in zip((*map(repr, BOUNDS), "+Inf"), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


__all__ = ["BOUNDS", "Histogram"]
