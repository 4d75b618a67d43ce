"""Metadata pressure on a real mount: a pool formatted with a tiny metadata area
(1 MiB, the smallest: ~1.8k files) and plenty of data room (64 KiB units), so the index is what
fills. In a kvfs-managed directory creates go on (kvfs evicts; evicted files are a
clean ENOENT, survivors byte-identical, also after a remount); ENOSPC only when
every file is open or engine-managed. Contents derive from names."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfs.evict.driver import META_HIGH
from kvfs.testing.harness import make_image, mounted

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse") or os.geteuid() != 0, reason="needs root and /dev/fuse"
)
MiB = 1 << 20
FILES = 4500  # about 1.5-2.5x what the area holds (depending on bytes per file)
ENGINE = 500
OPTIONS = ("--format", "--unit-size", "64K", "--meta-size", "1M")


def content(name: str) -> bytes:
    seed = hashlib.sha256(name.encode()).digest()
    return seed * (8 + int(name[1:6]) % 40)  # 256 B .. 1.5 KiB


def name_of(i: int) -> str:
    return f"b{i:05d}-{(i * 2654435761) % 2**32:08x}.bin"


WRITER = """
import hashlib, os, sys
d, first, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(first, first + n):
    name = f"b{i:05d}-{(i * 2654435761) % 2**32:08x}.bin"
    seed = hashlib.sha256(name.encode()).digest()
    fd = os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, seed * (8 + int(name[1:6]) % 40))
    finally:
        os.close(fd)
