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

import struct
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfs.policy.slots import NO_KEY

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
    (kind, image with only the lists that hold distinct keys), None if invalid."""
    kind = kind_of(data)
    if kind is None:
        return None
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


def _int64(column: array[int]) -> bytes:
    return (column if column.typecode == "q" else array("q", column)).tobytes()
