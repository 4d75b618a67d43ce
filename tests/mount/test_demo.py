"""`make demo` is honest: the pool it leaves persists, and the next run mounts it
without formatting and finds the previous run's chunks byte for byte; --fresh
formats anew; --keep leaves it mounted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvfs.testing.harness import is_mounted, kvfs_command

DEMO = [sys.executable, str(Path(__file__).parents[2] / "tools" / "demo.py")]


def demo(base: Path, *extra: str) -> str:
    r = subprocess.run(
        [*DEMO, "--dir", str(base), "--size", "1G", "--chunks", "2", *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    return r.stdout


def test_demo_pool_persists_across_runs(tmp_path: Path) -> None:
    first = demo(tmp_path)
    assert "new sparse image" in first and "formatted" in first
    assert "identical: True" in first and "the pool persists" in first
    assert "kvfs:demo" in first  # df names the pool by its label
    second = demo(tmp_path)
    assert "formatted" not in second and "holds a kvfs pool already" in second
    assert "2 present, all bytes identical" in second
    fresh = demo(tmp_path, "--fresh")
    assert "formatted" in fresh and "previous run" not in fresh
    kept = demo(tmp_path, "--keep")
    mnt = tmp_path / "mnt"
    try:
        assert "still mounted" in kept and is_mounted(mnt)
        assert len(list((mnt / "lmcache").iterdir())) == 2
    finally:
        subprocess.run([*kvfs_command(), "umount", str(mnt)], check=True, timeout=90)
    assert not is_mounted(mnt)
