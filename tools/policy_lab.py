"""policy_lab: a pure-Python reference of candidate eviction orders, scored on the suite.

Not a kvfs policy (no slot table, no image, dicts per key): a lab bench for the
question of issue 30 -- which online order beats LRU on Mooncake's traces without
ever falling under it -- before anything is built into ``kvfs.evict.policy``.

The candidate here, ``DecayPolicy``, keeps per key a *decayed reference score*
(``s <- s * 2 ** (-age / H) + 1`` at each use, ``H`` = ``half`` x the resident key
count, in accesses: a use counts half as much one ``half`` cache turnovers later)
that survives an eviction as a ghost (the newest max(1024, resident) evictions).
The victim is the key with the smallest ``last use + H * log2(s)`` -- the score
decayed to now, compared without recomputing -- kept O(classes) per victim by
quantizing ``log2(s)`` into ``steps`` classes per doubling, one LRU list per class
(the head of each list is its smallest). Ties follow the chain: a key its stream
accesses right after its predecessor is filed just before it (the deepest chunk
of a prompt goes first, as in ``prefix-lru``). With ``partial`` a key smaller than
the largest tracked (a prompt's partial last block, which the next turn never
reads again) counts ``partial`` doublings less.

    .venv/bin/python tools/policy_lab.py --candidates "decay:half=0.5" "decay:half=1" \
        [--adaptive] [--mooncake DIR] [--traces a,b] [--sized]

``--sized`` gives a prompt's partial last block its share of a chunk's bytes (only
Mooncake's traces have such keys). ``--adaptive`` also scores the adaptive policy
with each candidate in place of its recency expert. Prints, per cell, LRU's token
hit rate and each candidate's difference to it, then each one's worst cell.
Exit codes: 0 success, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Hashable, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kvtrace
import traces

from kvfs.evict.policy import AdaptivePolicy, make_policy

_GHOSTS_MIN = 1024


class _Links:
    """A doubly linked list of keys (dicts), oldest first; ``None`` is the sentinel."""

    def __init__(self) -> None:
        self.prev: dict[Any, Any] = {None: None}
        self.next: dict[Any, Any] = {None: None}

    def insert_before(self, anchor: Any, key: int) -> None:
        before = self.prev[anchor]
        self.prev[key], self.next[key] = before, anchor
        self.next[before] = key
        self.prev[anchor] = key

    def unlink(self, key: int) -> None:
        before, after = self.prev.pop(key), self.next.pop(key)
        self.next[before] = after
        self.prev[after] = before

    def __iter__(self) -> Iterator[int]:
        key = self.next[None]
        while key is not None:
            after = self.next[key]
            yield key
            key = after


class DecayPolicy:
    """Decayed reference scores with ghosts, chain ties, optional partial-first."""

    name = "decay"

    def __init__(
        self, half: float = 0.5, steps: int = 2, classes: int = 8, partial: float | None = None
    ) -> None:
        if half <= 0 or steps < 1 or classes < 1:
            raise ValueError("half > 0, steps >= 1, classes >= 1")
        self.half, self.steps, self.classes, self.partial = half, steps, classes, partial
        self._lists = [_Links() for _ in range(classes + 1)]  # the last: partial keys
        self._state: dict[int, list[Any]] = {}  # key -> [score, last use, list, pred, size]
        self._ghosts: dict[int, tuple[float, int]] = {}  # key -> (score, last use)
        self._streams: dict[Hashable, int] = {}
        self._clock = 0
        self._full = 0
        self._bytes = 0  # the resident bytes

    def __contains__(self, key: object) -> bool:
        return key in self._state

    def __len__(self) -> int:
        return len(self._state)

    def _horizon(self) -> float:
        return max(len(self._state), 64) * self.half

    def _decayed(self, score: float, last: int) -> float:
        return float(score * 2.0 ** (-(self._clock - last) / self._horizon()))

    def _file(self, key: int, state: list[Any], stream: Hashable, new: bool) -> None:
        self._clock += 1
        anchor = None
        if stream is not None:
            prev = self._streams.get(stream)
            self._streams[stream] = key
            if prev is not None and prev != key:
                known = state[3] == prev
                state[3] = prev
                if new or known:
                    anchor = prev
        lst = min(self.classes - 1, int(math.log2(state[0]) * self.steps))
        if self.partial is not None and state[4] < self._full:
            lst = self.classes
        state[2] = lst
        other = self._state.get(anchor) if anchor is not None else None
        if other is not None and other[2] == lst:
            state[1] = other[1]
            self._lists[lst].insert_before(anchor, key)
        else:
            state[1] = self._clock
            self._lists[lst].insert_before(None, key)

    def track(self, key: int, size: int, stream: Hashable) -> None:
        if key in self._state:
            self._bytes += size - self._state[key][4]
            self._state[key][4] = size
            self.touch(key, stream)
            return
        ghost = self._ghosts.pop(key, None)
        score = 1.0 if ghost is None else self._decayed(*ghost) + 1.0
        self._full = max(self._full, size)
        state = [score, self._clock, 0, None, size]
        self._state[key] = state
        self._bytes += size
        self._file(key, state, stream, True)

    def touch(self, key: int, stream: Hashable) -> None:
        state = self._state.get(key)
        if state is None:
            return
        self._lists[state[2]].unlink(key)
        state[0] = self._decayed(state[0], state[1]) + 1.0
        self._file(key, state, stream, False)

    def remove(self, key: int) -> None:
        state = self._state.pop(key, None)
        if state is None:
            return
        self._bytes -= state[4]
        self._lists[state[2]].unlink(key)
        self._ghosts[key] = (state[0], state[1])
        while len(self._ghosts) > max(_GHOSTS_MIN, len(self._state)):
            del self._ghosts[next(iter(self._ghosts))]

    def size_of(self, key: int) -> int:
        return int(self._state[key][4])

    def keys(self) -> set[int]:
        return set(self._state)

    def victims(self) -> Iterator[int]:
        """Smallest ``last use + H * class / steps`` first (the heads of the lists)."""
        skipped: set[int] = set()
        while True:
            best, least = None, math.inf
            horizon = self._horizon()
            for lst, links in enumerate(self._lists):
                for key in links:
                    if key in skipped:
                        continue
                    rank = lst if lst < self.classes else -(self.partial or 0) * self.steps
                    value = self._state[key][1] + horizon * rank / self.steps
                    if value < least:
                        best, least = key, value
                    break
            if best is None:
                return
            yield best
            if best in self._state:
                skipped.add(best)


def with_recency(candidate: Callable[[], DecayPolicy]) -> AdaptivePolicy:
    """The adaptive policy with ``candidate`` as its recency expert and as that
    expert's shadow in the duel (which decides when the policy follows it)."""
    policy = AdaptivePolicy()
    policy.recency = candidate()
    policy.duel._makers = (candidate, policy.duel._makers[1])  # type: ignore[assignment]
    policy.duel.restart()
    return policy


