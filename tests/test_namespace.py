"""Unit tests of kvfs.namespace: POSIX name semantics, nlink bookkeeping, xattrs, and
replay: the logged operations (or a snapshot) rebuild an identical namespace."""

from __future__ import annotations

import contextlib
import random
import stat
from array import array
from collections.abc import Callable
from typing import Any

import pytest

from kvfs.errors import (
    Exists,
    InvalidArgument,
    IsADirectory,
    KvfsError,
    NameTooLong,
    NoAttribute,
    NotADirectory,
    NotEmpty,
    NotFound,
    NotPermitted,
)
from kvfs.layout import NO_UNIT, Op, decode_ops, encode_ops, phys
from kvfs.namespace import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT_INO,
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
            i.entries,
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
                inode.units[:] = array(
                    "q",
                    [
                        rng.choice([NO_UNIT, phys(rng.randrange(3), rng.randrange(1000))])
                        for _ in range(n)
                    ],
                )
                inode.csums[:] = array(
                    "Q", [0 if u == NO_UNIT else rng.getrandbits(64) for u in inode.units]
                )
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
