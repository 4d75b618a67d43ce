"""The ghosts of gone files by name (``kvfs.evict.gone``): the same answers as a dict
with oldest-first trimming per table, through rebuilds, wide ghosts and re-puts."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvfs.evict.gone import _SHARD_MIN, SHARDS, GoneNames


def ghost_of(rng: random.Random, wide: bool) -> int:
    """Four 64-bit fields as ``take_ghost`` packs them; ``wide``: one over 32 bits."""
    fields = [rng.randrange(1 << 20) for _ in range(4)]
    if wide:
        fields[rng.randrange(4)] = rng.randrange(1 << 32, 1 << 64)
    return fields[0] | fields[1] << 64 | fields[2] << 128 | fields[3] << 192


class Model:
    """The contract, as a dict per table: oldest first, trimmed to the table's share."""

    def __init__(self) -> None:
        self.tables: dict[int, OrderedDict[int, int]] = {}

    def put(self, name: int, ghost: int, most: int) -> None:
        table = self.tables.setdefault(name % SHARDS, OrderedDict())
        table.pop(name, None)
        table[name] = ghost
        while len(table) > max(_SHARD_MIN, -(-most // SHARDS)):
            table.popitem(last=False)

    def pop(self, name: int) -> int | None:
        table = self.tables.get(name % SHARDS)
        return None if table is None else table.pop(name, None)

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables.values())


@pytest.mark.parametrize("seed", range(3))
def test_gone_names_answer_as_the_model_through_churn(seed: int) -> None:
    rng = random.Random(seed)
    gone, model = GoneNames(), Model()
    # few tables' worth of names (names sharing their low bits share a table), so
    # each table fills, trims, rebuilds and re-puts many times
    names = [rng.randrange(1 << 62) & ~(SHARDS - 1) | rng.randrange(4) for _ in range(3000)]
    most = 600 * SHARDS  # 600 per table, of ~750 names each
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


def test_gone_names_keep_the_newest_and_drop_the_oldest_of_a_table() -> None:
    gone = GoneNames()
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
