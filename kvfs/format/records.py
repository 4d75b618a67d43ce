"""Journal entries, the operations they carry, and unit addresses
(``docs/format.md``, "Metadata area", "Operations", "Data units").

Pure: encode/decode only, no I/O. Every record is one ``struct.Struct`` with a size
assert; ``ENTRY_VERSION`` versions the entry framing and the log grammar.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from kvfs.common.errors import Corruption

ENTRY_VERSION = 2
"""Version of the journal entry framing and of the log grammar written now: version 2
appends each group commit right behind the last (a COMMIT entry ends it) instead of
padding it to a block (PAD). Logs of version 1 (kvfs 0.2.0) are still read."""
ENTRY_VERSIONS = (1, 2)
"""Entry versions recovery reads; one half holds entries of one version only."""

ALIGN = 4096
"""The device block every record is aligned to: all device I/O (offsets, lengths and
buffer addresses), the log halves' bounds and the metadata area's size are multiples
of it (``docs/format.md``, "Device layout")."""

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


MAGIC_BYTES = JOURNAL_MAGIC.to_bytes(4, "little")
"""How an entry starts on the device (recovery searches for it with ``bytes.find``)."""


@dataclass(frozen=True)
class Entry:
    """One journal entry: an atomic transaction or a piece of a checkpoint."""

    kind: int
    generation: int
    seq: int
    payload: bytes
    version: int = ENTRY_VERSION


def encode_entry(
    kind: int,
    generation: int,
    seq: int,
    payload: bytes,
    seed: int = 0,
    version: int = ENTRY_VERSION,
) -> bytes:
    """Frame one entry; ``seed`` (from the pool UUID) keeps other pools' logs invalid.
    ``version`` other than ENTRY_VERSION only to build old logs in tests."""
    head = _ENTRY.pack(JOURNAL_MAGIC, version, kind, generation, seq, len(payload), 0)
    csum = xxhash.xxh64_intdigest(head + payload, seed)
    raw = head + payload + _ENTRY_CSUM.pack(csum)
    return raw + bytes(-len(raw) % 8)


KIND_PAD = 5
"""Version 1 only: zeros that make a group commit end on a 4096-byte boundary."""
KIND_COMMIT = 6
"""Version 2: ends every device write of the log (a group commit; empty payload)."""

PARSE_OK, PARSE_MORE, PARSE_END = 0, 1, 2


def parse_entry(
    view: memoryview,
    pos: int,
    generation: int,
    expected_seq: int | None,
    seed: int = 0,
    version: int = ENTRY_VERSION,
) -> tuple[int, Entry | None, int]:
    """Parse the entry at ``pos``: (PARSE_OK, entry, next position), (PARSE_MORE, ...)
    when ``view`` ends inside a plausible entry, or (PARSE_END, ...) when the bytes
    there are torn, corrupt, of another generation or version, or out of sequence —
    the log's end."""
    if pos + _ENTRY.size > len(view):
        return PARSE_MORE, None, pos
    magic, ver, kind, gen, seq, length, _ = _ENTRY.unpack_from(view, pos)
    if magic != JOURNAL_MAGIC or ver != version or gen != generation:
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
    return PARSE_OK, Entry(kind, gen, seq, payload, ver), end + (-end % 8)


def entry_header(
    view: memoryview, pos: int, generation: int, version: int = ENTRY_VERSION
) -> tuple[int, int, int, int] | None:
    """(kind, generation, seq, length) of a header at ``pos`` whose magic, version and
    generation are right (the checksum is not checked), else None."""
    if pos + _ENTRY.size > len(view):
        return None
    magic, ver, kind, gen, seq, length, _ = _ENTRY.unpack_from(view, pos)
    if magic != JOURNAL_MAGIC or ver != version or gen != generation:
        return None
    return kind, gen, seq, length


def pad_entry(
    generation: int, seq: int, at: int, block: int, seed: int = 0, version: int = 1
) -> bytes:
    """A PAD entry (version 1 logs) that, written at offset ``at``, ends exactly on a
    ``block`` boundary."""
    room = -at % block
    while room < ENTRY_OVERHEAD:
        room += block
    return encode_entry(KIND_PAD, generation, seq, bytes(room - ENTRY_OVERHEAD), seed, version)


def commit_entry(generation: int, seq: int, seed: int = 0) -> bytes:
    """The COMMIT entry that ends a version-2 device write (40 bytes)."""
    return encode_entry(KIND_COMMIT, generation, seq, b"", seed)


def peek_entry(buf: bytes, seed: int = 0) -> Entry | None:
    """The valid entry of a readable version at the start of ``buf``, if any (to find
    a log's generation and version)."""
    if len(buf) < _ENTRY.size:
        return None
    _, ver, _, gen, _, _, _ = _ENTRY.unpack_from(buf, 0)
    if ver not in ENTRY_VERSIONS:
        return None
    status, entry, _ = parse_entry(memoryview(buf), 0, gen, None, seed, ver)
    return entry if status == PARSE_OK else None


