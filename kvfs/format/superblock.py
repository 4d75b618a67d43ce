"""The superblock and the member table (``docs/format.md``, "Superblock").

Pure: encode/decode only, no I/O. ``FORMAT_VERSION`` is the pool format's version;
any change to these records bumps it. Also the signatures of other formats that
``kvfs format`` refuses to overwrite without ``--force``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from kvfs.common.errors import Corruption

FORMAT_VERSION = 2
"""Version of the pool format (the superblock); version 1 pools are still read."""
SB_MAGIC = b"KVFSPOOL"
SB_BLOCK = 4096
RESERVED_HEAD = 1 << 20
"""Bytes at the start of every device before the first unit (superblock lives at 0)."""
MAX_MEMBERS = 64
"""Devices a pool may have: the member table of every superblock lists them all."""

_SB = struct.Struct("<8sII16s16sIIIIQQQQQQQ32s")
assert _SB.size == 152
_SB_CSUM = struct.Struct("<Q")
_SB2 = struct.Struct(_SB.format + "Q")
"""Version 2: the version-1 fields (same offsets), then the backup copy's offset."""
assert _SB2.size == 160
_MEMBER = struct.Struct("<16sQQQ")
assert _MEMBER.size == 40
_SB2_CSUM_AT = SB_BLOCK - _SB_CSUM.size
assert _SB2.size + MAX_MEMBERS * _MEMBER.size <= _SB2_CSUM_AT


@dataclass(frozen=True)
class Member:
    """One row of the member table: what every device of a pool knows about each one."""

    device_uuid: bytes
    device_size: int
    data_start: int
    data_units: int


@dataclass(frozen=True)
class Superblock:
    """Ties the devices of one pool together: one per device at offset 0 and (version
    2) an identical backup copy in the device's last block, ``backup_offset``.

    Version 2 also carries the member table (``members``: every device of the pool, in
    index order) and the metadata area's place (``meta_start``, ``meta_size``) on every
    device, so any one member's superblock can rebuild another's. Version 1 (read
    only): no backup (``backup_offset`` 0), no member table, metadata fields 0 on
    devices other than device 0."""

    pool_uuid: bytes
    device_uuid: bytes
    device_index: int
    device_count: int
    unit_size: int
    block_size: int
    device_size: int
    data_start: int
    data_units: int
    meta_start: int
    meta_size: int
    created_ns: int
    pool_units: int
    label: str = ""
    version: int = FORMAT_VERSION
    backup_offset: int = 0
    members: tuple[Member, ...] = ()

    @property
    def log_seed(self) -> int:
        """Seed of the metadata log's checksums (its first 8 UUID bytes, little-endian):
        entries of another pool's log never verify."""
        return int.from_bytes(self.pool_uuid[:8], "little")

    @property
    def member(self) -> Member:
        """This device's own row of the member table."""
        return Member(self.device_uuid, self.device_size, self.data_start, self.data_units)

    def pool_part(self) -> tuple[object, ...]:
        """The fields every version-2 member of one pool has in common."""
        return (
            self.version,
            self.pool_uuid,
            self.device_count,
            self.unit_size,
            self.meta_start,
            self.meta_size,
            self.created_ns,
            self.pool_units,
            self.label,
            self.members,
        )

    def encode(self) -> bytes:
        """The 4096-byte block (version 2 only; version 1 is never written)."""
        if self.version != FORMAT_VERSION:
            raise ValueError(f"cannot write a version {self.version} superblock")
        _check_v2(self, ValueError)
        body = _SB2.pack(
            SB_MAGIC,
            self.version,
            _SB2.size,
            self.pool_uuid,
            self.device_uuid,
            self.device_index,
            self.device_count,
            self.unit_size,
            self.block_size,
            self.device_size,
            self.data_start,
            self.data_units,
            self.meta_start,
            self.meta_size,
            self.created_ns,
            self.pool_units,
            self.label.encode()[:32],
            self.backup_offset,
        )
        body += b"".join(
            _MEMBER.pack(m.device_uuid, m.device_size, m.data_start, m.data_units)
            for m in self.members
        )
        body += bytes(_SB2_CSUM_AT - len(body))
        return body + _SB_CSUM.pack(xxhash.xxh64_intdigest(body))

    @classmethod
    def decode(cls, block: bytes) -> Superblock:
        """Parse a superblock of version 1 or 2; Corruption if it is not one, fails its
        checksum or contradicts itself."""
        if block[:8] != SB_MAGIC:
            raise Corruption("no kvfs superblock")
        if len(block) < _SB.size + _SB_CSUM.size:
            raise Corruption("truncated superblock")
        (version,) = struct.unpack_from("<I", block, 8)
        if version == 1:
            return _decode_v1(block)
        if version != FORMAT_VERSION:
            raise Corruption(f"unsupported format version {version}")
        if len(block) < SB_BLOCK:
            raise Corruption("truncated superblock")
        (csum,) = _SB_CSUM.unpack_from(block, _SB2_CSUM_AT)
        if csum != xxhash.xxh64_intdigest(block[:_SB2_CSUM_AT]):
            raise Corruption("superblock checksum mismatch")
        f = _SB2.unpack_from(block)
        if f[2] != _SB2.size or not 1 <= f[6] <= MAX_MEMBERS:
            raise Corruption("superblock header size or device count out of range")
        table_end = _SB2.size + f[6] * _MEMBER.size
        if any(block[table_end:_SB2_CSUM_AT]):
            raise Corruption("superblock padding is not zero")
        members = tuple(
            Member(*_MEMBER.unpack_from(block, _SB2.size + i * _MEMBER.size)) for i in range(f[6])
        )
        sb = _unpacked(f, backup_offset=f[17], members=members)
        _check_v2(sb, Corruption)
        return sb


