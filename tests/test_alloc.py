"""Unit tests of kvfs.alloc: invariants after seeded random operations, placement."""

from __future__ import annotations

import random

import pytest

from kvfs.alloc import Allocator
from kvfs.errors import NoSpace

Unit = tuple[int, int]


def used_in_maps(alloc: Allocator, sizes: list[int]) -> set[Unit]:
    return {(d, u) for d, n in enumerate(sizes) for u in range(n) if alloc.is_used(d, u)}


def free_runs(sizes: list[int], used: set[Unit], dev: int) -> list[int]:
    runs, cur = [], 0
    for u in range(sizes[dev]):
        if (dev, u) in used:
            if cur:
                runs.append(cur)
            cur = 0
        else:
            cur += 1
    if cur:
        runs.append(cur)
    return runs


def check_invariants(alloc: Allocator, sizes: list[int], model: set[Unit]) -> None:
    assert used_in_maps(alloc, sizes) == model
    assert alloc.free_units == sum(sizes) - len(model)
    for d in range(len(sizes)):
        assert alloc.device_free(d) == sizes[d] - sum(1 for dd, _ in model if dd == d)
    stats = alloc.statistics()
    runs = [r for d in range(len(sizes)) for r in free_runs(sizes, model, d)]
    assert (stats.total_units, stats.free_units) == (sum(sizes), alloc.free_units)
    assert (stats.free_runs, stats.largest_free_run) == (len(runs), max(runs, default=0))


@pytest.mark.parametrize("seed", range(6))
def test_random_allocate_and_free_keep_the_maps_consistent(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.randrange(1, 300) for _ in range(rng.randrange(1, 4))]
    alloc = Allocator(sizes)
    model: set[Unit] = set()
    owned: list[list[tuple[int, int, int]]] = []
    for _ in range(400):
        if owned and rng.random() < 0.45:
            runs = owned.pop(rng.randrange(len(owned)))
            for d, start, n in runs:
                alloc.free(d, start, n)
                model -= {(d, start + i) for i in range(n)}
        else:
            count = rng.randrange(1, 40)
            dev = rng.randrange(len(sizes))
            largest = max(max(free_runs(sizes, model, d), default=0) for d in range(len(sizes)))
            free_before = alloc.free_units
            if count > free_before:
                with pytest.raises(NoSpace):
                    alloc.allocate(count, dev)
                continue
            runs = alloc.allocate(count, dev, near=rng.randrange(-1, sizes[dev] + 5))
            assert sum(n for _, _, n in runs) == count
            if largest >= count:
                assert len(runs) == 1, "contiguous space existed but the request was split"
            else:
                assert len(runs) > 1
            for d, start, n in runs:
                assert n >= 1 and start >= 0 and start + n <= sizes[d]
                new = {(d, start + i) for i in range(n)}
                assert not new & model, "a unit was handed out twice"
                model |= new
            owned.append(runs)
        check_invariants(alloc, sizes, model)


def test_prefers_the_requested_device_then_the_others() -> None:
    alloc = Allocator([10, 10, 10])
    assert alloc.allocate(4, 1) == [(1, 0, 4)]
    assert alloc.allocate(6, 1) == [(1, 4, 6)]
    (run,) = alloc.allocate(3, 1)
    assert run[0] != 1 and run[2] == 3


def test_near_hint_is_honoured_when_free() -> None:
    alloc = Allocator([100])
    assert alloc.allocate(5, 0, near=50) == [(0, 50, 5)]
    assert alloc.allocate(5, 0, near=55) == [(0, 55, 5)]  # a growing file stays contiguous
    (_, start, n) = alloc.allocate(5, 0, near=52)[0]  # taken: placed elsewhere
    assert n == 5 and not 50 <= start < 60
    assert alloc.allocate(3, 0, near=98)[0][1] != 98  # would run off the device's end


def test_split_when_fragmented_and_nospace_when_full() -> None:
    alloc = Allocator([8, 4])
    for u in range(0, 8, 2):
        alloc.mark_used(0, u)
    alloc.mark_used(1, 0, 4)
    runs = alloc.allocate(3, 0)
    assert sorted(runs) == [(0, 1, 1), (0, 3, 1), (0, 5, 1)]
    assert alloc.allocate(1, 1) == [(0, 7, 1)]
    assert alloc.free_units == 0
    with pytest.raises(NoSpace):
        alloc.allocate(1, 0)
    alloc.free(1, 1, 2)
    assert alloc.allocate(2, 0) == [(1, 1, 2)]


def test_split_spills_over_devices() -> None:
    alloc = Allocator([4, 4])
    alloc.mark_used(0, 1)
    alloc.mark_used(1, 2)
    runs = alloc.allocate(6, 0)
    assert sum(n for *_, n in runs) == 6
    assert {d for d, *_ in runs} == {0, 1}
    assert alloc.free_units == 0


def test_mark_used_twice_and_freeing_unused_units_raise() -> None:
    alloc = Allocator([16])
    alloc.mark_used(0, 3, 4)
    with pytest.raises(ValueError):
        alloc.mark_used(0, 6, 2)
    with pytest.raises(ValueError):
        alloc.free(0, 2, 2)
    with pytest.raises(ValueError):
        alloc.free(0, 10)
    assert alloc.free_units == 12  # failed calls changed nothing
    alloc.free(0, 3, 4)
    with pytest.raises(ValueError):
        alloc.free(0, 3)
    assert alloc.free_units == 16


def test_freed_neighbours_coalesce() -> None:
    alloc = Allocator([30])
    a = alloc.allocate(10, 0)
    b = alloc.allocate(10, 0)
    alloc.allocate(10, 0)
    for runs in (a, b):
        for d, s, n in runs:
            alloc.free(d, s, n)
    assert alloc.statistics().largest_free_run == 20
    assert len(alloc.allocate(20, 0)) == 1
