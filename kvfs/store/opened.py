"""The operations on an open file, handle by handle: open, read, write, flush (a
close) and release (the last close). They tie the parts together for one request: the
handle registry, the reader and writer, the direct path's pending writes, the rules
for reads beside a truncate (:mod:`kvfs.store.truncation`) and the file's lifetime
(:mod:`kvfs.store.lifetime`).

Runs on the trio thread; every ``await`` below is a point where another request may
run, so what a request checked before one it checks again after (``docs/design.md``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable

from kvfs.common import procs
from kvfs.common.errors import (
    Corruption,
    Incomplete,
    IsADirectory,
    KvfsError,
    NoSpace,
    QuotaExceeded,
)
from kvfs.evict.evictor import Evictor
from kvfs.format.records import FLAG_QUARANTINED, FLAG_WRITING
from kvfs.index.namespace import Inode, Namespace
from kvfs.log.journal import Journal
from kvfs.store.handles import Handles
from kvfs.store.hooks import Hooks
from kvfs.store.leases import DirectPath
from kvfs.store.lifetime import Lifetime
from kvfs.store.posix import ROOT, Caller
from kvfs.store.reader import Reader
from kvfs.store.truncation import Truncations
from kvfs.store.types import FileState, Handle, Traffic, check_failed
from kvfs.store.writer import Writer

log = logging.getLogger(__name__)


class OpenFiles:
    """Handle-level file operations of one store. ``commit(inode, pid)``: make a
    file durable (``Store.commit``)."""

    def __init__(
        self,
        ns: Namespace,
        journal: Journal,
        evictor: Evictor,
        handles: Handles,
        files: dict[int, FileState],
        reader: Reader,
        writer: Writer,
        direct: DirectPath,
        hooks: Hooks,
        traffic: Traffic,
        truncations: Truncations,
        lifetime: Lifetime,
        *,
        commit: Callable[[Inode, int], Awaitable[None]],
    ) -> None:
        self.ns = ns
        self.journal = journal
        self.evictor = evictor
        self.handles = handles
        self._files = files
        self.reader = reader
        self.writer = writer
        self.direct = direct
        self.hooks = hooks
        self.traffic = traffic
        self.truncations = truncations
        self.lifetime = lifetime
        self._commit = commit

    async def open(self, ino: int, flags: int, caller: Caller = ROOT) -> int:
        """A handle on a live file; Stale (ESTALE) for one kvfs removed, so an open
        through a dentry the kernel still caches retries its lookup and misses."""
        inode = self.ns.get(ino)
        if inode.is_dir:
            raise IsADirectory(f"inode {ino}")
        if inode.flags & FLAG_QUARANTINED:
            raise Corruption(f"inode {ino} is quarantined")
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        if writable and flags & os.O_TRUNC:
            async with self.truncations.shrinking(ino, inode.size > 0):
                await self.writer.truncate_at_open(inode, caller)
            inode = self.ns.get(ino)  # the await may have let an eviction in
        inode.opens += 1
        owner = self.evictor.opened(inode, caller.pid)
        if writable:
            self.writer.state(ino).writers += 1
        shrinks = self.truncations.shrinks(ino)
        direct = bool(flags & os.O_DIRECT)
        return self.handles.add(
            Handle(
                ino,
                writable,
                caller.pid,
                owner,
                caller.uid,
                direct,
                shrinks,
                readable=flags & os.O_ACCMODE != os.O_WRONLY,
            )
        )

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        """Every byte of ``off``..``off + size`` up to EOF, or an error: EIO for a
        file that is quarantined, whose bytes were not all stored, or that has data
        on a missing member (degraded mount)."""
        h = self.handles[fh]
        ino = h.ino
        while True:  # replied only while no shrinking truncate of the file is unanswered
            await self.truncations.settle(ino)
            data = await self._read_once(h, off, size)
            if not self.truncations.resizing(ino):
                break
        self.truncations.check_not_rewritten(h)  # a truncate may have come while it waited
        self.traffic.reads += 1
        self.traffic.bytes_read += len(data)
        return data

    async def _read_once(self, h: Handle, off: int, size: int) -> bytes | memoryview:
        inode = self.ns.inodes.get(h.ino)
        if inode is None or inode.flags & FLAG_QUARANTINED:
            raise Corruption(f"inode {h.ino} is quarantined or gone")
        self.truncations.check_not_rewritten(h)
        self.writer.check_readable(inode)
        st = self._files.get(h.ino)
        if st is not None:
            check_failed(st)
        end = min(off + size, inode.size)
        if off >= end:
            return b""
        return await self.reader.read(inode, off, end)

    async def write(self, fh: int, off: int, data: bytes) -> int:
        """Accept ``data`` at ``off``: the space it needs is claimed first, so a full
        pool or quota fails this write (ENOSPC/EDQUOT) before any byte is taken, and
        never a later close."""
        h = self.handles[fh]
        inode = self.ns.get(h.ino)
        end = off + len(data)
        self.writer.check_size(inode, end)
        st = self.writer.state(inode.ino)
        check_failed(st)
        if not data:
            return 0
        st.active += 1
        try:
            if fh in self.handles.wrote and not inode.flags & FLAG_WRITING:
                # committed while this handle goes on writing (an fsync, or the FLUSH
                # of another process's close): the committed prefix must not come back
                # from a crash as the whole file: uncommitted, durably, before it grows
                self.writer.begin_change(inode)
                await self.journal.wait_durable(self.journal.last_seq)
            await self.writer.write(h, inode, st, off, data)
        except (NoSpace, QuotaExceeded) as e:
            # the writer cannot store what it meant to: its file is incomplete (a
            # short chunk must never be served as a whole one), removed at its close
            self.writer.fail(st, e)
            raise
        finally:
            st.active -= 1
        self.traffic.writes += 1
        self.traffic.bytes_written += len(data)
        self.handles.wrote.add(fh)
        await self.writer.maybe_writeback(self.ns.get(h.ino), st)
        return len(data)

    async def flush(self, fh: int) -> None:
        """A close of a handle (FUSE flush): commit what it wrote, unless its writer
        is dying from a signal. A killed writer's close is the kernel closing its
        files in ``do_exit``; its file is as incomplete as after a crash: it is
        never committed and its last close removes it (``docs/design.md``).

        Every close() of a copy of the file's descriptor sends a FLUSH, so a commit
        here may come while the opener is still writing: a forked child closing the
        descriptors it inherited (``subprocess`` does, at exec) commits a prefix of
        the file, as an fsync mid-write does. Such a prefix is never taken for the
        whole file: a killed opener's handle that wrote makes the file incomplete
        again, committed or not.

        A handle with a direct write in progress is left alone: its commit is the
        client's, and a FLUSH may be a forked child's, not the writer's close. The
        write is abandoned at the handle's release (its last close), or here when
        the writer is dying (a child may hold the descriptor open long after)."""
        h = self.handles[fh]
        inode = self.ns.inodes.get(h.ino)
        if not h.writable or inode is None:
            return
        if self.direct.pending(fh):
            if h.owner is not None and procs.killed(*h.owner):
                self.direct.abandon(fh)  # the file is incomplete: dropped at last close
            return
        unfinished = inode.flags & FLAG_WRITING or fh in self.handles.wrote
        if unfinished and h.owner is not None and procs.killed(*h.owner):
            st = self.writer.state(inode.ino)
            if st.error is None:
                log.warning(
                    "inode %d: its writer (pid %d) was killed before closing it; "
                    "the incomplete file is dropped",
                    inode.ino,
                    h.owner[0],
                )
                self.writer.fail(st, Incomplete(f"inode {inode.ino}: writer killed mid-write"))
                if not inode.flags & FLAG_WRITING:  # uncommitted again: its last close
                    inode.flags |= FLAG_WRITING  # removes it, recovery drops it
                    self.ns.commit(inode)
                    await self.journal.wait_durable(self.journal.last_seq)
            return
        await self._commit(inode, h.pid)

    async def release(self, fh: int) -> None:
        """The last close of handle ``fh``: commit what is left unless the file failed,
        remove a file its last writer never committed, tell the tiers of a file they
        may send, and drop what nothing needs any more."""
        h = self.handles.remove(fh)
        inode = self.ns.inodes.get(h.ino)
        if inode is None:
            return
        inode.opens -= 1
        st = self._files.get(h.ino)
        if st is not None and h.writable:
            st.writers -= 1
        self.direct.closed(fh, inode)
        st = self._files.get(h.ino)  # an abandoned direct write may have made one
        failed = st is not None and st.error is not None
        if inode.opens == 0 and st is not None and not failed and (st.dirty or st.busy):
            try:
                await self._commit(inode, 0)
            except KvfsError as e:
                log.warning("release of inode %d: %s", h.ino, e)
        if inode.opens == 0 and inode.flags & FLAG_WRITING and h.writable:
            self.lifetime.abandon(inode)
        elif h.writable and self.hooks and self.lifetime.sendable(inode):
            self.hooks.closed(inode)
        self.lifetime.forget_state(inode)
        self.lifetime.maybe_drop(inode)
