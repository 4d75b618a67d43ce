"""Real-mount regressions: an engine gets a file's exact bytes, or ENOENT/EIO.

Never zeros, a short file or another file's data. Every file's content derives from
its name (:func:`content`), so whatever a read returns can be checked byte for byte.

- a data device that starts failing writes mid-file (its loop device shrunk under it);
- a failing metadata log (faultfs) must fail commits with EIO, not stop the mount;
- one flipped bit in a mid-log journal transaction must not silently drop every later
  durable transaction (fsck and the mount must say so, later commits must survive);
- a vLLM-style writer (tmp file, close, ``os.replace``) under eviction pressure must
  never find its just-closed tmp file evicted;
- readers under eviction churn with reused names never see a short complete file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfs.testing import harness
from tests.conftest import KvfsMount, read_or_errno, require_fuse
from tests.conftest import write_file as write

MiB = 1 << 20
KVFS = [sys.executable, "-m", "kvfs"]


def content(name: str, size: int) -> bytes:
    """The bytes a file called ``name`` holds (self-identifying)."""
    return random.Random(name).randbytes(size)


def kvfs(*args: object, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVFS, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def describe(got: bytes | int, want: bytes) -> str:
    """What a read returned, in words (for assertion messages)."""
    if isinstance(got, int):
        return f"errno {errno.errorcode.get(got, got)}"
    if got == want:
        return "exact bytes"
    if len(got) != len(want):
        return f"{len(got)} bytes instead of {len(want)}"
    step = 1 << 20
    bad = [u for u in range(0, len(want), step) if got[u : u + step] != want[u : u + step]]
    zeros = [u for u in bad if not any(got[u : u + step])]
    return f"wrong bytes in {len(bad)} MiB ({len(zeros)} MiB of them zeros)"


def error_lines(log: Path) -> list[str]:
    if not log.exists():
        return []
    return [line for line in log.read_text(errors="replace").splitlines() if " ERROR " in line]


# ================================================================ 2: failed data writes
def _losetup_capacity(dev: str) -> None:
    subprocess.run(["losetup", "-c", dev], check=True, capture_output=True)


def run_until(
    threads: list[threading.Thread], stop: threading.Event, least: float, enough: Any
) -> None:
    """Run ``threads`` for at least ``least`` seconds and until ``enough()`` (a
    loaded machine does less per second: the workload is measured by what it did,
    never by the clock; 240 s is only a hang guard) or until one of them sets
    ``stop``; then stop them and wait for each (60 s)."""
    for th in threads:
        th.start()
    start = time.monotonic()
    while not stop.is_set() and time.monotonic() - start < 240:
        if time.monotonic() - start >= least and enough():
            break
        time.sleep(0.2)
    stop.set()
    for th in threads:
        th.join(60)


@pytest.mark.expect_errors(
    "write-back|failed|EIO|damag|metadata|device|loop|short read|checksum|quarantin|space"
)
def test_failed_device_write_is_eio_never_zeros(loop_mount: KvfsMount, tmp_path: Path) -> None:
    """Device 2 starts failing writes (its loop device shrinks to 2 MiB) while a big
    file is written through buffered 8 MiB writes. Today the write-back error reaches
    one FUSE write only, which the kernel turns into a short write that the writer's
    loop simply continues: write and close succeed, and the lost units read as zeros,
    live and after a remount. A fixed kvfs fails the write or the close with EIO, and
    the file is then absent or unreadable (EIO), never other bytes."""
    mnt = loop_mount.path
    image2 = tmp_path / "loop1.img"
    dev2 = loop_mount.devices[1]
    before = {f"pre{i}": content(f"pre{i}", 3 * MiB + 5 + i) for i in range(4)}
    for name, data in before.items():
        write(mnt / name, data)
    saved = tmp_path / "loop1.saved"
    subprocess.run(["cp", "--sparse=always", str(image2), str(saved)], check=True)
    os.truncate(image2, 2 * MiB)
    _losetup_capacity(dev2)
    big = content("big", 160 * MiB)
    failure: OSError | None = None

    def check(when: str, pre_live: dict[str, bytes | int] | None) -> dict[str, bytes | int]:
        outcome = "succeeded" if failure is None else f"failed: {failure}"
        got = read_or_errno(mnt / "big")
        ok = got == big or got in (errno.ENOENT, errno.EIO)
        assert ok, (
            f"{when}: the file whose write-back failed (its write+close {outcome}) "
            f"reads {describe(got, big)}"
        )
        seen = {}
        for name, data in before.items():
            seen[name] = read_or_errno(mnt / name)
            exact_before = pre_live is not None and pre_live[name] == data
            ok = seen[name] == data or (seen[name] == errno.EIO and not exact_before)
            assert ok, (
                f"{when}: {name}, written before the fault, reads {describe(seen[name], data)}"
            )
        return seen

    try:
        try:
            with open(mnt / "big", "wb") as f:
                for off in range(0, len(big), 8 * MiB):
                    f.write(big[off : off + 8 * MiB])
        except OSError as e:
            failure = e
        live = check("live", None)
    finally:
        # the device comes back whole (what the shrink cut off is put back), so that
        # the pool can be mounted again
        if loop_mount.mounted:
            loop_mount.stop()
        subprocess.run(["cp", "--sparse=always", str(saved), str(image2)], check=True)
        _losetup_capacity(dev2)
    loop_mount.start()
    check("after a remount", live)
    assert failure is not None, (
        "write()+close() of a 160 MiB file succeeded although a device failed its writes"
    )
    assert failure.errno == errno.EIO, failure


# ============================================================ 3: failed metadata writes
def test_failed_metadata_write_fails_commits_but_keeps_the_mount(tmp_path: Path) -> None:
    """The only device (it holds the metadata log) starts failing writes. Today the
    first failed journal write is fatal for the background evictor (it waits for the
    journal and gets an uncaught DeviceError): the daemon dies and every client gets
    ENOTCONN. A fixed kvfs keeps serving: lookups and listings work, files that were
    durable before the fault read back exactly, every later commit (close, fsync)
    fails (EIO; ENOSPC once the failed device is offline), and the log says why."""
    from tests.mount.test_faults import faultfs

    require_fuse()
    with faultfs(tmp_path, {"d0.img": 128 * MiB}) as ffs:
        devs = [ffs.path / "d0.img"]
        mnt, log = tmp_path / "mnt", tmp_path / "kvfs.log"
        with harness.mounted(
            mnt, devs, "--format", "--meta-size", "8M", "--io-timeout", "5", log_file=log
        ) as proc:
            durable = {f"old{i}": content(f"old{i}", 2 * MiB + i) for i in range(3)}
            for name, data in durable.items():
                write(mnt / name, data)
            ffs.set(**{"d0.img": {"write": "eio"}})
            try:
                outcomes = _commits_after_a_metadata_fault(mnt)
                # the background evictor runs every 0.5 s: give it a few rounds
                deadline = time.monotonic() + 3
                while time.monotonic() < deadline and proc.poll() is None:
                    time.sleep(0.05)
                alive = _mount_answers(mnt)
                assert proc.poll() is None and alive is None, (
                    f"the mount died after a failed metadata write (daemon exit code "
                    f"{proc.poll()}, {alive}); commits saw {outcomes}; daemon stderr: "
                    f"{_stderr_tail(proc)}"
                )
                # the first commit meets the failed device; later ones may find it taken
                # offline (ENOSPC: no healthy device left); none may succeed
                first, *rest = outcomes.items()
                assert first[1] == errno.EIO, f"{first[0]} after the fault gave {first[1]}"
                for name, result in rest:
                    assert result in (errno.EIO, errno.ENOSPC), f"{name} gave {result}"
                assert set(durable) <= set(os.listdir(mnt))
                for name, data in durable.items():
                    got = read_or_errno(mnt / name)
                    assert got == data, f"durable {name} reads {describe(got, data)}"
                later = _commits_after_a_metadata_fault(mnt, "again")
                assert all(r in (errno.EIO, errno.ENOSPC) for r in later.values()), later
                assert any(re.search("metadata|journal", line) for line in error_lines(log)), (
                    error_lines(log)
                )
            finally:
                ffs.set()  # the device answers again: the unmount can finish


def _stderr_tail(proc: subprocess.Popen[bytes]) -> str:
    """The kvfs frames and exception lines of a dead daemon's traceback."""
    if proc.poll() is None or proc.stderr is None:
        return ""
    lines = proc.stderr.read().decode(errors="replace").splitlines()
    keep = [i for i, line in enumerate(lines) if "/kvfs/" in line]
    picked = [lines[j].strip(" |") for i in keep for j in (i, i + 1) if j < len(lines)]
    picked += [line.strip(" |") for line in lines if "Error:" in line]
    return "\n".join(dict.fromkeys(picked))


