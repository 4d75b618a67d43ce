"""``kvfs stats`` for a person: human units, the per-directory table, a path inside
the mount, a closed pipe; ``kvfs stats --watch`` in a pipe and under a real terminal
(tmux on a private server socket: the screen redraws, follows the traffic, and Ctrl-C
exits 0)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfs.cli import stats
from kvfs.testing import harness
from tests.conftest import KvfsMount, pattern, require_fuse

MIB = 1 << 20
KVFS = [sys.executable, "-m", "kvfs"]


def stats_text(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVFS, "stats", *map(str, args)], capture_output=True, text=True, timeout=60
    )


def populate(mount: KvfsMount) -> None:
    for d, n in (("lmcache", 3), ("sglang", 1)):
        (mount.path / d).mkdir()
        for i in range(n):
            harness.write_file(mount.path / d / f"c{i}", pattern((d, i), 2 * MIB))
    os.setxattr(mount.path / "sglang", "user.kvfs.quota", b"100M")
    assert (mount.path / "lmcache" / "c0").read_bytes() == pattern(("lmcache", 0), 2 * MIB)


def test_stats_in_human_units_with_directories(kvfs_mount: KvfsMount) -> None:
    populate(kvfs_mount)
    r = stats_text(kvfs_mount.path / "lmcache")  # any path inside the mount
    assert r.returncode == 0 and r.stderr == "", r.stderr
    out = r.stdout
    assert re.search(r"^files +4 in 3 directories", out, re.M), out
    assert re.search(r"^written +\S+ requests, 8\.00 MiB$", out, re.M), out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["lmcache"][1:3] == ["6.00", "MiB"], out
    assert rows["sglang"][1:5] == ["2.00", "MiB", "100", "MiB"], out
    assert rows["sglang"][5] == "2.0%", out
    assert "DEVICE" in rows and "DIRECTORY" in rows
    figures = out.split("\n", 1)[1]  # below the pool line (its uuid has digit runs)
    assert not re.search(r"\d{7,}", figures), "a raw byte count in the human view: " + out


def test_stats_into_a_closed_pipe(kvfs_mount: KvfsMount) -> None:
    cmd = f"{sys.executable} -m kvfs stats {kvfs_mount.path} | head -1"
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("pool "), r
    assert r.stderr == "", r.stderr


def test_watch_in_a_pipe_prints_each_refresh(kvfs_mount: KvfsMount) -> None:
    r = stats_text(kvfs_mount.path, "--watch", "--interval", "0.2", "--count", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("throughput ") == 3, r.stdout
    assert "\x1b[" not in r.stdout  # no terminal control into a pipe
    bad = stats_text(kvfs_mount.path, "--watch", "--interval", "0")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_stats_of_a_path_outside_kvfs(tmp_path: Path) -> None:
    r = stats_text(tmp_path)
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "not a kvfs mount" in r.stderr, r.stderr


class Tmux:
    """A tmux server of its own (``-L``), one window of 160x50."""

    def __init__(self, tmp_path: Path) -> None:
        if shutil.which("tmux") is None:
            pytest.fail("tmux is missing (make test-deps installs it)")
        self.socket = f"kvfs-test-{os.getpid()}-{tmp_path.name}"

    def __call__(self, *args: str) -> str:
        r = subprocess.run(
            ["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=30
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    def screen(self, *options: str) -> str:
        return self("capture-pane", "-p", *options, "-t", "view")

    def wait_screen(self, pattern: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if re.search(pattern, text, re.M):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} never on the screen:\n{text}")
            time.sleep(0.2)

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


def test_watch_under_a_terminal(kvfs_mount: KvfsMount, tmp_path: Path) -> None:
    tmux = Tmux(tmp_path)
    watch = f"{sys.executable} -m kvfs stats --watch --interval 0.3 {kvfs_mount.path}"
    try:
        tmux(
            "new-session", "-d", "-s", "view", "-x", "160", "-y", "50",
            f"sh -c 'trap true INT; {watch}; echo EXIT=$?; sleep 60'",
        )  # fmt: skip
        first = tmux.wait_screen(r"^files +0 in 1 directories")
        assert "throughput" in first and "hit rate" in first, first
        populate(kvfs_mount)
        screen = tmux.wait_screen(r"^files +4 in 3 directories")
        assert re.search(r"^lmcache +6\.00 MiB", screen, re.M), screen
        assert screen.count("throughput") == 1, "a refresh redraws, it does not scroll"
        # traffic in one refresh window shows as a rate
        for _ in range(20):
            (kvfs_mount.path / "lmcache" / "c1").read_bytes()
            harness.write_file(kvfs_mount.path / "lmcache" / "w", pattern("w", 4 * MIB))
            text = tmux.screen()
            if re.search(r"written [1-9][\d.]* [KMG]", text):  # the line may be cut at "~"
                break
        else:
            raise AssertionError("no write rate shown:\n" + tmux.screen())
        tmux("send-keys", "-t", "view", "C-c")
        end = tmux.wait_screen(r"^EXIT=\d+")
        assert "EXIT=0" in end and "Traceback" not in end, end
    finally:
        tmux.kill()


# ---------------------------------------------------------------------- what a new user hits
def test_watch_json_prints_one_json_object_per_line(kvfs_mount: KvfsMount) -> None:
    r = stats_text(kvfs_mount.path, "--watch", "--json", "--interval", "0.2", "--count", "3")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 3, r.stdout
    for line in lines:
        assert json.loads(line)["store"]["files"] == 0


def test_json_pool_figures_are_numbers(kvfs_mount: KvfsMount) -> None:
    r = stats_text(kvfs_mount.path, "--json")
    assert r.returncode == 0, r.stderr
    pool = json.loads(r.stdout)["pool"]
    assert set(pool) == {"label", "uuid", "format", "devices", "unit_size", "eviction"}, pool
    assert pool["devices"] == 1 and pool["unit_size"] == MIB and pool["format"] == 2, pool
    assert isinstance(pool["uuid"], str) and isinstance(pool["eviction"], str), pool


def test_identical_members_are_not_called_different(tmp_path: Path) -> None:
    require_fuse()
    images = [harness.make_image(tmp_path / f"m{i}.img", 128 * MIB) for i in range(2)]
    mnt = tmp_path / "mnt"
    with harness.mounted(mnt, images, "--format", "--meta-size", "8M"):
        harness.write_file(mnt / "a", pattern("a", MIB))
        r = stats_text(mnt)
    assert r.returncode == 0, r.stderr
    assert sum(line.startswith(str(tmp_path / "m")) for line in r.stdout.splitlines()) == 2
    assert "different sizes" not in r.stdout, r.stdout
    assert re.search(
        r"^eviction .* orphans now \(writer exited\); headroom \S+ \S+, "
        r"\d+ writes waited for room \(\d+\.\d\d s\)$",
        r.stdout,
        re.M,
    ), r.stdout


def test_fit_cuts_a_page_to_the_terminal() -> None:
    page = "".join(f"line {i} " + "x" * (i * 10) + "\n" for i in range(40))
    text = stats.fit(page, os.terminal_size((80, 24)))
    lines = text.splitlines()
    assert len(lines) == 23 and all(len(x) <= 80 for x in lines), lines
    assert lines[0] == "line 0 " and lines[-2].startswith("line 21 ") and lines[-2].endswith("~")
    assert lines[-1].startswith("... 18 more lines"), lines[-1]
    assert stats.fit("a\nb\n", os.terminal_size((80, 24))) == "a\nb\n"


def test_watch_fits_an_80x24_terminal(kvfs_mount: KvfsMount, tmp_path: Path) -> None:
    for i in range(30):  # more directories than 24 rows hold
        (kvfs_mount.path / f"engine-directory-{i:02d}").mkdir()
    tmux = Tmux(tmp_path)
    watch = f"{sys.executable} -m kvfs stats --watch --interval 0.3 {kvfs_mount.path}"
    try:
        tmux(
            "new-session", "-d", "-s", "view", "-x", "80", "-y", "24",
            f"sh -c 'trap true INT; {watch}; echo EXIT=$?; sleep 60'",
        )  # fmt: skip
        tmux.wait_screen(r"^hit rate ")
        tmux.wait_screen(r"^files +0 in 31 directories")
        rows = tmux.screen("-J").rstrip("\n").split("\n")  # -J: a wrapped line as one
        assert rows[0].startswith("kvfs stats --watch "), rows  # the top never scrolls off
        assert len(rows) <= 24 and all(len(r) <= 80 for r in rows), rows
        assert any(r.startswith("throughput ") for r in rows), rows
        assert rows[-1].startswith("... ") and "more lines" in rows[-1], rows
        tmux("send-keys", "-t", "view", "C-c")
        end = tmux.wait_screen(r"^EXIT=\d+")
        assert "EXIT=0" in end and "Traceback" not in end, end
    finally:
        tmux.kill()
