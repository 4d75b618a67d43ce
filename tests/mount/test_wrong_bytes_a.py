"""Wrong bytes on a real mount: an engine gets a file's exact bytes, or ENOENT/EIO.

Never zeros, a short file, or another file's data. Every file's content derives from
its intended name (:func:`content`), so foreign data is recognised and named.

Cases:

1. tmp + rename in one directory while it is listed (vLLM's fs tier).
4. A file evicted while the kernel still holds a reference to its inode.
5. A writer killed mid-write (its implicit close at exit is no commit), also after a
   FLUSH from a forked child or an fsync has committed a prefix of its file.
8. close() reporting ENOSPC after every write() succeeded.
9. FLUSHes from forked children while files are being written.

Also: ``kvfs umount`` of a dead mount (daemon killed).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfs.testing import harness
from tests.conftest import KvfsMount, aligned, pattern, read_or_errno, require_fuse, write_file

MiB = 1 << 20
GONE = (errno.ENOENT, errno.ESTALE, errno.EIO)
"""What a file that must not be served may answer instead (open or read)."""


# ---------------------------------------------------------------------- helpers
def size_of(name: str) -> int:
    """A per-name size (some KiB), so a file holding another's bytes is caught by size too."""
    return 8192 + hashlib.sha256(name.encode()).digest()[0] * 97


def content(name: str, size: int | None = None) -> bytes:
    """The bytes of the file intended to be called ``name``."""
    return pattern(name, size_of(name) if size is None else size)


def describe(got: bytes | int, expected: bytes, owners: dict[bytes, str] | None = None) -> str:
    """What a reader got, in words (for assertion messages)."""
    if isinstance(got, int):
        return errno.errorcode.get(got, str(got))
    if got == expected:
        return "exact"
    if not got:
        return f"an empty file (0 of {len(expected)} bytes)"
    who = (owners or {}).get(got[:64])
    if who is not None:
        return f"{len(got)} bytes of {who}"
    if got == expected[: len(got)]:
        return f"short: {len(got)} of {len(expected)} bytes (an exact prefix)"
    if not got.strip(b"\0"):
        return f"{len(got)} zero bytes"
    return f"{len(got)} wrong bytes (expected {len(expected)})"


# ============================================================ 1. tmp + rename + readdir
N_BLOCKS = 400


def test_tmp_rename_while_listing_keeps_every_block_exact(kvfs_mount: KvfsMount) -> None:
    """vLLM's fs tier: write ``x.tmp``, close, rename it to ``blk_i`` (same directory,
    the same tmp name every time) while another thread lists the directory. Every
    rename must succeed and every ``blk_i`` must hold exactly its own bytes, live and
    after a remount. (A listing whose directory handle predates a rename must not
    plant the old name ``x.tmp`` on the inode now called ``blk_j``: the next
    ``open(x.tmp, O_CREAT|O_TRUNC)`` would truncate and overwrite ``blk_j``.)"""
    d = kvfs_mount.path / "fs-tier"
    d.mkdir()
    names = [f"blk_{i}" for i in range(N_BLOCKS)]
    owners = {content(n)[:64]: n for n in names}
    stop = threading.Event()
    listings = [0]
    lister_error: list[BaseException] = []

    def lister() -> None:
        try:
            while not stop.is_set():
                os.listdir(d)
                listings[0] += 1
        except BaseException as e:  # reported by the main thread
            lister_error.append(e)

    thread = threading.Thread(target=lister, daemon=True)
    thread.start()
    rename_failures: list[str] = []
    tmp = d / "x.tmp"
    try:
        for name in names:
            write_file(tmp, content(name))
            try:
                os.rename(tmp, d / name)
            except OSError as e:
                rename_failures.append(f"{name}: {errno.errorcode.get(e.errno or 0, e)}")
    finally:
        stop.set()
        thread.join(10)
    assert not lister_error, f"listdir failed: {lister_error[0]!r}"
    assert listings[0] > 0

    def bad_blocks() -> list[str]:
        bad = []
        for name in names:
            got = read_or_errno(d / name)
            if got != content(name):
                bad.append(f"{name}: {describe(got, content(name), owners)}")
        return bad

    live = bad_blocks()
    left_live = sorted(set(os.listdir(d)) - set(names))
    kvfs_mount.remount()
    remounted = bad_blocks()
    left_remounted = sorted(set(os.listdir(d)) - set(names))
    problems = []
    if rename_failures:
        problems.append(f"{len(rename_failures)} renames failed, e.g. {rename_failures[:3]}")
    if live:
        problems.append(f"{len(live)} wrong blocks live, e.g. {live[:3]}")
    if remounted:
        problems.append(f"{len(remounted)} wrong blocks after remount, e.g. {remounted[:3]}")
    if left_live or left_remounted:
        problems.append(f"extra names: live {left_live[:3]}, remounted {left_remounted[:3]}")
    assert not problems, f"({listings[0]} listings ran meanwhile) " + "; ".join(problems)


