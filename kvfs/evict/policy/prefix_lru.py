"""Prefix-ordered LRU ("prefix-lru"): LRU whose prompts leave deepest chunk first.

A prompt's chunks are read in order, chunk 0 first, so plain LRU makes chunk 0 the
oldest of them and evicts it first -- which, under the prefix rule (a chunk is a hit
only if every earlier chunk is), makes every later chunk of the prompt worthless.
Here a key a stream accesses right after its *predecessor* is filed just before the
predecessor instead of at the newest end: a prompt's chain is ordered deepest
(oldest) .. chunk 0 (newest) and leaves tail first.

The predecessor of a key is the key its stream accessed just before it. For a new
key that is always taken (the engine writes a prompt's missing chunks in order,
right after reading its cached prefix); for a re-use only if it is the same
predecessor as last time, so the first chunk of a prompt is not filed behind the
last chunk of the previous prompt of the same stream (a request boundary).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Hashable
from typing import TYPE_CHECKING

from kvfs.evict.policy.fifo import FIFOPolicy
from kvfs.format import policy_image as img

if TYPE_CHECKING:
    from kvfs.format.policy_image import Image

STREAM_MEMORY = 4096
"""Streams remembered (the oldest is forgotten first)."""


class PrefixLRUPolicy(FIFOPolicy):
    """LRU with chains filed tail first (see module docstring)."""

    name = "prefix-lru"
    _kind = img.KIND_PREFIX_LRU
    _columns = ("I", "I")  # size, predecessor key + 1 (0: none)

    def __init__(self) -> None:
        super().__init__()
        self._bind_columns()
        self._streams: OrderedDict[Hashable, int] = OrderedDict()

    def track(self, key: int, size: int, stream: Hashable) -> None:
        """Record a write; it counts as a use."""
        self._check(key, size)
        slot = self._slot(key)
        if slot is None:
            slot = self._add(key, size)
            self._pred[slot] = 0
            self._place(slot, self._anchor(slot, stream, new=True))
        else:
            self._resize(slot, size)
            self._slots.unlink(slot)
            self._place(slot, self._anchor(slot, stream, new=False))

    def touch(self, key: int, stream: Hashable) -> None:
        """Record a read: ``key`` becomes the newest, or just older than its predecessor."""
        slot = self._slot(key)
        if slot is not None:
            self._touches += 1
            anchor = self._anchor(slot, stream, new=False)
            self._slots.unlink(slot)
            self._place(slot, anchor)

    def _anchor(self, slot: int, stream: Hashable, new: bool) -> int | None:
        """Return the slot to file ``slot`` before (its predecessor), or None."""
        if stream is None:  # no stream (e.g. files adopted at mount): no chain
            return None
        key = self._slots.key_of(slot)
        prev = self._streams.pop(stream, None)
        self._streams[stream] = key
        if len(self._streams) > STREAM_MEMORY:
            self._streams.popitem(last=False)
        if prev is None or prev == key:
            return None
        known = self._pred[slot] == prev + 1
        self._pred[slot] = prev + 1
        return self._slot(prev) if new or known else None

    def _place(self, slot: int, anchor: int | None) -> None:
        if anchor is not None and anchor != slot:
            self._slots.insert_before(anchor, slot, self._order)
        else:
            self._slots.append(self._order, slot)

    def _key_columns(self, slots: list[int]) -> tuple[array[int], array[int], array[int]]:
        n = len(slots)
        preds = array("q", (self._pred[slot] - 1 for slot in slots))
        return preds, array("q", [0]) * n, array("q", [0]) * n

    def _bind_columns(self) -> None:
        super()._bind_columns()
        self._pred = self._slots.columns[1]

    def _restore(self, decoded: Image) -> None:
        pred = self._pred
        for lst, (keys, sizes, preds, *_) in zip(self._lists, decoded.lists, strict=True):
            for slot, p in zip(self._restore_list(lst, keys, sizes), preds, strict=True):
                pred[slot] = p + 1
