"""Loading the index at mount: the namespace rebuilt from the metadata log
(:mod:`kvfs.log.recovery` reads the log; this module makes a mountable index of what it
found), a log damaged in the middle salvaged, files a crash left unfinished dropped,
files with data on a missing member (degraded mount) found, and the allocator
rebuilt from every mapped unit. Blocking; runs once, before the store serves.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

from kvfs.common.errors import Corruption
from kvfs.devices.alloc import Allocator
from kvfs.devices.pool import Pool
from kvfs.evict.evictor import Evictor
from kvfs.format.records import DEV_SHIFT, NO_UNIT, UNIT_MASK
from kvfs.index.check import Report, check_index, fix_dir_links
from kvfs.index.namespace import ROOT_INO, Namespace
from kvfs.log.journal import ApplySink, Journal, Recovered, recover

log = logging.getLogger(__name__)

LOGGED_NAMES = 50
"""How many files a mount names in its log when it drops or cannot read them."""


@dataclass(frozen=True)
class RecoveryReport:
    generation: int
    transactions: int
    files: int
    directories: int
    dropped_incomplete: int
    dropped_unlinked: int
    seconds: float
    unreadable: int = 0
    """Files kept with data on a missing member (degraded mount): reads fail (EIO)."""
    dropped_unreadable: int = 0
    """Files with data on a missing member dropped at the operator's request."""


