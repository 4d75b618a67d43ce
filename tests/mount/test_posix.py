"""POSIX details of a real kvfs mount, checked against what ext4 does: setuid/setgid
bits on truncation, setgid directories, xattr namespaces, timestamps, readdir, rename
exchange, unsupported file types and ``st_blocks`` (``docs/design.md``, "POSIX
behaviour").

The multi-user tests run on an ``--allow-other`` mount with a throwaway system user
(created and removed by the ``other_user`` fixture); its operations run in a forked
child that drops to that user (:func:`as_user`): the test interpreter lives under
``/root`` (mode 0700), so the user could not exec it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import pickle
import pwd
import select
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.conftest import KvfsMount, errno_of, pattern, wait_for, write_file

MiB = 1 << 20
T = TypeVar("T")
ALLOW_OTHER = pytest.mark.mount_options("--allow-other")
OTHER_GROUP = 4242
"""A group the throwaway user is not a member of."""


# ---------------------------------------------------------------------- another user
@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


@pytest.fixture
def other_user(unprivileged_user: pwd.struct_passwd) -> User:
    pw = unprivileged_user
    assert pw.pw_gid != OTHER_GROUP
    return User(pw.pw_name, pw.pw_uid, pw.pw_gid)


def as_user(user: User, cwd: Path, fn: Callable[[], T], timeout: float = 60.0) -> T:
    """``fn()`` in a forked child running as ``user`` (no supplementary groups, umask
    022) in directory ``cwd``; its result, or its OSError raised again here."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(r)
            os.chdir(cwd)  # as root: the user could not walk /tmp/pytest-of-root
            os.setgroups([])
            os.setgid(user.gid)
            os.setuid(user.uid)
            os.umask(0o022)
            try:
                out: tuple[str, Any] = ("ok", fn())
            except OSError as e:
                out = ("oserror", e.errno)
            data = memoryview(pickle.dumps(out))
            while data:
                data = data[os.write(w, data) :]
        except BaseException as e:  # reported to the parent, which fails the test
            os.write(w, pickle.dumps(("error", repr(e))))
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"the child running as {user.name} hung for {timeout} s")
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    kind, value = pickle.loads(b"".join(chunks))
    if kind == "oserror":
        raise OSError(value, os.strerror(value))
    assert kind == "ok", f"the child running as {user.name} failed: {value}"
    return value  # type: ignore[no-any-return]


def shared_root(mount: KvfsMount) -> Path:
    """The mount root, world-writable and sticky like /tmp."""
    os.chmod(mount.path, 0o1777)
    return mount.path


def remount_shared(mount: KvfsMount) -> None:
    """A clean remount that keeps ``--allow-other`` (``KvfsMount.remount`` mounts with
    the fixture's options only the first time)."""
    code = mount.stop()
    assert code == 0, f"kvfs exited {code} on a clean unmount: {mount.stderr[-1:]}"
    mount.start("--allow-other")


