"""Unit tests of kvfs.evict.policy: eviction order, chain learning, persistence, invariants."""

from __future__ import annotations

import random
import stat
import tracemalloc
from array import array
from typing import Any

import pytest

from kvfs.evict.evictor import Evictor
from kvfs.evict.policy import (
    POLICY_NAMES,
    AdaptivePolicy,
    EvictionPolicy,
    FIFOPolicy,
    KvfsPolicy,
    LRUPolicy,
    make_policy,
)
from kvfs.evict.policy.duel import Duel
from kvfs.format import policy_image as img
from kvfs.format.owners import PART_POLICY, POLICY_BLOB
from kvfs.format.records import Dentry, InodeRecord
from kvfs.index.namespace import ROOT_INO, Namespace

SIZE = 100


def order(policy: EvictionPolicy) -> list[int]:
    """Full victim order, without removing anything."""
    return list(policy.victims())


def test_make_policy_names_and_unknown() -> None:
    names = {"kvfs", "lru", "fifo", "prefix-lru", "adaptive"}
    assert {make_policy(name).name for name in POLICY_NAMES} == names
    with pytest.raises(ValueError, match="unknown"):
        make_policy("clock")


def test_fifo_ignores_reads_lru_does_not() -> None:
    fifo, lru = FIFOPolicy(), LRUPolicy()
    for policy in (fifo, lru):
        for key in (1, 2, 3):
            policy.track(key, SIZE, "s")
        policy.touch(1, "s")
    assert order(fifo) == [1, 2, 3]
    assert order(lru) == [2, 3, 1]


def test_unknown_keys_are_ignored_and_bad_keys_rejected() -> None:
    for name in POLICY_NAMES:
        policy = make_policy(name)
        policy.touch(7, "s")
        policy.remove(7)
        assert len(policy) == 0
        with pytest.raises(ValueError):
            policy.track(-1, SIZE, "s")


def test_kvfs_new_chain_evicts_tail_first() -> None:
    """A prompt's missing chunks, written after a read of its cached prefix, leave
    deepest first; a run of writes that no read began is filed like LRU (a writer
    that never reads keeps its newest files longest)."""
    policy = KvfsPolicy()
    policy.track(9, SIZE, "filler")
    policy.touch(9, "engine")  # the cached prefix, read first
    for key in (10, 11, 12, 13):
        policy.track(key, SIZE, "engine")
    assert order(policy) == [13, 12, 11, 10, 9]
    writer = KvfsPolicy()
    for key in (10, 11, 12, 13):
        writer.track(key, SIZE, "writer")
    assert order(writer) == [10, 11, 12, 13]


