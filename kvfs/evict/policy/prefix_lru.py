"""Prefix-ordered LRU ("prefix-lru"): LRU whose prompts leave deepest chunk first.

A prompt's chunks are read in order, chunk 0 first, so plain LRU makes chunk 0 the
oldest of them and evicts it first -- which, under the prefix rule (a chunk is a hit
only if every earlier chunk is), makes every later chunk of the prompt worthless.
Here a key a stream accesses right after its *predecessor* is filed just before the
predecessor instead of at the newest end: a prompt's chain is ordered deepest
(oldest) .. chunk 0 (newest) and leaves tail first.

The predecessor of a key is the key its stream accessed just before it. For a new
key it is taken when the stream's run of accesses began with a read: the engine
writes a prompt's missing chunks in order, right after reading its cached prefix.
A run of writes that no read began (a prompt with nothing cached, a writer that
never reads) is filed like LRU, each new key the newest: no request boundary can be
seen inside it, and chaining it would file everything one process writes behind its
first file -- the newest written would leave first (most recently used). For a
re-use the predecessor is taken only if it is the same as last time, so the first
chunk of a prompt is not filed behind the last chunk of the previous prompt of the
same stream (a request boundary), and never after a key the stream has just
created: a use after a write is the next request (an engine reads a prompt's cached
chunks before it writes the rest), and on a mount the keys are inode numbers, so
the key just created may have the number of a gone file the use followed once (a
mount caught a prompt's evicted partial chunk lending its number to the next one,
and the next prompt's prefix, read right after it, filed as the oldest key: evicted
the moment after its read; session 31).

A prompt's *partial last chunk* goes first: a new key chained to a predecessor
larger than itself (the engine stores a prompt's tokens past its last full chunk
as a smaller file, LMCache's partial chunk) is filed at the oldest end, and it
ends its stream's run. A continuation of the prompt never reads it: the next turn's
chunk at that position holds a full chunk of tokens, so it has another name. Only
the same prompt sent again reads it, and then it is a use like any other (filed
as a read). Traces whose chunks are all full (vLLM's and SGLang's fixed-size
blocks) never have one. On Mooncake's traces with a partial block's bytes counted
as its share of a chunk (``tools/trace_suite.py --sized``), this took the default
policy from 0.93 point under LRU to 0.06 under at mooncake-synthetic 10 %
(``docs/eviction.md``, "A prompt's partial last chunk goes first").
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

    def __init__(self, partial_first: bool = True) -> None:
        super().__init__()
        self._bind_columns()
        # a prompt's partial last chunk is filed oldest (module docstring); False only
        # for the ablation (tools/trace_suite.py --adaptive-ablation)
        self.partial_first = partial_first
        # stream -> (its last key, whether its run of accesses began with a read,
        # whether that last access created the key)
        self._streams: OrderedDict[Hashable, tuple[int, bool, bool]] = OrderedDict()

    def track(self, key: int, size: int, stream: Hashable) -> None:
        """Record a write; it counts as a use."""
        self._check(key, size)
        slot = self._slot(key)
        if slot is None:
            slot = self._add(key, size)
            self._pred[slot] = 0
            anchor = self._anchor(slot, stream, new=True, read=False)
            if self.partial_first and anchor is not None and size < self._size[anchor]:
                # a prompt's partial last chunk: filed oldest, and it ends the run (a
                # next prompt's chunks are not filed behind it)
                anchor = self._slots.first(self._order)
                self._streams[stream] = (key, False, True)
            self._place(slot, anchor)
        else:
            self._resize(slot, size)
            self._slots.unlink(slot)
            self._place(slot, self._anchor(slot, stream, new=False, read=False))

    def touch(self, key: int, stream: Hashable) -> None:
        """Record a read: ``key`` becomes the newest, or just older than its predecessor."""
        slot = self._slot(key)
        if slot is not None:
            self._touches += 1
            anchor = self._anchor(slot, stream, new=False, read=True)
            self._slots.unlink(slot)
            self._place(slot, anchor)

    def _anchor(self, slot: int, stream: Hashable, new: bool, read: bool) -> int | None:
        """Return the slot to file ``slot`` before (its predecessor), or None. A new
        key is chained only in a run that a read began (module docstring)."""
        if stream is None:  # no stream (e.g. files adopted at mount): no chain
            return None
        key = self._slots.key_of(slot)
        prev, began_with_read, created = self._streams.pop(stream, (None, False, False))
        anchor = None
        if prev is None or prev == key:
            run_read = read or (began_with_read and prev == key)
        else:
            # never along a link from a key the stream has just created (module
            # docstring: the next request, or an inode number reused)
            known = self._pred[slot] == prev + 1 and not created
            self._pred[slot] = prev + 1
            chained = (new and began_with_read) or (not new and known)
            run_read = read or chained
            anchor = self._slot(prev) if chained else None
        self._streams[stream] = (key, run_read, new)
        if len(self._streams) > STREAM_MEMORY:
            self._streams.popitem(last=False)
        return anchor

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
