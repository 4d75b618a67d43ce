"""Corruption on a real mount: flipped data units, journal entries, checkpoint pieces
and superblocks of image files (``docs/design.md`` "Integrity").

Data units: a read fails with EIO (never wrong bytes), the file is quarantined (later
lookups ENOENT), ``kvfs stats --json`` counts the corruption, the log names inode and
unit; ``kvfs fsck`` finds it offline and ``--repair`` drops the file. Metadata: the
mount recovers a consistent earlier state (a journal prefix, or the older checkpoint
generation) or refuses with a one-line message; it never serves wrong data.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvfs.cli.offline import offline_index
from kvfs.devices.pool import open_pool
from kvfs.format.halves import half_bounds
from kvfs.format.records import (
    DEV_SHIFT,
    KIND_CKPT_DATA,
    KIND_TXN,
    NO_UNIT,
    UNIT_MASK,
    allocated_size,
)
from kvfs.index.namespace import ROOT_INO, Namespace
from kvfs.log.journal import recover, scan
from kvfs.testing import harness
from tests.conftest import pattern, read_or_errno, require_fuse
from tests.conftest import write_file as write

MiB = 1 << 20
KVFS = [sys.executable, "-m", "kvfs"]


def kvfs(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVFS, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture
def pool(tmp_path: Path) -> list[Path]:
    require_fuse()
    return [harness.make_image(tmp_path / "pool.img", 256 * MiB)]


@contextmanager
def mount(tmp_path: Path, devices: list[Path], *extra: str) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    with harness.mounted(mnt, devices, *extra, log_file=tmp_path / "kvfs.log"):
        yield mnt


def flip(image: Path, offset: int, n: int = 16) -> None:
    """XOR ``n`` bytes at ``offset`` of an unmounted image."""
    fd = os.open(image, os.O_RDWR)
    try:
        old = os.pread(fd, n, offset)
        os.pwrite(fd, bytes(b ^ 0xA5 for b in old), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def index(devices: list[Path]) -> tuple[Namespace, list[int]]:
    """The pool's recovered namespace (offline) and each device's data_start."""
    ns, p = offline_index([str(d) for d in devices])
    return ns, [sb.data_start for sb in p.superblocks]


def unit_location(devices: list[Path], name: bytes, u: int) -> tuple[Path, int, int, int]:
    """(image, byte offset, inode, physical unit) of logical unit ``u`` of /name."""
    ns, _ = index(devices)
    inode = ns.inodes[ns.inodes[ROOT_INO].entries[name]]  # type: ignore[index]
    p = inode.units[u]
    assert p != NO_UNIT
    dev, unit = p >> DEV_SHIFT, p & UNIT_MASK
    p0 = open_pool([str(d) for d in devices])
    try:
        path = Path(p0.devices[dev].path)
        offset = p0.unit_offset(dev, unit)
    finally:
        p0.close()
    return path, offset, inode.ino, unit


def log_entries(image: Path) -> tuple[int, list[tuple[int, int, int]]]:
    """Newest generation's half: (generation, [(absolute offset, end, kind)])."""
    p = open_pool([str(image)])
    try:
        meta, start, size = p.meta
        found = recover(meta, start, size, p.seed)
        base, hsize = half_bounds(start, size, found.half)
        out, prev = [], 0
        for end, entry in scan(meta, base, hsize, found.generation, p.seed):
            out.append((base + prev, base + end, entry.kind))
            prev = end
        return found.generation, out
    finally:
        p.close()


def files(n: int, size: int = 3 * MiB + 123) -> dict[bytes, bytes]:
    return {f"f{i}".encode(): pattern(("integrity", i), size + i) for i in range(n)}


# ------------------------------------------------------------------------ data units
def test_corrupt_data_unit_is_eio_quarantined_counted_and_logged(
    tmp_path: Path, pool: list[Path]
) -> None:
    data = files(3)
    with mount(tmp_path, pool, "--format", "--meta-size", "8M") as mnt:
        for name, content in data.items():
            write(mnt / name.decode(), content)
    image, offset, ino, unit = unit_location(pool, b"f1", 1)
    flip(image, offset + 4000)
    with mount(tmp_path, pool) as mnt:
        assert read_or_errno(mnt / "f1") == errno.EIO  # never the flipped bytes
        # quarantined: unlinked, and the kernel's cached dentry invalidated; FUSE
        # delivers that notification asynchronously, so allow it a bounded moment
        deadline = time.monotonic() + 60
        while os.path.lexists(mnt / "f1"):
            assert time.monotonic() < deadline, "quarantined file still visible after 60 s"
            time.sleep(0.005)
        with pytest.raises(FileNotFoundError):
            os.stat(mnt / "f1")
        assert sorted(os.listdir(mnt)) == ["f0", "f2"]
        for name in (b"f0", b"f2"):
            assert read_or_errno(mnt / name.decode()) == data[name]
        r = kvfs("stats", "--json", mnt)
        assert r.returncode == 0, r.stderr
        store = json.loads(r.stdout)["store"]
        assert store["corruptions"] == 1
        assert store["files"] == 2
    log = (tmp_path / "kvfs.log").read_text()
    want = f"checksum mismatch: inode {ino} unit 1 at {image} unit {unit}; file quarantined"
    assert want in log, log[-2000:]
    # the quarantine is durable, and what remains is clean
    with mount(tmp_path, pool) as mnt:
        assert sorted(os.listdir(mnt)) == ["f0", "f2"]
        assert read_or_errno(mnt / "f1") == errno.ENOENT
    r = kvfs("fsck", *pool)
    assert r.returncode == 0, r.stdout + r.stderr


