"""Shadow caches that say which expert the adaptive policy follows (set dueling).

Each expert also runs as a *shadow*: a cache of its own kind over a sample of the
chunks (chunk id ``% sample == 0``), holding ``1 / sample`` of the real cache's
bytes, fed every access of a sampled chunk the real policy sees. A shadow is a
counterfactual: it holds what that expert alone would hold, whatever the expert
being followed made the real cache hold. Its hits are counted under the prefix
rule -- a hit on a chunk that continues its stream's previous chunk counts only
if that chunk was a hit too (a chunk after a missing one is a miss whatever is
cached) -- into a score that decays by ``1/e`` per turnover of the shadow. The
adaptive policy follows the expert whose score leads by the margin (docs/eviction.md,
"The adaptive policy follows shadow caches"); ``hold`` can also ask the lead to have
lasted that many turnovers (the ablation "A lead that must last": 0, the default).

Why not regrets (LeCaR, the 0.4 release): regret weights learn from the misses of
the real cache, which the followed expert shaped; on docqa-mix-h they followed the
loop expert into -4.5 points under LRU. Shadows measure each expert on its own.

Memory: the sample keeps each shadow near ``SHADOW_KEYS`` keys or fewer (``sample``
doubles, and the shadows restart, as the cache doubles past it): a few MiB
whatever the pool, nothing per file. Shadows are not persisted; the scores are
(the adaptive policy's two weights).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable

from kvfs.evict.policy.base import LinkedPolicy

SHADOW_KEYS = 1 << 15
"""A shadow holds about this many keys at most (the sample doubles past twice it)."""
MARGIN = 1.5
"""The followed expert changes only when the other's score is this many times its
own: on QA loops the loop expert's shadow hits 2-3 times as often as recency's, on
chat and document traffic they are within a few per cent. The rule that picks it:
the smallest margin of the ablation (1.0, 1.25, 1.5, 2.0) at which no cell of the
suite, unsized or sized, falls more than 0.3 point under LRU. 1.25 passes unsized
but is 0.95 under LRU sized at mooncake-synthetic 20 % (docs/eviction.md,
"Session 32")."""
STREAM_MEMORY = 4096
"""Streams whose last sampled chunk is remembered (the oldest forgotten first)."""
HOLD = 0.0
"""Turnovers (the shadow's keys in sampled accesses) the other expert's lead by the
margin must have lasted before the policy follows it. 0: measured, a hold of one
turnover lifts mooncake-synthetic 10 % from -0.35 to +0.39 points over LRU, but half
a turnover takes it to -1.01 and either costs the QA traces up to 2 points
(docs/eviction.md, "A lead that must last"): not a rule that generalizes."""
_FLOOR = 64  # keys: the smallest turnover the scores decay over


class Duel:
    """Two shadow caches, their prefix-rule hit scores, and the sample."""

    def __init__(
        self,
        makers: tuple[Callable[[], LinkedPolicy], Callable[[], LinkedPolicy]],
        prefix_rule: bool = True,
        margin: float = MARGIN,
        hold: float = HOLD,
    ) -> None:
        self._makers = makers
        self.prefix_rule = prefix_rule
        """Count a hit that continues a chain only if the chain's previous chunk hit
        (off: every hit counts; the ablation in docs/eviction.md)."""
        self.margin = margin
        self.hold = hold
        self.held = [0, 0]
        """Sampled accesses over which each expert's score has been ``margin`` times
        the other's without a break (not persisted: a recovered policy keeps the
        expert its image names until a lead lasts again)."""
        self._turnover = _FLOOR  # the shadows' turnover at the last sampled access
        self.sample = 1
        self.scores = [0.0, 0.0]
        self.shadows: list[LinkedPolicy] = []
        self.restart()

    def restart(self) -> None:
        """Empty shadows (the scores are kept)."""
        self.shadows = [make() for make in self._makers]
        self._pred: OrderedDict[int, int] = OrderedDict()  # sampled id -> predecessor
        self._last: OrderedDict[Hashable, int] = OrderedDict()  # stream -> last sampled id
        self._intact: list[dict[Hashable, bool]] = [{}, {}]  # stream -> prefix still hit

    def resize(self, resident: int) -> None:
        """Sample coarser while the cache holds more than twice ``SHADOW_KEYS`` keys
        per sampled one (shadows restart); never finer."""
        sample = self.sample
        while resident > 2 * SHADOW_KEYS * sample:
            sample *= 2
        if sample != self.sample:
            self.sample = sample
            self.restart()

    def access(self, chunk: int, size: int, stream: Hashable, resident: int, nbytes: int) -> None:
        """Chunk id ``chunk`` (``size`` bytes) was read or written by ``stream``; the
        real cache holds ``resident`` keys, ``nbytes`` bytes."""
        if chunk % self.sample:
            return
        key = chunk // self.sample
        self._turnover = turnover = max(resident // self.sample, _FLOOR)
        fade = math.exp(-1.0 / turnover)
        self.scores = [score * fade for score in self.scores]
        prev = self._last.pop(stream, None)
        self._last[stream] = key
        if len(self._last) > STREAM_MEMORY:
            gone = self._last.popitem(last=False)[0]
            for intact in self._intact:
                intact.pop(gone, None)
        pred = self._pred.get(key)
        if pred is None:
            self._pred[key] = pred = -1 if prev is None else prev
            if len(self._pred) > 2 * SHADOW_KEYS:
                self._pred.popitem(last=False)
        continues = self.prefix_rule and prev is not None and pred == prev
        capacity = max(nbytes // self.sample, size)
        for i, shadow in enumerate(self.shadows):
            hit = key in shadow
            counted = hit and (not continues or self._intact[i].get(stream, False))
            self._intact[i][stream] = counted
            if counted:
                self.scores[i] += 1.0
            if hit:
                shadow.touch(key, stream)
                continue
            shadow.track(key, size, stream)
            while shadow._bytes > capacity:
                victim = next((k for k in shadow.victims() if k != key), None)
                if victim is None:
                    break
                shadow.remove(victim)
        for i in (0, 1):
            ahead = self.scores[i] > self.margin * self.scores[1 - i]
            self.held[i] = self.held[i] + 1 if ahead else 0

    def ahead(self, current: int) -> int:
        """The other expert if its score is ``margin`` times ``current``'s, else
        ``current`` (however long the lead has lasted: a recovered image's choice)."""
        other = 1 - current
        return other if self.scores[other] > self.margin * self.scores[current] else current

    def leader(self, current: int) -> int:
        """The expert to follow: the other one once its lead by the margin has
        lasted ``hold`` turnovers (and holds now), else ``current``."""
        other = self.ahead(current)
        if other != current and self.held[other] >= self.hold * self._turnover:
            return other
        return current
