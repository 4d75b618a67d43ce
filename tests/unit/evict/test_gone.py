"""The ghosts of gone files by name (``kvfs.evict.gone``): the same answers as a dict
with oldest-first trimming (exact in one table, per table once split), through
rebuilds, wide ghosts, re-puts, the split, and a last-use clock past 32 bits."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvfs.evict.gone import _SHARD_MIN, SHARDS, SPLIT_AT, GoneNames, _Shard
from kvfs.evict.policy import make_policy


def ghost_of(rng: random.Random, wide: bool) -> int:
    """Four 64-bit fields as ``take_ghost`` packs them; ``wide``: one over 32 bits."""
    fields = [rng.randrange(1 << 20) for _ in range(4)]
    if wide:
        fields[rng.randrange(4)] = rng.randrange(1 << 32, 1 << 64)
    return fields[0] | fields[1] << 64 | fields[2] << 128 | fields[3] << 192


class Model:
    """The contract, as a dict per table: oldest first, trimmed to the bound (one
    table) or to the table's share of it (``split``: SHARDS tables)."""

    def __init__(self, split: bool) -> None:
        self.tables: dict[int, OrderedDict[int, int]] = {}
        self.split = split

    def put(self, name: int, ghost: int, most: int) -> None:
        table = self.tables.setdefault(name % SHARDS if self.split else 0, OrderedDict())
        table.pop(name, None)
        table[name] = ghost
        while len(table) > (max(_SHARD_MIN, -(-most // SHARDS)) if self.split else most):
            table.popitem(last=False)

    def pop(self, name: int) -> int | None:
        table = self.tables.get(name % SHARDS if self.split else 0)
        return None if table is None else table.pop(name, None)

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables.values())


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("split", [False, True], ids=["one-table", "split"])
def test_gone_names_answer_as_the_model_through_churn(seed: int, split: bool) -> None:
    rng = random.Random(seed)
    gone, model = GoneNames(), Model(split)
    # split: few tables' worth of names (names sharing their low bits share a table),
    # so each table fills, trims, rebuilds and re-puts many times
    tables = 4 if split else SHARDS
    names = [rng.randrange(1 << 62) & ~(SHARDS - 1) | rng.randrange(tables) for _ in range(3000)]
    most = 600 * SHARDS if split else 2400  # 600 per table, of ~750 names each
    for step in range(60_000):
        name = rng.choice(names)
        if rng.random() < 0.55:
            ghost = ghost_of(rng, wide=rng.random() < 0.05)
            gone.put(name, ghost, most)
            model.put(name, ghost, most)
        else:
            assert gone.pop(name) == model.pop(name), step
        assert len(gone) == len(model)
    assert len(model) > 1000  # the tables were full, not empty
    for name in names:
        assert gone.pop(name) == model.pop(name)
    assert len(gone) == 0


def test_gone_names_keep_exactly_the_newest_in_one_table() -> None:
    gone = GoneNames()
    names = [n * 7919 for n in range(1, 3001)]  # spread over the would-be tables
    for i, name in enumerate(names):
        gone.put(name, i, most=1024)
    assert len(gone) == 1024
    assert [gone.pop(n) for n in names[:-1024]] == [None] * (3000 - 1024)
    assert [gone.pop(n) for n in names[-1024:]] == list(range(3000 - 1024, 3000))


def test_gone_names_split_keeps_every_entry_and_its_age() -> None:
    gone = GoneNames()
    names = [n * 7919 for n in range(1, 10_001)]
    for i, name in enumerate(names):
        gone.put(name, i << 192 | i, most=SPLIT_AT)  # one table: all kept
    assert len(gone) == 10_000
    gone.put(1, 1, most=SPLIT_AT + 1)  # the split
    assert len(gone) == 10_001
    assert gone.pop(1) == 1
    assert [gone.pop(n) for n in names] == [i << 192 | i for i in range(10_000)]
    same_table = [k * SHARDS + 5 for k in range(1, 41)]
    for i, name in enumerate(same_table):  # after the split: a table's share
        gone.put(name, i, most=SPLIT_AT + 1)
    assert len(gone) == _SHARD_MIN  # this table's share (SPLIT_AT + 1 is 5 per table)
    assert [gone.pop(n) for n in same_table[-_SHARD_MIN:]] == list(range(40 - _SHARD_MIN, 40))


def test_gone_names_keep_the_newest_and_drop_the_oldest_of_a_table() -> None:
    gone = GoneNames()
    gone.put(0, 0, most=SPLIT_AT + 1)  # split from the start
    assert gone.pop(0) == 0
    same_table = [k * SHARDS + 7 for k in range(1, 101)]
    for i, name in enumerate(same_table):
        gone.put(name, i, most=50 * SHARDS)  # 50 per table
    assert len(gone) == 50
    assert [gone.pop(n) for n in same_table[:50]] == [None] * 50
    assert [gone.pop(n) for n in same_table[50:]] == list(range(50, 100))
    gone.put(same_table[0], 1, most=0)
    gone.put(same_table[1], 2, most=0)
    gone.put(same_table[0], 3, most=0)  # put again: the newest now
    assert len(gone) == 2  # below the table's least share, nothing dropped
    assert gone.pop(same_table[0]) == 3 and gone.pop(same_table[1]) == 2


def test_gone_names_refuse_what_they_cannot_hold() -> None:
    gone = GoneNames()
    for name, ghost in ((-1, 0), (1 << 63, 0), (1, -1), (1, 1 << 256)):
        with pytest.raises(ValueError):
            gone.put(name, ghost, 10)
    assert len(gone) == 0 and gone.pop(1) is None


def _wide_kept(gone: GoneNames) -> int:
    """Ghosts kept whole (beside the arrays, as Python ints: ~130 B each)."""
    return sum(len(shard._wide) for shard in gone._shards if shard is not None)


@pytest.mark.parametrize("split", [False, True], ids=["one-table", "split"])
def test_gone_names_stay_narrow_when_the_clock_passes_32_bits(split: bool) -> None:
    """A policy's last use is an event clock that passes 2**32 in a long-lived mount;
    the ghosts of files evicted then stay narrow and come back exact. A table's
    entries span ~2**31 events here (2000 of them, 2**20 apart on average): more
    than a window centred on the newest would hold."""
    rng = random.Random(7)
    gone, model = GoneNames(), Model(split)
    most = 500 * SHARDS if split else 2000  # split: 500 a table, in four tables
    clock = (1 << 32) - 5000
    recent: list[int] = []
    for step in range(30_000):
        clock += rng.randrange(1, 1 << 21)  # ~2**35 in all: past 32 bits eight times
        name = rng.randrange(1 << 62) & ~(SHARDS - 1) | rng.randrange(4)
        last = clock - rng.randrange(1 << 24)  # a last use up to a turnover ago
        ghost = rng.randrange(1 << 30) | last << 64 | rng.randrange(1 << 30) << 128  # field 3: 0
        gone.put(name, ghost, most)
        model.put(name, ghost, most)
        assert _wide_kept(gone) == 0, step
        recent = [*recent[-999:], name]
        if step % 7 == 0:
            victim = rng.choice(recent)
            assert gone.pop(victim) == model.pop(victim), step
    assert clock > 1 << 34
    assert len(gone) == len(model) > 1000
    assert _wide_kept(gone) == 0
    for table in list(model.tables.values()):
        for name in list(table):
            assert gone.pop(name) == model.pop(name)
    assert len(gone) == 0


def test_gone_names_keep_a_last_use_far_behind_the_newest_exactly() -> None:
    gone = GoneNames()
    old = 7 << 64 | 3  # last use 7
    gone.put(1, old, most=100)
    newer = [(n, (5 << 40) + n << 64 | n) for n in range(2, 50)]  # 2**42 events later
    for name, ghost in newer:
        gone.put(name, ghost, most=100)
    gone.put(1 << 40, (1 << 64) - 1 << 64, most=100)  # a last use of all ones: whole
    assert gone.pop(1) == old
    assert [gone.pop(n) for n, _ in newer] == [g for _, g in newer]
    assert gone.pop(1 << 40) == (1 << 64) - 1 << 64
    assert len(gone) == 0 and _wide_kept(gone) == 0


def test_a_table_index_takes_two_bytes_a_slot_until_its_positions_need_four() -> None:
    """A table's index holds array positions: 2 bytes a slot while the most a table
    may hold before its next rebuild fits them, 4 past that; every entry is found
    across the change."""
    shard = _Shard("I")
    rng = random.Random(7)
    keys = rng.sample(range(1 << 32), 60_000)
    codes = []
    for i, key in enumerate(keys):
        shard.put(key, i | (i + 1) << 64)
        codes.append(shard._index.typecode)
        assert shard._cap * 7 // 10 <= (0xFFFF if codes[-1] == "H" else 0xFFFFFFFF)
    assert codes[0] == "H" and codes[-1] == "I" and "H" in codes[50_000:]
    assert [shard.pop(key) for key in keys] == [i | (i + 1) << 64 for i in range(60_000)]


def test_a_ghost_is_kept_in_12_bytes_unless_a_successor_or_its_note_is_set() -> None:
    """A policy's ghost has field 3 (the loop expert's note) at 0, and field 2 (a
    successor to revive) almost always 0: it is kept in a 64-bit word, field 2 in a
    dict of the few that are not 0. One whose field 3 is set, or whose field 0 takes
    one of the low word's two marks, is kept whole, and every one comes back exact."""
    shard = _Shard("I")
    plain = [(k, k | (k + 9) << 64) for k in range(1, 2000)]
    chained = [(3000, 7 | 8 << 64 | 0xFFFFFFFF << 128), (3001, 1 | 2 << 64 | 5 << 128)]
    noted = [(1000 + k + 4000, k | k << 64 | k << 128 | (k + 1) << 192) for k in range(50)]
    marked = [(6000, 0xFFFFFFFE | 6 << 64), (6001, 0xFFFFFFFF | 6 << 64 | 3 << 128)]
    everything = plain + chained + noted + marked
    for key, ghost in everything:
        shard.put(key, ghost)
    assert shard._hi is None and shard._lo.itemsize == 8
    assert shard._his == {3000: 0xFFFFFFFF, 3001: 5}
    assert len(shard._wide) == len(noted) + len(marked)
    assert [shard.pop(k) for k, _ in everything] == [g for _, g in everything]
    assert not shard._wide and not shard._his and len(shard) == 0


@pytest.mark.parametrize("split", [False, True], ids=["one-table", "split"])
def test_successors_move_between_the_dict_and_an_array_and_stay_exact(split: bool) -> None:
    """Field 2 set in half the ghosts puts a table's high words in an array; when
    they are rare again, a rebuild puts them back in the dict; through churn and
    both moves every answer is the model's."""
    rng = random.Random(11)
    gone, model = GoneNames(), Model(split)
    tables = 2 if split else SHARDS
    names = [rng.randrange(1 << 62) & ~(SHARDS - 1) | rng.randrange(tables) for _ in range(4000)]
    most = 1500 * SHARDS if split else 3000
    shapes = []
    for share in (0.0, 0.5, 0.0, 0.02, 0.0):  # of the ghosts that carry a successor
        for step in range(15_000):
            name = rng.choice(names)
            if rng.random() < 0.6:
                ghost = rng.randrange(1 << 30) | rng.randrange(1 << 30) << 64
                if rng.random() < share:
                    ghost |= rng.randrange(1, 1 << 32) << 128
                gone.put(name, ghost, most)
                model.put(name, ghost, most)
            else:
                assert gone.pop(name) == model.pop(name), step
            assert len(gone) == len(model)
        shapes.append([s._hi is None for s in gone._shards if s is not None])
    assert all(shapes[0]) and not any(shapes[1]) and all(shapes[2]) and all(shapes[4])
    for name in names:
        assert gone.pop(name) == model.pop(name)
    assert len(gone) == 0


@pytest.mark.parametrize("policy", ["kvfs", "adaptive"])
def test_the_ghosts_a_policy_hands_over_are_kept_narrow(policy: str) -> None:
    """The ghosts the ghost-keeping policies hand over (``take_ghost`` after
    ``remove``, as ``Evictor.forget`` does) have field 3 at 0 and fit the narrow
    words, chained, re-used and cold ones alike: none is kept whole."""
    p = make_policy(policy)
    rng = random.Random(5)
    gone = GoneNames()
    for key in range(2000):  # chains on 8 streams, some re-read, the oldest evicted
        p.track(key, 1 << 20, key % 8)
        if rng.random() < 0.3:
            p.touch(rng.randrange(key + 1), key % 8)
        if key >= 500:
            victim = next(iter(p.victims()))
            p.remove(victim)
            ghost = p.take_ghost(victim)
            assert ghost is not None and ghost >> 192 == 0
            gone.put(victim, ghost, 1000)
    assert len(gone) == 1000 and _wide_kept(gone) == 0
