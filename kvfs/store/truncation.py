"""Reads beside a truncate: what keeps a reader off bytes the file never held while
another caller shrinks it (``docs/design.md``, "Reads beside a truncate", rules 2, 3
and 5; rule 1 is the reader's, rule 4 the cache's, rule 6 the FUSE adapter's).

- A shrinking truncate runs inside :meth:`Truncations.shrinking`; reads of the file
  wait (:meth:`Truncations.settle`) until none is unanswered (rule 3).
- A handle remembers how often its file had shrunk when it was opened
  (``Handle.shrinks``); once a truncate by another thread shrank it, its reads fail
  (``Rewritten``, rule 2), except the handles :meth:`Truncations.keep_readable` lets go
  on.
- A buffered READ answered short past the page of the file's last byte is refused
  (``StaleSize``, rule 5: :meth:`Truncations.check_kernel_read`).

The state lives in the store's per-file :class:`~kvfs.store.types.FileState`
(``shrinks``, ``resizing``, ``settled``) and its handles; this part reads and changes
them on the trio thread, with no ``await`` but the waits named here."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace

import trio

from kvfs.common.errors import Rewritten, StaleSize
from kvfs.store.handles import Handles
from kvfs.store.types import FileState, Handle, Traffic

PAGE = os.sysconf("SC_PAGE_SIZE")


def _page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


class Truncations:
    """The store's rules for reads beside a truncate, over its per-file states
    (``files``, shared with the reader and writer), its handles and its counters;
    ``state``: a file's state, made if it has none (``Writer.state``)."""

    def __init__(
        self,
        files: dict[int, FileState],
        handles: Handles,
        traffic: Traffic,
        state: Callable[[int], FileState],
    ) -> None:
        self._files = files
        self._handles = handles
        self._traffic = traffic
        self._state = state

    @asynccontextmanager
    async def shrinking(self, ino: int, shrinks: bool) -> AsyncIterator[None]:
        """A truncate that may shrink the file runs inside: reads wait (:meth:`settle`)."""
        if not shrinks:
            yield
            return
        st = self._state(ino)
        st.resizing += 1
        try:
            yield
        finally:
            st.resizing -= 1
            if not st.resizing:
                st.settled.set()
                st.settled = trio.Event()

    async def settle(self, ino: int) -> None:
        """Wait until no shrinking truncate of ``ino`` is in progress."""
        st = self._files.get(ino)
        while st is not None and st.resizing:
            await st.settled.wait()
            st = self._files.get(ino)

    def resizing(self, ino: int) -> bool:
        """Whether a shrinking truncate of ``ino`` is in progress (unanswered)."""
        st = self._files.get(ino)
        return st is not None and bool(st.resizing)

    def shrinks(self, ino: int) -> int:
        """How often the file shrank while some handle held it open (FileState lives
        as long as one does)."""
        st = self._files.get(ino)
        return st.shrinks if st is not None else 0

    def keep_readable(self, ino: int, tid: int | None, fh: int | None) -> None:
        """After a truncate by thread ``tid`` (through ``fh``, an ftruncate): the
        handle it came through, and the handles that thread opened, go on reading
        (one thread's calls are sequential: none of its reads was in flight).
        ``tid`` None: every handle does."""
        shrinks = self.shrinks(ino)
        for n, h in list(self._handles.items()):
            mine = tid is None or n == fh or h.pid == tid
            if h.ino == ino and h.shrinks != shrinks and mine:
                self._handles.replace(n, replace(h, shrinks=shrinks))

    def check_not_rewritten(self, h: Handle) -> None:
        """Rewritten (EIO) once another thread's truncate shrank the file ``h`` reads."""
        if self.shrinks(h.ino) != h.shrinks:
            raise Rewritten(f"inode {h.ino}: truncated through another descriptor; reopen it")

    def check_kernel_read(self, fh: int, off: int, size: int, got: int) -> None:
        """The kernel's READ of ``size`` bytes at ``off`` is about to be answered with
        ``got`` bytes. If it asked past the file's end by more than its page rounding
        (a buffered handle: an O_DIRECT one that reads is answered ``direct_io``, rule
        6, and asked the caller's whole count), it still holds a larger size: a
        shrink it has not applied yet (another process's ``O_TRUNC`` open or
        truncate answered a moment ago, a direct write that replaced the file). A
        short answer would make it zero-fill the rest of its pages and copy them out
        as the file's bytes (``docs/design.md``, "Reads beside a truncate", rule 5):
        EIO instead (``StaleSize``)."""
        if got < size and off + size > _page_up(off + got) and not self._handles[fh].direct:
            self._traffic.stale_size_reads += 1
            raise StaleSize(f"inode {self._handles[fh].ino}: read past a size not yet shrunk")
