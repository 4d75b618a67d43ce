"""Extended attributes: a file's set in the arena (or, over 4 KiB, in a side table),
names interned (``Xattrs``, a mixin of :class:`kvfs.index.namespace.Namespace`)."""

from __future__ import annotations

from kvfs.common.errors import NoSpace, TooBig
from kvfs.format.nsimage import BIG_XATTR_HEAD, XATTR_HEAD, XATTR_SET_LEN
from kvfs.index.columns import ARENA_MAX_ENTRY
from kvfs.index.state import State

XATTR_NAME_MAX = 255
XATTR_VALUE_MAX = 4096
"""Bytes of one xattr value: one ext4 block (ext4 without ``ea_inode`` keeps a file's
xattrs in one 4 KiB block). A larger value is E2BIG (the VFS's own limit, 64 KiB,
never reaches kvfs)."""
XATTR_FILE_MAX = 8192
"""Bytes of a file's xattrs, names plus values: a set that would pass it is ENOSPC, as
on ext4 (whose bound is about 4 KiB; twice that lets a full-size value sit beside
small ones). What one file adds to a checkpoint and to a journal window is bounded."""

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


class Xattrs(State):
    """A row's xattr set, read and replaced whole."""

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
