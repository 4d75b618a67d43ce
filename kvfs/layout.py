"""The on-device format: every record is one ``struct.Struct`` with a size assert.

``docs/format.md`` is the specification; this module is its executable form. Pure:
encode/decode only, no I/O. Any change to a record bumps ``FORMAT_VERSION``.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from kvfs.errors import Corruption

FORMAT_VERSION = 1
SB_MAGIC = b"KVFSPOOL"
SB_BLOCK = 4096
RESERVED_HEAD = 1 << 20
"""Bytes at the start of every device before the first unit (superblock lives at 0)."""

# ----------------------------------------------------------------------------- superblock
_SB = struct.Struct("<8sII16s16sIIIIQQQQQQQ32s")
assert _SB.size == 152
_SB_CSUM = struct.Struct("<Q")


@dataclass(frozen=True)
class Superblock:
    """Ties the devices of one pool together; one per device at offset 0."""

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

    def encode(self) -> bytes:
        body = _SB.pack(
            SB_MAGIC,
            self.version,
            _SB.size,
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
        )
        body += _SB_CSUM.pack(xxhash.xxh64_intdigest(body))
        return body + bytes(SB_BLOCK - len(body))

    @classmethod
    def decode(cls, block: bytes) -> Superblock:
        """Parse a superblock; Corruption if it is not one or fails its checksum."""
        if block[:8] != SB_MAGIC:
            raise Corruption("no kvfs superblock")
        if len(block) < _SB.size + _SB_CSUM.size:
            raise Corruption("truncated superblock")
        if any(block[_SB.size + _SB_CSUM.size : SB_BLOCK]):
            raise Corruption("superblock padding is not zero")
        fields = _SB.unpack_from(block)
        (csum,) = _SB_CSUM.unpack_from(block, _SB.size)
        if csum != xxhash.xxh64_intdigest(block[: _SB.size]):
            raise Corruption("superblock checksum mismatch")
        if fields[1] != FORMAT_VERSION:
            raise Corruption(f"unsupported format version {fields[1]}")
        return cls(
            pool_uuid=fields[3],
            device_uuid=fields[4],
            device_index=fields[5],
            device_count=fields[6],
            unit_size=fields[7],
            block_size=fields[8],
            device_size=fields[9],
            data_start=fields[10],
            data_units=fields[11],
            meta_start=fields[12],
            meta_size=fields[13],
            created_ns=fields[14],
            pool_units=fields[15],
            label=fields[16].rstrip(b"\0").decode(errors="replace"),
            version=fields[1],
        )


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


def foreign_signature(head: bytes) -> str | None:
    """Name of a known foreign format found in the first bytes of a device, if any."""
    for offset, magic, name in FOREIGN_SIGNATURES:
        if head[offset : offset + len(magic)] == magic:
            return name
    if len(head) >= 512 and head[510:512] == b"\x55\xaa" and any(head[446:510]):
        return "MBR partition table"
    return None


# ----------------------------------------------------------------------------- journal
JOURNAL_MAGIC = 0x314A564B  # "KVJ1"
_ENTRY = struct.Struct("<IHHQQII")
assert _ENTRY.size == 32
_ENTRY_CSUM = struct.Struct("<Q")
ENTRY_OVERHEAD = _ENTRY.size + _ENTRY_CSUM.size

KIND_TXN = 1
KIND_CKPT_BEGIN = 2
KIND_CKPT_DATA = 3
KIND_CKPT_END = 4


@dataclass(frozen=True)
class Entry:
    """One journal entry: an atomic transaction or a piece of a checkpoint."""

    kind: int
    generation: int
    seq: int
    payload: bytes


def encode_entry(kind: int, generation: int, seq: int, payload: bytes, seed: int = 0) -> bytes:
    """Frame one entry; ``seed`` (from the pool UUID) keeps other pools' logs invalid."""
    head = _ENTRY.pack(JOURNAL_MAGIC, FORMAT_VERSION, kind, generation, seq, len(payload), 0)
    csum = xxhash.xxh64_intdigest(head + payload, seed)
    raw = head + payload + _ENTRY_CSUM.pack(csum)
    return raw + bytes(-len(raw) % 8)


KIND_PAD = 5

PARSE_OK, PARSE_MORE, PARSE_END = 0, 1, 2


