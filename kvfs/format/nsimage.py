"""The namespace's checkpoint image: its columns, arena and name index as raw chunk
bytes (loaded with ``array.frombytes``, no per-file decoding), plus side tables.

Every payload starts with a header ``<BBHI``: TAG (0xC5, never an op kind, so a
loader tells image parts from ``encode_ops`` payloads by the first byte), part kind,
part id, chunk index. Format in ``docs/format.md`` ("Namespace image").

Encoded from and decoded into the plain records of :mod:`kvfs.format.nsparts`
(:func:`image_payloads`, :func:`decode_part`): the index never shows its objects here.
"""

from __future__ import annotations

import re
import struct
from array import array
from collections.abc import Iterable, Iterator, Sequence

from kvfs.common.errors import Corruption
from kvfs.format.nsparts import (
    ARENA_CHUNK,
    COLUMN,
    COLUMNS,
    GRANULE,
    ROWS,
    SLOTS,
    ArenaChunks,
    ArenaFree,
    BigXattrs,
    Blobs,
    Chunks,
    DeadRows,
    FreeRows,
    Links,
    Listings,
    Meta,
    MultiMaps,
    NameFormsPart,
    Owners,
    Part,
    Snapshot,
    UnitMaps,
    XattrNames,
)

TAG = 0xC5
VERSION = 4
"""4: names may be kept by their form (side table 12, ``kvfs.index.nameforms``;
an image with no form in use is written as version 3); 3: column chunks in their
own item code (pid's high byte), atime and ctime as distances from mtime; 2 and 1
are read (full-width chunks, absolute times)."""
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
_FORM = struct.Struct("<IB")
"""A name form in side table 12 (key: its id): the entries that use it, its prefix's
length; then the prefix and the suffix."""
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
    S_FORMS,
) = range(1, 13)
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


def _side_tables(snap: Snapshot) -> tuple[list[bytes], Iterator[bytes]]:
    """The side tables: the small ones serialized now, and an iterator over the big
    ones, which reads only the frozen listings and multi-unit maps of ``snap``."""
    links = (
        (d, b"".join(_LINK.pack(len(n), i) + n for n, i in names.items()))
        for d, names in snap.links
    )
    maps = ((i, u.tobytes() + c.tobytes()) for i, (u, c) in snap.maps.items())
    parts = [
        *_pairs(S_OWNERS, ((i, _OWNER.pack(*o)) for i, o in enumerate(snap.owners))),
        *_pairs(S_XNAMES, enumerate(snap.xattr_names)),
        *_pairs(S_FORMS, ((i, _FORM.pack(n, len(p)) + p + s) for i, n, p, s in snap.name_forms)),
        *_pairs(S_FREE, [(0, snap.free.tobytes())]),
        *_pairs(S_DEAD, ((i, b"") for i in snap.dead)),
        *_pairs(S_LINKS, links),
        *_pairs(S_MAPS, maps),
        *_pairs(S_BIGX, snap.big_xattrs.items()),
        *_pairs(S_AFREE, ((g, a.tobytes()) for g, a in snap.arena_free.items())),
        *_pairs(S_BLOBS, ((0, k.encode() + b"\0" + v) for k, v in snap.blobs.items())),
    ]
    listings, multi = snap.listings, snap.multi

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


def _row_parts(columns: Sequence[Sequence[array[int]]], holey: list[int]) -> Iterator[bytes]:
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


def _decode_rows(body: bytes, coded: bool) -> Iterator[Chunks]:
    """K_ROWS (``coded`` False: every column at its declared code, versions 1-2)
    or K_CODED_ROWS records: per chunk, every column's chunk with those rows
    filled in (zero elsewhere)."""
    pos = 0
    while pos < len(body):
        c, runs, pos = _run_record(body, pos)
        live = sum(length for _, length in runs)
        if any(a + length > ROWS for a, length in runs):
            raise ValueError("row run past its chunk")
        if coded:
            codes = [CODES[k] for k in body[pos : pos + len(COLUMNS)]]
            pos += len(COLUMNS)
            if len(codes) != len(COLUMNS):
                raise ValueError("truncated row chunk")
        else:
            codes = [spec.code for spec in COLUMNS]
        for cid, code in enumerate(codes):
            itemsize = array(code).itemsize
            end = pos + live * itemsize
            if end > len(body):
                raise ValueError("truncated row chunk")
            values = array(code)
            values.frombytes(body[pos:end])
            pos = end
            chunk, done = array(code, bytes(ROWS * itemsize)), 0
            for a, length in runs:
                chunk[a : a + length] = values[done : done + length]
                done += length
            yield Chunks(COLUMN, cid, [(c, chunk)], not coded)


ARENA_GAP = re.compile(rb"[^\x00]+(?:\x00{1,15}[^\x00]+)*")
"""Non-zero runs of an arena chunk; gaps under 16 zero bytes stay inside a run."""


def _arena_parts(chunks: Sequence[bytearray]) -> Iterator[bytes]:
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


def _decode_arena_runs(body: bytes) -> ArenaChunks:
    out = []
    pos = 0
    while pos < len(body):
        c, runs, pos = _run_record(body, pos)
        chunk = bytearray(ARENA_CHUNK)
        for a, length in runs:
            if a + length > ARENA_CHUNK or pos + length > len(body):
                raise ValueError("arena run past its chunk")
            chunk[a : a + length] = body[pos : pos + length]
            pos += length
        out.append((c, bytes(chunk)))
    return ArenaChunks(out)


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


