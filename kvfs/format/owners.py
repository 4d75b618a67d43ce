"""The evictor's checkpoint payloads: which process last opened each file, and
the blobs of older pools (``docs/format.md``, "Evictor payloads").

Pure: bytes in, bytes out. An evictor payload is ``EVICTOR_TAG``, a part byte
(``PART_POLICY``: a policy image piece, :mod:`kvfs.format.policy_image`;
``PART_OWNERS``: an owners piece, here), then the piece.
"""

from __future__ import annotations

import struct
import zlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvfs.format.policy_image import MASK, ROWS, SHIFT

POLICY_BLOB = "eviction-policy"
"""Blob of the version 1 policy image (pools written before the evictor's own
checkpoint payloads): read once at mount, then dropped."""
OWNERS_BLOB = "file-owners"
"""(inode, pid, process start time) triples, int64: who last opened each file
(pools written before the evictor's own checkpoint payloads)."""
PART_POLICY = b"P"
"""Evictor checkpoint payload: ``EVICTOR_TAG``, this byte, a policy image piece."""
PART_OWNERS = b"O"
"""Evictor checkpoint payload: ``EVICTOR_TAG``, this byte, an owners piece."""
OWNERS_PIECE = struct.Struct("<BII")  # 0: process table, 1: column chunks; index; count
MAX_PROCESSES = 0xFFFF
"""Processes owning files at once (a file's owner is a uint16 process number)."""
BATCH = 64
"""Owner column chunks per piece (128 KiB)."""

Process = tuple[int, int]
"""(pid, process start time)."""


@dataclass(frozen=True)
class Owners:
    """Decoded owners: the process table (``procs[n]`` is process number ``n``; 0 and
    freed numbers: None) and the owner column, a uint16 process number per inode
    (0: none) in chunks of ``ROWS`` rows by chunk number (None: no chunk)."""

    procs: list[Process | None]
    chunks: list[array[int] | None]


def _piece(part: int, index: int, count: int, raw: bytes) -> bytes:
    body = OWNERS_PIECE.pack(part, index, count) + raw
    return body + struct.pack("<I", zlib.crc32(body))


def _uint16(chunk: array[int]) -> bytes:
    """A chunk's rows as the image keeps them, two bytes each (the daemon keeps a
    chunk whose numbers are under 256 a byte a row)."""
    return (chunk if chunk.typecode == "H" else array("H", chunk)).tobytes()


def encode(procs: Sequence[Process | None], owners: Sequence[array[int] | None]) -> Iterator[bytes]:
    """Owners pieces: the process table (``procs[n]`` is process number ``n``), then
    the uint16 owner column's non-zero chunks in runs of at most ``BATCH``, the last
    chunk cut after its last owner. O(chunks), as the pieces are consumed."""
    table = array("q")
    for proc in procs:
        table.extend((-1, 0) if proc is None else proc)
    yield _piece(0, 0, len(procs), table.tobytes())
    used = [c for c, ch in enumerate(owners) if ch is not None and ch.count(0) != len(ch)]
    if not used:
        return
    last = used[-1]
    tail = _uint16(owners[last]).rstrip(b"\0")  # type: ignore[arg-type]
    batch: list[bytes] = []
    first = previous = used[0]
    for c in used:
        if batch and (c != previous + 1 or len(batch) == BATCH):
            yield _piece(1, first, len(batch), b"".join(batch))
            batch = []
        if not batch:
            first = c
        raw = _uint16(owners[c])  # type: ignore[arg-type]
        batch.append(raw if c != last else raw[: len(tail) + (len(tail) & 1)])
        previous = c
    yield _piece(1, first, len(batch), b"".join(batch))


def decode(pieces: list[bytes]) -> Owners:
    """Decode owners pieces. ValueError if a piece is damaged or an owner is not in
    the process table."""
    procs_: list[Process | None] | None = None
    chunks: list[array[int] | None] = []
    for piece in pieces:
        if len(piece) < OWNERS_PIECE.size + 4:
            raise ValueError("owners piece too short")
        body, (crc,) = piece[:-4], struct.unpack("<I", piece[-4:])
        if zlib.crc32(body) != crc:
            raise ValueError("owners piece checksum mismatch")
        part, index, count = OWNERS_PIECE.unpack_from(body, 0)
        raw = body[OWNERS_PIECE.size :]
        if part == 0:
            pairs = array("q")
            pairs.frombytes(raw)
            if len(pairs) != 2 * count:
                raise ValueError("bad owners table")
            procs_ = [
                None if pairs[2 * i] < 0 else (pairs[2 * i], pairs[2 * i + 1]) for i in range(count)
            ]
        elif part == 1 and -(-len(raw) // (ROWS * 2)) == count and not len(raw) & 1:
            if index + count > len(chunks):
                chunks.extend([None] * (index + count - len(chunks)))
            for k in range(count):  # the last chunk may end early (zeros after)
                chunk = array("H")
                chunk.frombytes(raw[k * ROWS * 2 : (k + 1) * ROWS * 2])
                chunk.extend(array("H", [0]) * (ROWS - len(chunk)))
                chunks[index + k] = chunk
        else:
            raise ValueError("bad owners piece")
    if procs_ is None:
        raise ValueError("owners without their process table")
    for owners in chunks:
        if owners is not None and max(owners) >= len(procs_):
            raise ValueError("owner beyond the process table")
    return Owners(procs_, chunks)


def decode_blob(raw: bytes) -> Owners:
    """Decode an ``OWNERS_BLOB`` (older pools). ValueError if it is malformed."""
    if len(raw) % 24:
        raise ValueError("bad owners blob")
    cols = array("q")
    cols.frombytes(raw)
    procs_: list[Process | None] = [None]
    numbers: dict[Process, int] = {}
    chunks: list[array[int] | None] = []
    for i in range(0, len(cols), 3):
        ino, proc = cols[i], (cols[i + 1], cols[i + 2])
        if not 0 <= ino < 1 << 40 or len(numbers) >= MAX_PROCESSES:
            raise ValueError("bad owners blob")
        number = numbers.get(proc)
        if number is None:
            number = numbers[proc] = len(procs_)
            procs_.append(proc)
        c = ino >> SHIFT
        if c >= len(chunks):
            chunks.extend([None] * (c + 1 - len(chunks)))
        chunk = chunks[c]
        if chunk is None:
            chunk = chunks[c] = array("H", [0]) * ROWS
        chunk[ino & MASK] = number
    return Owners(procs_, chunks)
