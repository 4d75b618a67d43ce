"""An unmounted pool, read and changed without a store: its index as the log has it
(:func:`offline_index`, for tools and tests), the consistency check and repair behind
``kvfs fsck DEV... [--repair] [--no-data]`` (:func:`fsck`), and the in-place format
upgrade behind ``kvfs upgrade DEV...`` (:func:`upgrade`). The commands' own modules
(:mod:`kvfs.cli.fsck`, :mod:`kvfs.cli.upgrade`) import this one only when they run:
it needs the whole stack below the store, which no other command waits for.

Checks, in order: superblocks (both copies of each device, and that they form one
pool; a member whose copies are both damaged is rebuilt from the others' member
tables only once its content proves which member it is), the metadata
log (newest complete checkpoint, where the journal ends), the index (every name points
to an inode, every inode is reachable, link counts, unit maps within the devices and
claimed once), and — unless ``--no-data`` — every data unit against its checksum.
``--repair`` rewrites damaged superblock copies, drops what cannot be trusted (corrupt
or mid-write files, dangling names, doubly claimed or out-of-range units, unreachable
inodes), fixes link counts, and writes a fresh checkpoint. Exit codes follow e2fsck:
0 clean, 1 errors corrected, 4 errors left uncorrected, 8 operational error (cannot
open, not a pool).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator

import xxhash

from kvfs.cli.progress import Progress
from kvfs.common.errors import Corruption, DeviceError, UserError
from kvfs.devices.device import ALIGN, aligned_buffer
from kvfs.devices.pool import (
    Pool,
    inspect_pool,
    open_for_upgrade,
    open_pool,
    rewrite_copies,
    upgraded,
    write_superblocks,
)
from kvfs.format.halves import encode_checkpoint, half_bounds
from kvfs.format.records import DEV_SHIFT, NO_UNIT, UNIT_MASK, Image, extent
from kvfs.format.superblock import FORMAT_VERSION, Superblock
from kvfs.index.check import Report, check_index, fix_dir_links
from kvfs.index.namespace import Inode, Namespace
from kvfs.log.journal import ApplySink, recover

log = logging.getLogger(__name__)

EXIT_CLEAN, EXIT_CORRECTED, EXIT_UNCORRECTED, EXIT_OPERATIONAL = 0, 1, 4, 8


def offline_index(paths: list[str]) -> tuple[Namespace, Pool]:
    """The recovered index of an unmounted pool, as the log has it (nothing dropped);
    the pool is returned closed, for its geometry. For tools and tests."""
    pool = open_pool(paths)
    try:
        return _recovered(pool), pool
    finally:
        pool.close()


def _recovered(pool: Pool) -> Namespace:
    """The index of ``pool`` as its log has it (nothing dropped)."""
    meta, start, size = pool.meta
    ns = Namespace(lambda ops: None)
    recover(meta, start, size, pool.seed, _sink(ns))
    ns.finish_load()
    return ns


def _sink(ns: Namespace) -> ApplySink:
    """Recovery's operations applied to ``ns`` (forgotten again on a fallback)."""

    return ApplySink(ns.apply, ns.reset, load=ns.load_payload)


