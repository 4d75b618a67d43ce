"""kill -9 of the daemon at the worst moment never leaves its callers waiting forever.

Eviction tells the kernel that an evicted file's name is gone (pyfuse3's notify
thread writes FUSE_NOTIFY_DELETE); the kernel takes the directory's lock for it. An
``open(O_CREAT)`` in that directory holds the same lock while it waits for the
daemon's answer, so the notify thread waits (uninterruptibly) until the daemon has
answered. If the daemon is killed right then, the notify thread can never finish:
the process stays a zombie holding its descriptor table, ``/dev/fuse`` never closes,
the kernel never aborts the connection, and the caller waits forever. A kill must
end that (``harness.kill`` aborts the connection, as the kernel would): the
callers get an error, the daemon is reaped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvfs.cli import daemon
from kvfs.testing import harness
from tests.conftest import require_fuse

WRITER = """
import errno, os, sys
d, i = sys.argv[1], sys.argv[2]
data = os.urandom(256 << 10)
n = 0
while True:
    n += 1
    try:
        fd = os.open(f"{d}/f{i}-{n % 300}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data)
        os.close(fd)
    except OSError as e:
        if e.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            sys.exit(0)
"""
"""Rewrites files in one directory until the mount goes away (exit 0 then)."""


def _notify_blocked(pid: int) -> bool:
    """A thread of ``pid`` waits in the kernel inside a FUSE entry notification."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stack") as f:
                stack = f.read()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state == "D" and "fuse_reverse_inval_entry" in stack:
            return True
    return False


def _freeze_while_notify_blocked(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Stop the daemon (SIGSTOP) at a moment a notification of it waits on a
    directory lock: stopped, it answers nothing, so the wait lasts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _notify_blocked(proc.pid):
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(0.2)  # the wait may have ended just before the stop
            if _notify_blocked(proc.pid):
                return
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.001)
    pytest.fail(f"no notification of the daemon waited on a directory lock in {timeout} s")


def _umount_by_cli(proc: subprocess.Popen[bytes], mnt: Path, mount: daemon.Mount) -> None:
    """What an operator does: kill -9 the daemon, then ``kvfs umount``; the command
    must neither hang on the dead mount nor leave the daemon unable to exit."""
    proc.kill()
    deadline = time.monotonic() + 60
    while daemon.killed_daemon(mount) is None:  # its leader gone, the stuck thread not
        assert time.monotonic() < deadline, "the killed daemon left no zombie leader"
        time.sleep(0.01)
    r = subprocess.run(
        [sys.executable, "-m", "kvfs", "umount", str(mnt)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "aborted its FUSE connection" in r.stdout, r.stdout
    proc.wait(60)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("clear", ["harness.kill", "kvfs umount"])
def test_kill9_while_a_notification_waits_on_a_directory_lock(tmp_path: Path, clear: str) -> None:
    require_fuse()
    if not os.access("/proc/self/stack", os.R_OK):
        pytest.skip("needs root: reads kernel stacks (/proc/PID/stack)")
    image = harness.make_image(tmp_path / "pool.img", 512 << 20)
    mnt = tmp_path / "mnt"
    log = tmp_path / "kvfs.log"
    with harness.mounted(mnt, [image], "--format", "--meta-size", "16M", log_file=log) as proc:
        mount = daemon.mount_at(str(mnt.resolve()))
        d = mnt / "pool"
        d.mkdir()
        os.setxattr(d, "user.kvfs.policy", b"kvfs-managed")
        os.setxattr(d, "user.kvfs.quota", b"16M")  # eviction (and its notifications) all along
        writers = [
            subprocess.Popen([sys.executable, "-c", WRITER, str(d), str(i)]) for i in range(4)
        ]
        try:
            _freeze_while_notify_blocked(proc, timeout=300)
            assert mount is not None
            killed = threading.Thread(
                target=lambda: (
                    harness.kill(proc, mnt)
                    if clear == "harness.kill"
                    else _umount_by_cli(proc, mnt, mount)
                ),
                daemon=True,
            )
            killed.start()
            killed.join(120)
            assert not killed.is_alive(), "the killed daemon never exited: its callers hang"
            assert proc.returncode == -signal.SIGKILL
            assert not harness.is_mounted(mnt)
            for w in writers:
                assert w.wait(120) == 0, "a writer got an unexpected error"
        finally:
            if mount is not None and proc.poll() is None:
                daemon.abort_connection(mount)  # a writer whose request was read is unkillable
            for w in writers:
                w.kill()
                w.wait()
