"""The columnar eviction state: slot columns and tables against dict models, the
version 2 image (pieces, copy-on-write, validation, the version 1 upgrade), bulk
adoption and the evictor's per-inode owners and orphans."""

from __future__ import annotations

import dataclasses
import gzip
import random
import stat
import struct
import zlib
from array import array
from collections.abc import Hashable

import pytest

from kvfs.evict.evictor import Evictor
from kvfs.evict.orphans import OrphanList
from kvfs.evict.policy import POLICY_NAMES, make_policy
from kvfs.evict.policy.adaptive import AdaptivePolicy, _Scalars
from kvfs.evict.policy.prefix import KvfsPolicy
from kvfs.evict.policy.prefix_lru import PrefixLRUPolicy
from kvfs.evict.slots import DIRECT, FREE, LOOSE, ROWS, SlotColumn, SlotTable, runs
from kvfs.format import policy_image as img
from kvfs.format.owners import OWNERS_BLOB, PART_OWNERS, PART_POLICY, POLICY_BLOB
from kvfs.index.inodes import F_DEAD
from kvfs.index.namespace import EVICTOR_TAG, ROOT_INO, Namespace
from tests.unit.evict.test_policy import (
    RELEASE_0_2_IMAGE,
    _add_file,
    _namespace_with_files,
    order,
    run_ops,
)
from tests.unit.log.test_journal import V1_IMAGES, v1_maker

SIZE = 1 << 20


