"""The read path: serve units from memory when resident, else read them from the
devices in parallel runs, verify their checksums, cache them, and keep a readahead
window in flight.

Resident means: a dirty or in-flight (being written back) buffer of the file, a hole
(zeros), or a verified unit in the clean cache. Concurrent fetches of one unit are
deduplicated. A checksum mismatch is never served: the reader rechecks whether the
unit was rewritten meanwhile (then it serves the new data), else it quarantines the
file (flagged, its names removed through ``remove``) and the read fails (EIO). Runs
on the trio thread; device reads go through ``io`` (worker threads, deadline).
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, NoReturn, TypeVar

import trio
import xxhash

from kvfs.common.errors import Corruption, DeviceError, KvfsError
from kvfs.devices.device import BufferPool
from kvfs.devices.pool import Pool
from kvfs.format.records import DEV_SHIFT, FLAG_QUARANTINED, NO_UNIT, extent, is_fragment
from kvfs.index.namespace import Inode, Namespace
from kvfs.store.cache import UnitCache
from kvfs.store.types import FileState

log = logging.getLogger(__name__)
T = TypeVar("T")
SNAPSHOT_TRIES = 8
"""Attempts of one read whose file shrank under it each time before it fails (EIO)."""


@asynccontextmanager
async def domain_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery that fails with the first KvfsError itself when only KvfsErrors
    failed it: trio wraps child errors in an ExceptionGroup, but callers (and the
    FUSE adapter, which maps only KvfsError) must see the domain error."""
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        matched, rest = group.split(KvfsError)
        if matched is None or rest is not None:
            raise
        first: BaseException = matched
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None


