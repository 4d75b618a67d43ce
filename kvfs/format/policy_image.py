"""The persisted policy image: one versioned, checksummed byte string per policy.

Specified in ``docs/format.md`` ("Eviction policy image"); the evictor stores it as
the namespace blob ``eviction-policy`` and so it travels in every checkpoint.

Layout (little-endian)::

    header   <4sBBHqq  magic b"KVEP", version 1, policy kind, list count L,
                       clock, horizon                                    (24 B)
    L times  <q count n, then five int64 columns of n values each:
             key, size, predecessor key (-1: none), last use clock, flags
    ghosts   <q count g, then g int64 keys, then g int64 last use clocks
    crc      <I crc32 of everything before it

The lists appear in the policy's own order (oldest first within a list); the
meaning of "flags" and of the scalars is the policy's.  ``decode`` validates
everything (checksum, version, kind, lengths, negative or duplicate keys) and
raises ValueError before any state changes.
"""

from __future__ import annotations

import functools
import struct
import sys
import zlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

# -- the slot tables' geometry: what a version 2 image's rows and values mean ------------

SHIFT = 10
ROWS = 1 << SHIFT
"""Rows per column chunk: the unit of a column piece (and of the evictor's owner
column, :mod:`kvfs.format.owners`)."""
MASK = ROWS - 1
NO_KEY = -1
"""'No key' in key-valued columns (a predecessor, a successor, a free sparse slot)."""
FREE = -1
"""Owner of a slot that holds no key (the owner column's byte 0xFF)."""
LINK = "i"
"""Typecode of the link columns: int32, so a table holds at most 2**31 - 1 slots."""
DIRECT = 1 << 28
"""Keys below this are their own slot, ``key + lists`` (slots ``0 .. lists - 1``
are the lists' sentinels); other keys are listed in the head, their slots from
``direct + lists`` up. An image's ``direct`` is this, :data:`LEGACY_DIRECT`, or 0
(every key mapped: hashes, in the simulators)."""
LEGACY_DIRECT = 1 << 26
"""The direct key limit of releases before narrow chunks (2^26)."""
LADDERS = {"i": "bhiq", "I": "BHIq", "q": "bhiq"}
"""A policy column's nominal code -> the codes its chunks may take in a version 3
image, narrowest first (int64 on top)."""

FORMAT_VERSION = 1
MAGIC = b"KVEP"
HEADER = struct.Struct("<4sBBHqq")  # magic, version, kind, list count, clock, horizon
assert HEADER.size == 24
COUNT = struct.Struct("<q")
CRC = struct.Struct("<I")

KIND_LRU = 0
KIND_FIFO = 1
KIND_KVFS = 2
KIND_ADAPTIVE = 3
KIND_PREFIX_LRU = 4
ORDERS = {KIND_ADAPTIVE: 1}
"""Kinds whose last lists are other orders of the same keys (see ``decode``)."""

if TYPE_CHECKING:
    Columns = tuple[array[int], array[int], array[int], array[int], array[int]]
    """One persisted list: its key, size, predecessor, last use and flags columns."""


@dataclass(frozen=True)
class Image:
    """A validated ``persist()`` image: per list the columns (key, size, pred, last,
    flags), and the ghost keys with their last use."""

    clock: int
    horizon: int
    lists: list[Columns]
    ghost_keys: array[int]
    ghost_last: array[int]


