"""The write path: dirty units in memory, write-back to newly allocated units, and
where they are placed.

A write copies its bytes into dirty unit buffers (one per logical unit, from a pool
of buffers); the space they need is claimed first, so a full pool fails the write,
never a later close. Complete units are written back in batches, and all of them at
a commit: each batch is allocated (placement: stripes rotated over the members, a
partial last unit in fragments), written in worker threads with its checksums, then
installed in the file's map (copy-on-write: the units it replaces are freed once the
journal no longer needs them). A failed write-back makes the file's failure sticky
(:class:`~kvfs.store.types.FileState`). A commit writes back every dirty unit and
logs the file clean; a truncate drops or zeroes what is past the new end. Runs on the
trio thread, as the reader (:mod:`kvfs.store.reader`); the store (:mod:`kvfs.store.facade`)
owns the handles and calls in here.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import xxhash

from kvfs.common.errors import DeviceError, FileTooLarge, Incomplete, IsADirectory, KvfsError
from kvfs.devices.alloc import Allocator
from kvfs.devices.device import BufferPool
from kvfs.devices.pool import Pool
from kvfs.evict.evictor import Evictor
from kvfs.evict.space import Space
from kvfs.format.records import (
    DEV_SHIFT,
    FLAG_WRITING,
    NO_UNIT,
    UNIT_MASK,
    extent,
    fragment_size,
    is_fragment,
    phys,
)
from kvfs.index.namespace import Inode, Namespace
from kvfs.log.journal import Journal
from kvfs.store import posix
from kvfs.store.cache import UnitCache
from kvfs.store.posix import Caller
from kvfs.store.reader import Reader, domain_nursery
from kvfs.store.types import (
    FILE_SIZE_LIMIT,
    FileState,
    Handle,
    InodeView,
    StoreConfig,
    check_failed,
)

log = logging.getLogger(__name__)


class Writer:
    """Writes and write-back for one store (see the module docstring)."""

    def __init__(
        self,
        pool: Pool,
        cfg: StoreConfig,
        ns: Namespace,
        alloc: Allocator,
        journal: Journal,
        cache: UnitCache,
        space: Space,
        evictor: Evictor,
        reader: Reader,
        files: dict[int, FileState],
        *,
        missing: frozenset[int],
        unreadable: set[int],
        io: Callable[[int, Callable[[], Any]], Awaitable[Any]],
        ensure_space: Callable[[Inode, int], Awaitable[None]],
        free_later: Callable[[int, int], None],
    ) -> None:
        self.pool, self.cfg, self.ns, self.alloc = pool, cfg, ns, alloc
        self.journal, self.cache, self.space, self.reader = journal, cache, space, reader
        self.evictor, self._files = evictor, files
        self._missing = missing  # members absent from a degraded mount
        self._unreadable = unreadable  # the store's: files with data on a missing member
        self._io = io
        self._ensure_space, self._free_later = ensure_space, free_later
        self.unit = pool.unit_size
        self._fragment = fragment_size(self.unit)
        self._pools: dict[int, BufferPool] = {}
        self.dirty_bytes = 0
        self.claimed = 0  # units promised to writes: dirty units + claims in progress
        self.incomplete = 0
        """Files whose failure was made sticky (:meth:`fail`)."""
        self.nursery: trio.Nursery | None = None
        """Where write-backs run: the store's, once it serves."""

    # ------------------------------------------------------------------ file state
    def check_readable(self, inode: Inode) -> None:
        """EIO for a file with data on a missing member (degraded mount)."""
        if inode.ino not in self._unreadable:
            return
        members = sorted({p >> DEV_SHIFT for p in inode.units if p != NO_UNIT} & self._missing)
        raise DeviceError(
            f"inode {inode.ino}: data on missing member {', '.join(str(d + 1) for d in members)} "
            "(degraded mount)"
        )

    def begin_change(self, inode: Inode) -> None:
        """Before the file's data changes: it is marked WRITING (uncommitted until its
        next commit); EIO if it has data on a missing member (its old bytes cannot be
        read to be changed)."""
        self.check_readable(inode)  # its old bytes cannot be read to be changed
        if not inode.flags & FLAG_WRITING:
            inode.flags |= FLAG_WRITING
            self.ns.commit(inode)

    def state(self, ino: int) -> FileState:
        st = self._files.get(ino)
        if st is None:
            st = self._files[ino] = FileState()
            st.idle.set()
        return st

    def fail(self, st: FileState, error: KvfsError) -> None:
        """Make a file's failure sticky (see :class:`FileState`)."""
        if st.error is None:
            st.error = error
            self.incomplete += 1

    def max_file_size(self, inode: Inode) -> int:
        """The size ``inode`` may reach: its top-level directory's setting, else the
        mount's, else a quarter of the pool; never over FILE_SIZE_LIMIT."""
        own = self.evictor.group_max_file_size(self.evictor.group_of(inode))
        limit = own or self.cfg.max_file_size or self.alloc.total_units * self.unit // 4
        return min(limit, FILE_SIZE_LIMIT)

    def check_size(self, inode: Inode, size: int) -> None:
        """EFBIG for a size past the limit: before any byte is taken, so nothing is
        evicted for a file that could never fit (a 10 GiB write into a 4 GiB pool)."""
        if size > self.max_file_size(inode):
            raise FileTooLarge(
                f"inode {inode.ino}: {size} bytes exceed the maximum file size of "
                f"{self.max_file_size(inode)} bytes"
            )

    def allocated_bytes(self, inode: InodeView) -> int:
        """Bytes of device space the file has (``st_blocks``): its mapped units and
        fragment tails, plus the dirty or in-flight units not mapped yet (a whole
        unit each: their space is already claimed, as ext4 counts delayed
        allocation); holes count nothing."""
        units = inode.units
        n = inode.mapped_units * self.unit
        # a fragment run is a file's tail, or one that was before a truncate grew it
        n -= sum(self.unit - extent(p, self.unit)[2] for p in units if p > 0 and is_fragment(p))
        st = self._files.get(inode.ino)
        if st is not None and (st.dirty or st.inflight):
            n += self.unit * sum(
                1 for u in {*st.dirty, *st.inflight} if u >= len(units) or units[u] == NO_UNIT
            )
        return n

    # ------------------------------------------------------------------ writes
    async def write(self, h: Handle, inode: Inode, st: FileState, off: int, data: bytes) -> None:
        """Copy ``data`` into dirty units. The size (and the map) grow with each piece
        copied, before the next await: a write that spans units may wait for space
        between them, and a commit running then (a FLUSH from any close of the file,
        e.g. a forked child closing the fds it inherited) writes back every dirty
        unit, sizing a partial last unit's fragments by ``inode.size``. A byte in a
        dirty buffer past the size would be dropped there, and the unit served with
        zeros under a checksum that matches them."""
        u_size, end = self.unit, off + len(data)
        span = range(off // u_size, (end - 1) // u_size + 1)
        claims = [sum(1 for u in span if u not in st.dirty)]
        claims[0] += off > inode.size  # the old last unit, zeroed past the old end
        await self._claim(inode, claims[0])
        try:
            inode = self.ns.get(h.ino)  # not evicted (open), but maybe quarantined
            check_failed(st)
            self.begin_change(inode)
            if off > inode.size:
                await self.zero_tail(inode, st, inode.size, claims)
            view = memoryview(data)
            pos = off
            while pos < end:
                u, uo = divmod(pos, u_size)
                n = min(u_size - uo, end - pos)
                buf = st.dirty.get(u)
                if buf is None:
                    covers = uo == 0 and pos + n >= min((u + 1) * u_size, inode.size)
                    buf = await self._dirty_unit(
                        inode, st, u, load=not covers, whole=n == u_size, claims=claims
                    )
                    check_failed(st)
                    self.begin_change(inode)  # a commit may have run during the await
                buf[uo : uo + n] = view[pos - off : pos - off + n]
                pos += n
                if pos > inode.size:  # no await since the copy (see the docstring)
                    inode.size = pos
                    self.grow_map(inode, pos)
        finally:
            self.claimed -= claims[0]  # claimed but not needed (others got there first)
        inode.touch()

    async def _claim(self, inode: Inode, units: int) -> None:
        """Promise ``units`` units of device space to a write (evicting for them if
        need be); NoSpace/QuotaExceeded when they cannot be had. A promise is held by
        the dirty unit it becomes, until that unit is allocated or discarded."""
        if units:
            await self._ensure_space(inode, units)
            self.claimed += units  # no await since the check: the room is still there

    async def _dirty_unit(
        self,
        inode: Inode,
        st: FileState,
        u: int,
        load: bool,
        whole: bool = False,
        claims: list[int] | None = None,
    ) -> mmap.mmap:
        """A private, writable copy of unit ``u``, registered as dirty; ``whole``: the
        caller overwrites all of it before its next await (no zeroing needed). Takes
        one of ``claims`` (the caller's claimed units), or claims its own."""
        own = claims is None or claims[0] <= 0
        if own:  # also when a write-back took a unit the caller saw dirty when it claimed
            await self._claim(inode, 1)
            claims = [1]
        assert claims is not None
        try:
            existing = st.dirty.get(u)
            if existing is not None:  # another writer made it dirty while we claimed
                return existing
            buf = self.buffer_pool(self.unit).take(zeroed=not (load or whole))
            if load:
                src = await self.reader.unit_view(inode, u)
                existing = st.dirty.get(u)
                if existing is not None:  # another writer got there during the await
                    return existing
                buf[:] = src
            claims[0] -= 1  # the claim is now held by the dirty unit
            st.dirty[u] = buf
            self.dirty_bytes += self.unit
            return buf
        finally:
            if own:
                self.claimed -= claims[0]

    async def zero_tail(
        self, inode: Inode, st: FileState, size: int, claims: list[int] | None = None
    ) -> None:
        """Zero bytes from ``size`` to the end of its unit (before the file grows
        past them, so bytes that were never written read as zeros)."""
        u, uo = divmod(size, self.unit)
        if uo == 0 or u >= inode.nunits:
            return
        buf = st.dirty.get(u)
        if buf is None:
            # a unit still being written back holds the old tail too: copy it dirty
            if inode.unit(u) == NO_UNIT and u not in st.inflight:
                return
            buf = await self._dirty_unit(inode, st, u, load=True, claims=claims)
        self.begin_change(inode)
        buf[uo:] = bytes(self.unit - uo)

    def grow_map(self, inode: Inode, size: int) -> None:
        need = -(-size // self.unit) - inode.nunits
        if need > 0:
            units, csums = self.ns.edit_map(inode)
            units.extend([NO_UNIT] * need)
            csums.extend([0] * need)

    def discard_dirty(self, ino: int, first: int = 0) -> None:
        """Drop dirty units ``first``.. of a file, and the space they had claimed."""
        st = self._files.get(ino)
        if st is None:
            return
        for u in [u for u in st.dirty if u >= first]:
            del st.dirty[u]
            self.dirty_bytes -= self.unit
            self.claimed -= 1

    async def truncate_at_open(self, inode: Inode, caller: Caller) -> None:
        """open(O_TRUNC). libfuse enables ``atomic_o_trunc``, so the kernel sends no
        SETATTR and leaves all of ext4's truncation to the open: size 0, mtime and
        ctime now even if the file was already empty, and setuid/setgid dropped for
        an unprivileged caller (``posix.drop_suid_sgid``), in the same record."""
        inode.mode = posix.drop_suid_sgid(inode.mode, inode.gid, caller)
        if inode.size:
            await self.truncate(inode, 0)
            return
        inode.touch()
        self.ns.commit(inode)

    async def truncate(self, inode: Inode, size: int) -> None:
        self.check_size(inode, size)
        if inode.is_dir:
            raise IsADirectory(f"inode {inode.ino}")
        st = self.state(inode.ino)
        check_failed(st)
        if size == 0:  # a full rewrite needs none of the old bytes, missing ones included
            self._unreadable.discard(inode.ino)
        self.begin_change(inode)
        if size < inode.size:
            st.shrinks += 1  # before any await: a read in flight must not trust its view
            keep = -(-size // self.unit)
            self.discard_dirty(inode.ino, keep)
            for u in [u for u in st.inflight if u >= keep]:
                del st.inflight[u]
            self.free_units(inode, keep)
            inode.size = size
            await self.zero_tail(inode, st, size)
        elif size > inode.size:
            await self.zero_tail(inode, st, inode.size)
            inode.size = size
            self.grow_map(inode, size)
        inode.touch()
        self.ns.commit(inode)
        if not st.writers:
            await self.commit(inode)

    def free_units(self, inode: Inode, first: int) -> None:
        freed = 0
        units, csums = self.ns.edit_map(inode)
        for u in range(first, len(units)):
            p = units[u]
            if p != NO_UNIT:
                # a unit on a missing member is not in the allocator: unmapped, it is
                # released implicitly (free when the member returns, as no file maps it)
                if p >> DEV_SHIFT not in self._missing:
                    self._free_later(inode.ino, p)
                freed += 1
            self.cache.discard((inode.ino, u))
        self.space.charge(inode, -freed)
        del units[first:]
        del csums[first:]

    # ------------------------------------------------------------------ write-back
    def buffer_pool(self, size: int) -> BufferPool:
        """The pool of ``size``-byte I/O buffers. Reads and writes take one-unit
        buffers, and the unit cache's come back here when it drops them: the pool
        keeps as many as the cache holds, plus ``buffer_pool_bytes`` for I/O."""
        pool = self._pools.get(size)
        if pool is None:
            cached = self.cfg.cache_bytes if size == self.unit else 0
            keep = max((self.cfg.buffer_pool_bytes + cached) // size, 2)
            pool = self._pools[size] = BufferPool(size, keep)
        return pool

    async def maybe_writeback(self, inode: Inode, st: FileState) -> None:
        """Start writing back complete dirty units once a batch has gathered."""
        if len(st.dirty) > self.cfg.writeback_units:
            full = inode.size // self.unit
            ready = sorted(u for u in st.dirty if u < full)
            if len(ready) >= self.cfg.writeback_units:
                self.start_writeback(inode, st, ready)
        while self.dirty_bytes > self.cfg.max_dirty_bytes and (st.busy or st.dirty):
            check_failed(st)
            if st.dirty:
                self.start_writeback(inode, st, sorted(st.dirty))
            await st.idle.wait()

    def start_writeback(self, inode: Inode, st: FileState, units: list[int]) -> None:
        """Allocate the units (their space was claimed when they were written, so
        this cannot fail for room) and write them in the background."""
        plan = self.allocate(inode, units)
        self.claimed -= len(units)  # the promise is kept: the units are allocated
        bufs = {u: st.dirty.pop(u) for u in units}
        st.inflight.update(bufs)
        st.busy += 1
        if st.busy == 1:
            # a fresh event only when the file goes busy: replacing the one that
            # waiters already hold (busy > 0) would leave them waiting forever, since
            # only the current event is set when busy returns to 0
            st.idle = trio.Event()
        assert self.nursery is not None
        self.nursery.start_soon(self._writeback, inode, st, plan, bufs)

    async def _writeback(
        self,
        inode: Inode,
        st: FileState,
        plan: list[tuple[int, int, list[int]]],
        bufs: dict[int, mmap.mmap],
    ) -> None:
        csums: dict[int, int] = {}
        try:
            async with domain_nursery() as nursery:
                for dev, start, lus in plan:
                    nursery.start_soon(
                        self._write_run, dev, start, [bufs[u] for u in lus], lus, csums
                    )
        except KvfsError as e:
            log.error("write-back of inode %d failed: %s", inode.ino, e)
            for dev, _, _ in plan:
                if self.pool.devices[dev].statistics().errors:
                    self._take_offline(dev)
            # the file lost these bytes: it must never be committed or served
            self.fail(st, Incomplete(f"inode {inode.ino}: write-back failed: {e}"))
            for dev, start, lus in plan:
                self.alloc.free(dev, start, len(lus))
            for u, buf in bufs.items():
                if st.inflight.get(u) is buf:
                    del st.inflight[u]
        else:
            self._install(inode, st, plan, bufs, csums)
        finally:
            self.dirty_bytes -= self.unit * len(bufs)
            st.busy -= 1
            if not st.busy:
                st.idle.set()
            bufs.clear()  # our last references: the pool may now reuse what no reader sees
            self.buffer_pool(self.unit).reap()

    async def _write_run(
        self, dev: int, start: int, bufs: list[mmap.mmap], lus: list[int], csums: dict[int, int]
    ) -> None:
        device = self.pool.devices[dev]
        unit, skip, length = extent(start, self.unit)
        offset = self.pool.unit_offset(dev, unit) + skip
        zeros = self.reader.zero

        def work() -> list[int]:
            if is_fragment(start):  # a tail: its fragments, the rest of the unit is zeros
                view = memoryview(bufs[0])[:length]
                digest = xxhash.xxh3_64(view)
                digest.update(zeros[length:])
                device.write(offset, [view])
                return [digest.intdigest()]
            sums = [xxhash.xxh3_64_intdigest(b) for b in bufs]
            device.write(offset, [memoryview(b) for b in bufs])
            return sums

        for u, c in zip(lus, await self._io(dev, work), strict=True):
            csums[u] = c
        self.journal.note_data_write(dev)

    def _install(
        self,
        inode: Inode,
        st: FileState,
        plan: list[tuple[int, int, list[int]]],
        bufs: dict[int, mmap.mmap],
        csums: dict[int, int],
    ) -> None:
        """Point the unit map at freshly written units (still uncommitted)."""
        alive = self.ns.inodes.get(inode.ino) is inode
        for dev, start, lus in plan:
            for i, u in enumerate(lus):
                p = phys(dev, start + i)
                if not alive or st.inflight.get(u) is not bufs[u] or u >= inode.nunits:
                    self.alloc.free(dev, start + i)  # superseded or truncated meanwhile
                    continue
                del st.inflight[u]
                self.begin_change(inode)  # the map changes: uncommitted until commit
                old = inode.unit(u)
                if old != NO_UNIT:
                    self._free_later(inode.ino, old)
                else:
                    self.space.charge(inode, 1)
                units, sums = self.ns.edit_map(inode)
                units[u], sums[u] = p, csums[u]
                self.cache.discard((inode.ino, u))

    def _take_offline(self, dev: int) -> None:
        if dev not in self.alloc.offline:
            log.error(
                "device %s failed a write: no new data goes there", self.pool.devices[dev].path
            )
            self.alloc.set_offline(dev)

    async def commit(self, inode: Inode, pid: int = 0) -> None:
        """Make the file's data and metadata durable (flush, fsync, close)."""
        st = self._files.get(inode.ino)
        if st is not None:
            async with st.lock:
                while (st.dirty and st.error is None) or st.busy:
                    if st.dirty and st.error is None:
                        self.start_writeback(inode, st, sorted(st.dirty))
                    await st.idle.wait()
                check_failed(st)
        # a write still in progress (the kernel sends one O_DIRECT write as many
        # concurrent requests) means the file is not complete yet: its data is
        # stored, but it stays WRITING until a commit with none (a FLUSH from
        # another process's close or an fsync may come at any moment)
        writing = st is not None and st.active > 0
        if self.ns.inodes.get(inode.ino) is inode and inode.flags & FLAG_WRITING and not writing:
            inode.flags &= ~FLAG_WRITING
            self.ns.commit(inode)
            self.evictor.committed(inode, pid)
        # Always: a close/fsync is a durable point for everything logged before it,
        # even when this file had nothing left to commit (an O_TRUNC to an empty file,
        # a commit another handle already made) -- engines rely on close ordering.
        await self.journal.wait_durable(self.journal.last_seq)

    # ------------------------------------------------------------------ placement
    def _tail_fragments(self, inode: Inode, u: int, size: int | None = None) -> int:
        """Fragments that unit ``u`` takes if it is the file's partial last unit (0:
        it takes a whole unit). Decided at write-back, when the size is known; a file
        that grows later rewrites this unit as a new dirty unit anyway."""
        tail = (inode.size if size is None else size) - u * self.unit
        if not 0 < tail < self.unit:
            return 0
        n = -(-tail // self._fragment)
        return n if n < self.alloc.fragments_per_unit else 0

    def allocate(
        self, inode: Inode, units: list[int], size: int | None = None
    ) -> list[tuple[int, int, list[int]]]:
        """Place units as (device, first physical unit, logical units) runs: logically
        consecutive units go to one device in stripes of ``stripe_units``, stripes
        rotate over the devices so one file's I/O spreads across all of them. A
        partial last unit gets a fragment run instead: (device, fragment field, [u]).
        ``size``: the size the file is going to have (a direct write's), if not its
        size now."""
        ndev = len(self.pool.devices)
        groups: list[tuple[int, list[int]]] = []
        tail = units[-1] if units and self._tail_fragments(inode, units[-1], size) else -1
        for u in units:
            if u == tail:
                continue
            dev = (inode.ino + u // self.cfg.stripe_units) % ndev
            if groups and groups[-1][0] == dev and groups[-1][1][-1] == u - 1:
                groups[-1][1].append(u)
            else:
                groups.append((dev, [u]))
        plan: list[tuple[int, int, list[int]]] = []
        try:
            for dev, lus in groups:
                prev = inode.unit(lus[0] - 1) if lus[0] > 0 else NO_UNIT
                near = (
                    (prev & UNIT_MASK) + 1
                    if prev != NO_UNIT and prev >> DEV_SHIFT == dev and not is_fragment(prev)
                    else -1
                )
                i = 0
                for d, start, count in self.alloc.allocate(len(lus), dev, near):
                    plan.append((d, start, lus[i : i + count]))
                    i += count
            if tail >= 0:
                dev = (inode.ino + tail // self.cfg.stripe_units) % ndev
                frags = self._tail_fragments(inode, tail, size)
                d, field = self.alloc.allocate_fragments(frags, dev)
                plan.append((d, field, [tail]))
        except KvfsError:
            for d, start, lus in plan:
                self.alloc.free(d, start, len(lus))
            raise
        return plan