def mode_of(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ---------------------------------------------------------------------- setuid/setgid
def _truncate_by_open(name: str) -> None:
    os.close(os.open(name, os.O_WRONLY | os.O_TRUNC))


def _truncate_by_call(name: str) -> None:
    os.truncate(name, 0)


# (mode, group is the user's own group, mode afterwards): ext4's rule, the kernel's
# setattr_should_drop_suidgid(): a caller without CAP_FSETID always loses S_ISUID, and
# S_ISGID when the file is group-executable or the caller is not in the file's group.
KILL_CASES = [
    (0o6777, False, 0o0777),
    (0o6777, True, 0o0777),
    (0o6767, True, 0o2767),  # S_ISGID without group-exec, caller in the group: kept
    (0o2766, False, 0o0766),  # ... caller not in the group: dropped
    (0o4666, False, 0o0666),
    (0o0666, False, 0o0666),
]


@ALLOW_OTHER
@pytest.mark.parametrize("how", [_truncate_by_open, _truncate_by_call], ids=["O_TRUNC", "truncate"])
def test_truncation_by_another_user_drops_setuid_and_setgid(
    kvfs_mount: KvfsMount, other_user: User, how: Callable[[str], None]
) -> None:
    root = shared_root(kvfs_mount)
    for i, (mode, own_group, _) in enumerate(KILL_CASES):
        for size in (0, 5000):  # an empty file too: O_TRUNC of it is a truncation
            name = f"f{i}-{size}"
            write_file(root / name, pattern(name, size))
            os.chown(root / name, 0, other_user.gid if own_group else 0)
            os.chmod(root / name, mode)
            assert mode_of(root / name) == mode
            as_user(other_user, root, functools.partial(how, name))
            assert os.stat(root / name).st_size == 0

    def check() -> None:
        for i, (mode, _, after) in enumerate(KILL_CASES):
            for size in (0, 5000):
                got = mode_of(root / f"f{i}-{size}")
                assert got == after, f"{oct(mode)} (size {size}) became {oct(got)}"

    check()
    remount_shared(kvfs_mount)
    check()


@ALLOW_OTHER
def test_truncation_by_root_keeps_setuid_and_setgid(kvfs_mount: KvfsMount) -> None:
    root = shared_root(kvfs_mount)
    write_file(root / "f", b"data")
    os.chmod(root / "f", 0o6777)
    _truncate_by_open(str(root / "f"))
    _truncate_by_call(str(root / "f"))
    assert mode_of(root / "f") == 0o6777


@ALLOW_OTHER
def test_write_by_another_user_drops_setuid(kvfs_mount: KvfsMount, other_user: User) -> None:
    """The kernel does this one itself (a SETATTR of the mode before the write)."""
    root = shared_root(kvfs_mount)
    write_file(root / "f", b"data")
    os.chmod(root / "f", 0o6777)

    def append() -> None:
        fd = os.open("f", os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"more")
        finally:
            os.close(fd)

    as_user(other_user, root, append)
    assert mode_of(root / "f") == 0o0777


# ---------------------------------------------------------------------- setgid directories
@ALLOW_OTHER
def test_setgid_directory_passes_its_group_on(kvfs_mount: KvfsMount, other_user: User) -> None:
    root = shared_root(kvfs_mount)
    (root / "g").mkdir()
    os.chown(root / "g", 0, OTHER_GROUP)
    os.chmod(root / "g", 0o2777)
    (root / "own").mkdir()
    os.chown(root / "own", 0, other_user.gid)
    os.chmod(root / "own", 0o2777)
    (root / "plain").mkdir()
    os.chmod(root / "plain", 0o777)

    def create() -> None:
        os.close(os.open("g/file", os.O_WRONLY | os.O_CREAT, 0o644))
        os.mkdir("g/sub", 0o755)
        os.mkdir("g/sub/deeper", 0o700)
        os.close(os.open("g/sub/deeper/file", os.O_WRONLY | os.O_CREAT, 0o600))
        os.mknod("g/node", stat.S_IFREG | 0o644)
        # not a member of the directory's group: S_ISGID of a new file is dropped
        os.close(os.open("g/sgid", os.O_WRONLY | os.O_CREAT, 0o2755))
        # a member keeps it
        os.close(os.open("own/sgid", os.O_WRONLY | os.O_CREAT, 0o2755))
        os.close(os.open("plain/file", os.O_WRONLY | os.O_CREAT, 0o644))
        os.mkdir("plain/dir", 0o755)

    as_user(other_user, root, create)
    os.mkdir(root / "g" / "by-root")
    u, g, o = other_user.uid, other_user.gid, OTHER_GROUP
    want = {
        "g/file": (u, o, stat.S_IFREG | 0o644),
        "g/sub": (u, o, stat.S_IFDIR | 0o2755),
        "g/sub/deeper": (u, o, stat.S_IFDIR | 0o2700),
        "g/sub/deeper/file": (u, o, stat.S_IFREG | 0o600),
        "g/node": (u, o, stat.S_IFREG | 0o644),
        "g/sgid": (u, o, stat.S_IFREG | 0o755),
        "g/by-root": (0, o, stat.S_IFDIR | 0o2755),
        "own/sgid": (u, g, stat.S_IFREG | 0o2755),
        "plain/file": (u, g, stat.S_IFREG | 0o644),
        "plain/dir": (u, g, stat.S_IFDIR | 0o755),
    }

    def check() -> None:
        for name, (uid, gid, mode) in want.items():
            st = os.stat(root / name)
            got = (st.st_uid, st.st_gid, st.st_mode)
            assert got == (uid, gid, mode), f"{name}: {got[:2]} {oct(got[2])}"

    check()
    remount_shared(kvfs_mount)
    check()


# ---------------------------------------------------------------------- xattrs
@ALLOW_OTHER
def test_trusted_xattrs_are_hidden_from_other_users(
    kvfs_mount: KvfsMount, other_user: User
) -> None:
    root = shared_root(kvfs_mount)
    write_file(root / "f", b"x")
    os.chmod(root / "f", 0o666)
    os.setxattr(root / "f", "user.u", b"1")
    os.setxattr(root / "f", "trusted.t", b"2")
    os.setxattr(root / "f", "security.s", b"3")
    assert sorted(os.listxattr(root / "f")) == ["security.s", "trusted.t", "user.u"]
    assert sorted(as_user(other_user, root, lambda: os.listxattr("f"))) == [
        "security.s",
        "user.u",
    ]
    assert as_user(other_user, root, lambda: os.getxattr("f", "user.u")) == b"1"
    assert (
        errno_of(as_user, other_user, root, lambda: os.getxattr("f", "trusted.t")) == errno.ENODATA
    )
    assert (
        errno_of(as_user, other_user, root, lambda: os.setxattr("f", "trusted.x", b""))
        == errno.EPERM
    )
    remount_shared(kvfs_mount)
    assert os.getxattr(root / "f", "trusted.t") == b"2"
    assert os.getxattr(root / "f", "security.s") == b"3"
    assert sorted(as_user(other_user, root, lambda: os.listxattr("f"))) == [
        "security.s",
        "user.u",
    ]


def test_xattrs_of_unknown_namespaces_are_not_supported(kvfs_mount: KvfsMount) -> None:
    p = kvfs_mount.path / "f"
    write_file(p, b"x")
    for name in ("bogus.x", "system.kvfs", "userx", "x"):
        assert errno_of(os.setxattr, p, name, b"v") == errno.EOPNOTSUPP, name
        assert errno_of(os.getxattr, p, name) == errno.EOPNOTSUPP, name
        assert errno_of(os.removexattr, p, name) == errno.EOPNOTSUPP, name
    # no POSIX ACLs (kvfs does not enforce them, so it does not store them)
    acl = b"\x02\0\0\0"  # an empty POSIX ACL, version 2
    assert errno_of(os.getxattr, p, "system.posix_acl_access") == errno.EOPNOTSUPP
    assert errno_of(os.setxattr, p, "system.posix_acl_access", acl) == errno.EOPNOTSUPP
    os.setxattr(kvfs_mount.path, "user.kvfs.policy", b"engine-managed")
    assert os.getxattr(kvfs_mount.path, "user.kvfs.policy") == b"engine-managed"
    assert os.getxattr(kvfs_mount.path, "user.kvfs.stats")
    assert os.listxattr(p) == []


# ---------------------------------------------------------------------- timestamps
def test_o_trunc_of_an_empty_file_updates_mtime_and_ctime(kvfs_mount: KvfsMount) -> None:
    p = kvfs_mount.path / "empty"
    write_file(p, b"")
    os.utime(p, ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    before = os.stat(p)
    wait_for(lambda: time.time_ns() > before.st_ctime_ns + 2_000_000, what="the clock to move")
    os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))
    after = os.stat(p)
    assert after.st_mtime_ns > before.st_ctime_ns, "mtime did not move"
    assert after.st_ctime_ns > before.st_ctime_ns, "ctime did not move"
    kvfs_mount.remount()
    assert os.stat(p).st_mtime_ns == after.st_mtime_ns
    assert os.stat(p).st_ctime_ns == after.st_ctime_ns