class _Reader:
    """Bounds-checked sequential reader over a persisted image."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.offset = 0

    def take(self, size: int) -> bytes:
        if size < 0 or self.offset + size > len(self.data):
            raise ValueError("truncated policy image")
        chunk = self.data[self.offset : self.offset + size]
        self.offset += size
        return chunk

    def column(self, count: int) -> array[int]:
        values = array("q")
        values.frombytes(self.take(count * 8))
        return values

    def count(self) -> int:
        (value,) = COUNT.unpack(self.take(COUNT.size))
        if value < 0:
            raise ValueError("negative count in policy image")
        return int(value)


def decode(data: bytes, kind: int, lists: int, orders: int = 0) -> Image:
    """Validate and decode an image of policy ``kind`` with ``lists`` lists; raise
    ValueError on any defect (nothing is returned for a damaged image).  The last
    ``orders`` lists are other orders of the same keys (each holds every key of the
    others exactly once); keys are distinct across all other lists."""
    if len(data) < HEADER.size + CRC.size:
        raise ValueError("policy image too short")
    body, (crc,) = data[: -CRC.size], CRC.unpack(data[-CRC.size :])
    if zlib.crc32(body) != crc:
        raise ValueError("policy image checksum mismatch")
    reader = _Reader(body)
    magic, version, got_kind, got_lists, clock, horizon = HEADER.unpack(reader.take(HEADER.size))
    if magic != MAGIC or version != FORMAT_VERSION:
        raise ValueError(f"not a version {FORMAT_VERSION} policy image")
    if got_kind != kind or got_lists != lists:
        raise ValueError("policy image belongs to another policy")
    if clock < 0 or horizon < 0:
        raise ValueError("negative clock in policy image")
    columns = [_decode_list(reader) for _ in range(lists)]
    count = reader.count()
    decoded = Image(clock, horizon, columns, reader.column(count), reader.column(count))
    if reader.offset != len(body):
        raise ValueError("trailing bytes in policy image")
    _check_keys(decoded.lists[: lists - orders], decoded.ghost_keys)
    resident = sorted(key for kept in decoded.lists[: lists - orders] for key in kept[0])
    for order in decoded.lists[lists - orders :]:
        if sorted(order[0]) != resident:
            raise ValueError("policy image: an order does not hold the resident keys")
        _check_keys([order], array("q"))
    return decoded


def _decode_list(reader: _Reader) -> Columns:
    count = reader.count()
    keys, sizes, preds, lasts, flags = (reader.column(count) for _ in range(5))
    return keys, sizes, preds, lasts, flags


def _check_keys(lists: Sequence[Columns], ghost_keys: array[int]) -> None:
    # C-level checks (min, a set) first; the row loop only to name the bad key
    seen: set[int] = set()
    total = 0
    for keys, sizes, preds, _last, _flags in lists:
        if keys and (min(keys) < 0 or min(sizes) < 0 or min(preds) < NO_KEY):
            break
        seen.update(keys)
        total += len(keys)
    else:
        if len(seen) == total:
            if ghost_keys and min(ghost_keys) < 0:
                raise ValueError("bad ghost key in policy image")
            return
    seen.clear()
    for keys, sizes, preds, _last, _flags in lists:
        for key, size, pred in zip(keys, sizes, preds, strict=True):
            if key < 0 or size < 0 or pred < NO_KEY or key in seen:
                raise ValueError(f"bad or duplicate key {key} in policy image")
            seen.add(key)
    raise AssertionError("unreachable")  # pragma: no cover


def decode_any(data: bytes) -> tuple[int, Image] | None:
    """Decode an image of any kind (its header names kind and list count); return
    (kind, image with only the lists that hold distinct keys), None if invalid.
    Of a version 2 image only the keys and sizes are kept (the other columns 0)."""
    kind = kind_of(data)
    if kind is None:
        return None
    if version_of(data) in (VERSION2, VERSION3):
        return _decode_any_v2(data, kind)
    lists = int.from_bytes(data[6:8], "little")
    orders = ORDERS.get(kind, 0)
    try:
        decoded = decode(data, kind, lists, orders)
    except ValueError:
        return None
    kept = decoded.lists[: lists - orders]
    return kind, Image(decoded.clock, decoded.horizon, kept, decoded.ghost_keys, decoded.ghost_last)


def kind_of(data: bytes) -> int | None:
    """Return the policy kind an image's header names, None if it is no image at all
    (the rest is not validated: ``decode`` does that)."""
    if len(data) < HEADER.size or data[:4] != MAGIC:
        return None
    return int(data[5])


def encode(
    kind: int,
    clock: int,
    horizon: int,
    lists: Sequence[Columns],
    ghost_keys: array[int],
    ghost_last: array[int],
) -> bytes:
    """Encode an image: ``lists`` holds per list its five columns (any int typecode)."""
    parts = [HEADER.pack(MAGIC, FORMAT_VERSION, kind, len(lists), clock, horizon)]
    for columns in lists:
        parts.append(COUNT.pack(len(columns[0])))
        parts.extend(_int64(column) for column in columns)
    parts.append(COUNT.pack(len(ghost_keys)))
    parts.append(_int64(ghost_keys))
    parts.append(_int64(ghost_last))
    body = b"".join(parts)
    return body + CRC.pack(zlib.crc32(body))


_FLOAT, _FLOAT_BITS = struct.Struct("<d"), struct.Struct("<q")


def float_bits(x: float) -> int:
    """A float scalar as the int64 of its IEEE 754 bits (images hold int64 scalars)."""
    return int(_FLOAT_BITS.unpack(_FLOAT.pack(x))[0])


def bits_float(v: int) -> float:
    """The float whose bits ``float_bits`` gave."""
    return float(_FLOAT.unpack(_FLOAT_BITS.pack(v))[0])


def _int64(column: array[int]) -> bytes:
    return (column if column.typecode == "q" else array("q", column)).tobytes()


# -- version 2: the slot table's columns, in pieces ------------------------------------

VERSION2 = 2
PIECE = struct.Struct("<4sBBBBII")  # magic, version, kind, part, table, index, body length
"""Header of one version 2 piece; the piece ends with the crc32 of header and body.
``table``: which of the policy's slot tables the piece belongs to (0 until the
adaptive policy, which keeps one per expert, wrote 1 too)."""
PART_HEAD = 0
PART_COLUMN = 1
HEAD = struct.Struct("<HHHHIIIII")
"""Head body: slot lists, persisted lists, columns, scalars, sparse keys, free sparse
slots, highest chunk + 1, the direct key limit, whether it is decided; then the
column typecodes, per slot list its count, the scalars (int64), the sparse keys and
the free sparse slots (int64)."""
COLUMN = struct.Struct("<Bc")  # column number, typecode; then whole chunks' raw rows
BATCH_CHUNKS = 128
"""Chunks per column piece at most (512 KiB of an int32 column)."""
OWNER_COLUMN = 2
"""Columns 0 and 1 are the links (prev, next), 2 the owner (a list, or FREE), then
the policy's own."""


