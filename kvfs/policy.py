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
from collections.abc import Collection, Hashable, Iterator
from dataclasses import dataclass
from itertools import compress
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

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
_NO_KEY = -1  # "no key" in the chain columns and in persisted columns
_FREE = -1  # owner of a slot that holds no key

# List ids double as the slot numbers of the lists' sentinels (slots 0..lists-1).
_ORDER = 0  # the single list of LRUPolicy / FIFOPolicy
_DEAD = 0  # KvfsPolicy: keys whose learned predecessor is gone
_PROBATION = 1  # KvfsPolicy: new, not (yet) re-used keys; FIFO/LRU order
_MAIN = 2  # KvfsPolicy: protected keys, LRU order
_GHOST = 3  # KvfsPolicy: recently evicted keys (not resident), oldest first

_CONFIRMED = 1  # flag: the learned predecessor was observed at least twice in a row
_STREAM_MEMORY = 4096  # streams remembered for chain learning (oldest forgotten first)
# Adaptive coldness threshold (multiple of a key's reuse interval), see KvfsPolicy.
_COLD_MIN = 1.25  # below this, the +-20 % jitter of a live loop looks cold
_COLD_MAX = 4.0
_COLD_UP = 0.25  # a key evicted as cold came back: be slower to call keys cold
_COLD_DOWN = 0.02  # per cold eviction: so ~8 % of cold evictions may be mistakes
# Adaptive main share (ARC-like), see KvfsPolicy._ghost_hit.
_SHARE_MIN = 0.5
_SHARE_MAX = 0.95
_SOON = 4  # a probation ghost hit counts if its gap is under horizon / _SOON
_PEAK_DECAY = 16  # the byte high-water mark forgets 1/65536 per new key
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

    def keys(self) -> set[int]:
        """Return the tracked keys (a new set, in no particular order)."""

    def remove_many(self, keys: Collection[int]) -> None:
        """``remove()`` each of ``keys`` in the order a fresh ``victims()`` lists them
        (what collecting them from ``victims()`` and then removing them does)."""