# ---------------------------------------------------------------------- readdir
def test_rewinddir_serves_a_fresh_listing(kvfs_mount: KvfsMount) -> None:
    d = kvfs_mount.path / "d"
    d.mkdir()
    for name in ("a", "b", "c"):
        write_file(d / name, b"")
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert sorted(os.listdir(fd)) == ["a", "b", "c"]  # listdir(fd) rewinds at the end
        os.unlink(d / "a")
        os.rename(d / "b", d / "b2")
        write_file(d / "new", b"")
        assert sorted(os.listdir(fd)) == ["b2", "c", "new"]
        os.unlink(d / "c")
        os.lseek(fd, 0, os.SEEK_SET)  # an explicit rewind too
        assert sorted(os.listdir(fd)) == ["b2", "new"]
    finally:
        os.close(fd)


class _Dirent(ctypes.Structure):
    _fields_ = [
        ("d_ino", ctypes.c_uint64),
        ("d_off", ctypes.c_int64),
        ("d_reclen", ctypes.c_ushort),
        ("d_type", ctypes.c_ubyte),
        ("d_name", ctypes.c_char * 256),
    ]


def raw_listing(path: Path) -> dict[bytes, int]:
    """name -> d_ino of every entry libc's readdir() returns, dot entries included."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.opendir.restype = ctypes.c_void_p
    libc.readdir.restype = ctypes.POINTER(_Dirent)
    libc.readdir.argtypes = libc.closedir.argtypes = [ctypes.c_void_p]
    dirp = libc.opendir(os.fsencode(path))
    assert dirp, os.strerror(ctypes.get_errno())
    out = {}
    try:
        while True:
            ent = libc.readdir(dirp)
            if not ent:
                break
            out[ent.contents.d_name] = ent.contents.d_ino
    finally:
        libc.closedir(dirp)
    return out


def test_readdir_lists_dot_and_dotdot(kvfs_mount: KvfsMount) -> None:
    mnt = kvfs_mount.path
    (mnt / "sub").mkdir()
    write_file(mnt / "sub" / "f", b"")
    root_ino, sub_ino = os.stat(mnt).st_ino, os.stat(mnt / "sub").st_ino
    assert raw_listing(mnt / "sub") == {
        b".": sub_ino,
        b"..": root_ino,
        b"f": os.stat(mnt / "sub" / "f").st_ino,
    }
    assert set(raw_listing(mnt)) == {b".", b"..", b"sub"}
    ls = subprocess.run(["ls", "-a1", str(mnt / "sub")], capture_output=True, text=True, check=True)
    assert ls.stdout.split() == [".", "..", "f"]
    assert os.listdir(mnt / "sub") == ["f"]
    assert [e.name for e in os.scandir(mnt)] == ["sub"]


# ---------------------------------------------------------------------- rename exchange
RENAME_EXCHANGE = 2


def renameat2(old: Path, new: Path, flags: int) -> None:
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        pytest.skip("libc has no renameat2")
    if fn(-100, os.fsencode(old), -100, os.fsencode(new), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def test_rename_exchange_updates_ctime_and_swaps_directories_across_parents(
    kvfs_mount: KvfsMount,
) -> None:
    mnt = kvfs_mount.path
    p1, p2 = mnt / "p1", mnt / "p2"
    os.makedirs(p1 / "d1" / "inner")
    os.makedirs(p2 / "d2")
    write_file(p1 / "d1" / "x", b"one")
    write_file(p2 / "d2" / "y", b"two")
    write_file(p2 / "f", b"file")
    ino = {n: os.stat(mnt / n).st_ino for n in ("p1", "p2", "p1/d1", "p2/d2", "p2/f")}
    before = {n: os.stat(mnt / n) for n in ino}
    wait_for(
        lambda: time.time_ns() > max(s.st_ctime_ns for s in before.values()) + 2_000_000,
        what="the clock to move",
    )

    renameat2(p1 / "d1", p2 / "d2", RENAME_EXCHANGE)  # two directories, two parents
    for n in ("p1/d1", "p2/d2"):
        assert os.stat(mnt / n).st_ctime_ns > before[n].st_ctime_ns, f"{n}: ctime"
    for n in ("p1", "p2"):
        assert os.stat(mnt / n).st_mtime_ns > before[n].st_mtime_ns, f"{n}: mtime"
    renameat2(p1 / "d1", p2 / "f", RENAME_EXCHANGE)  # a directory and a file
    assert os.stat(p2 / "f").st_ctime_ns > before["p2/f"].st_ctime_ns

    def check() -> None:
        assert os.stat(p1 / "d1").st_ino == ino["p2/f"]
        assert os.stat(p2 / "f").st_ino == ino["p2/d2"]
        assert os.stat(p2 / "d2").st_ino == ino["p1/d1"]
        assert (p1 / "d1").read_bytes() == b"file"
        assert (p2 / "f" / "y").read_bytes() == b"two"
        assert (p2 / "d2" / "x").read_bytes() == b"one"
        assert os.stat(p2 / "f" / "..").st_ino == ino["p2"]
        assert os.stat(p2 / "d2" / "inner" / ".." / "..").st_ino == ino["p2"]
        assert raw_listing(p2 / "d2")[b".."] == ino["p2"]
        assert os.stat(p1).st_nlink == 2  # its subdirectory went, a file came
        assert os.stat(p2).st_nlink == 4
        assert os.stat(p2 / "d2").st_nlink == 3

    check()
    # a directory into its own subtree: refused
    assert errno_of(renameat2, p2 / "d2", p2 / "d2" / "inner", RENAME_EXCHANGE) == errno.EINVAL
    assert errno_of(renameat2, p2 / "d2" / "inner", p2 / "d2", RENAME_EXCHANGE) == errno.EINVAL
    kvfs_mount.remount()
    check()
    kvfs_mount.crash()  # the journal's replay, without a final checkpoint
    check()


# ---------------------------------------------------------------------- file types
def test_symlinks_fifos_devices_and_sockets_are_eperm(kvfs_mount: KvfsMount) -> None:
    mnt = kvfs_mount.path
    write_file(mnt / "target", b"t")
    assert errno_of(os.symlink, "target", mnt / "link") == errno.EPERM
    assert errno_of(os.mkfifo, mnt / "fifo") == errno.EPERM
    assert errno_of(os.mknod, mnt / "chr", stat.S_IFCHR | 0o600, os.makedev(1, 3)) == errno.EPERM
    assert errno_of(os.mknod, mnt / "blk", stat.S_IFBLK | 0o600, os.makedev(7, 0)) == errno.EPERM
    with socket.socket(socket.AF_UNIX) as s:
        assert errno_of(s.bind, str(mnt / "sock")) == errno.EPERM
    assert os.listdir(mnt) == ["target"]


# ---------------------------------------------------------------------- st_blocks
def du_bytes(path: Path) -> int:
    out = subprocess.run(["du", "-B1", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def test_st_blocks_counts_allocated_units_and_fragments_not_holes(kvfs_mount: KvfsMount) -> None:
    mnt = kvfs_mount.path
    unit = os.stat(mnt).st_blksize
    assert unit == MiB
    write_file(mnt / "one", b"x")
    write_file(mnt / "three-and-a-half", pattern("3.5", 3 * unit + unit // 2))
    fd = os.open(mnt / "sparse", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"head", 0)
        os.pwrite(fd, b"tail", 10 * unit)  # units 1..9 are a hole
    finally:
        os.close(fd)
    fd = os.open(mnt / "hole", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, 5 * unit)
    finally:
        os.close(fd)
    # a partial last unit is held as 4 KiB fragments (docs/format.md "Fragment tails")
    frag = 4096
    want = {"one": frag, "three-and-a-half": 3 * unit + unit // 2, "sparse": unit + frag, "hole": 0}

    def check() -> None:
        for name, size in want.items():
            st = os.stat(mnt / name)
            assert st.st_blksize == unit
            assert st.st_blocks * 512 == size, (name, st.st_blocks)
            assert du_bytes(mnt / name) == size, name

    check()
    # while a file is being written, its dirty units are allocated space too
    fd = os.open(mnt / "open", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"y")
        os.pwrite(fd, b"z", 2 * unit)
        assert os.fstat(fd).st_blocks * 512 == 2 * unit
    finally:
        os.close(fd)
    want["open"] = unit + frag  # unit 0 whole, the 1-byte tail in unit 2 a fragment
    check()
    kvfs_mount.remount()
    check()
