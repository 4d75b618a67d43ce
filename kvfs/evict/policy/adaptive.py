"""The adaptive policy ("adaptive", the default): follows the better of two experts.

Two experts see every event and keep their own order over the same resident keys:

- *recency*: :class:`~kvfs.evict.policy.prefix_lru.PrefixLRUPolicy` (LRU whose prompts
  leave deepest chunk first), the right order for chat-like traffic where what was
  used last is used next;
- *loop*: :class:`~kvfs.evict.policy.prefix.KvfsPolicy` without its dead-tails-first rule
  (the ablation in ``docs/eviction.md`` found it worth nothing and it evicts fresh
  files), which keeps a fixed subset of conversations when they come back after a
  round longer than the cache (multi-round QA), where LRU keeps none.

Eviction follows the expert whose *shadow* leads (:mod:`~kvfs.evict.policy.duel`):
each expert also runs alone as a small cache over a sample of the chunks, its hits
counted under the prefix rule, and the policy turns to the other expert only when
that one's decayed hit score is ``margin`` (1.5) times the followed one's. Until
issue 30 the choice was LeCaR's regret weights (Vietri et al., HotStorage '18),
which learn only from the real cache's misses and followed the loop expert into
4.5 points under LRU on docqa-mix-h; the shadows measure each expert on its own
(docs/eviction.md, "The adaptive policy follows shadow caches"). O(1) per event
for the experts, plus the shadows' O(1) work for a sampled chunk.

A chunk written again after its eviction is a new inode on a mount: the evictor
tells the policy each file's identity (its name's hash, ``identify``) before each
event, and the shadows key chunks by it, so a chunk that comes back after any gap
is the same chunk to them (an entry per sampled file only).

The recency expert's table has the loop expert's geometry (the same sentinels, its
list where the loop expert's probation is), so after a mount's bulk adoption both
hold the same links and owners; chunks that hold the same rows are one array,
copy-on-write for both (``slots.share_equal_chunks``: at adoption and recovery, and
a bounded number per checkpoint), and the second expert costs what has diverged.
Its sizes are the loop expert's (:class:`_LoopSizes`): its own size column stays 0,
a byte a key (until session 26 it kept them too, 4 B a key). So are its predecessors
(:class:`_LoopPreds`), but for the few keys whose predecessor the loop expert did not
learn (it was no resident then), kept in a dict: a byte a key, was 4 (session 27).

Persisted as a version 3 image of kind 3 in two tables (``docs/format.md``): table
0 the loop expert's (its lists and ghosts), table 1 the recency expert's, whose
scalars carry the shadows' scores as two shares (the image's two weights), the
eviction count and how often the policy turned to each expert (the two counters
that held LeCaR's regrets before). Shadows are not persisted: they restart empty
and the scores resume from the shares. Older images still load: LeCaR's (its
weights read as shares), the 0.3 release's one-piece version 1 adaptive image
(even shares), a ``kvfs`` image (adopted whole by the loop expert, the recency
expert taking its residents in order) and any other policy's residents.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterator
from itertools import chain

from kvfs.evict.policy.duel import HOLD, MARGIN, Duel
from kvfs.evict.policy.prefix import _GHOST, _PROBATION, KvfsPolicy
from kvfs.evict.policy.prefix_lru import PrefixLRUPolicy
from kvfs.evict.policy.protocol import Policy, PolicyStatistics
from kvfs.evict.slots import FREE, LOOSE, ROWS, SHIFT, SlotTable, share_equal_chunks
from kvfs.format import policy_image as img
from kvfs.format.policy_image import Image

RECENCY = 0
LOOP = 1
_LOOP_LISTS = 3
_RESUMED = 64.0  # scores a recovered policy resumes with (the shares times this)
_SHARE_STEP = 256  # chunks per column compared for sharing at each checkpoint
_RECENCY_LIST = 1  # the recency expert's list: where the loop expert's probation is
assert _RECENCY_LIST == _PROBATION


class _LoopSizes:
    """The recency expert's sizes, read from the loop expert's table: the two hold
    the same residents, and the adaptive policy tells the recency expert of each
    write and removal first, so a read sees the size the key had before it. Writes
    are dropped (the loop expert stores the same size)."""

    __slots__ = ("_keys", "_loop")

    def __init__(self, keys: SlotTable, loop: KvfsPolicy) -> None:
        self._keys, self._loop = keys, loop

    def __getitem__(self, slot: int) -> int:
        return self._loop.size_of(self._keys.key_of(slot))

    def __setitem__(self, slot: int, value: int) -> None:
        pass


class _LoopPreds:
    """The recency expert's predecessors (key + 1, 0: none), read from the loop
    expert's (key, -1: none): both learn a key's predecessor from the same events,
    but the loop expert only when that predecessor is resident
    (``KvfsPolicy._observe``), so the keys where the two differ are kept in ``odd``
    (none at the end of any trace of the suite, at most 0.6 % of the residents on
    the way: session 27). A write goes to ``odd`` until :meth:`settle`, which the
    adaptive policy calls once the loop expert has seen the same event; ``odd`` is
    not persisted (a recovered key's predecessor is the loop expert's)."""

    __slots__ = ("_keys", "_loop", "odd")

    def __init__(self, keys: SlotTable, loop: KvfsPolicy) -> None:
        self._keys, self._loop = keys, loop
        self.odd: dict[int, int] = {}

    def __getitem__(self, slot: int) -> int:
        key = self._keys.key_of(slot)
        value = self.odd.get(key)
        return self._of_loop(key) if value is None else value

    def __setitem__(self, slot: int, value: int) -> None:
        self.odd[self._keys.key_of(slot)] = value

    def _of_loop(self, key: int) -> int:
        slot = self._loop._slots.find(key)
        return 0 if slot is None else self._loop._pred[slot] + 1

    def settle(self, key: int) -> None:
        """Keep ``key``'s predecessor only if the loop expert's differs."""
        value = self.odd.pop(key, None)
        if value is not None and value != self._of_loop(key):
            self.odd[key] = value


class _Recency(PrefixLRUPolicy):
    """The recency expert: prefix-LRU in the loop expert's table geometry (four
    sentinels, its one list where the loop expert's probation is), so that the
    two tables' chunks can be one array while they agree; its image scalars carry
    the adaptive policy's own (``carried``). With ``loop``, its sizes and
    predecessors are the loop expert's (:class:`_LoopSizes`, :class:`_LoopPreds`):
    its own size and predecessor columns stay 0, a byte a key each."""

    _lists = (_RECENCY_LIST,)
    _slot_lists = 4
    _order = _RECENCY_LIST

    def __init__(self, partial_first: bool = True, loop: KvfsPolicy | None = None) -> None:
        self._loop = loop
        self._preds: _LoopPreds | None = None  # with ``loop``: its ``_pred``
        super().__init__(partial_first)
        self.carried: list[int] = []

    def reset(self) -> None:
        self.__init__(self.partial_first, self._loop)  # type: ignore[misc]

    def _bind_columns(self) -> None:
        super()._bind_columns()
        if self._loop is not None:
            self._size = _LoopSizes(self._slots, self._loop)  # type: ignore[assignment]
            self._preds = _LoopPreds(self._slots, self._loop)
            self._pred = self._preds  # type: ignore[assignment]

    def settle(self, key: int) -> None:
        """The loop expert has seen the event the recency expert just saw on ``key``."""
        if self._preds is not None:
            self._preds.settle(key)

    def remove(self, key: int) -> None:
        super().remove(key)
        if self._preds is not None:
            self._preds.odd.pop(key, None)

    def _restore(self, decoded: Image) -> None:
        super()._restore(decoded)
        self._settle_all()  # (the loop expert was restored first)

    def adopt(
        self, keys: array[int], sizes: array[int], spans: list[tuple[int, int]] | None = None
    ) -> None:
        super().adopt(keys, sizes, spans)
        self._settle_all()  # (the loop expert adopted them first)

    def _settle_all(self) -> None:
        if self._preds is not None:
            for key in list(self._preds.odd):
                self._preds.settle(key)

    def _adopt_fresh(
        self, keys: array[int], sizes: array[int], spans: list[tuple[int, int]] | None
    ) -> None:
        if self._loop is None:
            super()._adopt_fresh(keys, sizes, spans)
        else:
            self._slots.adopt_keys(self._lists[0], keys, [], spans)

    def forget_own(self) -> None:
        """Zero the own size and predecessor columns (an image of a release before
        session 26 kept the sizes there too, before session 27 the predecessors;
        the few of those that differed from the loop expert's are lost): a byte a
        key each again."""
        for column in self._slots.columns:
            for c, chunk in enumerate(column.chunks):
                if chunk is not None and chunk.count(0) != len(chunk):
                    column.chunks[c] = array(column.ladder[0], bytes(ROWS))
                    column.shared[c] = 0

    def _extra_scalars(self) -> list[int]:
        return self.carried

    def _set_extra(self, values: list[int]) -> None:
        self.carried = list(values)

    def follow(self, loop: KvfsPolicy) -> bool:
        """On a fresh table: hold ``loop``'s residents in its image order (its dead,
        probation then main lists, oldest first), built from its columns in
        O(chunks) at C level, its link chunks (and owner chunks where they agree)
        shared copy-on-write: what ``adopt`` of those keys in that order gives (a
        first mount, where the loop expert adopted the files into probation; a pool
        of the ``kvfs`` default upgraded to ``adaptive``). False (nothing changed)
        if its keys are mapped through a dict, or ``loop`` is not the expert whose
        sizes it reads."""
        source = loop._slots
        if loop is not self._loop or not source.direct or source.sparse_keys or self._slots.decided:
            return False
        table = SlotTable(self._slot_lists, self._columns)
        table.decided, table.direct = source.decided, source.direct
        table.sparse_base = source.sparse_base
        to_recency = bytearray(range(256))  # owner byte -> this table's owner
        for lst in loop._lists:
            to_recency[lst] = _RECENCY_LIST
        to_recency[_GHOST] = FREE & 0xFF
        loose = bytes([LOOSE & 0xFF])
        for c, owners in enumerate(source.owner.chunks):
            if owners is None:
                continue
            for column in table.columns:  # 0: the loop expert's sizes and predecessors
                column.ensure_row(c << SHIFT)
            raw = owners.tobytes()
            if loose in raw:
                return False  # (never between two calls; shared flags set are harmless)
            mine = raw.translate(to_recency)
            pairs = [(source.prev, table.prev), (source.next, table.next)]
            if mine == raw:
                pairs.append((source.owner, table.owner))
            else:
                table.owner.load(c, array("b", mine))
            for theirs, ours in pairs:  # the same array, copy-on-write for both
                chunk = theirs.chunks[c]
                assert chunk is not None
                ours.load(c, chunk)
                theirs.shared[c] = ours.shared[c] = 1
        for lst in range(self._slot_lists):  # the sentinels: empty lists
            table.owner[lst] = table.prev[lst] = table.next[lst] = lst
        tail = _RECENCY_LIST
        for lst in loop._lists:  # then one list: the loop's lists end to end
            if source.count[lst]:
                first, last = source.next[lst], source.prev[lst]
                table.next[tail], table.prev[first] = first, tail
                tail = last
        table.next[tail], table.prev[_RECENCY_LIST] = _RECENCY_LIST, tail
        table.count[_RECENCY_LIST] = len(loop)
        self._slots = table
        self._bind_columns()
        self._resident, self._bytes = len(loop), loop.statistics().bytes
        self._tracks = len(loop)  # as adopt() counts them
        return True


class AdaptivePolicy(Policy):
    """Follow the better of a recency and a loop-resistant expert (module docstring)."""

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
        self.loop = KvfsPolicy(without=frozenset({"dead-first"}))
        self.recency = _Recency(partial_first, self.loop)
        self._experts: tuple[PrefixLRUPolicy, KvfsPolicy] = (self.recency, self.loop)
        self.duel = Duel(
            (
                lambda: PrefixLRUPolicy(partial_first),
                lambda: KvfsPolicy(without=frozenset({"dead-first"})),
            ),
            prefix_rule,
            margin,
            hold,
        )
        self._chosen = RECENCY
        self._evictions = 0
        self._yielded = -1
        self.switches = [0, 0]  # how often the policy turned to each expert
        self._chunks: dict[int, int] = {}  # key -> its chunk's identity (sampled only)
        self._named = False  # identities are told (a mount): keys without one unsampled
        self._recovered: list[float] | None = None
        self._share_from = 0  # the next chunk the checkpoint's sharing pass compares

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
        self._resample(len(self.recency))
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
        resident, nbytes = len(self.recency), self.recency._bytes
        if key not in self.recency:  # (the cache's bytes once it is written)
            resident, nbytes = resident + 1, nbytes + size
        self._recovered = None
        self._resample(resident)
        chunk = self._chunk(key)
        if chunk is not None:
            self.duel.access(chunk, size, stream, resident, nbytes)
        for expert in self._experts:
            expert.track(key, size, stream)
        self._settle(key)

    def touch(self, key: int, stream: Hashable) -> None:
        """Record a read of a resident key (a mount also touches a file it is about
        to create: an unknown key is no access of a chunk)."""
        chunk = self._chunk(key) if key in self.recency else None
        if chunk is not None:
            self._recovered = None
            size = self.recency.size_of(key)
            self.duel.access(chunk, size, stream, len(self.recency), self.recency._bytes)
        for expert in self._experts:
            expert.touch(key, stream)
        self._settle(key)

    def _settle(self, key: int) -> None:
        """Both experts have seen an event on ``key`` (``_LoopPreds``; a recency expert
        of another kind, as ``tools/policy_lab.py`` puts in, keeps its own)."""
        if isinstance(self.recency, _Recency):
            self.recency.settle(key)

    def remove(self, key: int) -> None:
        """Forget ``key`` and its identity; the victim just yielded counts as an
        eviction."""
        if key == self._yielded and key in self.recency:
            self._evictions += 1
        self._chunks.pop(key, None)
        for expert in self._experts:
            expert.remove(key)

    def take_ghost(self, key: int) -> int | None:
        """The loop expert's ghost of ``key``."""
        return None if key in self.recency else self.loop.take_ghost(key)

    def put_ghost(self, key: int, ghost: int) -> None:
        """Restore what :meth:`take_ghost` handed over, under ``key``."""
        if key not in self.recency:
            self.loop.put_ghost(key, ghost)

    def victims(self) -> Iterator[int]:
        """The victims of the expert whose shadow leads (``Duel.leader``)."""
        chosen = self.duel.leader(self._chosen)
        if chosen != self._chosen:
            self._chosen = chosen
            self.switches[chosen] += 1
        for key in self._experts[chosen].victims():
            self._yielded = key
            yield key
        self._yielded = -1

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

    # -- sharing the experts' chunks ---------------------------------------------------

    def _share(self, first: int, count: int) -> None:
        """Make the recency expert's link and owner chunks ``first ..`` that equal
        the loop expert's the same arrays (copy-on-write for both)."""
        a, b = self.loop._slots, self.recency._slots
        for x, y in ((a.prev, b.prev), (a.next, b.next), (a.owner, b.owner)):
            share_equal_chunks(x, y, first, count)

    def _share_all(self) -> None:
        self._share(0, len(self.loop._slots.owner.chunks))

    # -- persistence -------------------------------------------------------------------

    def persist_pieces(self) -> Iterator[bytes]:
        """Freeze both experts now (O(chunks)) and return an iterator over the
        pieces of the two-table image (module docstring). First a bounded sharing
        pass over the next ``_SHARE_STEP`` chunks (a cursor through the table)."""
        chunks = len(self.loop._slots.owner.chunks)
        if self._share_from >= chunks:
            self._share_from = 0
        self._share(self._share_from, _SHARE_STEP)
        self._share_from += _SHARE_STEP
        self.recency.carried = [
            self._evictions,
            img.float_bits(self.weights[RECENCY]),
            img.float_bits(self.weights[LOOP]),
            *self.switches,
            self._chosen,
        ]
        loop = self.loop._pieces(self._kind, 0)
        recency = self.recency._pieces(self._kind, 1)
        return chain(loop, recency)

    def recover_pieces(self, pieces: list[bytes]) -> None:
        """Replace the state by the image ``persist_pieces`` gave (or a one-piece
        version 1 image of the 0.3 release); ValueError changes nothing."""
        if len(pieces) == 1 and img.version_of(pieces[0]) == 1:
            self._recover_v1(pieces[0])
            return
        loop = KvfsPolicy(without=self.loop.without)
        recency = _Recency(self.partial_first, loop)
        loop._load_pieces(pieces, self._kind, 0)
        recency._load_pieces(pieces, self._kind, 1, loop._slots)  # sharing as it reads
        recency.forget_own()
        carried = recency.carried
        if len(carried) not in (5, 6):  # (5: written before the expert followed was kept)
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
        if len(loop) != len(recency) or not _same_keys(loop, recency):
            raise ValueError("adaptive policy image: the experts hold different keys")
        self.reset()
        self.loop, self.recency = loop, recency
        self._experts = (recency, loop)
        self._evictions, self.switches = evictions, switches
        # the shadows restart empty; their scores resume as the persisted shares,
        # worth one floor turnover of hits, and the expert followed is the one the
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
        recency list, in one piece (weights and history were not kept)."""
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

    def resident_mask(self, n: int) -> bytes | None:
        """The residents (both experts hold the same keys)."""
        return self.recency.resident_mask(n)

    def adopt(
        self, keys: array[int], sizes: array[int], spans: list[tuple[int, int]] | None = None
    ) -> None:
        """``track(key, size, None)`` per key, oldest first: in bulk by each expert
        on a policy that never held a key (then their chunks are shared)."""
        if self.loop._slots.decided or self.recency._slots.decided:
            for key, size in zip(keys, sizes, strict=True):
                self.track(key, size, None)
            return
        self.loop.adopt(keys, sizes, spans)
        if not self.recency.follow(self.loop):
            self.recency.adopt(keys, sizes, spans)
            self._share_all()

    def recover_foreign(self, data: bytes) -> bool:
        """A ``kvfs`` image (the 0.2-0.3 default) restores the loop expert whole and
        a ``prefix-lru`` one the recency expert's order, the other expert taking the
        residents in that order; other kinds: both take the residents."""
        if img.kind_of(data) == img.KIND_KVFS:
            self.reset()
            try:
                self.loop.recover(data)
            except ValueError:
                self.reset()
                return False
            if not self.recency.follow(self.loop):
                order = array("q", self.loop.keys_in_image_order())
                self.recency.adopt(order, array("q", map(self.loop.size_of, order)))
            return True
        if img.kind_of(data) == img.KIND_PREFIX_LRU:
            source = PrefixLRUPolicy()
            try:
                source.recover(data)
            except ValueError:
                return False
        else:
            source = _Recency()
            if not source.recover_foreign(data):
                return False
        self.reset()
        order = array("q", source.victims())
        sizes = array("q", map(source.size_of, order))
        self.adopt(order, sizes)
        return True


def _same_keys(a: KvfsPolicy, b: PrefixLRUPolicy) -> bool:
    """Whether ``a`` and ``b`` hold the same keys: masks of one length where both
    can say at C speed (one table may have chunks that hold only ghosts)."""
    n = max(len(a._slots.owner.chunks), len(b._slots.owner.chunks)) << SHIFT
    masks = (a.resident_mask(n), b.resident_mask(n))
    if a._slots.direct and b._slots.direct and None not in masks:
        return masks[0] == masks[1]
    return a.keys() == b.keys()