def fsck(
    paths: list[str],
    repair: bool = False,
    check_data: bool = True,
    out: Callable[[str], None] = print,
) -> int:
    try:
        pool = inspect_pool(paths)
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
        f"{sb.unit_size >> 10} KiB, metadata {sb.meta_size >> 20} MiB, "
        f"format version {pool.version}"
    )
    report = Report()
    for damage in pool.damage:
        report.problem(f"superblock: {damage}")
    superblock_problems = len(report.problems)
    if pool.version < FORMAT_VERSION:
        report.notes.append("format version 1 has no backup superblocks: kvfs upgrade adds them")
    meta, start, size = pool.meta
    ns = Namespace(lambda ops: None)
    sink = _sink(ns)
    try:
        found = recover(meta, start, size, pool.seed, sink)
    except (Corruption, DeviceError) as e:
        _print_problems(report, out)
        out(f"metadata: UNRECOVERABLE: {e}")
        for d in pool.damage:
            if d.copy == "both" and d.index == 0:
                out(f"superblock: {d.path} is not rebuilt as device 1: no metadata log there")
        return EXIT_UNCORRECTED
    out(
        f"metadata: checkpoint generation {found.generation} (half {found.half}), "
        f"{found.transactions} journal transactions replayed, log ends at byte {found.end}"
    )
    for damage_ in found.damage:
        report.problem(f"metadata log of half {found.half}: {damage_}")
    if found.damage:  # without damage, a skip is a fuzzy checkpoint's replay (normal)
        for op in sink.first_skipped:
            report.problem(f"journal operation {op!r:.80} refers to a missing inode")
        if sink.skipped > len(sink.first_skipped):
            report.problem(
                f"{sink.skipped - len(sink.first_skipped)} more journal operation(s) "
                "refer to missing inodes"
            )
    ns.finish_load()
    for d in pool.damage:
        if d.copy != "both":
            continue
        proven, why = _identity(ns, pool, d.index)
        if not proven:  # checking data against a wrong identity would condemn its files
            _print_problems(report, out)
            out(f"superblock: {d.path} is not rebuilt as device {d.index + 1}: {why}")
            return EXIT_UNCORRECTED
        report.notes.append(f"{d.path} is device {d.index + 1}: {why}")
    check_index(ns, pool, report)
    if check_data:
        _check_data(ns, pool, report)
    report.files = sum(1 for i in ns.inodes.values() if not i.is_dir)
    _print_problems(report, out)
    out(
        f"checked {report.files} files, {len(ns.inodes) - report.files} directories, "
        f"{report.units_checked} data units: {len(report.problems)} problem(s)"
    )
    if not report.problems:
        return EXIT_CLEAN
    if not repair:
        out("run with --repair to rewrite damaged superblocks and drop what cannot be trusted")
        return EXIT_UNCORRECTED
    for line in rewrite_copies(pool):
        out(f"repaired: {line}")
    if len(report.problems) > superblock_problems:
        _repair(ns, pool, report, found.generation, found.half, found.seq)
        out(f"repaired: dropped {len(report.doomed)} inode(s), wrote a fresh checkpoint")
    return EXIT_CORRECTED


def _print_problems(report: Report, out: Callable[[str], None]) -> None:
    for note in report.notes:
        out(f"note: {note}")
    for p in report.problems:
        out(f"problem: {p}")


PROOF_UNITS = 16
"""Data units of a rebuilt member read to prove its identity."""


def _identity(ns: Namespace, pool: Pool, index: int) -> tuple[bool, str]:
    """Whether the device given a rebuilt superblock is member ``index``, and why: its
    content must prove it. Device 0: the metadata log parsed under the pool's seed
    (already done). Others: a non-zero data unit on it matches the checksum the index
    holds for it; when no file has data there, nothing can be lost either way."""
    if index == 0:
        return True, "its metadata log parses under the pool's checksum seed"
    buf = aligned_buffer(pool.unit_size)
    view = memoryview(buf)
    checked = 0
    try:
        for dev, field, csum in _units_on(ns, pool, index):
            checked += 1
            try:
                _read_unit(pool, dev, field, view)
            except DeviceError:
                continue
            if any(view) and xxhash.xxh3_64_intdigest(view) == csum:
                unit = extent(field, pool.unit_size)[0]
                return True, f"data unit {unit} there matches its checksum in the index"
            if checked >= PROOF_UNITS:
                break
    finally:
        view.release()
        buf.close()
    if not checked:
        return True, "no file has data on it, so its identity cannot be checked (or matter)"
    return False, f"none of {checked} data unit(s) there holds the bytes the index expects"


def _read_unit(pool: Pool, dev: int, field: int, view: memoryview) -> None:
    """Unit field ``field`` of device ``dev`` into the unit-sized ``view``: the whole
    unit, or a fragment run followed by zeros (what its checksum covers)."""
    unit, skip, length = extent(field, pool.unit_size)
    if length < len(view):
        view[length:] = bytes(len(view) - length)
    pool.devices[dev].read_into(pool.unit_offset(dev, unit) + skip, view[:length])


def _units_on(ns: Namespace, pool: Pool, index: int) -> Iterator[tuple[int, int, int]]:
    """(device, unit field, checksum) of the mapped units on device ``index``."""
    limit, u_size = pool.superblocks[index].data_units, pool.unit_size
    for inode in ns.inodes.values():
        for u, p in enumerate(inode.units):
            if p != NO_UNIT and p >> DEV_SHIFT == index and extent(p, u_size)[0] < limit:
                yield index, p & UNIT_MASK, inode.csum(u)


def _check_data(ns: Namespace, pool: Pool, report: Report) -> None:
    view = memoryview(aligned_buffer(pool.unit_size))
    with Progress("fsck: reading data", ns.file_count, "files") as progress:
        for inode in ns.inodes.values():
            if inode.is_dir:
                continue
            progress.advance()
            if inode.ino not in report.doomed:
                _check_file(inode, pool, report, view)


