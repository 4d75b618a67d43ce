"""Unit tests of kvfs.index.namespace: POSIX name semantics, nlink bookkeeping, xattrs, and
replay: the logged operations (or a snapshot) rebuild an identical namespace."""

from __future__ import annotations

import contextlib
import errno
import itertools
import random
import stat
import time
from array import array
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvfs.common.errors import (
    Exists,
    InvalidArgument,
    IsADirectory,
    KvfsError,
    NameTooLong,
    NoAttribute,
    NoSpace,
    NotADirectory,
    NotEmpty,
    NotFound,
    NotPermitted,
    Stale,
    TooBig,
)
from kvfs.format import nsimage
from kvfs.format.records import (
    FLAG_GONE,
    FLAG_WRITING,
    NO_UNIT,
    Op,
    Xattr,
    decode_ops,
    encode_ops,
    phys,
)
from kvfs.index import columns
from kvfs.index.columns import MIGRATE_STEP, ROWS, SHIFT, TOMB
from kvfs.index.namespace import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT_INO,
    XATTR_FILE_MAX,
    XATTR_VALUE_MAX,
    Inode,
    Namespace,
)

FILE = stat.S_IFREG | 0o644
DIR = stat.S_IFDIR | 0o755
R = ROOT_INO


class Logged:
    """A namespace plus every transaction it logged, encoded at log time like the
    journal does (records share the inode's unit arrays, which change later)."""

    def __init__(self) -> None:
        self.txns: list[bytes] = []
        self.ns = Namespace(self._log)
        self.ns.init_root(0, 0)

    def _log(self, ops: list[Op]) -> None:
        self.txns.append(encode_ops(ops))


def state(ns: Namespace) -> dict[int, tuple[Any, ...]]:
    """Everything persistent about a namespace, comparable with ==."""
    out: dict[int, tuple[Any, ...]] = {}
    for ino, i in ns.inodes.items():
        out[ino] = (
            i.mode,
            i.uid,
            i.gid,
            i.nlink,
            i.size,
            i.atime_ns,
            i.mtime_ns,
            i.ctime_ns,
            i.flags,
            list(i.units),
            list(i.csums),
            None if i.entries is None else dict(i.entries.items()),
            i.parent if i.is_dir else None,
            i.xattrs or {},
        )
    return out


def replayed(txns: list[bytes]) -> Namespace:
    fresh = Namespace(lambda ops: pytest.fail("replay must not log"))
    for raw in txns:
        for op in decode_ops(raw):
            fresh.apply(op)
    return fresh


def assert_same(a: Namespace, b: Namespace) -> None:
    assert state(a) == state(b)
    assert a.blobs == b.blobs
    assert b.next_ino > max(b.inodes)


@pytest.fixture
def lg() -> Logged:
    return Logged()


def mk(ns: Namespace, parent: int, name: bytes, mode: int = FILE) -> Inode:
    return ns.make(parent, name, mode, 1000, 1000)


# ----------------------------------------------------------------------------- basics
def test_make_lookup_and_errors(lg: Logged) -> None:
    ns = lg.ns
    f = mk(ns, R, b"f")
    d = mk(ns, R, b"d", DIR)
    assert ns.lookup(R, b"f") is f and ns.lookup(R, b"d") is d
    assert ns.lookup(d.ino, b"..").ino == R and ns.lookup(d.ino, b".") is d
    assert (f.nlink, d.nlink, ns.get(R).nlink) == (1, 2, 3)
    with pytest.raises(Exists):
        mk(ns, R, b"f")
    with pytest.raises(NotFound):
        ns.lookup(R, b"missing")
    with pytest.raises(NotADirectory):
        mk(ns, f.ino, b"x")
    with pytest.raises(NotADirectory):
        ns.lookup(f.ino, b"x")
    with pytest.raises(NameTooLong):
        mk(ns, R, b"n" * 256)
    with pytest.raises(NameTooLong):
        ns.lookup(R, b"n" * 256)
    mk(ns, R, b"n" * 255)
    for bad in (b"", b".", b"..", b"a/b", b"a\0b"):
        with pytest.raises(InvalidArgument):
            mk(ns, R, bad)
    for kind in (stat.S_IFIFO, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFSOCK, stat.S_IFLNK):
        with pytest.raises(NotPermitted):
            mk(ns, R, b"special", kind | 0o644)
    with pytest.raises(NotFound):
        ns.get(12345)
    with pytest.raises(NotFound):
        mk(ns, 12345, b"x")


def test_link_and_remove_keep_nlink_right(lg: Logged) -> None:
    ns = lg.ns
    f = mk(ns, R, b"f")
    d = mk(ns, R, b"d", DIR)
    assert ns.link(f.ino, d.ino, b"g") is f and f.nlink == 2
    assert ns.lookup(d.ino, b"g") is f
    with pytest.raises(Exists):
        ns.link(f.ino, R, b"d")
    with pytest.raises(IsADirectory):
        ns.link(d.ino, R, b"dd")
    with pytest.raises(IsADirectory):
        ns.remove(R, b"d", want_dir=False)
    with pytest.raises(NotADirectory):
        ns.remove(R, b"f", want_dir=True)
    with pytest.raises(NotEmpty):
        ns.remove(R, b"d", want_dir=True)
    with pytest.raises(NotFound):
        ns.remove(R, b"nope", want_dir=False)
    assert ns.remove(R, b"f", want_dir=False) is f and f.nlink == 1
    assert ns.remove(d.ino, b"g", want_dir=False) is f and f.nlink == 0
    assert f.ino in ns.inodes  # dropping is the caller's decision (open files)
    ns.drop(f)
    assert f.ino not in ns.inodes
    root_links = ns.get(R).nlink
    assert ns.remove(R, b"d", want_dir=True) is d and d.nlink == 0
    assert ns.get(R).nlink == root_links - 1


def test_rename_plain_replace_and_noreplace(lg: Logged) -> None:
    ns = lg.ns
    a, b = mk(ns, R, b"a"), mk(ns, R, b"b")
    d = mk(ns, R, b"d", DIR)
    assert ns.rename(R, b"a", d.ino, b"a2") is None
    assert ns.lookup(d.ino, b"a2") is a
    with pytest.raises(NotFound):
        ns.lookup(R, b"a")
    with pytest.raises(Exists):
        ns.rename(d.ino, b"a2", R, b"b", RENAME_NOREPLACE)
    assert ns.lookup(R, b"b") is b
    victim = ns.rename(d.ino, b"a2", R, b"b")
    assert victim is b and b.nlink == 0 and ns.lookup(R, b"b") is a
    with pytest.raises(NotFound):
        ns.rename(R, b"zz", R, b"b")
    ns.link(a.ino, R, b"hard")
    assert ns.rename(R, b"hard", R, b"b") is None  # same inode: nothing happens
    assert ns.lookup(R, b"hard") is a and a.nlink == 2
    with pytest.raises(InvalidArgument):
        ns.rename(R, b"b", R, b"..")


