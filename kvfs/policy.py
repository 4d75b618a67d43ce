"""Eviction policies: pure, synchronous bookkeeping of which files to evict first.

A policy never does I/O and never evicts anything itself.  The store reports events
with four verbs and asks for an order:

- ``track(key, size, stream)``: a file was written (created, or its size changed);
- ``touch(key, stream)``: a file was opened or read;
- ``remove(key)``: a file is gone (unlinked, evicted or forgotten);
- ``victims()``: keys in eviction order, best victim first.

Keys are non-negative ints (inode numbers), sizes are bytes and ``stream`` is any
hashable naming the accessing process and directory, e.g. ``(pid, dir_ino)``.
Every call is O(1) amortized (``victims()`` is O(1) per yielded key) and none awaits,
so under trio a sequence of calls is atomic.

Three policies share this interface: :class:`LRUPolicy`, :class:`FIFOPolicy` and
:class:`KvfsPolicy`, the prefix-aware default (design and measurements in
``docs/eviction.md``).  ``persist()``/``recover()`` carry a policy's whole state across
a restart in a versioned, checksummed byte string.
"""

from __future__ import annotations

import struct
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

__all__ = [
    "POLICY_NAMES",
    "EvictionPolicy",
    "FIFOPolicy",
    "KvfsPolicy",
    "LRUPolicy",
    "PolicyStatistics",
    "make_policy",
]

FORMAT_VERSION = 1
_MAGIC = b"KVEP"
_HEADER = struct.Struct("<4sBBHqq")  # magic, version, kind, list count, clock, horizon
assert _HEADER.size == 24
_COUNT = struct.Struct("<q")
_CRC = struct.Struct("<I")
_NO_KEY = -1  # "no predecessor" in persisted columns

# List sentinels.  Keys are >= 0, so negative ints can never collide with a key.
_ORDER = -1  # the single list of LRUPolicy / FIFOPolicy
_DEAD = -1  # KvfsPolicy: keys whose learned predecessor is gone
_PROBATION = -2  # KvfsPolicy: new, not (yet) re-used keys; FIFO/LRU order
_MAIN = -3  # KvfsPolicy: protected keys, LRU order

_CONFIRMED = 1  # flag: the learned predecessor was observed at least twice in a row
_STREAM_MEMORY = 4096  # streams remembered for chain learning (oldest forgotten first)
_GHOST_MIN = 1024  # evicted keys remembered at least, whatever the resident count


@dataclass(frozen=True)
class PolicyStatistics:
    """Counters of one policy; segment fields are 0 for policies without segments."""

    name: str
    keys: int
    bytes: int
    probation_keys: int
    main_keys: int
    main_bytes: int
    dead_keys: int
    ghost_keys: int
    tracks: int
    touches: int
    removes: int
    promotions: int
    chain_links: int
    horizon: int


@runtime_checkable
class EvictionPolicy(Protocol):
    """The uniform verbs every eviction policy implements (see module docstring)."""

    name: str

    def track(self, key: int, size: int, stream: Hashable) -> None:
        """Record that ``key`` was written with ``size`` bytes by ``stream``."""

    def touch(self, key: int, stream: Hashable) -> None:
        """Record a read of ``key`` by ``stream``; unknown keys are ignored."""

    def remove(self, key: int) -> None:
        """Forget ``key``; unknown keys are ignored.  O(1)."""

    def victims(self) -> Iterator[int]:
        """Yield tracked keys best victim first; ``remove()`` of the yielded key is allowed."""

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...

    def statistics(self) -> PolicyStatistics:
        """Return a snapshot of the counters."""

    def reset(self) -> None:
        """Forget every key and counter."""

    def persist(self) -> bytes:
        """Encode the whole state (order, sizes, learned chains) as bytes."""

    def recover(self, data: bytes) -> None:
        """Replace the state by one from ``persist()``; raise ValueError on bad data."""