def _check_file(inode: Inode, pool: Pool, report: Report, view: memoryview) -> None:
    """Read every unit of one file and check its checksum (the first failure dooms it)."""
    u_size = pool.unit_size
    for u, p in enumerate(inode.units):
        if p == NO_UNIT:
            continue
        dev, unit = p >> DEV_SHIFT, extent(p, u_size)[0]
        if dev >= len(pool.devices) or unit >= pool.superblocks[dev].data_units:
            break
        report.units_checked += 1
        try:
            _read_unit(pool, dev, p & UNIT_MASK, view)
        except DeviceError as e:
            report.problem(f"inode {inode.ino} unit {u}: device error: {e}", doom=inode.ino)
            break
        if xxhash.xxh3_64_intdigest(view) != inode.csum(u):
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
    for ino in report.doomed:
        ns.discard(ino)  # its names too
    fix_dir_links(ns)
    # the eviction state the check loaded goes on (files it dropped leave it at mount)
    evictor = (Image(payload) for payload in ns.evictor_payloads)
    data, _, _ = encode_checkpoint(
        itertools.chain(ns.snapshot(), evictor), generation + 1, seq, pool.seed
    )
    meta, start, size = pool.meta
    base, half_size = half_bounds(start, size, 1 - half)
    if len(data) > half_size:
        raise DeviceError("metadata area too small for the repaired checkpoint")
    n = -(-len(data) // ALIGN) * ALIGN
    buf = aligned_buffer(n)
    buf[: len(data)] = data
    meta.write(base, [memoryview(buf)[:n]])
    meta.flush()


def upgrade(paths: list[str]) -> list[str]:
    """``kvfs upgrade DEV...``: rewrite a version-1 pool's superblocks as version 2 in
    place (every device named, the pool unmounted), keeping every file. Version 2 keeps
    a backup copy in each device's last block, so a device whose last unit holds file
    data is refused, naming the file (UserError, exit 1), and the pool stays as it
    was. Completes an interrupted upgrade. Returns what was done, one line each."""
    pool = open_for_upgrade(paths)
    try:
        if pool.version >= FORMAT_VERSION:
            if pool.damage:
                raise UserError("pool is at format version 2 but damaged: run kvfs fsck")
            return [f"pool is already at format version {FORMAT_VERSION}: nothing to do"]
        new = upgraded(pool.superblocks)
        in_the_way = _files_in_the_way(pool, new)
        if in_the_way:
            raise UserError(
                "the last unit of a device holds file data, where version 2 keeps its "
                f"backup superblock: {'; '.join(in_the_way)}; remove or rewrite those "
                "files and run kvfs upgrade again (the pool stays at format version 1)",
                1,  # the operation failed (the CLI's EXIT_FAIL)
            )
        old = pool.superblocks
        lost = sum(a.data_units - b.data_units for a, b in zip(old, new, strict=True))
        write_superblocks(pool, new)
        return [
            f"device {sb.device_index + 1} ({dev.path}): version {FORMAT_VERSION} superblock "
            f"and its backup written, {sb.data_units} data units"
            for dev, sb in zip(pool.devices, new, strict=True)
        ] + [f"upgraded to format version {FORMAT_VERSION} ({lost} unit(s) gave way)"]
    finally:
        pool.close()


def _files_in_the_way(pool: Pool, new: list[Superblock]) -> list[str]:
    """Files with data in units the new superblocks no longer count as data."""
    try:
        ns = _recovered(pool)
    except (Corruption, DeviceError) as e:
        raise UserError(f"metadata unreadable ({e}): run kvfs fsck first", 1) from None
    # a file the next mount drops (unlinked while open at a crash or an unmount the
    # kernel had not forgotten it by, left mid-write, quarantined) is not in the way:
    # its units are never claimed again
    dropped = set(ns.dropped_at_mount())
    hits = []
    for inode in ns.inodes.values():
        if inode.ino in dropped:
            continue
        for p in inode.units:
            dev, unit = p >> DEV_SHIFT, extent(p, pool.unit_size)[0]
            if p != NO_UNIT and dev < len(new) and unit >= new[dev].data_units:
                name = inode.name.decode(errors="replace") or "?"
                hits.append(f"device {dev + 1} unit {unit}: file {name!r} (inode {inode.ino})")
                break
    return hits


__all__ = [
    "EXIT_CLEAN",
    "EXIT_CORRECTED",
    "EXIT_OPERATIONAL",
    "EXIT_UNCORRECTED",
    "fsck",
    "offline_index",
    "upgrade",
]