def test_rename_directory_rules(lg: Logged) -> None:
    ns = lg.ns
    d1, d2 = mk(ns, R, b"d1", DIR), mk(ns, R, b"d2", DIR)
    sub = mk(ns, d1.ino, b"sub", DIR)
    mk(ns, d2.ino, b"child")
    mk(ns, R, b"f")
    empty = mk(ns, R, b"empty", DIR)
    with pytest.raises(InvalidArgument):
        ns.rename(R, b"d1", d1.ino, b"x")  # into itself
    with pytest.raises(InvalidArgument):
        ns.rename(R, b"d1", sub.ino, b"x")  # into its own subtree
    with pytest.raises(NotEmpty):
        ns.rename(R, b"d1", R, b"d2")
    with pytest.raises(IsADirectory):
        ns.rename(R, b"f", R, b"empty")  # file over directory
    with pytest.raises(NotADirectory):
        ns.rename(R, b"empty", R, b"f")  # directory over file
    root_links, d1_links, d2_links = ns.get(R).nlink, d1.nlink, d2.nlink
    ns.rename(d1.ino, b"sub", d2.ino, b"sub")
    assert sub.parent == d2.ino and ns.lookup(sub.ino, b"..") is d2
    assert (d1.nlink, d2.nlink) == (d1_links - 1, d2_links + 1)
    victim = ns.rename(R, b"d1", R, b"empty")  # directory over empty directory
    assert victim is empty and empty.nlink == 0
    assert ns.get(R).nlink == root_links - 1
    assert ns.lookup(R, b"empty") is d1


def test_rename_exchange(lg: Logged) -> None:
    ns = lg.ns
    a = mk(ns, R, b"a")
    d = mk(ns, R, b"d", DIR)
    b = mk(ns, d.ino, b"b")
    assert ns.rename(R, b"a", d.ino, b"b", RENAME_EXCHANGE) is None
    assert ns.lookup(R, b"a") is b and ns.lookup(d.ino, b"b") is a
    assert (a.nlink, b.nlink) == (1, 1)
    with pytest.raises(NotFound):
        ns.rename(R, b"a", R, b"missing", RENAME_EXCHANGE)
    e = mk(ns, R, b"e", DIR)
    ns.rename(R, b"a", R, b"e", RENAME_EXCHANGE)  # file <-> dir in one directory
    assert ns.lookup(R, b"a") is e and ns.lookup(R, b"e") is b
    assert_same(ns, replayed(lg.txns))


def test_rename_exchange_of_directories_across_parents(lg: Logged) -> None:
    ns = lg.ns
    p1, p2 = mk(ns, R, b"p1", DIR), mk(ns, R, b"p2", DIR)
    d1, d2 = mk(ns, p1.ino, b"d1", DIR), mk(ns, p2.ino, b"d2", DIR)
    inner = mk(ns, d1.ino, b"inner", DIR)
    f = mk(ns, p2.ino, b"f")
    for i in (d1, d2, f, p1, p2):
        i.ctime_ns = i.mtime_ns = 1
    ns.rename(p1.ino, b"d1", p2.ino, b"d2", RENAME_EXCHANGE)
    assert ns.lookup(p1.ino, b"d1") is d2 and ns.lookup(p2.ino, b"d2") is d1
    assert ns.lookup(d1.ino, b"..") is p2 and ns.lookup(d2.ino, b"..") is p1
    assert (p1.nlink, p2.nlink) == (3, 3)
    assert min(d1.ctime_ns, d2.ctime_ns, p1.mtime_ns, p2.mtime_ns, p1.ctime_ns) > 1
    ns.rename(p1.ino, b"d1", p2.ino, b"f", RENAME_EXCHANGE)  # a directory for a file
    assert ns.lookup(p1.ino, b"d1") is f and ns.lookup(p2.ino, b"f") is d2
    assert ns.lookup(d2.ino, b"..") is p2 and (p1.nlink, p2.nlink) == (2, 4)
    assert f.ctime_ns > 1
    before = len(lg.txns)
    with pytest.raises(InvalidArgument):  # d1 into its own subtree
        ns.rename(p2.ino, b"d2", d1.ino, b"inner", RENAME_EXCHANGE)
    with pytest.raises(InvalidArgument):
        ns.rename(d1.ino, b"inner", p2.ino, b"d2", RENAME_EXCHANGE)
    assert len(lg.txns) == before and ns.lookup(d1.ino, b"inner") is inner
    assert_same(ns, replayed(lg.txns))
    assert_same(ns, replayed([encode_ops(list(ns.snapshot()))]))


def test_xattrs(lg: Logged) -> None:
    ns = lg.ns
    f = mk(ns, R, b"f")
    with pytest.raises(NoAttribute):
        ns.get_xattr(f.ino, b"user.a")
    with pytest.raises(NoAttribute):
        ns.set_xattr(f.ino, b"user.a", None)
    ns.set_xattr(f.ino, b"user.a", b"1")
    ns.set_xattr(f.ino, b"user.a", b"22")
    ns.set_xattr(f.ino, b"user.b", b"")
    assert ns.get_xattr(f.ino, b"user.a") == b"22" and ns.get_xattr(f.ino, b"user.b") == b""
    ns.set_xattr(f.ino, b"user.a", None)
    with pytest.raises(NoAttribute):
        ns.get_xattr(f.ino, b"user.a")
    with pytest.raises(KvfsError):
        ns.set_xattr(f.ino, b"u" * 256, b"x")
    with pytest.raises(KvfsError):
        ns.set_xattr(f.ino, b"user.big", bytes(64 * 1024 + 1))
    assert f.xattrs == {b"user.b": b""}
    with pytest.raises(NotFound):
        ns.set_xattr(999, b"user.a", b"1")
    assert_same(ns, replayed(lg.txns))


