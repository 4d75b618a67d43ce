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

:class:`Store` is the one facade the FUSE adapter and the tiers call. It builds the
parts and hands each exactly the parts and callbacks it needs: the namespace
operations (:mod:`~kvfs.store.names`), the operations on an open file
(:mod:`~kvfs.store.opened`), reads beside a truncate (:mod:`~kvfs.store.truncation`),
when a file goes (:mod:`~kvfs.store.lifetime`), the reader, writer, direct path,
eviction driver and reports; its own methods delegate to them.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict
from typing import Any, TypeVar

import trio

from kvfs.common import heap
from kvfs.common.errors import (
    DeviceError,
    KvfsError,
    NotFound,
    NotPermitted,
)
from kvfs.common.timing import Histogram
from kvfs.devices.alloc import Allocator
from kvfs.devices.pool import Pool
from kvfs.evict.driver import EvictionDriver
from kvfs.evict.evictor import FRESH_GRACE_SHARE, Evictor
from kvfs.evict.space import Space
from kvfs.format.records import (
    FLAG_WRITING,
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
from kvfs.store.hooks import Hooks, StoreHooks
from kvfs.store.leases import DirectPath
from kvfs.store.lifetime import Lifetime
from kvfs.store.loading import Loader, RecoveryReport
from kvfs.store.names import OP_LOG_BYTES, Names
from kvfs.store.opened import OpenFiles
from kvfs.store.posix import ROOT, Caller
from kvfs.store.reader import Reader
from kvfs.store.reporting import Reports
from kvfs.store.tickets import Ticket
from kvfs.store.truncation import Truncations
from kvfs.store.types import (
    DeviceSpace,
    DirectoryUsage,
    FileState,
    FileView,
    Handle,
    InodeView,
    StoreConfig,
    StoreStatistics,
    Traffic,
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
        self.on_appear: Callable[[int, bytes], None] = lambda parent, name: None
        """A name made behind the kernel (the ring's path writes): the FUSE adapter
        drops a "no such name" the kernel may have cached for it."""
        self.on_resized: Callable[[int], None] = lambda ino: None
        """A file committed behind the kernel (the ring's path writes): the FUSE
        adapter drops the attributes (size 0) the kernel may have cached for it."""
        self.evictor = Evictor(
            self.ns,
            self.cfg.eviction_policy,
            self.cfg.default_policy,
            grace=self.cfg.fresh_grace,
            grace_bytes=max(1, int(self.alloc.total_units * self.unit * FRESH_GRACE_SHARE)),
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
            remove=lambda inode: self.lifetime.unlink_everywhere(inode),
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
            evictable=lambda inode: self.lifetime.evictable(inode),
            evict=self._evict,
            pinned=lambda uid: self.lifetime.pinned(uid),
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
            check_readable=self.writer.check_readable,
            begin_change=self.writer.begin_change,
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
            self.eviction,
            self.hooks,
            self.writer,
            self.truncations,
            drop=self.maybe_drop,
        )
        """Namespace operations (:mod:`kvfs.store.names`)."""
        self.lifetime = Lifetime(
            self.ns,
            self.space,
            self.evictor,
            self.writer,
            self.handles,
            self._files,
            self.unreadable,
            self.unit,
            vanish=lambda parent, name, ino: self.on_vanish(parent, name, ino),
        )
        """When inodes and their state go (:mod:`kvfs.store.lifetime`)."""
        self.opened = OpenFiles(
            self.ns,
            self.journal,
            self.evictor,
            self.handles,
            self._files,
            self.reader,
            self.writer,
            self.direct,
            self.hooks,
            self.traffic,
            self.truncations,
            self.lifetime,
            commit=self.commit,
        )
        """Open, read, write, flush, release (:mod:`kvfs.store.opened`)."""
        self.heap = heap.HeapStatistics()  # freed heap given back while serving
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
            nursery.start_soon(heap.trim_loop, self.heap)
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
        """A handle on a live file; Stale (ESTALE) for one kvfs removed."""
        return await self.opened.open(ino, flags, caller)

    async def flush(self, fh: int) -> None:
        """A close of a handle (FUSE flush): commit what it wrote (:mod:`kvfs.store.opened`)."""
        await self.opened.flush(fh)

    async def check_metadata_room(self, log_bytes: int = OP_LOG_BYTES) -> None:
        """Room in the metadata area for an operation that grows the index, or NoSpace
        (:meth:`Names.check_metadata_room <kvfs.store.names.Names.check_metadata_room>`)."""
        await self.names.check_metadata_room(log_bytes)

    async def release(self, fh: int) -> None:
        await self.opened.release(fh)

    def sendable(self, inode: FileView) -> bool:
        """A closed file a tier may send: committed, named, no writer left."""
        return self.lifetime.sendable(inode)

    def file_state(self, ino: int) -> FileState | None:
        """The in-memory state of a file being written or read, if it has one."""
        return self._files.get(ino)

    def forget(self, ino: int, count: int) -> None:
        self.lifetime.forget(ino, count)

    def maybe_drop(self, inode: Inode) -> None:
        """Free an inode once nothing holds it (:mod:`kvfs.store.lifetime`)."""
        self.lifetime.maybe_drop(inode)

    def allocated_bytes(self, inode: InodeView) -> int:
        """Bytes of device space the file has (``st_blocks``)."""
        return self.writer.allocated_bytes(inode)

    # ------------------------------------------------------------------ write path
    async def write(self, fh: int, off: int, data: bytes) -> int:
        """Accept ``data`` at ``off``, or fail (ENOSPC/EDQUOT) before taking any byte."""
        return await self.opened.write(fh, off, data)

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
        """Every byte of ``off``..``off + size`` up to EOF, or an error (EIO)."""
        return await self.opened.read(fh, off, size)

    def check_kernel_read(self, fh: int, off: int, size: int, got: int) -> None:
        """EIO for a buffered READ a short answer would corrupt (:mod:`kvfs.store.truncation`)."""
        self.truncations.check_kernel_read(fh, off, size, got)

    # ------------------------------------------------------------------ direct path
    async def direct_get(self, ino: int, name: bytes, caller: Caller) -> bytes:
        """A direct-path request (``user.kvfs.direct.*`` read): a map or a reservation."""
        return await self.direct.getxattr(ino, name, caller)

    async def ring_open_reads(self, files: list[bytes], caller: Caller) -> list[Ticket | int]:
        """For the aware ring's path reads: each path opened for reading as ``caller``
        (the kernel's permission rules, :func:`paths.readable_file`) and mapped, its
        read ticket; or the errno it failed with. The ring releases each handle
        (:meth:`release`) once its read is done."""
        out: list[Ticket | int] = []
        for path in files:
            found = paths.readable_file(self.ns, path, caller)
            if isinstance(found, int):
                out.append(found)
                continue
            try:
                fh = await self.open(found.ino, os.O_RDONLY, caller)
            except KvfsError as e:
                out.append(e.errno)
                continue
            try:
                out.append(self.direct.read_ticket(found.ino, fh, caller))
            except KvfsError as e:
                await self.release(fh)
                out.append(e.errno)
        return out

    async def ring_open_writes(
        self, files: list[tuple[bytes, int, int]], caller: Caller
    ) -> list[Ticket | int]:
        """For the aware ring's path writes: each ``(path, size, mode)`` created as a
        new file as ``caller`` would create it (``open(O_CREAT | O_EXCL)``: the
        kernel's permission rules, :func:`paths.new_file_place`), opened for writing,
        and room reserved for its ``size`` bytes: its write ticket; or the errno it
        failed with (EEXIST for a name in use: the client replaces it through the
        mount). The ring commits each (:meth:`ring_commit_writes`); a file not
        committed is dropped at its handle's release, as a killed writer's."""
        return [await self._ring_new_file(path, size, mode, caller) for path, size, mode in files]

    async def _ring_new_file(
        self, path: bytes, size: int, mode: int, caller: Caller
    ) -> Ticket | int:
        found = paths.new_file_place(self.ns, path, caller)
        if isinstance(found, int):
            return found
        parent, name = found
        fh = -1
        try:
            inode = await self.create(parent.ino, name, stat.S_IFREG | (mode & 0o7777), caller)
            self.on_appear(parent.ino, name)
            fh = await self.open(inode.ino, os.O_WRONLY, caller)
            return await self.direct.write_ticket(inode.ino, fh, size, caller)
        except Exception as e:
            if not isinstance(e, KvfsError):
                log.exception("aware ring: path write of %r: %s", path, e)
            if fh >= 0:
                await self.release(fh)  # the empty file goes with it
            return e.errno if isinstance(e, KvfsError) else errno.EIO

    async def ring_commit_writes(self, done: list[tuple[int, bool]], caller: Caller) -> list[int]:
        """The ring's path writes ``(handle, written)``: each one written committed
        (durable, the commits sharing the journal's flushes), then every handle
        released (an uncommitted file is dropped); per write 0 or the errno."""
        out = [0] * len(done)

        async def commit(i: int, fh: int) -> None:
            ino = self.handles[fh].ino if fh in self.handles else 0
            try:
                await self.direct.commit_ticket(fh, caller)
            except KvfsError as e:
                out[i] = e.errno
            else:
                self.on_resized(ino)

        try:
            async with trio.open_nursery() as nursery:
                for i, (fh, written) in enumerate(done):
                    if written:
                        nursery.start_soon(commit, i, fh)
        finally:
            for i, (fh, written) in enumerate(done):
                if not written:
                    out[i] = errno.EIO
                if fh in self.handles:
                    await self.release(fh)
        return out

    async def release_all(self, fhs: list[int]) -> None:
        """Release several handles (the ring's path reads, once read; a handle the
        stopping mount closed already is skipped)."""
        for fh in fhs:
            if fh in self.handles:
                await self.release(fh)

    async def direct_set(self, ino: int, name: bytes, value: bytes, caller: Caller) -> None:
        """A direct-path commit (``user.kvfs.direct.commit`` set)."""
        if name != directpath.COMMIT:
            raise NotPermitted(f"{name!r} cannot be set")
        await self.direct.commit(ino, value, caller)

    # ------------------------------------------------------------------ eviction hooks
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
        self.lifetime.hold(ino)

    def let_go(self, ino: int) -> None:
        """End a :meth:`hold`; a file removed meanwhile goes now."""
        self.lifetime.let_go(ino)

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

    @staticmethod
    def writing(inode: InodeView) -> bool:
        """Whether ``inode`` is still being written (not yet committed)."""
        return bool(inode.flags & FLAG_WRITING)

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
        """chmod, chown, truncate and utimens of one SETATTR (:mod:`kvfs.store.names`)."""
        return await self.names.setattr(
            ino, caller, size=size, mode=mode, uid=uid, gid=gid, times=times, fh=fh
        )

    def _evict(self, inode: Inode) -> None:
        """Eviction takes ``inode`` (a tier may send it first: the cluster's on-evict)."""
        self.hooks.evicted(inode)
        self.lifetime.unlink_everywhere(inode)

    @property
    def xattr_names(self) -> tuple[bytes, ...]:
        """Every xattr name stored since the pool was made (interned, never removed)."""
        return self.ns.xattr_names

    def get_xattr(self, ino: int, name: bytes) -> bytes:
        return self.names.get_xattr(ino, name)

    def list_xattrs(self, ino: int) -> list[bytes]:
        return self.names.list_xattrs(ino)

    async def set_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        """Set an xattr within the bounds (E2BIG, ENOSPC: :mod:`kvfs.store.names`)."""
        await self.names.set_xattr(ino, name, value)

    def check_group_setting(self, ino: int, name: bytes, value: bytes) -> None:
        """InvalidArgument for a malformed or misplaced eviction-group setting."""
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
        return {**self.reports.all_statistics(), "heap": asdict(self.heap)}

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
