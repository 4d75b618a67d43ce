"""``kvfs umount MOUNTPOINT``: unmount a kvfs mount and wait until its daemon has
finished (final commit and checkpoint); ``--lazy`` detaches a busy one. A mount whose
daemon died, or was killed while stuck in the kernel, is cleaned up too.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import time

from kvfs.cli import daemon
from kvfs.cli.args import parse_seconds
from kvfs.cli.outcome import EXIT_FAIL, EXIT_OK
from kvfs.common.errors import UserError

log = logging.getLogger("kvfs")

HELP = "unmount and wait for the daemon to finish"


def add_arguments(u: argparse.ArgumentParser) -> None:
    u.add_argument("mountpoint", help="where the pool is mounted")
    u.add_argument(
        "--timeout", type=parse_seconds, default=60.0, help="seconds to wait for the daemon (60)"
    )
    u.add_argument(
        "--lazy",
        "-z",
        action="store_true",
        help="detach a busy mount now; its daemon ends once the last process using it lets go",
    )


def run(args: argparse.Namespace) -> int:
    from kvfs.common import procs

    path = os.path.realpath(args.mountpoint)
    mount = daemon.mount_at(path)
    if mount is None:
        raise UserError(f"{path} is not mounted")
    if mount.fstype != daemon.KVFS_FSTYPE:
        raise UserError(f"{path} is a {mount.fstype} mount, not kvfs; refusing to unmount it")
    pid = daemon.daemon_pid(mount)  # its pidfile, keyed by the FUSE connection
    stuck = daemon.killed_daemon(mount)
    if stuck is not None and daemon.abort_connection(mount):
        # killed while a thread of it waited in the kernel: it can neither answer nor
        # exit, and every request to the mount (the statfs below too) would wait
        print(
            f"kvfs: {path}: its daemon (pid {stuck}) was killed but could not exit; "
            "aborted its FUSE connection (waiting callers get ECONNABORTED)"
        )
        pid = stuck
    pids = [] if pid is None else [pid]
    dead = daemon.daemon_gone(path)  # only the kernel's mount is left
    if pid is None and not dead:  # a daemon of a release before pidfiles, or one exiting
        log.warning("%s: no pidfile for its daemon; not waiting for it to exit", path)
    # who keeps it: read before a lazy unmount hides their paths, after a failed one
    users = procs.users_of(path) if args.lazy and not dead else []
    cmd = ["fusermount3", "-u", *(["-z"] if dead or args.lazy else []), path]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        users = users or ([] if dead else procs.users_of(path))
        if users:
            raise UserError(
                f"{path} is busy: used by {_listed(users)}; end them, or detach it now "
                f"with `kvfs umount --lazy {path}` (its daemon then ends when they let go)",
                EXIT_FAIL,
            )
        raise UserError(f"unmount failed: {r.stderr.strip()}", EXIT_FAIL)
    if args.lazy and users:
        end = f"its daemon (pid {pid})" if pid is not None else "its daemon"
        print(f"kvfs: {path} detached; {end} ends once these let go of it: {_listed(users)}")
        return EXIT_OK
    deadline = time.monotonic() + args.timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    if any(alive(p) for p in pids):
        raise UserError("kvfs daemon still running after unmount", EXIT_FAIL)
    if dead:
        print(f"kvfs: {path}: the daemon had died; its mount is cleaned up")
    return EXIT_OK


def _listed(users: list[tuple[int, str]], most: int = 5) -> str:
    """``pid 123 (python3), pid 456 (bash)``, at most ``most`` of them."""
    text = ", ".join(f"pid {pid} ({name})" for pid, name in users[:most])
    return text + (f" and {len(users) - most} more" if len(users) > most else "")


def alive(pid: int) -> bool:
    """Still running: not exited, or exited but with threads of it still ending (a
    zombie leader whose last thread is still tearing the memory down, which a parent's
    wait does not report yet)."""
    seen = daemon.process_state(pid)
    return seen is not None and (seen[0] not in ("Z", "X") or seen[1] > 1)


__all__ = ["HELP", "add_arguments", "alive", "run"]
