"""Offline consistency check and repair: ``kvfs fsck DEV... [--repair] [--no-data]``.

Checks, in order: superblocks (each device, and that they form one pool), the metadata
log (newest complete checkpoint, where the journal ends), the index (every name points
to an inode, every inode is reachable, link counts, unit maps within the devices and
claimed once), and — unless ``--no-data`` — every data unit against its checksum.
``--repair`` drops what cannot be trusted (corrupt or mid-write files, dangling names,
doubly claimed or out-of-range units, unreachable inodes), fixes link counts, and
writes a fresh checkpoint. Exit codes follow e2fsck: 0 clean, 1 errors corrected,
4 errors left uncorrected, 8 operational error (cannot open, not a pool).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import xxhash

from kvfs.check import Report, check_index, fix_dir_links
from kvfs.device import ALIGN, aligned_buffer
from kvfs.errors import Corruption, DeviceError, UserError
from kvfs.journal import encode_checkpoint, half_bounds, recover
from kvfs.layout import DEV_SHIFT, NO_UNIT, UNIT_MASK
from kvfs.namespace import Namespace
from kvfs.pool import Pool, open_pool

log = logging.getLogger(__name__)

EXIT_CLEAN, EXIT_CORRECTED, EXIT_UNCORRECTED, EXIT_OPERATIONAL = 0, 1, 4, 8


def offline_index(paths: list[str]) -> tuple[Namespace, Pool]:
    """The recovered index of an unmounted pool, as the log has it (nothing dropped);
    the pool is returned closed, for its geometry. For tools and tests."""
    pool = open_pool(paths)
    try:
        meta, start, size = pool.meta
        ns = Namespace(lambda ops: None)
        for op in recover(meta, start, size, pool.seed).ops:
            ns.apply(op)
        return ns, pool
    finally:
        pool.close()


def fsck(
    paths: list[str],
    repair: bool = False,
    check_data: bool = True,
    out: Callable[[str], None] = print,
) -> int:
    try:
        pool = open_pool(paths)
    except UserError as e:
        out(f"fsck: {e}")
        return EXIT_OPERATIONAL
    try:
        return _fsck_pool(pool, repair, check_data, out)
    finally:
        pool.close()


def _fsck_pool(pool: Pool, repair: bool, check_data: bool, out: Callable[[str], None]) -> int:
    sb = pool.superblocks[0]
    out(
        f"pool: {len(pool.devices)} device(s), {sb.pool_units} units of "
        f"{sb.unit_size >> 10} KiB, metadata {sb.meta_size >> 20} MiB"
    )
    meta, start, size = pool.meta
    try:
        found = recover(meta, start, size, pool.seed)
    except (Corruption, DeviceError) as e:
        out(f"metadata: UNRECOVERABLE: {e}")
        return EXIT_UNCORRECTED
    out(
        f"metadata: checkpoint generation {found.generation} (half {found.half}), "
        f"{found.transactions} journal transactions replayed, log ends at byte {found.end}"
    )
    ns = Namespace(lambda ops: None)
    report = Report()
    for damage in found.damage:
        report.problem(f"metadata log of half {found.half}: {damage}")
    for op in found.ops:
        try:
            ns.apply(op)
        except (KeyError, AssertionError):
            report.problem(f"journal operation {op!r:.80} refers to a missing inode")
    check_index(ns, pool, report)
    if check_data:
        _check_data(ns, pool, report)
    report.files = sum(1 for i in ns.inodes.values() if not i.is_dir)
    for note in report.notes:
        out(f"note: {note}")
    for p in report.problems:
        out(f"problem: {p}")
    out(
        f"checked {report.files} files, {len(ns.inodes) - report.files} directories, "
        f"{report.units_checked} data units: {len(report.problems)} problem(s)"
    )
    if not report.problems:
        return EXIT_CLEAN
    if not repair:
        out("run with --repair to drop what cannot be trusted")
        return EXIT_UNCORRECTED
    _repair(ns, pool, report, found.generation, found.half, found.seq)
    out(f"repaired: dropped {len(report.doomed)} inode(s), wrote a fresh checkpoint")
    return EXIT_CORRECTED


def _check_data(ns: Namespace, pool: Pool, report: Report) -> None:
    u_size = pool.unit_size
    buf = aligned_buffer(u_size)
    view = memoryview(buf)
    for inode in ns.inodes.values():
        if inode.ino in report.doomed:
            continue
        for u, p in enumerate(inode.units):
            if p == NO_UNIT:
                continue
            dev, unit = p >> DEV_SHIFT, p & UNIT_MASK
            if dev >= len(pool.devices) or unit >= pool.superblocks[dev].data_units:
                break
            report.units_checked += 1
            try:
                pool.devices[dev].read_into(pool.unit_offset(dev, unit), view)
            except DeviceError as e:
                report.problem(f"inode {inode.ino} unit {u}: device error: {e}", doom=inode.ino)
                break
            if xxhash.xxh3_64_intdigest(view) != inode.csums[u]:
                name = inode.name.decode(errors="replace")
                report.problem(
                    f"inode {inode.ino} ({name}) unit {u} at device {dev} unit "
                    f"{unit}: checksum mismatch",
                    doom=inode.ino,
                )
                break


def _repair(
    ns: Namespace, pool: Pool, report: Report, generation: int, half: int, seq: int
) -> None:
    for fix in report.fixes:
        fix()
    for d in ns.inodes.values():
        if d.entries:
            for name in [n for n, i in d.entries.items() if i in report.doomed]:
                del d.entries[name]
    for ino in report.doomed:
        ns.inodes.pop(ino, None)
    fix_dir_links(ns)
    data, _, _ = encode_checkpoint(ns.snapshot(), generation + 1, seq, pool.seed)
    meta, start, size = pool.meta
    base, half_size = half_bounds(start, size, 1 - half)
    if len(data) > half_size:
        raise DeviceError("metadata area too small for the repaired checkpoint")
    n = -(-len(data) // ALIGN) * ALIGN
    buf = aligned_buffer(n)
    buf[: len(data)] = data
    meta.write(base, [memoryview(buf)[:n]])
    meta.flush()


__all__ = [
    "EXIT_CLEAN",
    "EXIT_CORRECTED",
    "EXIT_OPERATIONAL",
    "EXIT_UNCORRECTED",
    "fsck",
    "offline_index",
]
