"""Unit tests of kvfs.format.records: every on-device record round-trips, and every
single-byte corruption is rejected (LevelDB ``log_test.cc`` style)."""

from __future__ import annotations

import random
from array import array
from typing import Any

import pytest
import xxhash

from kvfs.common.errors import Corruption
from kvfs.format.records import (
    ENTRY_OVERHEAD,
    KIND_CKPT_BEGIN,
    KIND_PAD,
    KIND_TXN,
    NO_UNIT,
    PARSE_END,
    PARSE_MORE,
    PARSE_OK,
    Blob,
    Dentry,
    Drop,
    InodeRecord,
    Op,
    Undentry,
    Xattr,
    decode_ops,
    encode_entry,
    encode_op,
    encode_ops,
    pad_entry,
    parse_entry,
    peek_entry,
    phys,
)
from kvfs.format.superblock import (
    FOREIGN_SIGNATURES,
    SB_BLOCK,
    SIGNATURE_PROBE,
    Member,
    Superblock,
    foreign_signature,
)

SEED = 0x1234_5678_9ABC_DEF0
SB_RECORD = 160 + 3 * 40
"""Bytes of an encoded 3-device superblock that carry meaning (header + member table)."""


def superblock(
    index: int = 1, data_start: int = 1 << 20, uuid: bytes = bytes(range(16, 32)), **changes: Any
) -> Superblock:
    """A valid version-2 superblock of device ``index`` of a 3-device pool."""
    unit, size = 1 << 20, 64 << 30
    own = Member(uuid, size, data_start, (size - 4096 - data_start) // unit)
    members = tuple(
        own if i == index else Member(bytes([i]) * 16, 32 << 30, unit, 30_000) for i in range(3)
    )
    fields: dict[str, Any] = dict(
        pool_uuid=bytes(range(16)),
        device_uuid=own.device_uuid,
        device_index=index,
        device_count=3,
        unit_size=unit,
        block_size=4096,
        device_size=size,
        data_start=data_start,
        data_units=own.data_units,
        meta_start=1 << 20,
        meta_size=8 << 20,
        created_ns=1_700_000_000_123_456_789,
        pool_units=sum(m.data_units for m in members),
        label="kv-pool",
        backup_offset=size - 4096,
        members=members,
    )
    fields.update(changes)
    return Superblock(**fields)


# ----------------------------------------------------------------------------- superblock
def test_superblock_round_trip() -> None:
    for sb in (superblock(), superblock(index=0, data_start=9 << 20, label="")):
        block = sb.encode()
        assert len(block) == SB_BLOCK
        assert Superblock.decode(block) == sb


@pytest.mark.parametrize("xor", [0x01, 0x80, 0xFF])
def test_every_single_byte_corruption_of_a_superblock_is_rejected(xor: int) -> None:
    block = superblock().encode()
    for i in range(SB_BLOCK):
        bad = bytearray(block)
        bad[i] ^= xor
        with pytest.raises(Corruption):
            Superblock.decode(bytes(bad))


def test_truncated_or_foreign_superblock_is_corruption() -> None:
    block = superblock().encode()
    for n in (0, 7, 8, 100, SB_RECORD - 1):
        with pytest.raises(Corruption):
            Superblock.decode(block[:n])
    with pytest.raises(Corruption):
        Superblock.decode(bytes(SB_BLOCK))


def test_superblock_of_another_format_version_is_rejected() -> None:
    block = bytearray(superblock().encode())
    block[8:12] = (99).to_bytes(4, "little")
    block[-8:] = xxhash.xxh64_intdigest(bytes(block[:-8])).to_bytes(8, "little")
    with pytest.raises(Corruption, match="unsupported format version 99"):
        Superblock.decode(bytes(block))
    with pytest.raises(ValueError, match="version 99"):
        superblock(version=99).encode()


@pytest.mark.parametrize(("offset", "magic", "name"), FOREIGN_SIGNATURES)
def test_foreign_signatures_are_detected(offset: int, magic: bytes, name: str) -> None:
    assert offset + len(magic) <= SIGNATURE_PROBE
    head = bytearray(SIGNATURE_PROBE)
    head[offset : offset + len(magic)] = magic
    assert foreign_signature(bytes(head)) == name


def test_mbr_detected_and_blank_or_kvfs_head_is_not_foreign() -> None:
    head = bytearray(SIGNATURE_PROBE)
    assert foreign_signature(bytes(head)) is None
    head[510:512] = b"\x55\xaa"
    assert foreign_signature(bytes(head)) is None  # boot signature, empty partition table
    head[446 + 4] = 0x83
    assert foreign_signature(bytes(head)) == "MBR partition table"
    rng = random.Random(1)
    for _ in range(50):
        sb = superblock(pool_uuid=rng.randbytes(16), uuid=rng.randbytes(16))
        ours = sb.encode() + bytes(SIGNATURE_PROBE - SB_BLOCK)
        assert foreign_signature(ours) is None


# ----------------------------------------------------------------------------- entries
def entry_bytes(payload: bytes = b"hello journal", kind: int = KIND_TXN) -> bytes:
    return encode_entry(kind, 7, 42, payload, SEED)


def test_entry_round_trip_and_alignment() -> None:
    rng = random.Random(2)
    for n in [0, 1, 7, 8, 9, 4095, 4096, 10_000]:
        payload = rng.randbytes(n)
        raw = encode_entry(KIND_TXN, 3, 99, payload, SEED)
        assert len(raw) % 8 == 0
        assert len(raw) - ENTRY_OVERHEAD - n < 8
        status, entry, nxt = parse_entry(memoryview(raw + bytes(64)), 0, 3, 99, SEED)
        assert status == PARSE_OK and entry is not None
        assert (entry.kind, entry.generation, entry.seq, entry.payload) == (
            KIND_TXN,
            3,
            99,
            payload,
        )
        assert nxt == len(raw)


def test_consecutive_entries_parse_in_sequence() -> None:
    raws = [encode_entry(KIND_TXN, 5, s, bytes([s]) * s, SEED) for s in range(1, 20)]
    view = memoryview(b"".join(raws) + bytes(4096))
    pos, seq = 0, 1
    while True:
        status, entry, nxt = parse_entry(view, pos, 5, seq, SEED)
        if status != PARSE_OK:
            break
        assert entry is not None and entry.payload == bytes([seq]) * seq
        pos, seq = nxt, seq + 1
    assert (status, seq) == (PARSE_END, 20)


def test_every_single_byte_flip_in_an_entry_ends_the_log() -> None:
    payload = bytes(range(256)) * 3
    raw = entry_bytes(payload)
    framed = ENTRY_OVERHEAD + len(payload)
    length_field = range(24, 28)
    tail = bytes(8192)
    for i in range(len(raw)):
        for xor in (0x01, 0x5A, 0xFF):
            bad = bytearray(raw)
            bad[i] ^= xor
            status, entry, _ = parse_entry(memoryview(bytes(bad) + tail), 0, 7, 42, SEED)
            if i >= framed:  # alignment padding after the checksum carries nothing
                assert status == PARSE_OK and entry is not None and entry.payload == payload
            elif i in length_field:  # a longer length may reach past what was read
                assert status in (PARSE_END, PARSE_MORE), i
            else:
                assert status == PARSE_END, i
            # without a sequence expectation (peek) it must not be accepted either
            if i < framed:
                assert peek_entry(bytes(bad) + tail, SEED) is None


def test_wrong_seed_generation_or_sequence_ends_the_log() -> None:
    view = memoryview(entry_bytes() + bytes(64))
    assert parse_entry(view, 0, 7, 42, SEED)[0] == PARSE_OK
    assert parse_entry(view, 0, 7, None, SEED)[0] == PARSE_OK
    assert parse_entry(view, 0, 7, 42, SEED + 1)[0] == PARSE_END
    assert parse_entry(view, 0, 7, 42, 0)[0] == PARSE_END
    assert parse_entry(view, 0, 6, 42, SEED)[0] == PARSE_END
    assert parse_entry(view, 0, 8, 42, SEED)[0] == PARSE_END
    assert parse_entry(view, 0, 7, 41, SEED)[0] == PARSE_END
    assert parse_entry(view, 0, 7, 43, SEED)[0] == PARSE_END
    assert peek_entry(bytes(view), SEED + 1) is None


def test_truncated_entry_asks_for_more() -> None:
    payload = b"x" * 300
    raw = entry_bytes(payload)
    for n in range(ENTRY_OVERHEAD + len(payload)):
        status, entry, pos = parse_entry(memoryview(raw[:n]), 0, 7, 42, SEED)
        assert (status, entry, pos) == (PARSE_MORE, None, 0), n
    assert parse_entry(memoryview(raw[: ENTRY_OVERHEAD + len(payload)]), 0, 7, 42, SEED)[0] == (
        PARSE_OK
    )
    assert peek_entry(raw[:20], SEED) is None


@pytest.mark.parametrize("block", [512, 4096])
def test_pad_entry_lands_on_block_boundaries(block: int) -> None:
    for at in range(0, 3 * block, 8):
        pad = pad_entry(9, 11, at, block, SEED)
        assert (at + len(pad)) % block == 0, at
        assert ENTRY_OVERHEAD <= len(pad) <= block + ENTRY_OVERHEAD
        view = memoryview(bytes(at) + pad)
        status, entry, nxt = parse_entry(view, at, 9, 11, SEED, version=1)
        assert status == PARSE_OK and entry is not None and entry.kind == KIND_PAD
        assert nxt == at + len(pad)


def test_peek_entry_finds_checkpoint_generation() -> None:
    raw = encode_entry(KIND_CKPT_BEGIN, 12, 1, b"", SEED)
    entry = peek_entry(raw + bytes(100), SEED)
    assert entry is not None and (entry.kind, entry.generation, entry.seq) == (
        KIND_CKPT_BEGIN,
        12,
        1,
    )
    assert peek_entry(bytes(4096), SEED) is None


# ----------------------------------------------------------------------------- ops
def record(
    ino: int, units: list[int], csums: list[int], size: int = 0, flags: int = 0
) -> InodeRecord:
    return InodeRecord(
        ino,
        0o100644,
        1000,
        1001,
        1,
        size,
        111,
        222,
        333,
        flags,
        array("q", units),
        array("Q", csums),
    )


def sample_ops() -> list[Op]:
    u = 1 << 20
    units = [
        phys(0, 10),
        phys(0, 11),
        phys(0, 12),  # one run
        NO_UNIT,  # hole
        phys(1, 13),
        phys(1, 14),  # same numbers, other device: a new run
        phys(2, 5),
        phys(0, 13),  # device change, then physically non-adjacent
        NO_UNIT,
        NO_UNIT,
        phys(2, (1 << 40) + 3),  # far physical unit
        NO_UNIT,  # trailing hole
    ]
    csums = [0 if p == NO_UNIT else (0xFFFF_FFFF_FFFF_FFFF - i) for i, p in enumerate(units)]
    return [
        record(2, units, csums, size=len(units) * u - 5, flags=1),
        record(3, [], [], size=0),
        record(4, [NO_UNIT] * 1000, [0] * 1000, size=1000 * u),
        InodeRecord(1, 0o40755, 0, 0, 5, 0, 1, 2, 3, 0, array("q"), array("Q")),
        Dentry(1, b"file", 2),
        Dentry(1, bytes(range(1, 256)).replace(b"/", b"_"), 3),
        Undentry(1, b"gone"),
        Drop(77),
        Xattr(2, b"user.tag", b"\x00\x01value"),
        Xattr(2, b"user.empty", b""),
        Xattr(2, b"user.removed", None),
        Blob("policy", b"\x00" * 10 + b"state"),
        Blob("h\u00e9", b""),
    ]


def test_every_op_kind_round_trips_alone_and_together() -> None:
    ops = sample_ops()
    for op in ops:
        assert list(decode_ops(encode_op(op))) == [op]
    assert list(decode_ops(encode_ops(ops))) == ops
    assert list(decode_ops(b"")) == []


def test_inode_runs_are_compact() -> None:
    contiguous = record(5, [phys(1, i) for i in range(1000)], list(range(1, 1001)))
    sparse = record(6, [phys(1, 2 * i) for i in range(1000)], list(range(1, 1001)))
    assert len(encode_op(contiguous)) < len(encode_op(sparse)) - 900 * 20 + 100


def test_truncated_or_overrunning_payload_is_corruption() -> None:
    raw = encode_ops(sample_ops())
    for n in range(1, len(raw)):
        try:
            list(decode_ops(raw[:n]))
        except Corruption:
            continue
        # a cut exactly between two ops is a valid, shorter payload
        assert any(len(encode_ops(sample_ops()[:k])) == n for k in range(len(sample_ops())))


def decodes_or_corruption(buf: bytes) -> None:
    """Decoding garbage may yield ops, but may fail only with Corruption."""
    try:
        for _ in decode_ops(buf):
            pass
    except Corruption:
        pass


def test_every_single_byte_change_of_a_payload_decodes_or_is_corruption() -> None:
    raw = encode_ops(sample_ops())
    for i in range(len(raw)):
        for xor in (0x01, 0x80, 0xFF):
            bad = bytearray(raw)
            bad[i] ^= xor
            decodes_or_corruption(bytes(bad))


def test_garbage_payload_is_corruption_not_another_exception() -> None:
    rng = random.Random(3)
    for _ in range(3000):
        # no OP_INODE kind byte: a random inode header may describe a legitimately
        # huge sparse file (see the inode fuzz below for inode records)
        garbage = rng.randbytes(rng.randrange(1, 200)).replace(b"\x01", b"\x02")
        decodes_or_corruption(garbage)
    with pytest.raises(Corruption):
        list(decode_ops(b"\x09"))
    with pytest.raises(Corruption):  # a blob whose name is not UTF-8
        list(decode_ops(bytes([7, 2, 0, 0, 0, 0, 0, 0xFF, 0xFE])))


def test_forged_inode_counts_are_corruption_without_huge_allocations() -> None:
    rng = random.Random(4)
    good = encode_op(record(9, [phys(0, 1), NO_UNIT, phys(1, 7)], [5, 0, 6], size=3 << 16))
    for _ in range(3000):
        bad = bytearray(good)
        # nunits (offset 61) and nruns (65) and the first run (69..89)
        for off in rng.sample(range(61, 89), rng.randrange(1, 6)):
            bad[off] = rng.randrange(256)
        decodes_or_corruption(bytes(bad) + rng.randbytes(rng.randrange(0, 64)))
    forged = bytearray(good)
    forged[61:65] = (1 << 31).to_bytes(4, "little")
    with pytest.raises(Corruption):
        list(decode_ops(bytes(forged)))


def test_an_inode_without_units_encodes_as_the_general_path_does() -> None:
    """The fast path for an empty unit map (directories, empty files: most of what a
    rename or an unlink logs) writes the bytes the general path writes (the INODE
    head, its unit and run counts, the runs, the mapped checksums), and a record with
    checksums but no units still fails as before."""
    from kvfs.format.records import _INODE, _RUN, _inode_head, _runs

    def general(op: InodeRecord) -> bytes:
        runs = _runs(array("q", op.units))
        mapped = array("Q", (c for p, c in zip(op.units, op.csums, strict=True) if p != NO_UNIT))
        head = _INODE.pack(*_inode_head(op), len(op.units), len(runs))
        return head + b"".join(_RUN.pack(*r) for r in runs) + mapped.tobytes()

    for ino, mode, flags in ((7, 0o40755, 0), (8, 0o100644, 1), (2**40, 0o100600, 3)):
        rec = InodeRecord(ino, mode, 1000, 1001, 2, 0, 11, 12, 13, flags, array("q"), array("Q"))
        raw = encode_op(rec)
        assert raw == general(rec)
        assert list(decode_ops(raw)) == [rec]
    with pytest.raises(ValueError):
        encode_op(InodeRecord(9, 0o100644, 0, 0, 1, 0, 1, 2, 3, 0, array("q"), array("Q", [5])))
