"""The checkpoint image of the namespace (``Checkpoint``, a mixin of
:class:`kvfs.index.namespace.Namespace`): a :class:`kvfs.format.nsparts.Snapshot`
of the frozen columns and tables for :mod:`kvfs.format.nsimage` to encode, and the
records it decodes installed whole chunks at a time."""

from __future__ import annotations

import weakref
from array import array
from collections.abc import Iterator

from kvfs.common.errors import Corruption
from kvfs.format import nsparts
from kvfs.format.nsimage import decode_part, image_payloads
from kvfs.format.records import Blob, Dentry, Image, Op, Xattr
from kvfs.index.inodes import DirView
from kvfs.index.lifecycle import Lifecycle
from kvfs.index.state import F_DEAD, _Dir


class Checkpoint(Lifecycle):
    """Snapshot and load."""

    def snapshot_payloads(self) -> Iterator[bytes]:
        """Freeze the state now (O(chunks) + O(directories)) and yield checkpoint
        payloads of it; the namespace may change while they are consumed. An empty
        payload is a pause (a bounded step that produced nothing): skip it."""
        self._reclaim()  # rows dropped since: zeroed, so left out of the image
        return image_payloads(self._snapshot())

    def _snapshot(self) -> nsparts.Snapshot:
        """The state now as the image's plain record: the columns, the name index's
        tables and the arena frozen (copy-on-write, O(chunks)), every directory's
        listing marked shared (``_Dir.shared``: the next change copies it), the
        contiguous maps' checksum arrays by reference (a map is replaced, never
        changed in place); the other side tables are serialized by the caller now."""
        index, arena = self._index, self._arena
        old = index.old
        slots, old_slots = index.freeze()
        for state in self._dirs.values():
            state.shared = True
        return nsparts.Snapshot(
            next_ino=self.next_ino,
            live=self._live,
            rows=self._rows,
            table=(index.table.size, index.table.used),
            old_table=(old.size, old.used) if old else (0, 0),
            cursor=index.cursor,
            arena_tail=arena.tail,
            columns=[col.freeze() for col in self.persisted_columns],
            slots=slots,
            old_slots=old_slots,
            arena=arena.freeze(),
            owners=self._owners,
            xattr_names=self._xnames,
            name_forms=self._forms.in_use(),
            free=self._free,
            dead=[*self._deferred, *self._ghosts],
            links=[(d, state.links) for d, state in self._dirs.items() if state.links],
            maps=self._maps,
            big_xattrs=self._big_xattrs,
            arena_free=arena.free,
            blobs=self.blobs,
            listings=[(d, state.children) for d, state in self._dirs.items()],
            multi=list(self._multi.items()),
        )

    def _load_image_part(self, payload: bytes) -> None:
        """Install one image payload (:func:`kvfs.format.nsimage.decode_part`) into a
        namespace being recovered: whole chunks by reference, side tables as lists."""
        try:
            for part in decode_part(payload):
                self._install(part)
        except (ValueError, IndexError) as e:
            raise Corruption(f"namespace image part: {e}") from e

    def _install(self, part: nsparts.Part) -> None:
        if isinstance(part, nsparts.Chunks):
            if part.target == nsparts.COLUMN:
                col = self.persisted_columns[part.pid]
            else:
                col = self._index.part_table(part.pid).slots
            for c, chunk in part.chunks:
                col.install(c, chunk)
                if part.narrow:
                    col.narrow(c)
        elif isinstance(part, nsparts.ArenaChunks):
            for c, raw in part.chunks:
                self._arena.load_chunk(c, raw)
        elif isinstance(part, nsparts.Meta):
            self._install_meta(part)
        else:
            self._install_side(part)

    def _install_meta(self, meta: nsparts.Meta) -> None:
        self.next_ino, self._live = meta.next_ino, meta.live
        self._absolute_times = meta.version < 3
        self._ensure(meta.rows)
        if meta.version == 1:
            self._index.load_legacy(*meta.table, meta.tombs)
        else:
            self._index.load(*meta.table, *meta.old_table, meta.cursor)
        self._arena.tail = meta.arena_tail

    def _install_side(self, part: nsparts.Part) -> None:
        if isinstance(part, nsparts.Owners):
            for owner in part.owners:
                self._owner_ids[owner] = len(self._owners)
                self._owners.append(owner)
        elif isinstance(part, nsparts.XattrNames):
            for name in part.names:
                self._xname_ids[name] = len(self._xnames)
                self._xnames.append(name)
        elif isinstance(part, nsparts.NameFormsPart):
            for form in part.forms:
                self._forms.load(*form)
        elif isinstance(part, nsparts.FreeRows):
            self._free.extend(part.rows)
        elif isinstance(part, nsparts.DeadRows):
            self._deferred.extend(part.rows)
        elif isinstance(part, nsparts.Listings):
            for d, children in part.listings:
                state = self._dirs.setdefault(d, _Dir())
                if state.children:
                    state.children.extend(children)
                else:
                    state.children = children
        elif isinstance(part, nsparts.Links):
            for d, names in part.links:
                links = self._dirs.setdefault(d, _Dir()).links = {}
                for name, ino in names:
                    links[name] = ino
                    self._extra.setdefault(ino, []).append((d, name))
        elif isinstance(part, nsparts.UnitMaps):
            for ino, units, csums in part.maps:
                self._maps[ino] = (units, csums)
        elif isinstance(part, nsparts.MultiMaps):
            self._multi.update(part.maps)
        elif isinstance(part, nsparts.BigXattrs):
            self._big_xattrs.update(part.sets)
        elif isinstance(part, nsparts.ArenaFree):
            self._arena.free.update(part.lists)
        elif isinstance(part, nsparts.Blobs):
            self.blobs.update(part.blobs)

    def snapshot(self) -> Iterator[Op]:
        """Checkpoint contents as operations for today's ``encode_checkpoint``.
        TEMPORARY GLUE (replaced when the journal takes ``snapshot_payloads``)."""
        return (Image(p) for p in self.snapshot_payloads() if p)

    def legacy_ops(self) -> Iterator[Op]:
        """The state as the operations an older release checkpointed (upgrade tests
        and tools/mounttime.py's legacy pools)."""
        for inode in self.inodes.values():
            yield inode.record()
            for name, value in (inode.xattrs or {}).items():
                yield Xattr(inode.ino, name, value)
        for d in self._dirs:
            for name, child in DirView(self, d).items():
                yield Dentry(d, name, child)
        for blob_name, data in self.blobs.items():
            yield Blob(blob_name, data)

    def finish_load(self) -> None:
        """After the last checkpoint payload and transaction: rows dropped while
        something still named them are free now (nothing survives a remount)."""
        if self._absolute_times:
            self._rebase_times()
        for ino in [*self._deferred, *self._ghosts]:
            if self._flags[ino] & F_DEAD:
                self._free_row(ino)
            elif not self._mode[ino]:  # stripped when dropped: the image kept no row
                self._free.append(ino)
        self._deferred, self._ghosts = [], set()
        # replay may have re-created rows on the free list, or freed one twice
        self._free = array("I", sorted({i for i in self._free if not self._mode[i]}))
        self.inodes.views = weakref.WeakValueDictionary()
        self._zombies = weakref.WeakValueDictionary()
