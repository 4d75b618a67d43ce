"""The adaptive policy ("adaptive", the default): follows the better of two orders.

One table (:class:`~kvfs.evict.policy.prefix.KvfsPolicy` without its dead-tails-first
rule: the ablation in ``docs/eviction.md`` found it worth nothing and it evicts fresh
files) sees every event and gives two eviction orders over the same resident keys:

- *loop*: its own (``KvfsPolicy.victims``), which keeps a fixed subset of
  conversations when they come back after a round longer than the cache
  (multi-round QA), where LRU keeps none;
- *recency*: its lists merged by last use (``KvfsPolicy.recent_first``), each list's
  chain filing kept (a prompt leaves deepest chunk first; a run of writes that no
  read began is filed like LRU; a prompt's partial last chunk is filed older than
  any key, so it leaves first), the right order for chat-like traffic where what
  was used last is used next.

Eviction follows the order whose *shadow* leads (:mod:`~kvfs.evict.policy.duel`):
each expert also runs alone as a small cache over a sample of the chunks, its hits
counted under the prefix rule, and the policy turns to the other order only when
that one's decayed hit score is ``margin`` (1.5) times the followed one's. The
recency shadow is :class:`~kvfs.evict.policy.prefix_lru.PrefixLRUPolicy` (LRU whose
prompts leave deepest chunk first, a prompt's partial last chunk first): it measures
how a recency order does on the traffic, and the merged order is what the real cache
follows for it. Until session 29 a second table held that prefix-LRU order for every
resident (11.4 B a file at 10^7, its links and list byte); the suite measured the
merged order never more than 0.04 point under LRU unsized where the two-table policy
was 0.35 under (docs/eviction.md, "Session 29"). Until
issue 30 the choice was LeCaR's regret weights (Vietri et al., HotStorage '18),
which learn only from the real cache's misses and followed the loop expert into
4.5 points under LRU on docqa-mix-h; the shadows measure each expert on its own.
O(1) per event for the table, plus the shadows' O(1) work for a sampled chunk.

A chunk written again after its eviction is a new inode on a mount: the evictor
tells the policy each file's identity (its name's hash, ``identify``) before each
event, and the shadows key chunks by it, so a chunk that comes back after any gap
is the same chunk to them (an entry per sampled file only).

Persisted as a version 3 image of kind 3 in two tables (``docs/format.md``): table
0 the loop expert's (its lists and ghosts), table 1 no keys since session 29, only
its scalars: the shadows' scores as two shares (the image's two weights), the
eviction count, how often the policy turned to each order and the one followed.
An earlier image's table 1 held the recency expert's order: it is read for its
scalars and its keys dropped. Shadows are not persisted: they restart empty and the
scores resume from the shares. Older images still load: LeCaR's (its weights read as
shares), the 0.3 release's one-piece version 1 adaptive image (even shares), a
``kvfs`` image (adopted whole) and any other policy's residents.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterator
from itertools import chain
from typing import Any

from kvfs.evict.policy.duel import HOLD, MARGIN, Duel
from kvfs.evict.policy.prefix import _PROBATION, KvfsPolicy
from kvfs.evict.policy.prefix_lru import PrefixLRUPolicy
from kvfs.evict.policy.protocol import Policy, PolicyStatistics
from kvfs.format import policy_image as img
from kvfs.format.policy_image import Image

RECENCY = 0
LOOP = 1
_LOOP_LISTS = 3
_RESUMED = 64.0  # scores a recovered policy resumes with (the shares times this)


class _Scalars(PrefixLRUPolicy):
    """Table 1 of the image: the geometry of the recency expert's table before
    session 29 (four sentinels, one list where the loop expert's probation is), no
    key since, its scalars carrying the adaptive policy's own (``carried``). Reading
    an earlier image's table 1 loads its keys too; the adaptive policy keeps only
    the scalars."""

    _lists = (_PROBATION,)
    _slot_lists = 4
    _order = _PROBATION

    def __init__(self) -> None:
        super().__init__()
        self.carried: list[int] = []

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def _extra_scalars(self) -> list[int]:
        return self.carried

    def _set_extra(self, values: list[int]) -> None:
        self.carried = list(values)


class AdaptivePolicy(Policy):
    """Follow the better of a recency and a loop-resistant order (module docstring)."""

    name = "adaptive"
    _kind = img.KIND_ADAPTIVE

    def __init__(
        self,
        margin: float = MARGIN,
        prefix_rule: bool = True,
        hold: float = HOLD,
        partial_first: bool = True,
    ) -> None:
        if margin < 1.0:
            raise ValueError("margin must be >= 1")
        if hold < 0.0:
            raise ValueError("hold must be >= 0")
        self.margin = margin
        self.prefix_rule = prefix_rule
        self.hold = hold
        self.partial_first = partial_first
        # the loop expert (without its dead-tails-first rule) and the shadow of it
        without = frozenset({"dead-first"} if partial_first else {"dead-first", "partial-first"})
        self.loop = KvfsPolicy(without=without)
        self.recency: Any = None
        """A recency expert of its own, told every event, whose victims are the
        recency order (``tools/policy_lab.py`` puts its candidates here); None: the
        loop expert's lists merged by last use (``KvfsPolicy.recent_first``)."""
        self.duel = Duel(
            (
                lambda: PrefixLRUPolicy(partial_first),
                lambda: KvfsPolicy(without=without),
            ),
            prefix_rule,
            margin,
            hold,
        )
        self._chosen = RECENCY
        self._evictions = 0
        self._yielded = -1
        self.switches = [0, 0]  # how often the policy turned to each order
        self._chunks: dict[int, int] = {}  # key -> its chunk's identity (sampled only)
        self._named = False  # identities are told (a mount): keys without one unsampled
        self._recovered: list[float] | None = None

    @property
    def weights(self) -> list[float]:
        """The shadows' scores as shares (persisted; even before any hit; exactly
        the recovered ones until the next access)."""
        if self._recovered is not None:
            return list(self._recovered)
        total = sum(self.duel.scores)
        if total <= 0.0:
            return [0.5, 0.5]
        return [max(score / total, 1e-9) for score in self.duel.scores]

    # -- verbs -----------------------------------------------------------------------

    def identify(self, key: int, chunk: int) -> None:
        """Key the shadows' view of ``key`` by ``chunk`` (kept only for a sampled
        chunk: ``_chunk`` answers None, no shadow access, for the others). Once a
        policy is told any identity, keys never identified are not sampled."""
        self._named = True
        self._resample(len(self.loop))
        if chunk % self.duel.sample == 0:
            self._chunks[key] = chunk
        else:
            self._chunks.pop(key, None)

    def _resample(self, resident: int) -> None:
        """The shadows' sample for a cache of ``resident`` keys (``Duel.resize``);
        when it grows, the identities it no longer samples are forgotten, so they
        stay about ``resident / sample`` (at most ~2 * ``SHADOW_KEYS``) whatever
        the keys told under a finer sample (a pool filling up, reads after a
        remount before the first write). They were never fed to a shadow again."""
        sample = self.duel.sample
        self.duel.resize(resident)
        if self.duel.sample != sample:
            sample = self.duel.sample
            self._chunks = {k: c for k, c in self._chunks.items() if c % sample == 0}

    def _chunk(self, key: int) -> int | None:
        """The chunk id the shadows see for ``key``: its identity on a mount (None
        if unsampled or unknown), the key itself in a simulation (content keys)."""
        if self._named:
            return self._chunks.get(key)
        return key

    def track(self, key: int, size: int, stream: Hashable) -> None:
        """Record a write (the shadows see it first, at the cache's size before it)."""
        resident, nbytes = len(self.loop), self.loop._bytes
        if key not in self.loop:  # (the cache's bytes once it is written)
            resident, nbytes = resident + 1, nbytes + size
        self._recovered = None
        self._resample(resident)
        chunk = self._chunk(key)
        if chunk is not None:
            self.duel.access(chunk, size, stream, resident, nbytes)
        if self.recency is not None:
            self.recency.track(key, size, stream)
        self.loop.track(key, size, stream)

    def touch(self, key: int, stream: Hashable) -> None:
        """Record a read of a resident key (a mount also touches a file it is about
        to create: an unknown key is no access of a chunk)."""
        chunk = self._chunk(key) if key in self.loop else None
        if chunk is not None:
            self._recovered = None
            size = self.loop.size_of(key)
            self.duel.access(chunk, size, stream, len(self.loop), self.loop._bytes)
        if self.recency is not None:
            self.recency.touch(key, stream)
        self.loop.touch(key, stream)

    def remove(self, key: int) -> None:
        """Forget ``key`` and its identity; the victim just yielded counts as an
        eviction."""
        if key == self._yielded and key in self.loop:
            self._evictions += 1
        self._chunks.pop(key, None)
        if self.recency is not None:
            self.recency.remove(key)
        self.loop.remove(key)

    def take_ghost(self, key: int) -> int | None:
        """The loop expert's ghost of ``key``."""
        return None if key in self.loop else self.loop.take_ghost(key)

    def put_ghost(self, key: int, ghost: int) -> None:
        """Restore what :meth:`take_ghost` handed over, under ``key``."""
        if key not in self.loop:
            self.loop.put_ghost(key, ghost)

    def victims(self) -> Iterator[int]:
        """The victims of the order whose shadow leads (``Duel.leader``)."""
        chosen = self.duel.leader(self._chosen)
        if chosen != self._chosen:
            self._chosen = chosen
            self.switches[chosen] += 1
        if chosen == LOOP:
            order = self.loop.victims()
        elif self.recency is not None:
            order = self.recency.victims()
        else:
            order = self.loop.recent_first()
        for key in order:
            self._yielded = key
            yield key
        self._yielded = -1

    def __contains__(self, key: object) -> bool:
        return key in self.loop

    def __len__(self) -> int:
        return len(self.loop)

    def keys(self) -> set[int]:
        return self.loop.keys()

    def size_of(self, key: int) -> int:
        """The size of resident ``key`` (0 if it is not resident)."""
        return self.loop.size_of(key)

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
            ghost_keys=loop.ghost_keys,
            tracks=loop.tracks,
            touches=loop.touches,
            removes=loop.removes,
            promotions=loop.promotions,
            chain_links=loop.chain_links,
            horizon=loop.horizon,
        )

    def reset(self) -> None:
        self.__init__(self.margin, self.prefix_rule, self.hold, self.partial_first)  # type: ignore[misc]

    # -- persistence -------------------------------------------------------------------

    def persist_pieces(self) -> Iterator[bytes]:
        """Freeze the table now (O(chunks)) and return an iterator over the pieces
        of the two-table image (module docstring)."""
        scalars = _Scalars()
        scalars.carried = [
            self._evictions,
            img.float_bits(self.weights[RECENCY]),
            img.float_bits(self.weights[LOOP]),
            *self.switches,
            self._chosen,
        ]
        return chain(self.loop._pieces(self._kind, 0), scalars._pieces(self._kind, 1))

    def recover_pieces(self, pieces: list[bytes]) -> None:
        """Replace the state by the image ``persist_pieces`` gave (or a one-piece
        version 1 image of the 0.3 release); ValueError changes nothing."""
        if len(pieces) == 1 and img.version_of(pieces[0]) == 1:
            self._recover_v1(pieces[0])
            return
        loop = KvfsPolicy(without=self.loop.without)
        loop._load_pieces(pieces, self._kind, 0)
        table1 = _Scalars()
        table1._load_pieces(pieces, self._kind, 1)  # (an earlier image's keys: dropped)
        carried = table1.carried
        del table1
        if len(carried) not in (5, 6):  # (5: written before the order followed was kept)
            raise ValueError("adaptive policy image: wrong scalar count")
        evictions, w_recency, w_loop, *switches = carried[:5]
        followed = carried[5] if len(carried) == 6 else None
        weights = [img.bits_float(w_recency), img.bits_float(w_loop)]
        if (
            not all(0.0 < w <= 1.0 for w in weights)
            or evictions < 0
            or min(switches) < 0
            or followed not in (None, RECENCY, LOOP)
        ):
            raise ValueError("adaptive policy image: scalars out of range")
        self.reset()
        self.loop = loop
        self._evictions, self.switches = evictions, switches
        # the shadows restart empty; their scores resume as the persisted shares,
        # worth one floor turnover of hits, and the order followed is the one the
        # image names (an older image: the leader)
        self.duel.scores = [w * _RESUMED for w in weights]
        self._recovered = weights
        self._chosen = self.duel.ahead(RECENCY) if followed is None else followed

    def recover(self, data: bytes) -> None:
        """Replace the state by an image of this policy; ValueError changes nothing."""
        if img.version_of(data) == 1:
            self._recover_v1(data)
        else:
            self.recover_pieces(img.split_pieces(data))

    def _recover_v1(self, data: bytes) -> None:
        """The 0.3 release's image: the loop expert's lists and ghosts, then the
        recency list, in one piece (weights and history were not kept); the
        recency list is dropped."""
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

    def resident_mask(self, n: int) -> bytes | None:
        """The residents (the loop expert's)."""
        return self.loop.resident_mask(n)

    def adopt(
        self, keys: array[int], sizes: array[int], spans: list[tuple[int, int]] | None = None
    ) -> None:
        """``track(key, size, None)`` per key, oldest first: in bulk by the loop
        expert on a policy that never held a key."""
        if self.recency is not None or self.loop._slots.decided:
            for key, size in zip(keys, sizes, strict=True):
                self.track(key, size, None)
            return
        self.loop.adopt(keys, sizes, spans)

    def recover_foreign(self, data: bytes) -> bool:
        """A ``kvfs`` image (the 0.2-0.3 default) restores the loop expert whole; a
        ``prefix-lru`` one and other kinds: the residents adopted in their order."""
        if img.kind_of(data) == img.KIND_KVFS:
            self.reset()
            try:
                self.loop.recover(data)
            except ValueError:
                self.reset()
                return False
            return True
        source = PrefixLRUPolicy()
        if img.kind_of(data) == img.KIND_PREFIX_LRU:
            try:
                source.recover(data)
            except ValueError:
                return False
        elif not source.recover_foreign(data):
            return False
        self.reset()
        order = array("q", source.victims())
        sizes = array("q", map(source.size_of, order))
        self.adopt(order, sizes)
        return True
