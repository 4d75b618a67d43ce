"""Replaying logged operations (``Replay``, a mixin of
:class:`kvfs.index.namespace.Namespace`): recovery feeds every checkpoint payload and
every transaction since to :meth:`Replay.load_payload` and :meth:`Replay.apply`."""

from __future__ import annotations

import stat

from kvfs.format.nsimage import TAG
from kvfs.format.records import (
    Blob,
    Dentry,
    Drop,
    Image,
    InodeRecord,
    Op,
    Undentry,
    Xattr,
    decode_ops,
)
from kvfs.index.checkpoint import Checkpoint
from kvfs.index.state import F_DEAD, F_INTERNAL, _Dir

EVICTOR_TAG = 0xE7
"""First byte of the evictor's checkpoint payloads (``kvfs.evict.evictor``); a load keeps
them in ``Namespace.evictor_payloads`` for the evictor (not an op tag, not TAG)."""


class Replay(Checkpoint):
    """Operations applied to the state, tolerant of a fuzzy checkpoint."""

    def apply(self, op: Op) -> bool:
        """Replay one journal operation (recovery); False when it was skipped because
        it names an inode that is not there. Tolerant by design: a checkpoint is
        fuzzy (each piece taken at another moment) and every transaction since it
        began is replayed over it, so an operation may meet the state after a later
        one (a name in a directory that is already dropped: that Drop follows in
        the replay). Operations set absolute state, so replaying them over any such
        snapshot ends in the live state (``docs/design.md``, "Checkpoints")."""
        if self._absolute_times and not isinstance(op, Image):
            self._rebase_times()
        if isinstance(op, InodeRecord):
            self._apply_record(op)
        elif isinstance(op, Dentry):
            if op.parent not in self._dirs or op.ino not in self.inodes:
                return False  # a name in a gone directory, or of a gone inode
            if self._find(op.parent, op.name):
                self._del_name(op.parent, op.name)
            self._add_name(op.parent, op.name, op.ino)
        elif isinstance(op, Undentry):
            if op.parent not in self._dirs:
                return False
            if self._find(op.parent, op.name):
                self._del_name(op.parent, op.name)
        elif isinstance(op, Drop):
            if op.ino in self.inodes:
                self._kill(op.ino)
        elif isinstance(op, Xattr):
            if op.ino not in self.inodes:
                return False
            self._apply_xattr(op)
        elif isinstance(op, Blob):
            self.blobs[op.name] = op.data
        elif op.payload[:1] == bytes((EVICTOR_TAG,)):  # the evictor's, set aside
            self.evictor_payloads.append(op.payload)
        else:  # an image part wrapped as an op (offline tools: encode_checkpoint)
            self._load_image_part(op.payload)
        return True

    def _apply_record(self, rec: InodeRecord) -> None:
        ino = rec.ino
        if ino not in self.inodes:
            if 0 < ino < self.next_ino and self._flags[ino] & F_DEAD:
                self._ghosts.discard(ino)
                self._free_row(ino)
            self._new_row(rec)
            return
        was_dir = ino in self._dirs
        self._mode[ino] = rec.mode
        self._set_owner(ino, rec.uid, rec.gid)
        self._nlink[ino] = rec.nlink
        self._flags[ino] = (self._flags[ino] & F_INTERNAL) | (rec.flags & ~F_INTERNAL)
        self._size[ino] = rec.size
        self._set_times(ino, rec.atime_ns, rec.mtime_ns, rec.ctime_ns)
        self._set_map(ino, rec.units, rec.csums)
        if stat.S_ISDIR(rec.mode) and not was_dir:
            self._dirs[ino] = _Dir()

    def _apply_xattr(self, op: Xattr) -> None:
        if op.ino not in self.inodes:
            raise KeyError(op.ino)
        xattrs = self._xattrs(op.ino) or {}
        if op.value is None:
            if op.name not in xattrs:
                return
            del xattrs[op.name]
        else:
            xattrs[op.name] = op.value
        self._store_xattrs(op.ino, xattrs)

    def reset(self) -> None:
        """Forget everything (recovery fed a half that turned out incomplete and
        starts over with the older one); callers keep this same object."""
        self.__init__(self._log)  # type: ignore[misc]

    def load_payload(self, payload: bytes) -> None:
        """One checkpoint payload: a columnar image part (kvfs.format.nsimage) or, from a
        pool written by an older release, ``encode_ops`` output."""
        if payload[:1] == bytes((TAG,)):
            self._load_image_part(payload)
            return
        if payload[:1] == bytes((EVICTOR_TAG,)):
            self.evictor_payloads.append(payload)
            return
        for op in decode_ops(payload):
            self.apply(op)