def version_of(data: bytes) -> int | None:
    """The format version an image's header names (None: no image)."""
    if len(data) < HEADER.size or data[:4] != MAGIC:
        return None
    return int(data[4])


VERSION3 = 3
"""Pieces as version 2, except that a column piece's chunks may be in any code of
their column's ladder (:data:`LADDERS`: the chunk's own, narrowest code)."""

Chunks = list["array[int] | None"]
"""A column as chunks of ROWS rows by chunk number (None: no chunk)."""


@dataclass
class TableImage:
    """One slot table of a version 2 image, as plain values: what ``encode_pieces``
    encodes and ``decode_pieces`` returns (validated). The evictor's slot table
    (``kvfs.evict.slots.SlotTable``) is built from one and gives one to encode."""

    lists: int
    """Slot lists (their sentinels are slots ``0 .. lists - 1``)."""
    persisted: int
    """Of them the resident ones (the first ``persisted``)."""
    codes: str
    """Every column's nominal typecode: ``"iib"`` (links, owner), then the policy's."""
    columns: list[Chunks]
    """Per column its chunks; a chunk's code is the column's, or with ``own_codes``
    one of its ladder's (:data:`LADDERS`)."""
    counts: list[int]
    """Keys per slot list."""
    scalars: list[int]
    sparse_keys: array[int]
    """Key of slot ``direct + lists + i`` (NO_KEY: a free slot), int64."""
    sparse_free: array[int]
    """The free sparse slots, int64."""
    direct: int
    decided: bool
    """Whether ``direct`` is settled (by the first key the table saw)."""
    own_codes: bool = True
    """The chunks are in their own codes (version 3); False: in their column's
    (version 2: the reader may narrow them)."""


def _piece(kind: int, part: int, index: int, body: bytes, number: int = 0) -> bytes:
    head = PIECE.pack(MAGIC, VERSION3, kind, part, number, index, len(body))
    return head + body + CRC.pack(zlib.crc32(body, zlib.crc32(head)))


