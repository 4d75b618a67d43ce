"""The in-memory index: inodes, directories, xattrs. Pure and synchronous.

Every mutation changes the in-memory state and hands the journal operations that
reproduce it to ``log`` (one call = one atomic transaction); recovery feeds the same
operations to :meth:`Namespace.apply`. No method awaits, so under trio each one is
atomic with respect to every other request.

Storage is columnar (``docs/design.md``, "The index in columns"): one row per inode
number in copy-on-write chunked ``array`` columns (:mod:`kvfs.index.columns`), names and
xattrs in a byte arena, a (parent, name) -> inode hash index; no Python object per
file. :class:`Inode` is a view (:mod:`kvfs.index.inodes`). A file in one contiguous extent
is its first unit, that unit's checksum and its size; other unit maps live in side
tables, and a file being written has a materialized map (:meth:`edit_map`) that
:meth:`commit` folds back once the file is clean.
"""

from __future__ import annotations

import stat
import time
import weakref
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from itertools import compress
from operator import sub

from kvfs.common.errors import (
    Exists,
    InvalidArgument,
    IsADirectory,
    NameTooLong,
    NoAttribute,
    NoSpace,
    NotADirectory,
    NotEmpty,
    NotFound,
    NotPermitted,
    Stale,
    TooBig,
)
from kvfs.format.nsimage import (
    BIG_XATTR_HEAD,
    TAG,
    XATTR_HEAD,
    XATTR_SET_LEN,
    image_payloads,
    load_part,
)
from kvfs.format.records import (
    FLAG_GONE,
    FLAG_WRITING,
    NO_UNIT,
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
from kvfs.index.columns import ARENA_MAX_ENTRY, GRANULE, MASK, ROWS, SHIFT, Arena, Column, NameIndex
from kvfs.index.inodes import F_DEAD, F_INTERNAL, F_NAMED, DirView, Inode, InodeTable, compact_kind

ROOT_INO = 1
NAME_MAX = 255
XATTR_NAME_MAX = 255
XATTR_VALUE_MAX = 4096
"""Bytes of one xattr value: one ext4 block (ext4 without ``ea_inode`` keeps a file's
xattrs in one 4 KiB block). A larger value is E2BIG (the VFS's own limit, 64 KiB,
never reaches kvfs)."""
XATTR_FILE_MAX = 8192
"""Bytes of a file's xattrs, names plus values: a set that would pass it is ENOSPC, as
on ext4 (whose bound is about 4 KiB; twice that lets a full-size value sit beside
small ones). What one file adds to a checkpoint and to a journal window is bounded."""
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2

BIG_XATTRS = 0xFFFFFFFF
"""``xattr`` column value: this inode's xattrs are in the big-xattr side table."""


def xattr_bytes(xattrs: dict[bytes, bytes]) -> int:
    """What a file's xattrs count against ``XATTR_FILE_MAX``: names plus values."""
    return sum(len(k) + len(v) for k, v in xattrs.items())


def check_xattr_room(xattrs: dict[bytes, bytes], name: bytes, value: bytes) -> None:
    """May ``name`` be set to ``value`` on a file holding ``xattrs``? TooBig (E2BIG)
    for a value over ``XATTR_VALUE_MAX``, NoSpace (ENOSPC) when the file's xattrs
    would pass ``XATTR_FILE_MAX`` (a set that does not grow them always may: a pool
    written before the bound)."""
    if len(value) > XATTR_VALUE_MAX:
        raise TooBig(f"xattr value of {len(value)} bytes, over {XATTR_VALUE_MAX}")
    old = xattr_bytes(xattrs)
    new = old + len(name) + len(value)
    if name in xattrs:
        new -= len(name) + len(xattrs[name])
    if new > XATTR_FILE_MAX and new > old:
        raise NoSpace(f"the file's xattrs would take {new} bytes, over {XATTR_FILE_MAX}")


def check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise NameTooLong(f"name of {len(name)} bytes")
    if not name or name in (b".", b"..") or b"/" in name or b"\0" in name:
        raise InvalidArgument(f"invalid name {name!r}")


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


INDEX_LOAD = 0.375
"""The name index's lowest load (right after it doubles): the most bytes a name costs."""


_Q_MIN, _Q_MAX = -(1 << 63), (1 << 63) - 1


def check_times(atime: int, mtime: int, ctime: int) -> None:
    """InvalidArgument unless the columns hold these times (ns): each one and its
    distance from mtime within int64 (292 years)."""
    da, dc = atime - mtime, ctime - mtime
    if not (_Q_MIN <= da <= _Q_MAX and _Q_MIN <= dc <= _Q_MAX and _Q_MIN <= mtime <= _Q_MAX):
        raise InvalidArgument("a time out of range, or times more than 292 years apart")


EVICTOR_TAG = 0xE7
"""First byte of the evictor's checkpoint payloads (``kvfs.evict.evictor``); a load keeps
them in ``Namespace.evictor_payloads`` for the evictor (not an op tag, not TAG)."""


class Namespace:
    """Inode table and directory tree."""

    def __init__(self, log: Callable[[list[Op]], None]) -> None:
        self._log = log
        self.blobs: dict[str, bytes] = {}
        self.evictor_payloads: list[bytes] = []
        self.next_ino = ROOT_INO + 1
        # persisted columns, in image order (kvfs.format.nsimage)
        # narrow=True: each chunk in the narrowest item size its values fit
        # (kvfs.index.columns.Column); mode and mtime are read as bytes / absolute values
        self._mode = Column("H")
        self._owner = Column("H", narrow=True)
        self._nlink = Column("I", narrow=True)
        self._flags = Column("B")
        self._size = Column("q", narrow=True)
        self._atime = Column("q", narrow=True)  # atime - mtime
        self._mtime = Column("q")
        self._ctime = Column("q", narrow=True)  # ctime - mtime
        self._parent = Column("I", narrow=True)
        self._name_off = Column("I", narrow=True)
        self._name_len = Column("B")
        # a compact map's first unit + 1 (0: none, or a side map)
        self._unit0 = Column("q", narrow=True)
        self._csum0 = Column("Q")
        self._xattr = Column("I", narrow=True)
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
        self._big_xattrs: dict[int, bytes] = {}
        self._maps: dict[int, tuple[array[int], array[int]]] = {}
        self._multi: dict[int, array[int]] = {}
        self._dirs: dict[int, _Dir] = {}
        self._extra: dict[int, list[tuple[int, bytes]]] = {}
        self._opens: dict[int, int] = {}
        self._views: weakref.WeakValueDictionary[int, Inode] = weakref.WeakValueDictionary()
        self._zombies: weakref.WeakValueDictionary[int, Inode] = weakref.WeakValueDictionary()
        self._deferred: list[int] = []
        self._reclaim_at = 32
        self._ghosts: set[int] = set()
        self._free = array("I")
        self._live = 0
        self._rows = 0
        self._ensure(ROOT_INO + 1)
        self.inodes = InodeTable(self)

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

    def _view(self, ino: int) -> Inode:
        view = self._views.get(ino)
        if view is None:
            view = self._views[ino] = Inode(self, ino)
        return view

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

    def _new_row(self, rec: InodeRecord) -> None:
        ino = rec.ino
        self._ensure(ino + 1)
        self._mode[ino] = rec.mode
        self._set_owner(ino, rec.uid, rec.gid)
        self._nlink[ino] = rec.nlink
        self._flags[ino] = rec.flags & ~F_INTERNAL
        self._size[ino] = rec.size
        self._set_times(ino, rec.atime_ns, rec.mtime_ns, rec.ctime_ns)
        self._parent[ino] = ROOT_INO if ino == ROOT_INO else 0  # the root's '..' is itself
        self._name_len[ino] = 0
        self._xattr[ino] = 0
        self._lookups[ino] = 0
        self._set_map(ino, rec.units, rec.csums)
        if stat.S_ISDIR(rec.mode):
            self._dirs[ino] = _Dir()
        self._live += 1
        if ino >= self.next_ino:
            self.next_ino = ino + 1

    def _alloc_ino(self) -> int:
        if not self._free and self._deferred:
            self._reclaim()
        if self._free:
            return self._free.pop()
        ino = self.next_ino
        self.next_ino += 1
        return ino

    def image_cost(self, ino: int) -> int:
        """Bytes inode ``ino`` takes in a checkpoint image: its row of every persisted
        column, its name index slot (at the index's highest load) and listing entry,
        its name and xattrs in the arena, a unit map or checksums in a side table."""
        row = sum(array(c.code).itemsize for c in self.persisted_columns)
        name = -(-self._name_len[ino] // GRANULE) * GRANULE
        xattrs = self._xattrs(ino)
        extra = sum(4 + len(v) for v in xattrs.values()) + 8 if xattrs else 0
        entry = self._maps.get(ino)
        if entry is not None:
            extra += 16 * len(entry[0]) + 12
        elif ino in self._multi:
            extra += 8 * len(self._multi[ino]) + 12
        return row + int(4 / INDEX_LOAD) + 4 + name + extra

    def _reclaim(self) -> None:
        """Free dropped rows no view names any more (those the kernel still knows
        are stripped now and freed by :meth:`kernel_forget`)."""
        keep = []
        for ino in self._deferred:
            if ino in self._zombies:
                keep.append(ino)
            elif self._lookups[ino]:
                self._strip_row(ino)
                self._ghosts.add(ino)
            else:
                self._free_row(ino)
        self._deferred = keep
        self._reclaim_at = 2 * len(keep) + 32  # amortized O(1) per drop

    def _strip_row(self, ino: int) -> None:
        """A dropped row keeps only its F_DEAD flag (and the kernel's lookup count):
        its name, xattrs and unit map are released and every other column zeroed,
        so chunks of dropped rows shrink in (or leave) the checkpoint image at once,
        while the number stays unused until the kernel forgets it (no ESTALE
        answered with another file's attributes)."""
        if not self._mode[ino]:
            return  # stripped already
        n = self._name_len[ino]
        if n:
            self._arena.release(self._name_off[ino], n)
        self._drop_xattrs(ino)
        self._maps.pop(ino, None)
        self._multi.pop(ino, None)
        self._opens.pop(ino, None)
        for col in (*self.persisted_columns, self._cpos):
            col[ino] = 0
        self._flags[ino] = F_DEAD

    def _free_row(self, ino: int) -> None:
        """Return a dropped row for reuse (nothing can name it any more)."""
        if not self._mode[ino] and not self._flags[ino]:
            return  # free already: never twice on the free list (two files, one row)
        self._strip_row(ino)
        self._flags[ino] = 0
        self._lookups[ino] = 0
        self._free.append(ino)

    def _kill(self, ino: int) -> None:
        """The row leaves the namespace (names first, if any are left)."""
        for parent, name in self._names(ino):
            self._del_name(parent, name)
        self._flags[ino] |= F_DEAD
        self._live -= 1
        self._dirs.pop(ino, None)
        view = self._views.pop(ino, None)
        if view is not None:  # a view may still read it (an open, unlinked file)
            self._zombies[ino] = view
            self._deferred.append(ino)
            if len(self._deferred) >= self._reclaim_at:
                self._reclaim()
        elif self._lookups[ino]:
            self._strip_row(ino)
            self._ghosts.add(ino)
        else:
            self._free_row(ino)

    def kernel_forget(self, ino: int, count: int) -> None:
        """FUSE forget of a dropped inode: its number is reused once the kernel
        holds no reference (never while it may still name the old file: ESTALE)."""
        if not (0 < ino < self.next_ino) or not self._flags[ino] & F_DEAD:
            return
        left = max(0, self._lookups[ino] - count)
        self._lookups[ino] = left
        if not left and ino in self._ghosts:
            self._ghosts.discard(ino)
            self._free_row(ino)

    # ------------------------------------------------------------------ names
    def _name(self, ino: int) -> bytes:
        n = self._name_len[ino]
        return self._arena.get(self._name_off[ino], n) if n else b""

    def _set_name(self, ino: int, name: bytes) -> None:
        n = self._name_len[ino]
        if n == len(name) and self._arena.equals(self._name_off[ino], n, name):
            return
        if n:
            self._arena.release(self._name_off[ino], n)
        self._name_off[ino] = self._arena.put(name)
        self._name_len[ino] = len(name)

    def _matches(self, ino: int, parent: int, name: bytes) -> bool:
        return (
            self._parent[ino] == parent
            and self._name_len[ino] == len(name)
            and self._arena.equals(self._name_off[ino], len(name), name)
        )

    def _key_of(self, ino: int) -> tuple[int, bytes]:
        return self._parent[ino], self._name(ino)

    def _find(self, parent: int, name: bytes) -> int:
        ino = self._index.find(parent, name)
        if ino:
            return ino
        d = self._dirs.get(parent)
        if d is not None and d.links:
            return d.links.get(name, 0)
        return 0

    def _add_name(self, parent: int, name: bytes, ino: int) -> None:
        """Record a name known to be absent from ``parent``."""
        if not self._flags[ino] & F_NAMED:
            self._parent[ino] = parent
            self._set_name(ino, name)
            self._flags[ino] |= F_NAMED
            self._index.insert(parent, name, ino)
            children = self._dirs[parent].own_children()
            self._cpos[ino] = len(children)
            children.append(ino)
            return
        d = self._dirs[parent]
        if d.links is None:
            d.links = {}
        d.links[name] = ino
        self._extra.setdefault(ino, []).append((parent, name))

    def _del_name(self, parent: int, name: bytes) -> int:
        """Remove a name; KeyError if it does not exist. Returns its inode."""
        ino = self._index.find(parent, name)
        if ino:
            self._index.remove(parent, name, ino)
            children = self._dirs[parent].own_children()
            i = self._child_pos(children, ino)
            last = children.pop()
            if i < len(children):
                children[i] = last
                self._cpos[last] = i
            self._flags[ino] &= ~F_NAMED
            extra = self._extra.get(ino)
            if extra:  # another hard link becomes the indexed name
                p, n = extra.pop()
                if not extra:
                    del self._extra[ino]
                self._drop_link(p, n)
                self._add_name(p, n, ino)
            return ino
        d = self._dirs.get(parent)
        if d is None or not d.links or name not in d.links:
            raise KeyError(name)
        ino = self._drop_link(parent, name)
        extra = self._extra[ino]
        extra.remove((parent, name))
        if not extra:
            del self._extra[ino]
        return ino

    def _child_pos(self, children: array[int], ino: int) -> int:
        """Where ``ino`` is in ``children`` (its parent's listing): O(1) from the
        position column. Positions are not in checkpoints: after a load (or anything
        else that filled a listing without them) the first miss in a directory
        recomputes its positions once."""
        i = self._cpos[ino]
        if i < len(children) and children[i] == ino:
            return i
        for j, child in enumerate(children):
            self._cpos[child] = j
        i = self._cpos[ino]
        if i < len(children) and children[i] == ino:
            return i
        return children.index(ino)  # ValueError: not listed (a broken index)

    def _drop_link(self, parent: int, name: bytes) -> int:
        d = self._dirs[parent]
        assert d.links is not None
        ino = d.links.pop(name)
        if not d.links:
            d.links = None
        return ino

    def _names(self, ino: int) -> list[tuple[int, bytes]]:
        out = [(p, n) for p, n in self._extra.get(ino, ())]
        if self._flags[ino] & F_NAMED:
            out.append((self._parent[ino], self._name(ino)))
        return out

    # ------------------------------------------------------------------ xattrs
    def _xattrs(self, ino: int) -> dict[bytes, bytes] | None:
        ref = self._xattr[ino]
        if not ref:
            return None
        if ref == BIG_XATTRS:
            raw, head = self._big_xattrs[ino], BIG_XATTR_HEAD
        else:
            (n,) = XATTR_SET_LEN.unpack(self._arena.get(ref - 1, XATTR_SET_LEN.size))
            raw, head = (
                self._arena.get(ref - 1, XATTR_SET_LEN.size + n)[XATTR_SET_LEN.size :],
                XATTR_HEAD,
            )
        out: dict[bytes, bytes] = {}
        pos = 0
        while pos < len(raw):
            nid, vlen = head.unpack_from(raw, pos)
            pos += head.size + vlen
            out[self._xnames[nid]] = raw[pos - vlen : pos]
        return out

    def _xname_id(self, name: bytes) -> int:
        nid = self._xname_ids.get(name)
        if nid is None:
            if len(self._xnames) > 0xFFFF:
                raise NoSpace("more than 65536 distinct xattr names")
            nid = self._xname_ids[name] = len(self._xnames)
            self._xnames.append(name)
        return nid

    def _store_xattrs(self, ino: int, xattrs: dict[bytes, bytes]) -> None:
        self._drop_xattrs(ino)
        if not xattrs:
            return
        items = sorted((self._xname_id(k), v) for k, v in xattrs.items())
        size = sum(XATTR_HEAD.size + len(v) for _, v in items)
        if size + XATTR_SET_LEN.size > ARENA_MAX_ENTRY:
            self._big_xattrs[ino] = b"".join(BIG_XATTR_HEAD.pack(k, len(v)) + v for k, v in items)
            self._xattr[ino] = BIG_XATTRS
        else:
            raw = b"".join(XATTR_HEAD.pack(k, len(v)) + v for k, v in items)
            self._xattr[ino] = self._arena.put(XATTR_SET_LEN.pack(len(raw)) + raw) + 1

    def _drop_xattrs(self, ino: int) -> None:
        ref = self._xattr[ino]
        if ref == BIG_XATTRS:
            del self._big_xattrs[ino]
        elif ref:
            (n,) = XATTR_SET_LEN.unpack(self._arena.get(ref - 1, XATTR_SET_LEN.size))
            self._arena.release(ref - 1, XATTR_SET_LEN.size + n)
        self._xattr[ino] = 0

    # ------------------------------------------------------------------ unit maps
    def _set_map(self, ino: int, units: array[int], csums: array[int]) -> None:
        self._maps[ino] = (array("q", units), array("Q", csums))
        self._multi.pop(ino, None)
        self._fold(ino)

    def _fold(self, ino: int) -> None:
        """A materialized map back to its compact form where it has one."""
        entry = self._maps.get(ino)
        if entry is None:
            return
        units, csums = entry
        kind = compact_kind(units, csums)
        if kind == 3:
            self._unit0[ino] = 0
            return
        del self._maps[ino]
        self._unit0[ino] = units[0] + 1 if kind else 0
        self._csum0[ino] = csums[0] if kind else 0
        if kind == 2:
            self._multi[ino] = csums

    def edit_map(self, inode: Inode) -> tuple[array[int], array[int]]:
        """The file's unit map and checksums as mutable arrays, kept materialized
        until :meth:`commit` of the file once it is no longer being written."""
        ino = inode.ino
        entry = self._maps.get(ino)
        if entry is None:
            entry = self._maps[ino] = (self._units(ino), self._csums(ino))
            self._multi.pop(ino, None)
            self._unit0[ino] = 0
        return entry

    def _nunits(self, ino: int) -> int:
        entry = self._maps.get(ino)
        if entry is not None:
            return len(entry[0])
        multi = self._multi.get(ino)
        if multi is not None:
            return len(multi)
        return 0 if self._unit0[ino] == 0 else 1

    def _unit(self, ino: int, u: int) -> int:
        entry = self._maps.get(ino)
        if entry is not None:
            return entry[0][u] if 0 <= u < len(entry[0]) else NO_UNIT
        if u == 0:
            return self._unit0[ino] - 1  # NO_UNIT for none
        multi = self._multi.get(ino)
        if multi is not None and 0 < u < len(multi):
            return self._unit0[ino] - 1 + u
        return NO_UNIT

    def _csum(self, ino: int, u: int) -> int:
        entry = self._maps.get(ino)
        if entry is not None:
            return entry[1][u] if 0 <= u < len(entry[1]) else 0
        multi = self._multi.get(ino)
        if multi is not None:
            return multi[u] if 0 <= u < len(multi) else 0
        return self._csum0[ino] if u == 0 and self._unit0[ino] else 0

    def _units(self, ino: int) -> array[int]:
        entry = self._maps.get(ino)
        if entry is not None:
            return entry[0]
        first = self._unit0[ino] - 1
        multi = self._multi.get(ino)
        if multi is not None:
            return array("q", range(first, first + len(multi)))
        return array("q") if first == NO_UNIT else array("q", (first,))

    def _csums(self, ino: int) -> array[int]:
        entry = self._maps.get(ino)
        if entry is not None:
            return entry[1]
        multi = self._multi.get(ino)
        if multi is not None:
            return multi[:]
        return array("Q", (self._csum0[ino],)) if self._unit0[ino] else array("Q")

    def _mapped(self, ino: int) -> int:
        entry = self._maps.get(ino)
        if entry is not None:
            return len(entry[0]) - entry[0].count(NO_UNIT)
        return self._nunits(ino)

    # ------------------------------------------------------------------ bulk reads
    def scan_inodes(self, flag_mask: int) -> list[int]:
        """Live inodes (root excluded) with a flag in ``flag_mask`` or no link:
        recovery's "unfinished" files, found with C-level scans of whole chunks."""
        clean = bytes(b for b in range(256) if not b & flag_mask & ~F_INTERNAL)
        found = []
        end = self.next_ino
        chunks = zip(self._mode.chunks, self._flags.chunks, self._nlink.chunks, strict=True)
        for c, (modes, flags, nlinks) in enumerate(chunks):
            base = c << SHIFT
            if base >= end:
                break
            if not flags.tobytes().translate(None, clean) and nlinks.count(0) == modes.count(0):
                continue  # (a free row has mode 0 and nlink 0)
            for i, m in enumerate(modes):
                ino = base + i
                live = m and ino != ROOT_INO and not flags[i] & F_DEAD
                if live and (flags[i] & flag_mask & ~F_INTERNAL or not nlinks[i]):
                    found.append(ino)
        return found

    def mapped_by_directory(self) -> tuple[Counter[int], Counter[int], list[int]]:
        """(units mapped by named files per parent directory, the same per owner uid,
        the root's subdirectories): what a mount's usage counters start from, in
        C-level passes over whole chunks (``itertools.compress`` + ``Counter``), not
        one Python step per file. A file counts for the directory of its indexed
        name (``Inode.parent``)."""
        parents: Counter[int] = Counter()
        owners: Counter[int] = Counter()  # owner-table id -> units
        # flags byte -> 1 for a row that has a name and is not dead (a file without a
        # name has no F_NAMED: ``_del_name`` gives it another name's, or clears it)
        named = bytes(int(bool(f & F_NAMED and not f & F_DEAD)) for f in range(256))
        end = self.next_ino
        columns = (self._unit0, self._flags, self._parent, self._owner)
        chunks = zip(*(col.chunks for col in columns), strict=False)
        for c, (u0, fl, par, own) in enumerate(chunks):
            if c << SHIFT >= end:
                break
            raw = u0.tobytes()
            if raw.count(0) == len(raw):  # (bytes.count: C speed; array.count is not)
                continue  # no compact map here (directories, side maps, free rows)
            # the rows with a first unit, then of those the named ones: iterators only
            sel = bytes(compress(fl.tobytes().translate(named), u0))
            here = Counter(compress(compress(par, u0), sel))
            parents.update(here)
            raw = own.tobytes()
            if raw.count(0) == len(raw):  # one owner: the usual pool
                owners[0] += here.total()
            else:
                owners.update(compress(compress(own, u0), sel))
        # further units of contiguous multi-unit files; general (side) maps
        extra = [(ino, len(csums) - 1) for ino, csums in self._multi.items()]
        extra += [(ino, len(u) - u.count(NO_UNIT)) for ino, (u, _) in self._maps.items()]
        for ino, units in extra:
            if ino in self.inodes and self._nlink[ino] and units:
                parents[self._parent[ino]] += units
                owners[self._owner[ino]] += units
        uids: Counter[int] = Counter()
        for oid, units in owners.items():
            uids[self._owners[oid][0] if self._owners else 0] += units
        tops = [d for d in self._dirs if d != ROOT_INO and self._parent[d] == ROOT_INO]
        return parents, uids, tops

    def parent_of(self, ino: int) -> int:
        """The directory of the inode's indexed name (``Inode.parent``, no view made)."""
        return self._parent[ino]

    def unit_columns(self) -> tuple[list[array[int]], list[tuple[int, int]]]:
        """Every unit a live file maps, for the mount's bulk claim: the first-unit
        column's chunks (address + 1 per row, 0 none) and, as (first, count), the
        extents those leave out (the further units of contiguous multi-unit files,
        general maps)."""
        rest = []
        for ino, csums in self._multi.items():
            first = self._unit0[ino] - 1
            if len(csums) > 1:
                rest.append((first + 1, len(csums) - 1))
        for units, _ in self._maps.values():
            rest.extend((p, 1) for p in units if p != NO_UNIT)
        return self._unit0.chunks, rest

    def file_rows(self) -> list[tuple[int, int, int]]:
        """(inode, size, mtime_ns) of every live file, without views."""
        out = []
        end = self.next_ino
        cols = zip(
            self._mode.chunks,
            self._flags.chunks,
            self._size.chunks,
            self._mtime.chunks,
            strict=True,
        )
        for c, (modes, flags, sizes, mtimes) in enumerate(cols):
            base = c << SHIFT
            if base >= end:
                break
            for i, m in enumerate(modes):
                if m and stat.S_ISREG(m) and not flags[i] & F_DEAD:
                    out.append((base + i, sizes[i], mtimes[i]))
        return out

    # ------------------------------------------------------------------ replay
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
            load_part(self, op.payload)
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
            load_part(self, payload)
            return
        if payload[:1] == bytes((EVICTOR_TAG,)):
            self.evictor_payloads.append(payload)
            return
        for op in decode_ops(payload):
            self.apply(op)

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
        self._views = weakref.WeakValueDictionary()
        self._zombies = weakref.WeakValueDictionary()

    def snapshot_payloads(self) -> Iterator[bytes]:
        """Freeze the state now (O(chunks) + O(directories)) and yield checkpoint
        payloads of it; the namespace may change while they are consumed. An empty
        payload is a pause (a bounded step that produced nothing): skip it."""
        self._reclaim()  # rows dropped since: zeroed, so left out of the image
        return image_payloads(self)

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

    # ------------------------------------------------------------------ queries
    def get(self, ino: int) -> Inode:
        """The inode the kernel names by number; Stale (ESTALE) if it is gone."""
        inode = self.inodes.get(ino)
        if inode is None or inode.flags & FLAG_GONE:
            raise Stale(f"inode {ino} is gone")
        return inode

    def directory(self, ino: int) -> DirView:
        self.get(ino)
        if ino not in self._dirs:
            raise NotADirectory(f"inode {ino}")
        return DirView(self, ino)

    def lookup(self, parent: int, name: bytes) -> Inode:
        inode = self.find(parent, name)
        if inode is None:
            raise NotFound(name.decode(errors="replace"))
        return inode

    def find(self, parent: int, name: bytes) -> Inode | None:
        """:meth:`lookup` that answers a missing name with None instead of raising
        (FUSE LOOKUP: misses are most of a lookup storm, and a rename's new name)."""
        if name == b".":
            return self.get(parent)
        if name == b"..":
            return self.get(self.get(parent).parent)
        if len(name) > NAME_MAX:
            raise NameTooLong(f"name of {len(name)} bytes")
        self.get(parent)
        if parent not in self._dirs:
            raise NotADirectory(f"inode {parent}")
        ino = self._find(parent, name)
        return self.inodes[ino] if ino else None

    # ------------------------------------------------------------------ mutations
    def init_root(self, uid: int, gid: int) -> None:
        now = time.time_ns()
        rec = InodeRecord(
            ROOT_INO, stat.S_IFDIR | 0o755, uid, gid, 2, 0, now, now, now, 0, array("q"), array("Q")
        )
        self._new_row(rec)
        self._log([self.inodes[ROOT_INO].record()])

    def make(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int, flags: int = 0
    ) -> Inode:
        """Create a file or directory named ``name`` in ``parent``."""
        check_name(name)
        entries = self.directory(parent)
        if name in entries:
            raise Exists(name.decode(errors="replace"))
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            raise NotPermitted("only regular files and directories are supported")
        owner = (uid, gid)
        if owner not in self._owner_ids and len(self._owners) > 0xFFFF:
            raise NoSpace("more than 65536 distinct (uid, gid) owners")
        now = time.time_ns()
        is_dir = stat.S_ISDIR(mode)
        ino = self._alloc_ino()
        empty_u, empty_c = array("q"), array("Q")
        rec = InodeRecord(
            ino, mode, uid, gid, 2 if is_dir else 1, 0, now, now, now, flags, empty_u, empty_c
        )
        self._new_row(rec)
        self._add_name(parent, name, ino)
        dir_inode = self.inodes[parent]
        dir_inode.touch(now)
        dir_inode.nlink += is_dir
        inode = self.inodes[ino]
        self._log([inode.record(), Dentry(parent, name, ino), dir_inode.record()])
        return inode

    def add_files(
        self,
        parent: int,
        names: list[bytes],
        mode: int,
        owner: tuple[int, int],
        size: int,
        units: array[int],
        csums: array[int],
    ) -> int:
        """Bulk creation of committed one-unit files (``units[i]``, ``csums[i]``) in
        ``parent``, unlogged: for tools that build big pools (benchmarks). Columns
        are filled with C-level slices; returns the first new inode number."""
        assert len(names) == len(units) == len(csums) and stat.S_ISREG(mode)
        for name in names:
            check_name(name)
        first, n = self.next_ino, len(names)
        self.next_ino += n
        self._ensure(self.next_ino)
        now = time.time_ns()
        constant: list[tuple[Column, int]] = [
            (self._mode, mode),
            (self._owner, self._owner_id(*owner)),
            (self._nlink, 1),
            (self._flags, F_NAMED),
            (self._size, size),
            (self._atime, 0),
            (self._mtime, now),
            (self._ctime, 0),
            (self._parent, parent),
        ]
        for col, value in constant:
            col.fill(first, array(col.code, [value]) * n)
        self._unit0.fill(first, array("q", [u + 1 for u in units]))
        self._csum0.fill(first, csums)
        self._name_len.fill(first, array("B", map(len, names)))
        put, insert = self._arena.put, self._index.insert
        self._name_off.fill(first, array("I", map(put, names)))
        for i, name in enumerate(names):
            insert(parent, name, first + i)
        children = self._dirs[parent].own_children()
        self._cpos.fill(first, array("I", range(len(children), len(children) + n)))
        children.extend(range(first, first + n))
        self._live += n
        return first

    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        inode = self.get(ino)
        if inode.is_dir:
            raise IsADirectory("hard link to a directory")
        check_name(name)
        entries = self.directory(parent)
        if name in entries:
            raise Exists(name.decode(errors="replace"))
        self._add_name(parent, name, ino)
        inode.nlink += 1
        inode.ctime_ns = time.time_ns()
        self._touch(parent)
        self._log([inode.record(), Dentry(parent, name, ino), self.inodes[parent].record()])
        return inode

    def names_of(self, inode: Inode) -> list[tuple[int, bytes]]:
        """Every (parent, name) of ``inode``."""
        return self._names(inode.ino)

    def remove(self, parent: int, name: bytes, want_dir: bool) -> Inode:
        """unlink (``want_dir`` False) or rmdir; returns the inode, maybe now nlink 0."""
        inode = self.lookup(parent, name)
        if want_dir and not inode.is_dir:
            raise NotADirectory(name.decode(errors="replace"))
        if not want_dir and inode.is_dir:
            raise IsADirectory(name.decode(errors="replace"))
        if want_dir and inode.entries:
            raise NotEmpty(name.decode(errors="replace"))
        ops = self._unlink_entry(parent, name, inode)
        self._log([*ops, Undentry(parent, name), self.inodes[parent].record()])
        return inode

    def _unlink_entry(self, parent: int, name: bytes, inode: Inode) -> list[Op]:
        self._del_name(parent, name)
        now = time.time_ns()
        self._touch(parent, now)
        inode.ctime_ns = now
        if inode.is_dir:
            inode.nlink = 0
            self.inodes[parent].nlink -= 1
        else:
            inode.nlink -= 1
        return [inode.record()]

    def _touch(self, ino: int, now: int = 0) -> None:
        """mtime and ctime of ``ino`` (a directory whose entries changed, or a file
        whose content did) = ``now`` (default: the clock)."""
        now = now or time.time_ns()
        self._set_times(ino, self.times(ino)[0], now, now)

    def rename(
        self, old_parent: int, old: bytes, new_parent: int, new: bytes, flags: int = 0
    ) -> Inode | None:
        """POSIX rename; returns the inode that lost its name (to be dropped), if any."""
        check_name(new)
        src = self.lookup(old_parent, old)
        dst_entries = self.directory(new_parent)
        target_ino = dst_entries.get(new)
        if flags & RENAME_EXCHANGE:
            if target_ino is None:
                raise NotFound(new.decode(errors="replace"))
            self._exchange(old_parent, old, new_parent, new)
            return None
        if target_ino is not None and flags & RENAME_NOREPLACE:
            raise Exists(new.decode(errors="replace"))
        if target_ino == src.ino:
            return None
        if src.is_dir:
            self._check_not_ancestor(src.ino, new_parent)
        ops: list[Op] = []
        victim = None
        if target_ino is not None:
            victim = self.inodes[target_ino]
            if victim.is_dir != src.is_dir:
                raise (IsADirectory if victim.is_dir else NotADirectory)(new.decode())
            if victim.entries:
                raise NotEmpty(new.decode(errors="replace"))
            ops += self._unlink_entry(new_parent, new, victim)
        self._del_name(old_parent, old)
        self._add_name(new_parent, new, src.ino)
        now = time.time_ns()
        src.ctime_ns = now
        if src.is_dir and old_parent != new_parent:
            self.inodes[old_parent].nlink -= 1
            self.inodes[new_parent].nlink += 1
        self._touch(old_parent, now)
        self._touch(new_parent, now)
        ops += [Undentry(old_parent, old), Dentry(new_parent, new, src.ino), src.record()]
        ops.append(self.inodes[old_parent].record())
        if new_parent != old_parent:  # within one directory: its record once
            ops.append(self.inodes[new_parent].record())
        self._log(ops)
        return victim

    def _exchange(self, p1: int, n1: bytes, p2: int, n2: bytes) -> None:
        """renameat2(RENAME_EXCHANGE): ``p1/n1`` and ``p2/n2`` swap inodes. A directory
        moved to the other parent takes its '..' along (``parent``) and moves one link
        of its old parent's count to the new one; neither may land in its own subtree."""
        a, b = self.inodes[self._find(p1, n1)], self.inodes[self._find(p2, n2)]
        if a is b:
            return
        if p1 != p2:
            if a.is_dir:
                self._check_not_ancestor(a.ino, p2)
            if b.is_dir:
                self._check_not_ancestor(b.ino, p1)
            moved = a.is_dir - b.is_dir  # subdirectories p1 loses to p2
            self.inodes[p1].nlink -= moved
            self.inodes[p2].nlink += moved
        self._del_name(p1, n1)
        self._del_name(p2, n2)
        self._add_name(p2, n2, a.ino)
        self._add_name(p1, n1, b.ino)
        now = time.time_ns()
        a.ctime_ns = b.ctime_ns = now
        self._touch(p1, now)
        self._touch(p2, now)
        ops: list[Op] = [Dentry(p1, n1, b.ino), Dentry(p2, n2, a.ino), a.record(), b.record()]
        ops.append(self.inodes[p1].record())
        if p2 != p1:
            ops.append(self.inodes[p2].record())
        self._log(ops)  # the inodes' ctimes and the directories' mtimes and links too

    def _check_not_ancestor(self, ino: int, target_dir: int) -> None:
        cur = target_dir
        while True:
            if cur == ino:
                raise InvalidArgument("cannot move a directory into itself")
            if cur == ROOT_INO:
                return
            cur = self._parent[cur]

    def drop(self, inode: Inode) -> None:
        """Forget an inode that has no names left and no users."""
        assert inode.nlink == 0 or inode.flags & FLAG_WRITING
        self._kill(inode.ino)
        self._log([Drop(inode.ino)])

    def detach(self, parent: int, name: bytes) -> None:
        """Remove a name without logging (recovery repairs; a checkpoint follows)."""
        if self._find(parent, name):
            self._del_name(parent, name)

    def discard(self, ino: int) -> None:
        """Remove an inode without logging (recovery repairs; a checkpoint follows)."""
        if ino in self.inodes:
            self._kill(ino)

    def commit(self, inode: Inode) -> None:
        """Log an inode's current persistent state; a file no longer being written
        gets its compact unit map back."""
        self._log([inode.record()])
        if not inode.flags & FLAG_WRITING:
            self._fold(inode.ino)

    def set_xattr(self, ino: int, name: bytes, value: bytes | None) -> None:
        inode = self.get(ino)
        if len(name) > XATTR_NAME_MAX:
            raise NameTooLong("xattr name too long")
        xattrs = inode.xattrs
        if value is None and (not xattrs or name not in xattrs):
            raise NoAttribute(name.decode(errors="replace"))
        if value is not None:
            check_xattr_room(xattrs or {}, name, value)
        self._apply_xattr(Xattr(ino, name, value))
        inode.ctime_ns = time.time_ns()
        self._log([Xattr(ino, name, value), inode.record()])

    def get_xattr(self, ino: int, name: bytes) -> bytes:
        xattrs = self.get(ino).xattrs
        if not xattrs or name not in xattrs:
            raise NoAttribute(name.decode(errors="replace"))
        return xattrs[name]

    def set_blob(self, name: str, data: bytes) -> None:
        self.blobs[name] = data
        self._log([Blob(name, data)])


__all__ = ["ROOT_INO", "SHIFT", "Inode", "Namespace", "check_name"]