class Loader:
    """One mount's loading of its index into ``ns`` and ``alloc`` (see the module
    docstring). After :meth:`load`: :attr:`unreadable`, and :attr:`clean`."""

    def __init__(
        self,
        pool: Pool,
        ns: Namespace,
        alloc: Allocator,
        evictor: Evictor,
        journal: Journal,
        missing: frozenset[int],
    ) -> None:
        self.pool, self.ns, self.alloc, self.evictor, self.journal = (
            pool,
            ns,
            alloc,
            evictor,
            journal,
        )
        self._missing = missing
        self.unreadable: set[int] = set()
        """Inodes with a unit on a missing member (kept unless dropped on request)."""
        self.clean = False
        """Whether the log ended at its last checkpoint (a clean unmount, nothing
        dropped): that checkpoint holds exactly the loaded index."""

    def load(self, drop_unreadable: bool) -> RecoveryReport:
        t0 = time.monotonic()
        meta, start, size = self.pool.meta
        sink = ApplySink(self.ns.apply, self.ns.reset, load=self.ns.load_payload)
        found = recover(meta, start, size, self.pool.seed, sink)
        doomed: set[int] = set()
        if found.damage:
            doomed = self._salvage(found, sink.skipped)
        elif sink.skipped:  # a checkpoint window's replay: names of what was dropped
            log.info("recovery: %d replayed operation(s) named dropped inodes", sink.skipped)
        self.ns.finish_load()
        if ROOT_INO not in self.ns.inodes:
            raise Corruption("metadata has no root directory")
        incomplete, unlinked, dropped = self._drop_unfinished(doomed, drop_unreadable)
        self._rebuild_allocator()
        self.evictor.adopt_all()
        clean = not (
            found.transactions
            or found.fell_back
            or found.damage
            or incomplete
            or unlinked
            or dropped
        )
        self.journal.resume(found, in_place=clean)
        self.clean = clean
        report = RecoveryReport(
            found.generation,
            found.transactions,
            self.ns.file_count,
            self.ns.dir_count,
            incomplete,
            unlinked,
            time.monotonic() - t0,
            unreadable=len(self.unreadable),
            dropped_unreadable=dropped,
        )
        log.info(
            "index recovered: generation %d, %d journal transactions replayed, dropped "
            "%d incomplete and %d unlinked files, %.2f s",
            report.generation,
            report.transactions,
            report.dropped_incomplete,
            report.dropped_unlinked,
            report.seconds,
        )
        return report

    def _salvage(self, found: Recovered, skipped: int) -> set[int]:
        """Rebuild the index from a log damaged in the middle: the transactions after
        the damage are applied too (each is whole and checksummed), what no longer
        fits together is dropped (names of missing inodes, unreachable inodes, units
        claimed twice: fsck's checks), link counts are fixed. Loud, and the mount
        then checkpoints the salvaged index. Returns the inodes to drop. ``skipped``:
        operations recovery's sink could not apply (they named what is gone)."""
        for damage in found.damage:
            log.error("metadata log %s; salvaging", damage)
        report = Report()
        check_index(self.ns, self._checkable_pool(), report)
        for fix in report.fixes:
            fix()
        fix_dir_links(self.ns)
        log.error(
            "metadata log salvaged: %d operation(s) skipped, %d problem(s) fixed, "
            "%d file(s) dropped; run kvfs fsck for a data check",
            skipped,
            len(report.problems),
            len(report.doomed),
        )
        for problem in report.problems[:50]:
            log.warning("salvage: %s", problem)
        return report.doomed

    def _checkable_pool(self) -> Pool:
        """The pool as fsck's checks must see it in a degraded mount: a missing
        member's size is unknown, and its units are unreadable, not outside the pool."""
        if not self._missing:
            return self.pool
        sbs = [
            dataclasses.replace(sb, data_units=UNIT_MASK + 1) if dev in self._missing else sb
            for dev, sb in enumerate(self.pool.superblocks)
        ]
        return Pool(self.pool.devices, sbs)

    def _drop_unfinished(self, doomed: set[int], drop_unreadable: bool) -> tuple[int, int, int]:
        """Drop files left mid-write or unlinked-while-open by a crash, ``doomed`` ones
        (a salvage), and names that point nowhere. Files with data on a missing member
        (degraded mount) are kept as :attr:`unreadable`, or dropped too with
        ``drop_unreadable``. Returns (incomplete, unlinked, unreadable dropped)."""
        doomed = {i for i in doomed if i in self.ns.inodes}
        doomed.update(self.ns.dropped_at_mount())
        unreadable = self._on_missing_members(doomed, drop_unreadable)
        incomplete = sum(1 for i in doomed if self.ns.inodes[i].nlink)
        unlinked = len(doomed) - incomplete
        if drop_unreadable:
            doomed |= unreadable
        else:
            self.unreadable = unreadable
        for ino in doomed:
            self.ns.discard(ino)  # its names too
        return incomplete, unlinked, len(unreadable) if drop_unreadable else 0

    def _on_missing_members(self, doomed: set[int], drop: bool) -> set[int]:
        """Files (other than ``doomed`` ones) with a unit on a missing member, logged:
        their count and the first names."""
        missing = self._missing
        if not missing:
            return set()
        found = [
            inode
            for inode in self.ns.inodes.values()
            if inode.ino not in doomed
            and any(p != NO_UNIT and p >> DEV_SHIFT in missing for p in inode.units)
        ]
        log.warning(
            "degraded: %d file(s), %d bytes, have data on missing member(s) %s: %s",
            len(found),
            sum(inode.size for inode in found),
            ", ".join(str(i + 1) for i in sorted(missing)),
            "dropped (--drop-unreadable)"
            if drop
            else "kept and listed; every read of them fails (EIO) until the member returns",
        )
        what = "dropped" if drop else "unreadable"
        for inode in found[:LOGGED_NAMES]:
            log.warning("%s: inode %d %s", what, inode.ino, inode.name.decode(errors="replace"))
        if len(found) > LOGGED_NAMES:
            log.warning("%s: %d more file(s) not named here", what, len(found) - LOGGED_NAMES)
        return {inode.ino for inode in found}

    def _rebuild_allocator(self) -> None:
        """Claim every mapped unit; a file in one contiguous extent (the common case)
        is claimed in one step, read from the namespace's columns (no views).
        Units on a missing member are skipped: the allocator has none there."""
        missing = self._missing
        mark = self.alloc.mark_used
        firsts, rest = self.ns.unit_columns()
        fragments = self.alloc.claim_firsts(firsts, missing)
        for first, count in itertools.chain(((p, 1) for p in fragments), rest):
            if first >> DEV_SHIFT not in missing:
                mark(first >> DEV_SHIFT, first & UNIT_MASK, count)
