"""Unit tests of kvfs.store.posix (the ownership, setuid/setgid and xattr-namespace rules)
and of the ``/proc`` credentials it reads; the real-mount side is in
``tests/mount/test_posix.py``."""

from __future__ import annotations

import os
import stat

import pytest

from kvfs.common import procs
from kvfs.common.errors import InvalidArgument, NotSupported
from kvfs.store import posix
from kvfs.store.posix import CAP_FSETID, CAP_SYS_ADMIN, ROOT, Caller

REG, DIR = stat.S_IFREG, stat.S_IFDIR


class Fixed(Caller):
    """A caller with given groups and capabilities (no ``/proc``)."""

    def __init__(self, uid: int, gid: int, groups: set[int], caps: set[int]) -> None:
        super().__init__(uid, gid, 0)
        self.groups, self.caps = groups, caps

    def in_group(self, gid: int) -> bool:
        return gid == self.gid or gid in self.groups

    def capable(self, cap: int) -> bool:
        return cap in self.caps


USER = Fixed(1000, 1000, {20}, set())
MEMBER_OF_7 = Fixed(1000, 1000, {7}, set())
FSETID = Fixed(1000, 1000, set(), {CAP_FSETID})


def test_new_owner_in_a_plain_directory_is_the_caller() -> None:
    assert posix.new_owner(DIR | 0o777, 7, REG | 0o2755, USER) == (REG | 0o2755, 1000)
    assert posix.new_owner(DIR | 0o777, 7, DIR | 0o755, USER) == (DIR | 0o755, 1000)


def test_new_owner_in_a_setgid_directory() -> None:
    sgid_dir = DIR | 0o2777
    assert posix.new_owner(sgid_dir, 7, REG | 0o644, USER) == (REG | 0o644, 7)
    assert posix.new_owner(sgid_dir, 7, DIR | 0o700, USER) == (DIR | 0o2700, 7)
    # a group-executable setgid file by a non-member loses S_ISGID ...
    assert posix.new_owner(sgid_dir, 7, REG | 0o2755, USER) == (REG | 0o755, 7)
    # ... not by a member, nor with CAP_FSETID, nor without group-exec
    assert posix.new_owner(sgid_dir, 7, REG | 0o2755, MEMBER_OF_7) == (REG | 0o2755, 7)
    assert posix.new_owner(sgid_dir, 7, REG | 0o2755, FSETID) == (REG | 0o2755, 7)
    assert posix.new_owner(sgid_dir, 7, REG | 0o2745, USER) == (REG | 0o2745, 7)
    assert posix.new_owner(sgid_dir, 1000, REG | 0o2755, USER) == (REG | 0o2755, 1000)


@pytest.mark.parametrize(
    ("mode", "gid", "caller", "after"),
    [
        (0o6777, 7, USER, 0o0777),
        (0o6767, 7, MEMBER_OF_7, 0o2767),
        (0o2767, 7, USER, 0o0767),
        (0o2767, 1000, USER, 0o2767),
        (0o4700, 7, USER, 0o0700),
        (0o6777, 7, FSETID, 0o6777),
        (0o6777, 0, ROOT, 0o6777),
        (0o0777, 7, USER, 0o0777),
    ],
)
def test_drop_suid_sgid(mode: int, gid: int, caller: Caller, after: int) -> None:
    assert posix.drop_suid_sgid(REG | mode, gid, caller) == REG | after


def test_drop_suid_sgid_leaves_directories_alone() -> None:
    assert posix.drop_suid_sgid(DIR | 0o2777, 7, USER) == DIR | 0o2777


def test_xattr_namespaces() -> None:
    for name in (b"user.a", b"trusted.b", b"security.c", b"user.kvfs.policy"):
        posix.check_xattr_name(name)
    for name in (b"bogus.x", b"system.posix_acl_access", b"userx", b"x", b""):
        with pytest.raises(NotSupported):
            posix.check_xattr_name(name)
    with pytest.raises(InvalidArgument):
        posix.check_xattr_name(b"user.")


def test_listed_xattrs_hide_trusted_without_cap_sys_admin() -> None:
    names = [b"user.a", b"trusted.t", b"security.s", b"bogus.old"]
    admin = Fixed(1000, 1000, set(), {CAP_SYS_ADMIN})
    assert posix.listed_xattrs(names, USER) == [b"user.a", b"security.s"]
    assert posix.listed_xattrs(names, admin) == [b"user.a", b"trusted.t", b"security.s"]
    assert posix.listed_xattrs(names, ROOT) == [b"user.a", b"trusted.t", b"security.s"]