class _Slots:
    """Per-key state as parallel arrays indexed by slot, plus intrusive circular lists.

    ``index`` maps a key to its slot; every other per-key field is one entry of an
    ``array('q')`` column, so a key costs one dict entry, one int object (the slot)
    and 8 bytes per column.  Slots ``0 .. lists-1`` are the lists' sentinels; freed
    slots are reused (a free-slot stack), so the arrays never shrink but never grow
    beyond the peak number of keys.  A slot is in at most one list (``owner``).
    """

    def __init__(self, lists: int, columns: int) -> None:
        self.index: dict[int, int] = {}
        self.key = array("q", [_NO_KEY] * lists)
        self.prev = array("q", range(lists))
        self.next = array("q", range(lists))
        self.owner = array("b", range(lists))
        self.columns = [array("q", [0] * lists) for _ in range(columns)]
        self.count = [0] * lists
        self.free = array("q")

    def new(self, key: int) -> int:
        """Allocate a slot for ``key`` (in no list, every column 0) and index it."""
        if self.free:
            slot = self.free.pop()
            self.key[slot] = key
        else:
            slot = len(self.key)
            self.key.append(key)
            self.prev.append(slot)
            self.next.append(slot)
            self.owner.append(_FREE)
            for column in self.columns:
                column.append(0)
        self.index[key] = slot
        return slot

    def extend(self, lst: int, keys: array[int]) -> int:
        """Give each of ``keys`` (none indexed yet) a new slot at the end of the arrays,
        every column 0, linked in order at the newest end of ``lst``: what ``new`` and
        ``append`` per key do on a table without free slots, with C-level bulk
        operations. Returns the first new slot (slots are consecutive)."""
        first, n = len(self.key), len(keys)
        if not n:
            return first
        self.key.extend(keys)
        self.index.update(zip(keys, range(first, first + n), strict=True))
        tail = self.prev[lst]
        self.prev.append(tail)
        self.prev.extend(range(first, first + n - 1))
        self.next.extend(range(first + 1, first + n))
        self.next.append(lst)
        self.next[tail] = first
        self.prev[lst] = first + n - 1
        self.owner.extend(array("b", [lst]) * n)
        zeros = array("q", [0]) * n
        for column in self.columns:
            column.extend(zeros)
        self.count[lst] += n
        return first

    def slot_list(self, lst: int) -> list[int]:
        """Return one list's slots oldest first (``slots`` as a list, faster)."""
        out: list[int] = []
        nxt = self.next
        slot = nxt[lst]
        while slot != lst:
            out.append(slot)
            slot = nxt[slot]
        return out

    def release(self, slot: int) -> None:
        """Unindex the key of ``slot`` (in no list) and free the slot."""
        del self.index[self.key[slot]]
        self.key[slot] = _NO_KEY
        for column in self.columns:
            column[slot] = 0
        self.free.append(slot)

    def insert_before(self, anchor: int, slot: int, lst: int) -> None:
        """Link ``slot`` (in no list) right before ``anchor``, a member or sentinel of ``lst``."""
        before = self.prev[anchor]
        self.prev[slot] = before
        self.next[slot] = anchor
        self.next[before] = slot
        self.prev[anchor] = slot
        self.owner[slot] = lst
        self.count[lst] += 1

    def append(self, lst: int, slot: int) -> None:
        """Link ``slot`` at the newest end of list ``lst``."""
        self.insert_before(lst, slot, lst)

    def unlink(self, slot: int) -> int:
        """Take ``slot`` out of its list and return the list."""
        before, after = self.prev[slot], self.next[slot]
        self.next[before] = after
        self.prev[after] = before
        lst = self.owner[slot]
        self.owner[slot] = _FREE
        self.count[lst] -= 1
        return lst

    def first(self, lst: int) -> int | None:
        """Return the oldest slot of list ``lst``, or None if it is empty."""
        slot = self.next[lst]
        return None if slot == lst else slot

    def slots(self, lst: int) -> Iterator[int]:
        """Iterate one list's slots oldest first; the lists must not change meanwhile."""
        slot = self.next[lst]
        while slot != lst:
            yield slot
            slot = self.next[slot]

    def walk(self, lst: int) -> Iterator[int]:
        """Yield the keys of one list oldest first, tolerating removal of the yielded key.

        If both the yielded key and its successor left the list meanwhile, the walk
        restarts from the oldest end (callers filter keys they have already seen).
        """
        slot = self.next[lst]
        while slot != lst:
            after = self.next[slot]
            key = self.key[slot]
            yield key
            if self.owner[slot] == lst and self.key[slot] == key:
                slot = self.next[slot]
            elif after == lst or self.owner[after] == lst:
                slot = after
            else:
                slot = self.next[lst]


