"""The namespace's checkpoint image: its columns, arena and name index as raw chunk
bytes (loaded with ``array.frombytes``, no per-file decoding), plus side tables.

Every payload starts with a header ``<BBHI``: TAG (0xC5, never an op kind, so a
loader tells image parts from ``encode_ops`` payloads by the first byte), part kind,
part id, chunk index. Format in ``docs/format.md`` ("Namespace image").
"""

from __future__ import annotations

import re
import struct
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvfs.common.errors import Corruption
from kvfs.index.columns import ARENA_CHUNK, GRANULE, ROWS

if TYPE_CHECKING:
    from kvfs.index.namespace import Namespace

TAG = 0xC5
VERSION = 3
"""3: column chunks in their own item code (pid's high byte), atime and ctime as
distances from mtime; 2 and 1 are read (full-width chunks, absolute times)."""
CODES = "BHIQbhiq"
"""A dense column part's item code is ``CODES[(pid >> 8) - 1]`` (version 3)."""
_HEAD = struct.Struct("<BBHI")
_META = struct.Struct("<IQQQQQQQ")
_MIGRATION = struct.Struct("<QQQ")
"""Appended to META since version 2: the name index's old table while it is being
migrated (slots, 0: none; used; cursor)."""
XATTR_SET_LEN = struct.Struct("<H")
"""An xattr set in the arena: its length, then ``XATTR_HEAD`` + value per xattr."""
XATTR_HEAD = struct.Struct("<HH")  # xattr name id, value length (arena sets are < 4 KiB)
BIG_XATTR_HEAD = struct.Struct("<HI")  # the same in the big-xattr side table
_PAIR = struct.Struct("<QI")
_OWNER = struct.Struct("<II")
_LINK = struct.Struct("<BI")

K_META, K_COLUMN, K_SLOTS, K_ARENA, K_SIDE, K_ROWS, K_CODED_ROWS = 1, 2, 3, 4, 5, 6, 7
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
        elif len(batch) % (16 * SCAN_STEP) == 0:
            yield PAUSE
    if batch:
        yield _part(K_SIDE, pid, 0, b"".join(batch))


PAUSE = b""
"""An empty payload: a bounded step of a scan that produced nothing yet (consumers
skip it; the checkpoint writer answers requests meanwhile)."""
SCAN_STEP = 256
"""Chunks (or side-table entries, x16) one step may scan without yielding: ~1 ms."""


def _side_tables(ns: Namespace) -> tuple[list[bytes], Iterator[bytes]]:
    """The side tables: the small ones serialized now, and an iterator over the big
    ones, which reads only what this call froze: every directory's listing
    (copy-on-write, ``_Dir.shared``) and the contiguous maps' checksum arrays (a
    map is replaced, never changed in place). O(directories + files with a
    contiguous multi-unit map) here, the bytes later, in bounded steps."""
    for state in ns._dirs.values():
        state.shared = True
    listings = [(d, state.children) for d, state in ns._dirs.items()]
    multi = list(ns._multi.items())
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
        *_pairs(S_LINKS, links),
        *_pairs(S_MAPS, ((i, u.tobytes() + c.tobytes()) for i, (u, c) in ns._maps.items())),
        *_pairs(S_BIGX, ns._big_xattrs.items()),
        *_pairs(S_AFREE, ((g, a.tobytes()) for g, a in ns._arena.free.items())),
        *_pairs(S_BLOBS, ((0, k.encode() + b"\0" + v) for k, v in ns.blobs.items())),
    ]

    def later() -> Iterator[bytes]:
        yield from _pairs(S_CHILDREN, ((d, a.tobytes()) for d, a in listings))
        yield from _pairs(S_MULTI, ((i, c.tobytes()) for i, c in multi))

    return parts, later()


BATCH = 1 << 20
"""Chunk payloads carry consecutive chunks up to about this many bytes."""


_SPARSE_REC = struct.Struct("<IH")
SPARSE = 0x80
"""Part-kind flag: the body is sparse chunk records, not consecutive dense chunks."""


def _sparse_record(c: int, items: array[int], live: int, code: str) -> bytes:
    """Chunk ``c`` as ``<IH`` (chunk, n), n ``H`` positions, n values (``code``)."""
    where = array("H", (i for i, v in enumerate(items) if v))
    values = array(code, (items[i] for i in where))
    assert len(where) == live
    return _SPARSE_REC.pack(c, live) + where.tobytes() + values.tobytes()