def test_caller_reads_this_threads_credentials() -> None:
    creds = procs.credentials(os.getpid())
    assert creds is not None
    assert creds.groups == frozenset(os.getgroups())  # both: the supplementary groups
    me = Caller(os.geteuid(), os.getegid(), os.getpid())
    for g in os.getgroups():
        assert me.in_group(g)
    assert me.capable(CAP_FSETID) == creds.capable(CAP_FSETID)
    assert procs.credentials(2**22 + 12345) is None  # beyond pid_max: no such thread
    gone = Caller(1000, 1000, 2**22 + 12345)
    assert not gone.capable(CAP_FSETID) and not gone.in_group(7) and gone.in_group(1000)
    assert Caller(0, 0, 2**22 + 12345).capable(CAP_SYS_ADMIN)  # uid 0 where /proc can't tell


def test_permitted_is_the_kernels_generic_permission_without_acls() -> None:
    """What the aware ring's path reads check (``default_permissions`` has the kernel
    check it for FUSE requests): owner, then group, then other bits; root reads and
    searches anything but executes only what has an x bit."""
    import stat as st

    from kvfs.store.posix import MAY_EXEC, MAY_READ, MAY_WRITE, Caller, permitted

    user, member, other = Caller(1000, 100), Caller(1001, 100), Caller(1002, 200)
    f = st.S_IFREG | 0o640
    assert permitted(f, 1000, 100, user, MAY_READ | MAY_WRITE)
    assert permitted(f, 1000, 100, member, MAY_READ)
    assert not permitted(f, 1000, 100, member, MAY_WRITE)
    assert not permitted(f, 1000, 100, other, MAY_READ)
    owner_shut = st.S_IFREG | 0o066  # the owner's own bits decide for the owner
    assert not permitted(owner_shut, 1000, 100, user, MAY_READ)
    d = st.S_IFDIR | 0o700
    assert not permitted(d, 1000, 100, other, MAY_EXEC)
    root = Caller(0, 0)
    assert permitted(d, 1000, 100, root, MAY_EXEC | MAY_READ)
    assert permitted(st.S_IFREG | 0o000, 1000, 100, root, MAY_READ | MAY_WRITE)
    assert not permitted(st.S_IFREG | 0o644, 1000, 100, root, MAY_EXEC)


class Counting(Fixed):
    """A caller that counts how often its groups are asked for."""

    def __init__(self, uid: int, gid: int, groups: set[int], caps: set[int]) -> None:
        super().__init__(uid, gid, groups, caps)
        self.asked = 0

    def in_group(self, gid: int) -> bool:
        self.asked += 1
        return super().in_group(gid)


def _reference(mode: int, uid: int, gid: int, c: Fixed, want: int) -> bool:
    """``generic_permission`` written out plainly: the class of the caller first."""
    from kvfs.store.posix import CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, MAY_EXEC, MAY_WRITE

    if c.uid == uid:
        bits = mode >> 6 & 7
    elif gid == c.gid or gid in c.groups:
        bits = mode >> 3 & 7
    else:
        bits = mode & 7
    if want & ~bits == 0:
        return True
    if want & MAY_EXEC and not stat.S_ISDIR(mode) and not mode & 0o111:
        return False
    if CAP_DAC_OVERRIDE in c.caps:
        return True
    read_search = want == 4 or (stat.S_ISDIR(mode) and not want & MAY_WRITE)
    return not want & MAY_WRITE and read_search and CAP_DAC_READ_SEARCH in c.caps


def test_permitted_asks_for_groups_only_when_they_decide() -> None:
    """Every mode, want and kind of caller: the same answer as the plain rule, and the
    caller's supplementary groups (a ``/proc`` read) asked for only when the group's
    bits and the others' differ on what is wanted (the ring's hot path: a root-owned
    0777 or 0755 mount point searched by an engine's user needs no read)."""
    from kvfs.store.posix import CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, permitted

    callers: list[tuple[int, int, set[int], set[int]]] = [
        (1000, 1000, set(), set()),  # the owner
        (1001, 100, set(), set()),  # the file's group is its own
        (1001, 1001, {100}, set()),  # a supplementary member
        (1001, 1001, set(), set()),  # an other
        (1001, 1001, set(), {CAP_DAC_OVERRIDE}),
        (1001, 1001, {100}, {CAP_DAC_READ_SEARCH}),
    ]
    for kind in (REG, DIR):
        for perm in range(0o1000):
            mode = kind | perm
            group, others = perm >> 3 & 7, perm & 7
            for want in range(1, 8):
                for who in callers:
                    c = Counting(*who)
                    assert permitted(mode, 1000, 100, c, want) == _reference(
                        mode, 1000, 100, c, want
                    ), (oct(mode), want, c.uid, c.gid, c.groups, c.caps)
                    both = want & ~group & 7 == 0 and want & ~others & 7 == 0
                    if c.uid != 1000 and c.gid != 100 and both:
                        assert c.asked == 0, (oct(mode), want)
