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

import dataclasses
import itertools
import logging
import mmap
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

import trio
import xxhash

from kvfs import directpath, posix, procs
from kvfs.alloc import Allocator
from kvfs.cache import UnitCache
from kvfs.check import Report, check_index, fix_dir_links
from kvfs.device import BufferPool
from kvfs.directpath import DirectPath
from kvfs.errors import (
    Corruption,
    DeviceError,
    FileTooLarge,
    Incomplete,
    IsADirectory,
    KvfsError,
    NoSpace,
    NotPermitted,
    QuotaExceeded,
)
from kvfs.evict import FRESH_GRACE, QUOTA_XATTR, Evictor
from kvfs.format.records import (
    DEV_SHIFT,
    FLAG_GONE,
    FLAG_QUARANTINED,
    FLAG_WRITING,
    NO_UNIT,
    UNIT_MASK,
    Op,
    extent,
    fragment_size,
    is_fragment,
    phys,
)
from kvfs.journal import ApplySink, Journal, Recovered, recover
from kvfs.namespace import ROOT_INO, Inode, Namespace
from kvfs.policy import DEFAULT_POLICY
from kvfs.pool import Pool
from kvfs.posix import ROOT, Caller
from kvfs.readpath import Reader, domain_nursery
from kvfs.space import Space

log = logging.getLogger(__name__)
T = TypeVar("T")

LOGGED_NAMES = 50
"""How many files a mount names in its log when it drops or cannot read them."""

FILE_SIZE_LIMIT = 1 << 40
"""No file is larger than this (1 TiB), whatever the settings."""


