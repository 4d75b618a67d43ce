"""The loop expert's event clock on a long-lived mount: last uses are kept modulo
2**32 (4 bytes a row, whatever the clock reads), ages stay exact up to 2**31 events
and never wrap (a sweep caps older ones), and images of an earlier release, whose
last uses were whole, load with their ages."""

from __future__ import annotations

import random

import pytest

from kvfs.evict.policy import prefix
from kvfs.evict.policy.adaptive import AdaptivePolicy
from kvfs.evict.policy.prefix import KvfsPolicy
from kvfs.format import policy_image as img
from tests.unit.evict.test_policy import order

SIZE = 1 << 20
KEYS = 3000  # three chunks of rows


def _loop(policy: KvfsPolicy | AdaptivePolicy) -> KvfsPolicy:
    return policy.loop if isinstance(policy, AdaptivePolicy) else policy


def _run(
    policy: KvfsPolicy | AdaptivePolicy, start: int, seed: int
) -> tuple[list[object], KvfsPolicy]:
    """A seeded workload of streams writing, rereading and evicting chains, ghosts
    handed over and back (as the evictor's gone table does) and one checkpoint and
    recovery, on a policy whose clock starts at ``start``; what it saw on the way, and
    its loop expert at the end."""
    rng = random.Random(seed)
    _loop(policy)._clock = start
    seen: list[object] = []
    handed: dict[int, int] = {}
    for step in range(12_000):
        key, stream = rng.randrange(2, KEYS), rng.randrange(8)
        if key in handed:
            policy.put_ghost(key, handed.pop(key))
        if rng.random() < 0.55:
            policy.track(key, SIZE * rng.randrange(1, 3), stream)
        else:
            policy.touch(key, stream)
        while len(policy) > KEYS // 3:
            victim = next(policy.victims())
            policy.remove(victim)
            if rng.random() < 0.3:
                ghost = policy.take_ghost(victim)
                if ghost is not None:
                    handed[victim] = ghost
        if step == 6000:
            data = b"".join(policy.persist_pieces())
            policy = type(policy)()
            policy.recover(data)
        if step % 500 == 0:
            loop = _loop(policy)
            seen.append((order(policy), loop._share, loop._cold, loop._horizon))
    loop = _loop(policy)
    table = loop._slots
    held = [table.find(key) for key in range(2, KEYS)]  # residents and ghosts
    seen.append([None if slot is None else loop._age(slot) for slot in held])
    return seen, loop


@pytest.mark.parametrize("kind", [KvfsPolicy, AdaptivePolicy])
def test_a_clock_past_2_to_the_32_decides_exactly_as_one_from_zero(kind: type) -> None:
    """The same events from a clock at 0 and from one that passes 2**32 half way
    give the same victims, thresholds and ages at every step, and the last-use
    column never holds an 8-byte chunk (it did: +4 B a file once past 2**32)."""
    early, _ = _run(kind(), 0, 5)
    seen, late = _run(kind(), (1 << 32) - 5000, 5)
    assert seen == early
    assert late._clock > 1 << 32
    codes = {chunk.typecode for chunk in late._last.chunks if chunk is not None}
    assert codes <= set("BHI"), codes


def test_ages_never_wrap_and_older_ones_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the clock's width scaled down to 16 bits (so that it wraps every 65 536
    events), keys unused for ever keep an age of at least the cap and never a
    small one, and every other key's age stays exact."""
    monkeypatch.setattr(prefix, "_M32", (1 << 16) - 1)
    monkeypatch.setattr(prefix, "_KEEP", 1 << 14)
    monkeypatch.setattr(prefix, "_SWEEP", 1 << 12)
    keep, most = 1 << 14, (1 << 14) + 3 * (1 << 12)
    policy = KvfsPolicy()
    rng = random.Random(11)
    last: dict[int, int] = {}
    for key in range(2, KEYS):
        policy.track(key, SIZE, None)
        last[key] = policy._clock
    slot = policy._slots.find
    for step in range(300_000):
        key = rng.randrange(1000, KEYS)
        policy.touch(key, rng.randrange(4))
        last[key] = policy._clock
        if step % 997 == 0:
            for k in (*range(2, 60), *rng.sample(range(1000, KEYS), 50)):
                true, age = policy._clock - last[k], policy._age(slot(k))  # type: ignore[arg-type]
                low, high = (true, true) if true <= keep else (keep, min(true, most))
                assert low <= age <= high, (k, true, age)
    assert policy._clock > 4 * (1 << 16)  # wrapped several times


def test_an_image_with_whole_last_uses_loads_with_its_ages() -> None:
    """An earlier release kept last uses whole (an int64 chunk past 2**32): its
    image loads into 4-byte chunks, each age as it was (capped at 2**31)."""
    old = KvfsPolicy()
    for key in range(2, KEYS):
        old.track(key, SIZE, key % 5)
    clock = old._clock = (1 << 40) + 12345
    ages = {key: (key * 7919) % (1 << 32) for key in range(2, KEYS)}
    ages[2], ages[3] = 0, (1 << 34)
    for key, age in ages.items():  # as the earlier release stored them
        old._last[old._slots.find(key)] = clock - age  # type: ignore[index]
    assert any(c is not None and c.typecode == "q" for c in old._last.chunks)
    images = [b"".join(old.persist_pieces()), old.persist_v1()]
    assert [img.version_of(data) for data in images] == [3, 1]
    for data in images:
        new = KvfsPolicy()
        new.recover(data)
        assert new._clock == clock
        assert {c.typecode for c in new._last.chunks if c is not None} <= set("BHI")
        got = {key: new._age(new._slots.find(key)) for key in ages}  # type: ignore[arg-type]
        assert got == {key: min(age, 1 << 31) for key, age in ages.items()}
        assert order(new) == order(old)
