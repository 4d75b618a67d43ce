"""The store's namespace operations: make, create, rename, unlink, rmdir, link,
setattr and xattrs, each with what it owes the other parts: room in the metadata
area before the index grows, the directories' usage counters (a file's bytes follow
its names), the eviction policy's view of new files, and the subscribed tiers'
events (:mod:`kvfs.store.hooks`).

Runs on the trio thread. An operation that grows the index awaits only for room
(:meth:`Names.check_metadata_room`), before it changes anything; the rest of it runs
without an ``await``, so no other request sees it half done."""

from __future__ import annotations

import stat
import time
from collections.abc import Callable

from kvfs.common.errors import NoSpace
from kvfs.evict.driver import EvictionDriver
from kvfs.evict.evictor import Evictor
from kvfs.evict.groups import GROUP_XATTRS, check_group_target, check_group_xattr
from kvfs.evict.space import Space
from kvfs.format.records import FLAG_WRITING
from kvfs.index.namespace import Inode, Namespace, check_times, check_xattr_room
from kvfs.log.journal import Journal
from kvfs.store import paths, posix
from kvfs.store.hooks import Hooks
from kvfs.store.posix import ROOT, Caller
from kvfs.store.truncation import Truncations
from kvfs.store.writer import Writer

OP_LOG_BYTES = 512
"""Log bytes admitted for one index operation beyond its xattr (a create: its
inode record, dentry and name; a commit: a map of a few extents). A larger one is
not lost: the window is retried (``Journal.admit``)."""