def image_payloads(snap: Snapshot) -> Iterator[bytes]:
    """An iterator over the image payloads of ``snap``: its small side tables are
    serialized now, its frozen chunks and big side tables as it is consumed."""
    version = VERSION if snap.name_forms else 3  # an earlier release reads a pool without forms
    meta = _META.pack(
        version, snap.next_ino, snap.live, snap.rows, *snap.table, 0, snap.arena_tail
    ) + _MIGRATION.pack(*snap.old_table, snap.cursor)
    columns = snap.columns
    codes = [spec.code for spec in COLUMNS]  # sparse records' item codes
    slots, old_slots, arena = snap.slots, snap.old_slots, snap.arena
    side, big_side = _side_tables(snap)

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


def decode_part(payload: bytes) -> list[Part]:
    """The records of one image payload (Corruption if it is not one)."""
    try:
        _tag, kind, pid, index = _HEAD.unpack_from(payload, 0)
        body = payload[_HEAD.size :]
        if kind == K_META:
            return [_decode_meta(body)]
        if kind in (K_COLUMN, K_SLOTS):
            target = COLUMN if kind == K_COLUMN else SLOTS
            declared = COLUMNS[pid & 0xFF].code if kind == K_COLUMN else "I"
            code = CODES[(pid >> 8) - 1] if pid >> 8 else ""  # "": version 1-2, full width
            step = ROWS * array(code or declared).itemsize
            chunks = [
                (index + i // step, _chunk(code or declared, body[i : i + step]))
                for i in range(0, len(body), step)
            ]
            return [Chunks(target, pid & 0xFF, chunks, not code)]
        if kind == K_ARENA:
            raws = [body[i : i + ARENA_CHUNK] for i in range(0, len(body), ARENA_CHUNK)]
            if raws and len(raws[-1]) != ARENA_CHUNK:
                raise ValueError(f"arena chunk of {len(raws[-1])} bytes")
            return [ArenaChunks([(index + k, raw) for k, raw in enumerate(raws)])]
        if kind in (K_ROWS, K_CODED_ROWS):
            return list(_decode_rows(body, kind == K_CODED_ROWS))
        if kind in (K_COLUMN | SPARSE, K_SLOTS | SPARSE):
            target = COLUMN if kind == K_COLUMN | SPARSE else SLOTS
            code = COLUMNS[pid].code if target == COLUMN else "I"
            zero = bytes(ROWS * array(code).itemsize)
            chunks = []
            for c, where, values in _sparse_chunks(body, code):
                items = _array(code, zero)
                _expand(where, values, items)
                chunks.append((c, items))
            return [Chunks(target, pid, chunks, True)]
        if kind == K_ARENA | SPARSE:
            return [_decode_arena_runs(body)]
        if kind == K_SIDE:
            return [_decode_side(pid, list(_unpairs(body)))]
        raise Corruption(f"unknown namespace image part {kind}")
    except (struct.error, ValueError, IndexError) as e:
        raise Corruption(f"namespace image part: {e}") from e


def _decode_meta(body: bytes) -> Meta:
    version, next_ino, live, rows, isize, iused, itombs, tail = _META.unpack_from(body)
    if version not in (1, 2, 3, VERSION):
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
    return Meta(version, next_ino, live, rows, (isize, iused), itombs, (osize, oused), cursor, tail)


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


def _chunk(code: str, raw: bytes) -> array[int]:
    """A whole column chunk of item code ``code`` from its bytes."""
    chunk = _array(code, raw)
    if len(chunk) != ROWS:
        raise ValueError(f"column chunk of {len(chunk)} rows")
    return chunk


def _links(value: bytes) -> list[tuple[bytes, int]]:
    out = []
    pos = 0
    while pos < len(value):
        n, ino = _LINK.unpack_from(value, pos)
        pos += _LINK.size + n
        out.append((value[pos - n : pos], ino))
    return out


def _form(fid: int, value: bytes) -> tuple[int, int, bytes, bytes]:
    """A name form: id, ``_FORM`` (entries that use it, prefix length), prefix,
    suffix."""
    count, n = _FORM.unpack_from(value)
    if _FORM.size + n > len(value):
        raise ValueError(f"name form of {len(value)} bytes with a {n}-byte prefix")
    return fid, count, value[_FORM.size : _FORM.size + n], value[_FORM.size + n :]


def _decode_side(pid: int, pairs: list[tuple[int, bytes]]) -> Part:
    if pid == S_OWNERS:
        return Owners([_OWNER.unpack(value) for _, value in pairs])
    if pid == S_XNAMES:
        return XattrNames([value for _, value in pairs])
    if pid == S_FORMS:
        return NameFormsPart([_form(key, value) for key, value in pairs])
    if pid == S_FREE:
        return FreeRows(_array("I", b"".join(value for _, value in pairs)))
    if pid == S_DEAD:
        return DeadRows([key for key, _ in pairs])
    if pid == S_CHILDREN:
        return Listings([(key, _array("I", value)) for key, value in pairs])
    if pid == S_LINKS:
        return Links([(key, _links(value)) for key, value in pairs])
    if pid == S_MAPS:
        maps = []
        for key, value in pairs:
            half = len(value) // 2
            maps.append((key, _array("q", value[:half]), _array("Q", value[half:])))
        return UnitMaps(maps)
    if pid == S_MULTI:
        return MultiMaps([(key, _array("Q", value)) for key, value in pairs])
    if pid == S_BIGX:
        return BigXattrs(pairs)
    if pid == S_AFREE:
        return ArenaFree([(key, _array("I", value)) for key, value in pairs])
    if pid == S_BLOBS:
        blobs = []
        for _, value in pairs:
            name, _, data = value.partition(b"\0")
            blobs.append((name.decode(), data))
        return Blobs(blobs)
    raise ValueError(f"unknown side table {pid}")
