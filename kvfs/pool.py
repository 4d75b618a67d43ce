"""A pool: the set of devices one kvfs instance owns, tied by their superblocks.

Formatting and opening are synchronous and run before the trio loop starts (or in a
worker thread); every problem a user can cause is a :class:`UserError` with one line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from dataclasses import dataclass

from kvfs.device import ALIGN, Device, FileDevice, MissingDevice, aligned_buffer
from kvfs.errors import Corruption, UserError
from kvfs.journal import encode_checkpoint, half_bounds
from kvfs.layout import (
    RESERVED_HEAD,
    SB_BLOCK,
    SIGNATURE_PROBE,
    Superblock,
    foreign_signature,
)
from kvfs.namespace import Namespace

log = logging.getLogger(__name__)

MIN_UNIT = 64 * 1024
MAX_UNIT = 64 << 20
DEFAULT_UNIT = 1 << 20
MIN_META = 32 << 20
MAX_META = 8 << 30


@dataclass
class Pool:
    """Open devices of one pool, ordered by device index."""

    devices: list[Device]
    superblocks: list[Superblock]

    @property
    def unit_size(self) -> int:
        return self.superblocks[0].unit_size

    @property
    def seed(self) -> int:
        """Checksum seed of this pool's metadata, from its UUID."""
        return int.from_bytes(self.superblocks[0].pool_uuid[:8], "little")

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
    real = [os.path.realpath(p) for p in paths]
    if len(set(real)) != len(real):
        raise UserError("the same device is named twice")
    devices: list[Device] = []
    try:
        for p in paths:
            devices.append(FileDevice(p))
    except BaseException:
        for d in devices:
            d.close()
        raise
    return devices


def _unit_for(devices: list[Device], unit_size: int) -> int:
    if unit_size & (unit_size - 1) or not MIN_UNIT <= unit_size <= MAX_UNIT:
        raise UserError(f"unit size must be a power of two in [64 KiB, 64 MiB], got {unit_size}")
    for dev in devices:
        opt = dev.optimal_io
        if opt and opt > unit_size and opt <= MAX_UNIT and not opt & (opt - 1):
            unit_size = opt  # keep every extent aligned to the device's optimal I/O size
    return unit_size


def format_pool(
    paths: list[str],
    *,
    unit_size: int = DEFAULT_UNIT,
    meta_size: int = 0,
    force: bool = False,
    label: str = "",
) -> list[Superblock]:
    """Write a new, empty pool onto ``paths`` (destroys what they hold)."""
    devices = _open_all(paths)
    try:
        for dev in devices:
            _check_formattable(dev, force)
        unit = _unit_for(devices, unit_size)
        sbs = _layout(devices, unit, meta_size, label)
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
    except Corruption:
        sig = foreign_signature(head)
        if sig:
            raise UserError(
                f"{dev.path} holds a {sig}; refusing to overwrite it (use --force)"
            ) from None
        return
    raise UserError(
        f"{dev.path} already belongs to kvfs pool {uuid.UUID(bytes=sb.pool_uuid)} "
        f"(device {sb.device_index + 1} of {sb.device_count}); use --force to reformat"
    )