def test_fsck_finds_and_repairs_a_corrupt_data_unit(tmp_path: Path, pool: list[Path]) -> None:
    data = files(4, 2 * MiB)
    with mount(tmp_path, pool, "--format", "--meta-size", "8M") as mnt:
        for name, content in data.items():
            write(mnt / name.decode(), content)
    image, offset, ino, unit = unit_location(pool, b"f2", 0)
    flip(image, offset + 17)
    r = kvfs("fsck", *pool)
    assert r.returncode == 4, r.stdout + r.stderr
    assert f"inode {ino} (f2) unit 0 at device 0 unit {unit}: checksum mismatch" in r.stdout
    assert kvfs("fsck", "--no-data", *pool).returncode == 0  # index itself is fine
    r = kvfs("fsck", "--repair", *pool)
    assert r.returncode == 1, r.stdout + r.stderr
    r = kvfs("fsck", *pool)
    assert r.returncode == 0, r.stdout + r.stderr
    with mount(tmp_path, pool) as mnt:
        assert sorted(os.listdir(mnt)) == ["f0", "f1", "f3"]
        for name in (b"f0", b"f1", b"f3"):
            assert read_or_errno(mnt / name.decode()) == data[name]
        stats = json.loads(kvfs("stats", "--json", mnt).stdout)
        assert stats["store"]["corruptions"] == 0
        # the dropped file's units are free again: nothing leaked
        unit_size = stats["store"]["unit_size"]
        # whole units, and each partial tail in fragments (docs/format.md)
        used = sum(allocated_size(len(data[n]), unit_size) for n in (b"f0", b"f1", b"f3"))
        assert stats["store"]["used_bytes"] == used