def parse_entry(
    view: memoryview, pos: int, generation: int, expected_seq: int | None, seed: int = 0
) -> tuple[int, Entry | None, int]:
    """Parse the entry at ``pos``: (PARSE_OK, entry, next position), (PARSE_MORE, ...)
    when ``view`` ends inside a plausible entry, or (PARSE_END, ...) when the bytes
    there are torn, corrupt, of another generation or out of sequence — the log's end."""
    if pos + _ENTRY.size > len(view):
        return PARSE_MORE, None, pos
    magic, version, kind, gen, seq, length, _ = _ENTRY.unpack_from(view, pos)
    if magic != JOURNAL_MAGIC or version != FORMAT_VERSION or gen != generation:
        return PARSE_END, None, pos
    if expected_seq is not None and seq != expected_seq:
        return PARSE_END, None, pos
    end = pos + _ENTRY.size + length + _ENTRY_CSUM.size
    if end > len(view):
        return PARSE_MORE, None, pos
    (csum,) = _ENTRY_CSUM.unpack_from(view, end - _ENTRY_CSUM.size)
    if csum != xxhash.xxh64_intdigest(view[pos : end - _ENTRY_CSUM.size], seed):
        return PARSE_END, None, pos
    payload = bytes(view[pos + _ENTRY.size : end - _ENTRY_CSUM.size])
    return PARSE_OK, Entry(kind, gen, seq, payload), end + (-end % 8)


def entry_header(view: memoryview, pos: int, generation: int) -> tuple[int, int, int, int] | None:
    """(kind, generation, seq, length) of a header at ``pos`` whose magic, version and
    generation are right (the checksum is not checked), else None."""
    if pos + _ENTRY.size > len(view):
        return None
    magic, version, kind, gen, seq, length, _ = _ENTRY.unpack_from(view, pos)
    if magic != JOURNAL_MAGIC or version != FORMAT_VERSION or gen != generation:
        return None
    return kind, gen, seq, length


def pad_entry(generation: int, seq: int, at: int, block: int, seed: int = 0) -> bytes:
    """A PAD entry that, written at offset ``at``, ends exactly on a ``block`` boundary."""
    room = -at % block
    while room < ENTRY_OVERHEAD:
        room += block
    return encode_entry(KIND_PAD, generation, seq, bytes(room - ENTRY_OVERHEAD), seed)


def peek_entry(buf: bytes, seed: int = 0) -> Entry | None:
    """The valid entry at the start of ``buf``, if any (to find a log's generation)."""
    if len(buf) < _ENTRY.size:
        return None
    gen = _ENTRY.unpack_from(buf, 0)[3]
    status, entry, _ = parse_entry(memoryview(buf), 0, gen, None, seed)
    return entry if status == PARSE_OK else None


# ----------------------------------------------------------------------------- operations
OP_INODE = 1
OP_DENTRY = 2
OP_UNDENTRY = 3
OP_DROP = 4
OP_XATTR = 5
OP_UNXATTR = 6
OP_BLOB = 7

FLAG_WRITING = 1
"""Inode flag: data changes are not yet committed; recovery drops such a file."""
FLAG_QUARANTINED = 2
"""Inode flag: a checksum failed; the file is unreadable and will be dropped."""
FLAG_GONE = 4
"""Runtime-only inode flag, never written: kvfs removed the file (eviction, quarantine,
an incomplete file abandoned) while the kernel or an open handle still knew it; every
later open or attribute request gets ESTALE."""

NO_UNIT = -1
"""Marks a hole in an inode's unit map."""
DEV_SHIFT = 48
UNIT_MASK = (1 << DEV_SHIFT) - 1
_MIN_UNIT = 64 * 1024
"""Smallest unit size a pool can have: an inode maps at most ceil(size / this) units."""

_INODE = struct.Struct("<BQIIIIQqqqIII")
assert _INODE.size == 69
_RUN = struct.Struct("<IIIQ")
assert _RUN.size == 20
_INODE_RUN = struct.Struct(_INODE.format + _RUN.format[1:])
"""An inode header directly followed by its only run (the common one-extent file)."""
assert _INODE_RUN.size == _INODE.size + _RUN.size
_DENTRY = struct.Struct("<BQQH")
assert _DENTRY.size == 19
_UNDENTRY = struct.Struct("<BQH")
assert _UNDENTRY.size == 11
_DROP = struct.Struct("<BQ")
assert _DROP.size == 9
_XATTR = struct.Struct("<BQHI")
assert _XATTR.size == 15
_BLOB = struct.Struct("<BHI")
assert _BLOB.size == 7


def phys(dev: int, unit: int) -> int:
    """Pack a (device, unit) address into one int for the unit map."""
    return (dev << DEV_SHIFT) | unit


@dataclass(slots=True)
class InodeRecord:
    """The persistent state of one inode (directory entries are separate ops)."""

    ino: int
    mode: int
    uid: int
    gid: int
    nlink: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    flags: int
    units: array[int]
    csums: array[int]


@dataclass(frozen=True, slots=True)
class Dentry:
    parent: int
    name: bytes
    ino: int