class Reader:
    """Unit reads for one store (see the module docstring)."""

    def __init__(
        self,
        pool: Pool,
        cache: UnitCache,
        ns: Namespace,
        files: dict[int, FileState],
        *,
        io: Callable[[int, Callable[[], Any]], Awaitable[Any]],
        buffers: Callable[[int], BufferPool],
        remove: Callable[[Inode], None],
        spawn: Callable[..., None],
        readahead_units: int,
        read_piece_units: int,
    ) -> None:
        self.pool, self.cache, self._files = pool, cache, files
        self.unit = pool.unit_size
        self.ns = ns
        self._io, self._buffers, self._remove, self._spawn = io, buffers, remove, spawn
        self.readahead_units, self.read_piece_units = readahead_units, read_piece_units
        self.zero = memoryview(bytes(self.unit)).toreadonly()
        """A unit of zeros (holes; the rest of a unit after its fragment tail)."""
        self._fetching: dict[tuple[int, int], trio.Event] = {}
        self.bad_units: set[tuple[int, int]] = set()  # (inode, unit) found corrupt
        self.quarantined = 0
        self.bytes_from_memory = 0
        """Bytes read served without waiting for a device (cache, readahead, unflushed
        writes, holes)."""
        self.bytes_from_device = 0
        """Bytes read that waited for a device read."""
        self.retaken = 0
        """Reads taken again because a truncate shrank the file while they waited."""

    def resident(self, inode: Inode, st: FileState | None, u: int) -> memoryview | None:
        """Unit ``u`` if it can be served without device I/O."""
        if st is not None:
            buf: mmap.mmap | None = st.dirty.get(u) or st.inflight.get(u)
            if buf is not None:
                return memoryview(buf)
        if inode.unit(u) == NO_UNIT:
            return self.zero
        return self.cache.get((inode.ino, u))

    async def unit_view(self, inode: Inode, u: int) -> memoryview:
        """Unit ``u``, from memory or the devices."""
        view = self.resident(inode, self._files.get(inode.ino), u)
        if view is None:
            view = (await self.fetch(inode, [u]))[u]
        return view

    async def read(self, inode: Inode, off: int, end: int) -> bytes | memoryview:
        """Bytes ``off``..``end`` of ``inode`` (within its size), all taken with no
        truncate between them; a single unit is returned as a zero-copy view.

        A truncate that shrinks the file while this read waits for a device may take
        units the read counted on (a unit another fetch was reading comes back a hole
        once the truncate unmapped it) and the length was taken from the old size: the
        read is then taken again within the new size (EOF may come earlier: a short
        count, as a read racing a truncate may get). EIO if the file keeps shrinking
        under every attempt."""
        for _ in range(SNAPSHOT_TRIES):
            st = self._files.get(inode.ino)
            shrinks = st.shrinks if st is not None else 0
            data = await self._read_once(inode, off, end)
            now = self._files.get(inode.ino)
            if now is st and (now is None or now.shrinks == shrinks):
                return data
            self.retaken += 1
            end = min(end, inode.size)
            if off >= end:
                return b""
        raise DeviceError(f"inode {inode.ino}: truncated under {SNAPSHOT_TRIES} reads in a row")

    async def _read_once(self, inode: Inode, off: int, end: int) -> bytes | memoryview:
        first, last = off // self.unit, (end - 1) // self.unit
        st = self._files.get(inode.ino)
        views: dict[int, memoryview] = {}
        missing = []
        for u in range(first, last + 1):
            view = self.resident(inode, st, u)
            if view is None:
                missing.append(u)
            else:
                views[u] = view
        base = first * self.unit
        waited = 0
        if missing:
            views.update(await self.fetch(inode, missing))
            unit = self.unit
            waited = sum(min(end, (u + 1) * unit) - max(off, u * unit) for u in missing)
        self.bytes_from_device += waited
        self.bytes_from_memory += end - off - waited
        self._readahead(inode, last)
        if first == last:
            return views[first][off - base : end - base]
        parts = [views[u] for u in range(first, last + 1)]
        return b"".join(parts)[off - base : end - base]

    def _readahead(self, inode: Inode, last: int) -> None:
        """Fetch the next window in the background while the kernel consumes this one."""
        stop = min(last + 1 + self.readahead_units, inode.nunits)
        nxt = [
            u
            for u in range(last + 1, stop)
            if inode.unit(u) != NO_UNIT
            and (inode.ino, u) not in self._fetching
            and (inode.ino, u) not in self.cache
        ]
        if nxt:
            self._spawn(self._prefetch, inode, nxt)

    async def _prefetch(self, inode: Inode, units: list[int]) -> None:
        try:
            await self.fetch(inode, units)
        except KvfsError as e:
            log.debug("readahead of inode %d failed: %s", inode.ino, e)

    async def fetch(self, inode: Inode, units: list[int]) -> dict[int, memoryview]:
        """Read units from the devices (deduplicated against concurrent fetches),
        verify their checksums and cache them."""
        ino = inode.ino
        theirs = {u: self._fetching[(ino, u)] for u in units if (ino, u) in self._fetching}
        mine = [u for u in units if u not in theirs]
        done = trio.Event()
        for u in mine:
            self._fetching[(ino, u)] = done
        results: dict[int, memoryview] = {}
        try:
            if mine:
                async with domain_nursery() as nursery:
                    for run in self._runs(inode, mine):
                        nursery.start_soon(self._read_run, inode, run, results)
        finally:
            for u in mine:
                del self._fetching[(ino, u)]
            done.set()
        for u, event in theirs.items():
            await event.wait()
            view = self.resident(inode, self._files.get(ino), u)
            results[u] = view if view is not None else (await self.fetch(inode, [u]))[u]
        return results

    def _runs(self, inode: Inode, units: list[int]) -> list[list[tuple[int, int, int]]]:
        """Group units into (logical, physical, checksum) runs contiguous on one device;
        a fragment tail is a run of its own."""
        runs: list[list[tuple[int, int, int]]] = []
        for u in sorted(units):
            # a readahead scheduled before a truncate may ask for units now gone
            p = inode.unit(u)
            if p == NO_UNIT:
                continue
            run = runs[-1] if runs else None
            if (
                run
                and not is_fragment(p)
                and run[-1][1] + 1 == p
                and run[-1][0] + 1 == u
                and len(run) < self.read_piece_units
            ):
                run.append((u, p, inode.csum(u)))
            else:
                runs.append([(u, p, inode.csum(u))])
        return runs

    async def _read_run(
        self, inode: Inode, run: list[tuple[int, int, int]], results: dict[int, memoryview]
    ) -> None:
        dev, u_size = run[0][1] >> DEV_SHIFT, self.unit
        # a fragment tail reads only its fragments, into a zeroed unit buffer
        start, skip, length = extent(run[0][1], u_size)
        device, whole_units = self.pool.devices[dev], not is_fragment(run[0][1])
        # one-unit buffers of the one pool the cache's units come back to (a run is
        # one vectored request): reused, never a fresh mapping per read
        pool = self._buffers(u_size)
        bufs = [pool.take(zeroed=not whole_units) for _ in run]  # or all read
        offset = self.pool.unit_offset(dev, start) + skip

        def work() -> list[int]:
            views = [memoryview(b) for b in bufs]
            device.read_vec(offset, views if whole_units else [views[0][:length]])
            return [xxhash.xxh3_64_intdigest(v) for v in views]

        sums: list[int] = await self._io(dev, work)
        for i, (u, p, csum) in enumerate(run):
            view = memoryview(bufs[i]).toreadonly()
            current = inode.unit(u)
            # rewritten while we read: the unit moved, or was freed and taken again
            # for this same unit of this file, with new content (same place, new sum)
            same = current == p and inode.csum(u) == csum
            if sums[i] != csum:
                if not same:  # serve the new data
                    now = self.resident(inode, self._files.get(inode.ino), u)
                    if now is None:  # read it here: a fetch would wait for this one
                        await self._read_run(inode, [(u, current, inode.csum(u))], results)
                    else:
                        results[u] = now
                    continue
                self._quarantine(inode, u, p)
            if same:  # never cache bytes the file no longer holds
                self.cache.put((inode.ino, u), view)
            results[u] = view

    def _quarantine(self, inode: Inode, u: int, p: int) -> NoReturn:
        self.bad_units.add((inode.ino, u))
        if inode.flags & FLAG_QUARANTINED:  # a concurrent read found it first
            raise Corruption(f"inode {inode.ino}: checksum mismatch in unit {u}")
        self.quarantined += 1
        path = self.pool.devices[p >> DEV_SHIFT].path
        log.error(
            "checksum mismatch: inode %d unit %d at %s unit %d; file quarantined",
            inode.ino,
            u,
            path,
            extent(p, self.unit)[0],  # a fragment tail: its host unit
        )
        inode.flags |= FLAG_QUARANTINED
        self.ns.commit(inode)
        self._remove(inode)
        raise Corruption(f"inode {inode.ino}: checksum mismatch in unit {u}")