class _Links:
    """Circular doubly-linked lists of int keys, all sharing two dicts.

    Each list is identified by a negative sentinel; a key is in at most one list.
    Costs one ``prev``, one ``next`` and one ``owner`` dict entry per key.
    """

    def __init__(self, sentinels: tuple[int, ...]) -> None:
        self.sentinels = sentinels
        self.prev: dict[int, int] = {s: s for s in sentinels}
        self.next: dict[int, int] = {s: s for s in sentinels}
        self.owner: dict[int, int] = {}
        self.count: dict[int, int] = dict.fromkeys(sentinels, 0)

    def insert_before(self, anchor: int, key: int, sentinel: int) -> None:
        """Put ``key`` (in no list) right before ``anchor`` (a member of ``sentinel``)."""
        before = self.prev[anchor]
        self.prev[key] = before
        self.next[key] = anchor
        self.next[before] = key
        self.prev[anchor] = key
        self.owner[key] = sentinel
        self.count[sentinel] += 1

    def append(self, sentinel: int, key: int) -> None:
        """Put ``key`` at the newest end of list ``sentinel``."""
        self.insert_before(sentinel, key, sentinel)

    def unlink(self, key: int) -> int:
        """Take ``key`` out of its list and return that list's sentinel."""
        before, after = self.prev.pop(key), self.next.pop(key)
        self.next[before] = after
        self.prev[after] = before
        sentinel = self.owner.pop(key)
        self.count[sentinel] -= 1
        return sentinel

    def first(self, sentinel: int) -> int | None:
        """Return the oldest key of list ``sentinel``, or None if it is empty."""
        key = self.next[sentinel]
        return None if key == sentinel else key

    def keys(self, sentinel: int) -> Iterator[int]:
        """Iterate one list oldest first; the lists must not change meanwhile."""
        key = self.next[sentinel]
        while key != sentinel:
            yield key
            key = self.next[key]

    def walk(self, sentinel: int) -> Iterator[int]:
        """Iterate one list oldest first, tolerating removal of the yielded key.

        If both the yielded key and its successor left the list meanwhile, the walk
        restarts from the oldest end (callers filter keys they have already seen).
        """
        key = self.next[sentinel]
        while key != sentinel:
            after = self.next[key]
            yield key
            if self.owner.get(key) == sentinel:
                key = self.next[key]
            elif after == sentinel or self.owner.get(after) == sentinel:
                key = after
            else:
                key = self.next[sentinel]


class _LinkedPolicy:
    """Shared state and persistence of the policies: sizes, lists and counters."""

    name: str = ""
    _kind: ClassVar[int] = 0
    _sentinels: ClassVar[tuple[int, ...]] = (_ORDER,)

    def __init__(self) -> None:
        self._links = _Links(self._sentinels)
        self._size: dict[int, int] = {}
        self._bytes = 0
        self._tracks = 0
        self._touches = 0
        self._removes = 0

    def __contains__(self, key: object) -> bool:
        return key in self._size

    def __len__(self) -> int:
        return len(self._size)

    def reset(self) -> None:
        """Forget every key and counter."""
        self.__init__()  # type: ignore[misc]

    def _set_size(self, key: int, size: int) -> bool:
        """Record ``size`` for ``key``; return True if the key is new."""
        if key < 0 or size < 0:
            raise ValueError(f"key and size must be >= 0, got {key}, {size}")
        old = self._size.get(key)
        self._size[key] = size
        self._bytes += size - (old or 0)
        self._tracks += 1
        return old is None

    def _forget(self, key: int) -> int | None:
        """Drop ``key`` from the size table and its list; return its list or None."""
        size = self._size.pop(key, None)
        if size is None:
            return None
        self._bytes -= size
        self._removes += 1
        return self._links.unlink(key)

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
            keys=len(self._size),
            bytes=self._bytes,
            tracks=self._tracks,
            touches=self._touches,
            removes=self._removes,
            **fields,
        )

    # -- persistence ---------------------------------------------------------------

    def _key_columns(self, key: int) -> tuple[int, int, int]:
        """Return (predecessor or -1, last access clock, flags) to persist for ``key``."""
        return _NO_KEY, 0, 0

    def _scalars(self) -> tuple[int, int]:
        """Return (clock, horizon) to persist."""
        return 0, 0

    def _ghost_items(self) -> list[tuple[int, int]]:
        """Return (evicted key, its last use clock) pairs to persist."""
        return []

    def persist(self) -> bytes:
        """Encode the state: header, per list five int64 columns, ghost keys, CRC32."""
        clock, horizon = self._scalars()
        parts = [
            _HEADER.pack(_MAGIC, FORMAT_VERSION, self._kind, len(self._sentinels), clock, horizon)
        ]
        for sentinel in self._sentinels:
            keys = array("q", self._links.keys(sentinel))
            columns = [self._key_columns(k) for k in keys]
            parts.append(_COUNT.pack(len(keys)))
            parts.append(keys.tobytes())
            parts.append(array("q", (self._size[k] for k in keys)).tobytes())
            for index in range(3):
                parts.append(array("q", (c[index] for c in columns)).tobytes())
        ghost = self._ghost_items()
        parts.append(_COUNT.pack(len(ghost)))
        parts.append(array("q", (key for key, _ in ghost)).tobytes())
        parts.append(array("q", (last for _, last in ghost)).tobytes())
        body = b"".join(parts)
        return body + _CRC.pack(zlib.crc32(body))

    def recover(self, data: bytes) -> None:
        """Replace the state by the one ``data`` encodes; on ValueError nothing changes."""
        decoded = _decode(data, self._kind, len(self._sentinels))
        self.reset()
        self._restore(decoded)

    def _restore(self, decoded: _Decoded) -> None:
        for sentinel, rows in zip(self._sentinels, decoded.lists, strict=True):
            for key, size, _pred, _last, _flags in rows:
                self._size[key] = size
                self._bytes += size
                self._links.append(sentinel, key)


