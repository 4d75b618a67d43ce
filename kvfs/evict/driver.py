"""The eviction driver: it makes room, and decides when and why files go.

It keeps usage under the high watermark (a background task, :meth:`EvictionDriver.evict_loop`),
and makes room inline when a write finds none (:meth:`EvictionDriver.ensure`: the
group's quota first, then the pool, fair shares between users): it asks the
:class:`~kvfs.evict.evictor.Evictor` for victims (who may go, in which order) and has
the store remove them (``evict``); NoSpace/QuotaExceeded only when nothing may be
evicted. Metadata pressure is eviction pressure too: when the next checkpoint would
come near the metadata area's limit, files go by the same rules until it shrinks
(:meth:`EvictionDriver.make_metadata_room`). Free space and usage counters are
:class:`~kvfs.evict.space.Space`'s. Everything here runs on the trio thread.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import trio

from kvfs.common.errors import DeviceError, KvfsError, NoSpace, QuotaExceeded
from kvfs.evict.evictor import Evictor
from kvfs.evict.groups import KVFS_MANAGED
from kvfs.evict.space import Space
from kvfs.format.geometry import CHECKPOINT_FILE_BYTES, CHECKPOINT_UNIT_BYTES, META_FULL
from kvfs.index.namespace import ROOT_INO, Inode, Namespace
from kvfs.log.journal import Journal

log = logging.getLogger(__name__)

EVICTION_LOG_INTERVAL = 5.0
"""Seconds between the INFO lines that sum up evictions (a line per file is DEBUG)."""
META_HIGH = 0.70
"""Share of a metadata half the next checkpoint may reach (estimated) before the
background evictor acts; the synchronous path acts at ``META_FULL`` (0.75) of the
last checkpoint, where growth would otherwise be refused."""
META_LOW = 0.65
"""Share of a half that eviction for metadata brings the next checkpoint down to:
a create storm at the limit pays one eviction batch and one checkpoint per ~10% of
a half, not one per create."""
META_BASIS = 256
"""Inodes a checkpoint must hold before its bytes per inode serve as the estimate
of what each removed inode gives back (below, a sample of the newest inodes does)."""
META_SAMPLE = 64
"""Newest inodes whose records are encoded to estimate what each added one costs."""
DENTRY_BYTES, XATTR_BYTES = 19, 15
"""DENTRY and XATTR operations before their names and values (docs/format.md)."""
EVICTION_STATE_BYTES = 64
"""What the eviction state adds to a checkpoint per file: the policy's columns for
the file and for a ghost key (the ``kvfs`` policy: 29 B each at the columns' own
codes, less in narrow chunks), its owner (2). Measured: 22 B per tracked, owned
file, 49 B with as many ghost keys (sparse ones, mapped); 31 / 69 B before narrow
chunks (it was 80). See ``format.geometry.CHECKPOINT_FILE_BYTES``."""


@dataclass(frozen=True)
class MetadataStatistics:
    """How full the metadata area is (``kvfs stats``)."""

    area_bytes: int
    """The whole area: two halves."""
    half_bytes: int
    limit_bytes: int
    """A checkpoint larger than this (``META_FULL`` of a half) is metadata pressure."""
    checkpoint_bytes: int
    """The last checkpoint."""
    journal_bytes: int
    """Journal behind the last checkpoint, in the current half."""
    next_checkpoint_bytes: int
    """Estimated size of the next checkpoint."""
    evictions: int
    """Files evicted to make metadata room since the mount."""


def _units_weight(inode: Inode) -> int:
    """What evicting a file gains for data: its units (an empty file counts one, so
    every victim is progress)."""
    return max(inode.mapped_units, 1)


def _file_weight(inode: Inode) -> int:
    return 1


HEADROOM_SHARE = 0.03
"""The most of the pool the background round keeps free (the headroom), and frees
in one round (the batch), unless :data:`HEADROOM_BYTES` is less."""
HEADROOM_BYTES = 1 << 30
"""Headroom and batch, per device, at most. The headroom must hold what writers store
while a round's frees wait for one journal commit (a few ms): a Gen5 drive's 14 GB/s
for 10 ms is 140 MB, so a GiB is ample, where 3 % of a 245 TB drive would keep 7 TB
idle (``docs/eviction.md``, "The headroom follows the writers")."""
DEMAND_HALF_LIFE = 10.0
"""Seconds in which the writers' demand (:meth:`EvictionDriver.headroom_units`) a
burst set falls by half."""


def headroom_cap(units: int, unit: int, devices: int) -> int:
    """The most units the headroom (and a batch) may take of a pool of ``units``."""
    return max(1, min(int(units * HEADROOM_SHARE), HEADROOM_BYTES * max(devices, 1) // unit))


def default_watermarks(capacity: int, devices: int) -> tuple[float, float]:
    """The watermarks with the largest headroom and batch (:func:`headroom_cap`) of a
    pool of ``capacity`` bytes: what one named watermark is paired with, and what
    ``kvfs plan`` assumes."""
    if capacity <= 0:
        return 1 - HEADROOM_SHARE, 1 - 2 * HEADROOM_SHARE
    share = min(HEADROOM_SHARE, HEADROOM_BYTES * max(devices, 1) / capacity)
    return 1 - share, 1 - 2 * share


class EvictionDriver:
    """Eviction for one store: room for writes, watermarks, metadata pressure."""

    def __init__(
        self,
        space: Space,
        journal: Journal,
        ns: Namespace,
        evictor: Evictor,
        *,
        evictable: Callable[[Inode], bool],
        evict: Callable[[Inode], None],
        pinned: Callable[[int], int] = lambda uid: 0,
        privileged: Callable[[int], bool] = lambda uid: uid == 0,
        checkpointed_inodes: Callable[[], int] = lambda: 0,
        high_watermark: float | None = None,
        low_watermark: float | None = None,
    ) -> None:
        self.space, self.journal, self.ns, self.evictor = space, journal, ns, evictor
        self.alloc, self.unit = space.alloc, space.unit
        self._evictable, self._evict = evictable, evict
        self._pinned, self._privileged = pinned, privileged
        self._cap = headroom_cap(space.alloc.total_units, space.unit, len(space.pool.devices))
        self._demand = 0.0  # units, decayed: see headroom_units
        self._demand_at = time.monotonic()
        self._fixed: tuple[float, float] | None = None
        if high_watermark is not None or low_watermark is not None:
            high, low = default_watermarks(
                space.alloc.total_units * space.unit, len(space.pool.devices)
            )
            gap = high - low
            if high_watermark is None:
                assert low_watermark is not None
                high, low = min(1.0, low_watermark + gap), low_watermark
            elif low_watermark is None:
                high, low = high_watermark, max(high_watermark - gap, high_watermark / 2)
            else:
                high, low = high_watermark, low_watermark
            if not 0 < low < high <= 1:
                raise ValueError("watermarks must satisfy 0 < low < high <= 1")
            self._fixed = (high, low)
        self._evicted = [0, 0, 0]  # files, units, orphans since the last log line
        self._evicted_since = -EVICTION_LOG_INTERVAL  # the first eviction logs at once
        self._evict_wake = trio.Event()
        self._checkpointed_inodes = checkpointed_inodes
        self._meta_lock = trio.Lock()
        self._meta_logged = -EVICTION_LOG_INTERVAL
        self._full_logged = -EVICTION_LOG_INTERVAL
        self.metadata_evictions = 0
        self.room_waits = 0
        """Writes that found no room and evicted for it themselves (the background
        round had not kept the headroom: ``docs/eviction.md``, "The headroom follows
        the writers")."""
        self.room_wait_seconds = 0.0
        self.evicted_by: dict[tuple[str, int], int] = {}
        """Files evicted by (reason, top-level directory inode); reasons: ``space``
        (the pool above its watermark or full), ``quota`` (a directory over its
        quota), ``metadata`` (the index over its area), ``orphan`` (a file whose last writer
        process is gone, whatever needed the room)."""
        self._meta_idle_until = 0.0  # no background retry before (nothing was evictable)
        self.stopping = False
        """Set by an unmount: background eviction stops (the kernel session ends soon,
        so nothing would learn of the removals, and the final checkpoint is near)."""

    # ------------------------------------------------------------------ watermarks
    def headroom_units(self) -> int:
        """Units the background round keeps free, and frees each round: twice the
        most the writers have had in flight lately (units claimed by writes not yet
        committed, the new claim's included; decayed by half every
        ``DEMAND_HALF_LIFE`` s), so that one round's frees are back before the
        writes in flight meanwhile fill the rest; at least a unit, at most
        :func:`headroom_cap`. A single writer of one-unit files keeps 2 units free,
        64 writers of 8 MiB chunks 1 GiB on a large pool (``docs/eviction.md``, "The
        headroom follows the writers")."""
        now = time.monotonic()
        self._demand *= 0.5 ** ((now - self._demand_at) / DEMAND_HALF_LIFE)
        self._demand_at = now
        return max(1, min(self._cap, math.ceil(2 * self._demand)))

    def headroom_bytes(self) -> int:
        """What the background round keeps free now (under the high watermark)."""
        return round((1 - self.high) * self.alloc.online_units) * self.unit

    def _note_demand(self, units: int) -> None:
        in_flight = self.space.in_flight() + units
        if in_flight > self._demand:  # over the undecayed peak, so over the decayed one
            self._demand, self._demand_at = float(in_flight), time.monotonic()

    def _watermarks(self) -> tuple[float, float]:
        if self._fixed is not None:
            return self._fixed
        total = self.alloc.online_units
        if total <= 0:  # no device takes writes: nothing to make room for, never evict
            return 1.0, 1.0
        # the cap was set on the whole pool; a device taken offline shrinks what is left
        h = min(self.headroom_units(), max(1, int(total * HEADROOM_SHARE)))
        return 1 - h / total, max(0.0, 1 - 2 * h / total)

    @property
    def high(self) -> float:
        """Evict in the background above this used share."""
        return self._watermarks()[0]

    @property
    def low(self) -> float:
        """... down to this one."""
        return self._watermarks()[1]

    # ------------------------------------------------------------------ eviction
    def evict_units(
        self,
        units: int,
        group: int | None = None,
        include_fresh: bool = False,
        owners: Collection[int] | None = None,
    ) -> int:
        """Evict files, best victims first, until ``units`` units are on their way
        back (sync: the frees complete once the journal has the unlinks). Files in
        their grace after a close go only with ``include_fresh`` (the last resort);
        ``owners``: only files of these uids."""
        return self._evict_by(units, _units_weight, group, include_fresh, owners)

    def evict_files(self, files: int, include_fresh: bool = False) -> int:
        """Evict up to ``files`` files, best victims first, by the rules of
        :meth:`evict_units` (metadata pressure: each one shrinks the index)."""
        return self._evict_by(files, _file_weight, None, include_fresh, None)

    def _evict_by(
        self,
        need: int,
        weigh: Callable[[Inode], int],
        group: int | None,
        include_fresh: bool,
        owners: Collection[int] | None,
    ) -> int:
        freed = 0
        cause = "quota" if group is not None else "metadata" if weigh is _file_weight else "space"
        self.evictor.reap()  # a writer that just exited leaves orphans: they go first
        candidates = self.evictor.candidates(self._evictable, group, include_fresh, owners)
        for inode, orphan in candidates:
            if freed >= need:
                break
            weight = weigh(inode)
            mapped = inode.mapped_units
            log.debug(
                "evicting inode %d of uid %d (%s, %d units)",
                inode.ino,
                inode.uid,
                "orphan" if orphan else "policy",
                mapped,
            )
            reason = "orphan" if orphan else cause
            key = (reason, self.evictor.group_of(inode))
            self.evicted_by[key] = self.evicted_by.get(key, 0) + 1
            self._evict(inode)
            self.evictor.evictions += 1
            self.evictor.orphan_evictions += orphan
            self._note_eviction(mapped, orphan)
            freed += weight
        return freed

    def _note_eviction(self, units: int, orphan: bool) -> None:
        ev = self._evicted
        ev[0], ev[1], ev[2] = ev[0] + 1, ev[1] + units, ev[2] + orphan
        self.log_evictions()

    def log_evictions(self) -> None:
        """One INFO line per EVICTION_LOG_INTERVAL at most, summing up evictions (the
        first after a quiet spell at once; the evictor's loop flushes the rest)."""
        ev, now = self._evicted, time.monotonic()
        if ev[0] and now - self._evicted_since >= EVICTION_LOG_INTERVAL:
            mib = ev[1] * self.unit >> 20
            log.info("evicted %d file(s), %d MiB (%d orphans)", ev[0], mib, ev[2])
            self._evicted, self._evicted_since = [0, 0, 0], now

    def _evict_or_last_resort(
        self, units: int, group: int | None = None, owners: Collection[int] | None = None
    ) -> int:
        """Evict ``units``; files still in their grace only if nothing else would do."""
        freed = self.evict_units(units, group, owners=owners)
        if freed < units:
            freed += self.evict_units(units - freed, group, include_fresh=True, owners=owners)
        return freed

    def _evict_fairly(self, units: int, uid: int) -> int:
        """Make room for ``units`` units of user ``uid``: a user over its fair share
        pushes out only its own files; otherwise users over theirs lose files first,
        then anyone (policy order)."""
        share = self.space.fair_share()
        usage = self.space.uid_usage()
        if not self._privileged(uid) and usage.get(uid, 0) + units * self.unit > share:
            return self._evict_or_last_resort(units, owners={uid})
        over = {u for u, used in usage.items() if used > share}
        freed = self._evict_or_last_resort(units, owners=over) if over else 0
        if freed < units:
            freed += self._evict_or_last_resort(units - freed)
        return freed

    async def ensure(self, inode: Inode, units: int) -> None:
        """Make room for ``units`` new units of ``inode`` (its group's quota first,
        then the pool), evicting as needed. Returns with ``available() >= units``
        and no await since that check, so the caller can claim them at once."""
        group = self.evictor.group_of(inode)
        quota = self.evictor.group_quota(group)
        if quota:
            over = self.space.group_usage(group) + units * self.unit - quota
            if (
                over > 0
                and self._evict_or_last_resort(-(-over // self.unit), group) * (self.unit) < over
            ):
                raise QuotaExceeded(f"directory quota of {quota} bytes is full")
        if not self.alloc.online_units:
            raise DeviceError("no device takes writes any more (every one failed a write)")
        uid = inode.uid
        privileged = self._privileged(uid)
        if not privileged and self._pinned(uid) + units * self.unit > self.space.fair_share():
            # open files are never evicted: no user may hold more than its share open
            raise NoSpace(f"uid {uid} holds its share of the pool open")
        reserve = 0 if privileged else self.space.reserve_units
        self._note_demand(units)
        if self.space.available() - reserve < units:
            self.room_waits += 1
            since = time.monotonic()
            try:
                await self._make_room(units, reserve, uid)
            finally:
                self.room_wait_seconds += time.monotonic() - since
        if self.space.used_fraction() > self.high:
            self._evict_wake.set()

    async def _make_room(self, units: int, reserve: int, uid: int) -> None:
        while self.space.available() - reserve < units:
            short = units + reserve - self.space.available()
            pending = self.space.pending_free()
            if pending < short and not self._evict_fairly(short - pending, uid) and not pending:
                raise NoSpace(f"pool full: {units} units needed, nothing may be evicted")
            freed = self.space.freed
            await self.journal.wait_durable()
            if self.space.available() - reserve < units:
                # bounded: units can also come back without a signal (a claim released)
                with trio.move_on_after(1.0):
                    await freed.wait()

    # ------------------------------------------------------------------ metadata pressure
    def _half_bytes(self) -> int:
        return self.journal.statistics().half_bytes

    def _newest(self, count: int) -> list[Inode]:
        """Up to ``count`` live inodes with the highest numbers (the newest, mostly;
        numbers are reused), looking at no more than 4x that many numbers."""
        inodes, out = self.ns.inodes, []
        for ino in range(self.ns.next_ino - 1, max(0, self.ns.next_ino - 1 - 4 * count), -1):
            inode = inodes.get(ino)
            if inode is not None:
                out.append(inode)
                if len(out) >= count:
                    break
        return out

    def _newest_cost(self, count: int) -> float:
        """Mean checkpoint bytes of the newest ``count`` inodes (at most META_SAMPLE):
        their records, names and xattrs as encoded, plus the eviction state."""
        sample = self._newest(min(count, META_SAMPLE))
        if not sample:
            return CHECKPOINT_FILE_BYTES + CHECKPOINT_UNIT_BYTES
        total = 0
        for inode in sample:
            total += self.ns.image_cost(inode.ino)
            total += 0 if inode.is_dir else EVICTION_STATE_BYTES
        return total / len(sample)

    def _bytes_per_inode(self) -> float:
        """What removing one inode gives back: the last checkpoint's mean when it is
        large enough to tell, else what the newest inodes cost."""
        then = self._checkpointed_inodes()
        if then >= META_BASIS:
            return self.journal.checkpoint_bytes / then
        return self._newest_cost(META_SAMPLE)

    def metadata_estimate(self) -> int:
        """Bytes the next checkpoint will take, estimated: the last one's, plus what
        the inodes added since cost (the newest, encoded), minus the last one's mean
        for every inode removed since."""
        grown = len(self.ns.inodes) - self._checkpointed_inodes()
        per = self._newest_cost(grown) if grown > 0 else self._bytes_per_inode()
        return max(0, int(self.journal.checkpoint_bytes + grown * per))

    def _metadata_excess(self, share: float) -> int:
        """Files to evict for the next checkpoint to fall to ``share`` of a half."""
        over = self.metadata_estimate() - share * self._half_bytes()
        return max(0, -int(-over // self._bytes_per_inode()))

    async def make_metadata_room(self, background: bool = False) -> None:
        """Bring the next checkpoint down to ``META_LOW`` of a half: evict files (data
        eviction's rules; files in their grace only as the last resort, never in the
        ``background``) and, if the last checkpoint is over the limit
        (``Journal.metadata_full``) and the index shrank since, take a fresh one; a
        checkpoint already running whose snapshot holds the index as it is is waited
        for instead. The caller checks ``metadata_full`` afterwards: still full means
        nothing more could go (ENOSPC). One caller at a time; the next finds the work
        done."""
        async with self._meta_lock:
            for _ in range(3):  # the estimate may be off: measure, and go on once or twice
                if not background and not self.journal.metadata_full:
                    return
                estimate, excess = self.metadata_estimate(), self._metadata_excess(META_LOW)
                if excess:
                    evicted = 0
                    if self._may_evict_any():
                        evicted = self.evict_files(excess)
                        if evicted < excess and not background:
                            evicted += self.evict_files(excess - evicted, include_fresh=True)
                    self.metadata_evictions += evicted
                    self._log_pressure(estimate, excess, evicted)
                    if background and not evicted:
                        self._meta_idle_until = time.monotonic() + EVICTION_LOG_INTERVAL
                shrunk = len(self.ns.inodes) < self._checkpointed_inodes()
                if self.journal.metadata_full and not shrunk and self.journal.checkpointing:
                    # the running checkpoint's snapshot already holds the index as it
                    # is (removals included): its size decides, so wait for it rather
                    # than answer ENOSPC from the one before it
                    await self.journal.checkpoint_settled()
                    continue
                if not (self.journal.metadata_full and shrunk):
                    return
                await self.journal.checkpoint()

    def _may_evict_any(self) -> bool:
        """False when no file can be a victim: no orphans and no kvfs-managed group
        (an all engine-managed pool whose writers live). Checked first because a
        fruitless walk of the policy's order costs O(files), on every refused
        operation."""
        self.evictor.reap()
        if self.evictor.orphans:
            return True
        tops = (
            d for d, _ in self.space.top_level()
        )  # (not a listing of the root: it may hold millions)
        groups = [ROOT_INO, *tops]
        return any(self.evictor.group_policy(g) == KVFS_MANAGED for g in groups)

    def _log_pressure(self, estimate: int, wanted: int, evicted: int) -> None:
        now = time.monotonic()
        if now - self._meta_logged >= EVICTION_LOG_INTERVAL:
            self._meta_logged = now
            log.info(
                "metadata pressure: the next checkpoint would fill ~%d%% of a metadata "
                "half (limit %d%%): %d of %d file(s) evicted to bring it to %d%%",
                estimate * 100 // max(self._half_bytes(), 1),
                int(META_FULL * 100),
                evicted,
                wanted,
                int(META_LOW * 100),
            )

    def metadata_statistics(self) -> MetadataStatistics:
        j = self.journal.statistics()
        return MetadataStatistics(
            area_bytes=self.space.pool.meta[2],
            half_bytes=j.half_bytes,
            limit_bytes=int(j.half_bytes * META_FULL),
            checkpoint_bytes=self.journal.checkpoint_bytes,
            journal_bytes=max(0, j.used_bytes - self.journal.checkpoint_bytes),
            next_checkpoint_bytes=self.metadata_estimate(),
            evictions=self.metadata_evictions,
        )

    def log_metadata_full(self) -> None:
        """A WARNING, once per EVICTION_LOG_INTERVAL: growth refused, nothing evictable."""
        now = time.monotonic()
        if now - self._full_logged >= EVICTION_LOG_INTERVAL:
            self._full_logged = now
            log.warning(
                "metadata area full and nothing may be evicted (open, engine-managed or "
                "directories): ENOSPC; reformat with a larger --meta-size for more files"
            )

    async def evict_loop(self) -> None:
        """Keep usage under the high watermark, evicting down to the low one, so
        writers rarely wait for eviction; also turns dead owners' files to orphans.
        A failing metadata log must not end the mount (it is fail-stop: commits get
        EIO, reads go on), so its errors are logged here, once, and waited out."""
        failed = False
        while True:
            with trio.move_on_after(0.5):
                await self._evict_wake.wait()
            self._evict_wake = trio.Event()
            if self.stopping:  # unmounting: nothing is evicted behind the last checkpoint
                continue
            self.evictor.reap()
            self.log_evictions()
            metadata = (
                self.metadata_estimate() > META_HIGH * self._half_bytes()
                and time.monotonic() >= self._meta_idle_until
            )
            if self.space.used_fraction() > self.high or metadata:
                if self.space.used_fraction() > self.high:
                    target = self.space.used_fraction() - self.low
                    self.evict_units(int(target * self.alloc.total_units) + 1)
                try:
                    if metadata:
                        await self.make_metadata_room(background=True)
                    await self.journal.wait_durable()
                except KvfsError as e:
                    if not failed:
                        log.error("background eviction stopped: %s", e)
                    failed = True
