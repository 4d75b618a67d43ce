"""What the slot-table policies share: residency, sizes, counters and persistence
(:class:`LinkedPolicy`, over one :class:`~kvfs.evict.slots.SlotTable`)."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

from kvfs.evict.policy.protocol import Policy, PolicyStatistics
from kvfs.evict.slots import DIRECT, MASK, NO_KEY, ROWS, SHIFT, SlotTable
from kvfs.format import policy_image as img

if TYPE_CHECKING:
    from kvfs.format.policy_image import Columns, Image

ORDER = 0
"""The single list of LRU and FIFO (list ids double as sentinel slots)."""


class LinkedPolicy(Policy):
    """Shared state and persistence of the policies: slots, sizes, lists and counters."""

    name: str = ""
    _kind: ClassVar[int] = 0
    _lists: ClassVar[tuple[int, ...]] = (ORDER,)  # persisted lists, in image order
    _order: ClassVar[int] = ORDER  # the list of LRU, FIFO and prefix-LRU
    _slot_lists: ClassVar[int] = 1  # lists including unpersisted ones (the ghost)
    _columns: ClassVar[tuple[str, ...]] = ("I",)  # typecodes (widened on overflow); 0: size

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
        if not isinstance(key, int):
            return None
        table = self._slots
        slot = table.find(key)
        if slot is None or table.owner.chunks[slot >> SHIFT][slot & MASK] not in self._lists:  # type: ignore[index]
            return None
        return slot

    def __contains__(self, key: object) -> bool:
        return self._slot(key) is not None

    def __len__(self) -> int:
        return self._resident

    def keys(self) -> set[int]:
        """Return the tracked keys (a new set, in no particular order)."""
        return set(self._slots.keys_where(self._lists))

    def size_of(self, key: int) -> int:
        """Return the size of resident ``key`` (0 if it is not resident)."""
        slot = self._slot(key)
        return 0 if slot is None else self._size[slot]

    def keys_in_image_order(self) -> list[int]:
        """Return the resident keys list by list, oldest first (as ``persist`` does)."""
        table = self._slots
        return [table.key_of(slot) for lst in self._lists for slot in table.slot_list(lst)]

    def reset(self) -> None:
        """Forget every key and counter."""
        self.__init__()  # type: ignore[misc]

    def _check(self, key: int, size: int) -> None:
        if key < 0 or size < 0:
            raise ValueError(f"key and size must be >= 0, got {key}, {size}")
        self._tracks += 1

    def _add(self, key: int, size: int) -> int:
        """Make ``key`` resident (in no list yet) with ``size``; return its slot."""
        slot = self._slots.find(key)
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
        """Return the (predecessor or -1, last access clock, flags) columns of a
        version 1 image for ``slots``."""
        n = len(slots)
        return array("q", [NO_KEY]) * n, array("q", [0]) * n, array("q", [0]) * n

    def _scalars(self) -> tuple[int, int]:
        """Return (clock, horizon) to persist."""
        return 0, 0

    def _ghost_items(self) -> tuple[array[int], array[int]]:
        """Return the columns (evicted key, its last use clock) of a version 1 image."""
        return array("q"), array("q")

    def _extra_scalars(self) -> list[int]:
        """The policy's own counters a version 2 image keeps (``_set_extra``)."""
        return []

    def _set_extra(self, values: list[int]) -> None:
        """Restore what ``_extra_scalars`` returned."""

    def persist_v1(self) -> bytes:
        """Encode the state as a version 1 image (the 0.2 release's format, read by
        ``recover``; O(keys) in Python: only the adaptive policy and tests use it)."""
        clock, horizon = self._scalars()
        table = self._slots
        lists: list[Columns] = []
        for lst in self._lists:
            slots = table.slot_list(lst)
            keys = array("q", map(table.key_of, slots))
            sizes = array("q", map(self._size.__getitem__, slots))
            lists.append((keys, sizes, *self._key_columns(slots)))
        return img.encode(self._kind, clock, horizon, lists, *self._ghost_items())

    def persist_pieces(self) -> Iterator[bytes]:
        """Freeze the state now (O(chunks): copy-on-write columns) and return an
        iterator over the pieces of its version 2 image, which reads only the frozen
        state: the policy may go on changing while they are encoded."""
        return self._pieces(self._kind, 0)

    def _pieces(self, kind: int, number: int) -> Iterator[bytes]:
        """``persist_pieces`` as table ``number`` of an image of policy ``kind``."""
        clock, horizon = self._scalars()
        scalars = [clock, horizon, self._resident, self._bytes, *self._extra_scalars()]
        return img.encode_pieces(kind, self._slots.image(len(self._lists), scalars), number)

    def recover(self, data: bytes) -> None:
        """Replace the state by the one ``data`` encodes (a version 2 image, or a
        version 1 one of the 0.2 release); on ValueError nothing changes."""
        if img.version_of(data) == 1:
            decoded = img.decode(data, self._kind, len(self._lists))
            self.reset()
            self._restore(decoded)
            return
        self.recover_pieces(img.split_pieces(data))

    def recover_pieces(self, pieces: list[bytes]) -> None:
        """Replace the state by a version 2 image given as its pieces; on ValueError
        nothing changes."""
        self._load_pieces(pieces, self._kind, 0)

    def _load_pieces(self, pieces: list[bytes], kind: int, number: int) -> None:
        """``recover_pieces`` of table ``number`` of an image of policy ``kind``."""
        table = self._slots
        codes = [c.code for c in table.columns]
        image = img.decode_pieces(pieces, kind, len(table.count), len(self._lists), codes, number)
        self.reset()
        self._slots = SlotTable.from_image(image)
        self._bind_columns()
        clock, horizon, self._resident, self._bytes, *extra = image.scalars
        self._set_scalars(clock, horizon)
        self._set_extra(extra)

    def _bind_columns(self) -> None:
        """Point the column attributes at ``self._slots``'s columns."""
        self._size = self._slots.columns[0]

    def _set_scalars(self, clock: int, horizon: int) -> None:
        """Restore (clock, horizon)."""

    def _restore(self, decoded: Image) -> None:
        for lst, (keys, sizes, *_) in zip(self._lists, decoded.lists, strict=True):
            self._restore_list(lst, keys, sizes)

    def _restore_list(self, lst: int, keys: array[int], sizes: array[int]) -> list[int]:
        """Make ``keys`` resident at the newest end of ``lst``; return their slots."""
        slots = self._slots.append_keys(lst, keys)
        size = self._size
        for slot, value in zip(slots, sizes, strict=True):
            size[slot] = value
        self._bytes += sum(sizes)
        self._resident += len(keys)
        return slots

    def adopt(
        self, keys: array[int], sizes: array[int], spans: list[tuple[int, int]] | None = None
    ) -> None:
        """Track each of ``keys`` (distinct, none tracked yet), oldest first, as files
        found at mount without a stream: exactly what ``track(key, size, None)`` per
        key does, in bulk (C-level column writes) on a policy that never held a key
        (a first mount of 10^7 files). ``spans``: the runs of consecutive keys
        (``slots.runs(keys)``), if the caller knows them."""
        fresh = not self._slots.decided and (not keys or 0 <= min(keys) <= max(keys) < DIRECT)
        if not fresh or min(sizes, default=0) < 0 or len(keys) != len(sizes):
            for key, size in zip(keys, sizes, strict=True):
                self.track(key, size, None)
            return
        self._adopt_fresh(keys, sizes, spans)
        total = sum(sizes)
        self._bytes += total
        self._resident += len(keys)
        self._tracks += len(keys)

    def _adopt_fresh(
        self, keys: array[int], sizes: array[int], spans: list[tuple[int, int]] | None
    ) -> None:
        """``adopt`` on a fresh table: link and fill the columns (counters aside)."""
        self._slots.adopt_keys(self._lists[0], keys, [(self._size, sizes)], spans)

    def resident_mask(self, n: int) -> bytes | None:
        """``bytes(n)`` with 1 where key ``i`` is resident (C-level, from the owner
        column); None if the table maps keys through its dict."""
        table = self._slots
        if not table.direct or n > table.direct:  # (slots past it are mapped ones)
            return None if table.decided else bytes(n)
        is_resident = bytearray(256)
        for lst in self._lists:
            is_resident[lst] = 1
        raw = b"".join(
            bytes(ROWS) if chunk is None else chunk.tobytes().translate(is_resident)
            for chunk in table.owner.chunks
        )
        raw = raw[table.lists : table.lists + n]
        return raw + bytes(n - len(raw))

    def recover_foreign(self, data: bytes) -> bool:
        """Adopt the resident keys of another policy's valid image, in its victim
        order (its lists oldest first, in image order), as newly written keys."""
        found = img.decode_any(data)
        if found is None or found[0] == self._kind:
            return False
        self.reset()
        for keys, sizes, *_ in found[1].lists:
            for key, size in zip(keys, sizes, strict=True):
                self.track(key, size, None)
        return True