def simulate_sized(
    trace: Sequence[kvtrace.Request], policy: Any, capacity: int, chunk: int
) -> kvtrace.SimResult:
    """``kvtrace.simulate`` where a partial last block takes its share of a chunk."""
    return kvtrace.simulate(trace, policy, capacity, chunk, sized=True)


def _candidate(spec: str) -> Callable[[], DecayPolicy]:
    kind, _, args = spec.partition(":")
    if kind != "decay":
        raise ValueError(f"unknown candidate {kind!r} (decay:half=..,steps=..,partial=..)")
    options: dict[str, float] = {}
    for item in filter(None, args.split(",")):
        name, _, value = item.partition("=")
        if name not in ("half", "steps", "classes", "partial"):
            raise ValueError(f"unknown option {name!r}")
        options[name] = float(value)
    for whole in ("steps", "classes"):
        if whole in options:
            options[whole] = int(options[whole])
    DecayPolicy(**options)  # type: ignore[arg-type]  # (validates)
    return lambda: DecayPolicy(**options)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--candidates", nargs="+", default=["decay:half=0.5"])
    ap.add_argument("--adaptive", action="store_true")
    ap.add_argument("--mooncake", type=Path, default=None)
    ap.add_argument("--traces", default="")
    ap.add_argument("--capacities", default="0.1,0.2,0.3,0.5")
    ap.add_argument("--sized", action="store_true")
    args = ap.parse_args(argv)
    try:
        policies: dict[str, Callable[[], Any]] = {"lru": lambda: make_policy("lru")}
        for spec in args.candidates:
            policies[spec] = _candidate(spec)
            if args.adaptive:
                policies[f"adaptive+{spec}"] = lambda made=policies[spec]: with_recency(made)
        fractions = [float(f) for f in args.capacities.split(",") if f]
    except ValueError as error:
        print(f"policy_lab: {error}", file=sys.stderr)
        return 2
    simulate = simulate_sized if args.sized else kvtrace.simulate
    names = [n for n in args.traces.split(",") if n] or None
    worst = dict.fromkeys(policies, math.inf)
    print("| trace | cap | lru | " + " | ".join(list(policies)[1:]) + " |")
    for trace in traces.suite(args.mooncake, names):
        chunks = kvtrace.footprint_chunks(trace.requests)
        for fraction in fractions:
            capacity = int(chunks * fraction) * 1000
            rate = {
                name: 100 * simulate(trace.requests, make(), capacity, 1000).hit_rate
                for name, make in policies.items()
            }
            cells = [f"{rate[name] - rate['lru']:+.1f}" for name in list(policies)[1:]]
            for name in policies:
                worst[name] = min(worst[name], rate[name] - rate["lru"])
            print(
                f"| {trace.name} | {fraction:.0%} | {rate['lru']:.1f} | " + " | ".join(cells) + " |"
            )
            sys.stdout.flush()
    print("| worst | | | " + " | ".join(f"{worst[n]:+.1f}" for n in list(policies)[1:]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
