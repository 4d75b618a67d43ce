"""What the store reports: its statistics (``kvfs stats``, the metrics read these
names), each member's space, the top-level directories' usage, and the files evicted
by reason. Read-only over the store's parts; O(top-level directories) at most."""

from __future__ import annotations

import heapq
import uuid
from dataclasses import asdict
from operator import itemgetter
from typing import Any

from kvfs.devices.alloc import Allocator
from kvfs.devices.pool import Pool
from kvfs.evict.driver import EvictionDriver
from kvfs.evict.evictor import Evictor
from kvfs.evict.space import Space
from kvfs.format.records import fragment_size
from kvfs.index.namespace import ROOT_INO, Namespace
from kvfs.log.journal import Journal
from kvfs.store.cache import UnitCache
from kvfs.store.handles import Handles
from kvfs.store.hooks import Hooks
from kvfs.store.leases import DirectPath
from kvfs.store.reader import Reader
from kvfs.store.types import DeviceSpace, DirectoryUsage, StoreStatistics, Traffic
from kvfs.store.writer import Writer


class Reports:
    """The reports of one store, from its parts."""

    def __init__(
        self,
        pool: Pool,
        ns: Namespace,
        alloc: Allocator,
        journal: Journal,
        cache: UnitCache,
        space: Space,
        eviction: EvictionDriver,
        evictor: Evictor,
        handles: Handles,
        reader: Reader,
        writer: Writer,
        direct: DirectPath,
        hooks: Hooks,
        traffic: Traffic,
        unreadable: set[int],
    ) -> None:
        self.pool, self.ns, self.alloc, self.journal = pool, ns, alloc, journal
        self.cache, self.space, self.evictor, self.handles = cache, space, evictor, handles
        self.eviction = eviction
        self.reader, self.writer, self.direct, self.hooks = reader, writer, direct, hooks
        self.traffic, self.unreadable = traffic, unreadable
        self.unit = pool.unit_size
        self._fragment = fragment_size(self.unit)

    def device_space(self) -> list[DeviceSpace]:
        """Data capacity and free space of each member: kvfs uses all of every
        member, whatever their sizes (stripes rotate; a full member is skipped)."""
        return [
            DeviceSpace(
                dev.path,
                sb.data_units * self.unit,
                self.alloc.device_free(i) * self.unit,
                i not in self.alloc.offline,
            )
            for i, (dev, sb) in enumerate(
                zip(self.pool.devices, self.pool.superblocks, strict=True)
            )
        ]

    DIRECTORY_LIMIT = 256
    """Top-level directories ``directory_usage`` reports at most (the largest)."""

    def directory_usage(self) -> list[DirectoryUsage]:
        """Usage, quota and policy of each top-level directory, largest first (at most
        :attr:`DIRECTORY_LIMIT`), then the root's own files as ``/`` if it has any.
        O(top-level directories): the usage comes from running counters
        (:meth:`Space.placed`, :meth:`Space.charge`), never from a walk."""
        largest = heapq.nlargest(self.DIRECTORY_LIMIT, self.space.top_level(), key=itemgetter(1))
        rows = [
            DirectoryUsage(
                self.ns.inodes[ino].name.decode(errors="replace"),
                used,
                self.evictor.group_quota(ino),
                self.evictor.group_policy(ino),
            )
            for ino, used in largest
        ]
        rows.sort(key=lambda r: (-r.used_bytes, r.name))
        own = self.space.group_usage(ROOT_INO)
        if own:
            rows.append(DirectoryUsage("/", own, 0, self.evictor.group_policy(ROOT_INO)))
        return rows

    def all_statistics(self) -> dict[str, Any]:
        """Every part's statistics, as ``kvfs stats`` shows them."""
        return {
            "pool": self.describe(),
            "store": asdict(self.statistics()),
            "allocator": asdict(self.alloc.statistics()),
            "cache": asdict(self.cache.statistics()),
            "journal": asdict(self.journal.statistics()),
            "metadata": asdict(self.eviction.metadata_statistics()),
            "eviction": asdict(self.evictor.statistics()),
            "devices": [asdict(d.statistics()) for d in self.pool.devices],
            "space": [asdict(d) for d in self.device_space()],
            "direct": asdict(self.direct.statistics()),
            # flat rows: dict(vars()) is ~5x cheaper than asdict's deep copy (256 rows)
            "directories": [dict(vars(d)) for d in self.directory_usage()],
            "evictions": self.eviction_counts(),
            **self.hooks.reports(),
        }

    def describe(self) -> dict[str, str | int]:
        """What identifies the mounted pool (``kvfs stats``' ``pool``, the metrics'
        ``kvfs_pool_info``): words as strings, counts and sizes as numbers."""
        sb = self.pool.superblocks[0]
        return {
            "label": sb.label,
            "uuid": str(uuid.UUID(bytes=sb.pool_uuid)),
            "format": sb.version,
            "devices": len(self.pool.devices),
            "unit_size": self.unit,
            "eviction": self.evictor.policy.name,
        }

    def eviction_counts(self) -> list[dict[str, Any]]:
        """Files evicted since the mount, by reason and top-level directory (``/``: the
        root's own files; ``(removed)``: a directory gone since), most first."""
        merged: dict[tuple[str, str], int] = {}
        for (reason, group), n in self.eviction.evicted_by.items():
            key = (reason, self._group_name(group))
            merged[key] = merged.get(key, 0) + n
        order = sorted(merged.items(), key=lambda kv: (-kv[1], kv[0]))
        return [{"reason": r, "directory": d, "files": n} for (r, d), n in order]

    def _group_name(self, group: int) -> str:
        """A top-level directory's name; ``/`` for the root, ``(removed)`` if gone."""
        if group == ROOT_INO:
            return "/"
        inode = self.ns.inodes.get(group)
        names = self.ns.names_of(inode) if inode is not None else []
        top = [n for parent, n in names if parent == ROOT_INO]
        return top[0].decode(errors="replace") if top else "(removed)"

    def statistics(self) -> StoreStatistics:
        # claimed units are spoken for; free fragments in host units are free bytes
        free = max(self.space.available(), 0) * self.unit
        free += self.alloc.free_fragments * self._fragment
        cap = self.alloc.total_units * self.unit
        devs = [d.statistics() for d in self.pool.devices]
        return StoreStatistics(
            files=self.ns.file_count,
            directories=self.ns.dir_count,
            unit_size=self.unit,
            capacity_bytes=cap,
            used_bytes=cap - free,
            free_bytes=free,
            dirty_bytes=self.writer.dirty_bytes,
            pending_free_bytes=self.space.pending_free() * self.unit,
            reads=self.traffic.reads,
            stale_size_reads=self.traffic.stale_size_reads,
            writes=self.traffic.writes,
            bytes_read=self.traffic.bytes_read,
            bytes_written=self.traffic.bytes_written,
            device_bytes_read=sum(d.bytes_read for d in devs),
            device_bytes_written=sum(d.bytes_written for d in devs),
            corruptions=len(self.reader.bad_units),
            incomplete=self.writer.incomplete,
            evictions=self.evictor.evictions,
            orphan_evictions=self.evictor.orphan_evictions,
            quarantined=self.reader.quarantined,
            unreadable_files=len(self.unreadable),
            open_handles=len(self.handles),
            bytes_read_memory=self.reader.bytes_from_memory,
            bytes_read_device=self.reader.bytes_from_device,
            room_waits=self.eviction.room_waits,
            room_wait_seconds=round(self.eviction.room_wait_seconds, 6),
            headroom_bytes=self.eviction.headroom_bytes(),
        )
