"""The pool's free space: deferred frees, TRIM, and who holds which bytes.

Units a file no longer maps are not reusable at once: a durable journal record may
still reference them (copy-on-write, ``docs/design.md``). They wait here until the
journal's durable point passes the record that dropped them, are then discarded
(BLKDISCARD / hole punch) in coalesced runs, and only then go back to the allocator.
Running counters say what each directory subtree, each top-level directory (a
quota's group) and each owner holds (fair shares). Making room is the eviction
driver's (:mod:`kvfs.evict.driver`). Everything here runs on the trio thread.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable

import trio

from kvfs.common.errors import DeviceError
from kvfs.devices.alloc import Allocator
from kvfs.devices.pool import Pool
from kvfs.format.records import DEV_SHIFT, UNIT_MASK, extent, is_fragment
from kvfs.index.namespace import ROOT_INO, Inode, Namespace
from kvfs.log.journal import Journal

log = logging.getLogger(__name__)


def coalesce(units: list[int]) -> list[tuple[int, int, int]]:
    """Sorted packed unit addresses -> (device, start, count) runs; a fragment run
    (its unit field as ``start``) stays a run of its own."""
    runs: list[tuple[int, int, int]] = []
    for p in units:
        dev, unit = p >> DEV_SHIFT, p & UNIT_MASK
        if (
            runs
            and not is_fragment(unit)
            and runs[-1][0] == dev
            and runs[-1][1] + runs[-1][2] == unit
        ):
            runs[-1] = (dev, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((dev, unit, 1))
    return runs


class Space:
    """Free-space bookkeeping for one store: deferred frees, TRIM, usage counters."""

    def __init__(
        self,
        pool: Pool,
        alloc: Allocator,
        journal: Journal,
        ns: Namespace,
        *,
        io: Callable[[int, Callable[[], None]], Awaitable[None]],
        claimed: Callable[[], int] = lambda: 0,
        reserve_units: int = 0,
        discard: bool,
    ) -> None:
        self.pool, self.alloc, self.journal, self.ns = pool, alloc, journal, ns
        self.unit = pool.unit_size
        self._io, self._claimed = io, claimed
        self.reserve_units = reserve_units
        """Units only privileged users may fill."""
        self.discard = discard
        self._uids: dict[int, int] = {}  # uid -> bytes mapped
        self._tree: dict[int, int] = {}
        """Directory -> bytes mapped by the named files in its subtree (absent: none);
        running counters, started by :meth:`count_usage` at mount."""
        self._root_files = 0  # bytes mapped by the root's own files
        self._tops: set[int] = set()  # the top-level directories
        self._deferred: deque[tuple[int, int]] = deque()
        self._trim: list[int] = []
        self._trimming = 0
        self._trim_wake = trio.Event()
        self.freed = trio.Event()
        """Set (and replaced by a new one) whenever freed units become reusable."""

    # ------------------------------------------------------------------ frees
    def defer_free(self, p: int) -> None:
        """Free unit ``p`` once everything logged so far is durable. If that is so
        already, at once: the journal's next durable point may never come (every
        writer waiting for room, nothing logged), and a write that counts on
        pending frees would wait for them forever."""
        seq = self.journal.last_seq
        self._deferred.append((seq, p))
        if seq <= self.journal.durable_seq:
            self.release_frees(seq)

    def release_frees(self, durable: int) -> None:
        """The journal's durable point moved: TRIM, then reuse, what it released."""
        released = False
        while self._deferred and self._deferred[0][0] <= durable:
            _, p = self._deferred.popleft()
            if self.discard:
                self._trim.append(p)
            else:
                self.alloc.free(p >> DEV_SHIFT, p & UNIT_MASK)
                released = True
        if self._trim:
            self._trim_wake.set()
        if released:
            self._signal_freed()

    def _signal_freed(self) -> None:
        freed, self.freed = self.freed, trio.Event()
        freed.set()

    async def trim_loop(self) -> None:
        """Discard freed units in large coalesced runs before they are reused (a
        fragment run: only its fragments)."""
        while True:
            await self._trim_wake.wait()
            self._trim_wake = trio.Event()
            batch, self._trim = sorted(self._trim), []
            self._trimming = len(batch)
            for dev, start, count in coalesce(batch):
                device = self.pool.devices[dev]
                unit, skip, length = extent(start, self.unit)
                offset, length = self.pool.unit_offset(dev, unit) + skip, count * length
                try:
                    await self._io(dev, functools.partial(device.discard, offset, length))
                except DeviceError as e:
                    log.warning("discard failed: %s", e)
                self.alloc.free(dev, start, count)
                self._trimming -= count
            self._signal_freed()

    def pending_free(self) -> int:
        """Units freed but not yet reusable (waiting for the journal or for TRIM)."""
        return len(self._deferred) + len(self._trim) + self._trimming

    def available(self) -> int:
        """Free units not promised to a write yet (``claimed``: dirty units and
        claims in progress)."""
        return self.alloc.free_units - self._claimed()

    def in_flight(self) -> int:
        """Units claimed by writes not yet committed (dirty units, claims in progress)."""
        return self._claimed()

    def used_fraction(self) -> float:
        """Used share of the devices that take writes (a device taken offline after a
        failed write is no reason to evict: freeing its units gains nothing)."""
        online = self.alloc.online_units
        if not online:
            return 0.0
        free = self.available() + self.pending_free()
        return 1 - free / online

    # ------------------------------------------------------------------ usage counters
    def count_usage(self) -> None:
        """Start the running counters from the index (a mount, before serving): bytes
        mapped per directory subtree, per owner, and the top-level directories, in
        C-level passes over the columns (``Namespace.mapped_by_directory``)."""
        by_dir, by_uid, tops = self.ns.mapped_by_directory()
        self._tree, self._root_files = {}, 0
        for d, units in by_dir.items():
            self._add(d, units * self.unit)
        self._uids = {uid: units * self.unit for uid, units in by_uid.items()}
        self._tops = set(tops)

    def _add(self, d: int, delta: int) -> None:
        """``delta`` bytes more under directory ``d``: for it and each ancestor below
        the root (O(depth)); the root's own files have a counter of their own."""
        if not delta:
            return
        if d == ROOT_INO:
            self._root_files += delta
            return
        tree, parent_of = self._tree, self.ns.parent_of
        for _ in range(4096):
            total = tree.get(d, 0) + delta
            if total:
                tree[d] = total
            else:
                del tree[d]  # a directory with no bytes below it costs no entry
            d = parent_of(d)
            if d == ROOT_INO:
                return

    def charge(self, inode: Inode, units: int) -> None:
        """Account mapped units to the inode's owner and, while it has a name, to its
        directory and that directory's ancestors (an unlinked file's bytes left them
        with its last name: :meth:`placed`)."""
        if not units:
            return
        self._uids[inode.uid] = self._uids.get(inode.uid, 0) + units * self.unit
        if inode.nlink:
            self._add(inode.parent, units * self.unit)

    def placement(self, inode: Inode) -> tuple[int, int] | None:
        """(the directory whose counters hold the inode's bytes, those bytes), None
        for an inode without a name (or gone): what :meth:`placed` compares."""
        if inode.ino not in self.ns.inodes or not inode.nlink:
            return None
        if inode.is_dir:
            return inode.parent, self._tree.get(inode.ino, 0)
        return inode.parent, inode.mapped_units * self.unit

    def placed(self, inode: Inode, before: tuple[int, int] | None) -> None:
        """A name operation is done (rename, unlink, link, rmdir, eviction): move the
        inode's bytes from where they were counted (``before``, its
        :meth:`placement` then) to where they count now: O(depth), a directory's
        whole subtree included (its total moves, nothing below it is walked)."""
        after = self.placement(inode)
        if after != before:
            if before is not None:
                self._add(before[0], -before[1])
            if after is not None:
                self._add(after[0], after[1])
        if after is not None and after[0] == ROOT_INO and inode.is_dir:
            self._tops.add(inode.ino)
        else:
            self._tops.discard(inode.ino)

    def group_usage(self, group: int) -> int:
        """Bytes mapped by the named files of a top-level directory's subtree (for
        ``ROOT_INO``: of the root's own files), O(1)."""
        return self._root_files if group == ROOT_INO else self._tree.get(group, 0)

    def top_level(self) -> list[tuple[int, int]]:
        """(top-level directory, bytes under it) for each one, O(top-level directories)."""
        tree = self._tree
        return [(d, tree.get(d, 0)) for d in self._tops]

    def uid_usage(self) -> dict[int, int]:
        """Bytes mapped per file owner (kept by :meth:`charge` and :meth:`owner_changed`)."""
        return self._uids

    def owner_changed(self, inode: Inode, old_uid: int) -> None:
        """A chown moved a file's bytes to another owner."""
        if old_uid != inode.uid:
            moved = inode.mapped_units * self.unit
            self._uids[old_uid] = self._uids.get(old_uid, 0) - moved
            self._uids[inode.uid] = self._uids.get(inode.uid, 0) + moved

    def fair_share(self) -> int:
        """Bytes each user may hold before its own files are the ones to go: what
        unprivileged users may fill, split evenly over the users holding data."""
        users = sum(1 for used in self.uid_usage().values() if used > 0) or 1
        return (self.alloc.online_units - self.reserve_units) * self.unit // users
