"""POSIX rules kvfs applies itself, as ext4 does: who owns a new inode, when
setuid/setgid bits go, which xattr namespaces exist and who sees ``trusted.*``.

With ``default_permissions`` the kernel checks access, but these rules are the
filesystem's: ext4 gets them from the kernel's generic inode code
(``inode_init_owner``, ``setattr_should_drop_suidgid``) and its xattr handlers,
which a FUSE filesystem does not run. Pure, except that :class:`Caller` reads the
caller's supplementary groups and capabilities from ``/proc`` once, and only when a
rule needs them (rarely: a setgid bit is involved, or a ``trusted.*`` name).
``docs/design.md`` ("POSIX behaviour") lists the rules.
"""

from __future__ import annotations

import stat

from kvfs.common import procs
from kvfs.common.errors import InvalidArgument, NotSupported

CAP_DAC_OVERRIDE = 1
CAP_DAC_READ_SEARCH = 2
CAP_FSETID = 4
CAP_SYS_ADMIN = 21

XATTR_NAMESPACES = (b"user.", b"trusted.", b"security.")
"""What kvfs stores. ``system.*`` (POSIX ACLs) is not supported: kvfs does not enforce
ACLs, so it does not pretend to keep them (ext4 mounted ``noacl`` says the same)."""
TRUSTED = b"trusted."

_UNREAD = object()


class Caller:
    """The thread behind a request: FUSE tells its uid, fsgid and thread id."""

    def __init__(self, uid: int, gid: int, pid: int = 0) -> None:
        self.uid, self.gid, self.pid = uid, gid, pid
        self._creds: object = _UNREAD

    def _credentials(self) -> procs.Credentials | None:
        if self._creds is _UNREAD:
            self._creds = procs.credentials(self.pid) if self.pid > 0 else None
        creds = self._creds
        assert creds is None or isinstance(creds, procs.Credentials)
        return creds

    def in_group(self, gid: int) -> bool:
        """The kernel's ``in_group_p``: the fsgid or a supplementary group."""
        if gid == self.gid:
            return True
        creds = self._credentials()
        return creds is not None and gid in creds.groups

    def capable(self, cap: int) -> bool:
        """Does the caller hold capability ``cap``? Where ``/proc`` cannot tell (the
        thread is gone, or no pid: a caller inside kvfs), uid 0 counts as capable."""
        creds = self._credentials()
        return creds.capable(cap) if creds is not None else self.uid == 0


ROOT = Caller(0, 0)
"""A privileged caller (kvfs itself, and tests calling the store directly)."""


MAY_EXEC, MAY_WRITE, MAY_READ = 1, 2, 4


def permitted(mode: int, uid: int, gid: int, caller: Caller, want: int) -> bool:
    """The kernel's ``generic_permission`` without ACLs (kvfs keeps none): the
    owner's bits for the owner, else the group's for a member, else the others';
    ``CAP_DAC_OVERRIDE`` reads and writes anything and searches any directory (and
    executes a file with any x bit), ``CAP_DAC_READ_SEARCH`` reads and searches. What
    ``default_permissions`` has the kernel check before FUSE sees a request, for the
    requests that reach kvfs another way (the aware ring's paths)."""
    if caller.uid == uid:
        bits = (mode >> 6) & 7
    elif gid != caller.gid and want & ~((mode >> 3) & mode & 7) == 0:
        return True  # the group's and the others' bits both grant it: membership (a
        # read of /proc per request on the ring's hot path) cannot change the answer
    elif caller.in_group(gid):
        bits = (mode >> 3) & 7
    else:
        bits = mode & 7
    if want & ~bits == 0:
        return True
    is_dir = stat.S_ISDIR(mode)
    if want & MAY_EXEC and not is_dir and not mode & 0o111:
        return False  # no x bit at all: not even root executes it
    if caller.capable(CAP_DAC_OVERRIDE):
        return True
    return (
        not want & MAY_WRITE
        and (want == MAY_READ or is_dir)
        and caller.capable(CAP_DAC_READ_SEARCH)
    )


def new_owner(dir_mode: int, dir_gid: int, mode: int, caller: Caller) -> tuple[int, int]:
    """(mode, gid) of an inode ``caller`` creates in a directory: ``inode_init_owner``
    with the VFS's ``mode_strip_sgid``. In a setgid directory the new inode gets the
    directory's group, a new directory also its S_ISGID bit, and a group-executable
    S_ISGID file made by a caller outside that group (without CAP_FSETID) loses S_ISGID."""
    if not dir_mode & stat.S_ISGID:
        return mode, caller.gid
    if stat.S_ISDIR(mode):
        return mode | stat.S_ISGID, dir_gid
    sgid_x = stat.S_ISGID | stat.S_IXGRP
    if mode & sgid_x == sgid_x and not caller.in_group(dir_gid) and not caller.capable(CAP_FSETID):
        mode &= ~stat.S_ISGID
    return mode, dir_gid


def drop_suid_sgid(mode: int, gid: int, caller: Caller) -> int:
    """The mode of a regular file after ``caller`` truncated it (ext4 and the kernel's
    ``setattr_should_drop_suidgid``): without CAP_FSETID, S_ISUID always goes, and
    S_ISGID when the file is group-executable or the caller is not in its group
    (S_ISGID without group-exec, the old mandatory-locking mark, stays for members)."""
    if not stat.S_ISREG(mode) or not mode & (stat.S_ISUID | stat.S_ISGID):
        return mode
    kill = mode & stat.S_ISUID
    if mode & stat.S_ISGID and (mode & stat.S_IXGRP or not caller.in_group(gid)):
        kill |= stat.S_ISGID
    if not kill or caller.capable(CAP_FSETID):
        return mode
    return mode & ~kill


def check_xattr_name(name: bytes) -> None:
    """NotSupported (EOPNOTSUPP) for a namespace kvfs does not keep, as ext4 answers
    for one it has no handler for; InvalidArgument for a bare prefix (``user.``)."""
    for prefix in XATTR_NAMESPACES:
        if name.startswith(prefix):
            if len(name) == len(prefix):
                raise InvalidArgument(f"xattr name {name!r} has no name after its namespace")
            return
    raise NotSupported(f"xattr namespace of {name!r} is not supported")


def listed_xattrs(names: list[bytes], caller: Caller) -> list[bytes]:
    """What listxattr shows ``caller``: ``trusted.*`` only with CAP_SYS_ADMIN (ext4's
    ``ext4_xattr_trusted_list``); the kernel itself refuses the rest of such access."""
    listable = [n for n in names if n.startswith(XATTR_NAMESPACES)]
    if any(n.startswith(TRUSTED) for n in listable) and not caller.capable(CAP_SYS_ADMIN):
        return [n for n in listable if not n.startswith(TRUSTED)]
    return listable