# ----------------------------------------------------------------------------- operations
OP_INODE = 1
OP_DENTRY = 2
OP_UNDENTRY = 3
OP_DROP = 4
OP_XATTR = 5
OP_UNXATTR = 6
OP_BLOB = 7
OP_IMAGE = 8
"""TEMPORARY GLUE: a columnar namespace image part carried as one checkpoint op
until the journal writes ``Namespace.snapshot_payloads()`` as CKPT_DATA payloads."""

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
MIN_UNIT = 64 * 1024
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


# A unit-map entry may name a run of *fragments* inside a unit instead of a whole unit
# (a file's last, partial unit: docs/format.md "Fragment tails"). The 48-bit unit field
# then reads: bit 47 set, bits 39..46 the first fragment, bits 31..38 the fragment
# count - 1, bits 0..30 the host unit. Whole-unit addresses never have bit 47 set.
FRAG_FLAG = 1 << 47
_FRAG_START_SHIFT = 39
_FRAG_COUNT_SHIFT = 31
HOST_MASK = (1 << _FRAG_COUNT_SHIFT) - 1
"""Host units of fragments are below 2**31 (2 PiB per device at 1 MiB units)."""
MAX_FRAGMENTS = 256
"""Fragments per unit at most (8 bits of start, 8 of count - 1)."""
MIN_FRAGMENT = 4096


def fragment_size(unit_size: int) -> int:
    """Bytes per fragment: 4 KiB (the O_DIRECT granule), or unit / 256 for units over
    1 MiB (so a fragment run always fits the 8-bit fields)."""
    return max(MIN_FRAGMENT, unit_size // MAX_FRAGMENTS)


def allocated_size(size: int, unit_size: int) -> int:
    """Device bytes a file of ``size`` bytes (no holes) holds once written back: whole
    units, and its partial last unit as fragments (a whole unit if no fragment would
    be saved)."""
    whole, tail = divmod(size, unit_size)
    frag = fragment_size(unit_size)
    tail = -(-tail // frag) * frag
    return whole * unit_size + (unit_size if tail > unit_size - frag else tail)


def fragment_field(host: int, start: int, count: int) -> int:
    """The unit field of fragments ``start``..``start + count - 1`` of unit ``host``."""
    assert 0 <= host <= HOST_MASK and start >= 0 and count >= 1
    assert start + count <= MAX_FRAGMENTS
    return FRAG_FLAG | start << _FRAG_START_SHIFT | (count - 1) << _FRAG_COUNT_SHIFT | host


def is_fragment(field: int) -> bool:
    """Whether a unit field (or a packed address) names fragments, not a whole unit
    (never ``NO_UNIT``, which has every bit set)."""
    return field >= 0 and bool(field & FRAG_FLAG)


def split_fragment(field: int) -> tuple[int, int, int]:
    """(host unit, first fragment, count) of a fragment unit field."""
    field &= UNIT_MASK
    start = (field >> _FRAG_START_SHIFT) & 0xFF
    return field & HOST_MASK, start, ((field >> _FRAG_COUNT_SHIFT) & 0xFF) + 1


def extent(field: int, unit_size: int) -> tuple[int, int, int]:
    """(unit, byte offset in it, bytes) that a unit field occupies on its device: the
    whole unit, or the fragment run inside its host unit. The unit's content is those
    bytes followed by zeros up to ``unit_size`` (its checksum covers the whole unit)."""
    field &= UNIT_MASK
    if not field & FRAG_FLAG:
        return field, 0, unit_size
    host, start, count = split_fragment(field)
    frag = fragment_size(unit_size)
    return host, start * frag, count * frag


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


@dataclass(frozen=True, slots=True)
class Image:
    """One ``Namespace.snapshot_payloads()`` payload carried as an operation (IMAGE):
    how a checkpoint written offline by ``halves.encode_checkpoint`` holds the image."""

    payload: bytes


Op = InodeRecord | Dentry | Undentry | Drop | Xattr | Blob | Image
_IMAGE = struct.Struct("<BI")


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
        if not len(units) and not len(csums):
            # no unit map (directories, empty files: what renames and unlinks log
            # most): the general path's bytes, without building runs
            return _INODE.pack(*_inode_head(op), 0, 0)
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
    if isinstance(op, Image):
        return _IMAGE.pack(OP_IMAGE, len(op.payload)) + op.payload
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
            if nunits > -(-size // MIN_UNIT):
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
    if nunits > -(-size // MIN_UNIT):
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
            elif kind == OP_IMAGE:
                _, n = _IMAGE.unpack_from(buf, pos)
                pos += _IMAGE.size + n
                if pos > len(buf):
                    raise Corruption("truncated namespace image op")
                yield Image(buf[pos - n : pos])
            else:
                raise Corruption(f"unknown journal op {kind}")
    except struct.error as e:
        raise Corruption(f"truncated journal op: {e}") from e
    if pos != len(buf):
        raise Corruption("journal op overruns its entry")