@dataclass(frozen=True, slots=True)
class Undentry:
    parent: int
    name: bytes


@dataclass(frozen=True, slots=True)
class Drop:
    ino: int


@dataclass(frozen=True, slots=True)
class Xattr:
    ino: int
    name: bytes
    value: bytes | None  # None removes it


@dataclass(frozen=True, slots=True)
class Blob:
    """Opaque state of another component (e.g. the eviction policy), by name."""

    name: str
    data: bytes


Op = InodeRecord | Dentry | Undentry | Drop | Xattr | Blob


def _runs(units: array[int]) -> list[tuple[int, int, int, int]]:
    """(logical start, count, device, physical start) runs of a unit map."""
    runs: list[tuple[int, int, int, int]] = []
    for lu, p in enumerate(units):
        if p == NO_UNIT:
            continue
        dev, pu = p >> DEV_SHIFT, p & UNIT_MASK
        if runs:
            ls, n, d, ps = runs[-1]
            if ls + n == lu and d == dev and ps + n == pu:
                runs[-1] = (ls, n + 1, d, ps)
                continue
        runs.append((lu, 1, dev, pu))
    return runs


def _single_run(units: array[int]) -> tuple[int, int, int, int] | None:
    """The one run of a unit map that is a single physically contiguous extent without
    holes (what ``_runs`` would return, found with C-level comparisons), else None."""
    n = len(units)
    if not n:
        return None
    first = units[0]
    last = first + n - 1
    if first < 0 or units[-1] != last or first >> DEV_SHIFT != last >> DEV_SHIFT:
        return None
    if n > 1 and units != array("q", range(first, last + 1)):
        return None
    return 0, n, first >> DEV_SHIFT, first & UNIT_MASK


def _inode_head(op: InodeRecord) -> tuple[int, ...]:
    """The INODE fields before the unit-map counts."""
    return (
        OP_INODE,
        op.ino,
        op.mode,
        op.uid,
        op.gid,
        op.nlink,
        op.size,
        op.atime_ns,
        op.mtime_ns,
        op.ctime_ns,
        op.flags,
    )


def encode_op(op: Op) -> bytes:
    if isinstance(op, InodeRecord):
        units, csums = op.units, op.csums
        run = _single_run(units) if isinstance(units, array) else None
        if run is not None and len(csums) == run[1]:
            # no holes: every checksum is mapped, in logical order
            mapped_bytes = (
                csums.tobytes()
                if isinstance(csums, array) and csums.typecode == "Q"
                else array("Q", csums).tobytes()
            )
            return (
                _INODE_RUN.pack(
                    *_inode_head(op),
                    run[1],
                    1,
                    *run,
                )
                + mapped_bytes
            )
        runs = _runs(op.units)
        mapped = array("Q", (c for p, c in zip(op.units, op.csums, strict=True) if p != NO_UNIT))
        head = _INODE.pack(*_inode_head(op), len(op.units), len(runs))
        return head + b"".join(_RUN.pack(*r) for r in runs) + mapped.tobytes()
    if isinstance(op, Dentry):
        return _DENTRY.pack(OP_DENTRY, op.parent, op.ino, len(op.name)) + op.name
    if isinstance(op, Undentry):
        return _UNDENTRY.pack(OP_UNDENTRY, op.parent, len(op.name)) + op.name
    if isinstance(op, Drop):
        return _DROP.pack(OP_DROP, op.ino)
    if isinstance(op, Xattr):
        if op.value is None:
            return _UNDENTRY.pack(OP_UNXATTR, op.ino, len(op.name)) + op.name
        head = _XATTR.pack(OP_XATTR, op.ino, len(op.name), len(op.value))
        return head + op.name + op.value
    name = op.name.encode()
    return _BLOB.pack(OP_BLOB, len(name), len(op.data)) + name + op.data


def encode_ops(ops: list[Op]) -> bytes:
    return b"".join(encode_op(op) for op in ops)


_MAX_DEV = 1 << (63 - DEV_SHIFT)


