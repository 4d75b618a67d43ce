"""What the slot-table policies share: residency, sizes, counters and persistence."""

from __future__ import annotations

from array import array
from collections.abc import Collection
from itertools import compress
from typing import TYPE_CHECKING, ClassVar

from kvfs.policy import PolicyStatistics
from kvfs.policy import image as img
from kvfs.policy.slots import NO_KEY, SlotTable

if TYPE_CHECKING:
    from kvfs.policy.image import Columns, Image

ORDER = 0
"""The single list of LRU and FIFO (list ids double as sentinel slots)."""


class LinkedPolicy:
    """Shared state and persistence of the policies: slots, sizes, lists and counters."""

    name: str = ""
    _kind: ClassVar[int] = 0
    _lists: ClassVar[tuple[int, ...]] = (ORDER,)  # persisted lists, in image order
    _slot_lists: ClassVar[int] = 1  # lists including unpersisted ones (the ghost)
    _columns: ClassVar[tuple[str, ...]] = ("q",)  # typecodes; column 0 is the size

    def __init__(self) -> None:
        self._slots = SlotTable(self._slot_lists, self._columns)
        self._size = self._slots.columns[0]
        self._resident = 0
        self._bytes = 0
        self._tracks = 0
        self._touches = 0
        self._removes = 0

    def _slot(self, key: object) -> int | None:
        """Return the slot of resident ``key``, or None."""
        slot = self._slots.index.get(key)  # type: ignore[call-overload]
        if slot is None or self._slots.owner[slot] not in self._lists:
            return None
        return int(slot)

    def __contains__(self, key: object) -> bool:
        return self._slot(key) is not None

    def __len__(self) -> int:
        return self._resident

    def keys(self) -> set[int]:
        """Return the tracked keys (a new set, in no particular order)."""
        table, lists = self._slots, len(self._slots.count)  # sentinels hold no key
        resident = map(self._lists.__contains__, table.owner[lists:])
        return set(compress(table.key[lists:], resident))

    def rekey(self, old: int, new: int) -> None:
        """Give the remembered (ghost) key ``old`` the key ``new``; no-op for
        policies without ghosts, a resident or unknown ``old`` or a known ``new``."""
        table = self._slots
        slot = table.index.get(old)
        if slot is None or table.owner[slot] in self._lists or new in table.index or new < 0:
            return
        del table.index[old]
        table.key[slot] = new
        table.index[new] = slot

    def size_of(self, key: int) -> int:
        """Return the size of resident ``key`` (0 if it is not resident)."""
        slot = self._slot(key)
        return 0 if slot is None else self._size[slot]

    def keys_in_image_order(self) -> list[int]:
        """Return the resident keys list by list, oldest first (as ``persist`` does)."""
        table = self._slots
        return [table.key[slot] for lst in self._lists for slot in table.slot_list(lst)]

    def remove_many(self, keys: Collection[int]) -> None:
        """``remove()`` each of ``keys`` in the order a fresh ``victims()`` lists them."""
        for key in [k for k in self.victims() if k in keys]:  # type: ignore[attr-defined]
            self.remove(key)  # type: ignore[attr-defined]

    def reset(self) -> None:
        """Forget every key and counter."""
        self.__init__()  # type: ignore[misc]

    def _check(self, key: int, size: int) -> None:
        if key < 0 or size < 0:
            raise ValueError(f"key and size must be >= 0, got {key}, {size}")
        self._tracks += 1

    def _add(self, key: int, size: int) -> int:
        """Make ``key`` resident (in no list yet) with ``size``; return its slot."""
        slot = self._slots.index.get(key)
        if slot is None:
            slot = self._slots.new(key)
            self._init_slot(slot)
        self._size[slot] = size
        self._bytes += size
        self._resident += 1
        return slot

    def _init_slot(self, slot: int) -> None:
        """Set the columns of a newly allocated slot (all 0 before)."""

    def _resize(self, slot: int, size: int) -> None:
        self._bytes += size - self._size[slot]
        self._size[slot] = size

    def _drop(self, slot: int) -> int:
        """Make the key of ``slot`` non-resident (slot kept, in no list); return its list."""
        self._bytes -= self._size[slot]
        self._resident -= 1
        self._removes += 1
        return self._slots.unlink(slot)

    def _base_statistics(self, **segments: int) -> PolicyStatistics:
        fields = {
            "probation_keys": 0,
            "main_keys": 0,
            "main_bytes": 0,
            "dead_keys": 0,
            "ghost_keys": 0,
            "promotions": 0,
            "chain_links": 0,
            "horizon": 0,
        }
        fields.update(segments)
        return PolicyStatistics(
            name=self.name,
            keys=self._resident,
            bytes=self._bytes,
            tracks=self._tracks,
            touches=self._touches,
            removes=self._removes,
            **fields,
        )

    # -- persistence ---------------------------------------------------------------

    def _key_columns(self, slots: list[int]) -> tuple[array[int], array[int], array[int]]:
        """Return the (predecessor or -1, last access clock, flags) columns to persist
        for ``slots``."""
        n = len(slots)
        return array("q", [NO_KEY]) * n, array("q", [0]) * n, array("q", [0]) * n

    def _scalars(self) -> tuple[int, int]:
        """Return (clock, horizon) to persist."""
        return 0, 0

    def _ghost_items(self) -> tuple[array[int], array[int]]:
        """Return the columns (evicted key, its last use clock) to persist."""
        return array("q"), array("q")

    def persist(self) -> bytes:
        """Encode the state as an image (``kvfs.policy.image``, ``docs/format.md``)."""
        clock, horizon = self._scalars()
        table = self._slots
        lists: list[Columns] = []
        for lst in self._lists:
            slots = table.slot_list(lst)
            keys = array("q", map(table.key.__getitem__, slots))
            sizes = array("q", map(self._size.__getitem__, slots))
            lists.append((keys, sizes, *self._key_columns(slots)))
        return img.encode(self._kind, clock, horizon, lists, *self._ghost_items())

    def recover(self, data: bytes) -> None:
        """Replace the state by the one ``data`` encodes; on ValueError nothing changes."""
        decoded = img.decode(data, self._kind, len(self._lists))
        self.reset()
        self._restore(decoded)

    def _restore(self, decoded: Image) -> None:
        # on a fresh table (no free slots) a bulk ``extend`` per list is exactly the
        # per key ``_add`` + ``append`` (``_init_slot`` of the base policies sets nothing)
        for lst, (keys, sizes, *_) in zip(self._lists, decoded.lists, strict=True):
            self._restore_list(lst, keys, sizes)

    def _restore_list(self, lst: int, keys: array[int], sizes: array[int]) -> int:
        """Make ``keys`` resident at the newest end of ``lst``; return the first slot."""
        first = self._slots.extend(lst, keys)
        self._size[first:] = sizes
        self._bytes += sum(sizes)
        self._resident += len(keys)
        return first

    def recover_foreign(self, data: bytes) -> bool:
        """Adopt the resident keys of another policy's valid image, in its victim
        order (its lists oldest first, in image order), as newly written keys."""
        found = img.decode_any(data)
        if found is None or found[0] == self._kind:
            return False
        self.reset()
        for keys, sizes, *_ in found[1].lists:
            for key, size in zip(keys, sizes, strict=True):
                self.track(key, size, None)  # type: ignore[attr-defined]
        return True
