"""A pool mounted ``--degraded``, one of its three members missing.

Files with a unit on the missing member stay in the index: listed, ``stat`` as
before, every read fails with EIO (never zeros, never ENOENT), and they read back
byte-identical once a mount has every member again. Files without one are served
as usual, new data goes to the present members only, and eviction or removal of an
unreadable file frees only its units on those. ``--drop-unreadable`` drops them
instead. A refused mount says which member is missing and never suggests
``kvfs format``. "Missing" means not named on the command line: each member is a
separate image file.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvfs.testing import harness
from tests.conftest import (
    KvfsMount,
    errno_of,
    eviction_settled,
    read_or_errno,
    require_fuse,
    write_file,
)
from tests.mount.test_faults import device_of

MiB = 1 << 20
UNREADABLE = r"data on missing member 3 \(degraded mount\)"
"""The daemon's ERROR line for each failed read or write of an unreadable file."""


def content(name: str, size: int) -> bytes:
    import random

    return random.Random(name).randbytes(size)


def digest(data: bytes | int) -> str:
    assert isinstance(data, bytes), f"read failed: errno {data}"
    return hashlib.sha256(data).hexdigest()


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


def split_by_member_3(devs: list[Path], files: dict[str, bytes]) -> tuple[list[str], list[str]]:
    """(names with a unit on member 3, names without one), from the offline index."""
    where = device_of(devs)
    lost = sorted(n for n in files if 2 in where[n])
    kept = sorted(n for n in files if 2 not in where[n])
    assert lost and kept, where
    assert any(len(where[n]) > 1 for n in kept), f"no multi-stripe file avoids member 3: {where}"
    return lost, kept


def mount(tmp_path: Path, devs: list[Path], *extra: str, errors: list[str]) -> KvfsMount:
    """A mount (and its remounts) of ``devs``, logging to a file of its own."""
    log = tmp_path / f"kvfs-{len(list(tmp_path.glob('kvfs-*.log')))}.log"
    log.touch()  # counted by the next call
    m = KvfsMount(tmp_path / "mnt", [str(d) for d in devs], log, errors, extra)
    m.start()
    return m


def finish(m: KvfsMount) -> None:
    m.close()
    assert m.exit_codes and all(c == 0 for c in m.exit_codes), (m.exit_codes, m.stderr)
    assert not m.unexpected_errors(), m.unexpected_errors()


# stripe k of inode i is on member (i + k) % 3: 12 MiB files have two stripes, 1 MiB
# ones one, 20 MiB ones three (every member): a mix with and without units on member 3
SIZES = [12 * MiB + 5, 1 * MiB + 5] * 5 + [20 * MiB + 3] * 2


