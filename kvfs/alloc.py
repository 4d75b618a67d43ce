"""Extent allocator: one byte per unit per device, searched at C speed.

Pure and synchronous. A unit is the allocation granule (1 MiB by default). The map
is a ``bytearray`` per device (0 = free, 1 = used), so finding a contiguous run of
n free units is ``bytearray.find(b"\\0" * n, cursor)`` — a memchr-speed scan even for
millions of units — and freeing is a slice assignment. A next-fit cursor per device
spreads writes over the device and keeps freshly freed runs coalesced: neighbours
are merged for free because the map *is* the coalesced state.

Nothing here is persisted: at mount the map is rebuilt from the index (every unit an
inode maps is used), so the index and the allocator cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfs.errors import NoSpace


@dataclass(frozen=True)
class AllocatorStatistics:
    total_units: int
    free_units: int
    free_runs: int
    largest_free_run: int


class Allocator:
    """Hands out runs of units on several devices."""

    def __init__(self, units_per_device: list[int]) -> None:
        self._maps = [bytearray(n) for n in units_per_device]
        self._free = list(units_per_device)
        self._cursor = [0] * len(units_per_device)
        self.total_units = sum(units_per_device)
        self.offline: set[int] = set()

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
        """Claim units known to be in use (index rebuild); they must be free."""
        m = self._maps[dev]
        if any(m[start : start + count]):
            raise ValueError(f"unit {dev}:{start}+{count} is claimed twice")
        m[start : start + count] = b"\x01" * count
        self._free[dev] -= count

    def free(self, dev: int, start: int, count: int = 1) -> None:
        m = self._maps[dev]
        if m[start : start + count] != b"\x01" * count:
            raise ValueError(f"freeing units {dev}:{start}+{count} that are not all in use")
        m[start : start + count] = bytes(count)
        self._free[dev] += count

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
        self._maps[dev][start : start + count] = b"\x01" * count
        self._free[dev] -= count
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

    def is_used(self, dev: int, unit: int) -> bool:
        return bool(self._maps[dev][unit])

    def statistics(self) -> AllocatorStatistics:
        runs = largest = 0
        for m in self._maps:
            for run in m.split(b"\x01"):
                if run:
                    runs += 1
                    largest = max(largest, len(run))
        return AllocatorStatistics(self.total_units, self.free_units, runs, largest)
