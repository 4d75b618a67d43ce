"""A pool: the set of devices one kvfs instance owns, tied by their superblocks.

Formatting and opening are synchronous and run before the trio loop starts (or in a
worker thread); every problem a user can cause is a :class:`UserError` with one line.

Every member keeps its superblock twice (offset 0 and its last block) and every
superblock lists all members (``docs/format.md``). Opening reads the primary copy,
else the backup; a member with neither is identified only by elimination (the one
slot of the member tables no other device fills), and only ``fsck --repair`` rebuilds
it. Damaged copies are listed in ``Pool.damage``; a mount rewrites them
(``open_pool(heal=True)``), fsck reports them and ``--repair`` rewrites them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import time
import uuid
from dataclasses import dataclass, field

from kvfs.common.errors import Corruption, DeviceError, UserError
from kvfs.devices.device import (
    ALIGN,
    Device,
    FileDevice,
    MissingDevice,
    aligned_buffer,
    member_identity,
)
from kvfs.format.geometry import DEFAULT_UNIT, new_pool, unit_for
from kvfs.format.halves import encode_checkpoint, half_bounds
from kvfs.format.nsimage import image_payloads
from kvfs.format.nsparts import root_snapshot
from kvfs.format.records import Image
from kvfs.format.superblock import (
    FORMAT_VERSION,
    MAX_MEMBERS,
    RESERVED_HEAD,
    SB_BLOCK,
    SIGNATURE_PROBE,
    Member,
    Superblock,
    foreign_signature,
    with_article,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CopyDamage:
    """Superblock copies of one member that do not hold its superblock: ``block`` (the
    intact copy, or the rebuilt superblock) belongs at each of ``offsets``."""

    index: int
    path: str
    copy: str
    """"primary", "backup" or "both" (rebuilt from the other members' tables)."""
    reason: str
    block: bytes = field(repr=False)
    offsets: tuple[int, ...]

    def __str__(self) -> str:
        where = f"device {self.index + 1} ({self.path})"
        if self.copy == "both":
            return (
                f"{where}: both superblock copies are damaged ({self.reason}); it is the "
                f"only device the member tables leave for slot {self.index + 1}"
            )
        other = "backup" if self.copy == "primary" else "primary"
        return (
            f"{where}: {self.copy} superblock copy damaged ({self.reason}); the {other} is intact"
        )


@dataclass
class Pool:
    """Open devices of one pool, ordered by device index."""

    devices: list[Device]
    superblocks: list[Superblock]
    damage: list[CopyDamage] = field(default_factory=list)
    """Superblock copies to rewrite (``rewrite_copies``)."""

    @property
    def version(self) -> int:
        return min(sb.version for sb in self.superblocks)

    @property
    def unit_size(self) -> int:
        return self.superblocks[0].unit_size

    @property
    def seed(self) -> int:
        """Checksum seed of this pool's metadata, from its UUID."""
        return self.superblocks[0].log_seed

    @property
    def meta(self) -> tuple[Device, int, int]:
        sb = self.superblocks[0]
        return self.devices[0], sb.meta_start, sb.meta_size

    def unit_offset(self, dev: int, unit: int) -> int:
        return self.superblocks[dev].data_start + unit * self.unit_size

    @property
    def missing(self) -> list[int]:
        """Indexes of devices absent from a degraded pool."""
        return [i for i, d in enumerate(self.devices) if isinstance(d, MissingDevice)]

    def close(self) -> None:
        for dev in self.devices:
            dev.close()


def _read_head(dev: Device, size: int) -> bytes:
    n = min(size, dev.size)
    n -= n % ALIGN
    buf = aligned_buffer(n)
    try:
        dev.read_into(0, memoryview(buf)[:n])
        return bytes(buf[:n])
    finally:
        buf.close()


def _open_all(paths: list[str]) -> list[Device]:
    if not paths:
        raise UserError("no devices given")
    named: dict[tuple[str, int, int], str] = {}
    for p in paths:  # by what each is: an image file and a loop device over it are one
        other = named.setdefault(member_identity(p), p)
        if other is not p:
            both = p if os.path.realpath(other) == os.path.realpath(p) else f"{other} and {p}"
            raise UserError(f"the same device is named twice ({both})")
    devices: list[Device] = []
    try:
        for p in paths:
            devices.append(FileDevice(p))
    except BaseException:
        for d in devices:
            d.close()
        raise
    return devices


def format_pool(
    paths: list[str],
    *,
    unit_size: int = DEFAULT_UNIT,
    meta_size: int = 0,
    force: bool = False,
    label: str = "",
    mean_file_size: int = 0,
) -> list[Superblock]:
    """Write a new, empty pool onto ``paths`` (destroys what they hold). The metadata
    area is ``meta_size``, or sized for a full pool of files of ``mean_file_size``
    (default: one unit each; ``default_meta_size``)."""
    if len(paths) > MAX_MEMBERS:
        raise UserError(f"a pool has at most {MAX_MEMBERS} devices, {len(paths)} given")
    devices = _open_all(paths)
    try:
        for dev in devices:
            _check_formattable(dev, force)
        unit = unit_for(devices, unit_size)
        sbs = new_pool(devices, unit, meta_size, label, mean_file_size)
        _write_empty_pool(devices, sbs)
        return sbs
    finally:
        for d in devices:
            d.close()


def _check_formattable(dev: Device, force: bool) -> None:
    head = _read_head(dev, SIGNATURE_PROBE)
    if force:
        return
    try:
        sb = Superblock.decode(head[:SB_BLOCK])
        which = ""
    except Corruption:
        sig = foreign_signature(head)
        if sig:
            raise UserError(
                f"{dev.path} holds {with_article(sig)}; refusing to overwrite it (use --force)"
            ) from None
        found = _backup_at(dev, dev.size - SB_BLOCK)
        if isinstance(found, str):
            return
        sb, which = found, " (by its backup superblock; the primary is damaged)"
    raise UserError(
        f"{dev.path} already belongs to kvfs pool {uuid.UUID(bytes=sb.pool_uuid)} "
        f"(device {sb.device_index + 1} of {sb.device_count}){which}; use --force to reformat"
    )


def _write_empty_pool(devices: list[Device], sbs: list[Superblock]) -> None:
    sb0 = sbs[0]
    seed = sb0.log_seed
    root = root_snapshot(os.getuid(), os.getgid(), time.time_ns(), stat.S_IFDIR | 0o755)
    image = (Image(p) for p in image_payloads(root) if p)  # a namespace of its root only
    data, _, _ = encode_checkpoint(image, 1, 0, seed)
    meta = devices[0]
    for half in (1, 0):  # invalidate whatever log was there, then write generation 1
        base, _ = half_bounds(sb0.meta_start, sb0.meta_size, half)
        blob = data if half == 0 else bytes(ALIGN)
        _write(meta, base, blob)
    meta.flush()
    for dev, sb in zip(devices, sbs, strict=True):
        block = sb.encode()
        _write(dev, 0, block)
        _write(dev, sb.backup_offset, block)
        dev.flush()
        dev.discard(sb.data_start, sb.data_units * sb.unit_size)


def _write(dev: Device, offset: int, data: bytes) -> None:
    n = -(-len(data) // ALIGN) * ALIGN
    buf = aligned_buffer(n)
    try:
        buf[: len(data)] = data
        dev.write(offset, [memoryview(buf)[:n]])
    finally:
        buf.close()


def open_pool(paths: list[str], degraded: bool = False, heal: bool = False) -> Pool:
    """Open and cross-check the devices of one pool (any order on the command line).
    With ``degraded``, devices other than device 0 may be missing. With ``heal`` (a
    mount), damaged superblock copies are rewritten from the intact ones, each with a
    WARNING. A member whose copies are both damaged is refused (``inspect_pool``)."""
    devices = _open_all(paths)
    try:
        pool = _assemble(_read_members(devices), degraded)
        if heal:
            _heal(pool)
        return pool
    except BaseException:
        for d in devices:
            d.close()
        raise


def inspect_pool(paths: list[str]) -> Pool:
    """Open a pool for fsck, writing nothing: like ``open_pool``, but a member known only
    by its backup copy is accepted even under a foreign signature, and a member with
    both copies damaged gets a superblock rebuilt (in memory, listed in ``damage``)
    when it is the only unidentified device and exactly one slot of the member
    tables is unaccounted for. fsck proves the rebuilt identity before writing it."""
    devices = _open_all(paths)
    try:
        return _assemble(_read_members(devices), salvage=True)
    except BaseException:
        for d in devices:
            d.close()
        raise


def open_for_upgrade(paths: list[str]) -> Pool:
    """Open every device of a pool of version 1, 2 or both (an interrupted upgrade)."""
    devices = _open_all(paths)
    try:
        return _assemble(_read_members(devices), mixed=True)
    except BaseException:
        for d in devices:
            d.close()
        raise


def rewrite_copies(pool: Pool) -> list[str]:
    """Write every copy in ``pool.damage`` (then clear it); one line per member done."""
    done = []
    while pool.damage:
        d = pool.damage[0]
        dev = pool.devices[d.index]
        for offset in d.offsets:
            _write(dev, offset, d.block)
        dev.flush()
        pool.damage.pop(0)
        copies = "both superblock copies" if len(d.offsets) > 1 else f"the {d.copy} superblock"
        done.append(f"device {d.index + 1} ({d.path}): rewrote {copies}")
    return done


def _heal(pool: Pool) -> None:
    if pool.version < FORMAT_VERSION:
        log.warning(
            "pool is format version %d: no backup superblocks (kvfs upgrade DEV... adds them)",
            pool.version,
        )
    for d in pool.damage:
        log.warning("%s: rewriting it from the intact copy", d)
    try:
        rewrite_copies(pool)
    except DeviceError as e:
        log.warning("could not rewrite a superblock copy: %s", e)


def upgraded(sbs: list[Superblock]) -> list[Superblock]:
    """Version-2 superblocks for the members of a pool (``sbs`` in index order, of
    version 1 or 2): identities and data areas kept, except that every device's data
    units now end before its last block, where the backup copy goes."""
    unit = sbs[0].unit_size
    rows = tuple(
        Member(
            sb.device_uuid,
            sb.device_size,
            sb.data_start,
            min(sb.data_units, (sb.device_size - SB_BLOCK - sb.data_start) // unit),
        )
        for sb in sbs
    )
    return [
        dataclasses.replace(
            sb,
            version=FORMAT_VERSION,
            data_units=row.data_units,
            meta_start=sbs[0].meta_start,
            meta_size=sbs[0].meta_size,
            pool_units=sum(r.data_units for r in rows),
            backup_offset=sb.device_size - SB_BLOCK,
            members=rows,
        )
        for sb, row in zip(sbs, rows, strict=True)
    ]


def write_superblocks(pool: Pool, sbs: list[Superblock]) -> None:
    """Replace every member's superblock by ``sbs`` (index order): all backups first,
    then the primaries, each device flushed. Until the first primary is written the
    pool reads as it was; an interruption after it leaves a pool of mixed versions,
    which only ``kvfs upgrade`` opens (and completes)."""
    blocks = [sb.encode() for sb in sbs]
    for dev, sb, block in zip(pool.devices, sbs, blocks, strict=True):
        _write(dev, sb.backup_offset, block)
        dev.flush()
    for dev, block in zip(pool.devices, blocks, strict=True):
        _write(dev, 0, block)
        dev.flush()
    pool.superblocks = list(sbs)


# ----------------------------------------------------------------------------- reading
@dataclass
class _Found:
    """What one device holds: its superblock (from the primary copy, else the backup)
    and why a copy is not usable."""

    dev: Device
    sb: Superblock | None = None
    block: bytes = b""
    """The raw block ``sb`` was read from."""
    head: bytes = b""
    primary_error: str | None = None
    backup_error: str | None = None
    foreign: str | None = None
    """A foreign signature in the head of a device whose primary copy is damaged."""


def _read_block(dev: Device, offset: int) -> bytes:
    buf = aligned_buffer(SB_BLOCK)
    try:
        dev.read_into(offset, memoryview(buf)[:SB_BLOCK])
        return bytes(buf[:SB_BLOCK])
    finally:
        buf.close()


def _backup_at(dev: Device, offset: int) -> Superblock | str:
    """The version-2 superblock whose backup copy is at ``offset``, or why not."""
    if offset < RESERVED_HEAD or offset + SB_BLOCK > dev.size:
        return "no room for a backup there"
    try:
        sb = Superblock.decode(_read_block(dev, offset))
    except (Corruption, DeviceError) as e:
        return str(e)
    if sb.backup_offset != offset:
        return f"a superblock whose backup belongs at {sb.backup_offset}, not {offset}"
    return sb


def _read_member(dev: Device) -> _Found:
    found = _Found(dev)
    try:
        found.head = _read_head(dev, SIGNATURE_PROBE)
        found.block = found.head[:SB_BLOCK]
        found.sb = Superblock.decode(found.block)
    except (Corruption, DeviceError) as e:
        found.primary_error = str(e)
        found.foreign = foreign_signature(found.head) if found.head else None
        _find_backup(found, [dev.size - SB_BLOCK])
        return found
    sb = found.sb
    if sb.device_size > dev.size:
        raise UserError(f"{dev.path} is smaller than when it was formatted")
    if sb.version >= 2:
        try:
            backup = _read_block(dev, sb.backup_offset)
        except DeviceError as e:
            found.backup_error = str(e)
            return found
        if backup != found.block:
            try:
                Superblock.decode(backup)
                found.backup_error = "it differs from the primary copy"
            except Corruption as e:
                found.backup_error = str(e)
    return found


def _find_backup(found: _Found, offsets: list[int]) -> None:
    for offset in offsets:
        sb = _backup_at(found.dev, offset)
        if isinstance(sb, Superblock):
            found.sb, found.block, found.backup_error = sb, _read_block(found.dev, offset), None
            return
        if found.backup_error is None:
            found.backup_error = sb


def _read_members(devices: list[Device]) -> list[_Found]:
    """Read every device; a device without a usable copy at its current end is looked
    for at the ends the member tables record (it may have grown since format)."""
    found = [_read_member(d) for d in devices]
    sizes = {m.device_size for f in found if f.sb for m in f.sb.members}
    for f in found:
        if f.sb is None:
            _find_backup(f, sorted(s - SB_BLOCK for s in sizes if s < f.dev.size))
    return found


# ----------------------------------------------------------------------------- assembling
def _assemble(
    found: list[_Found], degraded: bool = False, salvage: bool = False, mixed: bool = False
) -> Pool:
    known = [f for f in found if f.sb is not None]
    unknown = [f for f in found if f.sb is None]
    if not known:
        raise _unidentified(unknown[0], None)
    sbs = [f.sb for f in known if f.sb is not None]
    _check_one_pool(sbs, mixed)
    if not salvage:
        for f in known:
            if f.primary_error and f.foreign:
                raise _foreign_over_backup(f)
    damage = [d for f in known for d in _damage_of(f)]
    indexes = sorted(sb.device_index for sb in sbs)
    if len(set(indexes)) != len(indexes):
        raise UserError("two of the given devices claim the same place in the pool")
    if unknown:
        slot = _free_slot(unknown, indexes, sbs)
        if slot is None or not salvage:
            raise _unidentified(unknown[0], slot)
        rebuilt = _rebuilt(sbs, slot, unknown[0])
        unknown[0].sb = rebuilt
        damage.append(_both(unknown[0], rebuilt))
        known.append(unknown[0])
        sbs.append(rebuilt)
        indexes = sorted([*indexes, slot])
    devices = [f.dev for f in known]
    count = sbs[0].device_count
    if indexes != list(range(count)):
        missing = sorted(set(range(count)) - set(indexes))
        if not degraded or 0 in missing:
            raise UserError(_missing_members(devices, sbs, missing))
        for i in missing:
            log.warning(
                "member %d of %d is missing: mounting degraded; files with data on it "
                "are unreadable until it returns",
                i + 1,
                count,
            )
            # a stand-in: every request fails, and it has no units to allocate
            devices.append(MissingDevice(f"<missing member {i + 1}>"))
            sbs.append(
                dataclasses.replace(
                    sbs[0],
                    device_uuid=bytes(16),  # unknown: only the member itself records it
                    device_index=i,
                    data_units=0,
                    meta_start=0,
                    meta_size=0,
                )
            )
    order = sorted(range(len(sbs)), key=lambda i: sbs[i].device_index)
    return Pool([devices[i] for i in order], [sbs[i] for i in order], damage)


def _check_one_pool(sbs: list[Superblock], mixed: bool) -> None:
    """The superblocks describe one pool: same UUID, version and geometry, and every
    version-2 member carries the same member table."""
    if len({sb.pool_uuid for sb in sbs}) > 1:
        raise UserError("the devices belong to different kvfs pools")
    if len({sb.version for sb in sbs}) > 1 and not mixed:
        raise UserError(
            "the pool's upgrade to format version 2 was interrupted: run kvfs upgrade "
            "with all its devices again"
        )
    if len({(sb.unit_size, sb.device_count) for sb in sbs}) > 1:
        raise UserError("device superblocks disagree on the pool geometry")
    if len({sb.pool_units for sb in sbs if sb.version == 1}) > 1:
        raise UserError("device superblocks disagree on the pool geometry")
    if len({sb.pool_part() for sb in sbs if sb.version >= 2}) > 1:
        raise UserError("device superblocks disagree on the pool geometry (member tables)")


def _damage_of(f: _Found) -> list[CopyDamage]:
    sb = f.sb
    assert sb is not None
    if f.primary_error:
        sig = f"; it carries {with_article(f.foreign)} signature" if f.foreign else ""
        reason = f.primary_error + sig
        return [CopyDamage(sb.device_index, f.dev.path, "primary", reason, f.block, (0,))]
    if f.backup_error and sb.version >= 2:
        offsets = (sb.backup_offset,)
        return [CopyDamage(sb.device_index, f.dev.path, "backup", f.backup_error, f.block, offsets)]
    return []


def _free_slot(unknown: list[_Found], indexes: list[int], sbs: list[Superblock]) -> int | None:
    """The one slot an unidentified device can fill: exactly one such device, one slot
    of the (version-2) member tables that no identified device fills, and the device
    is at least as large as that slot's member was."""
    tables = [sb for sb in sbs if sb.version >= 2]
    if len(unknown) != 1 or not tables:
        return None
    free = sorted(set(range(tables[0].device_count)) - set(indexes))
    if len(free) != 1 or tables[0].members[free[0]].device_size > unknown[0].dev.size:
        return None
    return free[0]


def _rebuilt(sbs: list[Superblock], slot: int, f: _Found) -> Superblock:
    """Member ``slot``'s superblock, from another member's and the member table."""
    ref = next(sb for sb in sbs if sb.version >= 2)
    row = ref.members[slot]
    return dataclasses.replace(
        ref,
        device_uuid=row.device_uuid,
        device_index=slot,
        block_size=f.dev.logical_block,
        device_size=row.device_size,
        data_start=row.data_start,
        data_units=row.data_units,
        backup_offset=row.device_size - SB_BLOCK,
    )


def _both(f: _Found, sb: Superblock) -> CopyDamage:
    reason = f"primary: {f.primary_error}; backup: {f.backup_error}"
    return CopyDamage(
        sb.device_index, f.dev.path, "both", reason, sb.encode(), (0, sb.backup_offset)
    )


def _foreign_over_backup(f: _Found) -> UserError:
    sb = f.sb
    assert sb is not None
    foreign = with_article(f.foreign or "foreign format")
    return UserError(
        f"{f.dev.path} holds {foreign} where its kvfs superblock was (the backup copy "
        f"says device {sb.device_index + 1} of pool {uuid.UUID(bytes=sb.pool_uuid)}); "
        "if that was written by mistake, kvfs fsck --repair restores the superblock"
    )


def _unidentified(f: _Found, slot: int | None) -> UserError:
    """Why a device without a usable superblock copy cannot be opened."""
    path = f.dev.path
    if not f.foreign and (not f.head or not any(f.head[:SB_BLOCK])):
        # never written (or wiped): a blank device, not a damaged member to rebuild
        return UserError(_no_superblock(path, f.dev.size))
    if slot is not None:
        sig = f" (it carries {with_article(f.foreign)} signature)" if f.foreign else ""
        return UserError(
            f"{path}: both superblock copies are damaged (primary: {f.primary_error}; "
            f"backup: {f.backup_error}){sig}; it can only be device {slot + 1} of the "
            "pool: kvfs fsck --repair with every device of the pool rebuilds them"
        )
    if f.foreign:
        return UserError(f"{path} holds {with_article(f.foreign)}, not a kvfs pool")
    return UserError(
        f"{path}: damaged or foreign superblock ({f.primary_error}) and no valid backup copy"
    )


def _missing_members(devices: list[Device], sbs: list[Superblock], missing: list[int]) -> str:
    """One line on the members a mount lacks: what is wrong and what is safe to do."""
    count = sbs[0].device_count
    table = next((sb.members for sb in sbs if sb.version >= 2), None)
    names = ", ".join(str(i + 1) for i in missing)
    which = f"member {names} is" if len(missing) == 1 else f"members {names} are"
    given = ", ".join(
        f"member {sb.device_index + 1} {dev.path}"
        for dev, sb in sorted(zip(devices, sbs, strict=True), key=lambda d: d[1].device_index)
    )
    head = f"pool {uuid.UUID(bytes=sbs[0].pool_uuid)} has {count} devices; {which} missing"
    if table:  # version 2: every member's table names the missing one
        uuids = ", ".join(str(uuid.UUID(bytes=table[i].device_uuid)) for i in missing)
        given = f"device uuid {uuids}; given: {given}"
    else:
        given = f"given: {given}"
    if 0 in missing:
        return (
            f"{head} ({given}); member 1 holds the metadata: attach it, "
            "the pool cannot be mounted without it"
        )
    return (
        f"{head} ({given}): attach {'it' if len(missing) == 1 else 'them'}, "
        "or mount with --degraded to serve what the others hold"
    )


def _no_superblock(path: str, size: int) -> str:
    """What to say about a device without a superblock. Never advise formatting it:
    it may be a member of a pool that is not attached right now (a detached loop
    device reads as empty), and formatting would destroy that pool's data."""
    what = "is empty (0 bytes: a detached loop device?)" if not size else "has no superblock"
    return (
        f"{path} {what}: not a kvfs pool member; attach the right one, or leave it "
        "out and mount with --degraded to serve what the other members hold"
    )


__all__ = [
    "CopyDamage",
    "Pool",
    "format_pool",
    "inspect_pool",
    "open_for_upgrade",
    "open_pool",
    "rewrite_copies",
    "upgraded",
    "write_superblocks",
]
