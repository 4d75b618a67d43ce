"""The settings of an eviction group (a top-level directory; the root's own files
form the root's group): their xattr names, their values, and where each may be set.
Pure: checked before a setting is stored (``Store.check_group_setting``), read by the
evictor (:mod:`kvfs.evict.evictor`) when it asks a group's policy, quota or maximum
file size."""

from __future__ import annotations

from kvfs.common.errors import InvalidArgument
from kvfs.common.sizes import SizeError, parse_size
from kvfs.index.namespace import ROOT_INO, Inode

POLICY_XATTR = b"user.kvfs.policy"
QUOTA_XATTR = b"user.kvfs.quota"
MAX_FILE_XATTR = b"user.kvfs.max_file_size"
GROUP_XATTRS = (POLICY_XATTR, QUOTA_XATTR, MAX_FILE_XATTR)
"""Settings of a top-level directory, validated before they are stored."""
KVFS_MANAGED = "kvfs-managed"
ENGINE_MANAGED = "engine-managed"
POLICIES = (KVFS_MANAGED, ENGINE_MANAGED)


def parse_quota(value: bytes) -> int:
    """A quota or maximum file size xattr (``100G``, ``5368709120``; ``0``: none) as
    bytes, in the size grammar of :mod:`kvfs.common.sizes`; InvalidArgument otherwise."""
    try:
        return parse_size(value.decode(errors="replace"))
    except SizeError as e:
        raise InvalidArgument(str(e)) from None


ROOT_XATTRS = (POLICY_XATTR,)
"""Settings the root takes (for its own files): a quota or maximum file size there
would read as mount-wide but hold only for files directly in the root."""


def check_group_target(inode: Inode, name: bytes) -> None:
    """InvalidArgument unless ``inode`` is where ``name`` takes effect: a top-level
    directory (any setting) or the root (its policy). Anywhere else it would be stored
    and never read (groups are top-level directories), so it is refused."""
    if inode.ino == ROOT_INO:
        if name not in ROOT_XATTRS:
            raise InvalidArgument(
                f"{name.decode()} on the mount root: set it on a top-level directory "
                "(the pool's size bounds the mount; --max-file-size sets a mount-wide limit)"
            )
        return
    if not inode.is_dir or inode.parent != ROOT_INO:
        raise InvalidArgument(
            f"{name.decode()}: inode {inode.ino} is not a top-level directory of the "
            "mount; policy and quota apply to top-level directories"
        )


def check_group_xattr(name: bytes, value: bytes) -> None:
    """Reject a malformed policy, quota or maximum file size before it is stored."""
    if name == POLICY_XATTR and value.decode(errors="replace") not in POLICIES:
        raise InvalidArgument(f"policy must be one of {', '.join(POLICIES)}")
    if name in (QUOTA_XATTR, MAX_FILE_XATTR):
        parse_quota(value)