def _unpacked(f: tuple[Any, ...], **extra: Any) -> Superblock:
    """A Superblock from the unpacked version-1 fields (``_SB`` order) and ``extra``."""
    return Superblock(
        pool_uuid=f[3],
        device_uuid=f[4],
        device_index=f[5],
        device_count=f[6],
        unit_size=f[7],
        block_size=f[8],
        device_size=f[9],
        data_start=f[10],
        data_units=f[11],
        meta_start=f[12],
        meta_size=f[13],
        created_ns=f[14],
        pool_units=f[15],
        label=f[16].rstrip(b"\0").decode(errors="replace"),
        version=f[1],
        **extra,
    )


def _decode_v1(block: bytes) -> Superblock:
    if any(block[_SB.size + _SB_CSUM.size : SB_BLOCK]):
        raise Corruption("superblock padding is not zero")
    (csum,) = _SB_CSUM.unpack_from(block, _SB.size)
    if csum != xxhash.xxh64_intdigest(block[: _SB.size]):
        raise Corruption("superblock checksum mismatch")
    return _unpacked(_SB.unpack_from(block))


def _check_v2(sb: Superblock, error: type[Exception]) -> None:
    """The rules a version-2 superblock obeys (a checksummed block that breaks them
    was written by a bug)."""
    unit = sb.unit_size
    problem = None
    if not 1 <= sb.device_count <= MAX_MEMBERS or len(sb.members) != sb.device_count:
        problem = f"member table of {len(sb.members)} rows for {sb.device_count} devices"
    elif sb.device_index >= sb.device_count:
        problem = f"device index {sb.device_index} of {sb.device_count}"
    elif sb.members[sb.device_index] != sb.member:
        problem = "the member table contradicts the device's own fields"
    elif unit < 4096 or unit & (unit - 1):
        problem = f"unit size {unit}"
    elif sb.device_size % SB_BLOCK or sb.backup_offset != sb.device_size - SB_BLOCK:
        problem = f"backup at {sb.backup_offset} of a {sb.device_size}-byte device"
    elif any(m.data_start + m.data_units * unit > m.device_size - SB_BLOCK for m in sb.members):
        problem = "data units overlap the backup superblock"
    elif sb.pool_units != sum(m.data_units for m in sb.members):
        problem = f"pool units {sb.pool_units} are not the members' sum"
    if problem:
        raise error(f"inconsistent superblock: {problem}")


# Signatures of things that are not ours: (offset, bytes, name).
FOREIGN_SIGNATURES: tuple[tuple[int, bytes, str], ...] = (
    (1080, b"\x53\xef", "ext2/3/4 filesystem"),
    (0, b"XFSB", "XFS filesystem"),
    (65600, b"_BHRfS_M", "btrfs filesystem"),
    (3, b"NTFS    ", "NTFS filesystem"),
    (54, b"FAT", "FAT filesystem"),
    (82, b"FAT32", "FAT32 filesystem"),
    (512, b"LABELONE", "LVM physical volume"),
    (4086, b"SWAPSPACE2", "swap space"),
    (512, b"EFI PART", "GPT partition table"),
    (0, b"hsqs", "squashfs"),
    (32769, b"CD001", "ISO-9660 image"),
    (0, b"\xa9\x2b\x4a\xfc", "bcachefs"),
    (4096, b"\xfc\x4e\x2b\xa9", "MD RAID member"),
)
SIGNATURE_PROBE = 69632
"""Bytes read from a device's start to look for foreign signatures."""


def with_article(name: str) -> str:
    """``an ext2/3/4 filesystem``, ``a btrfs filesystem``: a signature's name in a
    sentence (by how its first letters are spoken)."""
    spoken_vowel = ("ext", "XFS", "NTFS", "LVM", "ISO", "MD ", "EFI")
    return f"{'an' if name.startswith(spoken_vowel) else 'a'} {name}"


def foreign_signature(head: bytes) -> str | None:
    """Name of a known foreign format found in the first bytes of a device, if any."""
    for offset, magic, name in FOREIGN_SIGNATURES:
        if head[offset : offset + len(magic)] == magic:
            return name
    if len(head) >= 512 and head[510:512] == b"\x55\xaa" and any(head[446:510]):
        return "MBR partition table"
    return None