@pytest.mark.parametrize("policy", [KvfsPolicy, AdaptivePolicy])
def test_a_prompts_partial_last_chunk_goes_first(policy: type) -> None:
    """A new key chained to a larger predecessor (a prompt's partial last chunk)
    is filed as the oldest of its list, in the loop order and in the adaptive
    policy's recency order (its last use that of the list's oldest key), and it
    ends the run: the next prompt's first chunk is not chained behind it. Switched
    off, the partial chunk is filed as any chain and the next prompt's chunk goes
    before it (the first victim of all the main keys)."""
    for rule in (True, False):
        p = (
            KvfsPolicy(without=frozenset() if rule else frozenset({"partial-first"}))
            if policy is KvfsPolicy
            else AdaptivePolicy(partial_first=rule)
        )
        for key in (1, 2, 3):
            p.track(key, SIZE, "old")  # 2 and 3 stay in probation
        p.touch(1, "engine")  # the cached prefix, read first: 1 enters main
        p.track(10, SIZE, "engine")  # a continuation of main: main too
        p.track(11, SIZE // 2, "engine")  # the prompt's partial last chunk
        p.track(20, SIZE, "engine")  # the next prompt's first chunk
        if not rule:
            assert order(p) == [2, 3, 20, 11, 10, 1]
            continue
        # the loop order evicts probation (2, 3) before main; the recency order
        # (the adaptive policy's first) is the lists merged by last use
        loop_order = policy is KvfsPolicy
        assert order(p) == ([2, 3, 11, 10, 1, 20] if loop_order else [11, 2, 3, 10, 1, 20])
        for partial in (21, 22):  # partial chunks again: each older still
            p.touch(1, "engine")
            p.track(partial, SIZE // 3, "engine")
            assert order(p)[0] == partial or loop_order
        for key in order(p):  # ghosts hand over a last use on the clock (not before it)
            p.remove(key)
            ghost = p.take_ghost(key)
            assert ghost is not None and 0 <= ghost < 1 << 256


def test_kvfs_learns_and_confirms_chains() -> None:
    policy = KvfsPolicy()
    for key in (1, 2, 3):
        policy.track(key, SIZE, "a")
    assert policy.statistics().chain_links == 0
    for key in (1, 2, 3):
        policy.touch(key, "a")
    assert policy.statistics().chain_links == 2  # 1->2 and 2->3 observed twice


def test_kvfs_streams_do_not_mix() -> None:
    policy = KvfsPolicy()
    for first, second in ((1, 101), (2, 102), (3, 103)):
        policy.track(first, SIZE, "a")
        policy.track(second, SIZE, "b")
    for first, second in ((1, 101), (2, 102), (3, 103)):
        policy.touch(first, "a")
        policy.touch(second, "b")
    policy.remove(1)
    assert policy.statistics().dead_keys == 1
    assert order(policy)[0] == 2  # 2's prefix 1 is gone; 101..103 are untouched


def test_kvfs_dead_tails_go_first_and_cascade() -> None:
    policy = KvfsPolicy()
    chain = [1, 2, 3, 4]
    for _ in range(2):
        for key in chain:
            policy.touch(key, "s") if key in policy else policy.track(key, SIZE, "s")
    policy.track(50, SIZE, "other")  # an unrelated, newer key
    policy.remove(2)  # the engine unlinked the middle of the chain
    victims = policy.victims()
    assert next(victims) == 3
    policy.remove(3)
    assert next(victims) == 4  # 4 became a dead tail while iterating
    policy.remove(4)
    assert 4 not in policy and 50 in policy


def test_kvfs_rewritten_prefix_revives_its_successor() -> None:
    policy = KvfsPolicy()
    for _ in range(2):
        for key in (1, 2):
            policy.touch(key, "s") if key in policy else policy.track(key, SIZE, "s")
    policy.remove(1)
    assert policy.statistics().dead_keys == 1
    policy.track(1, SIZE, "s")
    assert policy.statistics().dead_keys == 0


def test_kvfs_reused_chain_is_protected_over_new_data() -> None:
    policy = KvfsPolicy()
    for key in range(100, 110):
        policy.track(key, SIZE, "filler")
    for key in (1, 2, 3):
        policy.track(key, SIZE, "s")
    for key in (1, 2, 3):
        policy.touch(key, "s")  # round 2 re-reads the chain: promoted to main
    for key in (20, 21, 22):
        policy.track(key, SIZE, "t")  # one-off data of another stream (no read: LRU)
    assert policy.statistics().main_keys == 3
    assert order(policy)[-6:] == [20, 21, 22, 3, 2, 1]


def test_kvfs_loop_keeps_a_stable_subset() -> None:
    """A cyclic working set twice the capacity: LRU hits nothing, kvfs keeps some chains."""
    hits = {}
    for name in ("lru", "kvfs"):
        policy = make_policy(name)
        capacity, hit = 40, 0
        for _round in range(6):
            for user in range(8):
                chain = [user * 100 + i for i in range(10)]
                for key in chain:
                    if key in policy:
                        hit += 1
                        policy.touch(key, user)
                    else:
                        policy.track(key, SIZE, user)
                        while len(policy) > capacity:
                            policy.remove(next(policy.victims()))
        hits[name] = hit
    assert hits["lru"] == 0
    assert hits["kvfs"] >= 2 * 5 * 10  # at least 2 users' chains hit in rounds 2..6


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_remove_during_iteration_yields_every_key_once(name: str) -> None:
    policy = make_policy(name)
    for key in range(50):
        policy.track(key, SIZE, key % 3)
    for key in range(0, 50, 2):
        policy.touch(key, key % 3)
    seen = []
    for victim in policy.victims():
        seen.append(victim)
        if victim % 5:
            policy.remove(victim)  # keys divisible by 5 are "open": skipped
    assert sorted(seen) == list(range(50))
    assert sorted(policy.victims()) == list(range(0, 50, 5))


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_persist_recover_round_trip(name: str) -> None:
    policy = make_policy(name)
    rng = random.Random(5)
    run_ops(policy, rng, 400)
    image = policy.persist()
    copy = make_policy(name)
    copy.recover(image)
    assert order(copy) == order(policy)  # the weights are kept too (a version 2+ image)
    assert copy.persist() == image
    before, after = policy.statistics(), copy.statistics()
    assert (after.keys, after.bytes, after.main_keys, after.dead_keys, after.chain_links) == (
        before.keys,
        before.bytes,
        before.main_keys,
        before.dead_keys,
        before.chain_links,
    )


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_recover_rejects_every_corruption(name: str) -> None:
    policy = make_policy(name)
    run_ops(policy, random.Random(6), 60)
    image = policy.persist()
    target = make_policy(name)
    target.track(999, SIZE, "s")
    for index in range(len(image)):
        damaged = bytearray(image)
        damaged[index] ^= 0x41
        with pytest.raises(ValueError):
            target.recover(bytes(damaged))
    for bad in (b"", image[:-1], image + b"\0", b"\0" * 64):
        with pytest.raises(ValueError):
            target.recover(bad)
    assert list(target.victims()) == [999]  # a failed recover changes nothing


def test_recover_rejects_another_policy_kind() -> None:
    with pytest.raises(ValueError, match="another policy"):
        LRUPolicy().recover(FIFOPolicy().persist())


def run_ops(policy: EvictionPolicy, rng: random.Random, count: int) -> None:
    """Apply a seeded mix of track/touch/remove/evict operations."""
    for _ in range(count):
        key, op = rng.randrange(80), rng.random()
        stream = rng.randrange(3)
        if op < 0.45:
            policy.track(key, rng.randrange(1, 1000), stream)
        elif op < 0.8:
            policy.touch(key, stream)
        elif op < 0.9:
            policy.remove(key)
        elif len(policy):
            policy.remove(next(policy.victims()))


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_random_operations_keep_invariants(name: str) -> None:
    policy = make_policy(name)
    rng = random.Random(7)
    model: dict[int, int] = {}
    for _ in range(3000):
        key, op, stream = rng.randrange(60), rng.random(), rng.randrange(4)
        if op < 0.4:
            size = rng.randrange(1, 1000)
            policy.track(key, size, stream)
            model[key] = size
        elif op < 0.75:
            policy.touch(key, stream)
        elif op < 0.85:
            policy.remove(key)
            model.pop(key, None)
        elif model:
            victim = next(policy.victims())
            policy.remove(victim)
            del model[victim]
        stats = policy.statistics()
        assert stats.keys == len(model) == len(policy)
        assert stats.bytes == sum(model.values())
        assert stats.probation_keys + stats.main_keys + stats.dead_keys in (0, len(model))
        assert 0 <= stats.main_bytes <= stats.bytes
    assert sorted(policy.victims()) == sorted(model)
    policy.reset()
    assert len(policy) == 0 and policy.statistics().bytes == 0


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_memory_per_key_is_small_and_slots_are_reused(name: str) -> None:
    """Per-key state lives in parallel arrays: ~140 B/key for kvfs, ~105 B for LRU/FIFO
    (measured at 1 M keys in docs/eviction.md); evicted slots are reused."""
    keys = [random.Random(3).getrandbits(62) | (1 << 61) for _ in range(20_000)]
    tracemalloc.start()
    policy = make_policy(name)
    for index, key in enumerate(keys):
        policy.track(key, SIZE, index % 8)
    used, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert used / len(keys) < 200
    for index in range(20_000):  # churn: as many new keys again, 1000 resident
        policy.track(10**6 + index, SIZE, index % 8)
        while len(policy) > 1000:
            policy.remove(next(policy.victims()))
    ghosts = policy.statistics().ghost_keys
    assert len(policy) == 1000 and ghosts <= 1024
    expert: Any = policy.loop if isinstance(policy, AdaptivePolicy) else policy
    for table in [expert._slots]:
        assert len(table.index) == 1000 + expert.statistics().ghost_keys
        assert len(table.sparse_keys) <= 20_000  # no growth past the peak key count


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_keys_and_remove_many_match_victims_order(name: str) -> None:
    """``remove_many`` (recovery drops files gone since the checkpoint) removes in the
    order of a fresh ``victims()``, exactly as collecting then removing one by one."""
    for seed in range(40):
        rng = random.Random(seed)
        source = make_policy(name)
        run_ops(source, rng, rng.randrange(50, 1500))
        ref, fast = make_policy(name), make_policy(name)
        ref.recover(source.persist())
        fast.recover(source.persist())
        assert ref.keys() == fast.keys() == set(ref.victims())
        doomed = {key for key in range(80) if rng.random() < rng.random()}
        for key in [k for k in ref.victims() if k in doomed]:
            ref.remove(key)
        fast.remove_many(doomed)
        assert fast.persist() == ref.persist()
        assert order(fast) == order(ref)
        run_ops(ref, random.Random(seed), 200)
        run_ops(fast, random.Random(seed), 200)
        assert fast.persist() == ref.persist()


# A KvfsPolicy image written by kvfs 0.2.0 (the single-module kvfs/evict/policy.py): chain
# 5 -> 6 -> 7 read twice by stream "s", 20 and 21 written by "t", then 6 removed (7
# became a dead tail). Pools of that release carry such an image in their checkpoint.
RELEASE_0_2_IMAGE = bytes.fromhex(
    "4b5645500102030008000000000000000000000000000000010000000000000007000000000000000010"
    "000000000000060000000000000006000000000000000700000000000000020000000000000015000000"
    "000000001400000000000000002000000000000000200000000000001400000000000000ffffffffffff"
    "ffff08000000000000000700000000000000000000000000000000000000000000000100000000000000"
    "050000000000000000100000000000000700000000000000040000000000000006000000000000000100"
    "00000000000006000000000000000500000000000000227a6607"
)


def test_image_of_the_previous_release_is_recovered_unchanged() -> None:
    policy = KvfsPolicy()
    policy.recover(RELEASE_0_2_IMAGE)
    assert order(policy) == [7, 5, 21, 20]  # what 0.2.0 itself recovers from it
    stats = policy.statistics()
    assert (stats.keys, stats.dead_keys, stats.bytes) == (4, 1, 2 * 4096 + 2 * 8192)
    assert policy.persist_v1() == RELEASE_0_2_IMAGE  # the old encoder still agrees
    again = KvfsPolicy()  # and the version 2 image it now writes holds the same state
    again.recover(policy.persist())
    assert again.persist_v1() == RELEASE_0_2_IMAGE and order(again) == [7, 5, 21, 20]


def _add_file(ns: Namespace, ino: int, size: int, name: bytes | None = None) -> None:
    """File ``ino`` of ``size`` bytes (mtime ``ino``) named ``name`` in the root."""
    mode = stat.S_IFREG | 0o644
    ns.apply(InodeRecord(ino, mode, 0, 0, 1, size, 0, ino, 0, 0, array("q"), array("Q")))
    ns.apply(Dentry(ROOT_INO, name or b"f%d" % ino, ino))


def _namespace_with_files(sizes: dict[int, int]) -> Namespace:
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    for ino, size in sizes.items():
        _add_file(ns, ino, size)
    return ns


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_evictor_resumes_from_a_release_image_or_starts_fresh(name: str) -> None:
    """The mount's evictor recovers the saved image when it is its own policy's, keeps
    the residents of another policy's image, and starts afresh (never fails) on a
    damaged one; every file is tracked either way."""
    files = {5: 4096, 6: 4096, 7: 4096, 20: 8192, 21: 8192, 30: 100}
    for image, kept in ((RELEASE_0_2_IMAGE, True), (RELEASE_0_2_IMAGE[:-1] + b"\0", False)):
        ns = _namespace_with_files(files)
        ns.blobs[POLICY_BLOB] = image
        evictor = Evictor(ns, policy=name, alive=lambda pid: None)
        evictor.adopt_all()
        assert evictor.policy.keys() == set(files)
        victims = order(evictor.policy)
        if kept and name == "kvfs":  # the learned chain 5 -> 6 -> 7 survived
            assert evictor.policy.statistics().chain_links == 1
            assert victims.index(21) < victims.index(5)
        elif kept and name == "adaptive":  # the image whole in its loop expert, its
            # residents oldest first in the recency order, then the files it lacked
            assert evictor.policy.statistics().chain_links == 1
            assert sorted(victims[:4]) == [5, 7, 20, 21] and victims[4:] == [6, 30]
        elif kept:  # adopted in the image's order, then the files it lacked
            assert victims == [7, 21, 20, 5, 6, 30]
        else:  # fresh: every file in mtime order (mtime = inode here), oldest first
            assert victims == sorted(files)
        assert POLICY_BLOB not in ns.blobs  # read once: checkpoints carry payloads now
        evictor.save()
        again = make_policy(name)
        again.recover_pieces([p[2:] for p in ns.evictor_payloads if p[1:2] == PART_POLICY])
        assert again.keys() == set(files)
        if name != "kvfs":  # kvfs restarts its adaptive share, which reorders probation
            assert order(again) == victims


def test_prefix_lru_files_a_prompt_tail_first_and_sees_request_boundaries() -> None:
    policy = make_policy("prefix-lru")
    policy.track(1, SIZE, "e")
    policy.touch(1, "e")  # a prompt's cached prefix read by one engine,
    for key in (2, 3):  # then its missing chunks written in order
        policy.track(key, SIZE, "e")
    assert order(policy) == [3, 2, 1]  # LRU would evict 1 first and lose 2 and 3 with it
    policy.track(9, SIZE, "e")  # the next prompt starts with a new chunk
    for key in (1, 2, 3):  # the first prompt comes back: 1 follows 9, not its predecessor
        policy.touch(key, "e")
    assert order(policy) == [9, 3, 2, 1]
    lru = make_policy("lru")
    for key in (1, 2, 3, 9):
        lru.track(key, SIZE, "e")
    assert order(lru) == [1, 2, 3, 9]


def test_prefix_lru_files_a_writer_that_never_reads_like_lru() -> None:
    """A run of writes that no read began has no request boundary to see: chained,
    everything the process writes would be filed behind its first file and the
    newest written would leave first. It is filed like LRU (oldest leaves first)."""
    policy = make_policy("prefix-lru")
    for key in (1, 2, 3, 4):
        policy.track(key, SIZE, "w")
    assert order(policy) == [1, 2, 3, 4]
    policy.touch(2, "w")  # a read begins a run: what the stream writes next is chained
    policy.track(5, SIZE, "w")
    policy.track(6, SIZE, "w")
    assert order(policy) == [1, 3, 4, 6, 5, 2]


def test_a_prompts_partial_last_chunk_goes_first_and_ends_its_run() -> None:
    """A new chunk smaller than the chunk it follows (a prompt's partial last chunk)
    is filed oldest; the next prompt's chunks are not filed behind it; read again
    (the same prompt sent again) it is a use like any other. (``prefix-lru``, and so
    the adaptive policy's recency shadow; the loop expert has the rule too since
    session 29: ``test_a_prompts_partial_last_chunk_goes_first``.)"""
    policy = make_policy("prefix-lru")
    policy.track(1, SIZE, "e")
    policy.touch(1, "e")  # a cached prefix read, then the prompt's missing chunks
    policy.track(2, SIZE, "e")
    policy.track(3, SIZE // 3, "e")  # its partial last chunk
    assert order(policy) == [3, 2, 1]
    policy.track(7, SIZE, "e")  # the next prompt, nothing cached: not chained to 3
    policy.track(8, SIZE // 2, "e")  # a run no read began: no chain, no partial rule
    assert order(policy) == [3, 2, 1, 7, 8]
    for key in (1, 2, 3):  # the first prompt sent again: 3 is read like the others
        policy.touch(key, "e")
    assert order(policy)[0] == 7 and order(policy)[-3:] == [3, 2, 1]
    policy.touch(1, "f")  # another stream: the same rule, larger chunks are no partial
    policy.track(20, SIZE, "f")
    policy.track(21, 2 * SIZE, "f")
    assert order(policy)[-3:] == [21, 20, 1]


@pytest.mark.parametrize("name", ["prefix-lru", "kvfs", "adaptive"])
def test_a_partial_chunks_reused_number_never_files_the_next_prefix_oldest(name: str) -> None:
    """Keys are inode numbers, and a prompt's partial last chunk, evicted first, soon
    lends its number to another file. A use right after the stream created a key
    never follows a link to that key as a confirmed one: a read of the next
    prompt's prefix is a new request's first use, not a chain behind the tail (a
    mount caught ``prefix-lru`` filing the prefix behind a tail under the tail's
    reused number, as the oldest key: evicted the moment after its read; session 31)."""
    policy = make_policy(name)
    policy.track(1, SIZE, "e")  # the shared prefix
    policy.touch(1, "e")
    policy.track(10, SIZE, "e")
    policy.track(12, SIZE // 2, "e")  # prompt 1's partial last chunk
    policy.touch(1, "e")  # prompt 2 reads the prefix right after 12
    policy.track(20, SIZE, "e")
    policy.remove(12)  # the first victim goes; its number is free
    policy.track(12, SIZE // 2, "e")  # prompt 2's partial chunk takes number 12
    policy.touch(1, "e")  # prompt 3: the prefix read right after "12" again
    assert order(policy).index(1) > order(policy).index(20), order(policy)
    policy.track(30, SIZE, "e")  # prompt 3's chunk: behind its prefix in a chain order
    if name != "adaptive":  # (the adaptive policy's first order is by last use)
        assert order(policy).index(30) < order(policy).index(1), order(policy)


def _loop(policy: EvictionPolicy, rounds: int = 6) -> int:
    """8 users' prompts of 10 chunks after a shared one (a system prompt), in a
    loop over a cache of 40 chunks; returns the hits on the users' own chunks."""
    hit = 0
    for _round in range(rounds):
        for user in range(8):
            if 9999 in policy:
                policy.touch(9999, user)
            else:
                policy.track(9999, SIZE, user)
            for key in [user * 100 + i for i in range(10)]:
                if key in policy:
                    hit += 1
                    policy.touch(key, user)
                else:
                    policy.track(key, SIZE, user)
                    while len(policy) > 40:
                        policy.remove(next(policy.victims()))
    return hit


def test_adaptive_follows_the_loop_expert_on_a_loop_and_recency_on_recency() -> None:
    loop = AdaptivePolicy()
    assert _loop(loop) >= 2 * 5 * 10  # like kvfs, unlike LRU (0 hits)
    assert loop.weights[1] > 1.5 * loop.weights[0]  # its shadow leads by the margin
    assert loop._chosen == 1 and loop.switches[1] > 0
    recent = AdaptivePolicy()
    rng = random.Random(4)
    hits = {"adaptive": 0, "lru": 0}
    lru = make_policy("lru")
    for step in range(4000):  # a hot set that drifts: recency wins
        key = step // 20 + rng.randrange(30)
        for name, policy in (("adaptive", recent), ("lru", lru)):
            if key in policy:
                hits[name] += 1
                policy.touch(key, None)
            else:
                policy.track(key, SIZE, None)
                while len(policy) > 25:
                    policy.remove(next(policy.victims()))
    assert hits["adaptive"] >= hits["lru"] - 40, hits


def test_adaptive_image_holds_one_table_of_keys_and_refuses_a_mismatched_v1_order() -> None:
    """The image's table 0 is the loop expert's whole; table 1 holds no key (its
    scalars only, session 29). A release 0.3 image whose recency list lacks a
    resident key is refused, changing nothing."""
    policy = AdaptivePolicy()
    run_ops(policy, random.Random(9), 500)
    image = policy.persist()
    table1 = img.decode_pieces(img.split_pieces(image), img.KIND_ADAPTIVE, 4, 1, ["I", "I"], 1)
    assert table1.counts[1] == 0 and table1.scalars[2:4] == [0, 0]  # no key, no byte
    copy = AdaptivePolicy()
    copy.recover(image)
    assert copy.loop.persist_v1() == policy.loop.persist_v1()
    assert order(copy) == order(policy) and len(copy) == len(policy) > 0
    loop = img.decode(policy.loop.persist_v1(), img.KIND_KVFS, 3)
    recency = [array("q", policy.loop.recent_first())]
    recency += [array("q", map(policy.loop.size_of, recency[0]))]
    recency += [array("q", [-1]) * len(recency[0]), array("q", [0]) * len(recency[0])]
    recency += [array("q", [0]) * len(recency[0])]
    short = (recency[0][1:], recency[1][1:], recency[2][1:], recency[3][1:], recency[4][1:])
    forged = img.encode(
        img.KIND_ADAPTIVE, 0, 0, [*loop.lists, short], loop.ghost_keys, loop.ghost_last
    )
    with pytest.raises(ValueError, match="order"):
        copy.recover(forged)
    assert order(copy) == order(policy)


def test_evictor_shares_one_owner_tuple_per_process_and_reaps_it() -> None:
    """Ownership costs no tuple per file (memory per file, docs/eviction.md), and a
    process that exits still turns all of its files into orphans."""
    files = {ino: 100 for ino in range(2, 12)}
    ns = _namespace_with_files(files)
    alive = {1000: 7, 1001: 8}
    evictor = Evictor(ns, policy="adaptive", alive=alive.get, thread_group=lambda tid: tid)
    for ino in files:
        evictor.created(ns.inodes[ino], 1000 if ino % 2 else 1001)
        evictor.committed(ns.inodes[ino], 1000 if ino % 2 else 1001)
    owners = {id(evictor.owner_of(ino)) for ino in files}
    assert len(owners) == 2
    assert evictor.opened(ns.inodes[3], 1001) == (1001, 8)  # changes owner
    assert evictor.owner_of(3) is evictor.owner_of(2)
    del alive[1001]
    evictor._reaped = 0.0
    assert evictor.reap() == 6  # 2, 4, ..., 10 and 3
    assert set(evictor.orphans) == {2, 3, 4, 6, 8, 10}
    assert evictor.processes() == [(1000, 7)]
    assert [evictor.owner_of(ino) for ino in (2, 3, 5)] == [None, None, (1000, 7)]


def test_a_reaped_writers_files_turn_orphans_oldest_first() -> None:
    """Inode numbers are reused, so a writer's newest file may have its lowest
    number: its files join the orphan list (evicted first) in mtime order, oldest
    first, never in inode order -- else an engine's newest chunk goes first when
    it exits (a clean-clone run of the metadata pressure mount test saw it)."""
    mtimes = {9: 1, 12: 2, 4: 3, 15: 4, 2: 5, 7: 5}  # 2 and 7 tie: inode order
    ns = _namespace_with_files(dict.fromkeys(mtimes, 100))
    for ino, mtime in mtimes.items():
        ns.inodes[ino].mtime_ns = mtime
    alive = {1000: 7, 1001: 8}
    evictor = Evictor(ns, policy="lru", alive=alive.get, thread_group=lambda tid: tid)
    for ino in mtimes:
        writer = 1001 if ino == 12 else 1000
        evictor.created(ns.inodes[ino], writer)
        evictor.committed(ns.inodes[ino], writer)
    del alive[1000], alive[1001]
    evictor._reaped = 0.0
    assert evictor.reap() == 6
    assert list(evictor.orphans) == [9, 12, 4, 15, 2, 7]  # both writers' files, merged
    victims = [inode.ino for inode, orphan in evictor.candidates(lambda inode: True)]
    assert victims[:6] == [9, 12, 4, 15, 2, 7]


@pytest.mark.parametrize("source", POLICY_NAMES)
def test_every_policy_adopts_every_other_policys_image(source: str) -> None:
    """A pool remounted with another ``--eviction`` keeps its residents (and the kvfs
    policy's learned state when one side is kvfs and the other adaptive)."""
    writer = make_policy(source)
    run_ops(writer, random.Random(11), 400)
    image = writer.persist()
    for name in POLICY_NAMES:
        reader = make_policy(name)
        if name == source:
            reader.recover(image)
        else:
            with pytest.raises(ValueError):
                reader.recover(image)
            assert reader.recover_foreign(image)
        assert reader.keys() == writer.keys()
        assert reader.statistics().bytes == writer.statistics().bytes
    kvfs = KvfsPolicy()
    if source == "adaptive":
        assert kvfs.recover_foreign(image)
        assert kvfs.persist_v1() == writer.loop.persist_v1()  # type: ignore[attr-defined]


def test_a_ghost_handed_over_lets_a_rewritten_file_hit_it() -> None:
    """On a mount a chunk written again after its eviction is a new inode: with its
    ghost handed over (``take_ghost`` / ``put_ghost``) the policy still sees the
    ghost hit (kvfs: admission to main; adaptive: a regret), without it the rewrite
    looks like a brand-new key."""
    results = {}
    for hand_over in (False, True):
        policy = KvfsPolicy()
        for key in range(2, 12):
            policy.track(key, SIZE, "s")
        policy.remove(5)  # evicted
        assert policy.take_ghost(6) is None  # resident: no ghost
        if hand_over:
            ghost = policy.take_ghost(5)
            assert ghost is not None and policy.take_ghost(5) is None
            assert policy.statistics().ghost_keys == 0
            policy.put_ghost(105, ghost)
            assert 105 not in policy and policy.statistics().ghost_keys == 1
        policy.track(105, SIZE, "s")  # the same chunk, a new inode
        results[hand_over] = policy.statistics()
    assert results[False].main_keys == 0 and results[True].main_keys == 1
    assert results[True].ghost_keys == 0
    lru = make_policy("lru")
    lru.track(2, SIZE, "s")
    lru.remove(2)
    assert lru.take_ghost(2) is None  # no ghosts kept
    adaptive = AdaptivePolicy()
    _loop(adaptive, rounds=3)
    victim = next(adaptive.victims())
    adaptive.remove(victim)
    ghost = adaptive.take_ghost(victim)
    assert ghost is not None
    adaptive.put_ghost(5000, ghost)
    assert adaptive.loop.statistics().ghost_keys > 0 and 5000 not in adaptive


def test_shadows_know_a_rewritten_chunk_by_its_identity() -> None:
    """On a mount a chunk written again is a new inode: the shadows key it by the
    identity the evictor tells (its name), so a shadow that still holds the chunk
    scores a hit however long ago the real cache lost it (no ghost needed)."""
    adaptive = AdaptivePolicy()
    for ino in range(2, 12):  # ten chunks, identities 100 + ino
        adaptive.identify(ino, 100 + ino)
        adaptive.track(ino, SIZE, "s")
    assert adaptive._chunk(5) == 105 and adaptive._chunk(99) is None  # never named
    adaptive.remove(5)  # evicted (no ghost handed over)
    assert adaptive._chunk(5) is None
    held = [105 in shadow for shadow in adaptive.duel.shadows]
    assert held == [True, True]  # the shadows are caches of their own
    before = list(adaptive.duel.scores)
    adaptive.identify(40, 105)  # the chunk written again, as inode 40
    adaptive.track(40, SIZE, "t")
    assert all(a > b for a, b in zip(adaptive.duel.scores, before, strict=True))
    adaptive.identify(41, 999)  # another chunk: a miss in both shadows
    before = list(adaptive.duel.scores)
    adaptive.track(41, SIZE, "u")
    assert all(a < b for a, b in zip(adaptive.duel.scores, before, strict=True))


def test_the_sampled_identities_are_those_the_sample_keeps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The policy keeps a file's identity only while the shadows' sample takes it:
    as the pool fills and the sample grows, and when a remounted pool's files are
    read before any write, the identities told under a finer sample are not kept
    (they were once, one per file, where the sample was 1)."""
    from kvfs.evict.policy import duel as duel_mod

    monkeypatch.setattr(duel_mod, "SHADOW_KEYS", 8)

    def ident(ino: int) -> int:
        return ino * 2654435761 % (1 << 40)

    def expected(policy: AdaptivePolicy) -> dict[int, int]:
        sample, resident = policy.duel.sample, policy.keys()
        return {k: ident(k) for k in resident if ident(k) % sample == 0}

    filling = AdaptivePolicy()
    for ino in range(2, 3000):  # a pool filling up: the sample grows to 256
        filling.identify(ino, ident(ino))
        filling.track(ino, SIZE, ino % 7)
        if ino % 3 == 0:
            filling.identify(ino - 1, ident(ino - 1))
            filling.touch(ino - 1, ino % 7)
    assert filling.duel.sample == 256
    assert filling._chunks == expected(filling)
    for ino in range(2, 1000):  # evicted: forgotten
        filling.remove(ino)
    assert filling._chunks == expected(filling)

    remounted = AdaptivePolicy()  # a remount: adopted in bulk, then read
    keys = array("q", range(2, 3000))
    remounted.adopt(keys, array("q", [SIZE]) * len(keys))
    for ino in keys:
        remounted.identify(ino, ident(ino))
        remounted.touch(ino, "reader")
    assert remounted.duel.sample == 256
    assert remounted._chunks == expected(remounted) and len(remounted._chunks) < 40


def test_a_reused_number_drops_the_ghost_it_held() -> None:
    """The namespace hands a gone inode's number to the next file: that file is new,
    not a rewrite of the gone one, so no ghost hit (kvfs) and no regret (adaptive)."""
    policy = KvfsPolicy()
    for key in range(2, 12):
        policy.track(key, SIZE, "s")
    policy.remove(5)
    policy.take_ghost(5)  # dropped: the number goes to a new file
    assert policy.statistics().ghost_keys == 0
    policy.take_ghost(6)  # resident: unchanged
    assert 6 in policy
    policy.track(5, SIZE, "t")
    assert policy.statistics().main_keys == 0  # an ordinary newcomer (probation)


def test_shadows_count_hits_under_the_prefix_rule() -> None:
    """A shadow hit on a chunk that continues its stream's chain counts only if the
    chain's earlier chunk was a hit in that shadow too."""
    duel = Duel((lambda: make_policy("lru"), lambda: make_policy("fifo")))  # type: ignore[arg-type, return-value]
    for key in (1, 2, 3):  # a prompt's chain, written
        duel.access(key, SIZE, "s", 3, 3 * SIZE)
    assert duel.scores == [0.0, 0.0]
    for key in (1, 2, 3):  # read again: three hits in both
        duel.access(key, SIZE, "s", 3, 3 * SIZE)
    assert duel.scores[0] > 2.9 and duel.scores[1] > 2.9
    duel.shadows[0].remove(1)  # shadow 0 lost the head of the chain
    before = list(duel.scores)
    for key in (1, 2, 3):
        duel.access(key, SIZE, "s", 3, 3 * SIZE)
    assert duel.scores[0] < before[0]  # no hit counted (only decay)
    assert duel.scores[1] > before[1] + 2.5  # three hits, less the decay


def test_shadows_are_counterfactual_and_pick_the_leader_with_a_margin() -> None:
    """Each shadow holds what its expert alone would hold; the leader changes only
    when the other's score is ``margin`` times the current one's."""
    duel = Duel((lambda: make_policy("lru"), lambda: make_policy("fifo")))  # type: ignore[arg-type, return-value]
    for step in range(200):  # one hot key among a scan: LRU always keeps it, FIFO not
        duel.access(0, SIZE, None, 8, 8 * SIZE)
        duel.access(1000 + step, SIZE, None, 8, 8 * SIZE)
    assert 0 in duel.shadows[0] and duel.scores[0] > duel.scores[1]
    assert duel.leader(0) == 0
    duel.scores = [1.0, 1.4]
    assert duel.leader(0) == 0  # within the margin: keep following
    duel.scores = [1.0, 1.6]
    assert duel.leader(0) == 1 and duel.leader(1) == 1
    assert all(shadow._bytes <= 8 * SIZE for shadow in duel.shadows)


def test_a_hold_asks_the_lead_to_last_turnovers_before_a_switch() -> None:
    """With ``hold`` h the other expert is followed only once its lead by the margin
    has lasted h turnovers of sampled accesses without a break; a break restarts
    the count; hold 0 (the default) switches on the lead alone."""

    def duel_with(hold: float) -> Duel:
        return Duel((lambda: make_policy("lru"), lambda: make_policy("fifo")), hold=hold)  # type: ignore[arg-type, return-value]

    def misses(duel: Duel, count: int, start: int) -> None:
        for key in range(start, start + count):  # both shadows miss: scores only decay
            duel.access(key, SIZE, None, 8, 8 * SIZE)

    turnover = 64  # 8 keys resident: the floor
    instant, held = duel_with(0.0), duel_with(1.0)
    for duel in (instant, held):
        duel.scores = [10.0, 1.0]  # expert 0 leads by far more than the margin
        misses(duel, 10, 1000)
        assert duel.ahead(1) == 0 and duel.held == [10, 0]
    assert instant.leader(1) == 0  # hold 0: the lead is enough
    assert held.leader(1) == 1  # the lead is younger than a turnover
    misses(held, turnover - 10, 2000)
    assert held.leader(1) == 0 and held.leader(0) == 0
    held.scores = [1.0, 1.0]  # the lead breaks: its age starts again
    misses(held, 1, 3000)
    held.scores = [10.0, 1.0]
    misses(held, turnover - 1, 4000)
    assert held.held == [turnover - 1, 0] and held.leader(1) == 1
    with pytest.raises(ValueError, match="hold"):
        AdaptivePolicy(hold=-1.0)


def test_shadows_sample_a_large_cache_and_stay_small() -> None:
    """Past twice SHADOW_KEYS resident keys the sample doubles (the shadows
    restart, the scores stay); a shadow holds 1/sample of the cache's bytes."""
    from kvfs.evict.policy import duel as duel_mod

    duel = Duel((lambda: make_policy("lru"), lambda: make_policy("lru")))  # type: ignore[arg-type, return-value]
    resident = 8 * duel_mod.SHADOW_KEYS
    duel.resize(resident)
    assert duel.sample == 4
    for key in range(40_000):
        duel.access(key, SIZE, None, resident, resident * SIZE)
    assert len(duel.shadows[0]) == 10_000  # every 4th chunk: all fit in 1/4 of the cache
    duel.scores = [5.0, 5.0]
    duel.resize(4 * resident)
    assert duel.sample == 16 and len(duel.shadows[0]) == 0 and duel.scores == [5.0, 5.0]
    duel.resize(resident)
    assert duel.sample == 16  # never finer


def test_evictor_tells_a_files_identity_by_its_name() -> None:
    """A chunk written again under its gone file's name is a new inode: the
    evictor tells the adaptive policy the same identity; another name another."""
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    _add_file(ns, 5, 100, b"chunk-a")
    _add_file(ns, 6, 100, b"chunk-b")
    evictor = Evictor(ns, policy="adaptive", alive=lambda pid: None, thread_group=lambda t: t)
    policy = evictor.policy
    assert isinstance(policy, AdaptivePolicy)
    for ino in (5, 6):
        evictor.committed(ns.inodes[ino], 0)
    victim = next(policy.victims())
    chunk = policy._chunk(victim)
    assert chunk is not None  # (one in one is sampled: a small cache)
    name = ns.inodes[victim].name
    ns.remove(ROOT_INO, name, want_dir=False)
    evictor.forget(victim)
    _add_file(ns, 9, 100, name)  # the same name, a new inode
    evictor.committed(ns.inodes[9], 0)
    assert policy._chunk(9) == chunk
    _add_file(ns, 10, 100, b"unrelated")
    evictor.committed(ns.inodes[10], 0)
    assert policy._chunk(10) not in (None, chunk)  # another name: another chunk


def test_evictor_keeps_a_ghost_with_the_name_not_the_reused_inode_number() -> None:
    """The namespace reuses a gone inode's number for the next file: that file must
    not hit the gone one's ghost, while a file written under the gone one's name
    (at whatever number) must. Before, the ghost stayed under the number: on a
    replay of multi-round QA every new file was a ghost hit (admitted to main) and
    the kvfs policy fell to LRU's hit rate on a mount (14.6 % against 38.8 %
    simulated)."""
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    for ino in range(5, 15):
        _add_file(ns, ino, 100, b"chunk-%d" % ino)
    evictor = Evictor(ns, policy="kvfs", alive=lambda pid: None, thread_group=lambda t: t)
    policy = evictor.policy
    for ino in range(5, 15):
        evictor.committed(ns.inodes[ino], 0)
    victim = next(policy.victims())
    name = ns.inodes[victim].name
    ns.remove(ROOT_INO, name, want_dir=False)  # evicted: the store drops its name, then
    evictor.forget(victim)
    assert policy.statistics().ghost_keys == 0  # the ghost went with the name
    _add_file(ns, victim, 100, b"unrelated")  # the number reused by another file
    evictor.committed(ns.inodes[victim], 0)
    assert policy.statistics().main_keys == 0  # a newcomer, no ghost hit
    _add_file(ns, 20, 100, name)  # the gone chunk written again, a new number
    evictor.committed(ns.inodes[20], 0)
    assert policy.statistics().main_keys == 1  # its ghost hit: admitted to main


def test_store_config_takes_the_grace_and_rejects_a_negative_one() -> None:
    from kvfs.store.facade import StoreConfig

    assert StoreConfig().fresh_grace == 5.0
    assert StoreConfig(fresh_grace=0).fresh_grace == 0
    with pytest.raises(ValueError, match="fresh_grace"):
        StoreConfig(fresh_grace=-1)


def test_the_grace_protects_at_most_its_byte_bound_longest_closed_first() -> None:
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    for ino in range(5, 25):
        _add_file(ns, ino, 100, b"chunk-%d" % ino)
    evictor = Evictor(
        ns, policy="lru", alive=lambda pid: None, thread_group=lambda t: t, grace_bytes=350
    )
    for ino in range(5, 25):
        evictor.committed(ns.inodes[ino], 0)
        assert evictor.fresh_bytes() <= 350 and evictor.fresh() >= 1
    assert evictor.fresh() == 3 and evictor.fresh_bytes() == 300  # the newest three
    everything = lambda inode: True  # noqa: E731
    order = [inode.ino for inode, _ in evictor.candidates(everything)]
    assert order == list(range(5, 22))  # the policy's (LRU) order, past the grace's three
    last = [inode.ino for inode, _ in evictor.candidates(everything, include_fresh=True)]
    assert last == [22, 23, 24]  # and they go last, the longest closed first
    evictor.forget(23)
    assert evictor.fresh() == 2 and evictor.fresh_bytes() == 200
    big = Evictor(
        ns, policy="lru", alive=lambda pid: None, thread_group=lambda t: t, grace_bytes=50
    )
    big.committed(ns.inodes[5], 0)
    big.committed(ns.inodes[6], 0)
    assert big.fresh() == 1  # a file over the bound alone keeps its grace
    for ino in range(7, 15):  # eight writers, one file each: each keeps its newest
        big.committed(ns.inodes[ino], ino)
    big.committed(ns.inodes[15], 7)  # writer 7's second: its first loses the grace
    assert set(big._fresh) == {6, *range(8, 15), 15}  # writer 0's 6 too
    big.forget(15)
    big.committed(ns.inodes[16], 99)
    assert set(big._fresh) == {6, *range(8, 15), 16}  # writer 7 has none left
    unbounded = Evictor(ns, policy="lru", alive=lambda pid: None, thread_group=lambda t: t)
    for ino in range(5, 25):
        unbounded.committed(ns.inodes[ino], 0)
    assert unbounded.fresh() == 20
