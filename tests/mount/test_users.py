"""Sharing one pool between users, on a real ``--allow-other`` mount.

The model (docs/design.md, "Several users on one pool"): a reserve only root (and the
mount's owner) may fill; fair-share eviction (a user over its share of the pool
loses its own files first, and only its own); the bytes a user holds open are
bounded by its share; no file may outgrow the maximum file size (EFBIG before
anything is evicted for it); evictions are logged. The second user is a throwaway
system account made by the test, its writes run in a child process under its uid.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import KvfsMount, read_or_errno, write_file

MiB = 1 << 20
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (useradd, allow_other)"),
    pytest.mark.mount_options("--allow-other"),
]


def content(name: str, size: int) -> bytes:
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


class UserWriter:
    """Files written by another user: a forked child that drops to the user's uid and
    gid (no exec: the test's interpreter may not be executable by that user), writes
    ``n`` files of ``size`` bytes into ``d`` and reports what it wrote; with ``hold``
    it keeps them open (pinned: an open file is never evicted) until :meth:`finish`."""

    def __init__(
        self, user: pwd.struct_passwd, d: Path, prefix: str, n: int, size: int, hold: bool = False
    ) -> None:
        report_r, report_w = os.pipe()
        self._release_r, self._release_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.close(report_r)
                os.close(self._release_w)
                # the directory first: the test's tmp path above the mount is root's
                dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
                os.setgroups([])
                os.setgid(user.pw_gid)
                os.setuid(user.pw_uid)
                out = self._write(dfd, prefix, n, size, hold)
                os.write(report_w, (json.dumps(out) + "\n").encode())
                os.close(report_w)
                os.read(self._release_r, 1)  # until the test lets go
                code = 0
            except BaseException as e:  # say why, on the report pipe
                os.write(report_w, (json.dumps({"crash": repr(e)}) + "\n").encode())
            finally:
                os._exit(code)
        os.close(report_w)
        os.close(self._release_r)
        self.pid = pid
        self._report = os.fdopen(report_r)

    @staticmethod
    def _write(dfd: int, prefix: str, n: int, size: int, hold: bool) -> dict[str, list[object]]:
        out: dict[str, list[object]] = {"written": [], "errors": []}
        for i in range(n):
            name = f"{prefix}-{i:03d}"
            data = content(name, size)
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dfd)
            except OSError as e:
                out["errors"].append([name, e.errno])
                continue
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view[: 8 * MiB]) :]
                os.fsync(fd)
            except OSError as e:
                out["errors"].append([name, e.errno])
                with contextlib.suppress(OSError):  # the failed file's close fails too
                    os.close(fd)
                continue
            if not hold:
                os.close(fd)  # held ones stay open until the process exits
            out["written"].append(name)
        return out

    def report(self) -> dict[str, list[object]]:
        line = self._report.readline()
        assert line, "the user's writer died"
        out: dict[str, list[object]] = json.loads(line)
        assert "crash" not in out, out
        return out

    def finish(self) -> None:
        os.close(self._release_w)
        self._report.close()
        _, status = os.waitpid(self.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


def user_dir(mount: KvfsMount, user: pwd.struct_passwd, name: str) -> Path:
    d = mount.path / name
    d.mkdir()
    os.chown(d, user.pw_uid, user.pw_gid)
    return d


def test_a_user_over_its_share_loses_only_its_own_files(
    kvfs_mount: KvfsMount, unprivileged_user: pwd.struct_passwd
) -> None:
    """Reported: a second user's 14 x 256 MiB evicted 8 of root's 10 files."""
    mine = kvfs_mount.path / "root-cache"
    mine.mkdir()
    for i in range(10):  # root: 160 MiB, well within its half of the pool
        write_file(mine / f"r{i}", content(f"r{i}", 16 * MiB))
    theirs = user_dir(kvfs_mount, unprivileged_user, "user-cache")
    p = UserWriter(unprivileged_user, theirs, "u", 14, 64 * MiB)  # 896 MiB through a ~500 MiB pool
    out = p.report()
    p.finish()
    assert not out["errors"], out["errors"]
    for i in range(10):
        assert read_or_errno(mine / f"r{i}") == content(f"r{i}", 16 * MiB), f"r{i}"
    stats = kvfs_mount.stats()["store"]
    assert stats["evictions"] >= 5
    for name in os.listdir(theirs):  # the user's survivors are whole
        assert read_or_errno(theirs / name) in (content(name, 64 * MiB), errno.ENOENT)
    log = kvfs_mount.log.read_text()
    assert "evicted " in log and " file(s)" in log, "evictions are not logged"


def test_open_files_of_a_user_cannot_starve_root(
    kvfs_mount: KvfsMount, unprivileged_user: pwd.struct_passwd
) -> None:
    """Reported: holding its files open, another user made root's next write fail
    (ENOSPC) and root's last files go. Open files are never evicted, so what a user
    may hold open is bounded by its fair share of the pool."""
    mine = kvfs_mount.path / "root-cache"
    mine.mkdir()
    for i in range(10):  # root: 160 MiB
        write_file(mine / f"r{i}", content(f"r{i}", 16 * MiB))
    theirs = user_dir(kvfs_mount, unprivileged_user, "user-cache")
    p = UserWriter(
        unprivileged_user, theirs, "held", 30, 32 * MiB, hold=True
    )  # tries 960 MiB, all open
    try:
        out = p.report()
        held = len(out["written"])
        assert out["errors"], "the user pinned the whole pool open without an error"
        assert {err[1] for err in out["errors"]} == {errno.ENOSPC}, out["errors"]  # type: ignore[index]
        cap = kvfs_mount.stats()["store"]["capacity_bytes"]
        assert held * 32 * MiB <= cap // 2, f"{held} files of 32 MiB held open"
        more = content("root-more", 80 * MiB)
        write_file(mine / "more", more)  # root: room despite the user's pinned files
        assert read_or_errno(mine / "more") == more
        for i in range(10):
            assert read_or_errno(mine / f"r{i}") == content(f"r{i}", 16 * MiB), f"r{i}"
        for name in out["written"]:
            assert read_or_errno(theirs / str(name)) == content(str(name), 32 * MiB)
    finally:
        p.finish()


def test_the_reserve_is_root_s(kvfs_mount: KvfsMount, unprivileged_user: pwd.struct_passwd) -> None:
    theirs = user_dir(kvfs_mount, unprivileged_user, "user-cache")
    p = UserWriter(unprivileged_user, theirs, "held", 20, 32 * MiB, hold=True)
    try:
        out = p.report()
        assert out["errors"], "the user filled the whole pool"
        free = kvfs_mount.stats()["store"]["free_bytes"]
        assert free >= 16 * MiB, f"only {free} bytes left for root"
        mine = kvfs_mount.path / "root-cache"
        mine.mkdir()
        data = content("root-in-reserve", 16 * MiB)
        write_file(mine / "x", data)
        assert read_or_errno(mine / "x") == data
    finally:
        p.finish()


def test_a_file_bigger_than_the_limit_is_efbig_before_anything_is_evicted(
    kvfs_mount: KvfsMount,
) -> None:
    d = kvfs_mount.path / "cache"
    d.mkdir()
    for i in range(16):
        write_file(d / f"f{i}", content(f"f{i}", 16 * MiB))
    cap = kvfs_mount.stats()["store"]["capacity_bytes"]
    fd = os.open(d / "huge", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    written = 0
    try:
        with pytest.raises(OSError) as e:
            chunk = bytes(8 * MiB)
            for _ in range(10 * 1024 // 8):  # 10 GiB into a 512 MiB pool
                written += os.write(fd, chunk)
        assert e.value.errno == errno.EFBIG
    finally:
        os.close(fd)
    assert written <= cap // 4
    stats = kvfs_mount.stats()["store"]
    assert stats["evictions"] == 0, "files were evicted for a file that could never fit"
    for i in range(16):
        assert read_or_errno(d / f"f{i}") == content(f"f{i}", 16 * MiB)


def test_a_directory_sets_its_own_maximum_file_size(kvfs_mount: KvfsMount) -> None:
    d = kvfs_mount.path / "small-files"
    d.mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "kvfs", "policy", str(d), "--max-file-size", "4M"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "max file size 4M" in r.stdout
    write_file(d / "ok", content("ok", 4 * MiB))
    with pytest.raises(OSError) as e:
        write_file(d / "too-big", content("too-big", 4 * MiB + 1))
    assert e.value.errno == errno.EFBIG
    with pytest.raises(OSError) as e:
        os.truncate(d / "ok", 5 * MiB)
    assert e.value.errno == errno.EFBIG
    with pytest.raises(OSError) as bad:
        os.setxattr(d, "user.kvfs.max_file_size", b"huge")
    assert bad.value.errno == errno.EINVAL
    assert read_or_errno(d / "ok") == content("ok", 4 * MiB)
