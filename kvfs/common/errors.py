"""Domain errors of the kvfs core.

The core raises these; only the FUSE adapter (:mod:`kvfs.fuse.ops`) turns them into errno
values, and only the CLI turns :class:`UserError` into a one-line message.
"""

from __future__ import annotations

import errno


class KvfsError(Exception):
    """Base class; ``errno`` is what the FUSE adapter answers with."""

    errno: int = errno.EIO
    expected = False
    """An EIO that is a documented answer, not a fault: not logged as an error."""


class NotFound(KvfsError):
    errno = errno.ENOENT


class Stale(NotFound):
    """An inode the kernel still names is gone (evicted, quarantined, dropped): ESTALE,
    so a path lookup is retried (``LOOKUP_REVAL``) and then misses or creates cleanly."""

    errno = errno.ESTALE


class Incomplete(KvfsError):
    """A file whose bytes were not all stored (a failed device write, a writer killed
    mid-write): never committed, never served; EIO."""

    errno = errno.EIO


class Exists(KvfsError):
    errno = errno.EEXIST


class NotEmpty(KvfsError):
    errno = errno.ENOTEMPTY


class NotADirectory(KvfsError):
    errno = errno.ENOTDIR


class IsADirectory(KvfsError):
    errno = errno.EISDIR


class NameTooLong(KvfsError):
    errno = errno.ENAMETOOLONG


class InvalidArgument(KvfsError):
    errno = errno.EINVAL


class NotPermitted(KvfsError):
    """An operation kvfs never allows (a symlink, a FIFO or device node): EPERM, what
    ``symlink(2)``/``mknod(2)`` say for a filesystem without such files (as vfat)."""

    errno = errno.EPERM


class Busy(KvfsError):
    errno = errno.EBUSY


class TooBig(KvfsError):
    """An answer larger than the kernel carries (a 64 KiB xattr value)."""

    errno = errno.E2BIG


class NotSupported(KvfsError):
    """An xattr namespace kvfs does not support (ext4 says the same): EOPNOTSUPP."""

    errno = errno.EOPNOTSUPP


class FileTooLarge(KvfsError):
    errno = errno.EFBIG


class NoSpace(KvfsError):
    errno = errno.ENOSPC


class NoAttribute(KvfsError):
    errno = errno.ENODATA


class DeviceError(KvfsError):
    """A device request failed or missed its deadline."""

    errno = errno.EIO


class Rewritten(KvfsError):
    """The file was truncated through another descriptor since this one opened it:
    reads through this one could mix two contents (reopen to read the new one)."""

    errno = errno.EIO
    expected = True


class StaleSize(KvfsError):
    """A read asked past the file's end as if it were longer: the kernel has not yet
    applied a shrink. Answered EIO rather than short, which it would zero-fill."""

    errno = errno.EIO
    expected = True


class Corruption(KvfsError):
    """Stored bytes do not match their checksum; never served as data."""

    errno = errno.EIO


class UserError(Exception):
    """A problem the user can fix (bad arguments, foreign device, ...): one clear line."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class QuotaExceeded(KvfsError):
    """A directory's byte quota is full and nothing in it may be evicted."""

    errno = errno.EDQUOT