def encode_pieces(kind: int, table: TableImage, number: int = 0) -> Iterator[bytes]:
    """Encode the head of ``table`` now and return an iterator over the pieces of
    its image: the head (geometry, list counts, scalars, sparse keys), then per
    column its chunks in batches. Chunks that hold no key (owner all free) are left
    out. The chunks must not change meanwhile (frozen: copy-on-write).
    ``number``: the table's number in a policy that keeps several (pieces' header)."""
    frozen = table.columns
    owner = frozen[OWNER_COLUMN]
    head = HEAD.pack(
        table.lists,
        table.persisted,
        len(frozen),
        len(table.scalars),
        len(table.sparse_keys),
        len(table.sparse_free),
        len(owner),
        table.direct,
        table.decided,
    )
    body = b"".join(
        (
            head,
            table.codes.encode(),
            array("q", table.counts).tobytes(),
            array("q", table.scalars).tobytes(),
            table.sparse_keys.tobytes(),
            table.sparse_free.tobytes(),
        )
    )

    def pieces() -> Iterator[bytes]:
        # O(chunks) scans here, as the pieces are consumed (off the event loop)
        empty = array("b", [FREE]) * ROWS
        keep = [c == 0 or (ch is not None and ch != empty) for c, ch in enumerate(owner)]
        last = max(c for c, kept in enumerate(keep) if kept)
        last_owners = owner[last]
        assert last_owners is not None
        last_rows = len(last_owners.tobytes().rstrip(bytes([FREE & 0xFF])))  # then no key
        yield _piece(kind, PART_HEAD, 0, body, number)
        for column, chunks in enumerate(frozen):
            batch: list[bytes] = []
            first, code = 0, ""
            for c, chunk in enumerate(chunks):
                if batch and (
                    chunk is None
                    or not keep[c]
                    or chunk.typecode != code
                    or len(batch) == BATCH_CHUNKS
                ):
                    yield _column_piece(kind, column, code, first, batch, number)
                    batch = []
                if chunk is None or not keep[c]:
                    continue
                if not batch:
                    first, code = c, chunk.typecode
                raw = chunk.tobytes()
                batch.append(raw if c != last else raw[: last_rows * chunk.itemsize])
            if batch:
                yield _column_piece(kind, column, code, first, batch, number)

    return pieces()


def _column_piece(
    kind: int, column: int, code: str, first: int, batch: list[bytes], number: int
) -> bytes:
    body = COLUMN.pack(column, code.encode()) + b"".join(batch)
    return _piece(kind, PART_COLUMN, first, body, number)


def split_pieces(data: bytes) -> list[bytes]:
    """Cut a joined version 2 image into its pieces (ValueError if it is none)."""
    pieces, pos = [], 0
    while pos < len(data):
        if pos + PIECE.size > len(data):
            raise ValueError("truncated policy image")
        n = PIECE.unpack_from(data, pos)[6]
        end = pos + PIECE.size + n + CRC.size
        if end > len(data):
            raise ValueError("truncated policy image")
        pieces.append(data[pos:end])
        pos = end
    return pieces


def _get(chunks: Chunks, i: int, default: int) -> int:
    """Row ``i`` of a column, ``default`` where no chunk holds it."""
    c = i >> SHIFT
    chunk = chunks[c] if c < len(chunks) else None
    return default if chunk is None else chunk[i & MASK]