def test_xattrs_are_bounded_per_value_and_per_file_like_ext4(lg: Logged) -> None:
    """A value over one ext4 block is E2BIG; a set that would take a file's xattrs
    (names + values) past XATTR_FILE_MAX is ENOSPC, even as a replacement, and logs
    nothing; shrinking, removing and other files are unaffected; a directory's
    ``user.kvfs.*`` policy xattrs (small) are set as before."""
    ns = lg.ns
    f, g = mk(ns, R, b"f"), mk(ns, R, b"g")
    d = mk(ns, R, b"d", DIR)
    big = bytes(range(256)) * (XATTR_VALUE_MAX // 256)
    ns.set_xattr(f.ino, b"user.a", big)  # exactly the bound
    with pytest.raises(TooBig) as e:
        ns.set_xattr(f.ino, b"user.b", big + b"x")
    assert e.value.errno == errno.E2BIG
    with pytest.raises(TooBig):
        ns.set_xattr(g.ino, b"user.pad", bytes(60_000))  # the 60 kB value
    used = len(b"user.a") + len(big)
    room = XATTR_FILE_MAX - used
    ns.set_xattr(f.ino, b"user.b", bytes(room - len(b"user.b")))  # fills the file exactly
    before = len(lg.txns)
    for name, value in [(b"user.c", b""), (b"user.b", bytes(room - len(b"user.b") + 1))]:
        with pytest.raises(NoSpace) as e2:
            ns.set_xattr(f.ino, name, value)
        assert e2.value.errno == errno.ENOSPC
    assert len(lg.txns) == before, "a refused set logged something"
    assert ns.get_xattr(f.ino, b"user.b") == bytes(room - len(b"user.b"))
    ns.set_xattr(f.ino, b"user.b", b"x")  # shrinking makes room again
    ns.set_xattr(f.ino, b"user.vllm.kv_crc32c", b"3735928559")
    ns.set_xattr(g.ino, b"user.a", big)  # the bound is per file
    ns.set_xattr(d.ino, b"user.kvfs.policy", b"lru")
    ns.set_xattr(d.ino, b"user.kvfs.quota", b"100G")
    assert d.xattrs == {b"user.kvfs.policy": b"lru", b"user.kvfs.quota": b"100G"}
    assert_same(ns, replayed(lg.txns))


def test_a_file_over_the_xattr_bound_from_an_older_pool_may_shrink_not_grow() -> None:
    """A pool written before the bound may hold more: replacing with no more bytes
    works, growing (a new name, a longer value) is ENOSPC."""
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    f = mk(ns, R, b"f")
    for i in range(3):  # replayed as recovery does: no bound on what is stored
        ns.apply(Xattr(f.ino, b"user.%d" % i, bytes(3000)))
    assert sum(len(k) + len(v) for k, v in (f.xattrs or {}).items()) > XATTR_FILE_MAX
    ns.set_xattr(f.ino, b"user.0", bytes(range(200)) * 15)  # as many bytes
    with pytest.raises(NoSpace):
        ns.set_xattr(f.ino, b"user.1", bytes(3001))
    with pytest.raises(NoSpace):
        ns.set_xattr(f.ino, b"user.new", b"1")
    ns.set_xattr(f.ino, b"user.2", b"small")
    ns.set_xattr(f.ino, b"user.1", None)
    assert f.xattrs == {b"user.0": bytes(range(200)) * 15, b"user.2": b"small"}


def test_failed_mutations_log_nothing(lg: Logged) -> None:
    ns = lg.ns
    mk(ns, R, b"f")
    mk(ns, R, b"d", DIR)
    mk(ns, ns.lookup(R, b"d").ino, b"x")
    before = len(lg.txns)
    calls: list[Callable[[], object]] = [
        lambda: mk(ns, R, b"f"),
        lambda: ns.remove(R, b"d", want_dir=True),
        lambda: ns.rename(R, b"f", R, b"d"),
        lambda: ns.rename(R, b"d", R, b"f"),
        lambda: ns.set_xattr(R, b"user.none", None),
    ]
    for call in calls:
        with pytest.raises(KvfsError):
            call()
    assert len(lg.txns) == before


# ----------------------------------------------------------------------------- replay
class Fuzzer:
    """Seeded random namespace operations, mimicking the store's drop rule."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.lg = Logged()
        self.ns = self.lg.ns

    def pick(self, dirs_only: bool = False) -> tuple[int, bytes] | None:
        pairs = [
            (i.ino, n)
            for i in self.ns.inodes.values()
            for n, c in (i.entries or {}).items()
            if not dirs_only or self.ns.inodes[c].is_dir
        ]
        return self.rng.choice(pairs) if pairs else None

    def a_dir(self) -> int:
        return self.rng.choice([i.ino for i in self.ns.inodes.values() if i.is_dir])

    def name(self) -> bytes:
        return b"n%d" % self.rng.randrange(12)

    def drop_if_unused(self, inode: Inode | None) -> None:
        if inode is not None and inode.nlink == 0 and inode.ino in self.ns.inodes:
            self.ns.drop(inode)

    def step(self) -> None:
        ns, rng = self.ns, self.rng
        action = rng.randrange(10)
        if action <= 2:
            mode = DIR if rng.random() < 0.3 else FILE
            ns.make(self.a_dir(), self.name(), mode, rng.randrange(3), 0)
        elif action == 3 and (p := self.pick()):
            ns.link(ns.lookup(*p).ino, self.a_dir(), self.name())
        elif action == 4 and (p := self.pick()):
            self.drop_if_unused(ns.remove(*p, want_dir=ns.lookup(*p).is_dir))
        elif action == 5 and (p := self.pick()):
            flags = rng.choice([0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE])
            self.drop_if_unused(ns.rename(*p, self.a_dir(), self.name(), flags))
        elif action == 6 and (p := self.pick()):
            value = None if rng.random() < 0.3 else rng.randbytes(rng.randrange(8))
            ns.set_xattr(ns.lookup(*p).ino, b"user.%d" % rng.randrange(3), value)
        elif action == 7 and (p := self.pick()):
            inode = ns.lookup(*p)
            if not inode.is_dir:  # what the store does on a write + commit
                n = rng.randrange(5)
                units, csums = ns.edit_map(inode)
                units[:] = array(
                    "q",
                    [
                        rng.choice([NO_UNIT, phys(rng.randrange(3), rng.randrange(1000))])
                        for _ in range(n)
                    ],
                )
                csums[:] = array("Q", [0 if u == NO_UNIT else rng.getrandbits(64) for u in units])
                inode.size = max(0, n * 65536 - rng.randrange(65536))
                ns.commit(inode)
        elif action == 8:
            ns.set_blob(rng.choice(["policy", "stats"]), rng.randbytes(rng.randrange(20)))
        elif action == 9 and (p := self.pick(dirs_only=rng.random() < 0.5)) and (q := self.pick()):
            ns.rename(*p, *q, RENAME_EXCHANGE)  # often directories, often across parents


@pytest.mark.parametrize("seed", range(5))
def test_replaying_the_log_rebuilds_the_same_namespace(seed: int) -> None:
    fz = Fuzzer(seed)
    errors = 0
    for n in range(600):
        try:
            fz.step()
        except KvfsError:
            errors += 1
        if n % 100 == 99:
            assert_same(fz.ns, replayed(fz.lg.txns))
    assert errors < 400, "the fuzzer should mostly exercise successful operations"
    assert len(fz.ns.inodes) > 10
    assert_same(fz.ns, replayed(fz.lg.txns))


@pytest.mark.parametrize("seed", range(3))
def test_snapshot_rebuilds_the_same_namespace(seed: int) -> None:
    fz = Fuzzer(100 + seed)
    for _ in range(400):
        with contextlib.suppress(KvfsError):
            fz.step()
    assert_same(fz.ns, replayed([encode_ops(list(fz.ns.snapshot()))]))


def test_nlink_matches_directory_structure_after_random_operations() -> None:
    fz = Fuzzer(7)
    for _ in range(800):
        with contextlib.suppress(KvfsError):
            fz.step()
    names: dict[int, int] = {}
    subdirs: dict[int, int] = {}
    for inode in fz.ns.inodes.values():
        for child in (inode.entries or {}).values():
            names[child] = names.get(child, 0) + 1
            if fz.ns.inodes[child].is_dir:
                subdirs[inode.ino] = subdirs.get(inode.ino, 0) + 1
                assert fz.ns.inodes[child].parent == inode.ino
    for inode in fz.ns.inodes.values():
        if inode.is_dir:
            assert inode.nlink == 2 + subdirs.get(inode.ino, 0), inode.ino
        else:
            assert inode.nlink == names.get(inode.ino, 0) >= 1, inode.ino


# ----------------------------------------------------------------------------- columns
class Model:
    """The namespace as plain dicts: what the columns must agree with."""

    def __init__(self) -> None:
        self.dirs: dict[int, dict[bytes, int]] = {R: {}}
        self.nlink: dict[int, int] = {R: 2}
        self.xattrs: dict[int, dict[bytes, bytes]] = {R: {}}


def check_model(ns: Namespace, m: Model, rng: random.Random) -> None:
    assert len(ns.inodes) == len(m.nlink)
    assert ns.dir_count == len(m.dirs) and ns.file_count == len(m.nlink) - len(m.dirs)
    assert set(ns.inodes) == set(m.nlink)
    for d, entries in m.dirs.items():
        assert dict(ns.directory(d).items()) == entries
        assert len(ns.directory(d)) == len(entries)
        for name, ino in entries.items():
            assert ns.lookup(d, name).ino == ino
        with pytest.raises(NotFound):
            ns.lookup(d, b"missing-%d" % rng.randrange(1000))
    for ino, n in m.nlink.items():
        inode = ns.inodes[ino]
        assert inode.nlink == n and inode.is_dir == (ino in m.dirs)
        assert (inode.xattrs or {}) == m.xattrs[ino]
        assert ns.inodes.get(ino) is inode  # interned: the same live file, the same view


def model_step(ns: Namespace, m: Model, rng: random.Random, used: set[int]) -> bool:
    """One valid random operation on both; True if it reused a dropped inode number."""
    dirs = list(m.dirs)
    names = [(d, n) for d in dirs for n in m.dirs[d]]
    action = rng.randrange(8)
    name = b"f%d" % rng.randrange(40)
    if action <= 2 or not names:
        d = rng.choice(dirs)
        if name in m.dirs[d]:
            return False
        is_dir = rng.random() < 0.15
        ino = ns.make(d, name, DIR if is_dir else FILE, rng.randrange(3), 0).ino
        assert ino not in m.nlink
        m.dirs[d][name] = ino
        m.nlink[ino] = 2 if is_dir else 1
        m.xattrs[ino] = {}
        if is_dir:
            m.dirs[ino] = {}
            m.nlink[d] += 1
        reused = ino in used
        used.add(ino)
        return reused
    d, n = rng.choice(names)
    ino = m.dirs[d][n]
    if action == 3 and ino not in m.dirs:
        d2 = rng.choice(dirs)
        if name not in m.dirs[d2]:
            ns.link(ino, d2, name)
            m.dirs[d2][name] = ino
            m.nlink[ino] += 1
    elif action == 4:
        if m.dirs.get(ino):
            return False
        inode = ns.remove(d, n, want_dir=ino in m.dirs)
        del m.dirs[d][n]
        if ino in m.dirs:
            del m.dirs[ino]
            m.nlink[d] -= 1
            m.nlink[ino] = 0
        else:
            m.nlink[ino] -= 1
        if m.nlink[ino] == 0:
            ns.drop(inode)
            del m.nlink[ino], m.xattrs[ino]
    elif action == 5 and ino not in m.dirs:
        d2 = rng.choice(dirs)
        target = m.dirs[d2].get(name)
        if target is not None and (target in m.dirs or target == ino):
            return False
        victim = ns.rename(d, n, d2, name)
        del m.dirs[d][n]
        m.dirs[d2][name] = ino
        if target is not None:
            assert victim is not None and victim.ino == target
            m.nlink[target] -= 1
            if m.nlink[target] == 0:
                ns.drop(victim)
                del m.nlink[target], m.xattrs[target]
    elif action == 6:
        key = b"user.vllm.kv_crc32c" if rng.random() < 0.7 else b"user.x%d" % rng.randrange(3)
        if rng.random() < 0.2 and key in m.xattrs[ino]:
            ns.set_xattr(ino, key, None)
            del m.xattrs[ino][key]
        else:
            value = rng.randbytes(rng.choice([4, 8, 300, 4000]))
            after = {**m.xattrs[ino], key: value}
            if sum(len(k) + len(v) for k, v in after.items()) > XATTR_FILE_MAX:
                with pytest.raises(NoSpace):  # the file's xattrs are bounded
                    ns.set_xattr(ino, key, value)
                return False
            ns.set_xattr(ino, key, value)
            m.xattrs[ino][key] = value
    return False


@pytest.mark.parametrize("seed", range(3))
def test_columns_agree_with_a_dict_model(seed: int) -> None:
    """Random creates, hard links, unlinks with drops (inode numbers reused), renames
    over victims, xattrs (small, and big ones in the side table)."""
    rng = random.Random(seed)
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    m, used, reused = Model(), {R}, 0
    for step in range(1500):
        reused += model_step(ns, m, rng, used)
        if step % 100 == 99:
            check_model(ns, m, rng)
    check_model(ns, m, rng)
    assert reused > 10, "dropped inode numbers must be reused"
    fresh = Namespace(lambda ops: None)
    for payload in ns.snapshot_payloads():
        fresh.load_payload(payload)
    fresh.finish_load()
    check_model(fresh, m, rng)


def test_a_big_directory_grows_and_shrinks_its_name_index() -> None:
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    d = ns.make(R, b"big", DIR, 0, 0).ino
    inos = {i: ns.make(d, b"chunk-%08d.pt" % i, FILE, 0, 0).ino for i in range(5000)}
    for i in range(0, 5000, 2):
        ns.drop(ns.remove(d, b"chunk-%08d.pt" % i, want_dir=False))
    for i in range(5000):
        if i % 2:
            assert ns.lookup(d, b"chunk-%08d.pt" % i).ino == inos[i]
        else:
            with pytest.raises(NotFound):
                ns.lookup(d, b"chunk-%08d.pt" % i)
    assert len(ns.directory(d)) == 2500 == ns.file_count


def check_name_index(ns: Namespace, names: dict[tuple[int, bytes], int]) -> None:
    """The name index holds exactly ``names``, each in one of its tables, and a
    migration's swept slots are empty."""
    index = ns._index
    tables = [index.table] + ([index.old] if index.old is not None else [])
    held = [ino for t in tables for chunk in t.slots.chunks for ino in chunk if ino]
    tombs = held.count(TOMB)  # only in an old table loaded from a version-1 image
    assert tombs == 0 or (index.old is not None and index.old.tombs >= tombs)
    assert TOMB not in itertools.chain(*index.table.slots.chunks)
    assert sorted(i for i in held if i != TOMB) == sorted(names.values())
    assert index.used == len(names) == sum(t.used for t in tables)
    if index.old is not None:
        swept = index.old.slots.chunks
        assert not any(swept[c >> SHIFT][c & (ROWS - 1)] for c in range(index.cursor))
        released = swept[: index.cursor >> SHIFT]
        assert all(c is index.old.zero for c in released), "swept chunks are freed"
    for (parent, name), ino in names.items():
        assert index.find(parent, name) == ino
        assert index.find(parent, name + b"~") == 0


def names_of(ns: Namespace) -> dict[tuple[int, bytes], int]:
    return {(p, n): i for p in ns._dirs for n, i in ns.directory(p).items()}


@pytest.mark.parametrize(("seed", "step"), [(0, 16), (1, 16), (2, MIGRATE_STEP), (3, 1)])
def test_name_index_grows_and_shrinks_incrementally(
    seed: int, step: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Growths and shrinks of the name index with creates, unlinks (inode numbers
    reused) and lookups interleaved, against a dict; checkpoints frozen in the
    middle of a migration are consumed while the namespace goes on changing, load
    into what they froze, and the loaded index migrates on correctly. Step 1 is
    too small to end a migration before the new table fills: the insert that would
    pass 75% finishes it first."""
    monkeypatch.setattr(columns, "MIGRATE_STEP", step)
    rng = random.Random(seed)
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    dirs = [R] + [ns.make(R, b"d%d" % i, DIR, 0, 0).ino for i in range(4)]
    model = {(R, b"d%d" % i): dirs[i + 1] for i in range(4)}
    serial = 0
    pending: list[tuple[Iterator[bytes], list[bytes], dict[tuple[int, bytes], int]]] = []
    checked, migrations, cut_short, mig_ops, sizes = 0, 0, 0, 0, {ns._index.table.size}

    def step_once(ns: Namespace, model: dict[tuple[int, bytes], int], grow: bool) -> None:
        """A remove (30% growing, 70% shrinking) or a create, then a lookup."""
        nonlocal serial
        files = len(model) - 4  # the directories are the first four names
        if files and rng.random() < (0.3 if grow else 0.7):
            parent, name = next(itertools.islice(model, 4 + rng.randrange(min(files, 50)), None))
            ns.drop(ns.remove(parent, name, want_dir=False))
            del model[parent, name]
        else:
            serial += 1
            parent = rng.choice(dirs)
            name = b"f%d-" % serial + b"x" * rng.randrange(30)
            model[parent, name] = ns.make(parent, name, FILE, 0, 0).ino
        if rng.random() < 0.5:
            parent, name = next(reversed(model))
        else:
            parent, name = rng.choice(dirs), b"f%d-" % rng.randrange(serial + 1)
        assert ns._index.find(parent, name) == model.get((parent, name), 0)

    for target in (5000, 200, 9000, 100, 2500):
        grow = len(model) < target
        while (len(model) < target) if grow else (len(model) > target):
            was_migrating, table = ns._index.old is not None, ns._index.table
            step_once(ns, model, grow)
            sizes.add(ns._index.table.size)
            if ns._index.table is not table:
                migrations += 1
                cut_short += was_migrating
            if was_migrating and ns._index.old is None:
                check_name_index(ns, model)
            mig_ops = mig_ops + 1 if ns._index.old is not None else 0
            if mig_ops == 3:  # once per migration, in its middle
                payloads = ns.snapshot_payloads()
                pending.append((payloads, [next(payloads)], dict(model)))
            for payloads, taken, _ in pending:
                taken.extend(itertools.islice(payloads, 1))
        check_name_index(ns, model)
    assert migrations >= 8 and len(sizes) >= 5, (migrations, sizes)
    assert (cut_short > 0) == (step < 16), "a step of 16 ends every migration in time"
    assert len(pending) >= migrations - 2 >= 6
    while ns._index.old is not None:
        step_once(ns, model, grow=True)
    pending.append((ns.snapshot_payloads(), [], dict(model)))  # and after the last one
    for payloads, taken, frozen in pending:
        fresh = loaded([*taken, *payloads])
        assert (fresh._index.old is None) == (not taken), "frozen in a migration"
        assert names_of(fresh) == frozen
        check_name_index(fresh, frozen)
        while fresh._index.old is not None:
            step_once(fresh, frozen, grow=True)
        check_name_index(fresh, frozen)
        checked += 1
    assert checked == len(pending)


def test_a_version_1_image_with_deleted_slots_loads_and_migrates() -> None:
    """A version-1 image's index may hold tombstones (deletion before backward
    shift): it loads as the old table of a migration, which empties it."""
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    for i in range(600):
        ns.make(R, b"keep-%d" % i, FILE, 0, 0)
    gone = [ns.make(R, b"gone-%d" % i, FILE, 0, 0).ino for i in range(150)]
    size = ns._index.table.size
    slots = array("I", b"".join(c.tobytes() for c in ns._index.table.slots.chunks))
    for i in range(150):
        ns.drop(ns.remove(R, b"gone-%d" % i, want_dir=False))
    for ino in gone:  # the table as version 1 left it: removed names deleted in place
        slots[slots.index(ino)] = TOMB
    image = list(ns.snapshot_payloads())
    fields = list(nsimage._META.unpack_from(image[0], 8))
    assert image[0][1] == nsimage.K_META and fields[0] == 3  # (no name form in use)
    fields[0], fields[4:7] = 1, [size, 600, 150]
    v1 = [
        image[0][:8] + nsimage._META.pack(*fields),
        nsimage._part(nsimage.K_SLOTS, 0, 0, slots.tobytes()),
        *(p for p in image[1:] if p[1] != nsimage.K_SLOTS),
    ]
    fresh = loaded(v1)
    index = fresh._index
    assert index.old is not None and index.old.tombs == 150 and index.table.used == 0
    names = names_of(ns)
    assert names_of(fresh) == names and len(names) == 600
    check_name_index(fresh, names)
    for i in range(150):
        assert index.find(R, b"gone-%d" % i) == 0
    fresh.drop(fresh.remove(R, b"keep-0", want_dir=False))  # deleted in place
    assert index.old is not None and index.old.tombs == 151
    del names[R, b"keep-0"]
    check_name_index(fresh, names)
    for i in range(7, 600, 7):
        fresh.drop(fresh.remove(R, b"keep-%d" % i, want_dir=False))
        del names[R, b"keep-%d" % i]
    for i in range(100):
        names[R, b"new-%d" % i] = fresh.make(R, b"new-%d" % i, FILE, 0, 0).ino
    assert index.old is None and index.table.tombs == 0
    check_name_index(fresh, names)
    assert names_of(fresh) == names


def test_a_dropped_inode_the_kernel_still_names_is_not_reused() -> None:
    """ESTALE contract: a file kvfs removed while the kernel holds a reference keeps
    its number out of reuse until the kernel forgets it."""
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    old = ns.make(R, b"a", FILE, 0, 0)
    old_ino = old.ino
    old.lookups = 1
    old.flags |= FLAG_GONE
    ns.drop(ns.remove(R, b"a", want_dir=False))
    del old
    for i in range(3):
        assert ns.make(R, b"n%d" % i, FILE, 0, 0).ino != old_ino
    with pytest.raises(Stale):
        ns.get(old_ino)
    ns.kernel_forget(old_ino, 1)
    assert ns.make(R, b"again", FILE, 0, 0).ino == old_ino


def test_a_dropped_inode_held_by_a_view_is_not_reused() -> None:
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    held = ns.make(R, b"a", FILE, 0, 0)
    ino = held.ino
    ns.drop(ns.remove(R, b"a", want_dir=False))
    successor = ns.make(R, b"b", FILE, 0, 0)
    assert successor.ino != ino and ns.inodes.get(ino) is None
    assert held.name == b"a"  # the dropped view still reads its own row
    del held
    again = ns.make(R, b"c", FILE, 0, 0)
    assert again.ino == ino and again is ns.inodes[ino]


def state_with_blobs(ns: Namespace) -> tuple[dict[int, tuple[Any, ...]], dict[str, bytes]]:
    return state(ns), dict(ns.blobs)


def loaded(payloads: list[bytes], txns: list[bytes] = ()) -> Namespace:  # type: ignore[assignment]
    logged: list[list[Op]] = []
    fresh = Namespace(logged.append)
    for payload in payloads:
        fresh.load_payload(payload)
    for raw in txns:
        for op in decode_ops(raw):
            fresh.apply(op)
    fresh.finish_load()
    assert not logged, "loading must not log"
    return fresh


@pytest.mark.parametrize("scan_step", [0, 1])
@pytest.mark.parametrize("seed", range(3))
def test_a_snapshot_is_the_state_when_it_was_taken(
    seed: int, scan_step: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """freeze/copy-on-write: the payloads, consumed while the namespace changes,
    still hold the state of the moment ``snapshot_payloads`` was called; directory
    listings too (serialized last, copied on their first change). ``scan_step`` 1:
    a pause after every chunk scanned (the image's steps are bounded by
    ``SCAN_STEP`` chunks; a small namespace never reaches the real one)."""
    if scan_step:
        monkeypatch.setattr(nsimage, "SCAN_STEP", scan_step)
    fz = Fuzzer(200 + seed)
    for _ in range(300):
        with contextlib.suppress(KvfsError):
            fz.step()
    before = state_with_blobs(fz.ns)
    payloads = fz.ns.snapshot_payloads()
    taken = [next(payloads)]
    for _ in range(300):
        with contextlib.suppress(KvfsError):
            fz.step()
        taken.extend(itertools.islice(payloads, 1))
    taken.extend(payloads)
    pauses = taken.count(nsimage.PAUSE)
    assert bool(pauses) == bool(scan_step)
    assert state_with_blobs(loaded([p for p in taken if p])) == before
    assert state_with_blobs(fz.ns) != before


@pytest.mark.parametrize("seed", range(4))
def test_image_legacy_and_replay_after_a_checkpoint_agree(seed: int) -> None:
    """A checkpoint image plus the transactions logged after it, and the same as a
    legacy (pre-columns) op checkpoint, rebuild the live namespace; new inodes made
    after the load never collide with live ones (free-list bookkeeping)."""
    fz = Fuzzer(300 + seed)
    for _ in range(300):
        with contextlib.suppress(KvfsError):
            fz.step()
    image = list(fz.ns.snapshot_payloads())
    legacy = [encode_ops(list(fz.ns.legacy_ops()))]
    mark = len(fz.lg.txns)
    assert_same(fz.ns, loaded(image))
    assert_same(fz.ns, loaded(legacy))
    for _ in range(300):
        with contextlib.suppress(KvfsError):
            fz.step()
    after = fz.lg.txns[mark:]
    for ns in (loaded(image, after), loaded(legacy, after)):
        assert_same(fz.ns, ns)
        made = [ns.make(R, b"new%d" % i, FILE, 0, 0).ino for i in range(40)]
        assert len(set(made)) == 40 and not set(made) & set(fz.ns.inodes)


def test_one_unit_files_need_no_side_tables() -> None:
    """The compact form: a committed file of one contiguous extent is its columns."""
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    f = ns.make(R, b"a", FILE, 0, 0, flags=FLAG_WRITING)
    units, csums = ns.edit_map(f)
    units.extend([phys(0, 7), phys(0, 8)])
    csums.extend([11, 12])
    ns.commit(f)  # still being written: the map stays materialized
    assert f.units == (phys(0, 7), phys(0, 8))
    f.flags &= ~FLAG_WRITING
    ns.commit(f)
    assert not ns._maps and f.units == (phys(0, 7), phys(0, 8)) and f.csum(1) == 12
    assert f.unit(2) == NO_UNIT and f.nunits == 2 and f.mapped_units == 2
    g = ns.make(R, b"g", FILE, 0, 0)
    units, csums = ns.edit_map(g)
    units.extend([NO_UNIT, phys(1, 3)])
    csums.extend([0, 5])
    ns.commit(g)  # a hole: kept in the side table
    assert g.units == (NO_UNIT, phys(1, 3)) and g.mapped_units == 1
    h = ns.make(R, b"h", FILE, 0, 0)  # no data yet
    for view in (f, g, h):  # read from the columns, as the view counts them
        assert ns.mapped_units_of(view.ino) == view.mapped_units
    gone = g.ino
    ns.drop(ns.remove(R, b"g", want_dir=False))
    del g
    # numbers no live inode has: dropped, never handed out, out of range
    assert [ns.mapped_units_of(i) for i in (gone, 0, ns.next_ino, ns.next_ino + 9)] == [0] * 4


def test_replay_never_frees_an_inode_number_twice() -> None:
    """An inode number freed, reused and dropped again after a checkpoint: replay
    frees it twice; it must still be handed out once (else two files, one row)."""
    lg = Logged()
    ns = lg.ns
    ns.drop(ns.remove(R, mk(ns, R, b"a").name, want_dir=False))
    image = list(ns.snapshot_payloads())
    mark = len(lg.txns)
    b = mk(ns, R, b"b")
    ns.drop(ns.remove(R, b"b", want_dir=False))
    del b
    fresh = loaded(image, lg.txns[mark:])
    made = [fresh.make(R, b"n%d" % i, FILE, 0, 0).ino for i in range(3)]
    assert len(set(made)) == 3


def _image_bytes(ns: Namespace) -> int:
    return sum(len(p) for p in ns.snapshot_payloads())


@pytest.mark.parametrize("seed", range(3))
def test_the_image_holds_live_rows_only(seed: int) -> None:
    """Files dropped anywhere (a random half, the kernel still naming some of them)
    leave the next image at once, in proportion: metadata pressure relies on it.
    The image with holes loads back to the same namespace, column by column, and
    the holes are reusable after the load."""
    rng = random.Random(seed)
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    d = ns.make(R, b"d", DIR, 0, 0).ino
    n = 6000
    files = []
    for i in range(n):
        name = b"%s-%d.pt" % (rng.randbytes(rng.randrange(4, 40)).hex().encode(), i)
        f = ns.make(d, name, FILE, rng.randrange(3), 0, flags=FLAG_WRITING)
        units, csums = ns.edit_map(f)
        units.append(phys(0, 10 + i))
        csums.append(rng.getrandbits(64))
        f.flags &= ~FLAG_WRITING
        ns.commit(f)
        if rng.random() < 0.3:  # values with zero bytes in them, small and arena-big
            ns.set_xattr(f.ino, b"user.crc", bytes(4) + rng.randbytes(rng.choice([4, 300])))
        files.append((name, f.ino))
        del f
    full = _image_bytes(ns)
    gone = rng.sample(range(n), n // 2)
    ghosts = set()
    for k, i in enumerate(gone):
        inode = ns.lookup(d, files[i][0])
        if k % 10 == 0:  # the kernel still names it: kept out of reuse, but stripped
            inode.lookups = 1
            ghosts.add(inode.ino)
        ns.drop(ns.remove(d, files[i][0], want_dir=False))
        del inode
    half = _image_bytes(ns)
    # what stays per dropped file: its row and name on the free lists (4 B each), a
    # row-run header; the name index may not have shrunk yet (4 B per slot)
    slots = ns._index.nbytes()
    assert half < full / 2 + slots + 16 * len(gone), (half, full)
    fresh = Namespace(lambda ops: None)
    for payload in ns.snapshot_payloads():
        fresh.load_payload(payload)
    fresh.finish_load()
    assert_same(ns, fresh)
    for a, b in zip(ns.persisted_columns, fresh.persisted_columns, strict=True):
        for ino in range(ns.next_ino):
            if ino not in ghosts:  # a ghost's F_DEAD flag is the mount's, not the image's
                assert a[ino] == b[ino], (ino, a.code)
    made = {fresh.make(R, b"n%d" % i, FILE, 0, 0).ino for i in range(n // 2)}
    assert ghosts <= made, "rows the old mount's kernel named are free after a load"
    assert max(made) < ns.next_ino, "every dropped row is reused before new ones"
    for ino in ghosts:
        assert ns.inodes.get(ino) is None
        ns.kernel_forget(ino, 1)


def assert_positions(ns: Namespace, *dirs: int) -> None:
    """Every child listed in ``dirs`` knows where it is in its directory's listing
    (what makes a removal O(1) in a big directory instead of a scan of the listing)."""
    for d in dirs:
        for j, child in enumerate(ns._dirs[d].children):
            assert ns._cpos[child] == j


def test_removals_from_a_big_directory_keep_listing_and_positions_right() -> None:
    """Unlinks, renames within and out of a directory (bulk-made and made one by
    one), in random order: the listing is the model's after each step, and the
    position column stays exact, also after a snapshot was loaded (positions are not
    in the image: the first removal in a loaded directory recomputes them)."""
    rng = random.Random(7)
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    a = ns.make(R, b"a", DIR, 0, 0).ino
    b = ns.make(R, b"b", DIR, 0, 0).ino
    names = [b"bulk-%05d" % i for i in range(1500)]
    units = array("q", range(len(names)))
    first = ns.add_files(a, names, FILE, (0, 0), 1, units, array("Q", units))
    model = {a: {n: first + i for i, n in enumerate(names)}, b: {}}
    for i in range(500):
        model[a][b"one-%05d" % i] = mk(ns, a, b"one-%05d" % i).ino
    assert_positions(ns, R, a, b)

    def step(ns: Namespace) -> None:
        src = a if not model[b] or rng.random() < 0.7 else b
        name = rng.choice(sorted(model[src]))
        r = rng.random()
        if r < 0.4:
            ns.drop(ns.remove(src, name, want_dir=False))
            del model[src][name]
        else:
            dst = src if r < 0.7 else (b if src == a else a)
            new = b"r%d-" % rng.randrange(10**6) + name
            ns.rename(src, name, dst, new)
            model[dst][new] = model[src].pop(name)

    for n in range(600):
        step(ns)
        if n % 50 == 0:
            assert {d: dict(ns.directory(d).items()) for d in model} == model
    assert_positions(ns, R, a, b)
    fresh = Namespace(lambda ops: None)
    for payload in ns.snapshot_payloads():
        fresh.load_payload(payload)
    fresh.finish_load()
    for _ in range(300):
        step(fresh)
    assert {d: dict(fresh.directory(d).items()) for d in model} == model
    assert_positions(fresh, a, b)


# ----------------------------------------------------------------------------- narrow chunks
def test_a_narrowing_column_widens_one_chunk_exactly_and_keeps_frozen_copies() -> None:
    """Each chunk takes the narrowest item code its values fit; a store that does
    not fit widens only its chunk, exact; a value past the declared code raises and
    changes nothing; a frozen chunk keeps its old code and values."""
    col = columns.Column("q", narrow=True)
    col.ensure(3 * ROWS)
    assert {c.typecode for c in col.chunks} == {"b"} and col.nbytes() == 0
    values = {5: -7, ROWS + 1: 300, ROWS + 2: -(1 << 40), 2 * ROWS: (1 << 63) - 1}
    frozen = None
    for i, v in values.items():
        if i == ROWS + 2:
            frozen = col.freeze()
        col[i] = v
    assert [c.typecode for c in col.chunks] == ["b", "q", "q"]
    assert frozen is not None and frozen[1].typecode == "h" and frozen[1][1] == 300
    assert frozen[1][2] == 0 and frozen[2] is col.zero
    for i, v in values.items():
        assert col[i] == v
    with pytest.raises(OverflowError):
        col[7] = 1 << 63
    codes = [c.typecode for c in col.chunks]
    assert codes[0] == "b" and col[5] == -7 and col[7] == 0
    col.fill(ROWS - 2, array("q", [1 << 20] * 4))  # across two chunks, one widened
    codes = [c.typecode for c in col.chunks]
    assert codes[0] == "i" and col[ROWS - 1] == 1 << 20 == col[ROWS + 1]
    assert col[5] == -7 and col[ROWS + 2] == -(1 << 40)
    unsigned = columns.Column("I", narrow=True)
    unsigned.ensure(ROWS)
    with pytest.raises(OverflowError):
        unsigned[0] = -1
    unsigned[0] = (1 << 32) - 1
    assert unsigned.chunks[0].typecode == "I"


def test_evicted_files_do_not_leave_their_chunks_wide() -> None:
    """An unlink stamps a file's ctime only while something can still see it (a
    name left, an open descriptor): the last name of a closed file goes without a
    stamp, so the chunks of a cache that turns over keep their ctime distances at a
    byte a row (a stamp days after the mtime took 8 bytes a row for the chunk, for
    good); every time the namespace answers, and its image holds, is the one set."""
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    files = [ns.make(R, b"f%d" % i, FILE, 0, 0) for i in range(2 * ROWS)]
    for i, f in enumerate(files):
        f.set_times(10**15 + i, 10**15 + i, 10**15 + i)
    rng = random.Random(5)
    for k in range(3 * ROWS):
        j = rng.randrange(len(files))
        victim = files[j]
        ns.remove(R, victim.name, want_dir=False)
        assert victim.ctime_ns == victim.mtime_ns  # (no stamp: nothing sees it)
        ns.drop(victim)
        f = files[j] = ns.make(R, b"g%d" % k, FILE, 0, 0)
        f.set_times(2 * 10**15 + k, 2 * 10**15 + k, 2 * 10**15 + k)
    assert {c.typecode for c in ns._ctime.chunks} == {"b"}
    opened, linked = files[3], files[4]
    opened.opens = 1  # an open descriptor: fstat shows the unlink's ctime
    before = time.time_ns()
    ns.remove(R, opened.name, want_dir=False)
    assert opened.nlink == 0 and opened.ctime_ns >= before > opened.mtime_ns + (1 << 40)
    ns.link(linked.ino, R, b"second")
    ns.remove(R, linked.name, want_dir=False)  # a name is left
    assert linked.nlink == 1 and linked.ctime_ns >= before
    assert ns._ctime.chunks[linked.ino >> SHIFT].typecode == "q"
    times = {f.ino: f.times() for f in files if f is not opened}
    fresh = loaded(list(ns.snapshot_payloads()))
    assert {ino: fresh.get(ino).times() for ino in times} == times


def test_wide_values_survive_the_image_and_times_are_exact() -> None:
    """Link counts past a byte, sizes past 4 GiB, times centuries apart (each
    widening its chunk) come back exactly from a checkpoint image; the image of a
    namespace of ordinary files is narrower than full-width columns would be."""
    ns = Namespace(lambda ops: None)
    ns.init_root(0, 0)
    for i in range(3 * ROWS):
        ns.make(R, b"f%d" % i, FILE, 0, 0)
    odd = ns.make(R, b"odd", FILE, 0, 0)
    odd.size = (1 << 42) + 3
    odd.nlink = 1000
    odd.atime_ns, odd.mtime_ns, odd.ctime_ns = -(1 << 62), 1 << 61, (1 << 62) + 12345
    with pytest.raises(InvalidArgument):
        odd.atime_ns = -(1 << 62) - (1 << 61) - 1  # 2^63 + 1 ns before mtime
    assert odd.times() == (-(1 << 62), 1 << 61, (1 << 62) + 12345)
    before = state(ns)
    image = list(ns.snapshot_payloads())
    fresh = loaded(image)
    assert state(fresh) == before
    again = fresh.get(odd.ino)
    assert again.times() == odd.times() and again.size == odd.size and again.nlink == 1000
    c = odd.ino >> SHIFT
    assert fresh._size.chunks[c].typecode == "q" and fresh._nlink.chunks[c].typecode == "H"
    assert fresh._nlink.chunks[0].typecode == "B"
    full = sum(ROWS * array(col.code).itemsize * len(col.chunks) for col in ns.persisted_columns)
    assert sum(map(len, image)) < 0.75 * full