def _commits_after_a_metadata_fault(mnt: Path, tag: str = "") -> dict[str, int | None]:
    """Commit in every way an engine does; errno of each (None: it succeeded)."""
    out: dict[str, int | None] = {}

    def attempt(what: str, fn: Callable[[], object]) -> None:
        try:
            fn()
            out[what] = None
        except OSError as e:
            out[what] = e.errno

    attempt(f"close of a new 2 MiB file{tag}", lambda: write(mnt / f"new{tag}", b"x" * 2 * MiB))
    attempt(f"close of a new empty file{tag}", lambda: write(mnt / f"empty{tag}", b""))

    def fsync_small() -> None:
        fd = os.open(mnt / f"small{tag}", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"y" * 4096)
            os.fsync(fd)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)

    attempt(f"fsync of a small file{tag}", fsync_small)
    return out


def _mount_answers(mnt: Path) -> str | None:
    """None if stat and listdir of the mountpoint work, else what failed."""
    try:
        os.stat(mnt)
        os.listdir(mnt)
    except OSError as e:
        return f"{e.strerror} ({errno.errorcode.get(e.errno or 0)})"
    return None


# ============================================================ 6: one flipped journal bit
def _txn_entries(image: Path) -> list[tuple[int, int, list[object]]]:
    """The newest half's TXN entries: (absolute payload offset, payload length, ops)."""
    from kvfs.devices.pool import open_pool
    from kvfs.format.halves import half_bounds
    from kvfs.format.records import KIND_TXN, decode_ops
    from kvfs.log.journal import recover, scan

    pool = open_pool([str(image)])
    try:
        meta, start, size = pool.meta
        found = recover(meta, start, size, pool.seed)
        base, hsize = half_bounds(start, size, found.half)
        out: list[tuple[int, int, list[object]]] = []
        prev = 0
        for end, entry in scan(meta, base, hsize, found.generation, pool.seed):
            if entry.kind == KIND_TXN:
                out.append((base + prev + 32, len(entry.payload), list(decode_ops(entry.payload))))
            prev = end
        return out
    finally:
        pool.close()


