"""Paths inside the mount, for the tiers that name files by them (the cluster tier's
keys): the path of an inode, the directories on a path, and whether a directory's
files are kvfs-managed. Walks of the namespace, O(depth)."""

from __future__ import annotations

import errno
import stat

from kvfs.evict.evictor import Evictor
from kvfs.evict.groups import KVFS_MANAGED
from kvfs.index.namespace import ROOT_INO, Inode, Namespace
from kvfs.store.posix import MAY_EXEC, MAY_READ, MAY_WRITE, Caller, permitted

MAX_DEPTH = 4096
"""Deeper than this is no path (a walk never loops, whatever the index holds)."""


def path_of(ns: Namespace, ino: int) -> bytes | None:
    """The path of ``ino`` inside the mount (no leading ``/``; the root's is empty),
    or None for an inode with no name."""
    inodes, parts = ns.inodes, list[bytes]()
    node = inodes.get(ino)
    for _ in range(MAX_DEPTH):
        if node is None:
            return None
        if node.ino == ROOT_INO:
            return b"/".join(reversed(parts))
        parts.append(node.name)
        node = inodes.get(node.parent)
    return None


def directories_on(ns: Namespace, path: bytes) -> list[tuple[bytes, Inode]]:
    """The directories above ``path``, top down, as far as they exist: each one's path
    and inode."""
    parts = path.split(b"/")[:-1]
    found: list[tuple[bytes, Inode]] = []
    node: Inode | None = ns.inodes.get(ROOT_INO)
    for depth, name in enumerate(parts, 1):
        node = ns.find(node.ino, name) if node is not None else None
        if node is None or not node.is_dir:
            break
        found.append((b"/".join(parts[:depth]), node))
    return found


def _walk(ns: Namespace, parts: list[bytes], caller: Caller) -> Inode | int:
    """The directory ``parts`` names, if ``caller`` may search every directory on
    the way (and that one): the kernel's path walk; else ENOENT, ENOTDIR or EACCES."""
    node = ns.inodes.get(ROOT_INO)
    for name in parts:
        found = _searchable(node, caller)
        if isinstance(found, int):
            return found
        node = ns.find(found.ino, name)
    return _searchable(node, caller)


def _searchable(node: Inode | None, caller: Caller) -> Inode | int:
    """``node`` if it is a directory ``caller`` may search; else the errno."""
    if node is None:
        return errno.ENOENT
    if not node.is_dir:
        return errno.ENOTDIR
    if not permitted(node.mode, node.uid, node.gid, caller, MAY_EXEC):
        return errno.EACCES
    return node


def _place(ns: Namespace, path: bytes, caller: Caller) -> tuple[Inode, bytes] | int:
    """The directory ``path``'s last name is in, if ``caller`` may search its way
    there, and that name; else the errno: EINVAL for what the ring does not resolve
    (``.``, ``..``, empty parts: the client goes through the mount instead)."""
    parts = path.split(b"/")
    if len(parts) > MAX_DEPTH or any(p in (b"", b".", b"..") for p in parts):
        return errno.EINVAL
    parent = _walk(ns, parts[:-1], caller)
    return parent if isinstance(parent, int) else (parent, parts[-1])


def new_file_place(ns: Namespace, path: bytes, caller: Caller) -> tuple[Inode, bytes] | int:
    """The directory and name where ``caller`` may create the new file ``path``, as
    the kernel would let ``open(O_CREAT | O_EXCL)`` create it (search permission on
    every directory, write on the last); else the errno: EEXIST for a name in use
    (the client replaces a file through the mount), ENOENT, ENOTDIR, EACCES, EINVAL."""
    found = _place(ns, path, caller)
    if isinstance(found, int):
        return found
    parent, name = found
    if ns.find(parent.ino, name) is not None:
        return errno.EEXIST
    if not permitted(parent.mode, parent.uid, parent.gid, caller, MAY_WRITE):
        return errno.EACCES
    return found


def readable_file(ns: Namespace, path: bytes, caller: Caller) -> Inode | int:
    """The regular file at ``path`` (from the root, ``/``-separated) if ``caller``
    may search every directory on it and read it, as the kernel would have let it
    open the file; else the errno: ENOENT, EACCES, ENOTDIR, EISDIR, or EINVAL for
    what the ring does not resolve (``.``, ``..``, empty parts, a symbolic link: the
    client opens those through the mount instead)."""
    found = _place(ns, path, caller)
    if isinstance(found, int):
        return found
    node = ns.find(found[0].ino, found[1])
    if node is None:
        return errno.ENOENT
    if node.is_dir:
        return errno.EISDIR
    if not stat.S_ISREG(node.mode):
        return errno.EINVAL
    if not permitted(node.mode, node.uid, node.gid, caller, MAY_READ):
        return errno.EACCES
    return node


def managed(ns: Namespace, evictor: Evictor, parent: int) -> bool:
    """Whether files in directory ``parent`` are kvfs-managed: its top-level
    directory's policy (the default policy for the root's own files). An engine that
    manages its own files keeps its own index: such files stay local."""
    node = ns.inodes.get(parent)
    if node is None:
        return False
    if parent == ROOT_INO:
        return evictor.default_policy == KVFS_MANAGED
    return evictor.group_policy(evictor.group_of(node)) == KVFS_MANAGED
