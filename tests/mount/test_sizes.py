"""Members of different sizes: kvfs uses all of each, and says so (issue: bad input)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from kvfs.testing import harness
from tests.conftest import read_or_errno, require_fuse, write_file

MiB = 1 << 20


def content(name: str, size: int) -> bytes:
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def test_members_of_different_sizes_are_used_whole(tmp_path: Path) -> None:
    require_fuse()
    small = harness.make_image(tmp_path / "small.img", 64 * MiB)
    big = harness.make_image(tmp_path / "big.img", 192 * MiB)
    mnt = tmp_path / "mnt"
    with harness.mounted(mnt, [small, big], "--format", "--meta-size", "8M"):
        names = [f"f{i:02d}" for i in range(25)]
        for name in names:  # 200 MiB: more than twice the small member holds
            write_file(mnt / name, content(name, 8 * MiB))
        r = subprocess.run(
            [sys.executable, "-m", "kvfs", "stats", "--json", str(mnt)],
            capture_output=True,
            text=True,
        )
        stats = json.loads(r.stdout)
        small_space, big_space = stats["space"]
        assert small_space["data_bytes"] < 64 * MiB < big_space["data_bytes"]
        assert small_space["free_bytes"] < small_space["data_bytes"] // 4, small_space  # ~full
        assert stats["store"]["evictions"] == 0
        for name in names:
            assert read_or_errno(mnt / name) == content(name, 8 * MiB)
        r = subprocess.run(
            [sys.executable, "-m", "kvfs", "stats", str(mnt)], capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr
        assert "members of different sizes: all of each is used" in r.stdout, r.stdout