class _LinkedPolicy:
    """Shared state and persistence of the policies: slots, sizes, lists and counters."""

    name: str = ""
    _kind: ClassVar[int] = 0
    _lists: ClassVar[tuple[int, ...]] = (_ORDER,)  # persisted lists, in image order
    _slot_lists: ClassVar[int] = 1  # lists including unpersisted ones (the ghost)
    _columns: ClassVar[int] = 1  # column 0 is the size

    def __init__(self) -> None:
        self._slots = _Slots(self._slot_lists, self._columns)
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
        return array("q", [_NO_KEY]) * n, array("q", [0]) * n, array("q", [0]) * n

    def _scalars(self) -> tuple[int, int]:
        """Return (clock, horizon) to persist."""
        return 0, 0

    def _ghost_items(self) -> tuple[array[int], array[int]]:
        """Return the columns (evicted key, its last use clock) to persist."""
        return array("q"), array("q")

    def persist(self) -> bytes:
        """Encode the state: header, per list five int64 columns, ghost keys, CRC32."""
        clock, horizon = self._scalars()
        parts = [_HEADER.pack(_MAGIC, FORMAT_VERSION, self._kind, len(self._lists), clock, horizon)]
        table = self._slots
        for lst in self._lists:
            slots = table.slot_list(lst)
            parts.append(_COUNT.pack(len(slots)))
            parts.append(array("q", map(table.key.__getitem__, slots)).tobytes())
            parts.append(array("q", map(self._size.__getitem__, slots)).tobytes())
            parts.extend(column.tobytes() for column in self._key_columns(slots))
        ghost_keys, ghost_last = self._ghost_items()
        parts.append(_COUNT.pack(len(ghost_keys)))
        parts.append(ghost_keys.tobytes())
        parts.append(ghost_last.tobytes())
        body = b"".join(parts)
        return body + _CRC.pack(zlib.crc32(body))

    def recover(self, data: bytes) -> None:
        """Replace the state by the one ``data`` encodes; on ValueError nothing changes."""
        decoded = _decode(data, self._kind, len(self._lists))
        self.reset()
        self._restore(decoded)

    def _restore(self, decoded: _Decoded) -> None:
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


if TYPE_CHECKING:
    _Columns = tuple[array[int], array[int], array[int], array[int], array[int]]
    """One persisted list: its key, size, predecessor, last use and flags columns."""


@dataclass(frozen=True)
class _Decoded:
    """A validated ``persist()`` image: per list the columns (key, size, pred, last,
    flags), and the ghost keys with their last use."""

    clock: int
    horizon: int
    lists: list[_Columns]
    ghost_keys: array[int]
    ghost_last: array[int]


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
    columns = [_decode_list(reader) for _ in range(lists)]
    count = reader.count()
    decoded = _Decoded(clock, horizon, columns, reader.column(count), reader.column(count))
    if reader.offset != len(body):
        raise ValueError("trailing bytes in policy image")
    _check_keys(decoded)
    return decoded


def _decode_list(reader: _Reader) -> _Columns:
    count = reader.count()
    keys, sizes, preds, lasts, flags = (reader.column(count) for _ in range(5))
    return keys, sizes, preds, lasts, flags


def _check_keys(decoded: _Decoded) -> None:
    # C-level checks (min, a set) first; the row loop only to name the bad key
    seen: set[int] = set()
    total = 0
    for keys, sizes, preds, _last, _flags in decoded.lists:
        if keys and (min(keys) < 0 or min(sizes) < 0 or min(preds) < _NO_KEY):
            break
        seen.update(keys)
        total += len(keys)
    else:
        if len(seen) == total:
            if decoded.ghost_keys and min(decoded.ghost_keys) < 0:
                raise ValueError("bad ghost key in policy image")
            return
    seen.clear()
    for keys, sizes, preds, _last, _flags in decoded.lists:
        for key, size, pred in zip(keys, sizes, preds, strict=True):
            if key < 0 or size < 0 or pred < _NO_KEY or key in seen:
                raise ValueError(f"bad or duplicate key {key} in policy image")
            seen.add(key)
    raise AssertionError("unreachable")  # pragma: no cover


class FIFOPolicy(_LinkedPolicy):
    """First in, first out: evict in order of first ``track()``; reads change nothing."""

    name = "fifo"
    _kind = 1

    def track(self, key: int, size: int, stream: Hashable) -> None:
        """Record a write; a rewrite of a tracked key keeps its place."""
        self._check(key, size)
        slot = self._slot(key)
        if slot is None:
            self._slots.append(_ORDER, self._add(key, size))
        else:
            self._resize(slot, size)

    def touch(self, key: int, stream: Hashable) -> None:
        """Count a read; FIFO order ignores reads."""
        if self._slot(key) is not None:
            self._touches += 1

    def remove(self, key: int) -> None:
        """Forget ``key`` (no-op if unknown)."""
        slot = self._slot(key)
        if slot is not None:
            self._drop(slot)
            self._slots.release(slot)

    def victims(self) -> Iterator[int]:
        """Yield keys oldest write first; removing the yielded key is allowed."""
        return self._slots.walk(_ORDER)

    def statistics(self) -> PolicyStatistics:
        """Return a snapshot of the counters."""
        return self._base_statistics()