@dataclass(frozen=True)
class StoreConfig:
    """Tunables, validated once; see ``docs/design.md`` for the measured reasons."""

    cache_bytes: int = 256 << 20
    readahead_units: int = 8
    writeback_units: int = 8
    stripe_units: int = 8
    read_piece_units: int = 4
    max_dirty_bytes: int = 512 << 20
    io_timeout: float = 30.0
    queue_depth: int = 4
    max_file_size: int = 0
    """Bytes a file may reach (EFBIG past it, before anything is evicted for it);
    0: a quarter of the pool. A top-level directory may set its own
    (``user.kvfs.max_file_size``). Never more than ``FILE_SIZE_LIMIT``."""
    reserve: float = 0.05
    """Share of the pool only root (and the mount's owner) may fill, as ext4's
    reserved blocks: another user can never starve them."""
    commit_interval: float = 0.05
    buffer_pool_bytes: int = 64 << 20
    eviction_policy: str = DEFAULT_POLICY
    default_policy: str = "kvfs-managed"
    fresh_grace: float = FRESH_GRACE
    """Seconds after its close during which a file is evicted only as a last resort."""
    high_watermark: float = 0.97
    low_watermark: float = 0.94
    discard: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low < high <= 1")
        for name in ("readahead_units", "writeback_units", "stripe_units", "read_piece_units"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.fresh_grace < 0:
            raise ValueError("fresh_grace must be >= 0")
        if self.io_timeout <= 0 or self.queue_depth < 1 or self.cache_bytes < 0:
            raise ValueError("io_timeout, queue_depth and cache_bytes must be positive")
        if not 0 <= self.reserve < 0.5:
            raise ValueError("the reserve must be a fraction in [0, 0.5)")
        if not 0 <= self.max_file_size <= FILE_SIZE_LIMIT:
            raise ValueError(f"the maximum file size must be at most {FILE_SIZE_LIMIT} bytes")


@dataclass(eq=False)
class FileState:
    """Runtime data state of one inode: dirty and in-flight units, writer count.

    ``error`` is sticky: once a write-back failed or a writer died mid-write, the
    file's bytes are not all stored, so every later write, read, flush and fsync of
    it fails (EIO), it is never committed, and its last close removes it."""

    dirty: dict[int, mmap.mmap] = field(default_factory=dict)
    inflight: dict[int, mmap.mmap] = field(default_factory=dict)
    busy: int = 0
    idle: trio.Event = field(default_factory=trio.Event)
    lock: trio.Lock = field(default_factory=trio.Lock)
    error: KvfsError | None = None
    writers: int = 0
    active: int = 0
    """``write`` calls in progress: while one is, a commit is no end of the file."""


@dataclass(frozen=True)
class Handle:
    ino: int
    writable: bool
    pid: int
    owner: tuple[int, int] | None = None
    """The opening process as (pid, start time): is it dying when it closes?"""
    uid: int = 0
    """The opener's user: what it holds open, it pins (bounded per user)."""


@dataclass(frozen=True)
class RecoveryReport:
    generation: int
    transactions: int
    files: int
    directories: int
    dropped_incomplete: int
    dropped_unlinked: int
    seconds: float
    unreadable: int = 0
    """Files kept with data on a missing member (degraded mount): reads fail (EIO)."""
    dropped_unreadable: int = 0
    """Files with data on a missing member dropped at the operator's request."""


@dataclass(frozen=True)
class DeviceSpace:
    path: str
    data_bytes: int
    free_bytes: int
    writable: bool
    """False once the member failed a write (no new data goes there)."""


@dataclass(frozen=True)
class StoreStatistics:
    files: int
    directories: int
    unit_size: int
    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    dirty_bytes: int
    pending_free_bytes: int
    reads: int
    writes: int
    bytes_read: int
    bytes_written: int
    device_bytes_read: int
    device_bytes_written: int
    corruptions: int
    incomplete: int
    evictions: int
    orphan_evictions: int
    quarantined: int
    unreadable_files: int
    """Files with data on a missing member (degraded mount): listed, reads fail."""
    open_handles: int


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
        self._pools: dict[int, BufferPool] = {}
        self._files: dict[int, FileState] = {}
        self._handles: dict[int, Handle] = {}
        self._wrote: set[int] = set()
        """Handles that have written: a killed opener's close of one of them means
        an incomplete file, whatever commits a FLUSH or fsync made meanwhile."""
        self._pins: dict[int, dict[int, int]] = {}  # uid -> {inode: its open handles}
        self._next_fh = 1
        self._limiters = [trio.CapacityLimiter(self.cfg.queue_depth) for _ in pool.devices]
        self._dirty_bytes = 0
        self._claimed = 0  # units promised to writes: dirty units + claims in progress
        self._nursery: trio.Nursery | None = None
        self._reads = self._writes = self._bytes_read = self._bytes_written = 0
        self._bad_units: set[tuple[int, int]] = set()  # (inode, unit) found corrupt
        self._quarantined = self._incomplete = 0
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
            self._files,
            io=self._io,
            buffers=self._buffer_pool,
            quarantine=self._quarantine,
            spawn=self._spawn,
            readahead_units=self.cfg.readahead_units,
            read_piece_units=self.cfg.read_piece_units,
        )
        self.space = Space(
            pool,
            self.alloc,
            self.journal,
            self.ns,
            self.evictor,
            io=self._io,
            evictable=self._evictable,
            evict=self._unlink_everywhere,
            claimed=lambda: self._claimed,
            pinned=self._pinned,
            privileged=lambda uid: uid in (0, os.getuid()),
            reserve_units=int(self.alloc.total_units * self.cfg.reserve),
            checkpointed_inodes=lambda: self._ckpt_inodes,
            high_watermark=self.cfg.high_watermark,
            low_watermark=self.cfg.low_watermark,
            discard=self.cfg.discard,
        )
        self.direct = DirectPath(self)
        """Leases and reservations of the zero-copy path (:mod:`kvfs.directpath`)."""

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
        return self._load(drop_unreadable)

    def _load(self, drop_unreadable: bool) -> RecoveryReport:
        t0 = time.monotonic()
        meta, start, size = self.pool.meta
        sink = ApplySink(self.ns.apply, self.ns.reset, load=self.ns.load_payload)
        found = recover(meta, start, size, self.pool.seed, sink)
        doomed: set[int] = set()
        if found.damage:
            doomed = self._salvage(found, sink.skipped)
        elif sink.skipped:  # a checkpoint window's replay: names of what was dropped
            log.info("recovery: %d replayed operation(s) named dropped inodes", sink.skipped)
        self.ns.finish_load()
        if ROOT_INO not in self.ns.inodes:
            raise Corruption("metadata has no root directory")
        incomplete, unlinked, dropped = self._drop_unfinished(doomed, drop_unreadable)
        self._rebuild_allocator()
        self.evictor.adopt_all()
        clean = not (
            found.transactions
            or found.fell_back
            or found.damage
            or incomplete
            or unlinked
            or dropped
        )
        self.journal.resume(found, in_place=clean)
        if clean:  # the checkpoint found is the last one: it holds exactly these
            self._ckpt_inodes = len(self.ns.inodes)
        report = RecoveryReport(
            found.generation,
            found.transactions,
            self.ns.file_count,
            self.ns.dir_count,
            incomplete,
            unlinked,
            time.monotonic() - t0,
            unreadable=len(self.unreadable),
            dropped_unreadable=dropped,
        )
        log.info("recovered %s", report)
        return report

    def _salvage(self, found: Recovered, skipped: int) -> set[int]:
        """Rebuild the index from a log damaged in the middle: the transactions after
        the damage are applied too (each is whole and checksummed), what no longer
        fits together is dropped (names of missing inodes, unreachable inodes, units
        claimed twice: fsck's checks), link counts are fixed. Loud, and the mount
        then checkpoints the salvaged index. Returns the inodes to drop. ``skipped``:
        operations recovery's sink could not apply (they named what is gone)."""
        for damage in found.damage:
            log.error("metadata log %s; salvaging", damage)
        report = Report()
        check_index(self.ns, self._checkable_pool(), report)
        for fix in report.fixes:
            fix()
        fix_dir_links(self.ns)
        log.error(
            "metadata log salvaged: %d operation(s) skipped, %d problem(s) fixed, "
            "%d file(s) dropped; run kvfs fsck for a data check",
            skipped,
            len(report.problems),
            len(report.doomed),
        )
        for problem in report.problems[:50]:
            log.warning("salvage: %s", problem)
        return report.doomed

    def _checkable_pool(self) -> Pool:
        """The pool as fsck's checks must see it in a degraded mount: a missing
        member's size is unknown, and its units are unreadable, not outside the pool."""
        if not self._missing:
            return self.pool
        sbs = [
            dataclasses.replace(sb, data_units=UNIT_MASK + 1) if dev in self._missing else sb
            for dev, sb in enumerate(self.pool.superblocks)
        ]
        return Pool(self.pool.devices, sbs)

    def _drop_unfinished(self, doomed: set[int], drop_unreadable: bool) -> tuple[int, int, int]:
        """Drop files left mid-write or unlinked-while-open by a crash, ``doomed`` ones
        (a salvage), and names that point nowhere. Files with data on a missing member
        (degraded mount) are kept as :attr:`unreadable`, or dropped too with
        ``drop_unreadable``. Returns (incomplete, unlinked, unreadable dropped)."""
        doomed = {i for i in doomed if i in self.ns.inodes}
        doomed.update(self.ns.scan_inodes(FLAG_WRITING | FLAG_QUARANTINED))
        unreadable = self._on_missing_members(doomed, drop_unreadable)
        incomplete = sum(1 for i in doomed if self.ns.inodes[i].nlink)
        unlinked = len(doomed) - incomplete
        if drop_unreadable:
            doomed |= unreadable
        else:
            self.unreadable = unreadable
        for ino in doomed:
            self.ns.discard(ino)  # its names too
        return incomplete, unlinked, len(unreadable) if drop_unreadable else 0

    def _on_missing_members(self, doomed: set[int], drop: bool) -> set[int]:
        """Files (other than ``doomed`` ones) with a unit on a missing member, logged:
        their count and the first names."""
        missing = self._missing
        if not missing:
            return set()
        found = [
            inode
            for inode in self.ns.inodes.values()
            if inode.ino not in doomed
            and any(p != NO_UNIT and p >> DEV_SHIFT in missing for p in inode.units)
        ]
        log.warning(
            "degraded: %d file(s), %d bytes, have data on missing member(s) %s: %s",
            len(found),
            sum(inode.size for inode in found),
            ", ".join(str(i + 1) for i in sorted(missing)),
            "dropped (--drop-unreadable)"
            if drop
            else "kept and listed; every read of them fails (EIO) until the member returns",
        )
        what = "dropped" if drop else "unreadable"
        for inode in found[:LOGGED_NAMES]:
            log.warning("%s: inode %d %s", what, inode.ino, inode.name.decode(errors="replace"))
        if len(found) > LOGGED_NAMES:
            log.warning("%s: %d more file(s) not named here", what, len(found) - LOGGED_NAMES)
        return {inode.ino for inode in found}

    def _rebuild_allocator(self) -> None:
        """Claim every mapped unit; a file in one contiguous extent (the common case)
        is claimed in one step, read from the namespace's columns (no views).
        Units on a missing member are skipped: the allocator has none there."""
        missing = self._missing
        mark = self.alloc.mark_used
        firsts, rest = self.ns.unit_columns()
        fragments = self.alloc.claim_firsts(firsts, missing)
        for first, count in itertools.chain(((p, 1) for p in fragments), rest):
            if first >> DEV_SHIFT not in missing:
                mark(first >> DEV_SHIFT, first & UNIT_MASK, count)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve: start the background tasks, checkpoint the recovered state unless
        it came from a clean unmount, run until cancelled. Callers should use
        :meth:`close` before cancelling."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.journal.run)
            await self.journal.start()
            nursery.start_soon(self.space.evict_loop)
            nursery.start_soon(self.space.trim_loop)
            task_status.started()
            await trio.sleep_forever()

    async def close(self) -> None:
        """Commit every closed file and write a final checkpoint (clean unmount).

        A file still open for writing (the daemon told to stop under a live writer)
        was never closed: it is left uncommitted, so the next mount drops it, exactly
        as after a crash -- a writer's bytes count only once it closes the file."""
        self.space.stopping = True
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

    def _take_offline(self, dev: int) -> None:
        if dev not in self.alloc.offline:
            log.error(
                "device %s failed a write: no new data goes there", self.pool.devices[dev].path
            )
            self.alloc.set_offline(dev)

    # ------------------------------------------------------------------ handles
    def _state(self, ino: int) -> FileState:
        st = self._files.get(ino)
        if st is None:
            st = self._files[ino] = FileState()
            st.idle.set()
        return st

    def handle(self, fh: int) -> Handle:
        return self._handles[fh]

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
            await self._truncate_at_open(inode, caller)
            inode = self.ns.get(ino)  # the await may have let an eviction in
        inode.opens += 1
        owner = self.evictor.opened(inode, caller.pid)
        if writable:
            self._state(ino).writers += 1
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = Handle(ino, writable, caller.pid, owner, caller.uid)
        pins = self._pins.setdefault(caller.uid, {})
        pins[ino] = pins.get(ino, 0) + 1
        return fh

    def _pinned(self, uid: int) -> int:
        """Bytes of the files user ``uid`` holds open (they cannot be evicted), the
        ones still in memory (dirty, being written back) included."""
        inodes, files, units = self.ns.inodes, self._files, 0
        for ino in self._pins.get(uid, ()):
            inode, st = inodes.get(ino), files.get(ino)
            units += inode.mapped_units if inode is not None else 0
            units += len(st.dirty) + len(st.inflight) if st is not None else 0
        return units * self.unit

    def _unpin(self, h: Handle) -> None:
        pins = self._pins.get(h.uid)
        if pins is not None and h.ino in pins:
            pins[h.ino] -= 1
            if not pins[h.ino]:
                del pins[h.ino]
                if not pins:
                    del self._pins[h.uid]

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
        again, committed or not."""
        h = self._handles[fh]
        inode = self.ns.inodes.get(h.ino)
        if not h.writable or inode is None:
            return
        if self.direct.pending(fh):  # closed before its direct write's commit
            self.direct.abandon(fh)  # the file is incomplete: dropped at last close
            return
        unfinished = inode.flags & FLAG_WRITING or fh in self._wrote
        if unfinished and h.owner is not None and procs.killed(*h.owner):
            st = self._state(inode.ino)
            if st.error is None:
                log.warning(
                    "inode %d: its writer (pid %d) was killed before closing it; "
                    "the incomplete file is dropped",
                    inode.ino,
                    h.owner[0],
                )
                self._fail(st, Incomplete(f"inode {inode.ino}: writer killed mid-write"))
                if not inode.flags & FLAG_WRITING:  # uncommitted again: its last close
                    inode.flags |= FLAG_WRITING  # removes it, recovery drops it
                    self.ns.commit(inode)
                    await self.journal.wait_durable(self.journal.last_seq)
            return
        await self.commit(inode, h.pid)

    def _fail(self, st: FileState, error: KvfsError) -> None:
        """Make a file's failure sticky (see :class:`FileState`)."""
        if st.error is None:
            st.error = error
            self._incomplete += 1

    async def check_metadata_room(self) -> None:
        """Room in the metadata area for an operation that grows the index. Metadata
        pressure is eviction pressure: once the last checkpoint is over the area's
        limit, files are evicted by data eviction's rules and a smaller checkpoint
        is taken (``Space.make_metadata_room``; removals since the last checkpoint
        count too: a dropped row leaves the image at once, see
        ``Namespace._strip_row``). NoSpace only when nothing could go."""
        if self.journal.metadata_full:
            await self.space.make_metadata_room()
        if self.journal.metadata_full:
            self.space.log_metadata_full()
            raise NoSpace("metadata area full: nothing may be evicted")

    async def make(
        self, parent: int, name: bytes, mode: int, caller: Caller = ROOT, flags: int = 0
    ) -> Inode:
        """mkdir / mknod: a new committed directory or empty file, owned by ``caller``
        (or, in a setgid directory, by the directory's group: ``posix.new_owner``)."""
        await self.check_metadata_room()
        d = self.ns.get(parent)
        mode, gid = posix.new_owner(d.mode, d.gid, mode, caller)
        inode = self.ns.make(parent, name, mode, caller.uid, gid, flags=flags)
        if not inode.is_dir and not flags & FLAG_WRITING:
            # mknod: a committed empty file, evictable like a closed one (it costs
            # the index what any file does)
            self.evictor.created(inode, caller.pid)
            self.evictor.committed(inode, caller.pid)
        return inode

    async def create(self, parent: int, name: bytes, mode: int, caller: Caller = ROOT) -> Inode:
        """A new empty file, marked WRITING until its first commit."""
        inode = await self.make(parent, name, mode, caller, flags=FLAG_WRITING)
        self.evictor.created(inode, caller.pid)
        return inode

    def rename(self, old_parent: int, old: bytes, new_parent: int, new: bytes, flags: int) -> None:
        """POSIX rename (and renameat2's flags); a file that moves to another group
        takes its bytes' count along (O(1), no recount of any group)."""
        moving = [] if old_parent == new_parent else self._movers(old_parent, old, new_parent, new)
        groups = [(inode, self.evictor.group_of(inode)) for inode in moving]
        victim = self.ns.rename(old_parent, old, new_parent, new, flags)
        if victim is not None:
            self.maybe_drop(victim)
        for inode, group in groups:
            self.space.moved(inode, group)

    def _movers(self, old_parent: int, old: bytes, new_parent: int, new: bytes) -> list[Inode]:
        """The inodes a rename between two directories may move to the other one: the
        source, and the target in case of an exchange (a replaced target is dropped,
        not moved). Empty when the rename is going to fail anyway."""
        found = []
        for parent, name in ((old_parent, old), (new_parent, new)):
            d = self.ns.inodes.get(parent)
            ino = d.entries.get(name) if d is not None and d.entries is not None else None
            inode = None if ino is None else self.ns.inodes.get(ino)
            if inode is not None:
                found.append(inode)
        return found

    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh)
        self._wrote.discard(fh)
        self._unpin(h)
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
        self._maybe_forget_state(inode)
        self.maybe_drop(inode)

    def _abandon(self, inode: Inode) -> None:
        """The last writer closed a file that was never committed (its commit failed,
        or its writer was killed). Its bytes were never all stored: remove it rather
        than ever serve the gaps as data."""
        if self.ns.inodes.get(inode.ino) is not inode:
            return
        self._discard_dirty(inode.ino)
        log.warning("inode %d could not be committed; removing the incomplete file", inode.ino)
        self._unlink_everywhere(inode)

    def _discard_dirty(self, ino: int, first: int = 0) -> None:
        """Drop dirty units ``first``.. of a file, and the space they had claimed."""
        st = self._files.get(ino)
        if st is None:
            return
        for u in [u for u in st.dirty if u >= first]:
            del st.dirty[u]
            self._dirty_bytes -= self.unit
            self._claimed -= 1

    def _maybe_forget_state(self, inode: Inode) -> None:
        st = self._files.get(inode.ino)
        if st is not None and inode.opens == 0 and not (st.dirty or st.inflight or st.busy):
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
        self._free_units(inode, 0)
        self.unreadable.discard(inode.ino)
        self._discard_dirty(inode.ino)
        self._files.pop(inode.ino, None)
        self.evictor.forget(inode.ino)
        self.ns.drop(inode)

    def _free_units(self, inode: Inode, first: int) -> None:
        freed = 0
        units, csums = self.ns.edit_map(inode)
        for u in range(first, len(units)):
            p = units[u]
            if p != NO_UNIT:
                # a unit on a missing member is not in the allocator: unmapped, it is
                # released implicitly (free when the member returns, as no file maps it)
                if p >> DEV_SHIFT not in self._missing:
                    self.direct.free_later(inode.ino, p)
                freed += 1
            self.cache.discard((inode.ino, u))
        self.space.charge(inode, -freed)
        del units[first:]
        del csums[first:]

    def allocated_bytes(self, inode: Inode) -> int:
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

    # ------------------------------------------------------------------ write path
    def _begin_data_change(self, inode: Inode) -> None:
        if inode.ino in self.unreadable:  # its old bytes cannot be read to be changed
            raise self._unreadable_error(inode)
        if not inode.flags & FLAG_WRITING:
            inode.flags |= FLAG_WRITING
            self.ns.commit(inode)

    def _grow_map(self, inode: Inode, size: int) -> None:
        need = -(-size // self.unit) - inode.nunits
        if need > 0:
            units, csums = self.ns.edit_map(inode)
            units.extend([NO_UNIT] * need)
            csums.extend([0] * need)

    async def write(self, fh: int, off: int, data: bytes) -> int:
        """Accept ``data`` at ``off``: the space it needs is claimed first, so a full
        pool or quota fails this write (ENOSPC/EDQUOT) before any byte is taken, and
        never a later close."""
        h = self._handles[fh]
        inode = self.ns.get(h.ino)
        end = off + len(data)
        self._check_size(inode, end)
        st = self._state(inode.ino)
        self._check_failed(st)
        if not data:
            return 0
        st.active += 1
        try:
            if fh in self._wrote and not inode.flags & FLAG_WRITING:
                # committed while this handle goes on writing (an fsync, or the FLUSH
                # of another process's close): the committed prefix must not come back
                # from a crash as the whole file: uncommitted, durably, before it grows
                self._begin_data_change(inode)
                await self.journal.wait_durable(self.journal.last_seq)
            await self._write(h, inode, st, off, data)
        except (NoSpace, QuotaExceeded) as e:
            # the writer cannot store what it meant to: its file is incomplete (a
            # short chunk must never be served as a whole one), removed at its close
            self._fail(st, e)
            raise
        finally:
            st.active -= 1
        self._writes += 1
        self._bytes_written += len(data)
        self._wrote.add(fh)
        await self._maybe_writeback(self.ns.get(h.ino), st)
        return len(data)

    async def _write(self, h: Handle, inode: Inode, st: FileState, off: int, data: bytes) -> None:
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
            self._check_failed(st)
            self._begin_data_change(inode)
            if off > inode.size:
                await self._zero_tail(inode, st, inode.size, claims)
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
                    self._check_failed(st)
                    self._begin_data_change(inode)  # a commit may have run during the await
                buf[uo : uo + n] = view[pos - off : pos - off + n]
                pos += n
                if pos > inode.size:  # no await since the copy (see the docstring)
                    inode.size = pos
                    self._grow_map(inode, pos)
        finally:
            self._claimed -= claims[0]  # claimed but not needed (others got there first)
        inode.touch()

    def max_file_size(self, inode: Inode) -> int:
        """The size ``inode`` may reach: its top-level directory's setting, else the
        mount's, else a quarter of the pool; never over FILE_SIZE_LIMIT."""
        own = self.evictor.group_max_file_size(self.evictor.group_of(inode))
        limit = own or self.cfg.max_file_size or self.alloc.total_units * self.unit // 4
        return min(limit, FILE_SIZE_LIMIT)

    def _check_size(self, inode: Inode, size: int) -> None:
        """EFBIG for a size past the limit: before any byte is taken, so nothing is
        evicted for a file that could never fit (a 10 GiB write into a 4 GiB pool)."""
        if size > self.max_file_size(inode):
            raise FileTooLarge(
                f"inode {inode.ino}: {size} bytes exceed the maximum file size of "
                f"{self.max_file_size(inode)} bytes"
            )

    def owner_changed(self, inode: Inode, old_uid: int) -> None:
        """chown: the file's bytes now count for its new owner."""
        self.space.owner_changed(inode, old_uid)

    def _check_failed(self, st: FileState) -> None:
        if st.error is not None:
            raise st.error

    async def _claim(self, inode: Inode, units: int) -> None:
        """Promise ``units`` units of device space to a write (evicting for them if
        need be); NoSpace/QuotaExceeded when they cannot be had. A promise is held by
        the dirty unit it becomes, until that unit is allocated or discarded."""
        if units:
            await self._ensure_space(inode, units)
            self._claimed += units  # no await since the check: the room is still there

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
            buf = self._buffer_pool(self.unit).take(zeroed=not (load or whole))
            if load:
                src = await self.reader.unit_view(inode, u)
                existing = st.dirty.get(u)
                if existing is not None:  # another writer got there during the await
                    return existing
                buf[:] = src
            claims[0] -= 1  # the claim is now held by the dirty unit
            st.dirty[u] = buf
            self._dirty_bytes += self.unit
            return buf
        finally:
            if own:
                self._claimed -= claims[0]

    def _buffer_pool(self, size: int) -> BufferPool:
        """The pool of ``size``-byte I/O buffers (one unit, or a read run of units)."""
        pool = self._pools.get(size)
        if pool is None:
            keep = max(self.cfg.buffer_pool_bytes // size, 2)
            pool = self._pools[size] = BufferPool(size, keep)
        return pool

    async def _zero_tail(
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
        self._begin_data_change(inode)
        buf[uo:] = bytes(self.unit - uo)

    async def _maybe_writeback(self, inode: Inode, st: FileState) -> None:
        """Start writing back complete dirty units once a batch has gathered."""
        if len(st.dirty) > self.cfg.writeback_units:
            full = inode.size // self.unit
            ready = sorted(u for u in st.dirty if u < full)
            if len(ready) >= self.cfg.writeback_units:
                self._start_writeback(inode, st, ready)
        while self._dirty_bytes > self.cfg.max_dirty_bytes and (st.busy or st.dirty):
            self._check_failed(st)
            if st.dirty:
                self._start_writeback(inode, st, sorted(st.dirty))
            await st.idle.wait()

    def _start_writeback(self, inode: Inode, st: FileState, units: list[int]) -> None:
        """Allocate the units (their space was claimed when they were written, so
        this cannot fail for room) and write them in the background."""
        plan = self._allocate(inode, units)
        self._claimed -= len(units)  # the promise is kept: the units are allocated
        bufs = {u: st.dirty.pop(u) for u in units}
        st.inflight.update(bufs)
        st.busy += 1
        if st.busy == 1:
            # a fresh event only when the file goes busy: replacing the one that
            # waiters already hold (busy > 0) would leave them waiting forever, since
            # only the current event is set when busy returns to 0
            st.idle = trio.Event()
        assert self._nursery is not None
        self._nursery.start_soon(self._writeback, inode, st, plan, bufs)

    def _tail_fragments(self, inode: Inode, u: int, size: int | None = None) -> int:
        """Fragments that unit ``u`` takes if it is the file's partial last unit (0:
        it takes a whole unit). Decided at write-back, when the size is known; a file
        that grows later rewrites this unit as a new dirty unit anyway."""
        tail = (inode.size if size is None else size) - u * self.unit
        if not 0 < tail < self.unit:
            return 0
        n = -(-tail // self._fragment)
        return n if n < self.alloc.fragments_per_unit else 0

    def _allocate(
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
            self._fail(st, Incomplete(f"inode {inode.ino}: write-back failed: {e}"))
            for dev, start, lus in plan:
                self.alloc.free(dev, start, len(lus))
            for u, buf in bufs.items():
                if st.inflight.get(u) is buf:
                    del st.inflight[u]
        else:
            self._install(inode, st, plan, bufs, csums)
        finally:
            self._dirty_bytes -= self.unit * len(bufs)
            st.busy -= 1
            if not st.busy:
                st.idle.set()
            bufs.clear()  # our last references: the pool may now reuse what no reader sees
            self._buffer_pool(self.unit).reap()

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
                self._begin_data_change(inode)  # the map changes: uncommitted until commit
                old = inode.unit(u)
                if old != NO_UNIT:
                    self.direct.free_later(inode.ino, old)
                else:
                    self.space.charge(inode, 1)
                units, sums = self.ns.edit_map(inode)
                units[u], sums[u] = p, csums[u]
                self.cache.discard((inode.ino, u))

    async def commit(self, inode: Inode, pid: int = 0) -> None:
        """Make the file's data and metadata durable (flush, fsync, close)."""
        st = self._files.get(inode.ino)
        if st is not None:
            async with st.lock:
                while (st.dirty and st.error is None) or st.busy:
                    if st.dirty and st.error is None:
                        self._start_writeback(inode, st, sorted(st.dirty))
                    await st.idle.wait()
                self._check_failed(st)
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

    async def _truncate_at_open(self, inode: Inode, caller: Caller) -> None:
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
        self._check_size(inode, size)
        if inode.is_dir:
            raise IsADirectory(f"inode {inode.ino}")
        st = self._state(inode.ino)
        self._check_failed(st)
        if size == 0:  # a full rewrite needs none of the old bytes, missing ones included
            self.unreadable.discard(inode.ino)
        self._begin_data_change(inode)
        if size < inode.size:
            keep = -(-size // self.unit)
            self._discard_dirty(inode.ino, keep)
            for u in [u for u in st.inflight if u >= keep]:
                del st.inflight[u]
            self._free_units(inode, keep)
            inode.size = size
            await self._zero_tail(inode, st, size)
        elif size > inode.size:
            await self._zero_tail(inode, st, inode.size)
            inode.size = size
            self._grow_map(inode, size)
        inode.touch()
        self.ns.commit(inode)
        if not st.writers:
            await self.commit(inode)

    # ------------------------------------------------------------------ read path
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        """Every byte of ``off``..``off + size`` up to EOF, or an error: EIO for a
        file that is quarantined, whose bytes were not all stored, or that has data
        on a missing member (degraded mount)."""
        ino = self._handles[fh].ino
        inode = self.ns.inodes.get(ino)
        if inode is None or inode.flags & FLAG_QUARANTINED:
            raise Corruption(f"inode {ino} is quarantined or gone")
        if ino in self.unreadable:
            raise self._unreadable_error(inode)
        st = self._files.get(ino)
        if st is not None:
            self._check_failed(st)
        end = min(off + size, inode.size)
        if off >= end:
            return b""
        data = await self.reader.read(inode, off, end)
        self._reads += 1
        self._bytes_read += end - off
        return data

    def _unreadable_error(self, inode: Inode) -> DeviceError:
        """EIO for a file with data on a missing member (degraded mount)."""
        members = sorted({p >> DEV_SHIFT for p in inode.units if p != NO_UNIT} & self._missing)
        return DeviceError(
            f"inode {inode.ino}: data on missing member {', '.join(str(d + 1) for d in members)} "
            "(degraded mount)"
        )

    def _quarantine(self, inode: Inode, u: int, p: int) -> NoReturn:
        self._bad_units.add((inode.ino, u))
        if inode.flags & FLAG_QUARANTINED:  # a concurrent read found it first
            raise Corruption(f"inode {inode.ino}: checksum mismatch in unit {u}")
        self._quarantined += 1
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
        self._unlink_everywhere(inode)
        raise Corruption(f"inode {inode.ino}: checksum mismatch in unit {u}")

    def _unlink_everywhere(self, inode: Inode) -> None:
        """Remove ``inode`` for good (quarantine, eviction, an abandoned incomplete
        file): every name goes (the kernel is told, so its cached dentries go too),
        and the inode is GONE: the kernel's remaining references get ESTALE, so an
        open through one never sees an emptied file. Its units are freed once no
        handle is open (eviction only takes files without one)."""
        for parent, name in self.ns.names_of(inode):
            self.ns.remove(parent, name, want_dir=False)
            self.on_vanish(parent, name, inode.ino)
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
    def xattr_changed(self, ino: int, name: bytes) -> None:
        if name == QUOTA_XATTR:
            self.space.recount(ino)

    def _evictable(self, inode: Inode) -> bool:
        if inode.is_dir or inode.opens or inode.flags & FLAG_WRITING or not inode.nlink:
            return False
        st = self._files.get(inode.ino)
        return st is None or not (st.dirty or st.inflight or st.busy)

    async def _ensure_space(self, inode: Inode, units: int) -> None:
        """Room for ``units`` new units: metadata first, then data (may evict);
        NoSpace/QuotaExceeded only when nothing may be evicted."""
        await self.check_metadata_room()
        await self.space.ensure(inode, units)

    # ------------------------------------------------------------------ reporting
    def device_space(self) -> list[DeviceSpace]:
        """Data capacity and free space of each member: kvfs uses all of every
        member, whatever their sizes (stripes rotate; a full member is skipped)."""
        return [
            DeviceSpace(
                dev.path,
                sb.data_units * self.unit,
                self.alloc.device_free(i) * self.unit,
                i not in self.alloc.offline,
            )
            for i, (dev, sb) in enumerate(
                zip(self.pool.devices, self.pool.superblocks, strict=True)
            )
        ]

    def statistics(self) -> StoreStatistics:
        # claimed units are spoken for; free fragments in host units are free bytes
        free = max(self.space.available(), 0) * self.unit
        free += self.alloc.free_fragments * self._fragment
        cap = self.alloc.total_units * self.unit
        devs = [d.statistics() for d in self.pool.devices]
        return StoreStatistics(
            files=self.ns.file_count,
            directories=self.ns.dir_count,
            unit_size=self.unit,
            capacity_bytes=cap,
            used_bytes=cap - free,
            free_bytes=free,
            dirty_bytes=self._dirty_bytes,
            pending_free_bytes=self.space.pending_free() * self.unit,
            reads=self._reads,
            writes=self._writes,
            bytes_read=self._bytes_read,
            bytes_written=self._bytes_written,
            device_bytes_read=sum(d.bytes_read for d in devs),
            device_bytes_written=sum(d.bytes_written for d in devs),
            corruptions=len(self._bad_units),
            incomplete=self._incomplete,
            evictions=self.evictor.evictions,
            orphan_evictions=self.evictor.orphan_evictions,
            quarantined=self._quarantined,
            unreadable_files=len(self.unreadable),
            open_handles=len(self._handles),
        )


__all__ = [
    "DeviceSpace",
    "FileState",
    "Handle",
    "RecoveryReport",
    "Store",
    "StoreConfig",
    "StoreStatistics",
]
