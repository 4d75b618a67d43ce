"""Superblock redundancy without a mount: the version-2 record (round trips, every
single-byte corruption rejected, member table limits, self-consistency), version-1
superblocks still read, and how a pool is opened from image files when a copy is
damaged: the backup stands in, a member with both copies damaged is rebuilt only by
``inspect_pool`` (fsck), a foreign signature is never silently overridden, and an
upgrade from version 1 that is interrupted is refused until it is completed.

The real-mount cases (every overwrite, mount / fsck / repair, every byte read back)
are in ``tests/mount/test_superblock.py``.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import random
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash

from kvfs.cli.offline import EXIT_CLEAN, EXIT_CORRECTED, EXIT_UNCORRECTED, fsck, upgrade
from kvfs.common.errors import Corruption, UserError
from kvfs.devices.pool import (
    Pool,
    format_pool,
    inspect_pool,
    open_for_upgrade,
    open_pool,
    upgraded,
)
from kvfs.format.geometry import new_pool
from kvfs.format.superblock import FORMAT_VERSION, MAX_MEMBERS, SB_BLOCK, Member, Superblock
from kvfs.testing.devices import MemoryDevice

MiB = 1 << 20
UNIT = 64 * 1024


# ----------------------------------------------------------------------------- helpers
def v2(count: int = 3, index: int = 1, seed: int = 0) -> Superblock:
    """A valid version-2 superblock of device ``index`` of a ``count``-device pool."""
    rng = random.Random(seed)
    unit = 1 << 20
    members = []
    for i in range(count):
        size = (rng.randrange(2, 64) << 30) + rng.randrange(0, 256) * 4096
        start = (9 if i == 0 else 1) * unit
        members.append(Member(rng.randbytes(16), size, start, (size - SB_BLOCK - start) // unit))
    own = members[index]
    return Superblock(
        pool_uuid=rng.randbytes(16),
        device_uuid=own.device_uuid,
        device_index=index,
        device_count=count,
        unit_size=unit,
        block_size=4096,
        device_size=own.device_size,
        data_start=own.data_start,
        data_units=own.data_units,
        meta_start=unit,
        meta_size=8 * unit,
        created_ns=1_700_000_000_000_000_000 + seed,
        pool_units=sum(m.data_units for m in members),
        label=f"pool-{seed}",
        backup_offset=own.device_size - SB_BLOCK,
        members=tuple(members),
    )


_V1 = struct.Struct("<8sII16s16sIIIIQQQQQQQ32s")


def encode_v1(sb: Superblock) -> bytes:
    """A version-1 superblock block, encoded independently of kvfs (docs/format.md of
    version 1: the 152-byte record, its xxh64, zero padding)."""
    body = _V1.pack(
        b"KVFSPOOL",
        1,
        _V1.size,
        sb.pool_uuid,
        sb.device_uuid,
        sb.device_index,
        sb.device_count,
        sb.unit_size,
        sb.block_size,
        sb.device_size,
        sb.data_start,
        sb.data_units,
        sb.meta_start,
        sb.meta_size,
        sb.created_ns,
        sb.pool_units,
        sb.label.encode(),
    )
    body += struct.pack("<Q", xxhash.xxh64_intdigest(body))
    return body + bytes(SB_BLOCK - len(body))


def v1_of(sbs: list[Superblock]) -> list[Superblock]:
    """The superblocks version 1 wrote for this layout: data units run to the device's
    end, metadata fields only on device 0, no backup, no member table."""
    unit = sbs[0].unit_size
    units = [(sb.device_size - sb.data_start) // unit for sb in sbs]
    return [
        dataclasses.replace(
            sb,
            version=1,
            data_units=n,
            meta_start=sb.meta_start if sb.device_index == 0 else 0,
            meta_size=sb.meta_size if sb.device_index == 0 else 0,
            pool_units=sum(units),
            backup_offset=0,
            members=(),
        )
        for sb, n in zip(sbs, units, strict=True)
    ]


def make_v1(paths: list[Path]) -> list[Superblock]:
    """Turn a freshly formatted (version-2) pool into the pool version 1 would have
    written: the same devices, log and data, version-1 superblocks, no backups. The
    journal entries of both versions are the same bytes."""
    pool = open_pool([str(p) for p in paths])
    sbs = list(pool.superblocks)
    pool.close()
    old = v1_of(sbs)
    for sb, o in zip(sbs, old, strict=True):
        path = paths[sb.device_index]
        overwrite(path, 0, encode_v1(o))
        overwrite(path, sb.backup_offset, bytes(SB_BLOCK))
    return old


def overwrite(path: Path | str, offset: int, data: bytes) -> None:
    """Write ``data`` (a multiple of 4096 bytes) at ``offset`` of an unmounted image
    file or block device, with O_DIRECT where possible, durably."""
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        except OSError:
            fd = os.open(path, os.O_RDWR)
        try:
            assert os.pwritev(fd, [buf], offset) == len(data)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        buf.close()


def read_at(path: Path | str, offset: int, n: int = SB_BLOCK) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def forge(sb: Superblock, patch: Callable[[bytearray], None]) -> bytes:
    """``sb``'s block with ``patch`` applied and the checksum made valid again: a block
    only a bug could write."""
    block = bytearray(sb.encode())
    patch(block)
    block[-8:] = struct.pack("<Q", xxhash.xxh64_intdigest(bytes(block[:-8])))
    return bytes(block)


def images(tmp_path: Path, *sizes: int) -> list[Path]:
    out = []
    for i, size in enumerate(sizes):
        p = tmp_path / f"d{i}.img"
        with open(p, "wb") as f:
            f.truncate(size)
        out.append(p)
    return out


def formatted(tmp_path: Path, *sizes: int) -> tuple[list[Path], list[Superblock]]:
    paths = images(tmp_path, *sizes)
    sbs = format_pool([str(p) for p in paths], unit_size=UNIT, meta_size=8 * MiB)
    return paths, sbs


def garbage(seed: object) -> bytes:
    return random.Random(repr(seed)).randbytes(SB_BLOCK)


def opened(paths: list[Path], **kw: bool) -> Pool:
    pool = open_pool([str(p) for p in paths], **kw)
    pool.close()
    return pool


# ----------------------------------------------------------------------------- the record
@pytest.mark.parametrize("count", [1, 2, 7, MAX_MEMBERS])
def test_version_2_round_trip(count: int) -> None:
    for index in {0, count // 2, count - 1}:
        sb = v2(count, index, seed=count * 100 + index)
        block = sb.encode()
        assert len(block) == SB_BLOCK
        assert Superblock.decode(block) == sb
        assert Superblock.decode(block).encode() == block
        assert sb.member == sb.members[index]


@pytest.mark.parametrize("xor", [0x01, 0x80, 0xFF])
def test_every_single_byte_corruption_of_a_full_member_table_is_rejected(xor: int) -> None:
    block = v2(MAX_MEMBERS, 5).encode()
    for i in range(SB_BLOCK):
        bad = bytearray(block)
        bad[i] ^= xor
        with pytest.raises(Corruption):
            Superblock.decode(bytes(bad))


def test_truncated_version_2_superblock_is_corruption() -> None:
    block = v2().encode()
    for n in (0, 8, 160, 4095):
        with pytest.raises(Corruption):
            Superblock.decode(block[:n])


def test_member_table_limits() -> None:
    assert MAX_MEMBERS == 64
    sb = v2(MAX_MEMBERS, MAX_MEMBERS - 1)
    assert Superblock.decode(sb.encode()) == sb
    extra = (*sb.members, Member(bytes(16), 1 << 30, 1 << 20, 10))
    with pytest.raises(ValueError, match="member table"):
        dataclasses.replace(sb, device_count=MAX_MEMBERS + 1, members=extra).encode()
    with pytest.raises(ValueError, match="member table of 63 rows for 64"):
        dataclasses.replace(sb, members=sb.members[:-1]).encode()
    for count in (0, MAX_MEMBERS + 1, 1000):
        block = forge(sb, lambda b, c=count: struct.pack_into("<I", b, 52, c))  # type: ignore[misc]
        with pytest.raises(Corruption, match="device count"):
            Superblock.decode(block)


def test_format_refuses_more_members_than_the_table_holds(tmp_path: Path) -> None:
    paths = [str(tmp_path / f"d{i}.img") for i in range(MAX_MEMBERS + 1)]
    with pytest.raises(UserError, match="at most 64 devices, 65 given"):
        format_pool(paths)
    assert not any(os.path.exists(p) for p in paths)  # refused before opening anything


@pytest.mark.parametrize(
    ("what", "patch"),
    [
        ("device index", lambda b: struct.pack_into("<I", b, 48, 3)),
        ("contradicts", lambda b: struct.pack_into("<Q", b, 80, 7)),  # data_units
        ("contradicts", lambda b: b.__setitem__(slice(160 + 40, 176 + 40), bytes(16))),
        ("backup at", lambda b: struct.pack_into("<Q", b, 152, 0)),
        ("pool units", lambda b: struct.pack_into("<Q", b, 112, 1)),
        ("unit size", lambda b: struct.pack_into("<I", b, 56, 3 << 19)),
        ("padding", lambda b: b.__setitem__(4000, 1)),
    ],
)
def test_a_checksummed_but_inconsistent_superblock_is_rejected(
    what: str, patch: Callable[[bytearray], None]
) -> None:
    with pytest.raises(Corruption, match=what):
        Superblock.decode(forge(v2(3, 1), patch))


def test_data_units_overlapping_the_backup_are_rejected() -> None:
    sb = v2(2, 0)
    rows = (dataclasses.replace(sb.members[0]), dataclasses.replace(sb.members[1]))
    big = dataclasses.replace(rows[1], data_units=rows[1].data_units + 1)
    bad = dataclasses.replace(sb, members=(rows[0], big), pool_units=sb.pool_units + 1)
    with pytest.raises(ValueError, match="overlap the backup"):
        bad.encode()


def test_version_1_superblocks_still_decode() -> None:
    for seed in range(5):
        new = v2(3, seed % 3, seed)
        (old,) = v1_of([new])[:1]
        got = Superblock.decode(encode_v1(old))
        assert got == old
        assert (got.version, got.backup_offset, got.members) == (1, 0, ())
    with pytest.raises(ValueError, match="version 1"):
        old.encode()  # kvfs reads version 1 but never writes it


@pytest.mark.parametrize("xor", [0x01, 0xFF])
def test_every_single_byte_corruption_of_a_version_1_superblock_is_rejected(xor: int) -> None:
    block = encode_v1(v1_of([v2(3, 1)])[0])
    for i in range(SB_BLOCK):
        bad = bytearray(block)
        bad[i] ^= xor
        with pytest.raises(Corruption):
            Superblock.decode(bytes(bad))


def test_upgraded_keeps_identities_and_frees_only_the_last_block() -> None:
    unit = UNIT
    devs = [MemoryDevice(s) for s in (40 * MiB, 24 * MiB, 24 * MiB + 8192)]
    new = new_pool(list(devs), unit, 8 * MiB, "x")
    old = v1_of(new)
    assert [o.data_units - n.data_units for o, n in zip(old, new, strict=True)] == [1, 1, 0]
    again = upgraded(old)
    assert again == new  # the same superblocks format would have written
    assert upgraded(again) == again  # idempotent: completes an interrupted upgrade
    assert upgraded([*again[:1], *old[1:]]) == new


def test_layout_leaves_the_last_block_to_the_backup_and_uses_the_rest() -> None:
    for sizes in ([32 * MiB], [32 * MiB, 20 * MiB + 4096], [24 * MiB, 24 * MiB - 4096]):
        devs = [MemoryDevice(s) for s in sizes]
        sbs = new_pool(list(devs), UNIT, 8 * MiB, "")
        for sb in sbs:
            assert Superblock.decode(sb.encode()) == sb
            end = sb.data_start + sb.data_units * UNIT
            assert end <= sb.backup_offset == sb.device_size - SB_BLOCK
            assert sb.backup_offset - end < UNIT  # all of each device, less a unit at most
            assert (sb.meta_start, sb.meta_size) == (sbs[0].meta_start, sbs[0].meta_size)


# ----------------------------------------------------------------------------- opening
def test_format_writes_two_identical_copies(tmp_path: Path) -> None:
    paths, sbs = formatted(tmp_path, 32 * MiB, 24 * MiB)
    for p, sb in zip(paths, sbs, strict=True):
        assert read_at(p, 0) == read_at(p, sb.backup_offset) == sb.encode()
        assert sb.backup_offset == p.stat().st_size - SB_BLOCK
    pool = opened(paths)
    assert pool.damage == [] and pool.version == FORMAT_VERSION


@pytest.mark.parametrize(("index", "copy"), [(0, "primary"), (0, "backup"), (1, "primary")])
def test_one_damaged_copy_is_listed_and_healed(tmp_path: Path, index: int, copy: str) -> None:
    paths, sbs = formatted(tmp_path, 32 * MiB, 24 * MiB)
    sb = sbs[index]
    offset = 0 if copy == "primary" else sb.backup_offset
    overwrite(paths[index], offset, garbage((index, copy)))
    pool = opened(paths)
    assert pool.superblocks == sbs
    assert [(d.index, d.copy) for d in pool.damage] == [(index, copy)]
    assert f"device {index + 1} ({paths[index]}): {copy} superblock copy damaged" in str(
        pool.damage[0]
    )
    assert read_at(paths[index], offset) != sb.encode()  # opening alone writes nothing
    assert opened(paths, heal=True).damage == []
    assert read_at(paths[index], offset) == sb.encode()
    assert opened(paths).damage == []


def test_a_stale_but_valid_backup_counts_as_damaged(tmp_path: Path) -> None:
    paths, sbs = formatted(tmp_path, 32 * MiB, 24 * MiB)
    other = dataclasses.replace(sbs[1], label="other")
    overwrite(paths[1], sbs[1].backup_offset, other.encode())
    (damage,) = opened(paths).damage
    assert (damage.copy, damage.reason) == ("backup", "it differs from the primary copy")


def test_both_copies_damaged_is_refused_by_open_and_rebuilt_by_inspect(tmp_path: Path) -> None:
    paths, sbs = formatted(tmp_path, 32 * MiB, 24 * MiB)
    for offset in (0, sbs[1].backup_offset):
        overwrite(paths[1], offset, garbage(offset))
    with pytest.raises(UserError, match="both superblock copies are damaged") as e:
        opened(paths)
    assert "it can only be device 2 of the pool: kvfs fsck --repair" in str(e.value)
    pool = inspect_pool([str(p) for p in paths])
    pool.close()
    assert [sb.device_uuid for sb in pool.superblocks] == [sb.device_uuid for sb in sbs]
    assert pool.superblocks[1] == sbs[1]  # rebuilt exactly, from device 1's member table
    (damage,) = pool.damage
    assert (damage.index, damage.copy, damage.offsets) == (1, "both", (0, sbs[1].backup_offset))


def test_both_copies_of_device_0_are_rebuilt_from_device_1(tmp_path: Path) -> None:
    paths, sbs = formatted(tmp_path, 32 * MiB, 24 * MiB)
    for offset in (0, sbs[0].backup_offset):
        overwrite(paths[0], offset, garbage(offset))
    pool = inspect_pool([str(p) for p in reversed(paths)])
    pool.close()
    assert pool.superblocks == sbs  # metadata geometry included: it is in every member
    out: list[str] = []
    assert fsck([str(p) for p in paths], repair=True, out=out.append) == EXIT_CORRECTED, out
    assert any("its metadata log parses" in line for line in out), out
    assert opened(paths).damage == []


def test_rebuild_needs_exactly_one_unknown_device_and_one_free_slot(tmp_path: Path) -> None:
    paths, sbs = formatted(tmp_path, 32 * MiB, 24 * MiB, 24 * MiB)
    for i in (1, 2):
        for offset in (0, sbs[i].backup_offset):
            overwrite(paths[i], offset, garbage((i, offset)))
    with pytest.raises(UserError, match="damaged or foreign superblock"):
        inspect_pool([str(p) for p in paths])  # two unknown devices, two free slots
    with pytest.raises(UserError, match="damaged or foreign superblock"):
        inspect_pool([str(paths[0]), str(paths[1])])  # one unknown, two free slots


def test_a_rebuild_that_the_content_does_not_prove_is_not_written(tmp_path: Path) -> None:
    """A blank device named in place of a member that holds file data is not made that
    member: fsck stops before checking (or dropping) anything."""
    paths, sbs = formatted(tmp_path, 32 * MiB, 24 * MiB)
    _store_files(paths)
    blank = tmp_path / "blank.img"
    with open(blank, "wb") as f:
        f.truncate(24 * MiB)
    out: list[str] = []
    devs = [str(paths[0]), str(blank)]
    assert fsck(devs, repair=True, out=out.append) == EXIT_UNCORRECTED, out
    assert any("is not rebuilt as device 2: none of" in line for line in out), out
    assert not any(read_at(blank, 0)) and not any(read_at(blank, sbs[1].backup_offset))
    assert fsck([str(p) for p in paths], out=out.append) == EXIT_CLEAN, out


def test_backup_of_a_device_that_grew_is_found_through_the_member_table(tmp_path: Path) -> None:
    paths, sbs = formatted(tmp_path, 32 * MiB, 24 * MiB)
    with open(paths[1], "r+b") as f:
        f.truncate(28 * MiB)  # grown since format: its backup is not in its last block
    overwrite(paths[1], 0, garbage("grown"))
    pool = opened(paths, heal=True)
    assert [(d.index, d.copy) for d in pool.damage] == []
    assert read_at(paths[1], 0) == sbs[1].encode()


def test_a_foreign_signature_over_the_primary_is_not_overridden_by_mount(tmp_path: Path) -> None:
    paths, _ = formatted(tmp_path, 32 * MiB, 24 * MiB)
    block = bytearray(SB_BLOCK)
    block[1080:1082] = b"\x53\xef"  # what mkfs.ext4 leaves
    overwrite(paths[1], 0, bytes(block))
    with pytest.raises(UserError, match="holds an ext2/3/4 filesystem where its kvfs superblock"):
        opened(paths, heal=True)
    assert read_at(paths[1], 0) == bytes(block)
    pool = inspect_pool([str(p) for p in paths])  # fsck: reported, repairable on request
    pool.close()
    assert "carries an ext2/3/4 filesystem signature" in pool.damage[0].reason
    out: list[str] = []
    assert fsck([str(p) for p in paths], out=out.append) == EXIT_UNCORRECTED, out
    assert read_at(paths[1], 0) == bytes(block)
    assert fsck([str(p) for p in paths], repair=True, out=out.append) == EXIT_CORRECTED, out
    assert opened(paths, heal=True).damage == []


def test_format_refuses_a_member_known_only_by_its_backup(tmp_path: Path) -> None:
    paths, _ = formatted(tmp_path, 32 * MiB, 24 * MiB)
    overwrite(paths[1], 0, bytes(SB_BLOCK))
    with pytest.raises(UserError, match=r"device 2 of 2\) \(by its backup superblock"):
        format_pool([str(paths[1])], unit_size=UNIT, meta_size=8 * MiB)
    format_pool([str(paths[1])], unit_size=UNIT, meta_size=8 * MiB, force=True)


def _store_files(paths: list[Path]) -> None:
    """Put a few checksummed files on every device of the pool (through the store)."""
    import trio

    from kvfs.index.namespace import ROOT_INO
    from kvfs.store.facade import Store, StoreConfig

    async def main(pool: Pool) -> None:
        store = Store(pool, StoreConfig(cache_bytes=4 * MiB, default_policy="engine-managed"))
        store.load()
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            for i in range(4):
                inode = await store.create(ROOT_INO, f"f{i}".encode(), 0o100644)
                fh = await store.open(inode.ino, os.O_RDWR)
                data = random.Random(i).randbytes(40 * UNIT)
                for off in range(0, len(data), UNIT):
                    await store.write(fh, off, data[off : off + UNIT])
                await store.commit(inode)
                await store.release(fh)
            await store.close()
            nursery.cancel_scope.cancel()

    pool = open_pool([str(p) for p in paths])
    try:
        trio.run(main, pool)
    finally:
        pool.close()


# ----------------------------------------------------------------------------- upgrade
def test_upgrade_of_a_version_1_pool_in_place(tmp_path: Path) -> None:
    paths, sbs = formatted(tmp_path, 32 * MiB, 24 * MiB)
    old = make_v1(paths)
    pool = opened(paths)
    assert pool.version == 1 and pool.superblocks == old and pool.damage == []
    out: list[str] = []
    assert fsck([str(p) for p in paths], out=out.append) == EXIT_CLEAN, out
    assert any("format version 1 has no backup superblocks" in line for line in out), out
    lines = upgrade([str(p) for p in paths])
    assert lines[-1] == "upgraded to format version 2 (2 unit(s) gave way)", lines
    assert opened(paths).superblocks == sbs
    for p, sb in zip(paths, sbs, strict=True):
        assert read_at(p, 0) == read_at(p, sb.backup_offset) == sb.encode()
    assert upgrade([str(p) for p in paths]) == [
        "pool is already at format version 2: nothing to do"
    ]


def test_an_interrupted_upgrade_is_refused_until_upgrade_completes_it(tmp_path: Path) -> None:
    paths, sbs = formatted(tmp_path, 32 * MiB, 24 * MiB)
    old = make_v1(paths)
    overwrite(paths[0], sbs[0].backup_offset, sbs[0].encode())  # upgrade got this far:
    overwrite(paths[0], 0, sbs[0].encode())  # both backups and the first primary
    overwrite(paths[1], sbs[1].backup_offset, sbs[1].encode())
    with pytest.raises(UserError, match="upgrade to format version 2 was interrupted"):
        opened(paths)
    pool = open_for_upgrade([str(p) for p in paths])
    pool.close()
    assert pool.superblocks == [sbs[0], old[1]]
    upgrade([str(p) for p in paths])
    assert opened(paths).superblocks == sbs


def test_format_lists_every_device_when_sizes_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfs.cli import main

    paths = images(tmp_path, 48 * MiB, 32 * MiB + 12 * 4096)
    assert main(["format", "--meta-size", "8M", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "devices differ in size; all of each is used:" in out, out
    sbs = opened(paths).superblocks
    assert [sb.data_units for sb in sbs] == [38, 31]  # 1 MiB units: the last block is the backup's
    for p, sb in zip(paths, sbs, strict=True):
        assert f"  device {sb.device_index + 1} {p}: " in out
        assert f", {sb.data_units} units = " in out
    (tmp_path / "same").mkdir()
    same = images(tmp_path / "same", 32 * MiB, 32 * MiB)
    assert main(["format", "--meta-size", "8M", *map(str, same)]) == 0
    assert "differ" not in capsys.readouterr().out