def _layout(devices: list[Device], unit: int, meta_size: int, label: str) -> list[Superblock]:
    head = -(-RESERVED_HEAD // unit) * unit
    total = sum(d.size for d in devices)
    if not meta_size:
        meta_size = min(max(total // 128, MIN_META), MAX_META)
    meta_size = -(-meta_size // unit) * unit
    pool_uuid, now = uuid.uuid4().bytes, time.time_ns()
    layout = []
    for i, dev in enumerate(devices):
        data_start = head + (meta_size if i == 0 else 0)
        units = (dev.size - data_start) // unit if dev.size > data_start else 0
        if units < 1:
            raise UserError(f"{dev.path}: too small ({dev.size} bytes) for a kvfs device")
        layout.append((i, dev, data_start, units))
    pool_units = sum(u for *_, u in layout)
    return [
        Superblock(
            pool_uuid=pool_uuid,
            device_uuid=uuid.uuid4().bytes,
            device_index=i,
            device_count=len(devices),
            unit_size=unit,
            block_size=dev.logical_block,
            device_size=dev.size,
            data_start=data_start,
            data_units=units,
            meta_start=head if i == 0 else 0,
            meta_size=meta_size if i == 0 else 0,
            created_ns=now,
            pool_units=pool_units,
            label=label,
        )
        for i, dev, data_start, units in layout
    ]


def _write_empty_pool(devices: list[Device], sbs: list[Superblock]) -> None:
    sb0 = sbs[0]
    seed = int.from_bytes(sb0.pool_uuid[:8], "little")
    ns = Namespace(lambda ops: None)
    ns.init_root(os.getuid(), os.getgid())
    data, _, _ = encode_checkpoint(ns.snapshot(), 1, 0, seed)
    meta = devices[0]
    for half in (1, 0):  # invalidate whatever log was there, then write generation 1
        base, _ = half_bounds(sb0.meta_start, sb0.meta_size, half)
        blob = data if half == 0 else bytes(ALIGN)
        _write(meta, base, blob)
    meta.flush()
    for dev, sb in zip(devices, sbs, strict=True):
        _write(dev, 0, sb.encode())
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


def open_pool(paths: list[str], degraded: bool = False) -> Pool:
    """Open and cross-check the devices of one pool (any order on the command line).
    With ``degraded``, devices other than device 0 may be missing."""
    devices = _open_all(paths)
    try:
        sbs = [_read_superblock(dev) for dev in devices]
        return _assemble(devices, sbs, degraded)
    except BaseException:
        for d in devices:
            d.close()
        raise


def _read_superblock(dev: Device) -> Superblock:
    head = _read_head(dev, SIGNATURE_PROBE)
    try:
        sb = Superblock.decode(head[:SB_BLOCK])
    except Corruption as e:
        sig = foreign_signature(head)
        if sig:
            raise UserError(f"{dev.path} holds a {sig}, not a kvfs pool") from None
        if not any(head[:SB_BLOCK]):
            raise UserError(_no_superblock(dev)) from None
        raise UserError(f"{dev.path}: damaged or foreign superblock ({e})") from None
    if sb.device_size > dev.size:
        raise UserError(f"{dev.path} is smaller than when it was formatted")
    return sb


def _no_superblock(dev: Device) -> str:
    """What to say about a device without a superblock. Never advise formatting it:
    it may be a member of a pool that is not attached right now (a detached loop
    device reads as empty), and formatting would destroy that pool's data."""
    what = "is empty (0 bytes: a detached loop device?)" if not dev.size else "has no superblock"
    return (
        f"{dev.path} {what}: not a kvfs pool member; attach the right one, or leave it "
        "out and mount with --degraded to serve what the other members hold"
    )


def _assemble(devices: list[Device], sbs: list[Superblock], degraded: bool = False) -> Pool:
    pools = {sb.pool_uuid for sb in sbs}
    if len(pools) > 1:
        raise UserError("the devices belong to different kvfs pools")
    count = sbs[0].device_count
    indexes = sorted(sb.device_index for sb in sbs)
    if len(set(indexes)) != len(indexes) or any(i >= count for i in indexes):
        raise UserError("two of the given devices claim the same place in the pool")
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
    if len({(sb.unit_size, sb.pool_units, sb.device_count) for sb in sbs}) > 1:
        raise UserError("device superblocks disagree on the pool geometry")
    order = sorted(range(len(sbs)), key=lambda i: sbs[i].device_index)
    return Pool([devices[i] for i in order], [sbs[i] for i in order])


def _missing_members(devices: list[Device], sbs: list[Superblock], missing: list[int]) -> str:
    """One line on the members a mount lacks: what is wrong and what is safe to do."""
    count = sbs[0].device_count
    names = ", ".join(str(i + 1) for i in missing)
    which = f"member {names} is" if len(missing) == 1 else f"members {names} are"
    given = ", ".join(
        f"member {sb.device_index + 1} {dev.path}"
        for dev, sb in sorted(zip(devices, sbs, strict=True), key=lambda d: d[1].device_index)
    )
    head = f"pool {uuid.UUID(bytes=sbs[0].pool_uuid)} has {count} devices; {which} missing"
    if 0 in missing:
        return (
            f"{head} (given: {given}); member 1 holds the metadata: attach it, "
            "the pool cannot be mounted without it"
        )
    return (
        f"{head} (given: {given}): attach {'it' if len(missing) == 1 else 'them'}, "
        "or mount with --degraded to serve what the others hold"
    )


__all__ = ["Pool", "format_pool", "open_pool"]