def _chunk_parts(
    kind: int,
    pid: int,
    chunks: Sequence[array[int] | bytearray],
    skip: frozenset[int] = frozenset(),
    sparse_items: bool = True,
    code: str = "",
) -> Iterator[bytes]:
    """Payloads of the non-zero chunks not in ``skip``: runs of consecutive dense
    chunks of one item code as their raw bytes (the code in the part id's high
    byte), and chunks mostly zero (empty slots, columns most files leave 0) as
    sparse records of their non-zero items at the column's declared ``code`` (a
    loaded chunk starts zeroed). Zero bytes are counted at C speed; items only
    where the bytes say the chunk may be sparse."""
    batch: list[bytes] = []
    sparse: list[bytes] = []
    first = size = sparse_size = 0
    batch_code = ""
    declared = array(code).itemsize if code else GRANULE  # sparse records' item size
    for c, chunk in enumerate(chunks):
        if c % SCAN_STEP == SCAN_STEP - 1:
            yield PAUSE
        raw = b"" if c in skip else chunk.tobytes() if isinstance(chunk, array) else bytes(chunk)
        itemsize = chunk.itemsize if isinstance(chunk, array) else GRANULE
        n = len(raw) // itemsize
        # runs of itemsize zero bytes, counted without overlap: at least the zero items
        zeros = raw.count(bytes(itemsize))
        live = -1  # not counted
        if raw and zeros < n and sparse_items and isinstance(chunk, array):
            most = (ROWS * declared // 2 - _SPARSE_REC.size - 1) // (declared + 2)
            if zeros >= n - most:  # enough zero runs for a sparse chunk
                live = n - chunk.count(0)
                if live > most:
                    live = -1
                else:
                    record = _sparse_record(c, chunk, live, code)
                    sparse.append(record)
                    sparse_size += len(record)
                    if sparse_size >= BATCH:
                        yield _part(kind | SPARSE, pid, 0, b"".join(sparse))
                        sparse, sparse_size = [], 0
        chunk_code = chunk.typecode if isinstance(chunk, array) else ""
        if batch and (not raw or zeros == n or live >= 0 or chunk_code != batch_code):
            yield _part(kind, _coded(pid, batch_code), first, b"".join(batch))  # a run ends
            batch, size = [], 0
        if not raw or zeros == n or live >= 0:
            continue
        if not batch:
            first, batch_code = c, chunk_code
        batch.append(raw)
        size += len(raw)
        if size >= BATCH:
            yield _part(kind, _coded(pid, batch_code), first, b"".join(batch))
            batch, size = [], 0
    if batch:
        yield _part(kind, _coded(pid, batch_code), first, b"".join(batch))
    if sparse:
        yield _part(kind | SPARSE, pid, 0, b"".join(sparse))


def _coded(pid: int, code: str) -> int:
    """A dense part's id: ``pid`` with the item code of its chunks (none: bytes)."""
    return pid | (CODES.index(code) + 1) << 8 if code else pid


_ROWS_REC = struct.Struct("<IH")
_RUN = struct.Struct("<HH")


def _live_runs(modes: array[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of rows with a mode (live, or dropped but still
    named by a view) in a column chunk; every other row is zero in every column."""
    runs: list[tuple[int, int]] = []
    start = -1
    for i, m in enumerate(modes):
        if m:
            if start < 0:
                start = i
        elif start >= 0:
            runs.append((start, i))
            start = -1
    if start >= 0:
        runs.append((start, len(modes)))
    return runs


def _row_parts(columns: list[list[array[int]]], holey: list[int]) -> Iterator[bytes]:
    """K_CODED_ROWS payloads: each chunk with free rows as ``<IH`` (chunk, runs), the
    runs ``<HH`` (start, length), a byte per persisted column (its item code there:
    ``CODES`` index), then every column's values of those rows in column order. So
    a checkpoint holds live rows only: evictions shrink it."""
    batch: list[bytes] = []
    size = 0
    for i, c in enumerate(holey):
        if i % 16 == 15:  # a Python pass over a chunk's rows: ~50 us each
            yield PAUSE
        runs = _live_runs(columns[0][c])
        if not runs:
            continue
        parts = [_ROWS_REC.pack(c, len(runs)), *(_RUN.pack(a, b - a) for a, b in runs)]
        parts.append(bytes(CODES.index(col[c].typecode) for col in columns))
        for col in columns:
            chunk = col[c]
            parts.extend(chunk[a:b].tobytes() for a, b in runs)
        record = b"".join(parts)
        batch.append(record)
        size += len(record)
        if size >= BATCH:
            yield _part(K_CODED_ROWS, 0, 0, b"".join(batch))
            batch, size = [], 0
    if batch:
        yield _part(K_CODED_ROWS, 0, 0, b"".join(batch))


def _run_record(body: bytes, pos: int) -> tuple[int, list[tuple[int, int]], int]:
    """The ``<IH`` (chunk, r) header and r ``<HH`` runs of a record at ``pos``:
    (chunk, runs, where the record's data starts)."""
    c, n = _ROWS_REC.unpack_from(body, pos)
    pos += _ROWS_REC.size
    runs = [_RUN.unpack_from(body, pos + i * _RUN.size) for i in range(n)]
    return c, runs, pos + n * _RUN.size


def _load_rows(ns: Namespace, body: bytes, coded: bool) -> None:
    """K_ROWS (``coded`` False: every column at its declared code, versions 1-2)
    or K_CODED_ROWS records."""
    columns = ns.persisted_columns
    pos = 0
    while pos < len(body):
        c, runs, pos = _run_record(body, pos)
        live = sum(length for _, length in runs)
        if any(a + length > ROWS for a, length in runs):
            raise ValueError("row run past its chunk")
        if coded:
            codes = [CODES[k] for k in body[pos : pos + len(columns)]]
            pos += len(columns)
        else:
            codes = [col.code for col in columns]
        for col, code in zip(columns, codes, strict=True):
            itemsize = array(code).itemsize
            end = pos + live * itemsize
            if end > len(body):
                raise ValueError("truncated row chunk")
            values = array(code)
            values.frombytes(body[pos:end])
            pos = end
            chunk, done = col.load_chunk(c, bytes(ROWS * itemsize), code), 0
            for a, length in runs:
                chunk[a : a + length] = values[done : done + length]
                done += length
            if not coded:
                col.narrow(c)


ARENA_GAP = re.compile(rb"[^\x00]+(?:\x00{1,15}[^\x00]+)*")
"""Non-zero runs of an arena chunk; gaps under 16 zero bytes stay inside a run."""


def _arena_parts(chunks: list[bytearray]) -> Iterator[bytes]:
    """The arena: chunks without a gap of 16 zero bytes as raw chunks (K_ARENA),
    the others (released names, the unused tail) as ``<IH`` (chunk, runs), the runs
    ``<HH`` (offset, length), their bytes (K_ARENA | SPARSE)."""
    gap = bytes(16)
    found = []
    for c, chunk in enumerate(chunks):
        if c % SCAN_STEP == SCAN_STEP - 1:
            yield PAUSE
        if gap in chunk:
            found.append(c)
    holey = frozenset(found)
    yield from _chunk_parts(K_ARENA, 0, chunks, holey, sparse_items=False)
    batch: list[bytes] = []
    size = 0
    for i, c in enumerate(found):
        if i % 16 == 15:
            yield PAUSE
        runs = [(m.start(), m.end()) for m in ARENA_GAP.finditer(chunks[c])]
        if not runs:
            continue
        record = b"".join(
            [
                _ROWS_REC.pack(c, len(runs)),
                *(_RUN.pack(a, b - a) for a, b in runs),
                *(bytes(chunks[c][a:b]) for a, b in runs),
            ]
        )
        batch.append(record)
        size += len(record)
        if size >= BATCH:
            yield _part(K_ARENA | SPARSE, 0, 0, b"".join(batch))
            batch, size = [], 0
    if batch:
        yield _part(K_ARENA | SPARSE, 0, 0, b"".join(batch))


def _load_arena_runs(ns: Namespace, body: bytes) -> None:
    pos = 0
    while pos < len(body):
        c, runs, pos = _run_record(body, pos)
        chunk = bytearray(ARENA_CHUNK)
        for a, length in runs:
            if a + length > ARENA_CHUNK or pos + length > len(body):
                raise ValueError("arena run past its chunk")
            chunk[a : a + length] = body[pos : pos + length]
            pos += length
        ns._arena.load_chunk(c, bytes(chunk))


def _sparse_chunks(body: bytes, code: str) -> Iterator[tuple[int, array[int], array[int]]]:
    """(chunk, positions, values) of each sparse record in ``body``."""
    itemsize = array(code).itemsize
    pos = 0
    while pos < len(body):
        c, n = _SPARSE_REC.unpack_from(body, pos)
        pos += _SPARSE_REC.size
        where, values = array("H"), array(code)
        where.frombytes(body[pos : pos + 2 * n])
        pos += 2 * n
        values.frombytes(body[pos : pos + itemsize * n])
        pos += itemsize * n
        if len(values) != n:
            raise ValueError("truncated sparse chunk")
        yield c, where, values


def _expand(where: array[int], values: array[int], items: array[int]) -> None:
    for i, v in zip(where, values, strict=True):
        items[i] = v


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
    codes = [col.code for col in ns.persisted_columns]  # sparse records' item codes
    slots, old_slots = index.freeze()
    arena = ns._arena.freeze()
    side, big_side = _side_tables(ns)

    def parts() -> Iterator[bytes]:
        yield _part(K_META, 0, 0, meta)
        # a mode always has file-type bits in its high byte: a row is free exactly
        # when that byte is 0 (counted at C speed over the little-endian 'H' bytes)
        holey = []
        for c, chunk in enumerate(columns[0]):
            if c % SCAN_STEP == SCAN_STEP - 1:
                yield PAUSE
            if chunk.tobytes()[1::2].count(0):
                holey.append(c)
        skip = frozenset(holey)
        for cid, chunks in enumerate(columns):
            yield from _chunk_parts(K_COLUMN, cid, chunks, skip, code=codes[cid])
        yield from _row_parts(columns, holey)
        yield from _chunk_parts(K_SLOTS, 0, slots, code="I")
        yield from _chunk_parts(K_SLOTS, 1, old_slots, code="I")
        yield from _arena_parts(arena)
        yield from side
        yield from big_side

    return parts()


def load_part(ns: Namespace, payload: bytes) -> None:
    """Load one image payload into a namespace being recovered."""
    try:
        _tag, kind, pid, index = _HEAD.unpack_from(payload, 0)
        body = payload[_HEAD.size :]
        if kind == K_META:
            _load_meta(ns, body)
        elif kind in (K_COLUMN, K_SLOTS):
            col = (
                ns.persisted_columns[pid & 0xFF]
                if kind == K_COLUMN
                else ns._index.part_table(pid & 0xFF).slots
            )
            code = CODES[(pid >> 8) - 1] if pid >> 8 else ""  # "": version 1-2, full width
            step = ROWS * array(code or col.code).itemsize
            for i in range(0, len(body), step):
                col.load_chunk(index + i // step, body[i : i + step], code)
        elif kind == K_ARENA:
            for i in range(0, len(body), ARENA_CHUNK):
                ns._arena.load_chunk(index + i // ARENA_CHUNK, body[i : i + ARENA_CHUNK])
        elif kind in (K_ROWS, K_CODED_ROWS):
            _load_rows(ns, body, kind == K_CODED_ROWS)
        elif kind == K_COLUMN | SPARSE or kind == K_SLOTS | SPARSE:
            col = (
                ns.persisted_columns[pid]
                if kind == K_COLUMN | SPARSE
                else ns._index.part_table(pid).slots
            )
            zero = bytes(ROWS * array(col.code).itemsize)
            for c, where, values in _sparse_chunks(body, col.code):
                _expand(where, values, col.load_chunk(c, zero, col.code))
                col.narrow(c)
        elif kind == K_ARENA | SPARSE:
            _load_arena_runs(ns, body)
        elif kind == K_SIDE:
            for key, value in _unpairs(body):
                _load_side(ns, pid, key, value)
        else:
            raise Corruption(f"unknown namespace image part {kind}")
    except (struct.error, ValueError, IndexError) as e:
        raise Corruption(f"namespace image part: {e}") from e


def _load_meta(ns: Namespace, body: bytes) -> None:
    version, next_ino, live, rows, isize, iused, itombs, tail = _META.unpack_from(body)
    if version not in (1, 2, VERSION):
        raise Corruption(f"namespace image version {version} (this release reads 1 to {VERSION})")
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
    ns._absolute_times = version < 3
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
    from kvfs.index.namespace import _Dir

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
