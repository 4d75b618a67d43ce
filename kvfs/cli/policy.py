"""``kvfs policy DIR``: show or set a top-level directory's eviction policy, quota and
maximum file size, which are its xattrs ``user.kvfs.policy``, ``user.kvfs.quota`` and
``user.kvfs.max_file_size`` (the daemon checks them again: ``setfattr`` works too)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os

from kvfs.cli import daemon
from kvfs.cli.outcome import EXIT_OK
from kvfs.common import sizes
from kvfs.common.errors import UserError

HELP = "show or set a top-level directory's policy/quota"


def add_arguments(pol: argparse.ArgumentParser) -> None:
    pol.add_argument("directory", help="a top-level directory of a kvfs mount")
    pol.add_argument(
        "--set",
        choices=("kvfs-managed", "engine-managed"),
        help="kvfs-managed: kvfs evicts in policy order; engine-managed: only orphans",
    )
    pol.add_argument("--quota", help="byte quota, e.g. 100G (0 removes it)")
    pol.add_argument(
        "--max-file-size", help="largest file in the directory, e.g. 8G (0 removes it)"
    )


_WHERE = "policy and quota apply to top-level directories of the mount"


def _check_policy_target(args: argparse.Namespace, mountpoint: str) -> None:
    """UserError (nothing changed) unless ``args.directory`` is where its settings
    take effect: a top-level directory of the mount, or the root for its policy
    alone (a quota or size limit there would hold only for the root's own files).
    The daemon refuses the same xattrs elsewhere (EINVAL), for ``setfattr`` too."""
    d = args.directory
    real = os.path.realpath(d)
    if real == os.path.realpath(mountpoint):
        given = [f"--{n}" for n in ("quota", "max_file_size") if getattr(args, n) is not None]
        if given:
            raise UserError(
                f"{d} is the mount root: {' and '.join(g.replace('_', '-') for g in given)} "
                "apply to top-level directories (the pool's size bounds the mount, "
                "`kvfs mount --max-file-size` sets a mount-wide limit); nothing changed"
            )
        return
    if os.path.dirname(real) != os.path.realpath(mountpoint) or not os.path.isdir(real):
        what = "a nested directory" if os.path.isdir(real) else "not a directory"
        raise UserError(
            f"{d} is not a top-level directory of the mount {mountpoint} ({what}): "
            f"{_WHERE}; nothing changed"
        )


def run(args: argparse.Namespace) -> int:
    """Policy, quota and maximum file size are the xattrs user.kvfs.policy,
    user.kvfs.quota and user.kvfs.max_file_size of a top-level directory."""
    d = args.directory
    mount = daemon.mount_containing(d)
    if mount is None or mount.fstype != daemon.KVFS_FSTYPE:
        where = f"a {mount.fstype} mount" if mount else "no mount"
        raise UserError(f"{d} is not inside a kvfs mount (it is on {where}); nothing changed")
    _check_policy_target(args, mount.point)
    try:
        if args.set:
            os.setxattr(d, "user.kvfs.policy", args.set.encode())
        for name, value in (("quota", args.quota), ("max_file_size", args.max_file_size)):
            if value is None:
                continue
            try:
                nbytes = sizes.parse_size(value)
            except sizes.SizeError as e:
                raise UserError(f"--{name.replace('_', '-')}: {e}; nothing changed") from None
            if nbytes == 0:
                with contextlib.suppress(OSError):
                    os.removexattr(d, f"user.kvfs.{name}")
            else:
                os.setxattr(d, f"user.kvfs.{name}", value.strip().encode())
        values = {}
        for name in ("policy", "quota", "max_file_size"):
            try:
                values[name] = os.getxattr(d, f"user.kvfs.{name}").decode()
            except OSError:
                values[name] = "(default)"
                continue
            if name != "policy":
                with contextlib.suppress(sizes.SizeError):
                    values[name] += f" ({sizes.format_size(sizes.parse_size(values[name]))})"
    except OSError as e:
        if e.errno == errno.EINVAL:  # values are checked above: the daemon refused the place
            raise UserError(f"{d}: {e.strerror}: {_WHERE}; nothing changed") from None
        raise UserError(f"{d}: {e.strerror}") from None
    print(
        f"{d}: policy {values['policy']}, quota {values['quota']}, "
        f"max file size {values['max_file_size']}"
    )
    return EXIT_OK


__all__ = ["HELP", "add_arguments", "run"]