# ============================================================ 4. evicted files
FILL = 4 * MiB


def write_uncached(path: Path, data: bytes) -> None:
    """Write ``path`` and drop its pages from the kernel's page cache, so later reads
    show what the daemon serves (not what this process wrote)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evict(d: Path, victim: str) -> int:
    """Write 4 MiB files into ``d`` from this (live) process until ``victim`` is gone
    from the listing (the pool evicts); returns how many were written."""
    for i in range(80):  # 320 MiB through a 128 MiB pool
        name = f"fill-{i:03d}"
        write_file(d / name, content(name, FILL))
        if victim not in os.listdir(d):
            return i + 1
    pytest.fail(f"{victim} was never evicted")


def check_gone(got: bytes | int, expected: bytes, what: str) -> None:
    """An evicted file: ENOENT/ESTALE/EIO (its exact bytes would do too, never less)."""
    if isinstance(got, int):
        assert got in GONE, f"{what}: unexpected {errno.errorcode.get(got, got)}"
        return
    assert got == expected, f"{what}: the evicted file was served as {describe(got, expected)}"


@pytest.fixture
def evicting(small_mount: KvfsMount) -> Iterator[Path]:
    """A kvfs-managed directory of a 128 MiB pool (eviction makes room)."""
    d = small_mount.path / "vllm"
    d.mkdir()
    yield d


def test_evicted_file_never_opens_empty_through_an_o_path_fd(evicting: Path) -> None:
    """An O_PATH fd holds a kernel reference (a LOOKUP, no OPEN), so eviction may take
    the file. Opening it afterwards through /proc/self/fd must fail (ENOENT, ESTALE or
    EIO), on open or on read; it must never read as an empty or short file."""
    d = evicting
    victim = "victim"
    data = content(victim, 6 * MiB)
    write_uncached(d / victim, data)
    opath = os.open(d / victim, os.O_PATH)
    try:
        evict(d, victim)
        assert not (d / victim).exists()
        with pytest.raises(FileNotFoundError):
            os.stat(d / victim)
        try:
            size = f"size {os.fstat(opath).st_size}"
        except OSError as e:  # not asserted: any answer of fstat is acceptable
            size = errno.errorcode.get(e.errno or 0, str(e))
        got = read_or_errno(Path(f"/proc/self/fd/{opath}"))
        check_gone(got, data, f"open of the O_PATH fd (fstat: {size})")
    finally:
        os.close(opath)


def test_evicted_file_never_reappears_through_an_older_listing(evicting: Path) -> None:
    """A directory handle opened before the eviction, read (rewound) after it, must not
    bring the evicted name back: opening the file by name must then be ENOENT (the
    listing itself may show the old name, POSIX allows that), never an empty file."""
    d = evicting
    victim = "victim"
    data = content(victim, 6 * MiB)
    write_uncached(d / victim, data)
    opath = os.open(d / victim, os.O_PATH)  # the kernel keeps the inode
    dirfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)  # listing handle before eviction
    try:
        evict(d, victim)
        os.listdir(dirfd)  # rewinds and reads that handle again
        got = read_or_errno(d / victim)
        check_gone(got, data, "open by name after an older listing")
    finally:
        os.close(dirfd)
        os.close(opath)


def test_evicted_file_with_a_cached_dentry_opens_as_enoent(evicting: Path) -> None:
    """A stat caches the dentry and attributes (5 s); eviction then takes the file.
    Opening by name right after must be ENOENT, never the empty remains."""
    d = evicting
    victim = "victim"
    data = content(victim, 6 * MiB)
    write_uncached(d / victim, data)
    assert os.stat(d / victim).st_size == len(data)  # a cached dentry
    evict(d, victim)
    check_gone(read_or_errno(d / victim), data, "open by name after eviction")


# ============================================================ 5. writer killed mid-write
CHUNK = 32 * MiB
PARTIAL = 10 * MiB
CHILD = r"""
import mmap, os, random, sys
path, seed, mode, upto, then, between = sys.argv[1:7]
upto = int(upto)
data = random.Random(repr(seed)).randbytes(int(sys.argv[7]))
direct = mode == "direct"
flags = os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if direct else os.O_TRUNC)
fd = os.open(path, flags, 0o644)
buf = mmap.mmap(-1, 1 << 20)
for off in range(0, upto, 1 << 20):
    piece = data[off : off + (1 << 20)]
    if direct:
        buf[:] = piece
        n = os.write(fd, buf)
    else:
        n = os.write(fd, piece)
    assert n == len(piece), n