def _decode_inode(buf: bytes, pos: int) -> tuple[InodeRecord, int]:
    if pos + _INODE_RUN.size <= len(buf):
        # Fast path, the same checks in the same order: one run mapping every unit.
        f = _INODE_RUN.unpack_from(buf, pos)
        nunits, size, ls, n, dev, ps = f[11], f[6], f[13], f[14], f[15], f[16]
        if f[12] == 1 and ls == 0 and n == nunits:
            if nunits > -(-size // _MIN_UNIT):
                raise Corruption(f"inode {f[1]}: {nunits} units for {size} bytes")
            if dev >= _MAX_DEV or ps + n > UNIT_MASK:
                raise Corruption(f"inode {f[1]}: run beyond its unit map")
            pos += _INODE_RUN.size
            end = pos + 8 * n
            if end > len(buf):
                raise Corruption(f"inode {f[1]}: truncated checksums")
            first = (dev << DEV_SHIFT) | ps
            units = array("q", [first]) if n == 1 else array("q", range(first, first + n))
            csums = array("Q", buf[pos:end])
            rec = InodeRecord(
                f[1], f[2], f[3], f[4], f[5], size, f[7], f[8], f[9], f[10], units, csums
            )
            return rec, end
    f = _INODE.unpack_from(buf, pos)
    nunits, nruns, size = f[11], f[12], f[6]
    pos += _INODE.size
    # Validate against the bytes present before allocating anything: a forged count
    # must not turn into a multi-GiB unit map or a billion-step loop.
    if nunits > -(-size // _MIN_UNIT):
        raise Corruption(f"inode {f[1]}: {nunits} units for {size} bytes")
    end = pos + nruns * _RUN.size
    if end > len(buf):
        raise Corruption(f"inode {f[1]}: truncated runs")
    runs = [_RUN.unpack_from(buf, pos)] if nruns == 1 else list(_RUN.iter_unpack(buf[pos:end]))
    pos = end
    mapped_count = 0
    for ls, n, dev, ps in runs:
        if ls + n > nunits or dev >= _MAX_DEV or ps + n > UNIT_MASK:
            raise Corruption(f"inode {f[1]}: run beyond its unit map")
        mapped_count += n
    end = pos + 8 * mapped_count
    if end > len(buf):
        raise Corruption(f"inode {f[1]}: truncated checksums")
    # Unit maps and checksums are built per run with C-level slices: run (ls, n, dev,
    # ps) maps logical ls + i to phys(dev, ps + i) == phys(dev, ps) + i (ps + n fits).
    csums = array("Q")
    if nruns == 1 and runs[0][0] == 0 and mapped_count == nunits:
        # one extent without holes (the common case): checksums are in logical order
        first = (runs[0][2] << DEV_SHIFT) | runs[0][3]
        units = array("q", range(first, first + nunits))
        csums.frombytes(buf[pos:end])
    else:
        units = array("q", [NO_UNIT]) * nunits
        csums = array("Q", [0]) * nunits
        mapped = array("Q")
        mapped.frombytes(buf[pos:end])
        done = 0
        # later runs overwrite earlier ones where (forged) runs overlap
        for ls, n, dev, ps in runs:
            first = (dev << DEV_SHIFT) | ps
            units[ls : ls + n] = array("q", range(first, first + n))
            csums[ls : ls + n] = mapped[done : done + n]
            done += n
    rec = InodeRecord(f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[10], units, csums)
    return rec, end


def decode_ops(buf: bytes) -> Iterator[Op]:
    """Parse a payload produced by ``encode_ops``; Corruption on any inconsistency
    (the entry checksum already passed, so this means a bug or a forged entry)."""
    pos = 0
    try:
        while pos < len(buf):
            kind = buf[pos]
            if kind == OP_INODE:
                rec, pos = _decode_inode(buf, pos)
                yield rec
            elif kind == OP_DENTRY:
                _, parent, ino, n = _DENTRY.unpack_from(buf, pos)
                pos += _DENTRY.size + n
                yield Dentry(parent, buf[pos - n : pos], ino)
            elif kind in (OP_UNDENTRY, OP_UNXATTR):
                _, ino, n = _UNDENTRY.unpack_from(buf, pos)
                pos += _UNDENTRY.size + n
                name = buf[pos - n : pos]
                yield Undentry(ino, name) if kind == OP_UNDENTRY else Xattr(ino, name, None)
            elif kind == OP_DROP:
                yield Drop(_DROP.unpack_from(buf, pos)[1])
                pos += _DROP.size
            elif kind == OP_XATTR:
                _, ino, nn, nv = _XATTR.unpack_from(buf, pos)
                pos += _XATTR.size + nn + nv
                yield Xattr(ino, buf[pos - nn - nv : pos - nv], buf[pos - nv : pos])
            elif kind == OP_BLOB:
                _, nn, nd = _BLOB.unpack_from(buf, pos)
                pos += _BLOB.size + nn + nd
                try:
                    blob_name = buf[pos - nn - nd : pos - nd].decode()
                except UnicodeDecodeError as e:
                    raise Corruption(f"journal blob name is not UTF-8: {e}") from e
                yield Blob(blob_name, buf[pos - nd : pos])
            else:
                raise Corruption(f"unknown journal op {kind}")
    except struct.error as e:
        raise Corruption(f"truncated journal op: {e}") from e
    if pos != len(buf):
        raise Corruption("journal op overruns its entry")
