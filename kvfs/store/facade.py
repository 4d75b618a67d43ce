"""The store: namespace + allocator + journal + the data path over the pool's devices.

FUSE-free and async. Concurrency contract (see ``docs/design.md``):

- Namespace, allocator, cache and per-file state change only on the trio thread, in
  stretches without ``await``; every blocking device call runs in a worker thread
  through :meth:`Store._io`, under a per-device limiter and a deadline.
- Data is copy-on-write at unit granularity: a dirty unit is always written to newly
  allocated units, and the units it replaces are freed only once a journal record
  that no longer needs them is durable. A file whose data changes is marked WRITING
  in the journal first; committing it (flush/fsync/close) writes back its dirty
  units, flushes the data devices and logs it clean. Recovery drops WRITING files,
  so a file is either complete or absent after a crash, never torn.
- Units are checksummed (xxh3-64) when written and verified when read; a mismatch is
  never served: the read fails with EIO and the file is quarantined.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import trio

from kvfs.common import procs
from kvfs.common.errors import (
    Corruption,
    DeviceError,
    Incomplete,
    IsADirectory,
    KvfsError,
    NoSpace,
    NotFound,
    NotPermitted,
    QuotaExceeded,
)
from kvfs.common.timing import Histogram
from kvfs.devices.alloc import Allocator
from kvfs.devices.pool import Pool
from kvfs.evict.driver import EvictionDriver
from kvfs.evict.evictor import Evictor
from kvfs.evict.space import Space
from kvfs.format.records import (
    DEV_SHIFT,
    FLAG_GONE,
    FLAG_QUARANTINED,
    FLAG_WRITING,
    NO_UNIT,
    Op,
    fragment_size,
)
from kvfs.index.inodes import DirView
from kvfs.index.namespace import Inode, Namespace
from kvfs.log.journal import Journal
from kvfs.store import leases as directpath
from kvfs.store import paths
from kvfs.store.cache import UnitCache
from kvfs.store.handles import Handles
from kvfs.store.hooks import FileView, Hooks, StoreHooks
from kvfs.store.leases import DirectPath
from kvfs.store.loading import Loader, RecoveryReport
from kvfs.store.names import OP_LOG_BYTES, Names
from kvfs.store.posix import ROOT, Caller
from kvfs.store.reader import Reader
from kvfs.store.reporting import Reports
from kvfs.store.truncation import Truncations
from kvfs.store.types import (
    DeviceSpace,
    DirectoryUsage,
    FileState,
    Handle,
    InodeView,
    StoreConfig,
    StoreStatistics,
    Traffic,
    check_failed,
)
from kvfs.store.writer import Writer

log = logging.getLogger(__name__)
T = TypeVar("T")


class Store:
    """Everything below the FUSE adapter."""

    def __init__(self, pool: Pool, config: StoreConfig | None = None) -> None:
        self.pool = pool
        self.cfg = config or StoreConfig()
        self.unit = pool.unit_size
        self.ns = Namespace(self._log)
        self._fragment = fragment_size(self.unit)
        self.alloc = Allocator(
            [sb.data_units for sb in pool.superblocks], self.unit // self._fragment
        )
        meta, meta_start, meta_size = pool.meta
        self.journal = Journal(
            meta,
            meta_start,
            meta_size,
            pool.devices,
            self._snapshot,
            seed=pool.seed,
            on_durable=lambda durable: self.space.release_frees(durable),
            commit_interval=self.cfg.commit_interval,
            io_timeout=self.cfg.io_timeout,
        )
        self.cache = UnitCache(self.cfg.cache_bytes)
        self._files: dict[int, FileState] = {}
        self.handles = Handles()
        self._limiters = [trio.CapacityLimiter(self.cfg.queue_depth) for _ in pool.devices]
        self._nursery: trio.Nursery | None = None
        self.traffic = Traffic()
        self.on_vanish: Callable[[int, bytes, int], None] = lambda parent, name, ino: None
        self.evictor = Evictor(
            self.ns, self.cfg.eviction_policy, self.cfg.default_policy, grace=self.cfg.fresh_grace
        )
        self._missing = frozenset(pool.missing)  # members absent from a degraded mount
        for dev in self._missing:
            self.alloc.set_offline(dev)  # it has no units in the allocator either
        self.unreadable: set[int] = set()
        """Inodes with a unit on a missing member: kept, listed, every read fails."""
        self._ckpt_inodes = 0
        self.reader = Reader(
            pool,
            self.cache,
            self.ns,
            self._files,
            io=self._io,
            buffers=lambda size: self.writer.buffer_pool(size),
            remove=self._unlink_everywhere,
            spawn=self._spawn,
            readahead_units=self.cfg.readahead_units,
            read_piece_units=self.cfg.read_piece_units,
        )
        self.space = Space(
            pool,
            self.alloc,
            self.journal,
            self.ns,
            io=self._io,
            claimed=lambda: self.writer.claimed,
            reserve_units=int(self.alloc.total_units * self.cfg.reserve),
            discard=self.cfg.discard,
        )
        """Deferred frees, TRIM and usage counters (:mod:`kvfs.evict.space`)."""
        self.eviction = EvictionDriver(
            self.space,
            self.journal,
            self.ns,
            self.evictor,
            evictable=self._evictable,
            evict=self._evict,
            pinned=self._pinned,
            privileged=lambda uid: uid in (0, os.getuid()),
            checkpointed_inodes=lambda: self._ckpt_inodes,
            high_watermark=self.cfg.high_watermark,
            low_watermark=self.cfg.low_watermark,
        )
        """Room for writes, watermarks and metadata pressure (:mod:`kvfs.evict.driver`)."""
        self.hooks = Hooks()
        """The tiers subscribed to its events (:meth:`subscribe`)."""
        self.writer = Writer(
            pool,
            self.cfg,
            self.ns,
            self.alloc,
            self.journal,
            self.cache,
            self.space,
            self.evictor,
            self.reader,
            self._files,
            missing=self._missing,
            unreadable=self.unreadable,
            io=self._io,
            begin_change=self._begin_data_change,
            ensure_space=self._ensure_space,
            free_later=lambda ino, p: self.direct.free_later(ino, p),
        )
        """Writes and write-back (:mod:`kvfs.store.writer`); it owns the I/O buffers."""
        self.direct = DirectPath(
            pool,
            self.ns,
            self.alloc,
            self.journal,
            self.space,
            self.handles,
            self.writer,
            self._files,
            check_readable=self._check_readable,
            begin_change=self._begin_data_change,
            ensure_space=self._ensure_space,
            commit=self.commit,
        )
        """Leases and reservations of the zero-copy path (:mod:`kvfs.store.leases`)."""
        self.truncations = Truncations(self._files, self.handles, self.traffic, self.writer.state)
        """Reads beside a truncate (:mod:`kvfs.store.truncation`)."""
        self.names = Names(
            self.ns,
            self.journal,
            self.space,
            self.evictor,
            self.hooks,
            self.writer,
            self.truncations,
            room=self.check_metadata_room,
            drop=self.maybe_drop,
        )
        """Namespace operations (:mod:`kvfs.store.names`)."""
        self.reports = Reports(
            pool,
            self.ns,
            self.alloc,
            self.journal,
            self.cache,
            self.space,
            self.eviction,
            self.evictor,
            self.handles,
            self.reader,
            self.writer,
            self.direct,
            self.hooks,
            self.traffic,
            self.unreadable,
        )
        """What it reports (:mod:`kvfs.store.reporting`)."""

    # ------------------------------------------------------------------ lifecycle
    def _log(self, ops: list[Op]) -> None:
        self.journal.append(ops)

    def _snapshot(self) -> Iterator[bytes]:
        """What a checkpoint holds: the namespace plus the evictor's learned state, as
        CKPT_DATA payloads of both frozen now (copy-on-write) and encoded as the
        journal consumes them; the journal replays the window after them."""
        evictor = self.evictor.snapshot_payloads()  # frozen now, encoded as consumed
        self._ckpt_inodes = len(self.ns.inodes)
        return itertools.chain(self.ns.snapshot_payloads(), evictor)

    def load(self, drop_unreadable: bool = False) -> RecoveryReport:
        """Rebuild the index from the metadata log (blocking; before serving).
        ``drop_unreadable``: drop files with data on a missing member (degraded
        mount) instead of keeping them unreadable until it returns."""
        loader = Loader(self.pool, self.ns, self.alloc, self.evictor, self.journal, self._missing)
        report = loader.load(drop_unreadable)
        self.unreadable |= loader.unreadable  # in place: the writer shares the set
        t0 = time.monotonic()
        self.space.count_usage()  # once, before serving: then running counters
        log.info("usage counters from the index: %.2f s", time.monotonic() - t0)
        if loader.clean:  # the checkpoint found is the last one: it holds exactly these
            self._ckpt_inodes = len(self.ns.inodes)
        return report

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve: start the background tasks, checkpoint the recovered state unless
        it came from a clean unmount, run until cancelled. Callers should use
        :meth:`close` before cancelling."""
        async with trio.open_nursery() as nursery:
            self._nursery = self.writer.nursery = nursery
            await nursery.start(self.journal.run)
            await self.journal.start()
            nursery.start_soon(self.eviction.evict_loop)
            nursery.start_soon(self.space.trim_loop)
            await self.hooks.start(nursery)
            task_status.started()
            await trio.sleep_forever()

    async def close(self) -> None:
        """Commit every closed file and write a final checkpoint (clean unmount).

        A file still open for writing (the daemon told to stop under a live writer)
        was never closed: it is left uncommitted, so the next mount drops it, exactly
        as after a crash -- a writer's bytes count only once it closes the file."""
        self.eviction.stopping = True
        self.hooks.stop()  # at once: local durability never waits on a tier
        for ino, st in list(self._files.items()):
            inode = self.ns.inodes.get(ino)
            if inode is None or st.error is not None:
                continue
            if st.writers:
                log.warning("unmount: inode %d is still open for writing; dropped", ino)
                continue
            try:
                await self.commit(inode)
            except KvfsError as e:  # stays WRITING: recovery drops it
                log.warning("unmount: could not commit inode %d: %s", ino, e)
        await self.journal.checkpoint()

    # ------------------------------------------------------------------ device I/O
    async def _io(self, dev: int, fn: Callable[[], T]) -> T:
        """Run a blocking device call in a worker thread, with a deadline."""
        with trio.move_on_after(self.cfg.io_timeout):
            return await trio.to_thread.run_sync(
                fn, limiter=self._limiters[dev], abandon_on_cancel=True
            )
        path = self.pool.devices[dev].path
        raise DeviceError(f"{path}: request missed its {self.cfg.io_timeout:g} s deadline")

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: object) -> None:
        """Start a background task (readahead) once serving; dropped before that."""
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    # ------------------------------------------------------------------ handles
    def handle(self, fh: int) -> Handle:
        return self.handles[fh]

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
            Handle(ino, writable, caller.pid, owner, caller.uid, direct, shrinks)
        )

    def _pinned(self, uid: int) -> int:
        """Bytes of the files user ``uid`` holds open (they cannot be evicted), the
        ones still in memory (dirty, being written back) included."""
        inodes, files, units = self.ns.inodes, self._files, 0
        for ino in self.handles.pinned(uid):
            inode, st = inodes.get(ino), files.get(ino)
            units += inode.mapped_units if inode is not None else 0
            units += len(st.dirty) + len(st.inflight) if st is not None else 0
        return units * self.unit

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
        await self.commit(inode, h.pid)

    async def check_metadata_room(self, log_bytes: int = OP_LOG_BYTES) -> None:
        """Room in the metadata area for an operation that grows the index. Metadata
        pressure is eviction pressure: once the last checkpoint is over the area's
        limit, files are evicted by data eviction's rules and a smaller checkpoint
        is taken (``EvictionDriver.make_metadata_room``; removals since the last checkpoint
        count too: a dropped row leaves the image at once, see
        ``Namespace._strip_row``). NoSpace only when nothing could go. Then
        ``Journal.admit`` for the ``log_bytes`` the operation will log: it waits
        while a running checkpoint's window has no room (NoSpace if the area is full
        even after a fresh checkpoint; DeviceError once the log failed), so nothing
        is acknowledged that the log could not hold."""
        if self.journal.metadata_full:
            await self.eviction.make_metadata_room()
        if self.journal.metadata_full:
            self.eviction.log_metadata_full()
            raise NoSpace("metadata area full: nothing may be evicted")
        # last: the caller appends with no await after this returns
        await self.journal.admit(log_bytes)

    async def release(self, fh: int) -> None:
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
                await self.commit(inode)
            except KvfsError as e:
                log.warning("release of inode %d: %s", h.ino, e)
        if inode.opens == 0 and inode.flags & FLAG_WRITING and h.writable:
            self._abandon(inode)
        elif h.writable and self.hooks and self.sendable(inode):
            self.hooks.closed(inode)
        self._maybe_forget_state(inode)
        self.maybe_drop(inode)

    def sendable(self, inode: FileView) -> bool:
        """A closed file a tier may send: committed, named, no writer left."""
        if inode.flags & (FLAG_WRITING | FLAG_GONE | FLAG_QUARANTINED) or not inode.nlink:
            return False
        st = self._files.get(inode.ino)
        return st is None or (not st.writers and st.error is None)

    def file_state(self, ino: int) -> FileState | None:
        """The in-memory state of a file being written or read, if it has one."""
        return self._files.get(ino)

    def _abandon(self, inode: Inode) -> None:
        """The last writer closed a file that was never committed (its commit failed,
        or its writer was killed). Its bytes were never all stored: remove it rather
        than ever serve the gaps as data."""
        if self.ns.inodes.get(inode.ino) is not inode:
            return
        self.writer.discard_dirty(inode.ino)
        log.warning("inode %d could not be committed; removing the incomplete file", inode.ino)
        self._unlink_everywhere(inode)

    def _maybe_forget_state(self, inode: Inode) -> None:
        st = self._files.get(inode.ino)
        if st is not None and inode.opens == 0 and not (st.dirty or st.inflight or st.busy):
            if st.resizing:
                return
            del self._files[inode.ino]

    def forget(self, ino: int, count: int) -> None:
        inode = self.ns.inodes.get(ino)
        if inode is None:
            self.ns.kernel_forget(ino, count)  # a dropped inode's number is reusable now
            return
        inode.lookups = max(0, inode.lookups - count)
        self.maybe_drop(inode)

    def maybe_drop(self, inode: Inode) -> None:
        """Free an inode once it has no names, no open handles and no kernel refs; one
        that kvfs removed (GONE) goes as soon as no handle is open: the kernel's
        references to it get ESTALE."""
        gone = inode.flags & FLAG_GONE
        busy = inode.nlink or (inode.lookups and not gone) or (inode.opens and not inode.is_dir)
        if busy:
            return
        if self.ns.inodes.get(inode.ino) is not inode:
            return
        self.writer.free_units(inode, 0)
        self.unreadable.discard(inode.ino)
        self.writer.discard_dirty(inode.ino)
        self._files.pop(inode.ino, None)
        self.evictor.forget(inode.ino)
        self.ns.drop(inode)

    def allocated_bytes(self, inode: InodeView) -> int:
        """Bytes of device space the file has (``st_blocks``)."""
        return self.writer.allocated_bytes(inode)

    # ------------------------------------------------------------------ write path
    def _begin_data_change(self, inode: Inode) -> None:
        self._check_readable(inode)  # its old bytes cannot be read to be changed
        if not inode.flags & FLAG_WRITING:
            inode.flags |= FLAG_WRITING
            self.ns.commit(inode)

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
                self._begin_data_change(inode)
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

    def owner_changed(self, inode: Inode, old_uid: int) -> None:
        """chown: the file's bytes now count for its new owner."""
        self.space.owner_changed(inode, old_uid)

    async def commit(self, inode: Inode, pid: int = 0) -> None:
        """Make the file's data and metadata durable (flush, fsync, close)."""
        await self.writer.commit(inode, pid)

    async def truncate(self, inode: Inode, size: int) -> None:
        """Truncate with no caller to tell apart: every open handle goes on reading
        (the FUSE adapter's SETATTR says whose truncate it is: :meth:`setattr`)."""
        await self.writer.truncate(inode, size)
        self.truncations.keep_readable(inode.ino, None, None)

    def max_file_size(self, inode: Inode) -> int:
        return self.writer.max_file_size(inode)

    # ------------------------------------------------------------------ read path
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

    def check_kernel_read(self, fh: int, off: int, size: int, got: int) -> None:
        """EIO (``StaleSize``) for a buffered READ about to be answered short past the
        page of the file's last byte: the kernel still holds a larger size
        (``docs/design.md``, "Reads beside a truncate", rule 5; :mod:`kvfs.store.truncation`)."""
        self.truncations.check_kernel_read(fh, off, size, got)

    async def _read_once(self, h: Handle, off: int, size: int) -> bytes | memoryview:
        inode = self.ns.inodes.get(h.ino)
        if inode is None or inode.flags & FLAG_QUARANTINED:
            raise Corruption(f"inode {h.ino} is quarantined or gone")
        self.truncations.check_not_rewritten(h)
        self._check_readable(inode)
        st = self._files.get(h.ino)
        if st is not None:
            check_failed(st)
        end = min(off + size, inode.size)
        if off >= end:
            return b""
        return await self.reader.read(inode, off, end)

    def _check_readable(self, inode: Inode) -> None:
        """EIO for a file with data on a missing member (degraded mount)."""
        if inode.ino not in self.unreadable:
            return
        members = sorted({p >> DEV_SHIFT for p in inode.units if p != NO_UNIT} & self._missing)
        raise DeviceError(
            f"inode {inode.ino}: data on missing member {', '.join(str(d + 1) for d in members)} "
            "(degraded mount)"
        )

    def _unlink_everywhere(self, inode: Inode) -> None:
        """Remove ``inode`` for good (quarantine, eviction, an abandoned incomplete
        file): every name goes (the kernel is told, so its cached dentries go too),
        and the inode is GONE: the kernel's remaining references get ESTALE, so an
        open through one never sees an emptied file. Its units are freed once no
        handle is open (eviction only takes files without one)."""
        before = self.space.placement(inode)
        for parent, name in self.ns.names_of(inode):
            self.ns.remove(parent, name, want_dir=False)
            self.on_vanish(parent, name, inode.ino)
        self.space.placed(inode, before)
        self.evictor.forget(inode.ino)
        inode.flags |= FLAG_GONE
        self.maybe_drop(inode)

    # ------------------------------------------------------------------ direct path
    async def direct_get(self, ino: int, name: bytes, caller: Caller) -> bytes:
        """A direct-path request (``user.kvfs.direct.*`` read): a map or a reservation."""
        return await self.direct.getxattr(ino, name, caller)

    async def direct_set(self, ino: int, name: bytes, value: bytes, caller: Caller) -> None:
        """A direct-path commit (``user.kvfs.direct.commit`` set)."""
        if name != directpath.COMMIT:
            raise NotPermitted(f"{name!r} cannot be set")
        await self.direct.commit(ino, value, caller)

    # ------------------------------------------------------------------ eviction hooks
    def _evictable(self, inode: Inode) -> bool:
        if inode.is_dir or inode.opens or inode.flags & FLAG_WRITING or not inode.nlink:
            return False
        st = self._files.get(inode.ino)
        return st is None or not (st.dirty or st.inflight or st.busy)

    async def _ensure_space(self, inode: Inode, units: int) -> None:
        """Room for ``units`` new units: metadata first, then data (may evict);
        NoSpace/QuotaExceeded only when nothing may be evicted."""
        await self.check_metadata_room()
        await self.eviction.ensure(inode, units)

    # ------------------------------------------------------------------ tiers (hooks)
    def subscribe(self, hooks: StoreHooks) -> None:
        """Subscribe a tier to this store's events (:mod:`kvfs.store.hooks`), before
        :meth:`run`."""
        self.hooks.add(hooks)

    async def missed(self, parent: int, name: bytes) -> Inode | None:
        """A lookup of ``name`` in ``parent`` found nothing: the subscribed tiers may
        make it local (the cluster tier fetches it); what it names then, if anything."""
        if not self.hooks:
            return None
        return await self.hooks.missed(parent, name, self.ns.find)

    def negative_timeout(self, default: float) -> float:
        """How long "no such name" may be cached: ``default`` unless a tier may make
        names appear."""
        return self.hooks.negative_timeout(default)

    def histograms(self) -> dict[str, dict[str, Histogram]]:
        """The subscribed tiers' latency histograms, by tier."""
        return self.hooks.histograms()

    def path_of(self, ino: int) -> bytes | None:
        """The path of ``ino`` inside the mount (no leading ``/``), or None."""
        return paths.path_of(self.ns, ino)

    def directories_on(self, path: bytes) -> list[tuple[bytes, Inode]]:
        """The directories above ``path`` that exist here, top down: each one's path
        and inode (up to the first that is missing or not a directory)."""
        return paths.directories_on(self.ns, path)

    def managed(self, parent: int) -> bool:
        """Whether files in directory ``parent`` are kvfs-managed (its top-level
        directory's policy; the default for the root's own files)."""
        return paths.managed(self.ns, self.evictor, parent)

    def hold(self, ino: int) -> None:
        """Keep a live file from eviction and its units from reuse, as an open handle
        does, until :meth:`let_go` (a tier reading or sending it)."""
        self.ns.inodes[ino].opens += 1

    def let_go(self, ino: int) -> None:
        """End a :meth:`hold`; a file removed meanwhile goes now."""
        inode = self.ns.inodes.get(ino)
        if inode is not None:
            inode.opens -= 1
            self.maybe_drop(inode)

    async def read_file(self, ino: int) -> bytes:
        """Every byte of a held file (:meth:`hold`), read without a handle, also of one
        that eviction took since (GONE, held by a tier sending it); KvfsError as a
        read's, NotFound once it was dropped."""
        inode = self.ns.inodes.get(ino)
        if inode is None:
            raise NotFound(f"inode {ino} is gone")
        return bytes(await self.reader.read(inode, 0, inode.size)) if inode.size else b""

    def has_missing_data(self, ino: int) -> bool:
        """Whether the file has data on a missing member (degraded mount)."""
        return ino in self.unreadable

    # ------------------------------------------------------------------ names, attributes
    def lookup(self, parent: int, name: bytes) -> Inode | None:
        """What ``name`` in directory ``parent`` names (``.`` and ``..`` too), if any."""
        return self.ns.find(parent, name)

    def get_inode(self, ino: int) -> Inode:
        """A live inode (NotFound otherwise)."""
        return self.ns.get(ino)

    def find_inode(self, ino: int) -> Inode | None:
        return self.ns.inodes.get(ino)

    @property
    def inode_count(self) -> int:
        return len(self.ns.inodes)

    def directory(self, ino: int) -> DirView:
        """A directory's entries, name to inode (NotADirectory for a file)."""
        return self.ns.directory(ino)

    async def make(
        self, parent: int, name: bytes, mode: int, caller: Caller = ROOT, flags: int = 0
    ) -> Inode:
        """mkdir / mknod (:meth:`Names.make <kvfs.store.names.Names.make>`)."""
        return await self.names.make(parent, name, mode, caller, flags)

    async def create(self, parent: int, name: bytes, mode: int, caller: Caller = ROOT) -> Inode:
        """A new empty file, marked WRITING until its first commit."""
        return await self.names.create(parent, name, mode, caller)

    def rename(self, old_parent: int, old: bytes, new_parent: int, new: bytes, flags: int) -> None:
        """POSIX rename (and renameat2's flags) (:mod:`kvfs.store.names`)."""
        self.names.rename(old_parent, old, new_parent, new, flags)

    def unlink(self, parent: int, name: bytes) -> None:
        self.names.unlink(parent, name)

    def rmdir(self, parent: int, name: bytes) -> None:
        self.names.rmdir(parent, name)

    async def link(self, ino: int, parent: int, name: bytes) -> Inode:
        return await self.names.link(ino, parent, name)

    async def setattr(
        self,
        ino: int,
        caller: Caller,
        *,
        size: int | None = None,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        times: tuple[int | None, int | None, int | None] = (None, None, None),
        fh: int | None = None,
    ) -> Inode:
        """chmod, chown, truncate and utimens of one SETATTR (:meth:`Names.setattr
        <kvfs.store.names.Names.setattr>`)."""
        return await self.names.setattr(
            ino, caller, size=size, mode=mode, uid=uid, gid=gid, times=times, fh=fh
        )

    def _evict(self, inode: Inode) -> None:
        """Eviction takes ``inode`` (a tier may send it first: the cluster's on-evict)."""
        self.hooks.evicted(inode)
        self._unlink_everywhere(inode)

    @property
    def xattr_names(self) -> tuple[bytes, ...]:
        """Every xattr name stored since the pool was made (interned, never removed)."""
        return self.ns.xattr_names

    def get_xattr(self, ino: int, name: bytes) -> bytes:
        return self.names.get_xattr(ino, name)

    def list_xattrs(self, ino: int) -> list[bytes]:
        return self.names.list_xattrs(ino)

    async def set_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        """Set an xattr within the bounds (E2BIG, ENOSPC), checked before any room is
        made for it."""
        await self.names.set_xattr(ino, name, value)

    def check_group_setting(self, ino: int, name: bytes, value: bytes) -> None:
        """Before a caller's :meth:`set_xattr`: InvalidArgument for a malformed or
        misplaced eviction-group setting (:meth:`Names.check_group_setting
        <kvfs.store.names.Names.check_group_setting>`)."""
        self.names.check_group_setting(ino, name, value)

    def remove_xattr(self, ino: int, name: bytes) -> None:
        self.names.remove_xattr(ino, name)

    async def wait_durable(self) -> None:
        """Until everything logged so far is durable (fsync of a directory)."""
        await self.journal.wait_durable()

    def request_checkpoint(self) -> None:
        """Start a metadata checkpoint now (it runs in the background)."""
        self.journal.request_checkpoint()

    # ------------------------------------------------------------------ reporting
    def device_space(self) -> list[DeviceSpace]:
        """Data capacity and free space of each member (:mod:`kvfs.store.reporting`)."""
        return self.reports.device_space()

    def directory_usage(self) -> list[DirectoryUsage]:
        """Usage, quota and policy of each top-level directory, largest first."""
        return self.reports.directory_usage()

    def all_statistics(self) -> dict[str, Any]:
        """Every part's statistics, as ``kvfs stats`` shows them."""
        return self.reports.all_statistics()

    def describe(self) -> dict[str, str | int]:
        """What identifies the mounted pool."""
        return self.reports.describe()

    def eviction_counts(self) -> list[dict[str, Any]]:
        """Files evicted since the mount, by reason and top-level directory."""
        return self.reports.eviction_counts()

    def statistics(self) -> StoreStatistics:
        return self.reports.statistics()


__all__ = [
    "DeviceSpace",
    "FileState",
    "Handle",
    "RecoveryReport",
    "Store",
    "StoreConfig",
    "StoreStatistics",
]