def _crash(mount: KvfsMount) -> None:
    """kill -9 the daemon and leave the pool unmounted (no final checkpoint)."""
    assert mount.proc is not None and mount._stack is not None
    harness.kill(mount.proc, mount.path)
    mount._stack.close()
    mount._stack = None
    mount.proc = None


@pytest.mark.expect_errors("damag|corrupt|journal|metadata|checksum")
def test_flipped_bit_in_a_mid_log_transaction_loses_only_that_transaction(
    kvfs_mount: KvfsMount, tmp_path: Path
) -> None:
    """Six files closed one after another (each close is its own durable group
    commit), a crash, then one bit flipped in the transaction that commits file 3.
    Today recovery ends the log there without a word: files 3-6 vanish, fsck exits 0,
    and the mount checkpoints the truncated state. A fixed kvfs reports the damage
    (fsck exit 4, an ERROR at mount) and keeps the intact later transactions."""
    from kvfs.format.records import FLAG_WRITING, InodeRecord

    mnt = kvfs_mount.path
    image = tmp_path / "pool.img"
    files = {f"f{i}": content(f"f{i}", MiB + 1000 * i + 7) for i in range(1, 7)}
    inos = {}
    for name, data in files.items():
        write(mnt / name, data)
        inos[name] = os.stat(mnt / name).st_ino
    _crash(kvfs_mount)
    commits = [
        (off, length)
        for off, length, ops in _txn_entries(image)
        for op in ops
        if isinstance(op, InodeRecord)
        and op.ino == inos["f3"]
        and not op.flags & FLAG_WRITING
        and op.size == len(files["f3"])
    ]
    assert commits, "no journal transaction commits f3"
    off, length = commits[0]
    with open(image, "r+b") as f:
        f.seek(off + length // 2)
        byte = f.read(1)[0]
        f.seek(off + length // 2)
        f.write(bytes([byte ^ 0x10]))
    r = kvfs("fsck", image)
    assert r.returncode == 4 and re.search("damag|corrupt|checksum", r.stdout, re.I), (
        f"fsck of a log with a damaged mid-log transaction exited {r.returncode}:\n{r.stdout}"
    )
    kvfs_mount.start()
    errors = error_lines(kvfs_mount.log)
    assert any(re.search("damag|corrupt|journal|metadata", e) for e in errors), (
        f"the mount recovered a damaged log without an ERROR line: {errors}"
    )

    def check(when: str) -> None:
        for name, data in files.items():
            got = read_or_errno(mnt / name)
            ok = got == data or (name == "f3" and got == errno.ENOENT)
            assert ok, f"{when}: {name} reads {describe(got, data)}"

    check("after recovery")
    kvfs_mount.remount()  # what recovery checkpointed
    check("after a clean remount")


# ================================================ 7: a just-closed tmp file gets evicted
@pytest.fixture
def evicting_mount(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[KvfsMount]:
    """A 136 MiB pool (about 120 data units): a few hundred MiB of writes evict."""
    from tests.conftest import _expected, _finish

    require_fuse()
    image = harness.make_image(tmp_path / "dev.img", 136 * MiB)
    mount = KvfsMount(tmp_path / "mnt", [str(image)], tmp_path / "kvfs.log", _expected(request))
    try:
        mount.start("--format", "--meta-size", "8M")
        yield mount
    finally:
        _finish(mount)


def test_tmp_file_is_not_evicted_between_its_close_and_its_rename(
    evicting_mount: KvfsMount,
) -> None:
    """vLLM's writer: create ``blk.<rand>.tmp`` (O_EXCL), one write, close, then
    ``os.replace`` onto the block's name, from several threads while eviction runs all
    the time. Today the policy files a stream's newest file right *before* its
    predecessor (a chain's tail goes first), so a just-closed tmp file is often the
    very next victim and another writer's allocation evicts it before its rename:
    ``os.replace`` fails with ENOENT. A fixed kvfs gives new files a grace period.
    (Readers under the same churn: test_readers_under_eviction_churn_...)"""
    d = evicting_mount.path / "vllm"
    d.mkdir()
    size, writers = MiB, 8
    stop = threading.Event()
    lost: list[str] = []
    errors: list[str] = []
    done: list[str] = []

    def writer(t: int) -> None:
        rng = random.Random(t)
        i = 0
        while not stop.is_set():
            name = f"blk_{t}_{i}"
            i += 1
            tmp = d / f"{name}.{rng.getrandbits(32):08x}.tmp"
            try:
                fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                try:
                    os.write(fd, content(name, size))
                finally:
                    os.close(fd)
            except OSError as e:
                if e.errno != errno.ENOSPC:  # a grace period may briefly leave no victim
                    errors.append(f"writing {tmp.name}: {e}")
                    stop.set()
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                continue
            try:
                os.replace(tmp, d / name)
            except OSError as e:
                lost.append(f"os.replace({tmp.name}) right after its close: {e.strerror}")
                stop.set()
                continue
            done.append(name)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(writers)]
    run_until(threads, stop, 12, lambda: evicting_mount.stats()["store"]["evictions"] > 0)
    assert not any(th.is_alive() for th in threads), "a writer hung"
    assert not errors, errors
    evictions = evicting_mount.stats()["store"]["evictions"]
    assert not lost, f"{lost[0]} ({len(done)} blocks written, {evictions} evictions)"
    assert evictions > 0, "no eviction: the test did not put the pool under pressure"


# ============================================== 9: short reads of evicted, reopened files
ODD_SIZE = 1_237_720  # the size of the reported file
CACHED = 532_480  # what the reader got of it: the prefix still in the page cache

CHILD_WRITER = """
import os, random, sys
path, size, cached = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = random.Random(os.path.basename(path)).randbytes(size)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(fd, data)
os.close(fd)
fd = os.open(path, os.O_RDONLY)  # read it all (page cache), then keep only a prefix
assert os.read(fd, size + 1) == data
os.posix_fadvise(fd, cached, 0, os.POSIX_FADV_DONTNEED)
os.close(fd)
"""


def _evict_by_pressure(d: Path, victim: Path, timeout: float = 120) -> None:
    """Write 4 MiB files into ``d`` until ``victim`` is evicted."""
    deadline = time.monotonic() + timeout
    i = 0
    while victim.exists():
        assert time.monotonic() < deadline, f"{victim.name} was never evicted"
        try:
            write(d / f"pressure{i}", content(f"pressure{i}", 4 * MiB))
        except OSError as e:
            assert e.errno == errno.ENOSPC, e  # a grace period may leave no victim
            time.sleep(0.1)
        i += 1


def test_evicted_file_reopened_through_a_kernel_reference_is_not_served_short(
    evicting_mount: KvfsMount,
) -> None:
    """The reported short read (532,480 of 1,237,720 bytes), made deterministic. An
    open races with the eviction of its file: the kernel resolved the name (a cached
    dentry; here an O_PATH fd, reopened through /proc) while kvfs evicts the file,
    which frees its units and sets its size to 0 but keeps the inode while the kernel
    references it. The open of that dead inode succeeds; the kernel serves the pages
    it still caches under the old size and takes kvfs's empty READ reply for the end
    of the file. A fixed kvfs refuses to open an evicted inode (ENOENT, ESTALE or
    EIO) or serves all of its bytes, never a prefix."""
    mnt = evicting_mount.path
    victim = mnt / "chunk"
    want = content(victim.name, ODD_SIZE)
    # a child writes it and exits: an orphan, the first to go under pressure
    r = subprocess.run(
        [sys.executable, "-c", CHILD_WRITER, str(victim), str(ODD_SIZE), str(CACHED)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert os.stat(victim).st_size == ODD_SIZE
    ref = os.open(victim, os.O_PATH)  # the kernel's reference; no FUSE open
    try:
        _evict_by_pressure(mnt, victim)
        try:
            fd = os.open(f"/proc/self/fd/{ref}", os.O_RDONLY)
        except OSError as e:
            assert e.errno in (errno.ENOENT, errno.ESTALE, errno.EIO), e
            return
        try:
            size = os.fstat(fd).st_size
            got = b""
            while chunk := os.read(fd, 4 * MiB):
                got += chunk
        except OSError as e:
            assert e.errno in (errno.ENOENT, errno.ESTALE, errno.EIO), e
            return
        finally:
            os.close(fd)
    finally:
        os.close(ref)
    exact = got == want
    assert exact, (
        f"an evicted file reopened through the kernel's reference read "
        f"{describe(got, want)} (fstat said {size} bytes)"
    )


def test_readers_under_eviction_churn_get_whole_files_or_enoent(
    evicting_mount: KvfsMount,
) -> None:
    """The realistic form of the race above: writers keep replacing 200 chunk files
    (tmp + rename, always the same bytes for a name, 1,237,720 bytes each) through a
    ~120 MiB pool while readers open and read them by name. A chunk is never
    legitimately shorter than that, yet today a reader that opens a name just as its
    file is evicted gets the evicted inode: an empty file (or, with its attributes
    and some pages still cached, a prefix)."""
    d = evicting_mount.path / "chunks"
    d.mkdir()
    names = [f"c{i}" for i in range(200)]
    data = {n: content(n, ODD_SIZE) for n in names}
    stop = threading.Event()
    bad: list[str] = []
    errors: list[str] = []
    reads = [0]

    def writer(t: int) -> None:
        rng = random.Random(t)
        while not stop.is_set():
            name = rng.choice(names)
            tmp = d / f"{name}.{rng.getrandbits(32):08x}.tmp"
            try:
                fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                try:
                    os.write(fd, data[name])
                finally:
                    os.close(fd)
                os.replace(tmp, d / name)
            except OSError as e:
                # ENOSPC: a grace period may briefly leave no victim; ENOENT at the
                # rename: the tmp file was evicted (test_tmp_file_is_not_evicted...)
                if e.errno not in (errno.ENOSPC, errno.ENOENT):
                    errors.append(f"{tmp.name}: {e}")
                    stop.set()

    def reader(t: int) -> None:
        rng = random.Random(100 + t)
        while not stop.is_set():
            name = rng.choice(names)
            got = read_or_errno(d / name)
            if got == errno.ENOENT:
                continue
            reads[0] += 1
            if got != data[name]:
                now = read_or_errno(d / name)
                bad.append(
                    f"{name}: a reader got {describe(got, data[name])}; read again by "
                    f"name it gives {describe(now, data[name])}"
                )
                stop.set()

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(3)]
    threads += [threading.Thread(target=reader, args=(t,)) for t in range(3)]
    run_until(
        threads, stop, 15, lambda: evicting_mount.stats()["store"]["evictions"] > 0 and reads[0] > 0
    )
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert not errors, errors
    evictions = evicting_mount.stats()["store"]["evictions"]
    assert not bad, f"{bad[0]} ({reads[0]} whole reads, {evictions} evictions)"
    assert evictions > 0 and reads[0] > 0, (evictions, reads[0])
