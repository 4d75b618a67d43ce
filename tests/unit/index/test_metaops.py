"""O(1) metadata bookkeeping without a mount: the namespace's file and directory
counters, statistics that never walk the index, the allocator's cheap run
statistics, and group byte counts that follow a rename instead of being recounted."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import stat
from typing import NoReturn

import pyfuse3
import pytest

from kvfs.common.errors import KvfsError, QuotaExceeded
from kvfs.devices import alloc as alloc_mod
from kvfs.devices.alloc import Allocator
from kvfs.evict.groups import QUOTA_XATTR
from kvfs.format.records import encode_ops
from kvfs.fuse.ops import Operations
from kvfs.index.inodes import InodeTable
from kvfs.index.namespace import ROOT_INO, Namespace
from kvfs.store.facade import Store
from tests.unit.index.test_namespace import Fuzzer, replayed
from tests.unit.store.test_store import CFG, get, memory_pool, put, serving

DIR = stat.S_IFDIR | 0o755
FILE = stat.S_IFREG | 0o644


def walked_counts(ns: Namespace) -> tuple[int, int]:
    dirs = sum(1 for i in ns.inodes.values() if i.is_dir)
    return len(ns.inodes) - dirs, dirs


def counts(ns: Namespace) -> tuple[int, int]:
    return ns.file_count, ns.dir_count


# ---------------------------------------------------------------- namespace counters
@pytest.mark.parametrize("seed", range(4))
def test_counters_follow_random_operations_replay_and_snapshots(seed: int) -> None:
    fz = Fuzzer(500 + seed)
    for n in range(500):
        with contextlib.suppress(KvfsError):
            fz.step()
        assert counts(fz.ns) == walked_counts(fz.ns), n
    assert fz.ns.dir_count > 1 and fz.ns.file_count > 1
    again = replayed(fz.lg.txns)
    assert counts(again) == walked_counts(again) == counts(fz.ns)
    snap = replayed([encode_ops(list(fz.ns.snapshot()))])
    assert counts(snap) == counts(fz.ns)


def _walk(*args: object) -> NoReturn:
    pytest.fail("statistics walked the inode table")


async def test_statistics_df_and_stats_never_walk_the_inodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with serving(memory_pool()) as store:
        await store.make(ROOT_INO, b"d", DIR)
        for i in range(20):
            await put(store, b"f%d" % i, b"x" * (i * 1000))
        ops = Operations(store)
        # (keys, values, items and len-free views all iterate through __iter__)
        monkeypatch.setattr(InodeTable, "__iter__", _walk)
        st = store.statistics()
        assert (st.files, st.directories) == (20, 2)
        vfs = await ops.statfs(None)
        assert vfs.f_ffree == vfs.f_files - 22
        stats = ops.stats_json()
        assert '"files": 20' in stats and '"directories": 2' in stats
        store.maybe_drop(store.ns.remove(ROOT_INO, b"f3", want_dir=False))
        store.maybe_drop(store.ns.remove(ROOT_INO, b"d", want_dir=True))
        st = store.statistics()
        assert (st.files, st.directories) == (19, 1)
        monkeypatch.undo()  # for the store's teardown


async def test_counters_after_recovery_drops_unfinished_files() -> None:
    """Recovery removes files a crash left mid-write (not through ``drop``): the
    counters must agree with the table afterwards."""
    pool = memory_pool()
    async with serving(pool) as store:
        await put(store, b"done", b"y" * 5000)
        await store.make(ROOT_INO, b"sub", DIR)
        await store.create(ROOT_INO, b"unfinished", FILE)  # WRITING
        await store.journal.wait_durable()
        before = counts(store.ns)
    assert before == (2, 2)
    from tests.unit.store.test_store import crash_image

    again = Store(crash_image(pool), CFG)
    report = again.load()
    assert counts(again.ns) == walked_counts(again.ns) == (1, 2)
    assert (report.files, report.directories) == (1, 2)


# ---------------------------------------------------------------- allocator statistics
def brute(alloc: Allocator) -> tuple[int, int]:
    runs = [len(r) for m in alloc._maps for r in m.split(b"\x01") if r]
    return len(runs), max(runs, default=0)


@pytest.mark.parametrize("seed", range(4))
def test_allocator_run_statistics_across_small_chunks(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs that span chunk summaries (8 units each here) are joined right."""
    monkeypatch.setattr(alloc_mod, "SUMMARY_UNITS", 8)
    rng = random.Random(seed)
    alloc = Allocator([61, 8, 130])
    held: list[tuple[int, int, int]] = []
    for _ in range(400):
        if held and (rng.random() < 0.45 or alloc.free_units < 20):
            dev, start, count = held.pop(rng.randrange(len(held)))
            cut = rng.randrange(count)  # free in two pieces, in random order
            pieces = [(start, cut), (start + cut, count - cut)]
            rng.shuffle(pieces)
            for s, c in pieces:
                if c:
                    alloc.free(dev, s, c)
        else:
            held += alloc.allocate(rng.randrange(1, 20), rng.randrange(3))
        if rng.random() < 0.3:
            st = alloc.statistics()
            assert (st.free_runs, st.largest_free_run) == brute(alloc)
    st = alloc.statistics()
    assert (st.free_runs, st.largest_free_run) == brute(alloc)