class LRUPolicy(FIFOPolicy):
    """Least recently used: every track or touch makes a key the newest."""

    name = "lru"
    _kind = 0

    def track(self, key: int, size: int, stream: Hashable) -> None:
        """Record a write; it counts as a use."""
        self._check(key, size)
        slot = self._slot(key)
        if slot is None:
            slot = self._add(key, size)
        else:
            self._resize(slot, size)
            self._slots.unlink(slot)
        self._slots.append(_ORDER, slot)

    def touch(self, key: int, stream: Hashable) -> None:
        """Record a read: ``key`` becomes the newest."""
        slot = self._slot(key)
        if slot is not None:
            self._touches += 1
            self._slots.unlink(slot)
            self._slots.append(_ORDER, slot)


class KvfsPolicy(_LinkedPolicy):
    """Prefix-aware segmented policy for KV-cache chunk files (docs/eviction.md).

    Three lists; ``victims()`` yields in this order:

    1. *dead*: keys whose learned predecessor was removed.  Under the prefix rule a
       chunk without its prefix can never be a hit, so these go first.
    2. *cold main*: protected keys unused for longer than the coldness threshold
       times their own last reuse interval (finished conversations).
    3. *probation* while main stays within its share of the bytes (of their
       high-water mark, about the capacity) after the eviction: new keys and keys
       not admitted to main, oldest first.
    4. *main*, least recently used first, then the rest of probation.

    Admission to main (S3-FIFO-like, but loop-resistant as in LIRS): a key re-read
    while in probation, re-written after its eviction (a ghost hit) or written as the
    continuation of a main chain enters main if main stays within its share of the
    bytes *after the eviction the admission causes*, or main's oldest key is cold,
    or that key has been unused for longer than ``admit_factor`` times the
    newcomer's reuse interval.  Otherwise it stays in probation, so a working set
    larger than the cache keeps a stable subset of whole chains hot instead of
    cycling everything through (what LRU does on multi-round QA).  The share test
    of admission and the one that lets probation be evicted are the same
    expression: when they differed by one key (or one float rounding), a full main
    admitted every newcomer while probation could not be evicted, and main became
    an LRU (the ``main_share`` cliff of the first version, docs/eviction.md).

    Two thresholds adapt, both only from *near* ghost hits (the key was evicted
    fewer than ``len(self)`` evictions ago, so a cache twice as large would have
    hit it): main's share starts at ``main_share`` and moves by the key's share of
    the bytes, up when a key evicted from main comes back, down when a key
    evicted from probation comes back within a quarter of the reuse horizon
    (agentic fan-out rather than a QA loop), within [0.5, 0.95]; the coldness
    threshold starts at ``cold_factor``, rises by 0.25 when a key evicted as cold
    comes back and falls by 0.02 per cold eviction, within [1.25, 4].

    Chains are learned per stream: when a stream accesses key B right after a
    different key A, A becomes B's predecessor (confirmed when seen twice in a row).
    B is filed right *before* A in its list (for a re-read only if the link is
    confirmed), so a chain's tail is older than its head and is evicted first.
    Removing a key moves its latest successor, if that link is confirmed, to the
    dead list; re-writing the key brings the successor back.

    Time is a logical clock of track/touch calls.  State is kept in parallel arrays
    (see :class:`_Slots`): about 140 B per key in CPython, the same per ghost key.
    The adaptive thresholds are not persisted; ``recover()`` restarts them.
    """

    name = "kvfs"
    _kind = 2
    _lists = (_DEAD, _PROBATION, _MAIN)
    _slot_lists = 4  # and the ghost list
    _columns = 5  # size, predecessor key, latest successor key, last use, gap << 1 | flags

    def __init__(
        self, main_share: float = 0.93, cold_factor: float = 2.0, admit_factor: float = 1.5
    ) -> None:
        if not 0.0 <= main_share <= 1.0 or cold_factor <= 0.0 or admit_factor <= 0.0:
            raise ValueError("main_share must be in [0, 1], the factors > 0")
        super().__init__()
        self.main_share = main_share
        self.cold_factor = cold_factor
        self.admit_factor = admit_factor
        columns = self._slots.columns
        self._pred, self._succ, self._last, self._info = columns[1:]
        self._streams: OrderedDict[Hashable, int] = OrderedDict()
        self._clock = 0
        self._horizon = 0
        self._seg_bytes = [0] * self._slot_lists
        self._promotions = 0
        self._cold = min(_COLD_MAX, max(_COLD_MIN, cold_factor))
        self._evictions = 0
        self._share = main_share
        self._peak = 0

    def reset(self) -> None:
        """Forget every key, chain and counter (keeps the tuning parameters)."""
        self.__init__(self.main_share, self.cold_factor, self.admit_factor)  # type: ignore[misc]

    def _init_slot(self, slot: int) -> None:
        self._pred[slot] = _NO_KEY
        self._succ[slot] = _NO_KEY

    # -- verbs -----------------------------------------------------------------------

    def track(self, key: int, size: int, stream: Hashable) -> None:
        """Record a write of ``key``; a rewrite of a tracked key counts as a use."""
        self._check(key, size)
        slot = self._slot(key)
        if slot is not None:
            self._seg_bytes[self._slots.owner[slot]] += size - self._size[slot]
            self._resize(slot, size)
            self._use(slot, self._observe(slot, stream))
            return
        ghost = self._slots.index.get(key)  # resident keys were handled above
        if ghost is not None:
            self._slots.unlink(ghost)
            self._ghost_hit(self._size[ghost], size, self._clock + 1 - self._last[ghost])
        slot = self._add(key, size)
        self._peak = max(self._bytes, self._peak - (self._peak >> _PEAK_DECAY))
        prev = self._observe(slot, stream)
        gap = 0 if ghost is None else self._clock - self._last[slot]
        self._info[slot] = (gap << 1) | (self._info[slot] & _CONFIRMED)
        continues_main = prev is not None and self._slots.owner[prev] == _MAIN
        admitted = (ghost is not None or continues_main) and self._main_admits(size, gap)
        self._place(slot, prev, _MAIN if admitted else _PROBATION)
        self._last[slot] = self._clock
        self._revive_successor(slot)

    def touch(self, key: int, stream: Hashable) -> None:
        """Record a read of ``key`` by ``stream``; unknown keys are ignored."""
        slot = self._slot(key)
        if slot is None:
            return
        self._touches += 1
        self._use(slot, self._observe(slot, stream))

    def remove(self, key: int) -> None:
        """Forget ``key``; its chain successor becomes a dead tail.  No-op if unknown."""
        slot = self._slot(key)
        if slot is None:
            return
        owner = self._slots.owner[slot]
        cold = owner == _MAIN and self._is_cold(slot)
        self._seg_bytes[owner] -= self._size[slot]
        self._drop(slot)
        self._evictions += 1
        # a ghost's size column: eviction number << 2 | evicted from main << 1 | was cold
        self._size[slot] = self._evictions << 2 | (owner == _MAIN) << 1 | cold
        self._info[slot] = 0
        if cold:
            self._cold = max(_COLD_MIN, self._cold - _COLD_DOWN)
        self._unchain(slot)
        table = self._slots
        table.append(_GHOST, slot)  # keeps the last use (and a successor to revive)
        while table.count[_GHOST] > max(_GHOST_MIN, self._resident):
            oldest = table.next[_GHOST]
            table.unlink(oldest)
            table.release(oldest)

    def victims(self) -> Iterator[int]:
        """Yield keys best victim first: dead, cold main, probation, then main (LRU).

        The caller may ``remove()`` each yielded key before asking for the next; keys
        that become dead tails meanwhile are yielded before the remaining ones.
        Keys the caller skips are not yielded again by this iterator.
        """
        seen: set[int] = set()
        walk = self._slots.walk
        phases = (walk(_DEAD), self._cold_main(), self._probation_excess())
        for phase in (*phases, walk(_MAIN), walk(_PROBATION)):
            for key in phase:
                if key in seen or key not in self:
                    continue
                seen.add(key)
                yield key
                yield from self._new_dead(seen)

    def remove_many(self, keys: Collection[int]) -> None:
        """``remove()`` each of ``keys`` in the order a fresh ``victims()`` lists them.

        Without removals, ``victims()`` lists the dead list, main's cold prefix,
        probation's excess prefix, the rest of main, then the rest of probation (no
        key turns dead meanwhile); walking the lists directly gives that order
        without the per-key cost of ``victims()`` (O(1) per resident key: after a
        crash, recovery removes the files dropped since the last checkpoint).
        """
        table = self._slots
        key_of = table.key
        dead = [key_of[slot] for slot in table.slot_list(_DEAD) if key_of[slot] in keys]
        main_cold: list[int] = []
        main_rest: list[int] = []
        cold = True
        for slot in table.slot_list(_MAIN):
            cold = cold and self._is_cold(slot)
            if key_of[slot] in keys:
                (main_cold if cold else main_rest).append(key_of[slot])
        excess: list[int] = []
        rest: list[int] = []
        within, main_bytes = True, self._seg_bytes[_MAIN]
        for slot in table.slot_list(_PROBATION):
            within = within and self._within_share(main_bytes, self._size[slot])
            if key_of[slot] in keys:
                (excess if within else rest).append(key_of[slot])
        for key in dead + main_cold + excess + main_rest + rest:
            self.remove(key)

    def statistics(self) -> PolicyStatistics:
        """Return a snapshot of the counters."""
        count = self._slots.count
        return self._base_statistics(
            probation_keys=count[_PROBATION],
            main_keys=count[_MAIN],
            main_bytes=self._seg_bytes[_MAIN],
            dead_keys=count[_DEAD],
            ghost_keys=count[_GHOST],
            promotions=self._promotions,
            chain_links=sum(info & _CONFIRMED for info in self._info),
            horizon=self._horizon,
        )

    # -- chain learning ----------------------------------------------------------------

    def _observe(self, slot: int, stream: Hashable) -> int | None:
        """Advance the clock; return the slot of the stream's previous key if it precedes."""
        self._clock += 1
        key = self._slots.key[slot]
        prev = self._streams.pop(stream, None)
        self._streams[stream] = key
        if len(self._streams) > _STREAM_MEMORY:
            self._streams.popitem(last=False)
        if prev is None or prev == key:
            return None
        prev_slot = self._slot(prev)
        if prev_slot is None:
            return None
        info = self._info[slot] & ~_CONFIRMED
        if self._pred[slot] == prev:
            info |= _CONFIRMED
        else:
            self._pred[slot] = prev
        self._info[slot] = info
        self._succ[prev_slot] = key
        return prev_slot

    def _unchain(self, slot: int) -> None:
        """Drop ``slot``'s chain links; mark its successor dead if the link is confirmed."""
        key = self._slots.key[slot]
        pred, self._pred[slot] = self._pred[slot], _NO_KEY
        pred_slot = self._slots.index.get(pred) if pred != _NO_KEY else None
        if pred_slot is not None and self._succ[pred_slot] == key:
            self._succ[pred_slot] = _NO_KEY
        succ, self._succ[slot] = self._succ[slot], _NO_KEY
        succ_slot = self._slot(succ) if succ != _NO_KEY else None
        if succ_slot is None or self._pred[succ_slot] != key:
            return
        if self._info[succ_slot] & _CONFIRMED and self._slots.owner[succ_slot] != _DEAD:
            self._move(succ_slot, _DEAD)
            self._succ[slot] = succ  # so that rewriting ``key`` revives it

    def _revive_successor(self, slot: int) -> None:
        """A rewritten key brings its dead successor back to probation."""
        succ = self._succ[slot]
        succ_slot = self._slot(succ) if succ != _NO_KEY else None
        if succ_slot is not None and self._slots.owner[succ_slot] == _DEAD:
            self._move(succ_slot, _PROBATION)

    # -- segments ----------------------------------------------------------------------

    def _use(self, slot: int, prev: int | None) -> None:
        """Handle a re-use: refresh main keys, promote probation and dead ones if admitted."""
        age = self._clock - self._last[slot]
        self._last[slot] = self._clock
        if age > 0:
            self._info[slot] = (age << 1) | (self._info[slot] & _CONFIRMED)
        if not self._info[slot] & _CONFIRMED:
            prev = None  # e.g. a request boundary: do not file a hot key next to a stale one
        owner = self._unlink(slot)
        if owner == _MAIN:
            self._horizon = max(age, self._horizon - ((self._horizon >> 10) or 1))
            self._place(slot, prev, _MAIN)
        elif self._main_admits(self._size[slot], age):
            self._promotions += 1
            self._place(slot, prev, _MAIN)
        else:
            self._place(slot, prev, _PROBATION)

    def _place(self, slot: int, prev: int | None, lst: int) -> None:
        """Link ``slot`` as newest of ``lst``, but just before ``prev`` if it is there."""
        self._seg_bytes[lst] += self._size[slot]
        if prev is not None and self._slots.owner[prev] == lst:
            self._slots.insert_before(prev, slot, lst)
        else:
            self._slots.append(lst, slot)

    def _unlink(self, slot: int) -> int:
        owner = self._slots.unlink(slot)
        self._seg_bytes[owner] -= self._size[slot]
        return owner

    def _move(self, slot: int, lst: int) -> None:
        self._unlink(slot)
        self._place(slot, None, lst)

    def _main_admits(self, size: int, gap: int) -> bool:
        """Main takes a key re-used after ``gap`` ticks if it stays within its share of
        the bytes left after the eviction this causes, or if its oldest key is cold or
        unused for longer than ``admit_factor`` x ``gap`` (LIRS's test)."""
        if self._within_share(self._seg_bytes[_MAIN] + size, size):
            return True
        oldest = self._slots.first(_MAIN)
        if oldest is None:
            return False
        age = self._clock - self._last[oldest]
        return self._is_cold(oldest) or (gap > 0 and age > self.admit_factor * gap)

    def _within_share(self, main: int, size: int) -> bool:
        """Is ``main`` bytes within main's share once ``size`` bytes are evicted?

        The share is of the bytes' high-water mark (about the capacity), not of the
        current bytes, so it does not shrink when a store evicts below capacity.
        (Batches deeper than probation still rotate main: docs/eviction.md.)
        """
        return main <= self._share * (self._peak - size)

    def _ghost_hit(self, record: int, size: int, gap: int) -> None:
        """Learn from an evicted key written again (``record`` from ``remove()``)."""
        if self._evictions - (record >> 2) > self._resident or not self._bytes:
            return  # not a near miss: a cache twice as large would not have hit it either
        if record & 1:  # evicted as cold, yet back: detect coldness later
            self._cold = min(_COLD_MAX, self._cold + _COLD_UP)
        step = size / self._bytes
        if record & 2:  # main was too small to keep it
            self._share = min(max(_SHARE_MAX, self.main_share), self._share + step)
        elif gap * _SOON < self._horizon:  # probation was, and it came back soon
            self._share = max(min(_SHARE_MIN, self.main_share), self._share - step)

    def _is_cold(self, slot: int) -> bool:
        gap = (self._info[slot] >> 1) or self._horizon
        return gap > 0 and self._clock - self._last[slot] > self._cold * gap

    def _cold_main(self) -> Iterator[int]:
        index = self._slots.index
        for key in self._slots.walk(_MAIN):
            if not self._is_cold(index[key]):
                return
            yield key

    def _probation_excess(self) -> Iterator[int]:
        """Yield probation keys while main stays within its share after the eviction.

        The very expression of :meth:`_main_admits`, so that a key admitted to main
        because of free share is always followed by a probation eviction.
        """
        index, seg = self._slots.index, self._seg_bytes
        for key in self._slots.walk(_PROBATION):
            if not self._within_share(seg[_MAIN], self._size[index[key]]):
                return
            yield key

    def _new_dead(self, seen: set[int]) -> Iterator[int]:
        """Yield dead keys not yet seen (they appear when the caller removes a head)."""
        if self._slots.count[_DEAD] == 0:
            return
        for key in self._slots.walk(_DEAD):
            if key not in seen:
                seen.add(key)
                yield key

    # -- persistence ---------------------------------------------------------------------

    def _key_columns(self, slots: list[int]) -> tuple[array[int], array[int], array[int]]:
        return (
            array("q", map(self._pred.__getitem__, slots)),
            array("q", map(self._last.__getitem__, slots)),
            array("q", map(self._info.__getitem__, slots)),
        )

    def _scalars(self) -> tuple[int, int]:
        return self._clock, self._horizon

    def _ghost_items(self) -> tuple[array[int], array[int]]:
        table = self._slots
        slots = table.slot_list(_GHOST)
        return (
            array("q", map(table.key.__getitem__, slots)),
            array("q", map(self._last.__getitem__, slots)),
        )

    def _restore(self, decoded: _Decoded) -> None:
        # Bulk, column-wise: the same slots, links and columns as ``_add`` + ``append``
        # per row, then one new ghost slot per first sighting of a ghost key.
        self._clock, self._horizon = decoded.clock, decoded.horizon
        table = self._slots
        for lst, (keys, sizes, preds, lasts, flags) in zip(self._lists, decoded.lists, strict=True):
            first = self._restore_list(lst, keys, sizes)
            self._seg_bytes[lst] += sum(sizes)
            self._pred[first:] = preds
            self._succ[first:] = array("q", [_NO_KEY]) * len(keys)  # _init_slot
            self._last[first:] = lasts
            self._info[first:] = flags
        ghost_keys, ghost_last = decoded.ghost_keys, decoded.ghost_last
        fresh = dict.fromkeys(ghost_keys)
        if len(fresh) != len(ghost_keys) or not table.index.keys().isdisjoint(fresh):
            # only a forged image repeats keys: keep the first sighting of each
            kept: dict[int, int] = {}
            for key, last in zip(ghost_keys, ghost_last, strict=True):
                if key not in table.index and key not in kept:
                    kept[key] = last
            ghost_keys, ghost_last = array("q", kept), array("q", kept.values())
        first = table.extend(_GHOST, ghost_keys)
        self._pred[first:] = array("q", [_NO_KEY]) * len(ghost_keys)
        self._succ[first:] = array("q", [_NO_KEY]) * len(ghost_keys)
        self._last[first:] = ghost_last
        index = table.index
        for keys, _sizes, preds, _lasts, _flags in decoded.lists:
            if not preds or max(preds) == _NO_KEY:
                continue  # no learned chains in this list
            for pred, key in zip(preds, keys, strict=True):
                if pred != _NO_KEY:
                    pred_slot = index.get(pred)
                    if pred_slot is not None:
                        self._succ[pred_slot] = key


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