"""


def write_all(d: Path, first: int, n: int) -> None:
    """Create files ``first .. first + n - 1`` in a writer process; every one must
    be accepted."""
    p = subprocess.run(
        [sys.executable, "-c", WRITER, str(d), str(first), str(n)],
        capture_output=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr.decode()[-2000:]


def survivors(d: Path, count: int) -> list[int]:
    """Which of files 0..count-1 are there: each exact, or a clean ENOENT (never
    listed, never opened)."""
    alive, missing = [], set()
    for i in range(count):
        name = name_of(i)
        try:
            with open(d / name, "rb", buffering=0) as f:
                data = f.read()
        except FileNotFoundError:
            missing.add(name)
            continue
        assert data == content(name), f"{name}: wrong bytes"
        alive.append(i)
    # the background evictor may take a file at any moment; once it is ENOENT it
    # must not be listed any more (nothing recreates these names: one listing after
    # the reads checks every one)
    listed = missing & set(os.listdir(d))
    assert not listed, f"{sorted(listed)[:5]}: listed after ENOENT"
    return alive


def metadata_stats(mnt: Path) -> dict[str, int]:
    raw = json.loads(os.getxattr(mnt, "user.kvfs.stats"))
    m: dict[str, int] = raw["metadata"]
    return m


def settled(mnt: Path) -> dict[str, int]:
    """The metadata statistics once background eviction has nothing left to do (the
    next checkpoint at most META_HIGH of a half): it goes on after the writer ends,
    as files leave their grace, so survivors counted earlier would still change."""
    deadline = time.monotonic() + 180  # a hang guard
    while True:
        m = metadata_stats(mnt)
        if m["next_checkpoint_bytes"] <= META_HIGH * m["half_bytes"]:
            return m
        assert time.monotonic() < deadline, f"background eviction never settled: {m}"
        time.sleep(0.2)


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    img = make_image(tmp_path / "dev.img", 512 * MiB)
    mnt, log = tmp_path / "mnt", tmp_path / "kvfs.log"
    yield mnt, img
    errors = [line for line in log.read_text().splitlines() if " ERROR " in line]
    assert not errors, errors


@pytest.mark.timeout(300)
def test_creates_go_on_in_a_kvfs_managed_directory(pool: tuple[Path, Path]) -> None:
    mnt, img = pool
    log = img.parent / "kvfs.log"
    with mounted(mnt, [img], *OPTIONS, log_file=log):
        d = mnt / "vllm"
        d.mkdir()  # kvfs-managed: the default policy
        write_all(d, 0, FILES)
        m = settled(mnt)
        assert m["area_bytes"] == MiB and m["evictions"] > 0, m
        assert m["checkpoint_bytes"] <= m["limit_bytes"], m
        # the newest files stayed (eviction took the oldest): read before the scan
        # below, whose reads make every file it reaches newer than those it has not
        # reached yet (an eviction meanwhile takes those: the newest, last in order)
        for i in (FILES - 1, FILES - 100):
            got = (d / name_of(i)).read_bytes() if (d / name_of(i)).exists() else None
            assert got == content(name_of(i)), f"the newest files went: {i}"
        scanned = metadata_stats(mnt)["evictions"]
        alive = survivors(d, FILES)
        assert FILES // 5 < len(alive) <= FILES - m["evictions"], (len(alive), m)
        # the evictions were needed: at this release's checkpoint bytes per file (an
        # overestimate if files went after that checkpoint) all FILES would not fit.
        # How many went depends on when the checkpoints fell (1101-1471 of 4500 seen),
        # so no fixed count is asserted.
        per_file = m["checkpoint_bytes"] / len(alive)
        assert FILES * per_file > m["limit_bytes"], (per_file, m)
        stats = subprocess.run(
            [sys.executable, "-m", "kvfs", "stats", str(mnt)], capture_output=True, text=True
        )
        assert stats.returncode == 0 and re.search(r"^metadata +checkpoint", stats.stdout, re.M), (
            stats
        )
        late = metadata_stats(mnt)["evictions"] - scanned  # since the scan began
    assert "metadata pressure" in log.read_text()
    with mounted(mnt, [img], log_file=log):  # remount: the same survivors, exact
        after = survivors(mnt / "vllm", FILES)
        if late == 0:
            assert after == alive
        else:  # the evictor went on during the scan: fewer, never others
            assert set(after) <= set(alive) and len(after) >= len(alive) - late, late


@pytest.mark.timeout(300)
def test_enospc_only_when_nothing_is_evictable(pool: tuple[Path, Path]) -> None:
    """Files in an engine-managed directory (of a live writer) and open files in a
    kvfs-managed one never go: the area fills and creates fail with ENOSPC; every
    file accepted before is exact; closing the open ones makes room again."""
    mnt, img = pool
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 8192:
        pytest.skip(f"needs 8192 open files, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (8192, hard))
    fds: list[int] = []
    try:
        with mounted(mnt, [img], *OPTIONS, log_file=img.parent / "kvfs.log"):
            engine = mnt / "lmcache"
            engine.mkdir()
            os.setxattr(engine, "user.kvfs.policy", b"engine-managed")
            for i in range(ENGINE):
                (engine / name_of(i)).write_bytes(content(name_of(i)))
            managed = mnt / "vllm"
            managed.mkdir()
            failure = None
            for i in range(ENGINE, FILES):
                name = name_of(i)
                try:
                    fd = os.open(managed / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                except OSError as e:
                    failure = e
                    break
                fds.append(fd)
                os.write(fd, content(name))
                os.fsync(fd)
            assert failure is not None and failure.errno == errno.ENOSPC, repr(failure)
            held = len(fds)
            assert held > ENGINE, held
            assert survivors(engine, ENGINE) == list(range(ENGINE))
            for fd in fds:
                os.lseek(fd, 0, os.SEEK_SET)
                name = os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[1]
                assert os.read(fd, 4096) == content(name)
            for fd in fds[: held // 2]:  # closed: evictable again
                os.close(fd)
            del fds[: held // 2]
            write_all(managed, ENGINE + held, 500)
            assert survivors(engine, ENGINE) == list(range(ENGINE)), "engine-managed file lost"
            alive = set(survivors(managed, ENGINE + held + 500))
            assert set(range(ENGINE + held // 2, ENGINE + held)) <= alive, "an open file went"
            while fds:
                os.close(fds.pop())
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def pad(file: int, round_: int) -> bytes:
    """The ``user.pad`` value of round ``round_`` on file ``file``: 4 KiB (the most a
    value may take), derived from both."""
    return hashlib.sha256(b"%d.%d" % (file, round_)).digest() * 128


XATTR_FILES, XATTR_ROUNDS = 8, 250


def set_pads(d: Path, first: int, last: dict[int, bytes], refused: list[int]) -> None:
    """Round after round of ``user.pad`` sets on files ``first``, ``first + 2``, ...:
    each succeeds (``last`` keeps the value) or fails ENOSPC/E2BIG (counted); any
    other error fails the test."""
    for r in range(XATTR_ROUNDS):
        for k in range(first, XATTR_FILES, 2):
            value = pad(k, r)
            try:
                os.setxattr(d / name_of(k), "user.pad", value)
            except OSError as e:
                assert e.errno in (errno.ENOSPC, errno.E2BIG), repr(e)
                refused.append(k)
                continue
            last[k] = value


@pytest.mark.timeout(300)
def test_large_xattrs_never_stop_the_metadata_log(pool: tuple[Path, Path]) -> None:
    """Issue 26: many empty files, then a flood of large setxattr calls on a few of
    them while another thread stats and reads files. A value over the bound is
    E2BIG; every other set either succeeds durably (byte-exact after a remount) or
    fails ENOSPC; the mount keeps serving throughout, unmounts with exit 0 and fsck
    finds nothing (the log used to overflow a half in a checkpoint's window, go
    fail-stop, keep acknowledging sets, and exit 1 at unmount)."""
    mnt, img = pool
    log = img.parent / "kvfs.log"
    files = 2000  # empty: ~40% of a half (1 MiB area), no eviction
    last: dict[int, bytes] = {}
    refused: list[int] = []
    with mounted(mnt, [img], *OPTIONS, log_file=log) as proc:
        d = mnt / "vllm"
        d.mkdir()
        for i in range(files):
            os.mknod(d / name_of(i), 0o644)
        (mnt / "kept.bin").write_bytes(content(name_of(1)))
        stop, served, failures = threading.Event(), [0], []

        def stat_files() -> None:
            i = 0
            while not stop.is_set():
                try:
                    os.stat(d / name_of(i % files))
                    assert (mnt / "kept.bin").read_bytes() == content(name_of(1))
                    served[0] += 1
                except BaseException as e:  # reported by the test
                    failures.append(e)
                    return
                i += 7

        reader = threading.Thread(target=stat_files)
        reader.start()
        try:
            big = 0
            for _ in range(50):  # the 60 kB values: over the bound, refused
                try:
                    os.setxattr(d / name_of(0), "user.pad", bytes(60_000))
                except OSError as e:
                    assert e.errno == errno.E2BIG, repr(e)
                    big += 1
            assert big == 50
            setters = [
                threading.Thread(target=set_pads, args=(d, first, last, refused))
                for first in (0, 1)
            ]
            for t in setters:
                t.start()
            for t in setters:
                t.join()
        finally:
            stop.set()
            reader.join()
        assert not failures, failures
        assert served[0] > 0 and last, (served, len(refused))
        assert os.listxattr(d / name_of(0)) == ["user.pad"]
    assert proc.returncode == 0, log.read_text()[-3000:]
    fsck = subprocess.run(
        [sys.executable, "-m", "kvfs", "fsck", str(img)], capture_output=True, text=True
    )
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    with mounted(mnt, [img], log_file=log) as proc:
        for k, value in last.items():
            assert os.getxattr(mnt / "vllm" / name_of(k), "user.pad") == value, k
        assert (mnt / "kept.bin").read_bytes() == content(name_of(1))
    assert proc.returncode == 0