if between == "fsync":
    os.fsync(fd)
elif between == "fork":  # the child closes its copy of fd at exec: a FLUSH, no writer's close
    import subprocess
    subprocess.run(["true"], check=True)
sys.stdout.write("ready\n")
sys.stdout.flush()
if then == "block":
    sys.stdin.read()
os._exit(0)
"""


def run_child(
    path: Path, mode: str, upto: int, then: str, between: str = "nothing"
) -> subprocess.Popen[bytes]:
    """A writer process; returns once it has written ``upto`` bytes and done
    ``between`` (``fsync``, or ``fork``: spawn a child), or exited."""
    args = [str(path), path.name, mode, str(upto), then, between, str(CHUNK)]
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line != b"ready\n":
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"writer failed: {err.decode(errors='replace')}")
    return proc


@pytest.mark.parametrize(
    ("restart", "between"),
    [
        ("remount-then-crash", "nothing"),
        ("crash", "nothing"),
        ("remount-then-crash", "fork"),
        ("crash", "fsync"),
    ],
)
@pytest.mark.parametrize("mode", ["buffered", "direct"])
def test_writer_killed_mid_write_leaves_no_short_file(
    kvfs_mount: KvfsMount, mode: str, restart: str, between: str
) -> None:
    """A writer killed (SIGKILL) after 10 MiB of a 32 MiB chunk: the kernel's implicit
    close (FLUSH from the dying process) is no commit. Readers get ENOENT or EIO for
    ``chunk`` -- never a 10 MiB file -- right after the kill, after a clean remount,
    and after a daemon crash (kill -9 + recovery). Also when the 10 MiB were
    committed before the kill by an fsync, or by the FLUSH of a child the writer
    spawned (its close of the descriptor it inherited): that was no writer's close
    either (before, such a prefix stayed as the whole chunk)."""
    path = kvfs_mount.path / "chunk"
    proc = run_child(path, mode, PARTIAL, "block", between)
    proc.kill()
    proc.communicate(timeout=30)
    expected = content(path.name, CHUNK)
    seen = {"after the kill": read_or_errno(path)}
    if restart == "remount-then-crash":
        kvfs_mount.remount()
        seen["after a clean remount"] = read_or_errno(path)
    kvfs_mount.crash()
    seen["after a crash"] = read_or_errno(path)
    served = {
        when: describe(got, expected)
        for when, got in seen.items()
        if not (isinstance(got, int) and got in (errno.ENOENT, errno.EIO))
    }
    assert not served, f"the killed writer's partial chunk was served: {served}"


@pytest.mark.parametrize("mode", ["buffered", "direct"])
def test_writer_exiting_without_close_leaves_a_complete_file(
    kvfs_mount: KvfsMount, mode: str
) -> None:
    """Control: a writer that writes the whole chunk and exits normally without
    closing (os._exit(0): the kernel closes the fd) has committed its file."""
    path = kvfs_mount.path / "chunk"
    proc = run_child(path, mode, CHUNK, "exit")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode(errors="replace")
    expected = content(path.name, CHUNK)
    seen = {"after the exit": read_or_errno(path)}
    kvfs_mount.remount()
    seen["after a clean remount"] = read_or_errno(path)
    kvfs_mount.crash()
    seen["after a crash"] = read_or_errno(path)
    wrong = {when: describe(got, expected) for when, got in seen.items() if got != expected}
    assert not wrong, f"the complete chunk was not served exactly: {wrong}"


# ============================================================ 8. ENOSPC at close
def free_units(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize // MiB


def fill_to(d: Path, free: int, held: list[int] | None) -> None:
    """Fill the pool with files in ``d`` until exactly ``free`` MiB are free; with
    ``held``, every file stays open from its creation on (committed by fsync, its fd
    appended to ``held``), so it is never evictable."""
    i = 0
    while (left := free_units(d)) > free:
        size = 4 * MiB if left - free >= 4 else MiB
        name = f"fill-{i:03d}"
        if held is None:
            write_file(d / name, content(name, size))
        else:
            fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            held.append(fd)
            assert os.write(fd, content(name, size)) == size
            os.fsync(fd)
        i += 1
        assert i < 200, "the pool never filled"
    assert free_units(d) == free, f"{free_units(d)} MiB free, wanted {free}"


@pytest.mark.parametrize(("free", "size"), [(3, 6), (10, 12), (0, 1)])
@pytest.mark.parametrize("setup", ["engine-managed", "held-open"])
def test_close_never_enospc_after_every_write_succeeded(
    small_mount: KvfsMount, setup: str, free: int, size: int
) -> None:
    """A pool where eviction cannot help (an engine-managed directory of this live
    process, or files held open). Writing one more file in 1 MiB write() calls: either
    a write() fails with ENOSPC (the test asks nothing more then), or every write()
    succeeded and close() must then succeed and the file read back exactly."""
    d = small_mount.path / "engine"
    d.mkdir()
    held: list[int] = []
    if setup == "engine-managed":
        os.setxattr(d, "user.kvfs.policy", b"engine-managed")
    try:
        fill_to(d, free, held if setup == "held-open" else None)
        name = "last"
        data = content(name, size * MiB)
        fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        write_error: OSError | None = None
        close_error: OSError | None = None
        written = 0
        try:
            while written < len(data):
                written += os.write(fd, data[written : written + MiB])
        except OSError as e:
            write_error = e
        finally:
            try:
                os.close(fd)
            except OSError as e:
                close_error = e
        if write_error is not None:
            assert write_error.errno in (errno.ENOSPC, errno.EDQUOT), write_error
            return
        got = read_or_errno(d / name)
        assert close_error is None, (
            f"every write() of {size} MiB succeeded ({free} MiB were free), then close() "
            f"failed: {close_error!r}; the file then read as: {describe(got, data)}"
        )
        assert got == data, f"{name}: {describe(got, data)}"
    finally:
        for h in held:
            os.close(h)


# ============================================================ 9. FLUSH from forked children
PIECES = (1500, 4096, 65536, 300_000, MiB, MiB)


def read_direct(path: Path) -> bytes | int:
    """The whole file through O_DIRECT (kvfs's own bytes, not the page cache's), or
    the errno that opening or reading it failed with."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        assert e.errno is not None, e
        return e.errno
    try:
        size = os.fstat(fd).st_size
        buf = aligned(size + 4096)
        try:
            return bytes(buf[: os.preadv(fd, [buf], 0)])
        finally:
            buf.close()
    except OSError as e:
        assert e.errno is not None, e
        return e.errno
    finally:
        os.close(fd)


