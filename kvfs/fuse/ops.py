"""The pyfuse3 adapter: translates FUSE requests to Store calls, errors to errno.

This is the only module that imports pyfuse3 handler types; it talks to the store
alone (its files are :class:`~kvfs.store.types.InodeView` to it), and
:mod:`kvfs.fuse.session` runs it in a mount. Only ``FUSEError`` leaves a handler:
domain errors are mapped by :func:`_errors`; anything else is a bug and is allowed to
stop the loop loudly, except in the eviction policy, whose faults the evictor
catches and survives (it holds only an order: ``Evictor.policy_failed``).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, ParamSpec, TypeVar

import pyfuse3

from kvfs.common.errors import KvfsError, NoAttribute, NotPermitted, NotSupported
from kvfs.fuse.counters import RequestCounters
from kvfs.store import leases as directpath
from kvfs.store import posix
from kvfs.store.control import CHECKPOINT_XATTR, STATS_XATTR
from kvfs.store.facade import Store
from kvfs.store.posix import Caller
from kvfs.store.types import InodeView

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

SECURITY = b"security."
ATTR_TIMEOUT = 300.0
"""Seconds the kernel may keep an entry or a negative entry without asking again.
Every change to names is a request through this mount, except kvfs's own removals
(eviction, quarantine), which invalidate the kernel's entry at once, so the timeout
only bounds how long the kernel's cache lives. It must outlast a listing: ``ls -l``
of 10^5 entries stats them after READDIRPLUS cached them, and with 5 s the tail of
the listing had expired (a LOOKUP round trip per entry)."""
DATA_ATTR_TIMEOUT = 5.0
"""Seconds the kernel may keep a file's attributes. Kept short on purpose: when the
kernel refetches them and sees a new size or mtime it drops its cached pages of the
file, and that is what retires a page it zero-filled past a shorter EOF while another
process was still writing the file with O_DIRECT (which bypasses the page cache).
With 300 s such a page outlived the write and a later buffered read was served its
zeros (tests/mount/test_model.py caught it)."""


def has_labels(names: Iterable[bytes]) -> bool:
    """Whether a ``security.*`` xattr was ever stored in the pool: the namespace's
    interned xattr names (O(distinct names), not a pass over every file at mount;
    a name stays interned after its last use, which only errs toward ENODATA)."""
    return any(n.startswith(SECURITY) for n in names)


def _errors(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    op = fn.__name__

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        counters: RequestCounters = args[0].requests  # type: ignore[attr-defined]
        start = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        except KvfsError as e:
            if e.errno == errno.EIO:
                log.log(logging.DEBUG if e.expected else logging.ERROR, "%s: %s", op, e)
            counters.error(op, e.errno)
            raise pyfuse3.FUSEError(e.errno) from None
        except pyfuse3.FUSEError as e:
            counters.error(op, e.errno)
            raise
        finally:
            counters.observe(op, time.perf_counter() - start)

    return wrapper


def _file_info(fh: int, flags: int) -> pyfuse3.FileInfo:
    """The open's answer: the kernel keeps the file's cached pages across opens. An
    O_DIRECT open that may read is answered ``direct_io`` (FOPEN_DIRECT_IO): its
    reads then never touch the page cache. Without it, the kernel reads the rest of
    a short direct read through the page cache, on this handle, up to the size *it*
    holds; while it holds a size a truncate has not yet shrunk there, the short
    answers made it zero-fill those pages and return the old length with zeros past
    the cut (``docs/design.md``, "Reads beside a truncate", rule 6)."""
    direct_reader = bool(flags & os.O_DIRECT) and flags & os.O_ACCMODE != os.O_WRONLY
    return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=direct_reader)


def _caller(ctx: Any) -> Caller:
    return Caller(ctx.uid, ctx.gid, ctx.pid)


class Operations(pyfuse3.Operations):  # type: ignore[misc]
    """FUSE request handlers over one :class:`Store`."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, store: Store, timeout: float = ATTR_TIMEOUT) -> None:
        super().__init__()
        self.store = store
        self.timeout = timeout
        self.requests = RequestCounters()
        self.labels = has_labels(store.xattr_names)
        """False while no file of the pool has a ``security.*`` xattr: a get of a
        missing one is then EOPNOTSUPP, not ENODATA (see :meth:`getxattr`)."""
        self._dirs: dict[int, tuple[int, list[tuple[bytes, int]]]] = {}
        self._next_dh = 1
        store.on_vanish = self._invalidate
        store.on_appear = self._appeared
        store.on_resized = self._invalidate_attr

    def _invalidate(self, parent: int, name: bytes, ino: int) -> None:
        try:
            pyfuse3.invalidate_entry_async(parent, name, deleted=ino, ignore_enoent=True)
        except Exception as e:  # no session (tests calling handlers directly)
            log.debug("invalidate %d/%r: %s", parent, name, e)

    def _appeared(self, parent: int, name: bytes) -> None:
        """A name made behind the kernel: a negative entry it cached for it goes (and
        the directory's cached attributes with it)."""
        try:
            pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)
        except Exception as e:  # no session (tests calling handlers directly)
            log.debug("invalidate %d/%r: %s", parent, name, e)

    def _attr(self, inode: InodeView) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode.ino
        a.generation = 0
        a.entry_timeout = self.timeout
        # a file still being written may get its size behind the kernel (a ring path
        # write's commit): the kernel keeps none of its attributes, so no reply made
        # before that commit can leave it reading the file as empty afterwards
        a.attr_timeout = 0 if self.store.writing(inode) else min(self.timeout, DATA_ATTR_TIMEOUT)
        a.st_mode = inode.mode
        a.st_nlink = inode.nlink
        a.st_uid, a.st_gid = inode.uid, inode.gid
        a.st_rdev = 0
        a.st_size = inode.size
        a.st_blksize = self.store.unit
        a.st_blocks = -(-self.store.allocated_bytes(inode) // 512)
        a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns = inode.times()
        return a

    def _entry(self, inode: InodeView) -> pyfuse3.EntryAttributes:
        inode.lookups += 1
        return self._attr(inode)

    @_errors
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        inode = self.store.lookup(parent_inode, name)
        self.requests.lookups["miss" if inode is None else "hit"] += 1
        if inode is None:
            inode = await self.store.missed(parent_inode, name)  # a remote hit made local
        if inode is None:
            miss = pyfuse3.EntryAttributes()
            miss.st_ino = 0  # a cached negative entry: lookup storms of misses stay cheap
            # (briefly with a cluster tier: another node may publish the name)
            miss.entry_timeout = self.store.negative_timeout(self.timeout)
            return miss
        if name in (b".", b".."):
            return self._attr(inode)
        return self._entry(inode)

    @_errors
    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, count in inode_list:
            self.store.forget(ino, count)

    @_errors
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None) -> Any:
        return self._attr(self.store.get_inode(inode))

    @_errors
    async def setattr(
        self, inode: int, attr: Any, fields: Any, fh: int | None, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        node = await self.store.setattr(
            inode,
            _caller(ctx),
            size=attr.st_size if fields.update_size else None,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            times=(
                attr.st_atime_ns if fields.update_atime else None,
                attr.st_mtime_ns if fields.update_mtime else None,
                attr.st_ctime_ns if fields.update_ctime else None,
            ),
            fh=fh,
        )
        return self._attr(node)

    @_errors
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        inode = await self.store.make(parent_inode, name, mode, _caller(ctx))
        return self._entry(inode)

    @_errors
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        inode = await self.store.make(
            parent_inode, name, stat.S_IFDIR | stat.S_IMODE(mode), _caller(ctx)
        )
        return self._entry(inode)

    @_errors
    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        raise NotPermitted("kvfs has no symbolic links")

    @_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self.store.unlink(parent_inode, name)

    @_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self.store.rmdir(parent_inode, name)

    @_errors
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: Any,
    ) -> None:
        self.store.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @_errors
    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        return self._entry(await self.store.link(inode, new_parent_inode, new_name))

    @_errors
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        fh = await self.store.open(inode, flags, _caller(ctx))
        return _file_info(fh, flags)

    @_errors
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        caller = _caller(ctx)
        inode = await self.store.create(
            parent_inode, name, stat.S_IFREG | stat.S_IMODE(mode), caller
        )
        fh = await self.store.open(inode.ino, flags & ~os.O_TRUNC, caller)
        return _file_info(fh, flags), self._entry(inode)

    @_errors
    async def read(self, fh: int, off: int, size: int) -> Any:
        data = await self.store.read(fh, off, size)
        self.store.check_kernel_read(fh, off, size, len(data))  # never a short reply it zero-fills
        return data

    @_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self.store.write(fh, off, buf)

    @_errors
    async def flush(self, fh: int) -> None:
        inode = self.store.find_inode(self.store.handle(fh).ino)
        before = self.store.allocated_bytes(inode) if inode is not None else 0
        await self.store.flush(fh)
        if inode is not None and self.store.allocated_bytes(inode) != before:
            # the commit turned claimed whole units into what is held (a tail's
            # fragments): the st_blocks the kernel cached while writing is stale
            self._invalidate_attr(inode.ino)

    def _invalidate_attr(self, ino: int) -> None:
        try:  # attributes only: no page-cache work, so it cannot block (no writeback cache)
            pyfuse3.invalidate_inode(ino, attr_only=True)
        except Exception as e:  # no session (tests calling handlers directly)
            log.debug("invalidate attributes of %d: %s", ino, e)

    @_errors
    async def release(self, fh: int) -> None:
        await self.store.release(fh)

    @_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        h = self.store.handle(fh)
        inode = self.store.find_inode(h.ino)
        if inode is None:
            await self.store.wait_durable()
        else:
            await self.store.commit(inode, h.pid)  # waits for the journal too

    @_errors
    async def opendir(self, inode: int, ctx: Any) -> int:
        self.store.directory(inode)
        dh = self._next_dh
        self._next_dh += 1
        self._dirs[dh] = (inode, [])
        return dh

    @_errors
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        """Offsets index a listing taken at offset 0 (the first call, and every
        rewinddir), so they stay stable while the directory changes; each entry is
        re-checked against the live directory before it is replied, because a reply
        carries attributes (readdirplus) that make the kernel cache the name: a name
        renamed or removed since the listing was taken must never be planted again
        (it once made open(tmp, O_TRUNC) truncate the file renamed away from tmp)."""
        ino, listing = self._dirs[fh]
        directory = self.store.get_inode(ino)
        entries = self.store.directory(ino)
        if start_id == 0:
            listing[:] = [(b".", ino), (b"..", directory.parent), *entries.items()]
        for i in range(start_id, len(listing)):
            name, child = listing[i]
            dot = i < 2
            if not dot and entries.get(name) != child:
                continue  # renamed or removed since the listing was taken
            inode = self.store.find_inode(child)
            if inode is None:
                continue
            if not pyfuse3.readdir_reply(token, name, self._attr(inode), i + 1):
                return
            if not dot:
                inode.lookups += 1  # readdirplus: the kernel now holds a reference

    @_errors
    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    @_errors
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        await self.store.wait_durable()

    @_errors
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        st = self.store.statistics()
        s.f_bsize = s.f_frsize = 4096  # LMCache divides by it and needs chunk % f_bsize == 0
        s.f_blocks = st.capacity_bytes // 4096
        s.f_bfree = s.f_bavail = st.free_bytes // 4096
        s.f_files = max(self.store.inode_count * 2, 1 << 24)
        s.f_ffree = s.f_favail = s.f_files - self.store.inode_count
        s.f_namemax = 255
        return s

    @_errors
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        posix.check_xattr_name(name)
        if name == STATS_XATTR:
            raise pyfuse3.FUSEError(errno.EPERM)
        if name == CHECKPOINT_XATTR:
            if inode != pyfuse3.ROOT_INODE or _caller(ctx).uid not in (0, os.getuid()):
                raise pyfuse3.FUSEError(errno.EPERM)
            self.store.request_checkpoint()
            return
        if name.startswith(directpath.PREFIX):
            await self.store.direct_set(inode, name, value, _caller(ctx))
            self._invalidate_attr(inode)  # its size and times changed behind the kernel
            return
        self.store.check_group_setting(inode, name, value)
        await self.store.set_xattr(inode, name, value)
        self.labels = self.labels or name.startswith(SECURITY)

    @_errors
    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        """A missing ``security.*`` name is EOPNOTSUPP while the pool holds no
        security labels at all (a pool where one was ever set answers ENODATA, as
        ext4): ``ls -l`` asks for ``security.selinux`` of every entry unless the
        device says it has no labels (coreutils' ``getfilecon_cache`` then stops
        asking for the device), and FUSE has no xattr cache, so each ask is a round
        trip. Setting, listing and reading stored ones are unchanged."""
        posix.check_xattr_name(name)
        if name == STATS_XATTR and inode == pyfuse3.ROOT_INODE:
            return self.stats_json().encode()
        if name.startswith(directpath.PREFIX):
            return await self.store.direct_get(inode, name, _caller(ctx))
        try:
            return self.store.get_xattr(inode, name)
        except NoAttribute:
            if not self.labels and name.startswith(SECURITY):
                raise NotSupported("no security labels on this pool") from None
            raise

    @_errors
    async def listxattr(self, inode: int, ctx: Any) -> Sequence[bytes]:
        return posix.listed_xattrs(self.store.list_xattrs(inode), _caller(ctx))

    @_errors
    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        posix.check_xattr_name(name)
        self.store.remove_xattr(inode, name)

    @_errors
    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        self.store.get_inode(inode)
        return True

    def stats_json(self) -> str:
        stats = self.store.all_statistics()
        stats["lookups"] = dict(self.requests.lookups)
        return json.dumps(stats)