# ------------------------------------------------------------------------ metadata
def test_corrupt_mid_log_transaction_is_reported_and_later_transactions_kept(
    tmp_path: Path, pool: list[Path]
) -> None:
    """Files committed one by one, then a crash (no final checkpoint): the journal holds
    their transactions, one group commit each. Damage one in the middle: that is not a
    torn tail (complete group commits follow it), so fsck reports it (exit 4), the
    mount says so loudly and keeps every later transaction: every file is intact or
    absent, never wrong, and only the damaged transaction's file may be missing."""
    data = files(12, 1 * MiB + 7)
    mnt = tmp_path / "mnt"
    with harness.mounted(
        mnt, pool, "--format", "--meta-size", "8M", log_file=tmp_path / "kvfs.log"
    ) as proc:
        for name, content in data.items():
            write(mnt / name.decode(), content)  # close = commit: one flush each
        harness.kill(proc, mnt)
    _, entries = log_entries(pool[0])
    txns = [(start, end) for start, end, kind in entries if kind == KIND_TXN]
    assert len(txns) >= 12, entries
    start, _ = txns[len(txns) // 2]
    flip(pool[0], start + 40, 8)  # inside the payload: the entry's checksum fails
    r = kvfs("fsck", "--no-data", *pool)
    assert r.returncode == 4, r.stdout + r.stderr
    assert "damaged at byte" in r.stdout, r.stdout
    with mount(tmp_path, pool) as mnt:
        seen = {}
        for name, content in data.items():
            got = read_or_errno(mnt / name.decode())
            assert got in (content, errno.ENOENT), f"{name!r}: wrong data or error {got!r}"
            seen[name] = got == content
        missing = [n for n, ok in seen.items() if not ok]
        assert len(missing) <= 1, f"more than the damaged transaction's file lost: {missing}"
        assert seen[b"f0"] and seen[b"f11"], seen
        assert sorted(os.listdir(mnt)) == sorted(n.decode() for n, ok in seen.items() if ok)
    log = (tmp_path / "kvfs.log").read_text()
    assert "metadata log damaged at byte" in log and "salvaged" in log, log[-2000:]
    r = kvfs("fsck", *pool)  # the mount checkpointed the salvaged index
    assert r.returncode == 0, r.stdout + r.stderr


def test_torn_tail_is_no_damage(tmp_path: Path, pool: list[Path]) -> None:
    """A crash that tears the last group commit is the normal end of a log: the
    damage in the last write is not reported as mid-log damage, and fsck is clean."""
    data = files(4, 256 * 1024)
    mnt = tmp_path / "mnt"
    with harness.mounted(
        mnt, pool, "--format", "--meta-size", "8M", log_file=tmp_path / "kvfs.log"
    ) as proc:
        for name, content in data.items():
            write(mnt / name.decode(), content)
        harness.kill(proc, mnt)
    _, entries = log_entries(pool[0])
    txns = [(start, end) for start, end, kind in entries if kind == KIND_TXN]
    start, _ = txns[-1]  # the last group commit: as if the crash had torn it
    flip(pool[0], start + 40, 8)
    r = kvfs("fsck", "--no-data", *pool)
    assert r.returncode == 0, r.stdout + r.stderr
    with mount(tmp_path, pool) as mnt:
        for name, content in list(data.items())[:-1]:
            assert read_or_errno(mnt / name.decode()) == content
        last = list(data)[-1]
        assert read_or_errno(mnt / last.decode()) in (data[last], errno.ENOENT)
    assert " ERROR " not in (tmp_path / "kvfs.log").read_text()


def test_corrupt_newest_checkpoint_falls_back_to_the_older_generation(
    tmp_path: Path, pool: list[Path]
) -> None:
    """A clean unmount leaves the newest checkpoint in one half and the previous
    generation + its journal (the same state) in the other: damage a piece of the
    newest checkpoint and the mount recovers everything from the older one."""
    data = files(6, 512 * 1024)
    with mount(tmp_path, pool, "--format", "--meta-size", "8M") as mnt:
        for name, content in data.items():
            write(mnt / name.decode(), content)
        for i in range(5000):  # enough records for several checkpoint pieces
            os.close(os.open(mnt / f"e{i}", os.O_CREAT | os.O_WRONLY, 0o644))
    generation, entries = log_entries(pool[0])
    pieces = [(s, e) for s, e, kind in entries if kind == KIND_CKPT_DATA]
    assert pieces, entries[:5]
    s, e = pieces[-1]  # a columnar image may be one piece: damage the last
    flip(pool[0], (s + e) // 2, 8)
    r = kvfs("fsck", "--no-data", *pool)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"checkpoint generation {generation - 1} " in r.stdout, r.stdout
    with mount(tmp_path, pool) as mnt:
        for name, content in data.items():
            assert read_or_errno(mnt / name.decode()) == content
        assert len(os.listdir(mnt)) == len(data) + 5000
    log = (tmp_path / "kvfs.log").read_text()
    assert f"checkpoint generation {generation} is incomplete" in log
    r = kvfs("fsck", *pool)
    assert r.returncode == 0, r.stdout + r.stderr


def test_both_checkpoints_destroyed_refuses_to_mount(tmp_path: Path, pool: list[Path]) -> None:
    with mount(tmp_path, pool, "--format", "--meta-size", "8M") as mnt:
        write(mnt / "a", b"x" * 5000)
    p = open_pool([str(pool[0])])
    meta_start, meta_size = p.superblocks[0].meta_start, p.superblocks[0].meta_size
    p.close()
    for half in (0, 1):
        base, _ = half_bounds(meta_start, meta_size, half)
        flip(pool[0], base, 64)  # the CKPT_BEGIN entry of each half
    r = subprocess.run(
        [*KVFS, "mount", "--foreground", str(tmp_path / "mnt"), str(pool[0])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    err = r.stderr.strip()
    assert "no complete metadata checkpoint" in err, err
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    assert not harness.is_mounted(tmp_path / "mnt")
    r = kvfs("fsck", *pool)
    assert r.returncode == 4 and "UNRECOVERABLE" in r.stdout, r.stdout + r.stderr


def test_garbage_superblock_is_refused_and_data_stays_intact(tmp_path: Path) -> None:
    """Both copies of one device's superblock damaged: mount refuses with one line, fsck
    says what it would rebuild, nothing is written. (One damaged copy is repaired from
    the other: ``tests/mount/test_superblock.py``.)"""
    require_fuse()
    devs = [harness.make_image(tmp_path / f"d{i}.img", 192 * MiB) for i in range(2)]
    data = files(4, 20 * MiB)  # striped over both devices
    with mount(tmp_path, devs, "--format", "--meta-size", "8M") as mnt:
        for name, content in data.items():
            write(mnt / name.decode(), content)
    for i, victim in enumerate(devs):
        copies = (0, victim.stat().st_size - 4096)  # primary and backup
        saved = victim.read_bytes()
        for offset in copies:
            flip(victim, offset + 100, 32)
        damaged = victim.read_bytes()
        r = subprocess.run(
            [*KVFS, "mount", "--foreground", str(tmp_path / "mnt"), *map(str, devs)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, r.stderr
        err = r.stderr.strip()
        assert f"{victim}: both superblock copies are damaged (primary: superblock " in err, err
        assert f"it can only be device {i + 1} of the pool" in err, err
        assert len(err.splitlines()) == 1 and "Traceback" not in err
        assert not harness.is_mounted(tmp_path / "mnt")
        r = kvfs("fsck", *devs)
        assert r.returncode == 4 and "both superblock copies are damaged" in r.stdout, r.stdout
        assert victim.read_bytes() == damaged  # neither mount nor fsck wrote anything
        for offset in copies:
            flip(victim, offset + 100, 32)  # XOR again: restored
        assert victim.read_bytes() == saved
    # refusing touched nothing: every byte of every file is still there
    with mount(tmp_path, devs) as mnt:
        for name, content in data.items():
            assert read_or_errno(mnt / name.decode()) == content
    assert kvfs("fsck", *devs).returncode == 0
