"""Extent allocator: one byte per unit per device, searched at C speed.

Pure and synchronous. A unit is the allocation granule (1 MiB by default). The map
is a ``bytearray`` per device (0 = free, 1 = used), so finding a contiguous run of
n free units is ``bytearray.find(b"\\0" * n, cursor)`` — a memchr-speed scan even for
millions of units — and freeing is a slice assignment. A next-fit cursor per device
spreads writes over the device and keeps freshly freed runs coalesced: neighbours
are merged for free because the map *is* the coalesced state.

Small files and tails: a unit may be split into fragments
(``format.records.fragment_size``, 4 KiB at 1 MiB units). A *host* unit is used in the
unit map and has a byte per fragment of its own; a file's last, partial unit takes a
run of fragments in a host with room (the first few hosts with enough free fragments
are tried, then a fresh unit becomes a host), and a host whose last fragment is freed
goes back to the unit map. Addresses are unit fields (``kvfs.format.records``): a
field with ``FRAG_FLAG`` names fragments, and ``free``/``mark_used`` take either form.

Nothing here is persisted: at mount the map is rebuilt from the index (every unit an
inode maps is used), so the index and the allocator cannot disagree.

Statistics are cheap at any size (``kvfs stats`` must not scan 2.5x10^8 units of a
245 TB drive): the number of free runs is kept exactly by every take and free (only
the two neighbouring units decide whether runs split or merge), and the largest free
run comes from per-chunk summaries (``SUMMARY_UNITS`` units each) recomputed only for
the chunks changed since the last call.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import islice, repeat
from operator import sub

from kvfs.common.errors import NoSpace
from kvfs.format.records import (
    DEV_SHIFT,
    FRAG_FLAG,
    HOST_MASK,
    UNIT_MASK,
    fragment_field,
    split_fragment,
)

FRAGMENT_SCAN = 8
"""Hosts with free fragments tried (those that gained room last first) before a fresh
unit becomes a host: a fragment allocation stays O(1) however many hosts there are;
a nearly full host is soon passed over, not searched again and again."""

SUMMARY_UNITS = 1 << 18
"""Units per chunk summary of the largest free run (256 GiB of 1 MiB units): a changed
chunk costs a few C-speed passes over its 256 KiB of map; 892 summaries at 245 TB."""


@dataclass(frozen=True)
class AllocatorStatistics:
    total_units: int
    free_units: int
    free_runs: int
    largest_free_run: int
    fragment_hosts: int = 0
    """Units split into fragments (counted as used units above)."""
    fragments_used: int = 0
    fragments_per_unit: int = 0


class Allocator:
    """Hands out runs of units on several devices."""

    def __init__(self, units_per_device: list[int], fragments_per_unit: int = 0) -> None:
        self._maps = [bytearray(n) for n in units_per_device]
        self._free = list(units_per_device)
        self._cursor = [0] * len(units_per_device)
        self.total_units = sum(units_per_device)
        self.offline: set[int] = set()
        self.fragments_per_unit = fragments_per_unit
        """0 or 1: no fragments (every allocation is whole units)."""
        n = len(units_per_device)
        self._hosts: list[dict[int, bytearray]] = [{} for _ in range(n)]  # host -> fragment map
        self._roomy: list[dict[int, int]] = [{} for _ in range(n)]  # host -> free fragments
        self.fragments_used = 0
        self._runs = sum(1 for n in units_per_device if n)  # free runs, kept exactly
        # per device and chunk: (leading free, trailing free, largest free run), all
        # free at first, and the chunks changed since they were summarised
        self._summary = [
            [self._free_chunk(n, c) for c in range(-(-n // SUMMARY_UNITS))]
            for n in units_per_device
        ]
        self._stale: list[set[int]] = [set() for _ in units_per_device]

    @property
    def fragment_hosts(self) -> int:
        return sum(len(h) for h in self._hosts)

    @property
    def free_fragments(self) -> int:
        """Free fragments inside hosts on devices that still take writes."""
        return sum(sum(r.values()) for d, r in enumerate(self._roomy) if d not in self.offline)

    @staticmethod
    def _free_chunk(units: int, c: int) -> tuple[int, int, int]:
        size = min(SUMMARY_UNITS, units - c * SUMMARY_UNITS)
        return size, size, size

    @property
    def free_units(self) -> int:
        """Free units on devices that are still taking writes."""
        return sum(f for d, f in enumerate(self._free) if d not in self.offline)

    @property
    def online_units(self) -> int:
        """Units of the devices that are still taking writes."""
        return sum(len(m) for d, m in enumerate(self._maps) if d not in self.offline)

    def set_offline(self, dev: int) -> None:
        """Stop placing new data on a device (it failed a write)."""
        self.offline.add(dev)

    def device_free(self, dev: int) -> int:
        return self._free[dev]

    def mark_used(self, dev: int, start: int, count: int = 1) -> None:
        """Claim units known to be in use (index rebuild); they must be free.
        ``start`` may be a fragment field (``count`` consecutive fields, then)."""
        if start & FRAG_FLAG:
            for i in range(count):
                self._mark_fragments(dev, start + i)
            return
        m = self._maps[dev]
        if any(m[start : start + count]):
            raise ValueError(f"unit {dev}:{start}+{count} is claimed twice")
        self._set(dev, start, count, used=True)

    def claim_firsts(self, chunks: Iterable[array[int]], skip: AbstractSet[int]) -> list[int]:
        """Index rebuild, fast path: claim the unit named by every non-zero entry of
        ``chunks`` (unit addresses + 1, as the namespace's first-unit column holds
        them) at one byte store each, skipping devices in ``skip``. Fragment runs
        are not claimed here: their addresses are returned, for :meth:`mark_used`.
        A unit claimed twice (a corrupt index) is found afterwards by counting the
        map's free bytes: ValueError, as :meth:`mark_used` raises."""
        maps = self._maps
        claimed = [0] * len(maps)
        fragments: list[int] = []
        first_map = maps[0] if maps and 0 not in skip else None
        try:
            for chunk in chunks:
                values = list(filter(None, chunk))  # C speed from here on
                if not values:
                    continue
                if first_map is not None and min(values) > 0 and max(values) <= FRAG_FLAG:
                    # whole units on device 0 only (the common chunk): stores at C speed
                    deque(
                        map(first_map.__setitem__, map(sub, values, repeat(1)), repeat(1)),
                        maxlen=0,
                    )
                    claimed[0] += len(values)
                    continue
                for v in values:
                    p = v - 1
                    if p & FRAG_FLAG:
                        fragments.append(p)
                        continue
                    d = p >> DEV_SHIFT
                    if d not in skip:
                        maps[d][p & UNIT_MASK] = 1
                        claimed[d] += 1
        except IndexError as e:
            raise ValueError(f"a unit address past its device: {e}") from e
        for d, m in enumerate(maps):
            free = m.count(0)
            if self._free[d] - free != claimed[d]:
                raise ValueError(
                    f"device {d}: {claimed[d] - self._free[d] + free} unit(s) claimed twice"
                )
            self._free[d] = free
            self._stale[d].update(range(len(self._summary[d])))
        self._runs = sum(m.count(b"\x01\x00") + (m[:1] == b"\x00") for m in maps)
        return fragments

    def free(self, dev: int, start: int, count: int = 1) -> None:
        """Free units, or ``count`` consecutive fragment fields from ``start``."""
        if start & FRAG_FLAG:
            for i in range(count):
                self._free_fragments(dev, start + i)
            return
        m = self._maps[dev]
        if m[start : start + count] != b"\x01" * count:
            raise ValueError(f"freeing units {dev}:{start}+{count} that are not all in use")
        self._set(dev, start, count, used=False)

    def _set(self, dev: int, start: int, count: int, used: bool) -> None:
        """Mark a run of units that are all free (``used``) or all used (not
        ``used``): the free counts follow, the number of free runs changes by what
        the neighbours say (a run taken out of a free run leaves 0, 1 or 2 pieces of
        it; a run freed joins 0, 1 or 2 free neighbours), the chunks go stale."""
        m = self._maps[dev]
        end = start + count
        free_neighbours = (start > 0 and not m[start - 1]) + (end < len(m) and not m[end])
        m[start:end] = b"\x01" * count if used else bytes(count)
        self._free[dev] += -count if used else count
        self._runs += (free_neighbours - 1) if used else (1 - free_neighbours)
        self._stale[dev].update(range(start // SUMMARY_UNITS, (end - 1) // SUMMARY_UNITS + 1))

    def allocate(self, count: int, device: int, near: int = -1) -> list[tuple[int, int, int]]:
        """``count`` units as few (device, start, count) runs as possible.

        Prefers one contiguous run on ``device`` right after unit ``near`` (so a
        file growing segment by segment stays contiguous), then anywhere on that
        device, then on the other devices, and only then splits the request over
        the largest free runs. NoSpace if fewer than ``count`` units are free.
        """
        if count > self.free_units:
            raise NoSpace(f"need {count} units, {self.free_units} free")
        order = [d for d in (device, *range(len(self._maps))) if d not in self.offline]
        order = list(dict.fromkeys(order))
        for dev in order:
            start = self._find(dev, count, near if dev == device else -1)
            if start >= 0:
                self._take(dev, start, count)
                return [(dev, start, count)]
        return self._allocate_split(count, order)

    def _find(self, dev: int, count: int, near: int) -> int:
        m = self._maps[dev]
        if self._free[dev] < count:
            return -1
        pattern = bytes(count)
        if near >= 0 and m[near : near + count] == pattern and near + count <= len(m):
            return near
        start = m.find(pattern, self._cursor[dev])
        if start < 0:
            start = m.find(pattern, 0)
        return start

    def _take(self, dev: int, start: int, count: int) -> None:
        self._set(dev, start, count, used=True)
        self._cursor[dev] = start + count

    def _allocate_split(self, count: int, order: list[int]) -> list[tuple[int, int, int]]:
        runs: list[tuple[int, int, int]] = []
        for dev in order:
            m = self._maps[dev]
            pos = 0
            while count and self._free[dev]:
                start = m.find(0, pos)
                if start < 0:
                    break
                end = m.find(1, start)
                end = len(m) if end < 0 else end
                n = min(end - start, count)
                self._take(dev, start, n)
                runs.append((dev, start, n))
                count -= n
                pos = start + n
        assert count == 0, "free count and map disagree"
        return runs

    # ------------------------------------------------------------------ fragments
    def allocate_fragments(self, count: int, device: int) -> tuple[int, int]:
        """``count`` consecutive fragments as (device, fragment field) on ``device``
        (so a tail stays on its stripe's device, as a whole unit would): in one of
        its hosts that gained room last, else in a fresh unit that becomes a host,
        else in any of its hosts; only then on another device. NoSpace if no device
        has room."""
        assert 1 <= count < self.fragments_per_unit
        order = [d for d in (device, *range(len(self._maps))) if d not in self.offline]
        for dev in dict.fromkeys(order):
            field = self._fit(dev, count, FRAGMENT_SCAN)
            if field < 0:
                host = self._find(dev, 1, -1)
                if 0 <= host <= HOST_MASK:
                    self._take(dev, host, 1)
                    self._hosts[dev][host] = bytearray(self.fragments_per_unit)
                    self._roomy[dev][host] = self.fragments_per_unit
                    field = self._take_fragments(dev, host, 0, count)
                else:
                    field = self._fit(dev, count, None)
            if field >= 0:
                return dev, field
        raise NoSpace(f"need {count} fragments, no unit or host has room")

    def _fit(self, dev: int, count: int, scan: int | None) -> int:
        """A run in one of the ``scan`` hosts that gained room last (all: None)."""
        pattern = bytes(count)
        roomy = self._roomy[dev]
        for host, free in islice(reversed(roomy.items()), scan):
            if free >= count:
                start = self._hosts[dev][host].find(pattern)
                if start >= 0:
                    return self._take_fragments(dev, host, start, count)
        return -1

    def _take_fragments(self, dev: int, host: int, start: int, count: int) -> int:
        self._hosts[dev][host][start : start + count] = b"\x01" * count
        left = self._roomy[dev][host] - count
        if left:
            self._roomy[dev][host] = left
        else:
            del self._roomy[dev][host]
        self.fragments_used += count
        return fragment_field(host, start, count)

    def _mark_fragments(self, dev: int, field: int) -> None:
        host, start, count = split_fragment(field)
        if host not in self._hosts[dev]:
            self.mark_used(dev, host)  # a unit held whole cannot also be a host
            self._hosts[dev][host] = bytearray(self.fragments_per_unit)
            self._roomy[dev][host] = self.fragments_per_unit
        m = self._hosts[dev][host]
        if start + count > len(m) or any(m[start : start + count]):
            raise ValueError(f"fragments {dev}:{host}:{start}+{count} are claimed twice")
        self._take_fragments(dev, host, start, count)

    def _free_fragments(self, dev: int, field: int) -> None:
        host, start, count = split_fragment(field)
        m = self._hosts[dev].get(host)
        if m is None or m[start : start + count] != b"\x01" * count:
            raise ValueError(f"freeing fragments {dev}:{host}:{start}+{count} not in use")
        m[start : start + count] = bytes(count)
        self.fragments_used -= count
        # re-inserted, so the host is among the first tried (``_fit`` scans newest first)
        left = self._roomy[dev].pop(host, 0) + count
        if left < self.fragments_per_unit:
            self._roomy[dev][host] = left
            return
        del self._hosts[dev][host]
        self.free(dev, host)  # the whole unit is free again

    def is_used(self, dev: int, unit: int) -> bool:
        return bool(self._maps[dev][unit])

    def largest_free_run(self) -> int:
        """The longest run of free units on any device (offline ones included, as
        ``free_runs``): stale chunk summaries are redone, then joined in order."""
        largest = 0
        for dev, m in enumerate(self._maps):
            summary = self._summary[dev]
            for c in self._stale[dev]:
                summary[c] = self._summarise(m, c)
            self._stale[dev].clear()
            run = 0  # free units running into the current chunk
            for c, (lead, trail, best) in enumerate(summary):
                size = min(SUMMARY_UNITS, len(m) - c * SUMMARY_UNITS)
                if lead == size:
                    run += size
                    continue
                largest = max(largest, run + lead, best)
                run = trail
            largest = max(largest, run)
        return largest

    @staticmethod
    def _summarise(m: bytearray, c: int) -> tuple[int, int, int]:
        """(leading free, trailing free, largest free run) of chunk ``c`` of map ``m``:
        C-speed count and find passes, one Python step per free run in the chunk (a
        full pool's chunks have few; a chunk fragmented unit by unit costs ~20 ms)."""
        start = c * SUMMARY_UNITS
        end = min(start + SUMMARY_UNITS, len(m))
        free = m.count(0, start, end)
        if free in (0, end - start):
            return free, free, free
        lead = m.find(1, start, end) - start
        trail = end - 1 - m.rfind(1, start, end)
        best, pos = max(lead, trail), start + lead + 1
        while True:
            pos = m.find(0, pos, end - trail)
            if pos < 0:
                return lead, trail, best
            stop = m.find(1, pos, end)
            best, pos = max(best, stop - pos), stop

    def statistics(self) -> AllocatorStatistics:
        return AllocatorStatistics(
            self.total_units,
            self.free_units,
            self._runs,
            self.largest_free_run(),
            self.fragment_hosts,
            self.fragments_used,
            self.fragments_per_unit,
        )
