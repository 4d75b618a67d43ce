"""The geometry of a new pool: unit size limits, the metadata area's size, and where
each device's data units start (``docs/format.md``, "Device layout").

Pure: it computes the superblocks of a pool about to be formatted (``kvfs.devices.pool``
writes them).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Protocol

from kvfs.common.errors import UserError
from kvfs.format.records import ALIGN, MIN_UNIT
from kvfs.format.superblock import RESERVED_HEAD, SB_BLOCK, Member, Superblock

META_FULL = 0.75
"""Fraction of a half a checkpoint may fill before growth is refused (ENOSPC)."""
MAX_UNIT = 64 << 20
DEFAULT_UNIT = 1 << 20
MIN_META = 1 << 20
"""The smallest metadata area ``--meta-size`` may ask for (two halves of 512 KiB)."""
DEFAULT_MIN_META = 32 << 20
"""The default area is never smaller than this (small pools, many empty files)."""
CHECKPOINT_FILE_BYTES = 256
"""Checkpoint bytes one file costs, apart from its units, in the namespace image
(version 3) with the eviction state: its row at the columns' declared widths (78;
narrow chunks make it ~45), its name in the arena (up to ~100 bytes, 4-byte
granules: SGLang's ``<64 hex>_<model>_0_1.bin`` is ~100, LMCache's
``model@world@worker@hash@dtype.pt`` ~70, vLLM's ``<hash>.bin`` ~20), its name-index
slot (4 B at 37.5-75% load: up to 11) and listing entry (4), the eviction state
(``evict.driver.EVICTION_STATE_BYTES``: 64). Measured by ``tests/unit/store/test_meta_sizing.py``
(which asserts it): 111 (vLLM names), 168 (LMCache), 188 (SGLang) per one-unit file
with a ghost key per file; 164 / 220 / 240 before narrow chunks (it was 320)."""
CHECKPOINT_UNIT_BYTES = 16
"""Checkpoint bytes per mapped unit: a file of one contiguous extent stores only its
checksums (8 per unit), one of several extents (striped over devices) its whole map
in the namespace image, address and checksum (8 + 8 per unit)."""
SPARE_FILES = 1 / 16
"""Room for empty files and directories on top of the files the data can hold."""


def default_meta_size(pool_units: int, unit: int, mean_file_size: int = 0) -> int:
    """A metadata area whose checkpoint fits the file count of the full pool: one file
    per ``mean_file_size`` (default: per unit -- a file holds at least one unit), plus
    ``SPARE_FILES``; each checkpoint may fill ``META_FULL`` of a half, and there are
    two halves. Rounded up to a unit, at least ``DEFAULT_MIN_META``."""
    per_file = max(1, -(-mean_file_size // unit)) if mean_file_size else 1
    files = -(-pool_units // per_file)
    files += int(files * SPARE_FILES)
    checkpoint = files * CHECKPOINT_FILE_BYTES + pool_units * CHECKPOINT_UNIT_BYTES
    size = 2 * int(checkpoint / META_FULL) + 2 * ALIGN
    return max(DEFAULT_MIN_META, -(-size // unit) * unit)


class Target(Protocol):
    """What the geometry needs of a device: its name, size and logical block."""

    @property
    def path(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def logical_block(self) -> int: ...
    @property
    def optimal_io(self) -> int: ...


def new_pool(
    devices: Sequence[Target], unit: int, meta_size: int, label: str, mean_file_size: int = 0
) -> list[Superblock]:
    """Superblocks of a new pool: device 0 holds the metadata area, every device's data
    units run up to its last block (the backup superblock)."""
    head = -(-RESERVED_HEAD // unit) * unit
    if meta_size and meta_size < MIN_META:
        raise UserError(f"the metadata area must be at least {MIN_META >> 20} MiB")
    if mean_file_size < 0:
        raise UserError("the mean file size must be positive")
    if not meta_size:  # sized for the units the devices would hold without it
        units = sum(max(0, d.size - SB_BLOCK - head) // unit for d in devices)
        meta_size = default_meta_size(units, unit, mean_file_size)
    meta_size = -(-meta_size // unit) * unit
    if head + meta_size + unit + SB_BLOCK > devices[0].size:
        raise UserError(
            f"{devices[0].path}: too small for the {meta_size >> 20} MiB metadata area it "
            "would hold (give --mean-file-size or a smaller --meta-size, or name a "
            "larger device first)"
        )
    pool_uuid, now = uuid.uuid4().bytes, time.time_ns()
    members = []
    for i, dev in enumerate(devices):
        data_start = head + (meta_size if i == 0 else 0)
        room = dev.size - SB_BLOCK - data_start
        units = room // unit if room > 0 else 0
        if units < 1:
            raise UserError(f"{dev.path}: too small ({dev.size} bytes) for a kvfs device")
        members.append(Member(uuid.uuid4().bytes, dev.size, data_start, units))
    return [
        Superblock(
            pool_uuid=pool_uuid,
            device_uuid=m.device_uuid,
            device_index=i,
            device_count=len(devices),
            unit_size=unit,
            block_size=dev.logical_block,
            device_size=m.device_size,
            data_start=m.data_start,
            data_units=m.data_units,
            meta_start=head,
            meta_size=meta_size,
            created_ns=now,
            pool_units=sum(m.data_units for m in members),
            label=label,
            backup_offset=m.device_size - SB_BLOCK,
            members=tuple(members),
        )
        for i, (dev, m) in enumerate(zip(devices, members, strict=True))
    ]


def unit_for(devices: Sequence[Target], unit_size: int) -> int:
    """``unit_size`` checked, raised to the devices' optimal I/O size where that is a
    larger power of two (every extent stays aligned to it)."""
    if unit_size & (unit_size - 1) or not MIN_UNIT <= unit_size <= MAX_UNIT:
        raise UserError(f"unit size must be a power of two in [64 KiB, 64 MiB], got {unit_size}")
    for dev in devices:
        opt = dev.optimal_io
        if opt and opt > unit_size and opt <= MAX_UNIT and not opt & (opt - 1):
            unit_size = opt  # keep every extent aligned to the device's optimal I/O size
    return unit_size
