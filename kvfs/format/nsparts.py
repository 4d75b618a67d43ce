"""The namespace image's geometry and the plain records it is encoded from and
decoded into (``docs/format.md``, "Namespace image").

The sizes here define the image's bytes: a column chunk holds ``ROWS`` rows, the arena
is cut into ``ARENA_CHUNK`` chunks of ``GRANULE``-byte granules, and ``COLUMNS``
lists the persisted columns in image order with their declared item codes. The
index (:mod:`kvfs.index`) keeps its state in exactly these shapes: it hands a
:class:`Snapshot` of frozen chunks and side tables to
:func:`kvfs.format.nsimage.image_payloads`, and installs the records
:func:`kvfs.format.nsimage.decode_part` returns, whole chunks at a time (no
per-file work on either side beyond what the bytes require).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

SHIFT = 10
ROWS = 1 << SHIFT
"""Rows per column chunk (8 KiB for an 8-byte column): the unit of copy-on-write,
and small enough that a nearly empty namespace checkpoints in a few KiB."""

GRANULE = 4
"""Arena allocation unit in bytes: offsets are granule numbers in an 'I' column."""
ARENA_CHUNK = 64 << 10
"""Arena chunk size in bytes; no entry spans two chunks."""
FORM_HEAD = struct.Struct("<BHB")
"""A name kept by its form in the arena (``kvfs.index.nameforms``): 0 (no name
starts with NUL), the form's id (side table 12), the count of hex digits; then the
digits, two to a byte."""

ROOT_INO = 1
"""The root directory's inode number (its row's parent is itself)."""


class ColumnSpec(NamedTuple):
    """A persisted column: its name, declared item code, and whether its chunks
    narrow (each in the narrowest code of its ladder that holds its values)."""

    name: str
    code: str
    narrow: bool


COLUMNS: tuple[ColumnSpec, ...] = (
    ColumnSpec("mode", "H", False),
    ColumnSpec("owner", "H", True),  # owner-table id
    ColumnSpec("nlink", "I", True),
    ColumnSpec("flags", "B", False),
    ColumnSpec("size", "q", True),
    ColumnSpec("atime", "q", True),  # atime - mtime
    ColumnSpec("mtime", "q", False),
    ColumnSpec("ctime", "q", True),  # ctime - mtime
    ColumnSpec("parent", "I", True),
    ColumnSpec("name_off", "I", True),
    ColumnSpec("name_len", "B", False),
    ColumnSpec("unit0", "q", True),  # a compact map's first unit + 1 (0: none, or a side map)
    ColumnSpec("csum0", "Q", False),
    ColumnSpec("xattr", "I", True),  # arena offset + 1 of the xattr set (0: none)
)
"""The persisted columns, in image order (a COLUMN part's id is the index here)."""

LADDERS = {
    "B": "B",
    "H": "BH",
    "I": "BHI",
    "Q": "BHIQ",
    "b": "b",
    "h": "bh",
    "i": "bhi",
    "q": "bhiq",
}
"""Item codes a narrowing column's chunks may take, narrowest first, up to the
column's declared code (unsigned and signed ladders)."""


def ladder(spec: ColumnSpec) -> str:
    """The item codes ``spec``'s chunks may have (its declared code alone if it
    does not narrow)."""
    return LADDERS[spec.code] if spec.narrow else spec.code


@dataclass
class Snapshot:
    """A namespace at one moment, as the image encodes it. The chunk lists and
    ``listings`` / ``multi`` must be frozen (copy-on-write: nobody changes them
    afterwards), as the encoder reads them while the namespace goes on; every other
    table is read during the ``image_payloads`` call itself."""

    next_ino: int
    live: int
    rows: int
    table: tuple[int, int]
    """The name index's table: (slots, used)."""
    old_table: tuple[int, int]
    """The table being migrated from: (slots, used); (0, 0) when none."""
    cursor: int
    arena_tail: int
    columns: Sequence[Sequence[array[int]]]
    """Each persisted column's chunks (``COLUMNS`` order)."""
    slots: Sequence[array[int]]
    old_slots: Sequence[array[int]]
    arena: Sequence[bytearray]
    owners: Sequence[tuple[int, int]]
    xattr_names: Sequence[bytes]
    name_forms: Sequence[tuple[int, int, bytes, bytes]]
    """The name forms in use (``kvfs.index.nameforms``): id, entries that use it,
    prefix, suffix (none: the image is written as version 3)."""
    free: array[int]
    dead: Sequence[int]
    """Rows dropped while something still named them."""
    links: Sequence[tuple[int, Mapping[bytes, int]]]
    """Extra hard-link names per directory (directories without any left out)."""
    maps: Mapping[int, tuple[array[int], array[int]]]
    """General unit maps: inode -> (units, checksums)."""
    big_xattrs: Mapping[int, bytes]
    arena_free: Mapping[int, array[int]]
    blobs: Mapping[str, bytes]
    listings: Sequence[tuple[int, array[int]]]
    """Every directory's children (frozen)."""
    multi: Sequence[tuple[int, array[int]]]
    """Contiguous multi-unit maps: inode -> checksums (never changed in place)."""


# ------------------------------------------------------------------ decoded parts
class Meta(NamedTuple):
    """The image's head: its version and geometry (validated)."""

    version: int
    next_ino: int
    live: int
    rows: int
    table: tuple[int, int]
    tombs: int
    """Deleted slots of a version-1 table (0 since version 2)."""
    old_table: tuple[int, int]
    cursor: int
    arena_tail: int


COLUMN = 0
SLOTS = 1


class Chunks(NamedTuple):
    """Whole chunks of a persisted column (``target`` COLUMN, ``pid`` its index in
    ``COLUMNS``) or of a name-index table (SLOTS, ``pid`` 0 the table, 1 the old
    one), each ``ROWS`` items in the code it was stored in. ``narrow``: they are at
    their column's declared code (older images, sparse records): narrow them once
    installed."""

    target: int
    pid: int
    chunks: list[tuple[int, array[int]]]
    narrow: bool


class ArenaChunks(NamedTuple):
    """Whole arena chunks (``ARENA_CHUNK`` bytes each), by chunk number."""

    chunks: list[tuple[int, bytes]]


class Owners(NamedTuple):
    owners: list[tuple[int, int]]
    """(uid, gid) of the owner ids from the next one on."""


class XattrNames(NamedTuple):
    names: list[bytes]
    """Interned xattr names, ids from the next one on."""


class NameFormsPart(NamedTuple):
    forms: list[tuple[int, int, bytes, bytes]]
    """Name forms in use: id, entries that use it, prefix, suffix."""


class FreeRows(NamedTuple):
    rows: array[int]


class DeadRows(NamedTuple):
    rows: list[int]


class Listings(NamedTuple):
    listings: list[tuple[int, array[int]]]
    """(directory, children)."""


class Links(NamedTuple):
    links: list[tuple[int, list[tuple[bytes, int]]]]
    """(directory, its extra hard-link names and their inodes)."""


class UnitMaps(NamedTuple):
    maps: list[tuple[int, array[int], array[int]]]
    """(inode, units, checksums)."""


class MultiMaps(NamedTuple):
    maps: list[tuple[int, array[int]]]
    """(inode, checksums): units from its first-unit column on."""


class BigXattrs(NamedTuple):
    sets: list[tuple[int, bytes]]


class ArenaFree(NamedTuple):
    lists: list[tuple[int, array[int]]]
    """(granules, free offsets)."""


class Blobs(NamedTuple):
    blobs: list[tuple[str, bytes]]


Part = (
    Meta
    | Chunks
    | ArenaChunks
    | Owners
    | XattrNames
    | NameFormsPart
    | FreeRows
    | DeadRows
    | Listings
    | Links
    | UnitMaps
    | MultiMaps
    | BigXattrs
    | ArenaFree
    | Blobs
)
"""What one image payload decodes to."""


def root_snapshot(uid: int, gid: int, now: int, mode: int) -> Snapshot:
    """A namespace holding only its root directory (``mode``, owned by ``uid``,
    ``gid``, every time ``now``), as a new pool's first checkpoint holds it: one
    chunk per column, each in the narrowest code of its ladder, rows 0 and
    everything but the root's zero."""
    row = {"mode": mode, "nlink": 2, "mtime": now, "parent": ROOT_INO}
    columns = []
    for spec in COLUMNS:
        chunk = array(ladder(spec)[0], bytes(ROWS * array(ladder(spec)[0]).itemsize))
        chunk[ROOT_INO] = row.get(spec.name, 0)
        columns.append([chunk])
    return Snapshot(
        next_ino=ROOT_INO + 1,
        live=1,
        rows=ROWS,
        table=(ROWS, 0),
        old_table=(0, 0),
        cursor=0,
        arena_tail=0,
        columns=columns,
        slots=[array("I", bytes(4 * ROWS))],
        old_slots=[],
        arena=[],
        owners=[(uid, gid)],
        xattr_names=[],
        name_forms=[],
        free=array("I"),
        dead=[],
        links=[],
        maps={},
        big_xattrs={},
        arena_free={},
        blobs={},
        listings=[(ROOT_INO, array("I"))],
        multi=[],
    )
