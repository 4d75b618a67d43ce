"""The namespace's state: every column, table and side table of the index, and
the row-level primitives the rest of the index builds on (times, owners, a row's
name bytes in the arena). Pure and synchronous.

Storage is columnar (``docs/design.md``, "The index in columns"): one row per inode
number in copy-on-write chunked ``array`` columns (:mod:`kvfs.index.columns`, in the
shapes of :mod:`kvfs.format.nsparts`), names and xattrs in a byte arena, a
(parent, name) -> inode hash index; no Python object per file. The behaviour lives
in the mixins above this class (:mod:`kvfs.index.names`, :mod:`kvfs.index.xattrs`,
:mod:`kvfs.index.unitmaps`, :mod:`kvfs.index.rows`, :mod:`kvfs.index.lifecycle`,
:mod:`kvfs.index.checkpoint`, :mod:`kvfs.index.replay`, :mod:`kvfs.index.scans`),
composed by :class:`kvfs.index.namespace.Namespace`.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from operator import sub

from kvfs.common.errors import InvalidArgument, NoSpace
from kvfs.format.nsparts import COLUMNS, FORM_HEAD, ROOT_INO
from kvfs.format.records import Op
from kvfs.index.columns import MASK, ROWS, SHIFT, Arena, Column, NameIndex
from kvfs.index.nameforms import NameForms

F_DEAD = 0x80
"""Internal: the row was dropped (kept until no view or kernel reference names it)."""
F_NAMED = 0x40
"""Internal: the row's (parent, name) is in the name index."""
F_INTERNAL = F_DEAD | F_NAMED


class _Dir:
    """Per-directory state (directories are few): the inodes whose indexed name is
    in it (for listing), and extra hard-link names. ``shared``: a checkpoint froze
    ``children`` (it serializes that array later); the next change copies it first."""

    __slots__ = ("children", "links", "shared")

    def __init__(self) -> None:
        self.children = array("I")
        self.links: dict[bytes, int] | None = None
        self.shared = False

    def own_children(self) -> array[int]:
        """``children``, to be changed: a private copy if a checkpoint holds it."""
        if self.shared:
            self.children = array("I", self.children)
            self.shared = False
        return self.children


_Q_MIN, _Q_MAX = -(1 << 63), (1 << 63) - 1


def check_times(atime: int, mtime: int, ctime: int) -> None:
    """InvalidArgument unless the columns hold these times (ns): each one and its
    distance from mtime within int64 (292 years)."""
    da, dc = atime - mtime, ctime - mtime
    if not (_Q_MIN <= da <= _Q_MAX and _Q_MIN <= dc <= _Q_MAX and _Q_MIN <= mtime <= _Q_MAX):
        raise InvalidArgument("a time out of range, or times more than 292 years apart")