def test_slot_column_matches_a_dict_and_freezes_point_in_time() -> None:
    rng = random.Random(1)
    column = SlotColumn("i", fill=-1)
    model: dict[int, int] = {}
    frozen: list[tuple[list[array[int] | None], dict[int, int]]] = []
    for step in range(20_000):
        i = rng.randrange(5 * ROWS)
        value = rng.choice([rng.randrange(-(2**31), 2**31), rng.randrange(2**40)])
        if step < 10_000:
            value = rng.randrange(-5, 1000)  # fits int32 first: widened later
        column.ensure_row(i)
        column[i] = value
        model[i] = value
        if step % 2500 == 0:
            frozen.append((column.freeze(), dict(model)))
    assert column.code == "q"  # a value past int32 widened it
    for i in range(5 * ROWS):
        assert column.get(i, -1) == model.get(i, -1)
    for chunks, then in frozen:  # every freeze still holds its own moment
        for i, value in then.items():
            chunk = chunks[i // ROWS]
            assert chunk is not None and chunk[i % ROWS] == value


@pytest.mark.parametrize("keys", ["dense", "sparse", "mixed"])
def test_slot_table_lists_match_a_list_model(keys: str) -> None:
    rng = random.Random(len(keys))
    table = SlotTable(3, ("I", "i"))
    model: list[list[int]] = [[], [], []]
    where: dict[int, int] = {}  # key -> list (-2: loose)

    def new_key() -> int:
        while True:
            if keys == "dense" or (keys == "mixed" and (not where or rng.random() < 0.5)):
                key = rng.randrange(3 * ROWS)  # the first key decides: direct slots
            else:
                key = rng.randrange(DIRECT, 2**62)
            if key not in where:
                return key

    for _ in range(6000):
        op = rng.random()
        if op < 0.35 or not where:
            key = new_key()
            slot = table.new(key)
            assert table.find(key) == slot and table.key_of(slot) == key
            assert table.owner[slot] == LOOSE and table.columns[0][slot] == 0
            lst = rng.randrange(3)
            table.append(lst, slot)
            table.columns[0][slot] = key & 0xFFFF
            model[lst].append(key)
            where[key] = lst
            continue
        key = rng.choice(sorted(where))
        found = table.find(key)
        assert found is not None and table.columns[0][found] == key & 0xFFFF
        slot, lst = found, where[key]
        if op < 0.55:  # move before another member of some list
            table.unlink(slot)
            model[lst].remove(key)
            dest = rng.randrange(3)
            if model[dest] and rng.random() < 0.7:
                anchor = rng.choice(model[dest])
                table.insert_before(table.find(anchor), slot, dest)  # type: ignore[arg-type]
                model[dest].insert(model[dest].index(anchor), key)
            else:
                table.append(dest, slot)
                model[dest].append(key)
            where[key] = dest
        elif op < 0.65:  # another key takes its place and its columns
            new = new_key()
            moved = table.move_key(slot, new)
            assert table.find(key) is None and table.columns[0][moved] == key & 0xFFFF
            table.columns[0][moved] = new & 0xFFFF
            model[lst][model[lst].index(key)] = new
            del where[key]
            where[new] = lst
        else:  # gone
            table.unlink(slot)
            table.release(slot)
            model[lst].remove(key)
            del where[key]
            assert table.find(key) is None
    for lst in range(3):
        assert [table.key_of(s) for s in table.slot_list(lst)] == model[lst]
        assert list(table.walk(lst)) == model[lst] and table.count[lst] == len(model[lst])
    assert sorted(table.keys_where((0, 1, 2))) == sorted(where)
    if keys == "sparse":
        assert table.direct == 0 and len(table.index) == len(where)
    else:
        assert table.direct == DIRECT


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_version_2_round_trip_continues_exactly(name: str) -> None:
    """recover(persist()) holds the same state: the same victims, the same image,
    and for lru/fifo the same future (the same operations afterwards)."""
    for seed in range(6):
        rng = random.Random(seed)
        policy = make_policy(name)
        run_ops(policy, rng, rng.randrange(100, 1500))
        image = policy.persist()
        copy = make_policy(name)
        copy.recover(image)
        assert copy.keys() == policy.keys()
        if isinstance(policy, AdaptivePolicy):  # both orders, weights and history
            assert isinstance(copy, AdaptivePolicy)
            assert order(copy.loop) == order(policy.loop)
            assert list(copy.loop.recent_first()) == list(policy.loop.recent_first())
            assert copy.weights == pytest.approx(policy.weights)
            assert copy.switches == policy.switches and copy._chosen == policy._chosen
        assert order(copy) == order(policy)
        assert copy.statistics().bytes == policy.statistics().bytes
        assert copy.persist() == image
        if name in ("lru", "fifo"):  # the others restart their stream memory and
            # adaptive thresholds (not persisted): their futures may differ
            run_ops(policy, random.Random(seed + 100), 300)
            run_ops(copy, random.Random(seed + 100), 300)
            assert copy.persist() == policy.persist() and order(copy) == order(policy)


@pytest.mark.parametrize("name", ["kvfs", "lru", "fifo", "prefix-lru", "adaptive"])
def test_pieces_are_the_state_when_frozen_while_the_policy_changes(name: str) -> None:
    policy = make_policy(name)
    for key in range(2, 5000):  # dense keys: several chunks
        policy.track(key, SIZE, key % 5)
    before = policy.persist()
    pieces = policy.persist_pieces()  # frozen here
    first = next(pieces)
    for key in range(2, 3000, 3):  # the loop goes on: every chunk changes
        policy.remove(key)
    for key in range(5000, 6000):
        policy.track(key, SIZE, 7)
    assert first + b"".join(pieces) == before
    later = make_policy(name)
    later.recover(before)
    assert later.keys() == set(range(2, 5000))


def test_adaptive_image_keeps_the_expert_followed_and_reads_images_without_it() -> None:
    """Within the margin the expert followed depends on history (hysteresis), so the
    image keeps it; an image written before it was kept (five scalars) loads with
    the leader of its weights followed."""
    policy = AdaptivePolicy()
    for key in range(2, 200):
        policy.track(key, SIZE, key % 3)
    policy.duel.scores = [1.0, 1.4]  # the loop expert leads, but not by the margin 1.5
    for chosen in (0, 1):
        policy._chosen = chosen
        copy = AdaptivePolicy()
        copy.recover(policy.persist())
        assert copy._chosen == chosen and copy.weights == pytest.approx(policy.weights)
        assert copy.persist() == policy.persist()
    policy.duel.scores = [1.0, 2.0]  # the loop expert leads by the margin

    def five_scalar_image(followed: int) -> bytes:
        policy._chosen = followed
        return _image_with_table1(policy, _carried(policy)[:5])

    old = AdaptivePolicy()
    old.recover(five_scalar_image(0))
    assert old._chosen == 1 and old.keys() == policy.keys()
    bad = AdaptivePolicy()
    policy._chosen = 0
    carried = _carried(policy)
    carried[5] = 7  # no such order
    with pytest.raises(ValueError):
        bad.recover(_image_with_table1(policy, carried))
    assert len(bad) == 0


def _carried(policy: AdaptivePolicy) -> list[int]:
    """The scalars the policy's image carries in its table 1."""
    pieces = img.split_pieces(policy.persist())
    scalars = _Scalars()
    scalars._load_pieces(pieces, img.KIND_ADAPTIVE, 1)
    return scalars.carried


def _image_with_table1(
    policy: AdaptivePolicy, carried: list[int], keys: list[int] | None = None
) -> bytes:
    """The policy's image with table 1 holding ``carried`` and, as until session 29
    (the recency expert's table), ``keys`` in that order."""
    table1 = _Scalars()
    for key in keys or []:
        table1.track(key, policy.loop.size_of(key), None)
    table1.carried = carried
    return b"".join([*policy.loop._pieces(policy._kind, 0), *table1._pieces(policy._kind, 1)])


def _adaptive_state(policy: AdaptivePolicy) -> tuple[object, ...]:
    return (
        order(policy.loop),
        list(policy.loop.recent_first()),
        [round(w, 12) for w in policy.weights],
        policy.switches,
        policy.statistics(),
    )


def _step(
    policy: AdaptivePolicy,
    op: float,
    cuts: tuple[float, float, float],
    key: int,
    size: int,
    stream: int,
) -> None:
    """A write (``op`` under ``cuts[0]``), a read (under ``cuts[1]``) or a removal
    (under ``cuts[2]``) of ``key``; nothing past that."""
    if op < cuts[0]:
        policy.track(key, size, stream)
    elif op < cuts[1]:
        policy.touch(key, stream)
    elif op < cuts[2]:
        policy.remove(key)


def test_the_recency_order_is_the_loop_experts_lists_merged_by_last_use() -> None:
    """The recency side keeps no table (session 29): its order is the loop expert's
    dead, probation and main lists merged by last use. Through writes, reads,
    removals and evictions taken from it (the caller removing each key it is
    given, as the store does), it yields every resident once, keeps each list's
    own order (a chain filed tail first leaves tail first), and each key it yields
    is, among the oldest keys not yet yielded of each list, the one used longest
    ago."""
    rng = random.Random(5)
    policy = AdaptivePolicy()
    policy._chosen = 0  # the recency order
    policy.duel.leader = lambda current: current  # type: ignore[method-assign]
    loop = policy.loop

    def age(key: int) -> int:
        slot = loop._slots.find(key)
        assert slot is not None
        return loop._age(slot)

    for step in range(30_000):
        key, stream = rng.randrange(2, 3000), rng.randrange(6)
        _step(policy, rng.random(), (0.5, 0.85, 0.9), key, rng.choice((SIZE, 7)), stream)
        if len(policy) > 800:
            for victim in policy.victims():  # evict a batch, removing each as given
                policy.remove(victim)
                if len(policy) <= 760:
                    break
        if step % 3000 == 0:
            lists = [
                [loop._slots.key_of(s) for s in loop._slots.slot_list(lst)] for lst in loop._lists
            ]
            merged = list(loop.recent_first())
            assert sorted(merged) == sorted(policy.keys()) and len(merged) == len(policy)
            heads = [0] * len(lists)
            for key in merged:
                where = [i for i, keys in enumerate(lists) if heads[i] < len(keys)]
                i = next(i for i in where if lists[i][heads[i]] == key)
                ages = [age(lists[j][heads[j]]) for j in where]
                assert age(key) == max(ages)
                heads[i] += 1


def test_the_adaptive_policy_costs_what_its_loop_expert_costs() -> None:
    """One table (session 29): an adaptive policy that adopted a pool's files costs
    what the ``kvfs`` policy holding them costs, plus the two shadows' empty tables
    (a fixed ~30 KiB each whatever the keys; until session 29 the recency expert's
    table added a byte or more a key even while its chunks were shared)."""
    import tracemalloc

    keys = array("q", range(2, 40_000))
    sizes = array("q", [SIZE]) * len(keys)
    used = []
    for name in ("adaptive", "kvfs"):
        tracemalloc.start()
        policy = make_policy(name)
        policy.adopt(keys, sizes)
        used.append(tracemalloc.get_traced_memory()[0])
        tracemalloc.stop()
        assert len(policy) == len(keys)
        del policy
    assert used[0] < used[1] + 3 * (32 << 10), used


def test_an_image_whose_table_1_holds_the_recency_experts_keys_loads() -> None:
    """Until session 29 table 1 held the recency expert's order of the residents:
    such an image loads (its scalars read, its keys dropped) to the state the
    image of this release gives, and is written back without them."""
    policy = AdaptivePolicy()
    run_ops(policy, random.Random(12), 1500)
    policy._chosen = 1
    carried = _carried(policy)
    recency = list(policy.loop.recent_first())
    earlier = _image_with_table1(policy, carried, recency)
    assert len(earlier) > len(policy.persist())
    for image in (earlier, policy.persist()):
        copy = AdaptivePolicy()
        copy.recover(image)
        assert _adaptive_state(copy)[:-1] == _adaptive_state(policy)[:-1]
        assert copy._chosen == 1 and copy.persist() == policy.persist()


def _kvfs_workload(policy: object, rng: random.Random, keys: int, count: int) -> None:
    """Streams writing and rereading chains over ``keys`` keys, evicting to half."""
    for _ in range(count):
        key, stream = rng.randrange(2, keys), rng.randrange(8)
        if rng.random() < 0.6:
            policy.track(key, SIZE, stream)  # type: ignore[attr-defined]
        else:
            policy.touch(key, stream)  # type: ignore[attr-defined]
        while len(policy) > keys // 2:  # type: ignore[arg-type]
            policy.remove(next(policy.victims()))  # type: ignore[attr-defined]


@pytest.mark.parametrize("keys", [80, 6000])
def test_adaptive_takes_a_kvfs_image_whole(keys: int) -> None:
    """A pool of the former default (``kvfs``) mounted with ``adaptive``: the loop
    expert restores the image whole (its lists, ghosts and counters), and both
    orders go on from it as from the same state recovered by ``adaptive``."""
    for seed in range(4):
        kvfs = make_policy("kvfs")
        _kvfs_workload(kvfs, random.Random(seed), keys, 4 * keys)
        image = kvfs.persist()
        fast = AdaptivePolicy()
        assert fast.recover_foreign(image)
        assert fast.loop.persist() == image and fast.keys() == kvfs.keys()
        assert fast.statistics().bytes == kvfs.statistics().bytes
        _kvfs_workload(fast, random.Random(seed + 10), keys, 2 * keys)
        again = AdaptivePolicy()
        again.recover(fast.persist())
        assert _adaptive_state(again)[:2] == _adaptive_state(fast)[:2]


def test_adaptive_recovers_through_a_kvfs_image_and_resumes_its_leader() -> None:
    """``adaptive`` -> ``kvfs`` (its loop expert's table whole) -> ``adaptive``
    again: the keys and the loop expert's order survive; the shadows restart, the
    scores resume from the persisted shares, and the order followed is the one
    the image names."""
    rng = random.Random(2)
    first = AdaptivePolicy()
    for _ in range(60_000):
        key, stream = rng.randrange(400), rng.randrange(8)
        if len(first) > 50:
            first.remove(next(first.victims()))
        if key not in first:
            first.track(key, 10, None if rng.random() < 0.5 else stream)
    kvfs = make_policy("kvfs")
    assert kvfs.recover_foreign(first.persist())
    again = AdaptivePolicy()
    assert again.recover_foreign(kvfs.persist())
    assert again.keys() == first.keys() and order(again.loop) == order(first.loop)
    assert again.weights == [0.5, 0.5]  # (a kvfs image keeps no scores)
    copy = AdaptivePolicy()
    copy.recover(first.persist())
    assert copy.weights == pytest.approx(first.weights)
    assert copy._chosen == first._chosen and copy.duel.ahead(first._chosen) == first._chosen


def test_adaptive_image_whose_last_chunks_hold_only_ghosts_recovers() -> None:
    """The loop expert's last chunks may hold only ghosts: the whole state (ghosts
    too) recovers."""
    policy = AdaptivePolicy()
    for key in range(1100):
        policy.track(key, 10, None)
    for key in range(1020, 1100):  # the newest files deleted: ghosts past the last key
        policy.remove(key)
    copy = AdaptivePolicy()
    copy.recover_pieces(img.split_pieces(policy.persist()))
    assert _adaptive_state(copy)[:-1] == _adaptive_state(policy)[:-1]
    assert copy.loop.persist() == policy.loop.persist()
    assert copy.loop.statistics().ghost_keys == policy.loop.statistics().ghost_keys == 80


def test_an_image_head_claiming_more_rows_than_links_address_is_refused() -> None:
    """Chunks past 2**31 rows (int32 links): a ValueError, so every fallback
    (another policy's adoption, a fresh start) still runs."""
    policy = make_policy("prefix-lru")
    for key in range(10):
        policy.track(key, 100, None)
    pieces = list(policy.persist_pieces())
    header, body = pieces[0][: img.PIECE.size], bytearray(pieces[0][img.PIECE.size : -4])
    struct.pack_into("<I", body, 16, 1 << 22)  # the head's chunk count
    crc = img.CRC.pack(zlib.crc32(bytes(body), zlib.crc32(header)))
    pieces[0] = header + bytes(body) + crc
    with pytest.raises(ValueError, match="geometry"):
        make_policy("prefix-lru").recover_pieces(pieces)
    for name in ("adaptive", "kvfs", "lru"):
        assert not make_policy(name).recover_foreign(b"".join(pieces))


def test_adaptive_reads_the_one_piece_image_of_release_0_3() -> None:
    """Release 0.3 wrote the adaptive state as one version 1 image (the loop
    expert's lists and ghosts, then the recency list; no weights, no history):
    it still loads, the loop expert's lists whole, the recency list dropped (the
    recency order is the loop expert's since session 29), the weights even."""
    old = AdaptivePolicy()
    run_ops(old, random.Random(8), 1500)
    loop = img.decode(old.loop.persist_v1(), img.KIND_KVFS, 3)
    recency = PrefixLRUPolicy()
    for key in old.loop.recent_first():
        recency.track(key, old.loop.size_of(key), None)
    v1 = img.encode(
        img.KIND_ADAPTIVE,
        loop.clock,
        loop.horizon,
        [*loop.lists, *img.decode(recency.persist_v1(), img.KIND_PREFIX_LRU, 1).lists],
        loop.ghost_keys,
        loop.ghost_last,
    )
    for load in ("recover", "recover_pieces"):
        new = AdaptivePolicy()
        new.recover(v1) if load == "recover" else new.recover_pieces([v1])
        # the lists, each in order (a version 1 image keeps no thresholds: the
        # loop expert's share restarts, which may move probation in its order)
        assert new.loop.keys_in_image_order() == old.loop.keys_in_image_order()
        assert list(new.loop.recent_first()) == list(old.loop.recent_first())
        assert new.weights == [0.5, 0.5] and new.keys() == old.keys()
        assert img.version_of(new.persist()) == 3


def test_damaged_adaptive_images_are_refused_and_change_nothing() -> None:
    policy = AdaptivePolicy()
    run_ops(policy, random.Random(3), 800)
    pieces = list(policy.persist_pieces())
    loop_only = [p for p in pieces if p[img.PIECE.size - 9] == 0]
    target = AdaptivePolicy()
    run_ops(target, random.Random(4), 200)
    kept = target.persist()
    flipped = [*pieces[:-1], pieces[-1][:-5] + bytes([pieces[-1][-5] ^ 1]) + pieces[-1][-4:]]
    for damaged in (loop_only, flipped, pieces[:-1]):
        with pytest.raises(ValueError):
            target.recover_pieces(damaged)
        assert target.persist() == kept
    kvfs = make_policy("kvfs")  # another policy takes the loop expert's table whole
    assert kvfs.recover_foreign(b"".join(pieces))
    assert order(kvfs) == order(policy.loop)


def test_damaged_version_2_images_are_refused_and_change_nothing() -> None:
    policy = make_policy("kvfs")
    run_ops(policy, random.Random(3), 800)
    pieces = list(policy.persist_pieces())
    target = make_policy("kvfs")
    run_ops(target, random.Random(4), 200)
    kept = target.persist()
    rng = random.Random(5)
    bad = [
        pieces[1:],  # no head
        pieces[:1],  # no columns: the list counts do not match
        [*pieces, pieces[0]],  # two heads
        [pieces[0][:-1] + bytes([pieces[0][-1] ^ 1]), *pieces[1:]],  # checksum
        [pieces[0], pieces[1][:-9] + pieces[1][-4:], *pieces[2:]],  # truncated
    ]
    for _ in range(20):  # a flipped byte anywhere
        i = rng.randrange(len(pieces))
        at = rng.randrange(len(pieces[i]))
        flipped = bytearray(pieces[i])
        flipped[at] ^= 1 << rng.randrange(8)
        bad.append([*pieces[:i], bytes(flipped), *pieces[i + 1 :]])
    for damaged in bad:
        with pytest.raises(ValueError):
            target.recover_pieces(damaged)
        assert target.persist() == kept
    for other in ("lru", "fifo", "prefix-lru"):  # another policy's image: refused
        with pytest.raises(ValueError):
            make_policy(other).recover_pieces(pieces)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_bulk_adopt_is_track_per_key(name: str) -> None:
    rng = random.Random(7)
    runs = [*range(5, 1000), 3000, 3001, 1023, 1024, 1025, *rng.sample(range(4000, 9000), 800)]
    for keys in (runs, list(range(2, 3000)), rng.sample(range(2, 20_000), 3000)):
        sizes = [rng.choice([1, SIZE, 5 << 32]) for _ in keys]  # a size past uint32
        slow, fast = make_policy(name), make_policy(name)
        for key, size in zip(keys, sizes, strict=True):
            slow.track(key, size, None)
        fast.adopt(array("q", keys), array("q", sizes))
        assert fast.persist() == slow.persist()
        assert fast.statistics() == slow.statistics()
        assert order(fast) == order(slow) == (keys if name != "kvfs" else order(slow))
        mask = fast.resident_mask(20_000)
        assert mask is not None and list(array("B", mask)).count(1) == len(keys)
        assert all(mask[key] for key in keys)


def test_kvfs_adopts_files_oldest_first_without_chains() -> None:
    """Files found at mount (no stream) are not a chain: the oldest goes first
    (0.2 filed each before the previous one: newest first)."""
    policy = make_policy("kvfs")
    for key in range(2, 10):
        policy.track(key, SIZE, None)
    assert order(policy) == list(range(2, 10))
    assert policy.statistics().chain_links == 0


def test_orphan_list_matches_an_ordered_dict() -> None:
    rng = random.Random(9)
    orphans = OrphanList()
    model: dict[int, None] = {}
    orphans.extend(array("q", [5, 6, 7, 9, 3, 4, 100]))
    model.update(dict.fromkeys([5, 6, 7, 9, 3, 4, 100]))
    for _ in range(20_000):
        ino = rng.randrange(1, 3000)
        if rng.random() < 0.5:
            orphans.add(ino)
            model[ino] = None  # a member keeps its place
        else:
            orphans.pop(ino, None)
            model.pop(ino, None)
        assert (ino in orphans) == (ino in model)
    assert list(orphans) == list(model) and len(orphans) == len(model)
    orphans.extend(array("q", [5000, 5001, 5002]))  # onto a non-empty list
    assert list(orphans)[-3:] == [5000, 5001, 5002]
    with pytest.raises(ValueError):
        orphans.add(0)


def _evictor(ns: Namespace, alive: dict[int, int], policy: str = "kvfs") -> Evictor:
    return Evictor(ns, policy=policy, alive=alive.get, thread_group=lambda tid: tid, grace=0)


def _reload(ns: Namespace, evictor: Evictor) -> None:
    """What a checkpoint and its load do with the evictor's payloads."""
    ns.evictor_payloads = []
    for payload in evictor.snapshot_payloads():
        assert payload[0] == EVICTOR_TAG
        ns.load_payload(payload)


@pytest.mark.parametrize("name", ["kvfs", "lru", "adaptive"])
def test_remount_drops_gone_files_and_adopts_new_ones(name: str) -> None:
    files = {ino: SIZE for ino in range(2, 3000)}
    ns = _namespace_with_files(files)
    alive = {1000: 7}
    evictor = _evictor(ns, alive, name)
    evictor.adopt_all()
    for ino in range(2, 3000, 7):
        evictor.opened(ns.inodes[ino], 1000)  # owned by a live process
    _reload(ns, evictor)
    saved = make_policy(name)
    saved.recover_pieces([p[2:] for p in ns.evictor_payloads if p[1:2] == PART_POLICY])
    for ino in range(2, 3000, 5):  # gone since the checkpoint
        ns.drop(ns.remove(ROOT_INO, b"f%d" % ino, want_dir=False))
    for ino in range(3000, 3100):  # written since
        _add_file(ns, ino, 7)
    again = _evictor(ns, alive, name)
    again.adopt_all()
    left = {ino for ino, inode in ns.inodes.items() if not inode.is_dir}
    assert again.policy.keys() == left
    saved.remove_many(set(range(2, 3000, 5)))  # what adopt_all does, one by one
    for ino in range(3000, 3100):
        saved.track(ino, 7, None)
    assert order(again.policy) == order(saved)
    assert again.policy.persist() == saved.persist()
    owned = {ino for ino in range(2, 3000, 7) if ino in left}
    assert list(again.orphans) == sorted(left - owned)  # mtime order (= inode here)
    assert all(again.owner_of(ino) == (1000, 7) for ino in owned)
    del alive[1000]
    again._reaped = 0.0
    assert again.reap() == len(owned) and set(again.orphans) == left


def test_an_older_pools_blobs_are_read_once_then_payloads_replace_them() -> None:
    """The upgrade path: the 0.2 policy image and (inode, pid, start) owner triples
    in the namespace's blobs are adopted at mount and the next checkpoint carries
    the new payloads instead (the blobs are dropped)."""
    files = {5: 4096, 6: 4096, 7: 4096, 20: 8192, 21: 8192, 30: 100}
    ns = _namespace_with_files(files)
    ns.blobs[POLICY_BLOB] = RELEASE_0_2_IMAGE
    ns.blobs[OWNERS_BLOB] = array("q", [5, 1000, 7, 20, 1000, 7, 21, 1001, 3]).tobytes()
    evictor = _evictor(ns, {1000: 7, 1001: 4})  # 1001 is another process now
    evictor.adopt_all()
    assert POLICY_BLOB not in ns.blobs and OWNERS_BLOB not in ns.blobs
    assert evictor.policy.statistics().chain_links == 1  # the learned chain 5 -> 6 -> 7
    assert list(evictor.orphans) == [6, 7, 21, 30]
    assert [evictor.owner_of(i) for i in (5, 20, 21)] == [(1000, 7), (1000, 7), None]
    victims = order(evictor.policy)
    _reload(ns, evictor)
    assert {p[1:2] for p in ns.evictor_payloads} == {PART_POLICY, PART_OWNERS}
    again = _evictor(ns, {1000: 7})
    again.adopt_all()
    assert order(again.policy) == victims and list(again.orphans) == [6, 7, 21, 30]
    assert again.owner_of(5) == (1000, 7)


@pytest.mark.parametrize("mtimes_in_inode_order", [False, True])
def test_first_mount_adopts_in_mtime_order_and_skips_dead_rows(
    mtimes_in_inode_order: bool,
) -> None:
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    rng = random.Random(11)
    inos = list(range(2, 2600))
    mtimes = {ino: rng.randrange(10**6) for ino in inos}
    if mtimes_in_inode_order:  # the runs then come from the namespace's bytes
        mtimes = {ino: ino // 3 for ino in inos}
    for ino in inos:
        mode = stat.S_IFREG | 0o644
        from kvfs.format.records import Dentry, InodeRecord

        ns.apply(InodeRecord(ino, mode, 0, 0, 1, ino, 0, mtimes[ino], 0, 0, array("q"), array("Q")))
        ns.apply(Dentry(ROOT_INO, b"f%d" % ino, ino))
    ns.make(ROOT_INO, b"dir", stat.S_IFDIR | 0o755, 0, 0)
    for ino in inos[::9]:
        ns.drop(ns.remove(ROOT_INO, b"f%d" % ino, want_dir=False))
    dead = [ino for ino in inos if ns._flags[ino] & F_DEAD or ino not in ns.inodes]
    evictor = _evictor(ns, {})
    evictor.adopt_all()
    left = sorted((ino for ino in inos if ino in ns.inodes), key=lambda i: (mtimes[i], i))
    assert list(evictor.orphans) == left and not set(dead) & set(evictor.orphans)
    assert order(evictor.policy) == left and len(evictor.orphans) == len(left)
    assert evictor.policy.statistics().bytes == sum(left)


def test_owner_column_overflow_leaves_files_unowned() -> None:
    files = {ino: 1 for ino in range(2, 6)}
    ns = _namespace_with_files(files)
    evictor = _evictor(ns, {pid: 1 for pid in range(10)})
    evictor._procs.extend([(10**6 + i, 0) for i in range(0xFFFF)])  # every number taken
    evictor._proc_files.extend([1] * 0xFFFF)
    assert evictor.opened(ns.inodes[2], 3) is None
    assert evictor.owner_of(2) is None
    assert FREE == -1 and LOOSE == -2


def test_owners_take_a_byte_a_file_under_256_processes_and_the_image_two() -> None:
    """The owner column keeps a chunk a byte a row while its process numbers are
    under 256 and widens only the chunk that takes a larger one; a checkpoint
    keeps two bytes a row whatever the width (the owners image is unchanged), a
    reload gives every file its owner back, and a reaped process's files are
    found in chunks of either width."""
    files = {ino: 10 for ino in range(2, 3 * ROWS)}
    ns = _namespace_with_files(files)
    alive = {pid: pid + 7 for pid in range(1000, 1300)}
    evictor = _evictor(ns, alive)
    for ino in files:
        pid = 1000 + ino % 200
        evictor.created(ns.inodes[ino], pid)
        evictor.committed(ns.inodes[ino], pid)
    assert {ch.typecode for ch in evictor._owner.chunks if ch is not None} == {"B"}
    assert evictor._owner.nbytes() == 3 * ROWS
    for pid in range(1200, 1300):  # numbers 201 .. 300: the last chunk's rows
        evictor.opened(ns.inodes[2 * ROWS + pid - 1200], pid)
    codes = [ch.typecode for ch in evictor._owner.chunks if ch is not None]
    assert codes == ["B", "B", "H"]
    owners = {ino: evictor.owner_of(ino) for ino in files}
    assert owners[2 * ROWS + 99] == (1299, 1306) and owners[5] == (1005, 1012)
    wide = Evictor(ns, policy="kvfs", alive=alive.get, thread_group=lambda tid: tid, grace=0)
    wide._owner = SlotColumn("H")  # as before: two bytes a row
    wide._procs, wide._proc_ids = evictor._procs, evictor._proc_ids
    for c, chunk in enumerate(evictor._owner.chunks):
        assert chunk is not None
        wide._owner.load(c, array("H", chunk))
    pieces = [p for p in evictor.snapshot_payloads() if p[1:2] == PART_OWNERS]
    assert pieces == [p for p in wide.snapshot_payloads() if p[1:2] == PART_OWNERS]
    _reload(ns, evictor)
    again = _evictor(ns, alive)
    again.adopt_all()
    assert {ino: again.owner_of(ino) for ino in files} == owners
    # numbers 6 (a byte-wide chunk's) and 257 (the wide one's: 0x0101, its bytes also
    # met across the rows of 256 and 257)
    del alive[1005], alive[1256]
    evictor._reaped = 0.0
    gone = sorted(ino for ino in files if owners[ino] in ((1005, 1012), (1256, 1263)))
    assert evictor.reap() == len(gone) and sorted(evictor.orphans) == gone
    assert all(evictor.owner_of(ino) is None for ino in gone)


def test_image_module_reads_both_versions() -> None:
    assert img.version_of(RELEASE_0_2_IMAGE) == 1
    policy = make_policy("kvfs")
    policy.recover(RELEASE_0_2_IMAGE)
    assert img.version_of(policy.persist()) == 3
    kind, decoded = img.decode_any(policy.persist())  # type: ignore[misc]
    assert kind == img.KIND_KVFS
    assert sorted(k for keys, *_ in decoded.lists for k in keys) == [5, 7, 20, 21]


def test_runs_are_the_maximal_runs_of_consecutive_keys() -> None:
    rng = random.Random(13)
    for _ in range(300):
        keys = array("q", rng.sample(range(3000), rng.randrange(1, 80)))
        if rng.random() < 0.5:
            keys = array("q", sorted(keys))
        if rng.random() < 0.3:
            keys = array("q", range(7, 7 + rng.randrange(1, 3000)))
        expected, start = [], 0
        for i in range(1, len(keys)):
            if keys[i] != keys[i - 1] + 1:
                expected.append((start, i))
                start = i
        expected.append((start, len(keys)))
        assert runs(keys) == expected


def test_evictor_payloads_wrapped_as_image_ops_are_set_aside() -> None:
    """Offline tools (fsck's repair) carry the evictor's payloads as IMAGE ops of an
    ``encode_checkpoint``: replayed, they reach ``evictor_payloads`` too."""
    from kvfs.format.records import Image

    ns = _namespace_with_files({5: 10, 6: 20})
    evictor = _evictor(ns, {})
    evictor.adopt_all()
    payloads = list(evictor.snapshot_payloads())
    fresh = _namespace_with_files({5: 10, 6: 20})
    for payload in payloads:
        assert fresh.apply(Image(payload))
    assert fresh.evictor_payloads == payloads
    again = _evictor(fresh, {})
    again.adopt_all()
    assert order(again.policy) == order(evictor.policy) == [5, 6]


def _policy_v2_images() -> tuple[object, dict[str, bytes]]:
    maker = v1_maker("make_policy_v2_images")
    raw, images, pos = gzip.decompress((V1_IMAGES / "policy-v2.bin.gz").read_bytes()), {}, 0
    for name in maker.NAMES:
        n = int.from_bytes(raw[pos : pos + 4], "little")
        images[name] = raw[pos + 4 : pos + 4 + n]
        pos += 4 + n
    return maker, images


class _ChainsEveryWrite(PrefixLRUPolicy):
    """prefix-lru as the release that wrote the images filed new keys: each one
    chained to its stream's previous key, whether a read began the run or not (since
    issue 30 only a run a read began is chained), and with no partial-chunk-first
    rule (built without it)."""

    def __init__(self) -> None:
        super().__init__(partial_first=False)

    def _anchor(self, slot: int, stream: object, new: bool, read: bool) -> int | None:
        if stream in self._streams:  # every run counts as begun by a read, and any
            # link as confirmable (a created key's too, until session 31)
            self._streams[stream] = (self._streams[stream][0], True, False)
        return super()._anchor(slot, stream, new, read)


class _KvfsChainsEveryWrite(KvfsPolicy):
    """kvfs as the release that wrote the images filed new keys: chained whether a
    read began the run or not, no partial-chunk-first rule (both since session 29)."""

    def __init__(self) -> None:
        super().__init__(without=frozenset({"partial-first"}))

    def _observe(
        self, slot: int, stream: Hashable, read: bool = False, new: bool = False
    ) -> int | None:
        if stream in self._streams:  # every run counts as begun by a read, and any
            # link as confirmable (a created key's too, until session 31)
            self._streams[stream] = (self._streams[stream][0], True, False)
        return super()._observe(slot, stream, read, new)


@pytest.mark.parametrize("name", ["kvfs", "lru", "prefix-lru"])
def test_a_version_2_policy_image_of_the_previous_release_recovers_the_same_state(
    name: str,
) -> None:
    """The bytes of real version 2 images (full-width chunks): recovered, the policy
    holds the state the same operations build today (victims, statistics but the
    operation counters), and answers further operations exactly as a policy
    recovered from today's version 3 image of that state; its chunks are narrowed
    and its own image is version 3 and smaller."""
    maker, images = _policy_v2_images()
    old = images[name]
    assert img.version_of(old) == 2
    as_released = {"prefix-lru": _ChainsEveryWrite, "kvfs": _KvfsChainsEveryWrite}
    live = as_released.get(name, lambda: make_policy(name))()
    maker.workload(live)  # type: ignore[attr-defined]
    got, today = make_policy(name), make_policy(name)
    got.recover(old)
    today.recover(live.persist())
    counters = {"tracks": 0, "touches": 0, "removes": 0}  # not persisted

    def stats(policy: object) -> object:
        return dataclasses.replace(policy.statistics(), **counters)  # type: ignore[attr-defined]

    assert list(got.victims()) == list(live.victims()) and stats(got) == stats(live)
    new = got.persist()
    assert img.version_of(new) == 3 and len(new) <= len(old)
    if name == "kvfs":  # its chains, clocks and gaps fit a byte or two here
        table = got._slots  # type: ignore[attr-defined]
        codes = {c.typecode for col in table.columns for c in col.chunks if c is not None}
        assert len(codes) > 1 and len(new) < 0.8 * len(old)
    for policy in (got, today):
        maker.workload(policy, seed=9, count=2000)  # type: ignore[attr-defined]
    assert list(got.victims()) == list(today.victims()) and got.statistics() == today.statistics()


def test_a_narrowing_slot_column_widens_one_chunk_exactly() -> None:
    column = SlotColumn("I", narrow=True)
    for i in (0, ROWS, 2 * ROWS):
        column.ensure_row(i)
    assert {c.typecode for c in column.chunks if c is not None} == {"B"}
    column[ROWS + 3] = 70_000
    column[2 * ROWS] = 5 << 32
    assert [c.typecode for c in column.chunks if c is not None] == ["B", "I", "q"]
    assert column[ROWS + 3] == 70_000 and column[2 * ROWS] == 5 << 32 and column.code == "I"
    frozen = column.freeze()
    column.assign(0, 10, array("q", [-1, 300]))
    assert column.chunks[0].typecode == "q" and column[10] == -1 and column[11] == 300  # type: ignore[union-attr]
    assert frozen[0] is not None and frozen[0].typecode == "B" and frozen[0][10] == 0


def test_inode_numbers_up_to_2_28_are_direct_and_old_tables_keep_2_26() -> None:
    """A key below DIRECT (2^28: 2.7x10^8 inode numbers) is its own slot, no dict
    entry; a table recovered from a version 2 image keeps that release's 2^26 and
    maps the keys above it."""
    from kvfs.evict.slots import LEGACY_DIRECT

    table = SlotTable(2, ("I",))
    key = (1 << 27) + 5
    slot = table.new(key)
    assert slot == key + 2 and not table.index and table.find(key) == slot
    _, images = _policy_v2_images()
    old = make_policy("lru")
    old.recover(images["lru"])
    assert old._slots.direct == LEGACY_DIRECT  # type: ignore[attr-defined]
    old.track(key, 10, None)
    assert key in old._slots.index and key in set(old.victims())  # type: ignore[attr-defined]
    again = make_policy("lru")
    again.recover(old.persist())
    assert list(again.victims()) == list(old.victims())