def test_forked_children_closing_inherited_fds_mid_write_lose_no_byte(
    small_mount: KvfsMount,
) -> None:
    """Every close() of a copy of a descriptor sends a FLUSH, so a process that spawns
    children (``subprocess`` closes the inherited descriptors before exec) makes kvfs
    commit files its other threads are still writing. Four threads write 2-6 MiB
    files in pieces of many sizes into a pool that evicts all the time (a write
    that spans two units may wait for space between them) while a fifth spawns
    ``true`` over and over; every file reads back exact through O_DIRECT, or is
    gone. Before the fix 3-6 of ~200 files per 30 s held zeros from the end of file
    the commit saw to the end of that unit."""
    d = small_mount.path / "d"
    d.mkdir()
    stop = threading.Event()
    bad: list[str] = []
    counts = {"files": 0, "exact": 0, "spawned": 0}

    def writer(t: int) -> None:
        rng = random.Random(t)
        while not stop.is_set():
            counts["files"] += 1
            name = f"f{t}-{counts['files']}"
            data = content(name, rng.randrange(2 * MiB, 6 * MiB))
            fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view[: rng.choice(PIECES)]) :]
            finally:
                os.close(fd)
            got = read_direct(d / name)
            if got == data:
                counts["exact"] += 1
            elif got not in GONE:
                bad.append(f"{name}: {describe(got, data)}")
            if rng.random() < 0.5:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(d / name)

    def spawner() -> None:
        while not stop.is_set():
            subprocess.run(["true"], check=True)
            counts["spawned"] += 1

    def enough() -> bool:
        return counts["spawned"] > 100 and counts["exact"] > 20

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    threads.append(threading.Thread(target=spawner))
    for t in threads:
        t.start()
    # at least 10 s, and until enough ran (a loaded machine is slower): a workload
    # measured by what it did, not by the clock; 240 s is only a hang guard
    start = time.monotonic()
    while time.monotonic() - start < 240 and (time.monotonic() - start < 10 or not enough()):
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join()
    assert enough(), counts
    assert not bad, f"{len(bad)} of {counts['files']} files read back wrong: {bad[:5]}"


# ============================================================ kvfs umount of a dead mount
def test_umount_cleans_up_a_dead_mount(tmp_path: Path) -> None:
    """kill -9 of the daemon leaves a dead mount (ENOTCONN); ``kvfs umount`` must
    still remove it and exit 0."""
    require_fuse()
    img = harness.make_image(tmp_path / "pool.img", 64 * MiB)
    mnt = tmp_path / "mnt"
    with harness.mounted(mnt, [img], "--format", "--meta-size", "8M") as proc:
        write_file(mnt / "f", content("f"))
        proc.kill()
        proc.wait(30)
        with pytest.raises(OSError) as dead:
            os.statvfs(mnt)  # always asks the daemon (a stat may be answered from cache)
        assert dead.value.errno == errno.ENOTCONN
        t0 = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "kvfs", "umount", str(mnt)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        still_mounted = harness.is_mounted(mnt)
        took = time.monotonic() - t0
    assert r.returncode == 0 and not still_mounted, (
        f"kvfs umount of a dead mount exited {r.returncode} after {took:.1f} s "
        f"({r.stderr.strip()!r}); still in /proc/self/mounts: {still_mounted}"
    )
