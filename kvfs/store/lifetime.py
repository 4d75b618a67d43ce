"""When a file goes: what holds an inode (names, open handles, the kernel's lookups, a
tier's hold), when it and its in-memory state are dropped, and how kvfs removes a
file itself (quarantine, eviction, an abandoned incomplete file). Also what eviction
asks of that: whether a file may be evicted, and how much a user holds open.

Runs on the trio thread, without an ``await``: a drop frees the inode's units, its
dirty state and its index row in one stretch."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvfs.evict.evictor import Evictor
from kvfs.evict.space import Space
from kvfs.format.records import FLAG_GONE, FLAG_QUARANTINED, FLAG_WRITING
from kvfs.index.namespace import Inode, Namespace
from kvfs.store.handles import Handles
from kvfs.store.types import FileState, FileView
from kvfs.store.writer import Writer

log = logging.getLogger(__name__)


class Lifetime:
    """The lifetime of one store's inodes, over its per-file states (``files``, shared
    with the reader and writer) and its ``unreadable`` set (shared with the writer).
    ``vanish(parent, name, ino)``: tell the kernel a name kvfs removed is gone
    (``Store.on_vanish``, read at each call: the FUSE adapter sets it later)."""

    def __init__(
        self,
        ns: Namespace,
        space: Space,
        evictor: Evictor,
        writer: Writer,
        handles: Handles,
        files: dict[int, FileState],
        unreadable: set[int],
        unit: int,
        *,
        vanish: Callable[[int, bytes, int], None],
    ) -> None:
        self.ns = ns
        self.space = space
        self.evictor = evictor
        self.writer = writer
        self.handles = handles
        self._files = files
        self.unreadable = unreadable
        self.unit = unit
        self._vanish = vanish

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

    def forget(self, ino: int, count: int) -> None:
        """The kernel dropped ``count`` references to ``ino`` (FUSE forget)."""
        inode = self.ns.inodes.get(ino)
        if inode is None:
            self.ns.kernel_forget(ino, count)  # a dropped inode's number is reusable now
            return
        inode.lookups = max(0, inode.lookups - count)
        self.maybe_drop(inode)

    def hold(self, ino: int) -> None:
        """Keep a live file from eviction and its units from reuse, as an open handle
        does, until :meth:`let_go`."""
        self.ns.inodes[ino].opens += 1

    def let_go(self, ino: int) -> None:
        """End a :meth:`hold`; a file removed meanwhile goes now."""
        inode = self.ns.inodes.get(ino)
        if inode is not None:
            inode.opens -= 1
            self.maybe_drop(inode)

    def unlink_everywhere(self, inode: Inode) -> None:
        """Remove ``inode`` for good (quarantine, eviction, an abandoned incomplete
        file): every name goes (the kernel is told, so its cached dentries go too),
        and the inode is GONE: the kernel's remaining references get ESTALE, so an
        open through one never sees an emptied file. Its units are freed once no
        handle is open (eviction only takes files without one)."""
        before = self.space.placement(inode)
        for parent, name in self.ns.names_of(inode):
            self.ns.remove(parent, name, want_dir=False)
            self._vanish(parent, name, inode.ino)
        self.space.placed(inode, before)
        self.evictor.forget(inode.ino)
        inode.flags |= FLAG_GONE
        self.maybe_drop(inode)

    def abandon(self, inode: Inode) -> None:
        """The last writer closed a file that was never committed (its commit failed,
        or its writer was killed). Its bytes were never all stored: remove it rather
        than ever serve the gaps as data."""
        if self.ns.inodes.get(inode.ino) is not inode:
            return
        self.writer.discard_dirty(inode.ino)
        log.warning("inode %d could not be committed; removing the incomplete file", inode.ino)
        self.unlink_everywhere(inode)

    def forget_state(self, inode: Inode) -> None:
        """Drop the file's in-memory state once nothing needs it (no handle, nothing
        dirty or in flight, no shrinking truncate unanswered)."""
        st = self._files.get(inode.ino)
        if st is not None and inode.opens == 0 and not (st.dirty or st.inflight or st.busy):
            if st.resizing:
                return
            del self._files[inode.ino]

    def sendable(self, inode: FileView) -> bool:
        """A closed file a tier may send: committed, named, no writer left."""
        if inode.flags & (FLAG_WRITING | FLAG_GONE | FLAG_QUARANTINED) or not inode.nlink:
            return False
        st = self._files.get(inode.ino)
        return st is None or (not st.writers and st.error is None)

    def evictable(self, inode: Inode) -> bool:
        """Whether eviction may take the file: closed, committed, named, nothing in
        memory."""
        if inode.is_dir or inode.opens or inode.flags & FLAG_WRITING or not inode.nlink:
            return False
        st = self._files.get(inode.ino)
        return st is None or not (st.dirty or st.inflight or st.busy)

    def pinned(self, uid: int) -> int:
        """Bytes of the files user ``uid`` holds open (they cannot be evicted), the
        ones still in memory (dirty, being written back) included."""
        mapped, files, units = self.ns.mapped_units_of, self._files, 0
        for ino in self.handles.pinned(uid):  # every create: no view per file
            units += mapped(ino)
            st = files.get(ino)
            if st is not None:
                units += len(st.dirty) + len(st.inflight)
        return units * self.unit