def decode_pieces(
    pieces: Sequence[bytes],
    kind: int,
    lists: int | None = None,
    persisted: int | None = None,
    codes: Sequence[str] | None = None,
    number: int = 0,
) -> TableImage:
    """Validate version 2 pieces of policy ``kind`` (``lists`` slot lists of which
    ``persisted`` are resident ones, ``codes`` the policy's own column typecodes)
    and return table ``number`` of them (None: whatever the image says, for an
    image of another policy); ValueError on any defect. Only the pieces of table
    ``number`` are read (the others are checked for their framing and checksum
    only). The checks are C-level per chunk: checksums, geometry,
    every column's rows of every chunk with keys, owners, link ranges, list counts
    and sparse keys."""
    head_body: bytes | None = None
    columns: list[tuple[int, int, str, bytes]] = []
    versions = set()
    for piece in pieces:
        if len(piece) < PIECE.size + CRC.size:
            raise ValueError("policy image piece too short")
        magic, version, got_kind, part, got_number, index, n = PIECE.unpack_from(piece, 0)
        versions.add(version)
        if (
            magic != MAGIC
            or version not in (VERSION2, VERSION3)
            or len(versions) > 1
            or len(piece) != PIECE.size + n + CRC.size
        ):
            raise ValueError(f"not a version {VERSION2}-{VERSION3} policy image piece")
        body = piece[PIECE.size : PIECE.size + n]
        (crc,) = CRC.unpack_from(piece, PIECE.size + n)
        if zlib.crc32(body, zlib.crc32(piece[: PIECE.size])) != crc:
            raise ValueError("policy image checksum mismatch")
        if got_kind != kind:
            raise ValueError("policy image belongs to another policy")
        if got_number != number:
            continue
        if part == PART_HEAD:
            if head_body is not None:
                raise ValueError("policy image with two heads")
            head_body = body
        elif part == PART_COLUMN and len(body) >= COLUMN.size:
            col, code = COLUMN.unpack_from(body, 0)
            columns.append((col, index, code.decode(errors="replace"), body[COLUMN.size :]))
        else:
            raise ValueError("unknown policy image piece")
    if head_body is None:
        raise ValueError("policy image without its head")
    if len(head_body) < HEAD.size:
        raise ValueError("truncated policy image head")
    got_lists, got_persisted, ncols, nscalars, nsparse, nfree, nchunks, direct, decided = (
        HEAD.unpack_from(head_body, 0)
    )
    if lists is None or persisted is None or codes is None:
        lists, persisted = got_lists, got_persisted
        codes = head_body[HEAD.size + 3 : HEAD.size + ncols].decode(errors="replace")
    if got_lists != lists or got_persisted != persisted or ncols != len(codes) + 3:
        raise ValueError("policy image belongs to another policy")
    if not 0 < persisted <= lists or not set(codes) <= set("bBiIq"):
        raise ValueError("bad policy image head")
    pos = HEAD.size
    want = HEAD.size + ncols + 8 * (lists + nscalars + nsparse + nfree)
    if len(head_body) != want:
        raise ValueError("policy image head of the wrong length")
    got_codes = head_body[pos : pos + ncols].decode(errors="replace")
    pos += ncols
    if got_codes[:3] != LINK * 2 + "b" or any(
        got not in (want, "q") for want, got in zip(codes, got_codes[3:], strict=True)
    ):
        raise ValueError("policy image columns of the wrong types")

    def take(count: int) -> array[int]:
        nonlocal pos
        values = array("q")
        values.frombytes(head_body[pos : pos + 8 * count])
        pos += 8 * count
        return values

    counts, scalars, sparse_keys, sparse_free = (
        take(lists),
        take(nscalars),
        take(nsparse),
        take(nfree),
    )
    ladders = ["", "", "", *(LADDERS[code] for code in codes)]  # (the links' and owner's: none)
    if direct not in (0, LEGACY_DIRECT, DIRECT) or decided > 1 or (direct == 0 and not decided):
        raise ValueError("bad key geometry in policy image")
    sparse_base = direct + lists
    coded = versions == {VERSION3}
    chunks: list[Chunks] = [[] for _ in range(ncols)]
    loaded: set[tuple[int, int]] = set()
    for col, first, code, raw in columns:
        if col >= ncols or code not in "bBhHiIq":
            raise ValueError("bad column in policy image")
        if code != got_codes[col] and not (coded and code in ladders[col]):
            raise ValueError("bad column in policy image")
        if col == OWNER_COLUMN and code != "b":
            raise ValueError("bad owner column in policy image")
        size = array(code).itemsize
        step = ROWS * size
        if not raw or len(raw) % size or first + -(-len(raw) // step) > nchunks:
            raise ValueError("bad column chunk in policy image")
        fill = FREE if col == OWNER_COLUMN else 0
        column = chunks[col]
        for i in range(0, len(raw), step):  # the last chunk may end early (no keys after)
            chunk = array(code)
            chunk.frombytes(raw[i : i + step])
            if len(chunk) < ROWS:
                chunk.extend(array(code, [fill]) * (ROWS - len(chunk)))
            c = first + i // step
            if c >= len(column):
                column.extend([None] * (c + 1 - len(column)))
            column[c] = chunk
            loaded.add((col, c))
    owner, prev, nxt = chunks[OWNER_COLUMN], chunks[0], chunks[1]
    rows = nchunks * ROWS
    if rows > 1 << 31:  # links are int32 slots
        raise ValueError("bad geometry in policy image")
    if nchunks == 0 or len(owner) > nchunks or (nsparse and sparse_base + nsparse > rows):
        raise ValueError("bad geometry in policy image")
    allowed = bytes(range(lists)) + bytes([FREE & 0xFF])
    found = [0] * lists
    for c in range(max(len(owner), 1)):
        owners = owner[c] if c < len(owner) else None
        if owners is None and c:
            continue
        if any((col, c) not in loaded for col in range(ncols)):  # every column's rows
            raise ValueError("policy image: a column misses a chunk")
        assert owners is not None
        raw = owners.tobytes()
        tail = sparse_base + nsparse - (c << SHIFT)  # rows from here on hold no key
        if tail < ROWS and raw[max(tail, 0) :].translate(None, bytes([FREE & 0xFF])):
            raise ValueError("policy image: a slot beyond the keys has an owner")
        if raw.translate(None, allowed):
            raise ValueError("bad list owner in policy image")
        for lst in range(lists):
            found[lst] += raw.count(lst)
        for links in (prev[c], nxt[c]):
            assert links is not None
            if not _links_below(links, rows):
                raise ValueError("bad link in policy image")
    for lst in range(lists):
        if _get(owner, lst, FREE) != lst:
            raise ValueError("bad list head in policy image")
        found[lst] -= 1  # the sentinel
    if found != list(counts):
        raise ValueError("policy image list counts do not match its owners")
    live = [key for key in sparse_keys if key != NO_KEY]
    if len(set(live)) != len(live) or any(key < direct for key in live):
        raise ValueError("bad sparse key in policy image")
    for i, key in enumerate(sparse_keys):
        if (key == NO_KEY) != (_get(owner, sparse_base + i, FREE) == FREE):
            raise ValueError("policy image: a sparse slot's key and owner disagree")
    if not set(sparse_free) <= {sparse_base + i for i, k in enumerate(sparse_keys) if k == NO_KEY}:
        raise ValueError("bad free sparse slot in policy image")
    return TableImage(
        lists,
        persisted,
        LINK * 2 + "b" + "".join(codes),
        chunks,
        list(counts),
        list(scalars),
        sparse_keys,
        sparse_free,
        direct,
        bool(decided),
        coded,
    )


@functools.cache
def _lanes(n: int, lane: int) -> int:
    """``lane`` in each of ``n`` 32-bit lanes of one little-endian integer."""
    return int.from_bytes(lane.to_bytes(4, "little") * n, "little")


def _links_below(links: array[int], rows: int) -> bool:
    """Whether every int32 of ``links`` is in ``0 .. rows - 1`` (``rows <= 2**31``),
    at C speed: the array as one integer of 32-bit lanes, a lane is negative iff
    its bit 31 is set, and ``v + 2**31 - rows`` (no carry out of a lane for
    ``0 <= v < 2**31``) sets bit 31 iff ``v >= rows``."""
    value = int.from_bytes(links.tobytes(), sys.byteorder)
    signs = _lanes(len(links), 1 << 31)
    return not value & signs and not (value + _lanes(len(links), (1 << 31) - rows)) & signs


def _list_slots(table: TableImage, lst: int) -> list[int]:
    """The slots of one list of a decoded table, oldest first."""
    nxt = table.columns[1]
    out: list[int] = []
    slot = nxt[lst >> SHIFT][lst & MASK]  # type: ignore[index]
    while slot != lst:
        out.append(slot)
        slot = nxt[slot >> SHIFT][slot & MASK]  # type: ignore[index]
    return out


def _decode_any_v2(data: bytes, kind: int) -> tuple[int, Image] | None:
    try:
        table = decode_pieces(split_pieces(data), kind)
    except ValueError:
        return None
    lists: list[Columns] = []
    sparse_base = table.direct + table.lists
    size = table.columns[3]
    for lst in range(table.persisted):
        slots = _list_slots(table, lst)
        n = len(slots)
        zeros = array("q", [0]) * n
        keys = array(
            "q",
            (
                s - table.lists if s < sparse_base else table.sparse_keys[s - sparse_base]
                for s in slots
            ),
        )
        sizes = array("q", (size[s >> SHIFT][s & MASK] for s in slots))  # type: ignore[index]
        lists.append((keys, sizes, array("q", [NO_KEY]) * n, zeros, zeros))
    return kind, Image(table.scalars[0], table.scalars[1], lists, array("q"), array("q"))