@dataclass(frozen=True)
class _Decoded:
    """A validated ``persist()`` image: per list rows of (key, size, pred, last, flags)."""

    clock: int
    horizon: int
    lists: list[list[tuple[int, int, int, int, int]]]
    ghost: list[tuple[int, int]]


class _Reader:
    """Bounds-checked sequential reader over a persisted image."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.offset = 0

    def take(self, size: int) -> bytes:
        if size < 0 or self.offset + size > len(self.data):
            raise ValueError("truncated policy image")
        chunk = self.data[self.offset : self.offset + size]
        self.offset += size
        return chunk

    def column(self, count: int) -> array[int]:
        values = array("q")
        values.frombytes(self.take(count * 8))
        return values

    def count(self) -> int:
        (value,) = _COUNT.unpack(self.take(_COUNT.size))
        if value < 0:
            raise ValueError("negative count in policy image")
        return int(value)


def _decode(data: bytes, kind: int, lists: int) -> _Decoded:
    """Validate and decode a ``persist()`` image; raise ValueError on any defect."""
    if len(data) < _HEADER.size + _CRC.size:
        raise ValueError("policy image too short")
    body, (crc,) = data[: -_CRC.size], _CRC.unpack(data[-_CRC.size :])
    if zlib.crc32(body) != crc:
        raise ValueError("policy image checksum mismatch")
    reader = _Reader(body)
    magic, version, got_kind, got_lists, clock, horizon = _HEADER.unpack(reader.take(_HEADER.size))
    if magic != _MAGIC or version != FORMAT_VERSION:
        raise ValueError(f"not a version {FORMAT_VERSION} policy image")
    if got_kind != kind or got_lists != lists:
        raise ValueError("policy image belongs to another policy")
    decoded = _Decoded(clock, horizon, [_decode_list(reader) for _ in range(lists)], [])
    count = reader.count()
    decoded.ghost.extend(zip(reader.column(count), reader.column(count), strict=True))
    if reader.offset != len(body):
        raise ValueError("trailing bytes in policy image")
    _check_keys(decoded)
    return decoded


def _decode_list(reader: _Reader) -> list[tuple[int, int, int, int, int]]:
    count = reader.count()
    columns = [reader.column(count) for _ in range(5)]
    return list(zip(*columns, strict=True))


def _check_keys(decoded: _Decoded) -> None:
    seen: set[int] = set()
    for rows in decoded.lists:
        for key, size, pred, _last, _flags in rows:
            if key < 0 or size < 0 or pred < _NO_KEY or key in seen:
                raise ValueError(f"bad or duplicate key {key} in policy image")
            seen.add(key)
    if any(key < 0 for key, _ in decoded.ghost):
        raise ValueError("bad ghost key in policy image")


class FIFOPolicy(_LinkedPolicy):
    """First in, first out: evict in order of first ``track()``; reads change nothing."""

    name = "fifo"
    _kind = 1

    def track(self, key: int, size: int, stream: Hashable) -> None:
        """Record a write; a rewrite of a tracked key keeps its place."""
        if self._set_size(key, size):
            self._links.append(_ORDER, key)

    def touch(self, key: int, stream: Hashable) -> None:
        """Count a read; FIFO order ignores reads."""
        if key in self._size:
            self._touches += 1

    def remove(self, key: int) -> None:
        """Forget ``key`` (no-op if unknown)."""
        self._forget(key)

    def victims(self) -> Iterator[int]:
        """Yield keys oldest write first; removing the yielded key is allowed."""
        return self._links.walk(_ORDER)

    def statistics(self) -> PolicyStatistics:
        """Return a snapshot of the counters."""
        return self._base_statistics()


class LRUPolicy(FIFOPolicy):
    """Least recently used: every track or touch makes a key the newest."""

    name = "lru"
    _kind = 0

    def track(self, key: int, size: int, stream: Hashable) -> None:
        """Record a write; it counts as a use."""
        if not self._set_size(key, size):
            self._links.unlink(key)
        self._links.append(_ORDER, key)

    def touch(self, key: int, stream: Hashable) -> None:
        """Record a read: ``key`` becomes the newest."""
        if key in self._size:
            self._touches += 1
            self._links.unlink(key)
            self._links.append(_ORDER, key)


class KvfsPolicy(_LinkedPolicy):
    """Prefix-aware segmented policy for KV-cache chunk files (docs/eviction.md).

    Three lists; ``victims()`` yields in this order:

    1. *dead*: keys whose learned predecessor was removed.  Under the prefix rule a
       chunk without its prefix can never be a hit, so these go first.
    2. *cold main*: protected keys unused for longer than ``cold_factor`` times their
       own last reuse interval (finished conversations).
    3. *probation* while it holds more than ``1 - main_share`` of the bytes: new keys
       and keys not admitted to main, oldest first.
    4. *main*, least recently used first, then the rest of probation.

    Admission to main (S3-FIFO-like, but loop-resistant as in LIRS): a key re-read
    while in probation, re-written after its eviction (a ghost hit) or written as the
    continuation of a main chain enters main if main is under ``main_share`` of the
    bytes, or main's oldest key is cold, or that key has been unused for longer than
    ``admit_factor`` times the newcomer's reuse interval.  Otherwise it stays in
    probation, so a working set larger than the cache keeps a stable subset of whole
    chains hot instead of cycling everything through (what LRU does on multi-round QA).

    Chains are learned per stream: when a stream accesses key B right after a
    different key A, A becomes B's predecessor (confirmed when seen twice in a row).
    B is filed right *before* A in its list (for a re-read only if the link is
    confirmed), so a chain's tail is older than its head and is evicted first.
    Removing a key moves its latest successor, if that link is confirmed, to the
    dead list; re-writing the key brings the successor back.

    Time is a logical clock of track/touch calls.  Memory: about 700 B per key in
    CPython (seven dicts), plus one ghost entry per recently evicted key.
    """

    name = "kvfs"
    _kind = 2
    _sentinels = (_DEAD, _PROBATION, _MAIN)

    def __init__(
        self, main_share: float = 0.9, cold_factor: float = 1.5, admit_factor: float = 1.5
    ) -> None:
        if not 0.0 <= main_share <= 1.0 or cold_factor <= 0.0 or admit_factor <= 0.0:
            raise ValueError("main_share must be in [0, 1], the factors > 0")
        super().__init__()
        self.main_share = main_share
        self.cold_factor = cold_factor
        self.admit_factor = admit_factor
        self._pred: dict[int, int] = {}
        self._succ: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._info: dict[int, int] = {}
        self._ghost: OrderedDict[int, int] = OrderedDict()  # evicted key -> last use
        self._streams: OrderedDict[Hashable, int] = OrderedDict()
        self._clock = 0
        self._horizon = 0
        self._seg_bytes = dict.fromkeys(self._sentinels, 0)
        self._promotions = 0

    def reset(self) -> None:
        """Forget every key, chain and counter (keeps the tuning parameters)."""
        self.__init__(self.main_share, self.cold_factor, self.admit_factor)  # type: ignore[misc]

    # -- verbs -----------------------------------------------------------------------

    def track(self, key: int, size: int, stream: Hashable) -> None:
        """Record a write of ``key``; a rewrite of a tracked key counts as a use."""
        old = self._size.get(key)
        is_new = self._set_size(key, size)
        if old is not None:
            self._seg_bytes[self._links.owner[key]] += size - old
        prev = self._observe(key, stream)
        if not is_new:
            self._use(key, prev)
            return
        last_use = self._ghost.pop(key, None)
        ghost_hit = last_use is not None
        gap = 0 if last_use is None else self._clock - last_use
        self._info[key] = (gap << 1) | (self._info.get(key, 0) & _CONFIRMED)
        continues_main = prev is not None and self._links.owner.get(prev) == _MAIN
        admitted = (ghost_hit or continues_main) and self._main_admits(size, gap)
        self._place(key, prev, _MAIN if admitted else _PROBATION)
        self._last[key] = self._clock
        self._revive_successor(key)

    def touch(self, key: int, stream: Hashable) -> None:
        """Record a read of ``key`` by ``stream``; unknown keys are ignored."""
        if key not in self._size:
            return
        self._touches += 1
        self._use(key, self._observe(key, stream))

    def remove(self, key: int) -> None:
        """Forget ``key``; its chain successor becomes a dead tail.  No-op if unknown."""
        size = self._size.get(key, 0)
        owner = self._forget(key)
        if owner is None:
            return
        self._seg_bytes[owner] -= size
        last = self._last.pop(key, self._clock)
        self._info.pop(key, None)
        self._unchain(key)
        self._ghost[key] = last
        while len(self._ghost) > max(_GHOST_MIN, len(self._size)):
            self._ghost.popitem(last=False)

    def victims(self) -> Iterator[int]:
        """Yield keys best victim first: dead, cold main, probation, then main (LRU).

        The caller may ``remove()`` each yielded key before asking for the next; keys
        that become dead tails meanwhile are yielded before the remaining ones.
        Keys the caller skips are not yielded again by this iterator.
        """
        seen: set[int] = set()
        phases = (self._links.walk(_DEAD), self._cold_main(), self._probation_excess())
        for phase in (*phases, self._links.walk(_MAIN), self._links.walk(_PROBATION)):
            for key in phase:
                if key in seen or key not in self._size:
                    continue
                seen.add(key)
                yield key
                yield from self._new_dead(seen)

    def statistics(self) -> PolicyStatistics:
        """Return a snapshot of the counters."""
        count = self._links.count
        return self._base_statistics(
            probation_keys=count[_PROBATION],
            main_keys=count[_MAIN],
            main_bytes=self._seg_bytes[_MAIN],
            dead_keys=count[_DEAD],
            ghost_keys=len(self._ghost),
            promotions=self._promotions,
            chain_links=sum(info & _CONFIRMED for info in self._info.values()),
            horizon=self._horizon,
        )

    # -- chain learning ----------------------------------------------------------------

    def _observe(self, key: int, stream: Hashable) -> int | None:
        """Advance the clock; return the stream's previous key if it precedes ``key``."""
        self._clock += 1
        prev = self._streams.pop(stream, None)
        self._streams[stream] = key
        if len(self._streams) > _STREAM_MEMORY:
            self._streams.popitem(last=False)
        if prev is None or prev == key or prev not in self._size:
            return None
        info = self._info.get(key, 0) & ~_CONFIRMED
        if self._pred.get(key) == prev:
            info |= _CONFIRMED
        else:
            self._pred[key] = prev
        self._info[key] = info
        self._succ[prev] = key
        return prev

    def _unchain(self, key: int) -> None:
        """Drop ``key``'s chain links; mark its successor dead if the link is confirmed."""
        pred = self._pred.pop(key, None)
        if pred is not None and self._succ.get(pred) == key:
            del self._succ[pred]
        succ = self._succ.pop(key, None)
        if succ is None or self._pred.get(succ) != key or not self._confirmed(succ):
            return
        if self._links.owner.get(succ) in (_PROBATION, _MAIN):
            self._move(succ, _DEAD)
            self._succ[key] = succ  # so that rewriting ``key`` revives it

    def _revive_successor(self, key: int) -> None:
        """A rewritten key brings its dead successor back to probation."""
        succ = self._succ.get(key)
        if succ is not None and self._links.owner.get(succ) == _DEAD:
            self._move(succ, _PROBATION)

    # -- segments ----------------------------------------------------------------------

    def _use(self, key: int, prev: int | None) -> None:
        """Handle a re-use: refresh main keys, promote probation and dead ones if admitted."""
        age = self._clock - self._last.get(key, self._clock)
        self._last[key] = self._clock
        if age > 0:
            self._info[key] = (age << 1) | (self._info.get(key, 0) & _CONFIRMED)
        if not self._confirmed(key):
            prev = None  # e.g. a request boundary: do not file a hot key next to a stale one
        owner = self._unlink(key)
        if owner == _MAIN:
            self._horizon = max(age, self._horizon - (self._horizon >> 10))
            self._place(key, prev, _MAIN)
        elif self._main_admits(self._size[key], age):
            self._promotions += 1
            self._place(key, prev, _MAIN)
        else:
            self._place(key, prev, _PROBATION)

    def _place(self, key: int, prev: int | None, sentinel: int) -> None:
        """Insert ``key`` as newest of ``sentinel``, but just before ``prev`` if it is there."""
        self._seg_bytes[sentinel] += self._size[key]
        if prev is not None and self._links.owner.get(prev) == sentinel:
            self._links.insert_before(prev, key, sentinel)
        else:
            self._links.append(sentinel, key)

    def _unlink(self, key: int) -> int:
        owner = self._links.unlink(key)
        self._seg_bytes[owner] -= self._size[key]
        return owner

    def _move(self, key: int, sentinel: int) -> None:
        self._unlink(key)
        self._place(key, None, sentinel)

    def _main_admits(self, size: int, gap: int) -> bool:
        """Main takes a key re-used after ``gap`` ticks while under its share of the bytes,
        or if its oldest key is cold or unused for longer than ``gap`` (LIRS's test)."""
        if self._seg_bytes[_MAIN] + size <= self.main_share * (self._bytes - size):
            return True
        oldest = self._links.first(_MAIN)
        if oldest is None:
            return False
        age = self._clock - self._last[oldest]
        return self._is_cold(oldest) or (gap > 0 and age > self.admit_factor * gap)

    def _is_cold(self, key: int) -> bool:
        gap = (self._info.get(key, 0) >> 1) or self._horizon
        return gap > 0 and self._clock - self._last[key] > self.cold_factor * gap

    def _confirmed(self, key: int) -> bool:
        return bool(self._info.get(key, 0) & _CONFIRMED)

    def _cold_main(self) -> Iterator[int]:
        for key in self._links.walk(_MAIN):
            if not self._is_cold(key):
                return
            yield key

    def _probation_excess(self) -> Iterator[int]:
        """Yield probation keys while probation holds more than its floor share."""
        floor = (1.0 - self.main_share) * self._bytes
        for key in self._links.walk(_PROBATION):
            if self._seg_bytes[_PROBATION] <= floor:
                return
            yield key

    def _new_dead(self, seen: set[int]) -> Iterator[int]:
        """Yield dead keys not yet seen (they appear when the caller removes a head)."""
        if self._links.count[_DEAD] == 0:
            return
        for key in self._links.walk(_DEAD):
            if key not in seen:
                seen.add(key)
                yield key

    # -- persistence ---------------------------------------------------------------------

    def _key_columns(self, key: int) -> tuple[int, int, int]:
        return self._pred.get(key, _NO_KEY), self._last[key], self._info.get(key, 0)

    def _scalars(self) -> tuple[int, int]:
        return self._clock, self._horizon

    def _ghost_items(self) -> list[tuple[int, int]]:
        return list(self._ghost.items())

    def _restore(self, decoded: _Decoded) -> None:
        self._clock, self._horizon = decoded.clock, decoded.horizon
        for sentinel, rows in zip(self._sentinels, decoded.lists, strict=True):
            for key, size, pred, last, flags in rows:
                self._size[key] = size
                self._bytes += size
                self._links.append(sentinel, key)
                self._seg_bytes[sentinel] += size
                self._last[key] = last
                self._restore_chain(key, pred, flags)
        self._ghost.update(decoded.ghost)

    def _restore_chain(self, key: int, pred: int, flags: int) -> None:
        if pred != _NO_KEY:
            self._pred[key] = pred
            self._succ[pred] = key
        if flags:
            self._info[key] = flags


_FACTORIES: dict[str, type[LRUPolicy] | type[FIFOPolicy] | type[KvfsPolicy]] = {
    "kvfs": KvfsPolicy,
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
}
POLICY_NAMES = tuple(_FACTORIES)


def make_policy(name: str) -> EvictionPolicy:
    """Return a new policy by name: "kvfs", "lru" or "fifo"; ValueError otherwise."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {POLICY_NAMES}")
    return factory()
