"""The namespace's checkpoint image: its columns, arena and name index as raw chunk
bytes (loaded with ``array.frombytes``, no per-file decoding), plus side tables.

Every payload starts with a header ``<BBHI``: TAG (0xC5, never an op kind, so a
loader tells image parts from ``encode_ops`` payloads by the first byte), part kind,
part id, chunk index. Format in ``docs/format.md`` ("Namespace image").
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from kvfs.columns import ARENA_CHUNK, ROWS
from kvfs.errors import Corruption

if TYPE_CHECKING:
    from kvfs.namespace import Namespace

TAG = 0xC5
VERSION = 2
_HEAD = struct.Struct("<BBHI")
_META = struct.Struct("<IQQQQQQQ")
_MIGRATION = struct.Struct("<QQQ")
"""Appended to META since version 2: the name index's old table while it is being
migrated (slots, 0: none; used; cursor)."""
_PAIR = struct.Struct("<QI")
_OWNER = struct.Struct("<II")
_LINK = struct.Struct("<BI")

K_META, K_COLUMN, K_SLOTS, K_ARENA, K_SIDE = 1, 2, 3, 4, 5
(
    S_OWNERS,
    S_XNAMES,
    S_FREE,
    S_DEAD,
    S_CHILDREN,
    S_LINKS,
    S_MAPS,
    S_MULTI,
    S_BIGX,
    S_AFREE,
    S_BLOBS,
) = range(1, 12)
SIDE_BATCH = 4 << 20
"""Side-table payloads are cut at about this many bytes."""


def _part(kind: int, pid: int, index: int, body: bytes) -> bytes:
    return _HEAD.pack(TAG, kind, pid, index) + body


def _pairs(pid: int, items: Iterable[tuple[int, bytes]]) -> Iterator[bytes]:
    batch: list[bytes] = []
    size = 0
    for key, value in items:
        batch.append(_PAIR.pack(key, len(value)) + value)
        size += _PAIR.size + len(value)
        if size >= SIDE_BATCH:
            yield _part(K_SIDE, pid, 0, b"".join(batch))
            batch, size = [], 0
    if batch:
        yield _part(K_SIDE, pid, 0, b"".join(batch))


def _side_tables(ns: Namespace) -> list[bytes]:
    """The side tables serialized now (they are Python state, not chunks)."""
    links = (
        (d, b"".join(_LINK.pack(len(n), i) + n for n, i in state.links.items()))
        for d, state in ns._dirs.items()
        if state.links
    )
    parts = [
        *_pairs(S_OWNERS, ((i, _OWNER.pack(*o)) for i, o in enumerate(ns._owners))),
        *_pairs(S_XNAMES, enumerate(ns._xnames)),
        *_pairs(S_FREE, [(0, ns._free.tobytes())]),
        *_pairs(S_DEAD, ((i, b"") for i in [*ns._deferred, *ns._ghosts])),
        *_pairs(S_CHILDREN, ((d, s.children.tobytes()) for d, s in ns._dirs.items())),
        *_pairs(S_LINKS, links),
        *_pairs(S_MAPS, ((i, u.tobytes() + c.tobytes()) for i, (u, c) in ns._maps.items())),
        *_pairs(S_MULTI, ((i, c.tobytes()) for i, c in ns._multi.items())),
        *_pairs(S_BIGX, ns._big_xattrs.items()),
        *_pairs(S_AFREE, ((g, a.tobytes()) for g, a in ns._arena.free.items())),
        *_pairs(S_BLOBS, ((0, k.encode() + b"\0" + v) for k, v in ns.blobs.items())),
    ]
    return parts


BATCH = 1 << 20
"""Chunk payloads carry consecutive chunks up to about this many bytes."""


def _chunk_parts(
    kind: int, pid: int, chunks: list[array[int]] | list[bytearray]
) -> Iterator[bytes]:
    """Payloads of consecutive non-zero chunks (all-zero chunks are left out: a
    loaded column starts zeroed)."""
    batch: list[bytes] = []
    first = size = 0
    for c, chunk in enumerate(chunks):
        raw = chunk.tobytes() if isinstance(chunk, array) else bytes(chunk)
        if raw.count(0) == len(raw):
            if batch:
                yield _part(kind, pid, first, b"".join(batch))
                batch, size = [], 0
            continue
        if not batch:
            first = c
        batch.append(raw)
        size += len(raw)
        if size >= BATCH:
            yield _part(kind, pid, first, b"".join(batch))
            batch, size = [], 0
    if batch:
        yield _part(kind, pid, first, b"".join(batch))


def image_payloads(ns: Namespace) -> Iterator[bytes]:
    """Freeze ``ns`` now and return an iterator over its image payloads, which reads
    only the frozen chunks and the side tables serialized here."""
    index = ns._index
    old = index.old
    meta = _META.pack(
        VERSION,
        ns.next_ino,
        ns._live,
        ns._rows,
        index.table.size,
        index.table.used,
        0,
        ns._arena.tail,
    ) + _MIGRATION.pack(old.size if old else 0, old.used if old else 0, index.cursor)
    columns = [col.freeze() for col in ns.persisted_columns]
    slots, old_slots = index.freeze()
    arena = ns._arena.freeze()
    side = _side_tables(ns)

    def parts() -> Iterator[bytes]:
        yield _part(K_META, 0, 0, meta)
        for cid, chunks in enumerate(columns):
            yield from _chunk_parts(K_COLUMN, cid, chunks)
        yield from _chunk_parts(K_SLOTS, 0, slots)
        yield from _chunk_parts(K_SLOTS, 1, old_slots)
        yield from _chunk_parts(K_ARENA, 0, arena)
        yield from side

    return parts()


def load_part(ns: Namespace, payload: bytes) -> None:
    """Load one image payload into a namespace being recovered."""
    try:
        _tag, kind, pid, index = _HEAD.unpack_from(payload, 0)
        body = payload[_HEAD.size :]
        if kind == K_META:
            _load_meta(ns, body)
        elif kind == K_COLUMN:
            col = ns.persisted_columns[pid]
            step = ROWS * array(col.code).itemsize
            for i in range(0, len(body), step):
                col.load_chunk(index + i // step, body[i : i + step])
        elif kind == K_SLOTS:
            step = ROWS * 4
            slots = ns._index.part_table(pid).slots
            for i in range(0, len(body), step):
                slots.load_chunk(index + i // step, body[i : i + step])
        elif kind == K_ARENA:
            for i in range(0, len(body), ARENA_CHUNK):
                ns._arena.load_chunk(index + i // ARENA_CHUNK, body[i : i + ARENA_CHUNK])
        elif kind == K_SIDE:
            for key, value in _unpairs(body):
                _load_side(ns, pid, key, value)
        else:
            raise Corruption(f"unknown namespace image part {kind}")
    except (struct.error, ValueError, IndexError) as e:
        raise Corruption(f"namespace image part: {e}") from e


def _load_meta(ns: Namespace, body: bytes) -> None:
    version, next_ino, live, rows, isize, iused, itombs, tail = _META.unpack_from(body)
    if version not in (1, VERSION):
        raise Corruption(f"namespace image version {version} (this release reads 1, {VERSION})")
    osize = oused = cursor = 0
    if version > 1:
        osize, oused, cursor = _MIGRATION.unpack(body[_META.size :])
    if (
        not _table_geometry(isize, iused)
        or rows % ROWS
        or (osize and not _table_geometry(osize, oused))
        or cursor > osize
        or (version > 1 and itombs)
    ):
        raise Corruption("namespace image geometry")
    ns.next_ino, ns._live = next_ino, live
    ns._ensure(rows)
    if version == 1:
        ns._index.load_legacy(isize, iused, itombs)
    else:
        ns._index.load(isize, iused, osize, oused, cursor)
    ns._arena.tail = tail


def _table_geometry(size: int, used: int) -> bool:
    return size >= ROWS and not size & (size - 1) and used < size


def _unpairs(body: bytes) -> Iterator[tuple[int, bytes]]:
    pos = 0
    while pos < len(body):
        key, n = _PAIR.unpack_from(body, pos)
        pos += _PAIR.size + n
        if pos > len(body):
            raise ValueError("truncated side table")
        yield key, body[pos - n : pos]


def _array(code: str, raw: bytes) -> array[int]:
    a = array(code)
    a.frombytes(raw)
    return a


def _load_side(ns: Namespace, pid: int, key: int, value: bytes) -> None:
    from kvfs.namespace import _Dir

    if pid == S_OWNERS:
        owner = _OWNER.unpack(value)
        ns._owner_ids[owner] = len(ns._owners)
        ns._owners.append(owner)
    elif pid == S_XNAMES:
        ns._xname_ids[value] = len(ns._xnames)
        ns._xnames.append(value)
    elif pid == S_FREE:
        ns._free.frombytes(value)
    elif pid == S_DEAD:
        ns._deferred.append(key)
    elif pid == S_CHILDREN:
        d = ns._dirs.setdefault(key, _Dir())
        d.children.frombytes(value)
    elif pid == S_LINKS:
        links = ns._dirs.setdefault(key, _Dir()).links = {}
        pos = 0
        while pos < len(value):
            n, ino = _LINK.unpack_from(value, pos)
            pos += _LINK.size + n
            links[value[pos - n : pos]] = ino
            ns._extra.setdefault(ino, []).append((key, value[pos - n : pos]))
    elif pid == S_MAPS:
        half = len(value) // 2
        ns._maps[key] = (_array("q", value[:half]), _array("Q", value[half:]))
    elif pid == S_MULTI:
        ns._multi[key] = _array("Q", value)
    elif pid == S_BIGX:
        ns._big_xattrs[key] = value
    elif pid == S_AFREE:
        ns._arena.free[key] = _array("I", value)
    elif pid == S_BLOBS:
        name, _, data = value.partition(b"\0")
        ns.blobs[name.decode()] = data
    else:
        raise ValueError(f"unknown side table {pid}")