class Names:
    """Namespace operations of one store. ``drop(inode)``: free an inode that may
    have lost its last reference (``Store.maybe_drop``)."""

    def __init__(
        self,
        ns: Namespace,
        journal: Journal,
        space: Space,
        evictor: Evictor,
        eviction: EvictionDriver,
        hooks: Hooks,
        writer: Writer,
        truncations: Truncations,
        *,
        drop: Callable[[Inode], None],
    ) -> None:
        self.ns = ns
        self.journal = journal
        self.space = space
        self.evictor = evictor
        self.eviction = eviction
        self.hooks = hooks
        self.writer = writer
        self.truncations = truncations
        self._drop = drop

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

    async def make(
        self, parent: int, name: bytes, mode: int, caller: Caller = ROOT, flags: int = 0
    ) -> Inode:
        """mkdir / mknod: a new committed directory or empty file, owned by ``caller``
        (or, in a setgid directory, by the directory's group: ``posix.new_owner``)."""
        await self.check_metadata_room()
        d = self.ns.get(parent)
        mode, gid = posix.new_owner(d.mode, d.gid, mode, caller)
        inode = self.ns.make(parent, name, mode, caller.uid, gid, flags=flags)
        self.space.placed(inode, None)  # a top-level directory is listed from now on
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
        """POSIX rename (and renameat2's flags); what moves takes its bytes' count
        along (a directory: its subtree's, O(depth), nothing below it walked), and a
        replaced target's bytes leave the counters with its last name."""
        self.journal.check_usable()
        placed = [
            (i, self.space.placement(i)) for i in self._movers(old_parent, old, new_parent, new)
        ]
        hooks = self.hooks
        src = self.ns.find(old_parent, old) if hooks else None
        old_dir = paths.path_of(self.ns, old_parent) if hooks else None
        victim = self.ns.rename(old_parent, old, new_parent, new, flags)
        if victim is not None:
            self._drop(victim)
        for inode, before in placed:
            self.space.placed(inode, before)
        if hooks and src is not None:
            hooks.renamed(src, old_parent, old, old_dir)

    def _movers(self, old_parent: int, old: bytes, new_parent: int, new: bytes) -> list[Inode]:
        """The inodes a rename may move or unname: the source, and the target (moved
        by an exchange, else replaced)."""
        found: dict[int, Inode] = {}  # one entry for two names of one file
        for parent, name in ((old_parent, old), (new_parent, new)):
            d = self.ns.inodes.get(parent)
            ino = d.entries.get(name) if d is not None and d.entries is not None else None
            inode = None if ino is None else self.ns.inodes.get(ino)
            if inode is not None:
                found[inode.ino] = inode
        return list(found.values())

    def unlink(self, parent: int, name: bytes) -> None:
        self.journal.check_usable()
        hooks = self.hooks
        where = paths.path_of(self.ns, parent) if hooks else None
        self._unname(parent, name, want_dir=False)
        if hooks:
            hooks.unlinked(where, name, parent)

    def rmdir(self, parent: int, name: bytes) -> None:
        self.journal.check_usable()
        self._unname(parent, name, want_dir=True)

    def _unname(self, parent: int, name: bytes, want_dir: bool) -> None:
        """unlink / rmdir; the bytes of a file that loses its last (or its indexed)
        name leave (or move between) the directories' counters."""
        found = self.ns.find(parent, name)
        before = self.space.placement(found) if found is not None else None
        inode = self.ns.remove(parent, name, want_dir=want_dir)
        self._drop(inode)
        self.space.placed(inode, before)

    async def link(self, ino: int, parent: int, name: bytes) -> Inode:
        await self.check_metadata_room()
        before = self.space.placement(self.ns.get(ino))
        inode = self.ns.link(ino, parent, name)
        self.space.placed(inode, before)
        return inode

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
        """chmod, chown, truncate and utimens of one SETATTR (what is not None). The
        times (atime, mtime, ctime; a ctime not given is now) are checked before
        anything changes. ``fh``: the handle an ftruncate came through (it goes on
        reading the file it shrank itself)."""
        self.journal.check_usable()
        node = self.ns.get(ino)
        atime, mtime, _ = node.times()
        at, mt, ct = times
        new_times = (
            atime if at is None else at,
            mtime if mt is None else mt,
            time.time_ns() if ct is None else ct,
        )
        check_times(*new_times)  # refused before anything changes
        if size is not None:
            async with self.truncations.shrinking(ino, size < node.size):
                await self.writer.truncate(node, size)
                self.truncations.keep_readable(ino, caller.pid, fh)
        if mode is not None:
            node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(mode)
        if uid is not None and node.uid != uid:
            old_uid, node.uid = node.uid, uid
            self.space.owner_changed(node, old_uid)  # its bytes count for the new owner
        if gid is not None:
            node.gid = gid
        if size is not None:
            # the kernel's FUSE code asks for the older rule (S_ISGID only if group-
            # executable); ext4's also drops it for a caller outside the file's group
            node.mode = posix.drop_suid_sgid(node.mode, node.gid, caller)
        node.set_times(*new_times)
        self.ns.commit(node)
        return node

    def get_xattr(self, ino: int, name: bytes) -> bytes:
        return self.ns.get_xattr(ino, name)

    def list_xattrs(self, ino: int) -> list[bytes]:
        return list(self.ns.get(ino).xattrs or ())

    async def set_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        """Set an xattr within the bounds (``namespace.check_xattr_room``: E2BIG,
        ENOSPC), checked before any room is made for it."""
        inode = self.ns.get(ino)
        check_xattr_room(inode.xattrs or {}, name, value)
        await self.check_metadata_room(OP_LOG_BYTES + len(name) + len(value))
        self.ns.set_xattr(ino, name, value)

    def check_group_setting(self, ino: int, name: bytes, value: bytes) -> None:
        """Before a caller's :meth:`set_xattr`: InvalidArgument if ``name`` is a setting
        of an eviction group (``user.kvfs.policy``, ``.quota``, ``.max_file_size``)
        with a malformed value, or set where it takes no effect (groups are top-level
        directories; the root takes its policy alone). Any other name passes."""
        if name in GROUP_XATTRS:
            check_group_xattr(name, value)
            check_group_target(self.ns.get(ino), name)

    def remove_xattr(self, ino: int, name: bytes) -> None:
        self.journal.check_usable()
        self.ns.set_xattr(ino, name, None)