class State:
    """The index's state and its row primitives (see the module docstring)."""

    def __init__(self, log: Callable[[list[Op]], None]) -> None:
        self._log = log
        self.blobs: dict[str, bytes] = {}
        self.evictor_payloads: list[bytes] = []
        self.next_ino = ROOT_INO + 1
        # persisted columns, in image order (kvfs.format.nsparts.COLUMNS); a narrowing
        # one keeps each chunk in the narrowest item size its values fit
        # (kvfs.index.columns.Column); mode and mtime are read as bytes / absolute values
        (
            self._mode,
            self._owner,
            self._nlink,
            self._flags,
            self._size,
            self._atime,  # atime - mtime
            self._mtime,
            self._ctime,  # ctime - mtime
            self._parent,
            self._name_off,
            self._name_len,
            self._unit0,  # a compact map's first unit + 1 (0: none, or a side map)
            self._csum0,
            self._xattr,
        ) = (Column(spec.code, narrow=spec.narrow) for spec in COLUMNS)
        # runtime only: the kernel forgot everything at mount
        self._lookups = Column("I", narrow=True)
        # runtime only: where the row is in its parent's children
        self._cpos = Column("I", narrow=True)
        self._absolute_times = False
        """A version 2 image is loading: atime and ctime hold absolute times until
        :meth:`_rebase_times` (before the first replayed operation)."""
        self._arena = Arena()
        self._index = NameIndex(self._matches, self._key_of)
        self._owners: list[tuple[int, int]] = []
        self._owner_ids: dict[tuple[int, int], int] = {}
        self._xnames: list[bytes] = []
        self._xname_ids: dict[bytes, int] = {}
        self._forms = NameForms()
        self._big_xattrs: dict[int, bytes] = {}
        self._maps: dict[int, tuple[array[int], array[int]]] = {}
        self._multi: dict[int, array[int]] = {}
        self._dirs: dict[int, _Dir] = {}
        self._extra: dict[int, list[tuple[int, bytes]]] = {}
        self._opens: dict[int, int] = {}
        self._deferred: list[int] = []
        self._reclaim_at = 32
        self._ghosts: set[int] = set()
        self._free = array("I")
        self._live = 0
        self._rows = 0
        self._ensure(ROOT_INO + 1)

    @property
    def persisted_columns(self) -> tuple[Column, ...]:
        return (
            self._mode,
            self._owner,
            self._nlink,
            self._flags,
            self._size,
            self._atime,
            self._mtime,
            self._ctime,
            self._parent,
            self._name_off,
            self._name_len,
            self._unit0,
            self._csum0,
            self._xattr,
        )

    @property
    def xattr_names(self) -> tuple[bytes, ...]:
        """Every xattr name stored since the pool was made (interned, never removed)."""
        return tuple(self._xnames)

    @property
    def file_count(self) -> int:
        return self._live - len(self._dirs)

    @property
    def dir_count(self) -> int:
        return len(self._dirs)

    # ------------------------------------------------------------------ rows
    def _ensure(self, rows: int) -> None:
        if rows <= self._rows:
            return
        rows = -(-rows // ROWS) * ROWS
        for col in (*self.persisted_columns, self._lookups, self._cpos):
            col.ensure(rows)
        self._rows = rows

    def _set_times(self, ino: int, atime: int, mtime: int, ctime: int) -> None:
        """Absolute times of row ``ino``: mtime as it is, atime and ctime as their
        distance from it (a few bytes: they are close for almost every file)."""
        check_times(atime, mtime, ctime)
        self._atime[ino] = atime - mtime
        self._ctime[ino] = ctime - mtime
        self._mtime[ino] = mtime

    def times(self, ino: int) -> tuple[int, int, int]:
        """(atime, mtime, ctime) of row ``ino`` in ns."""
        c, r = ino >> SHIFT, ino & MASK
        mtime = self._mtime.chunks[c][r]
        return self._atime.chunks[c][r] + mtime, mtime, self._ctime.chunks[c][r] + mtime

    def _rebase_times(self) -> None:
        """A version 2 image held absolute atimes and ctimes: make them distances
        from mtime (once, when the image is in and before any replayed operation).
        A distance past 292 years (not settable since) is clamped."""
        self._absolute_times = False
        for c, mtimes in enumerate(self._mtime.chunks):
            for col in (self._atime, self._ctime):
                old = col.chunks[c]
                try:
                    new = array("q", map(sub, old, mtimes))
                except OverflowError:
                    pairs = zip(old, mtimes, strict=True)
                    new = array("q", (min(max(a - m, _Q_MIN), _Q_MAX) for a, m in pairs))
                col.chunks[c] = new
                col.shared[c] = 0
                col.narrow(c)

    def _touch(self, ino: int, now: int = 0) -> None:
        """mtime and ctime of ``ino`` (a directory whose entries changed, or a file
        whose content did) = ``now`` (default: the clock)."""
        now = now or time.time_ns()
        self._set_times(ino, self.times(ino)[0], now, now)

    def _owner_id(self, uid: int, gid: int) -> int:
        key = (uid, gid)
        oid = self._owner_ids.get(key)
        if oid is None:
            if len(self._owners) > 0xFFFF:
                raise NoSpace("more than 65536 distinct (uid, gid) owners")
            oid = self._owner_ids[key] = len(self._owners)
            self._owners.append(key)
        return oid

    def _set_owner(self, ino: int, uid: int, gid: int) -> None:
        self._owner[ino] = self._owner_id(uid, gid)

    # ------------------------------------------------------------------ name bytes
    def _name(self, ino: int) -> bytes:
        n = self._name_len[ino]
        return self._forms.name(self._arena.get(self._name_off[ino], n)) if n else b""

    def _set_name(self, ino: int, name: bytes) -> None:
        if self._name_len[ino]:
            if self._is_named(ino, name):
                return
            self._release_name(ino)
        entry = self._forms.entry(name)
        self._name_off[ino] = self._put_entry(entry)
        self._name_len[ino] = len(entry)

    def _put_entry(self, entry: bytes) -> int:
        """A name's arena entry stored (and counted against its form)."""
        self._forms.hold(entry)
        return self._arena.put(entry)

    def _release_name(self, ino: int) -> None:
        """Row ``ino``'s name entry released (its form's count too); the caller
        clears or replaces the row's name."""
        n, off = self._name_len[ino], self._name_off[ino]
        self._forms.drop(self._arena.get(off, min(n, FORM_HEAD.size)))
        self._arena.release(off, n)

    def _is_named(self, ino: int, name: bytes) -> bool:
        """Row ``ino``'s name is ``name``, kept whole or by its form (an entry by
        form is shorter than its name and starts with NUL, which no name holds)."""
        n, off = self._name_len[ino], self._name_off[ino]
        if n >= len(name):  # (a name with a NUL, never valid, is never found)
            return n == len(name) and name[:1] != b"\0" and self._arena.equals(off, n, name)
        return self._forms.name(self._arena.get(off, n)) == name

    def _matches(self, ino: int, parent: int, name: bytes) -> bool:
        return self._parent[ino] == parent and self._is_named(ino, name)

    def _key_of(self, ino: int) -> tuple[int, bytes]:
        return self._parent[ino], self._name(ino)
