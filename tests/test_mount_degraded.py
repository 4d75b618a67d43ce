"""A pool mounted with one of its three members missing.

A refused mount says which member is missing and never suggests ``kvfs format``.
"Missing" means not named on the command line: each member is a separate image file.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import require_fuse, write_file

from kvfs import harness

MiB = 1 << 20


def content(name: str, size: int) -> bytes:
    import random

    return random.Random(name).randbytes(size)


def kvfs(*args: object) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvfs", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def three_member_pool(
    tmp_path: Path, sizes: list[int], member_size: int = 128 * MiB
) -> tuple[list[Path], dict[str, bytes]]:
    """Format three image files, write files ``f0``.. of ``sizes`` (1 to 3 stripes of
    8 MiB, so some have units on member 3 and some do not), unmount cleanly."""
    devs = [harness.make_image(tmp_path / f"m{i}.img", member_size) for i in range(3)]
    files = {f"f{i}": content(f"f{i}", size) for i, size in enumerate(sizes)}
    mnt = tmp_path / "mnt"
    with harness.mounted(
        mnt, devs, "--format", "--meta-size", "8M", log_file=tmp_path / "format.log"
    ):
        for name, data in files.items():
            write_file(mnt / name, data)
    return devs, files


def one_line(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "kvfs format" not in lines[0] and "format" not in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("degraded", [False, True])
def test_refusals_name_the_missing_member_and_never_suggest_format(
    tmp_path: Path, degraded: bool
) -> None:
    from kvfs.fsck import offline_index

    require_fuse()
    devs, _ = three_member_pool(tmp_path, [MiB])
    _, pool = offline_index([str(d) for d in devs])
    pool_uuid = str(uuid.UUID(bytes=pool.superblocks[0].pool_uuid))
    mnt, opt = tmp_path / "mnt", ["--degraded"] if degraded else []
    if not degraded:
        line = one_line(kvfs("mount", "--foreground", mnt, *devs[:2]))
        assert f"pool {pool_uuid} has 3 members; member 3 is missing" in line, line
        assert "attach it, or mount with --degraded" in line, line
    line = one_line(kvfs("mount", "--foreground", mnt, *devs[1:], *opt))
    assert f"pool {pool_uuid} has 3 members; member 1 is missing" in line, line
    assert "member 1 holds the metadata" in line, line
    # member 3's place taken by a device without a superblock: all zeros, or empty (a
    # detached loop device reads as 0 bytes); formatting it could destroy a member
    zeros = harness.make_image(tmp_path / "zeros.img", 128 * MiB)
    line = one_line(kvfs("mount", "--foreground", mnt, *devs[:2], zeros, *opt))
    assert f"{zeros} has no superblock: not a kvfs pool member" in line, line
    empty = harness.make_image(tmp_path / "empty.img", 0)
    line = one_line(kvfs("mount", "--foreground", mnt, *devs[:2], empty, *opt))
    assert f"{empty} is empty (0 bytes" in line and "not a kvfs pool member" in line, line
    assert "--degraded" in line, line
    assert not harness.is_mounted(mnt)
