"""The adaptive policy ("adaptive"): learns online which of two experts to follow.

Two experts see every event and keep their own order over the same resident keys:

- *recency*: :class:`~kvfs.policy.prefix_lru.PrefixLRUPolicy` (LRU whose prompts
  leave deepest chunk first), the right order for chat-like traffic where what was
  used last is used next;
- *loop*: :class:`~kvfs.policy.prefix.KvfsPolicy` without its dead-tails-first rule
  (the ablation in ``docs/eviction.md`` found it worth nothing and it evicts fresh
  files), which keeps a fixed subset of conversations when they come back after a
  round longer than the cache (multi-round QA), where LRU keeps none.

Eviction follows the expert with the larger weight. Learning is LeCaR's (Vietri et
al., HotStorage'18): every eviction is remembered (key, the expert that chose it,
the eviction count) in a history as long as the cache holds keys -- unless the
other expert's first victim was the same key: both would have evicted it, so a
later miss on it is nobody's regret (LeCaR's rule; without it the followed expert
collects all the regrets and the weights swing, landing between the experts).
When a remembered key is written again -- a miss the other expert might have
avoided -- the other expert's weight grows by
``exp(learning_rate * 0.005 ** (age / resident keys))`` (a regret that fades with
the time since the eviction), and the weights are normalised -- once per run of
rewrites of a stream: under the prefix rule the chunks after a missing one are
misses whatever is cached, so only the first rewrite after a hit is a mistake.
O(1) per event (each expert is), plus O(1) history work and a bounded look at the
other expert's order.

Persisted as one image of kind 3 (``docs/format.md``): the loop expert's three
lists and ghosts, then the recency expert's list; the weights and the history are
not persisted (they restart even).  A release-0.2 ``kvfs`` image is adopted whole
by the loop expert, the recency expert taking its residents in order.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterator

from kvfs.format import policy_image as img
from kvfs.format.policy_image import Image
from kvfs.policy import PolicyStatistics
from kvfs.policy.prefix import _STREAM_MEMORY, _U64, KvfsPolicy
from kvfs.policy.prefix_lru import PrefixLRUPolicy

RECENCY = 0
LOOP = 1
_HISTORY_MIN = 1024
_DISCOUNT = 0.005  # LeCaR: a regret one cache-turnover old counts 0.5 %
_LOOP_LISTS = 3
_PEEK = 64  # how far victims() looks into the other expert's order for agreement


class AdaptivePolicy:
    """Follow the better of a recency and a loop-resistant expert (module docstring)."""

    name = "adaptive"
    _kind = img.KIND_ADAPTIVE

    def __init__(self, learning_rate: float = 0.45) -> None:
        if learning_rate <= 0:
            raise ValueError("learning_rate must be > 0")
        self.learning_rate = learning_rate
        self.recency = PrefixLRUPolicy()
        self.loop = KvfsPolicy(without=frozenset({"dead-first"}))
        self._experts = (self.recency, self.loop)
        self.weights = [0.5, 0.5]
        self._history: OrderedDict[int, int] = OrderedDict()  # key -> evictions << 1 | expert
        self._evictions = 0
        self._yielded = -1
        self._agreed = False
        self._chosen = RECENCY
        self.regrets = [0, 0]
        self._missing: OrderedDict[Hashable, None] = OrderedDict()  # last access a write

    # -- verbs -----------------------------------------------------------------------

    def track(self, key: int, size: int, stream: Hashable) -> None:
        """Record a write; a write of a key evicted recently is a regret, unless the
        stream's previous access was a write too: under the prefix rule a chunk after
        a missing one is a miss whatever is cached, so a request's run of rewritten
        chunks is one mistake, not one per chunk (on a mount a batch of evictions
        takes a whole chain at once, and per-chunk regrets swung the weights)."""
        record = self._history.pop(key, None)
        after_miss = stream in self._missing
        self._missing[stream] = None
        self._missing.move_to_end(stream)
        if len(self._missing) > _STREAM_MEMORY:
            self._missing.popitem(last=False)
        if record is not None and key not in self.recency and not after_miss:
            self._regret(record)
        for expert in self._experts:
            expert.track(key, size, stream)

    def touch(self, key: int, stream: Hashable) -> None:
        """Record a read; a hit ends the stream's run of misses. (A mount also
        touches a file it is about to create: an unknown key ends nothing.)"""
        if key in self.recency:
            self._missing.pop(stream, None)
        for expert in self._experts:
            expert.touch(key, stream)

    def remove(self, key: int) -> None:
        """Forget ``key``; if it is the victim just yielded, remember the eviction."""
        if key == self._yielded and key in self.recency:
            self._evictions += 1
            if not self._agreed:
                self._history[key] = self._evictions << 1 | self._chosen
            while len(self._history) > max(_HISTORY_MIN, len(self.recency)):
                self._history.popitem(last=False)
        for expert in self._experts:
            expert.remove(key)

    def take_ghost(self, key: int) -> int | None:
        """The loop expert's ghost and the remembered eviction of ``key``, as one int."""
        if key in self.recency:
            return None
        record = self._history.pop(key, None)
        ghost = self.loop.take_ghost(key)
        if record is None and ghost is None:
            return None
        return (0 if ghost is None else ghost + 1) << 64 | (0 if record is None else record + 1)

    def put_ghost(self, key: int, ghost: int) -> None:
        """Restore what :meth:`take_ghost` handed over, under ``key``."""
        if key in self.recency or key in self._history:
            return
        record, loop = (ghost & _U64) - 1, (ghost >> 64) - 1
        if record >= 0:
            self._history[key] = record
        if loop >= 0:
            self.loop.put_ghost(key, loop)

    def victims(self) -> Iterator[int]:
        """The victims of the expert with the larger weight (ties: recency).

        Each key yielded is marked *agreed* when the other expert's first victim
        (passing over the keys the caller skipped) is the same key: both would
        have evicted it, so a later miss on it is nobody's regret (LeCaR)."""
        self._chosen = LOOP if self.weights[LOOP] > self.weights[RECENCY] else RECENCY
        other = self._experts[1 - self._chosen]
        skipped: set[int] = set()
        self._yielded = -1
        for key in self._experts[self._chosen].victims():
            if self._yielded in self.recency:  # the caller kept the previous key
                skipped.add(self._yielded)
            self._yielded = key
            self._agreed = _first_victim(other, skipped) == key
            yield key
        self._yielded = -1

    def remove_many(self, keys: Collection[int]) -> None:
        """``remove()`` each of ``keys`` in the order a fresh ``victims()`` lists them
        (one walk of the chosen expert's order, O(resident keys))."""
        for key in [k for k in self.victims() if k in keys]:
            self.remove(key)

    def __contains__(self, key: object) -> bool:
        return key in self.recency

    def __len__(self) -> int:
        return len(self.recency)

    def keys(self) -> set[int]:
        return self.recency.keys()

    def statistics(self) -> PolicyStatistics:
        """The loop expert's segments, this policy's name and counters."""
        loop = self.loop.statistics()
        return PolicyStatistics(
            name=self.name,
            keys=loop.keys,
            bytes=loop.bytes,
            probation_keys=loop.probation_keys,
            main_keys=loop.main_keys,
            main_bytes=loop.main_bytes,
            dead_keys=loop.dead_keys,
            ghost_keys=len(self._history),
            tracks=loop.tracks,
            touches=loop.touches,
            removes=loop.removes,
            promotions=loop.promotions,
            chain_links=loop.chain_links,
            horizon=loop.horizon,
        )

    def reset(self) -> None:
        self.__init__(self.learning_rate)  # type: ignore[misc]

    def _regret(self, record: int) -> None:
        """LeCaR's update: the expert that did not evict the key gains weight."""
        age = self._evictions - (record >> 1)
        reward = _DISCOUNT ** (age / max(len(self.recency), 1))
        other = 1 - (record & 1)
        self.regrets[record & 1] += 1
        self.weights[other] *= math.exp(self.learning_rate * reward)
        total = sum(self.weights)
        self.weights = [weight / total for weight in self.weights]

    # -- persistence -------------------------------------------------------------------

    def persist(self) -> bytes:
        """One image: the loop expert's lists and ghosts, then the recency list."""
        loop = img.decode(self.loop.persist_v1(), img.KIND_KVFS, _LOOP_LISTS)
        recency = img.decode(self.recency.persist_v1(), img.KIND_PREFIX_LRU, 1)
        lists = [*loop.lists, *recency.lists]
        return img.encode(
            self._kind, loop.clock, loop.horizon, lists, loop.ghost_keys, loop.ghost_last
        )

    def persist_pieces(self) -> Iterator[bytes]:
        """The image as one piece (encoded now: O(keys), as in the 0.2 release)."""
        return iter([self.persist()])

    def recover_pieces(self, pieces: list[bytes]) -> None:
        """``recover`` of the image ``persist_pieces`` gave."""
        self.recover(b"".join(pieces))

    def resident_mask(self, n: int) -> bytes | None:
        """The residents (both experts hold the same keys)."""
        return self.recency.resident_mask(n)

    def adopt(
        self, keys: array[int], sizes: array[int], spans: list[tuple[int, int]] | None = None
    ) -> None:
        """``track(key, size, None)`` per key, oldest first."""
        for key, size in zip(keys, sizes, strict=True):
            self.track(key, size, None)

    def recover(self, data: bytes) -> None:
        """Replace the state by an image of this policy; ValueError changes nothing."""
        decoded = img.decode(data, self._kind, _LOOP_LISTS + 1, orders=1)
        self.reset()
        loop = Image(
            decoded.clock,
            decoded.horizon,
            decoded.lists[:_LOOP_LISTS],
            decoded.ghost_keys,
            decoded.ghost_last,
        )
        self.loop._restore(loop)
        empty = decoded.ghost_keys[:0]
        self.recency._restore(Image(0, 0, decoded.lists[_LOOP_LISTS:], empty, empty))

    def recover_foreign(self, data: bytes) -> bool:
        """A ``kvfs`` image (the 0.2 default) restores the loop expert whole and a
        ``prefix-lru`` one the recency expert, the other expert taking the residents
        in that order; other kinds: both take the residents."""
        if img.kind_of(data) == img.KIND_KVFS:
            try:
                self.loop.recover(data)
            except ValueError:
                self.reset()
                return False
            self.recency.reset()
            for key in self.loop.keys_in_image_order():
                self.recency.track(key, self.loop.size_of(key), None)
            return True
        if img.kind_of(data) == img.KIND_PREFIX_LRU:
            try:
                self.recency.recover(data)
            except ValueError:
                self.reset()
                return False
        elif not self.recency.recover_foreign(data):
            return False
        self.loop.reset()
        for key in self.recency.victims():
            self.loop.track(key, self.recency.size_of(key), None)
        return True


def _first_victim(expert: KvfsPolicy | PrefixLRUPolicy, skipped: set[int]) -> int | None:
    """``expert``'s first victim not in ``skipped``; None if none within ``_PEEK``."""
    for index, key in enumerate(expert.victims()):
        if key not in skipped:
            return key
        if index >= _PEEK:
            break
    return None
