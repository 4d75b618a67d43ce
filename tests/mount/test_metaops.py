"""Metadata operations on a real mount: ``ls -l`` needs no security label per entry
on a pool that has none (and one set anywhere brings ENODATA back, across a remount),
files renamed across quota groups keep their bytes and move their count, and ``df``
and ``kvfs stats`` agree with what was created."""

from __future__ import annotations

import errno
import json
import os
import subprocess

from kvfs.testing.harness import kvfs_command
from tests.conftest import KvfsMount, errno_of, pattern, write_file

MiB = 1 << 20


def test_security_labels_answered_without_breaking_user_xattrs(kvfs_mount: KvfsMount) -> None:
    root = kvfs_mount.path
    d = root / "d"
    d.mkdir()
    for i in range(50):
        write_file(d / f"f{i}", pattern(i, 1000 + i))
    os.setxattr(d / "f1", "user.vllm.kv_crc32c", b"1234")
    # coreutils' getfilecon_cache: EOPNOTSUPP makes ls stop asking for this device
    assert errno_of(os.getxattr, d / "f0", "security.selinux") == errno.EOPNOTSUPP
    assert errno_of(os.getxattr, d / "f0", "user.missing") == errno.ENODATA
    out = subprocess.run(["ls", "-l", str(d)], check=True, capture_output=True, text=True)
    lines = out.stdout.splitlines()[1:]
    assert sorted(line.split()[-1] for line in lines) == sorted(f"f{i}" for i in range(50))
    assert {line.split()[-1]: int(line.split()[4]) for line in lines}["f7"] == 1007
    assert os.getxattr(d / "f1", "user.vllm.kv_crc32c") == b"1234"
    os.setxattr(d / "f2", "security.label", b"s0")
    assert errno_of(os.getxattr, d / "f0", "security.selinux") == errno.ENODATA
    kvfs_mount.remount()
    assert errno_of(os.getxattr, d / "f0", "security.selinux") == errno.ENODATA
    assert os.getxattr(d / "f2", "security.label") == b"s0"
    assert os.getxattr(d / "f1", "user.vllm.kv_crc32c") == b"1234"
    assert sorted(os.listxattr(d / "f1")) == ["user.vllm.kv_crc32c"]


def test_renames_across_quota_groups_keep_bytes_and_counts(kvfs_mount: KvfsMount) -> None:
    root = kvfs_mount.path
    a, b = root / "a", root / "b"
    a.mkdir()
    b.mkdir()
    for group, quota in ((a, b"8M"), (b, b"6M")):  # engine-managed: EDQUOT, no eviction
        os.setxattr(group, "user.kvfs.policy", b"engine-managed")
        os.setxattr(group, "user.kvfs.quota", quota)
    want = {f"f{i}": pattern(("q", i), 2 * MiB - 7 * i) for i in range(3)}
    for name, data in want.items():
        write_file(a / name, data)
    for name in want:
        os.rename(a / name, b / name)
    # the renamed files fill b's quota (6 units): 3 MiB more do not fit there, but in a
    big = pattern("big", 3 * MiB)
    assert errno_of(lambda: write_file(b / "big", big)) == errno.EDQUOT
    assert not (b / "big").exists()  # an incomplete file is never kept
    write_file(a / "big", big)
    kvfs_mount.remount()
    for name, data in want.items():
        assert (b / name).read_bytes() == data, name
    assert (a / "big").read_bytes() == big
    assert sorted(os.listdir(a)) == ["big"] and sorted(os.listdir(b)) == sorted(want)


def test_df_and_stats_count_what_was_created(kvfs_mount: KvfsMount) -> None:
    root = kvfs_mount.path
    before = os.statvfs(root)
    (root / "d").mkdir()
    for i in range(30):
        write_file(root / "d" / f"f{i}", b"x" * 100)
    for i in range(10):
        os.unlink(root / "d" / f"f{i}")
    out = subprocess.run(
        [*kvfs_command(), "stats", "--json", str(root)], check=True, capture_output=True
    )
    store = json.loads(out.stdout)["store"]
    assert (store["files"], store["directories"]) == (20, 2)
    after = os.statvfs(root)
    assert after.f_files - after.f_ffree == before.f_files - before.f_ffree + 21
