"""Files smaller than a unit on a real mount: they take fragments, not whole units, and
``st_blocks``, ``df`` and ``kvfs stats`` say what is held (``docs/format.md``
"Fragment tails"). Bytes are checked after concurrent writes, remounts, a crash, tail
changes and eviction; fsck (data included) is clean afterwards; a flipped byte in a
fragment tail is EIO."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfs.cli.offline import offline_index
from kvfs.devices.pool import open_pool
from kvfs.format.records import DEV_SHIFT, allocated_size, extent, is_fragment
from kvfs.index.namespace import ROOT_INO
from kvfs.testing import harness
from tests.conftest import KvfsMount, pattern, read_or_errno, write_file

MiB = 1 << 20
UNIT = MiB
SIZES = [1, 4096, 100 << 10, 512 << 10, UNIT - 1, UNIT, UNIT + 1, 32 * MiB + (100 << 10)]


def kvfs(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfs", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def in_threads(jobs: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def write_all(mnt: Path, data: dict[str, bytes]) -> None:
    in_threads([lambda n=n: write_file(mnt / n, data[n]) for n in data])  # type: ignore[misc]


def check_all(mnt: Path, data: dict[str, bytes]) -> None:
    assert sorted(os.listdir(mnt)) == sorted(data)
    for name, content in data.items():
        assert read_or_errno(mnt / name) == content, name
        st = os.stat(mnt / name)
        assert st.st_blocks * 512 == allocated_size(len(content), UNIT), name


def used_bytes_df(mnt: Path) -> int:
    s = os.statvfs(mnt)
    return (s.f_blocks - s.f_bfree) * s.f_frsize


def sized(tag: str, sizes: list[int]) -> dict[str, bytes]:
    return {f"{tag}{i}-{n}": pattern((tag, i), n) for i, n in enumerate(sizes)}


def test_small_files_take_their_fragments_through_remount_and_crash(
    kvfs_mount: KvfsMount,
) -> None:
    mnt = kvfs_mount.path
    data = sized("a", SIZES * 3)
    write_all(mnt, data)
    check_all(mnt, data)
    want = sum(allocated_size(len(v), UNIT) for v in data.values())
    assert used_bytes_df(mnt) == want == kvfs_mount.stats()["store"]["used_bytes"]
    assert want < sum(-(-len(v) // UNIT) * UNIT for v in data.values()) - 8 * MiB
    kvfs_mount.stop()
    kvfs_mount.start()
    check_all(mnt, data)
    assert used_bytes_df(mnt) == want
    # tail changes: append, overwrite inside a tail, truncate down and up
    for name in list(data)[:8]:
        content, n0 = bytearray(data[name]), len(data[name])
        with open(mnt / name, "r+b") as f:
            f.seek(n0)
            f.write(b"x" * 70_000)
            f.seek(n0 // 2)
            f.write(b"y" * 100)
        content += b"x" * 70_000
        content[n0 // 2 : n0 // 2 + 100] = b"y" * 100
        cut = len(content) // 3
        os.truncate(mnt / name, cut)
        os.truncate(mnt / name, cut + 5000)
        data[name] = bytes(content[:cut]) + bytes(5000)
    more = sized("b", [300 << 10] * 10)
    write_all(mnt, more)
    data.update(more)
    check_all(mnt, data)
    # a crash: every closed file is back, byte-identical, and space is not leaked
    kvfs_mount.crash()
    check_all(mnt, data)
    want = sum(allocated_size(len(v), UNIT) for v in data.values())
    assert used_bytes_df(mnt) == want == kvfs_mount.stats()["store"]["used_bytes"]
    kvfs_mount.stop()
    r = kvfs("fsck", *kvfs_mount.devices)
    assert r.returncode == 0, r.stdout + r.stderr
    kvfs_mount.start()


@pytest.mark.mount_options("--default-policy", "kvfs-managed")
def test_eviction_frees_fragments_while_other_small_files_are_read(
    kvfs_mount: KvfsMount,
) -> None:
    """A 512 MiB pool filled twice over with 300-700 KiB files: eviction frees tails
    in shared hosts while readers read the survivors; what is there is intact."""
    mnt = kvfs_mount.path
    written: dict[str, bytes] = {}
    sizes = [300 << 10, 512 << 10, 700 << 10, 4096]
    for batch in range(8):
        chunk = {
            f"c{batch}-{i}": pattern(("evict", batch, i), sizes[i % 4] + i) for i in range(200)
        }
        survivors = [n for n in written if os.path.exists(mnt / n)][-50:]

        def read_survivors(names: list[str] = survivors) -> None:
            for n in names:
                got = read_or_errno(mnt / n)
                assert got == written[n] or got == errno.ENOENT, n  # evicted: a clean miss

        in_threads([lambda c=chunk: write_all(mnt, c), read_survivors])  # type: ignore[misc]
        written.update(chunk)
    stats = kvfs_mount.stats()["store"]
    assert stats["evictions"] > 0
    for name in os.listdir(mnt):  # the background evictor may still take some
        got = read_or_errno(mnt / name)
        assert got == written[name] or got == errno.ENOENT, name
    # once eviction is done, df says exactly what the files hold
    deadline = time.monotonic() + 90
    while True:
        before = kvfs_mount.stats()["store"]["evictions"]
        present = {n: written[n] for n in os.listdir(mnt)}
        want = sum(allocated_size(len(v), UNIT) for v in present.values())
        used = used_bytes_df(mnt)
        if used == want and kvfs_mount.stats()["store"]["evictions"] == before:
            break
        assert time.monotonic() < deadline, (used, want)
        time.sleep(0.2)
    check_all(mnt, present)
    kvfs_mount.stop()
    r = kvfs("fsck", *kvfs_mount.devices)
    assert r.returncode == 0, r.stdout + r.stderr
    kvfs_mount.start()


def test_a_flipped_byte_in_a_fragment_tail_is_eio(tmp_path: Path) -> None:
    from tests.conftest import require_fuse

    require_fuse()
    image = harness.make_image(tmp_path / "pool.img", 256 * MiB)
    mnt, log = tmp_path / "mnt", tmp_path / "kvfs.log"
    data = sized("t", [UNIT + (200 << 10), 300 << 10, 100 << 10])
    with harness.mounted(mnt, [image], "--format", "--meta-size", "8M", log_file=log):
        for name, content in data.items():
            write_file(mnt / name, content)
    victim, *others = data
    ns, _ = offline_index([str(image)])
    inode = ns.inodes[ns.inodes[ROOT_INO].entries[victim.encode()]]  # type: ignore[index]
    p = inode.units[1]
    assert is_fragment(p)
    unit, skip, length = extent(p, UNIT)
    pool = open_pool([str(image)])
    try:
        offset = pool.unit_offset(p >> DEV_SHIFT, unit) + skip + length - 100
    finally:
        pool.close()
    fd = os.open(image, os.O_RDWR)
    try:
        os.pwrite(fd, bytes(b ^ 0x5A for b in os.pread(fd, 8, offset)), offset)
    finally:
        os.close(fd)
    r = kvfs("fsck", image)
    assert r.returncode == 4 and "checksum mismatch" in r.stdout, r.stdout + r.stderr
    with harness.mounted(mnt, [image], log_file=log):
        assert read_or_errno(mnt / victim) == errno.EIO  # never the flipped bytes
        for name in others:  # tails sharing its host unit are intact
            assert read_or_errno(mnt / name) == data[name]
    assert "checksum mismatch" in log.read_text()