def test_degraded_mount_keeps_unreadable_files_until_the_member_returns(tmp_path: Path) -> None:
    require_fuse()
    devs, files = three_member_pool(tmp_path, SIZES)
    lost, kept = split_by_member_3(devs, files)
    sums = {name: digest(data) for name, data in files.items()}
    rewritten, removed, untouched = lost[0], lost[1], lost[2:]
    new = {"new0": content("new0", 20 * MiB + 7), "new1": content("new1", 12 * MiB)}
    again = content("again", 9 * MiB + 1)

    m = mount(tmp_path, devs[:2], "--degraded", errors=[UNREADABLE])
    try:
        mnt = m.path
        assert sorted(os.listdir(mnt)) == sorted(files)
        for name in lost:
            assert os.stat(mnt / name).st_size == len(files[name])
            assert read_or_errno(mnt / name) == errno.EIO, name
            fd = os.open(mnt / name, os.O_RDONLY)
            try:
                assert errno_of(os.pread, fd, 4096, len(files[name]) // 2) == errno.EIO
            finally:
                os.close(fd)
        for name in kept:
            assert read_or_errno(mnt / name) == files[name], name
        assert m.stats()["store"]["unreadable_files"] == len(lost)
        # a change that needs the old bytes fails; a full rewrite (O_TRUNC) is a new file
        fd = os.open(mnt / lost[-1], os.O_WRONLY)
        try:
            assert errno_of(os.pwrite, fd, b"x" * 4096, 0) == errno.EIO
            assert errno_of(os.ftruncate, fd, 4096) == errno.EIO
        finally:
            os.close(fd)
        write_file(mnt / rewritten, again)
        assert read_or_errno(mnt / rewritten) == again
        os.unlink(mnt / removed)
        for name, data in new.items():
            write_file(mnt / name, data)
            assert read_or_errno(mnt / name) == data
        assert m.stats()["store"]["unreadable_files"] == len(lost) - 2
        # a crash: recovery (and the checkpoint it writes) keeps the records too
        m.crash()
        assert sorted(os.listdir(mnt)) == sorted({*files, *new} - {removed})
        for name in untouched:
            assert read_or_errno(mnt / name) == errno.EIO, name
        assert read_or_errno(mnt / rewritten) == again
        assert m.stats()["store"]["unreadable_files"] == len(untouched)
    finally:
        finish(m)
    text = m.log.read_text()
    assert f"degraded: {len(lost)} file(s)" in text, text[-3000:]
    for name in lost:
        assert re.search(rf"unreadable: inode \d+ {name}\n", text), name

    where = device_of(devs)
    for name in [*new, rewritten]:
        assert where[name] <= {0, 1}, (name, where[name])  # new data avoided member 3
    r = kvfs("fsck", *devs)
    assert r.returncode == 0, r.stdout + r.stderr

    m = mount(tmp_path, devs, errors=[])
    try:
        mnt = m.path
        assert sorted(os.listdir(mnt)) == sorted({*files, *new} - {removed})
        for name in [*untouched, *kept]:
            assert digest(read_or_errno(mnt / name)) == sums[name], name
        assert read_or_errno(mnt / rewritten) == again
        for name, data in new.items():
            assert read_or_errno(mnt / name) == data
        assert m.stats()["store"]["unreadable_files"] == 0
    finally:
        finish(m)


def test_eviction_of_unreadable_files_frees_only_present_units(tmp_path: Path) -> None:
    """Filling the present members evicts old files, unreadable ones among them: only
    their units on present members go back to the allocator (those on the missing
    member are not in it); the mount survives, and with every member back the pool
    checks clean and what was not evicted reads back byte-identical."""
    require_fuse()
    devs, files = three_member_pool(tmp_path, [12 * MiB + 5, 20 * MiB + 3] * 3, 64 * MiB)
    lost, kept = split_by_member_3(devs, files)
    sums = {name: digest(data) for name, data in files.items()}
    fill = {f"fill{i}": content(f"fill{i}", 8 * MiB) for i in range(11)}
    m = mount(tmp_path, devs[:2], "--degraded", errors=[UNREADABLE])
    try:
        mnt = m.path
        assert sorted(os.listdir(mnt)) == sorted(files)
        assert m.stats()["store"]["unreadable_files"] == len(lost)
        for name, data in fill.items():  # ~88 MiB: more than the present members hold
            write_file(mnt / name, data)
        eviction_settled(m.stats)  # the last write's round may still be evicting
        left = set(os.listdir(mnt))
        stats = m.stats()["store"]
        assert stats["evictions"] > 0 and set(lost) - left, (stats, left)
        assert stats["unreadable_files"] == len(set(lost) & left)
        want = {**files, **fill}
        for name in sorted((set(fill) | set(kept)) & left):
            got = read_or_errno(mnt / name)
            # a full pool may still evict (a later round): gone, never wrong bytes
            assert got == want[name] or (got == errno.ENOENT and name not in os.listdir(mnt))
        left = set(os.listdir(mnt))
    finally:
        finish(m)
    r = kvfs("fsck", *devs)
    assert r.returncode == 0, r.stdout + r.stderr
    m = mount(tmp_path, devs, errors=[])
    try:
        assert set(os.listdir(m.path)) <= left  # nothing comes back; eviction up to unmount
        assert set(os.listdir(m.path)) & set(fill), "the fill files were all evicted"
        left = set(os.listdir(m.path))
        for name in left:
            digest_now = sums[name] if name in files else digest(fill[name])
            assert digest(read_or_errno(m.path / name)) == digest_now, name
    finally:
        finish(m)


def test_drop_unreadable_drops_them_for_good(tmp_path: Path) -> None:
    require_fuse()
    devs, files = three_member_pool(tmp_path, SIZES[:6])
    lost, kept = split_by_member_3(devs, files)
    r = kvfs("mount", "--foreground", tmp_path / "mnt", *devs[:2], "--drop-unreadable")
    assert r.returncode == 2 and "--degraded" in r.stderr, r.stderr
    m = mount(tmp_path, devs[:2], "--degraded", "--drop-unreadable", errors=[])
    try:
        assert sorted(os.listdir(m.path)) == kept
        for name in kept:
            assert read_or_errno(m.path / name) == files[name]
        assert m.stats()["store"]["unreadable_files"] == 0
    finally:
        finish(m)
    text = m.log.read_text()
    assert f"degraded: {len(lost)} file(s)" in text and "dropped (--drop-unreadable)" in text
    for name in lost:
        assert re.search(rf"dropped: inode \d+ {name}\n", text), name
    m = mount(tmp_path, devs, errors=[])
    try:
        assert sorted(os.listdir(m.path)) == kept
    finally:
        finish(m)
    r = kvfs("fsck", *devs)
    assert r.returncode == 0, r.stdout + r.stderr


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
    from kvfs.cli.offline import offline_index

    require_fuse()
    devs, _ = three_member_pool(tmp_path, [MiB])
    _, pool = offline_index([str(d) for d in devs])
    pool_uuid = str(uuid.UUID(bytes=pool.superblocks[0].pool_uuid))
    mnt, opt = tmp_path / "mnt", ["--degraded"] if degraded else []
    if not degraded:
        line = one_line(kvfs("mount", "--foreground", mnt, *devs[:2]))
        assert f"pool {pool_uuid} has 3 devices; member 3 is missing" in line, line
        assert "attach it, or mount with --degraded" in line, line
    line = one_line(kvfs("mount", "--foreground", mnt, *devs[1:], *opt))
    assert f"pool {pool_uuid} has 3 devices; member 1 is missing" in line, line
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


def transaction_offsets(devs: list[Path]) -> list[int]:
    """Byte offsets on member 1 of the transactions in the newest log half."""
    from kvfs.devices.pool import open_pool
    from kvfs.format.halves import half_bounds
    from kvfs.format.records import KIND_TXN
    from kvfs.log.journal import recover, scan

    p = open_pool([str(d) for d in devs])
    try:
        meta, start, size = p.meta
        found = recover(meta, start, size, p.seed)
        base, half_size = half_bounds(start, size, found.half)
        offsets, prev = [], 0
        for end, entry in scan(meta, base, half_size, found.generation, p.seed):
            if entry.kind == KIND_TXN:
                offsets.append(base + prev)
            prev = end
        return offsets
    finally:
        p.close()


def test_salvage_of_a_damaged_log_keeps_the_unreadable_files(tmp_path: Path) -> None:
    """Mid-log damage found by a degraded mount: the salvage runs fsck's index checks,
    which must not take a unit on the missing member for one outside the pool."""
    from tests.mount.test_integrity import flip

    require_fuse()
    devs = [harness.make_image(tmp_path / f"m{i}.img", 128 * MiB) for i in range(3)]
    files = {f"f{i}": content(f"f{i}", MiB + 7) for i in range(12)}
    mnt = tmp_path / "mnt"
    with harness.mounted(
        mnt, devs, "--format", "--meta-size", "8M", log_file=tmp_path / "format.log"
    ) as proc:
        for name, data in files.items():
            write_file(mnt / name, data)  # close = commit: one group commit each
        harness.kill(proc, mnt)  # no final checkpoint: the transactions stay in the log
    lost = sorted(n for n, where in device_of(devs).items() if 2 in where)
    assert 2 <= len(lost) < len(files), lost
    txns = transaction_offsets(devs)
    assert len(txns) >= 12, txns
    flip(devs[0], txns[len(txns) // 2] + 40, 8)
    m = mount(tmp_path, devs[:2], "--degraded", errors=[UNREADABLE, "metadata log"])
    try:
        names = set(os.listdir(m.path))
        assert len(set(files) - names) <= 1, names  # at most the damaged transaction's
        assert len(set(lost) & names) >= len(lost) - 1, (lost, names)
        for name in set(lost) & names:
            assert read_or_errno(m.path / name) == errno.EIO, name
        for name in names - set(lost):
            assert read_or_errno(m.path / name) == files[name], name
    finally:
        finish(m)
    assert "metadata log salvaged" in m.log.read_text()
    m = mount(tmp_path, devs, errors=[])
    try:
        assert set(os.listdir(m.path)) == names
        for name in names:
            assert read_or_errno(m.path / name) == files[name], name
    finally:
        finish(m)