def test_allocator_statistics_redo_only_changed_chunks() -> None:
    units = 40 * alloc_mod.SUMMARY_UNITS  # a 2.5 TiB device of 1 MiB units
    alloc = Allocator([units])
    assert alloc.statistics().largest_free_run == units
    alloc.allocate(3, 0)
    assert len(alloc._stale[0]) == 1  # one chunk to summarise again, not 40
    st = alloc.statistics()
    assert (st.free_runs, st.largest_free_run, st.free_units) == (1, units - 3, units - 3)
    assert not alloc._stale[0]


# ---------------------------------------------------------------- groups across renames
def usage_walked(store: Store, group: int) -> int:
    """A group's bytes by a walk of its subtree (what the counters must equal)."""
    total, stack = 0, [group]
    while stack:
        node = store.ns.inodes[stack.pop()]
        if node.entries is None:
            total += node.mapped_units * store.unit
        else:
            stack.extend(node.entries.values())
    return total


async def test_a_file_renamed_to_another_group_takes_its_bytes_along() -> None:
    unit = 64 * 1024
    async with serving(memory_pool(size=32 << 20)) as store:
        a = await store.make(ROOT_INO, b"a", DIR)
        b = await store.make(ROOT_INO, b"b", DIR)
        for g in (a, b):
            store.ns.set_xattr(g.ino, QUOTA_XATTR, b"%d" % (8 * unit))
        data = random.Random(1).randbytes(5 * unit)
        ino = await put(store, b"f", data)
        store.rename(ROOT_INO, b"f", a.ino, b"f", 0)
        assert store.space.group_usage(a.ino) == 5 * unit
        assert store.space.group_usage(b.ino) == 0
        store.rename(a.ino, b"f", b.ino, b"g", 0)
        assert store.space._tree == {b.ino: 5 * unit}  # moved, not recounted
        assert usage_walked(store, a.ino) == 0 and usage_walked(store, b.ino) == 5 * unit
        assert await get(store, ino) == data
        # b's quota now holds the file: 4 more units do not fit there, but do in a
        fh = await store.open((await store.create(b.ino, b"h", FILE)).ino, os.O_RDWR)
        with pytest.raises(QuotaExceeded):
            await store.write(fh, 0, b"z" * (4 * unit))
        await store.release(fh)
        fh = await store.open((await store.create(a.ino, b"h", FILE)).ino, os.O_RDWR)
        assert await store.write(fh, 0, b"z" * (4 * unit)) == 4 * unit
        await store.release(fh)
        # a directory moved between groups takes its subtree's count along
        sub = await store.make(b.ino, b"sub", DIR)
        store.rename(b.ino, b"g", sub.ino, b"g", 0)
        store.rename(b.ino, b"sub", a.ino, b"sub", 0)
        assert store.space.group_usage(a.ino) == 9 * unit == usage_walked(store, a.ino)
        assert store.space.group_usage(b.ino) == 0 == usage_walked(store, b.ino)
        assert await get(store, ino) == data


# ---------------------------------------------------------------- security labels
async def getxattr_errno(ops: Operations, ino: int, name: bytes) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await ops.getxattr(ino, name, None)
    return e.value.errno


async def test_a_pool_without_security_labels_says_so_for_a_missing_one() -> None:
    async with serving(memory_pool()) as store:
        ino = await put(store, b"f", b"data")
        other = await put(store, b"g", b"more")
        ops = Operations(store)
        assert await getxattr_errno(ops, ino, b"security.selinux") == errno.EOPNOTSUPP
        await ops.setxattr(ino, b"user.x", b"1", None)
        assert await ops.getxattr(ino, b"user.x", None) == b"1"
        assert await getxattr_errno(ops, ino, b"user.y") == errno.ENODATA
        await ops.setxattr(ino, b"security.s", b"3", None)
        assert await ops.getxattr(ino, b"security.s", None) == b"3"
        assert await getxattr_errno(ops, other, b"security.selinux") == errno.ENODATA
        assert Operations(store).labels  # the next mount finds the label
        await ops.removexattr(ino, b"security.s", None)
        assert await getxattr_errno(ops, ino, b"security.s") == errno.ENODATA


async def test_the_kernel_keeps_no_attributes_of_a_file_still_being_written() -> None:
    """A file not yet committed may get its size behind the kernel (a ring path
    write's commit), so its attributes are answered uncacheable; once committed they
    are cached as any file's. (A lookup answered with size 0 just before such a
    commit, reaching the kernel after it, made readers see the file empty.)"""
    async with serving(memory_pool()) as store:
        ops = Operations(store)
        inode = await store.create(ROOT_INO, b"new", FILE)  # WRITING
        entry = await ops.lookup(ROOT_INO, b"new")
        assert entry.st_ino == inode.ino and entry.attr_timeout == 0
        assert (await ops.getattr(inode.ino)).attr_timeout == 0
        await put(store, b"done", b"x" * 5000)
        done = await ops.lookup(ROOT_INO, b"done")
        assert done.st_size == 5000 and done.attr_timeout > 0
