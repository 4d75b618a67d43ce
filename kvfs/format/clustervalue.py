"""The cluster tier's value format (``docs/format.md``, "Cluster values"): the header
object of a file or directory kvfs publishes to Mooncake Store. Not device bytes, but
bytes another node (perhaps of another kvfs release) reads: versioned by its magic."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"KVFSCL01"
_HEADER = struct.Struct("<8sBBHIIIQQQ")  # magic kind 0 parts mode uid gid size mtime checksum
KIND_FILE, KIND_DIR = 1, 2
HEADER_SIZE = _HEADER.size


def pack_header(
    kind: int, parts: int, mode: int, uid: int, gid: int, size: int, mtime: int, data: bytes
) -> bytes:
    """The header object of a file (``data``: its whole content) or directory. The
    checksum covers the header's fields and every byte of the content."""
    fields = _HEADER.pack(MAGIC, kind, 0, parts, mode, uid, gid, size, mtime, 0)
    h = xxhash.xxh3_64(fields[:-8])
    h.update(data)
    return fields[:-8] + struct.pack("<Q", h.intdigest())


@dataclass(frozen=True)
class Header:
    kind: int
    parts: int
    mode: int
    uid: int
    gid: int
    size: int
    mtime: int
    checksum: int
    raw: bytes

    def verify(self, data: bytes) -> bool:
        h = xxhash.xxh3_64(self.raw[:-8])
        h.update(data)
        return len(data) == self.size and h.intdigest() == self.checksum


def unpack_header(raw: bytes) -> Header | None:
    if len(raw) != HEADER_SIZE:
        return None
    magic, kind, _, parts, mode, uid, gid, size, mtime, checksum = _HEADER.unpack(raw)
    if magic != MAGIC or kind not in (KIND_FILE, KIND_DIR):
        return None
    return Header(kind, parts, mode, uid, gid, size, mtime, checksum, raw)
