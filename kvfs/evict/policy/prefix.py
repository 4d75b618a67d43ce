"""The prefix-aware segmented policy ("kvfs"): dead tails, probation, protected main.

Design, ablations and measurements in ``docs/eviction.md``.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterator
from typing import TYPE_CHECKING

from kvfs.evict.policy.base import LinkedPolicy
from kvfs.evict.policy.protocol import PolicyStatistics
from kvfs.evict.slots import NO_KEY, SHIFT
from kvfs.format import policy_image as img
from kvfs.index.columns import narrowed

if TYPE_CHECKING:
    from kvfs.format.policy_image import Image

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
_U64 = (1 << 64) - 1  # a handed-over ghost's fields (take_ghost)
# Last uses are kept modulo 2**32 (the clock itself is exact), so the column stays 4
# bytes a row however long the mount runs; an age is (clock - last) mod 2**32. Once
# the clock passes _KEEP, a sweep visits one chunk of the column at a time, a full
# pass at most every _SWEEP events, and sets any age past _KEEP to _KEEP: an age is
# then exact up to 2**31 events and never wraps (it stays under _KEEP + 3 * _SWEEP).
_M32 = (1 << 32) - 1
_KEEP = 1 << 31
_SWEEP = 1 << 29
_IDLE = 1 << 62  # _sweep_next when no pass runs
_GAP_MAX = (1 << 31) - 1  # a reuse interval kept (gap << 1 | flag: 32 bits)
_RECORD = (1 << 30) - 1  # eviction numbers in a ghost's record, modulo 2**30
RULES = frozenset(
    {"dead-first", "cold-main", "chain-order", "lirs-admit", "adapt", "partial-first"}
)
"""Rules an ablation may switch off (``KvfsPolicy(without=...)``, docs/eviction.md)."""


class KvfsPolicy(LinkedPolicy):
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
    confirmed; for a new key only in a run of the stream's accesses that a read
    began, as in ``prefix-lru``: a writer that never reads would otherwise lose its
    newest files first), so a chain's tail is older than its head and is evicted
    first. A new key chained to a larger predecessor (a prompt's partial last
    chunk, which a continuation never reads) is filed as the oldest of its list,
    its last use that of the oldest key of all lists, and ends the run.
    Removing a key moves its latest successor, if that link is confirmed, to the
    dead list; re-writing the key brings the successor back.

    Time is a logical clock of track/touch calls.  State is kept in typed columns
    (see :class:`~kvfs.evict.slots.SlotTable`): 29 B per inode number (resident or
    ghost key), ~100 B more for a key that is not an inode number.
    A version 2 image keeps the adaptive thresholds; ``recover()`` of a version 1
    image restarts them.
    """

    name = "kvfs"
    _kind = img.KIND_KVFS
    _lists = (_DEAD, _PROBATION, _MAIN)
    _slot_lists = 4  # and the ghost list
    _columns = ("I", "i", "i", "I", "I")  # size, predecessor, successor, last use, gap<<1|flags

    def __init__(
        self,
        main_share: float = 0.93,
        cold_factor: float = 2.0,
        admit_factor: float = 1.5,
        without: frozenset[str] = frozenset(),
    ) -> None:
        if not 0.0 <= main_share <= 1.0 or cold_factor <= 0.0 or admit_factor <= 0.0:
            raise ValueError("main_share must be in [0, 1], the factors > 0")
        if not without <= RULES:
            raise ValueError(f"unknown rules {sorted(without - RULES)}; rules are {sorted(RULES)}")
        super().__init__()
        self.without = without
        self._dead_first = "dead-first" not in without
        self._cold_first = "cold-main" not in without
        self._chain_order = "chain-order" not in without
        self._lirs = "lirs-admit" not in without
        self._adapt = "adapt" not in without
        self.main_share = main_share
        self.cold_factor = cold_factor
        self.admit_factor = admit_factor
        self._bind_columns()
        self._partial_first = "partial-first" not in without
        # stream -> (its last key, whether its run of accesses began with a read,
        # whether that last access created the key)
        self._streams: OrderedDict[Hashable, tuple[int, bool, bool]] = OrderedDict()
        self._chained = False  # what the last _observe() found (its docstring)
        self._clock = 0
        self._horizon = 0
        self._sweep_at = _KEEP  # the clock of the sweep's next step
        self._sweep_next = _IDLE  # the chunk it visits then
        self._pass_end = 0  # the clock by which the running pass ends
        self._seg_bytes = [0] * self._slot_lists
        self._promotions = 0
        self._cold = min(_COLD_MAX, max(_COLD_MIN, cold_factor))
        self._evictions = 0
        self._share = main_share
        self._peak = 0

    def reset(self) -> None:
        """Forget every key, chain and counter (keeps the tuning parameters)."""
        self.__init__(  # type: ignore[misc]
            self.main_share, self.cold_factor, self.admit_factor, self.without
        )

    def recover_foreign(self, data: bytes) -> bool:
        """An ``adaptive`` image holds a whole kvfs image (its loop expert's lists and
        ghosts): restore it; other kinds: adopt their resident keys."""
        if img.kind_of(data) == img.KIND_ADAPTIVE and img.version_of(data) != 1:
            try:  # its table 0 is the loop expert's: a whole kvfs table
                self._load_pieces(img.split_pieces(data), img.KIND_ADAPTIVE, 0)
                return True
            except ValueError:
                self.reset()
        found = img.decode_any(data)
        if found is not None and found[0] == img.KIND_ADAPTIVE:
            self.reset()
            self._restore(found[1])
            return True
        return super().recover_foreign(data)

    def _bind_columns(self) -> None:
        super()._bind_columns()
        self._pred, self._succ, self._last, self._info = self._slots.columns[1:]

    def _adopt_fresh(
        self, keys: array[int], sizes: array[int], spans: list[tuple[int, int]] | None
    ) -> None:
        # per key, track(key, size, None) on a fresh policy: clock + 1, last use =
        # clock, no chain, newest of probation; the byte high-water mark follows the
        # bytes (they only grow), so it ends at the total
        n, clock = len(keys), self._clock
        lasts = array("q", range(clock + 1, clock + n + 1))
        if clock + n > _M32:
            lasts = array("q", [t & _M32 for t in lasts])
        fills = [
            (self._size, sizes),
            (self._pred, NO_KEY),
            (self._succ, NO_KEY),
            (self._last, lasts),
        ]
        self._slots.adopt_keys(_PROBATION, keys, fills, spans)  # type: ignore[arg-type]
        total = sum(sizes)
        self._clock += n
        if self._clock >= self._sweep_at:
            self._sweep()
        self._seg_bytes[_PROBATION] += total
        self._peak = max(self._bytes + total, self._peak)

    def _init_slot(self, slot: int) -> None:
        self._pred[slot] = NO_KEY
        self._succ[slot] = NO_KEY

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
        ghost = self._slots.find(key)  # resident keys were handled above
        if ghost is not None:
            self._slots.unlink(ghost)
            self._ghost_hit(self._size[ghost], size, self._age(ghost) + 1)
        slot = self._add(key, size)
        self._peak = max(self._bytes, self._peak - (self._peak >> _PEAK_DECAY))
        prev = self._observe(slot, stream, new=True)
        gap = 0 if ghost is None else min(self._age(slot), _GAP_MAX)
        self._info[slot] = (gap << 1) | (self._info[slot] & _CONFIRMED)
        continues_main = prev is not None and self._slots.owner[prev] == _MAIN
        admitted = (ghost is not None or continues_main) and self._main_admits(size, gap)
        lst = _MAIN if admitted else _PROBATION
        anchor = prev if self._chained else None
        self._last[slot] = self._clock & _M32
        if self._partial_first and anchor is not None and size < self._size[anchor]:
            self._place_oldest(slot, lst)
            self._streams[stream] = (key, False, True)  # it ends the run (class docstring)
        else:
            self._place(slot, anchor, lst)
        self._revive_successor(slot)

    def touch(self, key: int, stream: Hashable) -> None:
        """Record a read of ``key`` by ``stream``; unknown keys are ignored."""
        slot = self._slot(key)
        if slot is None:
            return
        self._touches += 1
        self._use(slot, self._observe(slot, stream, read=True))

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
        # a ghost's size column: eviction number (mod 2**30) << 2 | evicted from main << 1
        # | was cold
        self._size[slot] = (self._evictions & _RECORD) << 2 | (owner == _MAIN) << 1 | cold
        self._info[slot] = 0
        if cold:
            self._cold = max(_COLD_MIN, self._cold - _COLD_DOWN)
        self._unchain(slot)
        self._slots.append(_GHOST, slot)  # keeps the last use (and a successor to revive)
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        table = self._slots
        while table.count[_GHOST] > max(_GHOST_MIN, self._resident):
            oldest = table.next[_GHOST]
            table.unlink(oldest)
            table.release(oldest)

    def take_ghost(self, key: int) -> int | None:
        """Hand over ``key``'s ghost as one int (its eviction record, last use on the
        whole clock, successor to revive, and its note) and forget it here; None if
        ``key`` is no ghost."""
        table = self._slots
        slot = self._ghost_slot(key)
        if slot is None:
            return None
        ghost = (
            self._size[slot]
            | (self._clock - self._age(slot)) << 64
            | (self._succ[slot] + 1) << 128
            | self._info[slot] << 192
        )
        table.unlink(slot)
        table.release(slot)
        return ghost

    def put_ghost(self, key: int, ghost: int) -> None:
        """Make ``ghost`` (from :meth:`take_ghost`) the newest ghost of ``key``, which
        holds no state (``take_ghost`` whatever it held first); no-op otherwise."""
        table = self._slots
        if key < 0 or table.find(key) is not None:
            return
        slot = table.new(key)
        self._init_slot(slot)
        self._size[slot] = ghost & _U64
        age = min(max(self._clock - (ghost >> 64 & _U64), 0), _KEEP)  # capped as the sweep caps
        self._last[slot] = (self._clock - age) & _M32
        self._succ[slot] = (ghost >> 128 & _U64) - 1
        self._info[slot] = ghost >> 192
        table.append(_GHOST, slot)
        self._trim_ghosts()

    def _ghost_slot(self, key: int) -> int | None:
        table = self._slots
        slot = table.find(key) if key >= 0 else None
        return slot if slot is not None and table.owner[slot] == _GHOST else None

    def victims(self) -> Iterator[int]:
        """Yield keys best victim first: dead, cold main, probation, then main (LRU).

        The caller may ``remove()`` each yielded key before asking for the next; keys
        that become dead tails meanwhile are yielded before the remaining ones.
        Keys the caller skips are not yielded again by this iterator.
        """
        seen: set[int] = set()
        walk = self._slots.walk
        first = (walk(_DEAD),) if self._dead_first else ()
        cold = (self._cold_main(),) if self._cold_first else ()
        last = () if self._dead_first else (walk(_DEAD),)
        for phase in (
            *first,
            *cold,
            self._probation_excess(),
            walk(_MAIN),
            walk(_PROBATION),
            *last,
        ):
            for key in phase:
                if key in seen or key not in self:
                    continue
                seen.add(key)
                yield key
                if self._dead_first:
                    yield from self._new_dead(seen)

    def recent_first(self) -> Iterator[int]:
        """Yield the resident keys in a recency order, oldest first, from this table
        alone: the dead, probation and main lists merged by last use, each list's
        own order kept (so a chain filed tail first still leaves tail first), the
        list whose oldest key was used longest ago next; of two as old, the
        smaller key (a partial chunk, ``_place_oldest``), then list order. The
        adaptive policy's recency side (``adaptive.py``): where it once kept a
        second table of its own, 11 B a file at 10^7 (session 29).

        As for ``victims()``, the caller may ``remove()`` each yielded key before
        asking for the next, and a key is yielded once."""
        walks = [self._slots.walk(lst) for lst in self._lists]
        heads: list[int | None] = [next(w, None) for w in walks]
        seen: set[int] = set()
        while True:
            best, oldest = -1, (-1, 0)
            for i, key in enumerate(heads):
                slot = None
                while key is not None:  # the list's oldest key not yet yielded
                    slot = None if key in seen else self._slot(key)
                    if slot is not None:
                        break
                    key = heads[i] = next(walks[i], None)
                if slot is not None and (rank := (self._age(slot), -self._size[slot])) > oldest:
                    best, oldest = i, rank
            if best < 0:
                return
            key = heads[best]
            assert key is not None
            seen.add(key)
            heads[best] = next(walks[best], None)
            yield key

    def remove_many(self, keys: Collection[int]) -> None:
        """``remove()`` each of ``keys`` in the order a fresh ``victims()`` lists them.

        Without removals, ``victims()`` lists the dead list, main's cold prefix,
        probation's excess prefix, the rest of main, then the rest of probation (no
        key turns dead meanwhile); walking the lists directly gives that order
        without the per-key cost of ``victims()`` (O(1) per resident key: after a
        crash, recovery removes the files dropped since the last checkpoint).
        """
        if self.without:  # an ablation: the generic (slower) walk of victims()
            super().remove_many(keys)
            return
        table = self._slots
        key_of = table.key_of
        dead = [key_of(slot) for slot in table.slot_list(_DEAD) if key_of(slot) in keys]
        main_cold: list[int] = []
        main_rest: list[int] = []
        cold = True
        for slot in table.slot_list(_MAIN):
            cold = cold and self._is_cold(slot)
            if key_of(slot) in keys:
                (main_cold if cold else main_rest).append(key_of(slot))
        excess: list[int] = []
        rest: list[int] = []
        within, main_bytes = True, self._seg_bytes[_MAIN]
        for slot in table.slot_list(_PROBATION):
            within = within and self._within_share(main_bytes, self._size[slot])
            if key_of(slot) in keys:
                (excess if within else rest).append(key_of(slot))
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
            chain_links=sum(
                sum(map(_CONFIRMED.__and__, chunk)) for chunk in self._info.chunks if chunk
            ),
            horizon=self._horizon,
        )

    # -- chain learning ----------------------------------------------------------------

    def _observe(
        self, slot: int, stream: Hashable, read: bool = False, new: bool = False
    ) -> int | None:
        """Advance the clock; return the slot of the stream's previous key if it precedes.
        No stream (``None``: files adopted at mount) learns no chain.

        Sets ``_chained``: a ``new`` key may be filed before that key, because the
        stream's run of accesses began with a read (a write-only run is filed like
        LRU, as in ``prefix-lru``: no request boundary shows inside it). A run goes
        on through a read, a chained new key or a re-use along a confirmed link."""
        self._clock += 1
        if self._clock >= self._sweep_at:
            self._sweep()
        self._chained = False
        if stream is None:
            return None
        key = self._slots.key_of(slot)
        prev, began, created = self._streams.pop(stream, (None, False, False))
        if len(self._streams) >= _STREAM_MEMORY:
            self._streams.popitem(last=False)
        if prev is None or prev == key:
            self._streams[stream] = (key, read or (began and prev == key), new)
            return None
        # a link from a key the stream has just created is never a confirmed one: a
        # use after a write is the next request (a prompt reads its cached chunks
        # before it writes), and a mount's keys are inode numbers, so ``prev`` may be
        # a number this key's recorded predecessor had before it was evicted
        confirmed = self._pred[slot] == prev and not created
        self._chained = new and began
        self._streams[stream] = (key, read or self._chained or (not new and confirmed), new)
        prev_slot = self._slot(prev)
        if prev_slot is None:
            return None
        info = self._info[slot] & ~_CONFIRMED
        if confirmed:
            info |= _CONFIRMED
        else:
            self._pred[slot] = prev
        self._info[slot] = info
        self._succ[prev_slot] = key
        return prev_slot

    def _unchain(self, slot: int) -> None:
        """Drop ``slot``'s chain links; mark its successor dead if the link is confirmed."""
        key = self._slots.key_of(slot)
        pred, self._pred[slot] = self._pred[slot], NO_KEY
        pred_slot = self._slots.find(pred) if pred != NO_KEY else None
        if pred_slot is not None and self._succ[pred_slot] == key:
            self._succ[pred_slot] = NO_KEY
        succ, self._succ[slot] = self._succ[slot], NO_KEY
        succ_slot = self._slot(succ) if succ != NO_KEY else None
        if succ_slot is None or self._pred[succ_slot] != key:
            return
        if self._info[succ_slot] & _CONFIRMED and self._slots.owner[succ_slot] != _DEAD:
            self._move(succ_slot, _DEAD)
            self._succ[slot] = succ  # so that rewriting ``key`` revives it

    def _revive_successor(self, slot: int) -> None:
        """A rewritten key brings its dead successor back to probation."""
        succ = self._succ[slot]
        succ_slot = self._slot(succ) if succ != NO_KEY else None
        if succ_slot is not None and self._slots.owner[succ_slot] == _DEAD:
            self._move(succ_slot, _PROBATION)

    # -- segments ----------------------------------------------------------------------

    def _use(self, slot: int, prev: int | None) -> None:
        """Handle a re-use: refresh main keys, promote probation and dead ones if admitted."""
        age = self._age(slot)
        self._last[slot] = self._clock & _M32
        if age > 0:
            gap = age if age <= _GAP_MAX else _GAP_MAX
            self._info[slot] = (gap << 1) | (self._info[slot] & _CONFIRMED)
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
        if prev is not None and self._chain_order and self._slots.owner[prev] == lst:
            self._slots.insert_before(prev, slot, lst)
        else:
            self._slots.append(lst, slot)

    def _place_oldest(self, slot: int, lst: int) -> None:
        """Link ``slot`` (a partial chunk) as the oldest of ``lst``, its last use
        that of the oldest key of all the lists: the recency merge
        (``recent_first``) yields it first, being as old and smaller."""
        self._seg_bytes[lst] += self._size[slot]
        heads = [h for h in map(self._slots.first, self._lists) if h is not None]
        if heads:
            self._last[slot] = self._last[max(heads, key=self._age)]
        head = self._slots.first(lst)
        if head is None:
            self._slots.append(lst, slot)
        else:
            self._slots.insert_before(head, slot, lst)

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
        if oldest is None or not self._lirs:
            return False
        age = self._age(oldest)
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
        near = (self._evictions - (record >> 2)) & _RECORD <= self._resident
        if not self._adapt or not near or not self._bytes:
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
        return gap > 0 and self._age(slot) > self._cold * gap

    def _age(self, slot: int) -> int:
        """Events since ``slot``'s last use (the column holds it modulo 2**32)."""
        return (self._clock - self._last[slot]) & _M32

    def _sweep(self) -> None:
        """One step of the sweep (see ``_KEEP``): ages past ``_KEEP`` in one chunk of
        the last-use column become ``_KEEP``; the next step is timed so that the
        pass ends within ``_SWEEP`` events. A chunk that needs no change is not
        written (a checkpoint's frozen chunk stays shared)."""
        column, clock = self._last, self._clock
        chunks = column.chunks
        c = self._sweep_next
        if c >= len(chunks):
            c, self._pass_end = 0, clock + _SWEEP
        chunk = chunks[c] if c < len(chunks) else None
        if chunk is not None:
            old = [i for i, t in enumerate(chunk) if (clock - t) & _M32 > _KEEP]
            base, floor = c << SHIFT, (clock - _KEEP) & _M32
            for i in old:
                column[base + i] = floor
        self._sweep_next = c + 1
        left = max(1, len(chunks) - c - 1)
        self._sweep_at = clock + max(1, (self._pass_end - clock) // left)

    def _wrap_lasts(self) -> None:
        """After loading an image: last uses modulo 2**32 (an earlier release kept
        them whole: an int64 chunk), and a new sweep pass at once if the clock has
        passed ``_KEEP``."""
        column, clock = self._last, self._clock
        for c, chunk in enumerate(column.chunks):
            if chunk is not None and chunk.typecode == "q":
                whole = [clock - min(max(clock - t, 0), _KEEP) for t in chunk]
                column.chunks[c] = narrowed(array("I", [t & _M32 for t in whole]), column.ladder)
                column.shared[c] = 0
        self._sweep_next, self._sweep_at = _IDLE, max(_KEEP, clock)

    def _cold_main(self) -> Iterator[int]:
        find = self._slots.find
        for key in self._slots.walk(_MAIN):
            if not self._is_cold(find(key)):  # type: ignore[arg-type]
                return
            yield key

    def _probation_excess(self) -> Iterator[int]:
        """Yield probation keys while main stays within its share after the eviction.

        The very expression of :meth:`_main_admits`, so that a key admitted to main
        because of free share is always followed by a probation eviction.
        """
        find, seg = self._slots.find, self._seg_bytes
        for key in self._slots.walk(_PROBATION):
            if not self._within_share(seg[_MAIN], self._size[find(key)]):  # type: ignore[index]
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
            array("q", map(table.key_of, slots)),
            array("q", map(self._last.__getitem__, slots)),
        )

    def _set_scalars(self, clock: int, horizon: int) -> None:
        self._clock, self._horizon = clock, horizon
        self._wrap_lasts()  # (the columns are loaded by now)

    def _extra_scalars(self) -> list[int]:
        # the adaptive thresholds too (floats as their int64 bit patterns)
        share, cold = img.float_bits(self._share), img.float_bits(self._cold)
        return [*self._seg_bytes, self._promotions, self._evictions, self._peak, share, cold]

    def _set_extra(self, values: list[int]) -> None:
        n = self._slot_lists
        if len(values) != n + 5:
            raise ValueError("policy image: wrong scalar count")
        self._seg_bytes = list(values[:n])
        self._promotions, self._evictions, self._peak = values[n : n + 3]
        share, cold = (img.bits_float(v) for v in values[n + 3 :])
        if not (0.0 <= share <= 1.0 and _COLD_MIN <= cold <= _COLD_MAX):
            raise ValueError("policy image: thresholds out of range")
        self._share, self._cold = share, cold

    def _restore(self, decoded: Image) -> None:
        # a version 1 image: per row ``_add`` + ``append``, then one new ghost slot
        # per first sighting of a ghost key, then the successors from the predecessors
        self._clock, self._horizon = decoded.clock, decoded.horizon
        table = self._slots
        pred, succ, last, info = self._pred, self._succ, self._last, self._info
        for lst, (keys, sizes, preds, lasts, flags) in zip(self._lists, decoded.lists, strict=True):
            slots = self._restore_list(lst, keys, sizes)
            self._seg_bytes[lst] += sum(sizes)
            for slot, p, t, f in zip(slots, preds, lasts, flags, strict=True):
                pred[slot] = p
                succ[slot] = NO_KEY  # _init_slot
                last[slot] = t
                info[slot] = f
        kept: dict[int, int] = {}
        for key, t in zip(decoded.ghost_keys, decoded.ghost_last, strict=True):
            if table.find(key) is None and key not in kept:  # a forged image repeats keys
                kept[key] = t
        slots = table.append_keys(_GHOST, array("q", kept))
        for slot, t in zip(slots, kept.values(), strict=True):
            pred[slot] = succ[slot] = NO_KEY
            last[slot] = t
        self._wrap_lasts()
        for keys, _sizes, preds, _lasts, _flags in decoded.lists:
            if not preds or max(preds) == NO_KEY:
                continue  # no learned chains in this list
            for p, key in zip(preds, keys, strict=True):
                if p != NO_KEY:
                    pred_slot = table.find(p)
                    if pred_slot is not None:
                        succ[pred_slot] = key
