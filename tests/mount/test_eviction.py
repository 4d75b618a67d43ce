"""Capacity and eviction on a real mount (issue: eviction engines can live with).

Each test mounts a small pool (about 120 data units of 1 MiB), so "past capacity"
means a few hundred MiB of writes. File contents derive from their names, so any
surviving file can be checked byte for byte.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfs.testing.harness import make_image, mounted
from tests.conftest import eviction_settled

MiB = 1 << 20
pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0, reason="needs root and /dev/fuse"
)


def content(name: str, size: int) -> bytes:
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def write_file(path: Path, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, content(path.name, size))
    finally:
        os.close(fd)


def check_file(path: Path, size: int, may_vanish: bool = False) -> None:
    """Exact bytes, or (``may_vanish``: eviction may still be running) a clean ENOENT."""
    try:
        with open(path, "rb", buffering=0) as f:
            data = f.read()
    except FileNotFoundError:
        if may_vanish:
            return
        raise
    assert data == content(path.name, size), f"{path.name}: wrong bytes"


WRITER = """
import hashlib, os, sys
d, prefix, n, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
for i in range(n):
    name = f"{prefix}-{i:04d}"
    seed = hashlib.sha256(name.encode()).digest()
    data = (seed * (size // len(seed) + 1))[:size]
    fd = os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
"""


def run_writer(d: Path, prefix: str, n: int, size: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(d), prefix, str(n), str(size)], stderr=subprocess.PIPE
    )


def finish(p: subprocess.Popen[bytes]) -> None:
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Path]:
    img = make_image(tmp_path / "dev.img", 136 * MiB)
    mnt = tmp_path / "mnt"
    log = tmp_path / "kvfs.log"
    with mounted(mnt, [img], "--format", "--meta-size", "8M", log_file=log):
        yield mnt
    errors = [line for line in log.read_text().splitlines() if " ERROR " in line]
    assert not errors, errors


def stats(mnt: Path) -> dict[str, int]:
    raw = os.getxattr(mnt, "user.kvfs.stats")
    s: dict[str, int] = json.loads(raw)["store"]
    return s


def test_fill_past_capacity_with_several_writers_never_enospc(pool: Path) -> None:
    d = pool / "vllm"
    d.mkdir()
    procs = [run_writer(d, f"w{k}", 24, 6 * MiB) for k in range(3)]  # 432 MiB into ~120
    for p in procs:
        finish(p)
    s = stats(pool)
    assert s["evictions"] > 0
    assert s["used_bytes"] <= s["capacity_bytes"]
    survivors = sorted(os.listdir(d))
    assert 5 <= len(survivors) < 72
    for name in survivors:  # whatever survived is whole and exact (or a clean miss)
        check_file(d / name, 6 * MiB, may_vanish=True)


def test_orphans_go_first_and_live_files_stay(pool: Path) -> None:
    d = pool / "cache"
    d.mkdir()
    gone = run_writer(d, "orphan", 8, 4 * MiB)  # its writer exits: orphans
    finish(gone)
    for i in range(8):  # written by this (live) process
        write_file(d / f"live-{i}", 4 * MiB)
    for i in range(30):  # pressure from this process: 120 MiB more, ~15 files too many
        write_file(d / f"more-{i}", 4 * MiB)
    names = set(os.listdir(d))
    orphans_left = [n for n in names if n.startswith("orphan")]
    s = stats(pool)
    assert s["evictions"] > s["orphan_evictions"], "never evicted past the orphans: too small"
    assert not orphans_left, f"orphans survived while live files were evicted: {orphans_left}"
    assert stats(pool)["orphan_evictions"] == 8
    for n in names:
        check_file(d / n, 4 * MiB, may_vanish=True)


def test_open_file_survives_pressure_and_evicted_files_are_clean_misses(pool: Path) -> None:
    d = pool / "d"
    d.mkdir()
    keep = d / "held-open"
    write_file(keep, 8 * MiB)
    fd = os.open(keep, os.O_RDONLY)
    try:
        names = [f"f{i:03d}" for i in range(40)]
        for n in names:
            write_file(d / n, 4 * MiB)  # 160 MiB through a ~120 MiB pool
        assert keep.exists()
        assert os.pread(fd, 8 * MiB, 0) == content(keep.name, 8 * MiB)
    finally:
        os.close(fd)
    evicted = [n for n in names if not (d / n).exists()]
    assert evicted, "nothing was evicted"
    for n in evicted:
        with pytest.raises(FileNotFoundError):
            os.stat(d / n)
        with pytest.raises(FileNotFoundError):
            os.open(d / n, os.O_RDONLY)
    assert set(evicted).isdisjoint(os.listdir(d))
    for n in set(names) - set(evicted):
        check_file(d / n, 4 * MiB, may_vanish=True)


def test_engine_managed_directory_gets_enospc_instead_of_losing_live_files(pool: Path) -> None:
    d = pool / "lmcache"
    d.mkdir()
    os.setxattr(d, "user.kvfs.policy", b"engine-managed")
    written = []
    with pytest.raises(OSError) as e:
        for i in range(40):
            write_file(d / f"chunk-{i}", 4 * MiB)
            written.append(f"chunk-{i}")
    assert e.value.errno == errno.ENOSPC
    for n in written:  # every chunk this live engine wrote is still there, intact
        check_file(d / n, 4 * MiB)
    assert stats(pool)["evictions"] == 0
    # a kvfs-managed neighbour can still not push them out
    other = pool / "vllm"
    other.mkdir()
    with pytest.raises(OSError):
        write_file(other / "x", 8 * MiB)
    for n in written:
        check_file(d / n, 4 * MiB)


def test_engine_managed_reclaims_orphans_of_a_restarted_engine(pool: Path) -> None:
    d = pool / "lmcache"
    d.mkdir()
    os.setxattr(d, "user.kvfs.policy", b"engine-managed")
    old = run_writer(d, "before-restart", 20, 4 * MiB)  # the engine "restarts"
    finish(old)
    for i in range(20):  # the new engine process writes its own chunks
        write_file(d / f"after-{i}", 4 * MiB)
    names = os.listdir(d)
    assert all(f"after-{i}" in names for i in range(20))
    assert stats(pool)["orphan_evictions"] > 0


def test_quota_keeps_a_directory_within_its_bytes(pool: Path) -> None:
    a, b = pool / "tenant-a", pool / "tenant-b"
    a.mkdir()
    b.mkdir()
    os.setxattr(a, "user.kvfs.quota", b"32M")
    assert os.getxattr(a, "user.kvfs.quota") == b"32M"
    with pytest.raises(OSError) as bad:
        os.setxattr(a, "user.kvfs.quota", b"lots")
    assert bad.value.errno == errno.EINVAL
    for i in range(4):
        write_file(b / f"b{i}", 4 * MiB)
    for i in range(20):
        write_file(a / f"a{i}", 4 * MiB)
        used = sum(os.stat(a / n).st_size for n in os.listdir(a))
        assert used <= 32 * MiB
    assert sorted(os.listdir(b)) == [f"b{i}" for i in range(4)]
    os.setxattr(a, "user.kvfs.policy", b"engine-managed")
    with pytest.raises(OSError) as e:
        for i in range(20, 40):
            write_file(a / f"a{i}", 4 * MiB)
    assert e.value.errno == errno.EDQUOT


def test_policy_and_quota_persist_across_remount(tmp_path: Path) -> None:
    img = make_image(tmp_path / "dev.img", 136 * MiB)
    mnt = tmp_path / "mnt"
    with mounted(mnt, [img], "--format", "--meta-size", "8M"):
        (mnt / "x").mkdir()
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvfs",
                "policy",
                str(mnt / "x"),
                "--set",
                "engine-managed",
                "--quota",
                "10G",
            ],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
    with mounted(mnt, [img]):
        assert os.getxattr(mnt / "x", "user.kvfs.policy") == b"engine-managed"
        assert os.getxattr(mnt / "x", "user.kvfs.quota") == b"10G"
        with pytest.raises(OSError) as e:
            os.setxattr(mnt / "x", "user.kvfs.policy", b"whatever")
        assert e.value.errno == errno.EINVAL


def kvfs_policy(path: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfs", "policy", str(path), *options],
        capture_output=True,
        text=True,
        timeout=60,
    )


def settings(path: Path) -> dict[str, bytes]:
    return {n: os.getxattr(path, n) for n in os.listxattr(path) if n.startswith("user.kvfs.")}


@pytest.mark.parametrize(
    "where, options",
    [
        ("nested", ("--set", "engine-managed")),
        ("nested", ("--quota", "100M")),
        ("nested", ("--max-file-size", "8M")),
        ("file", ("--quota", "100M")),
        ("file", ("--set", "engine-managed")),
        ("root", ("--quota", "100M")),
        ("root", ("--max-file-size", "8M")),
    ],
)
def test_policy_refuses_settings_that_would_do_nothing(
    pool: Path, where: str, options: tuple[str, ...]
) -> None:
    """Groups are top-level directories: a policy or quota on a nested directory or a
    file, or a quota on the root (its own files only), would be stored and never
    enforced. The CLI says so in one line (rc 2), and the daemon refuses the same
    xattr set directly (EINVAL), so nothing is stored either way."""
    top = pool / "tenant"
    (top / "sub").mkdir(parents=True)
    write_file(top / "chunk", MiB)
    path = {"nested": top / "sub", "file": top / "chunk", "root": pool}[where]
    before = settings(path)
    r = kvfs_policy(path, *options)
    assert r.returncode == 2, r
    assert r.stderr.count("\n") == 1 and "top-level director" in r.stderr, r.stderr
    assert r.stdout == ""
    assert settings(path) == before
    name = {"--set": "policy", "--quota": "quota", "--max-file-size": "max_file_size"}[options[0]]
    with pytest.raises(OSError) as e:  # setfattr: refused by the daemon itself
        os.setxattr(path, f"user.kvfs.{name}", options[1].encode())
    assert e.value.errno == errno.EINVAL
    assert settings(path) == before


def test_root_policy_and_top_level_quota_via_the_cli(pool: Path) -> None:
    """What is accepted takes effect: the root's policy (its own files), and a
    top-level directory's quota over its whole subtree: 256 MiB written under a
    100 MiB quota (100M) stay within it by eviction."""
    r = kvfs_policy(pool, "--set", "kvfs-managed")
    assert r.returncode == 0 and "policy kvfs-managed" in r.stdout, r.stderr
    top = pool / "tenant"
    (top / "deep" / "er").mkdir(parents=True)
    r = kvfs_policy(top, "--quota", "100M")
    assert r.returncode == 0 and "quota 100M" in r.stdout, r.stderr
    names = [f"c{i:03d}" for i in range(64)]  # 64 x 4 MiB = 256 MiB
    for n in names:
        write_file(top / "deep" / "er" / n, 4 * MiB)
        kept = os.listdir(top / "deep" / "er")
        assert sum(os.stat(top / "deep" / "er" / k).st_blocks * 512 for k in kept) <= 100 * MiB
    kept = os.listdir(top / "deep" / "er")
    assert 0 < len(kept) < len(names)
    for n in kept:
        check_file(top / "deep" / "er" / n, 4 * MiB, may_vanish=True)


@pytest.mark.parametrize("policy", ["adaptive", "prefix-lru"])
def test_new_policies_evict_whole_files_and_hand_over_to_another_policy(
    tmp_path: Path, policy: str
) -> None:
    """``--eviction adaptive|prefix-lru`` on a real mount: past capacity, every file
    that survives is exact and every evicted one a clean miss; remounted with the
    default policy, the saved image (another kind) is adopted, the mount logs no
    error, and eviction keeps serving exact bytes."""
    img = make_image(tmp_path / "dev.img", 136 * MiB)
    mnt, log = tmp_path / "mnt", tmp_path / "kvfs.log"
    with mounted(mnt, [img], "--format", "--meta-size", "8M", "--eviction", policy, log_file=log):
        d = mnt / "kv"
        d.mkdir()
        for p in [run_writer(d, f"w{k}", 20, 4 * MiB) for k in range(2)]:
            finish(p)  # 160 MiB into ~120: the writers exit, their files are orphans
        # this live process's files, evicted by the policy's order once the orphans
        # are gone: 160 MiB, more than the pool holds, so some are evicted however the
        # writers above were scheduled (one that ran alone left only orphans to evict,
        # enough for 80 MiB of live files: "evictions > orphan_evictions" failed twice
        # on a loaded machine)
        for i in range(40):
            write_file(d / f"live-{i:02d}", 4 * MiB)
            if i % 3 == 0:
                check_file(d / f"live-{i:02d}", 4 * MiB)  # a read: touch()
        assert stats(mnt)["evictions"] > stats(mnt)["orphan_evictions"] > 0
        first = sorted(os.listdir(d))
        for name in first:
            check_file(d / name, 4 * MiB, may_vanish=True)
    with mounted(mnt, [img], log_file=log):
        d = mnt / "kv"
        assert set(os.listdir(d)) <= set(first)
        for i in range(20):
            write_file(d / f"again-{i:02d}", 4 * MiB)
        for name in os.listdir(d):
            check_file(d / name, 4 * MiB, may_vanish=True)
        assert stats(mnt)["evictions"] > 0
    errors = [line for line in log.read_text().splitlines() if " ERROR " in line]
    assert not errors, errors
    assert "starting afresh" not in log.read_text()


@pytest.mark.parametrize("tight", [False, True], ids=["default-headroom", "one-unit-headroom"])
@pytest.mark.parametrize("policy", ["adaptive", "prefix-lru"])
def test_a_prompts_partial_last_chunk_is_evicted_before_full_chunks(
    tmp_path: Path, policy: str, tight: bool
) -> None:
    """An engine reads a cached prefix, then writes a prompt's missing chunks, the
    last one smaller (LMCache's partial chunk). Past capacity, the partial chunks go
    first: every full chunk and the prefix stay, byte-exact, and only partial chunks
    are gone (without the rule, the oldest prompt's full chunks would go first).
    With a one-unit headroom each 2-unit write makes room for itself, right after
    the next prompt's read of the prefix: the moment a partial chunk's reused inode
    number filed the prefix as the oldest key (session 31)."""
    img = make_image(tmp_path / "dev.img", 136 * MiB)
    mnt, log = tmp_path / "mnt", tmp_path / "kvfs.log"
    full, tail = 2 * MiB, MiB + 7
    # 126 units: free space under one unit starts a round that frees about two more
    tight_options = ("--high-watermark", "0.9925", "--low-watermark", "0.984") if tight else ()
    with mounted(
        mnt,
        [img],
        "--format",
        "--meta-size",
        "8M",
        "--eviction",
        policy,
        *tight_options,
        log_file=log,
    ):
        d = mnt / "kv"
        d.mkdir()
        write_file(d / "prefix", full)
        sizes = {"prefix": full}
        prompts, more = 0, 2
        while more:  # prompts until eviction began, then two more
            check_file(d / "prefix", full)  # the cached prefix read: a run a read began
            for name, size in ((f"p{prompts:03d}-0", full), (f"p{prompts:03d}-1", full)):
                write_file(d / name, size)
                sizes[name] = size
            write_file(d / f"p{prompts:03d}-tail", tail)
            sizes[f"p{prompts:03d}-tail"] = tail
            prompts += 1
            assert prompts < 100, stats(mnt)
            if stats(mnt)["evictions"]:
                more -= 1
        eviction_settled(lambda: {"store": stats(mnt)})
        left = set(os.listdir(d))
        gone = set(sizes) - left
        assert gone and all(name.endswith("-tail") for name in gone), sorted(gone)
        for name in sorted(left):
            check_file(d / name, sizes[name])
    errors = [line for line in log.read_text().splitlines() if " ERROR " in line]
    assert not errors, errors
