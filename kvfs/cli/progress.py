"""Progress of long work (fsck reading every unit, a mount recovering a large index,
the benchmarks) on one self-overwriting line of stderr — only when stderr is a
terminal: logs, pipes and CI output get nothing from here."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from kvfs.common.sizes import format_size

INTERVAL = 0.25
"""Seconds between redraws at most."""


class Progress:
    """``with Progress("fsck: data", total=n, unit="B") as p: p.advance(k)``.

    ``total`` 0: unknown, shows the count and rate only. ``unit`` "B" shows sizes,
    anything else a count of that noun."""

    def __init__(
        self, label: str, total: int = 0, unit: str = "", stream: TextIO | None = None
    ) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.stream = sys.stderr if stream is None else stream
        self.done = 0
        self.enabled = _is_terminal(self.stream)
        self._t0 = self._last = time.monotonic()
        self._width = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.enabled:
            now = time.monotonic()
            if now - self._last >= INTERVAL:
                self._last = now
                self._draw(now)

    def _amount(self, n: float) -> str:
        return (
            format_size(n)
            if self.unit == "B"
            else f"{n:,.0f}{' ' + self.unit if self.unit else ''}"
        )

    def _draw(self, now: float) -> None:
        rate = self.done / max(now - self._t0, 1e-9)
        text = f"{self.label}: {self._amount(self.done)}"
        if self.total:
            pct = 100 * self.done / self.total
            text += f" of {self._amount(self.total)} ({pct:.0f}%)"
            if rate > 0 and self.done < self.total:
                text += f", {_eta((self.total - self.done) / rate)} left"
        self._write(text + f", {self._amount(rate)}/s")

    def line(self, text: str) -> None:
        """Draw ``label: text`` in place."""
        self._write(f"{self.label}: {text}")

    def _write(self, text: str) -> None:
        pad = max(self._width - len(text), 0)
        self._width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        """Erase the line (what the work found is printed by its caller)."""
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


class Ticker:
    """For work that cannot count its own steps (a mount loading its index): a thread
    redraws ``label: status()  (N s)`` from the start plus ``delay`` until closed.
    ``status`` runs on that thread: it may only read plain counters."""

    def __init__(
        self,
        label: str,
        status: Callable[[], str],
        delay: float = 1.0,
        stream: TextIO | None = None,
    ) -> None:
        self.progress = Progress(label, stream=stream)
        self.status, self.delay = status, delay
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Ticker:
        if self.progress.enabled:
            self._thread = threading.Thread(target=self._run, name="kvfs-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.progress.close()

    def _run(self) -> None:
        t0 = time.monotonic()
        if self._stop.wait(self.delay):
            return
        while not self._stop.is_set():
            try:
                status = self.status()
            except Exception:  # a counter mid-change: skip this redraw
                status = ""
            elapsed = time.monotonic() - t0
            self.progress.line(f"{status}  ({elapsed:.0f} s)" if status else f"{elapsed:.0f} s")
            self._stop.wait(INTERVAL * 2)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return os.isatty(stream.fileno()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, OSError, ValueError):
        return False


def _eta(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
