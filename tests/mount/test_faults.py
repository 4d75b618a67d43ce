"""Device faults under a real mount.

This kernel has no device-mapper (``/dev/mapper/control`` answers ENODEV, no
``modprobe``), so dm-error / dm-delay cannot be used. Faults are injected one level
lower instead, just as really: kvfs's devices are image files on *faultfs*, a tiny
pass-through FUSE filesystem (this file run as a script) whose answers for one image
can be switched, while mounted, to EIO or to hanging forever (a dead NVMe queue).
faultfs opens the backing files with ``direct_io``, so every kvfs device request
reaches it (no page cache in between).

Store-level checks of the metadata log under the same faults use ``FaultyDevice``.
Also here: a missing device (refused, or ``--degraded``), a device already in use, and
bad mountpoints.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from tests.conftest import read_or_errno
from tests.conftest import write_file as write

MiB = 1 << 20
FAULT_XATTR = "user.fault"
T = TypeVar("T")


# =============================================================================== faultfs
def faultfs_main(backing: str, mountpoint: str) -> None:
    import pyfuse3
    import trio

    names = sorted(n.encode() for n in os.listdir(backing))
    inos = {name: i + 2 for i, name in enumerate(names)}
    by_ino = {i: n for n, i in inos.items()}
    faults: dict[bytes, dict[str, str]] = {}
    release = [trio.Event()]
    fhs: dict[int, tuple[int, bytes]] = {}

    class FaultFS(pyfuse3.Operations):  # type: ignore[misc]
        def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
            a = pyfuse3.EntryAttributes()
            if ino == pyfuse3.ROOT_INODE:
                a.st_mode, a.st_nlink, a.st_size = stat.S_IFDIR | 0o755, 2, 0
            else:
                st = os.stat(os.path.join(backing, by_ino[ino].decode()))
                a.st_mode, a.st_nlink, a.st_size = stat.S_IFREG | 0o644, 1, st.st_size
                a.st_mtime_ns = st.st_mtime_ns
            a.st_ino = ino
            a.entry_timeout = a.attr_timeout = 0
            return a

        async def lookup(self, parent: int, name: bytes, ctx: object = None) -> object:
            if parent != pyfuse3.ROOT_INODE or name not in inos:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._attr(inos[name])

        async def getattr(self, ino: int, ctx: object = None) -> object:
            return self._attr(ino)

        async def setattr(
            self, ino: int, attr: object, fields: object, fh: object, ctx: object
        ) -> object:
            return self._attr(ino)

        async def opendir(self, ino: int, ctx: object) -> int:
            return ino

        async def readdir(self, fh: int, start: int, token: pyfuse3.ReaddirToken) -> None:
            for i, name in enumerate(names[start:], start):
                if not pyfuse3.readdir_reply(token, name, self._attr(inos[name]), i + 1):
                    return

        async def open(self, ino: int, flags: int, ctx: object) -> object:
            fd = os.open(os.path.join(backing, by_ino[ino].decode()), os.O_RDWR)
            fhs[fd] = (fd, by_ino[ino])
            return pyfuse3.FileInfo(fh=fd, direct_io=True)

        async def _gate(self, fh: int, kind: str) -> None:
            mode = faults.get(fhs[fh][1], {}).get(kind)
            if mode == "eio":
                raise pyfuse3.FUSEError(errno.EIO)
            if mode == "hang":
                await release[0].wait()

        async def read(self, fh: int, off: int, size: int) -> bytes:
            await self._gate(fh, "read")
            return os.pread(fh, size, off)

        async def write(self, fh: int, off: int, buf: bytes) -> int:
            await self._gate(fh, "write")
            return os.pwrite(fh, buf, off)

        async def flush(self, fh: int) -> None:
            pass

        async def fsync(self, fh: int, datasync: bool) -> None:
            await self._gate(fh, "flush")
            os.fdatasync(fh)

        async def release(self, fh: int) -> None:
            fhs.pop(fh, None)
            os.close(fh)

        async def setxattr(self, ino: int, name: bytes, value: bytes, ctx: object) -> None:
            if name != FAULT_XATTR.encode():
                raise pyfuse3.FUSEError(errno.ENOTSUP)
            faults.clear()
            faults.update({k.encode(): v for k, v in json.loads(value).items()})
            release[0].set()  # wake whatever hung under the previous setting
            release[0] = trio.Event()

        async def getxattr(self, ino: int, name: bytes, ctx: object) -> bytes:
            return json.dumps({k.decode(): v for k, v in faults.items()}).encode()

        async def statfs(self, ctx: object) -> object:
            s = pyfuse3.StatvfsData()
            s.f_bsize = s.f_frsize = 4096
            return s

    pyfuse3.init(FaultFS(), mountpoint, {"fsname=faultfs", "allow_other"})
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)


# =============================================================================== helpers
KVFS = [sys.executable, "-m", "kvfs"]


def kvfs(*args: object, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVFS, *map(str, args)], capture_output=True, text=True, timeout=timeout)


class FaultFS:
    def __init__(self, path: Path) -> None:
        self.path = path

    def set(self, **faults: dict[str, str]) -> None:
        """set(**{"d1.img": {"read": "eio"}}); set() clears every fault."""
        os.setxattr(self.path, FAULT_XATTR, json.dumps(faults).encode())


@contextmanager
def faultfs(tmp_path: Path, sizes: dict[str, int]) -> Iterator[FaultFS]:
    from kvfs.testing import harness

    backing, mnt = tmp_path / "backing", tmp_path / "ffs"
    backing.mkdir()
    mnt.mkdir()
    for name, size in sizes.items():
        harness.make_image(backing / name, size)
    proc = subprocess.Popen(  # as a module from the repository root: it imports tests.conftest
        [sys.executable, "-m", __name__, "faultfs", str(backing), str(mnt)],
        stderr=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        deadline = time.monotonic() + 90  # python start-up on a loaded machine
        while not harness.is_mounted(mnt):
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "faultfs did not mount"
            time.sleep(0.02)
        yield FaultFS(mnt)
    finally:
        if harness.is_mounted(mnt):
            with contextlib.suppress(OSError):
                FaultFS(mnt).set()  # release anything still hanging
        harness.unmount(mnt)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if harness.is_mounted(mnt):  # it mounted after all, then died: no mount left behind
            harness.unmount(mnt)
        if proc.stderr:
            proc.stderr.close()


def device_of(devices: list[Path]) -> dict[str, set[int]]:
    """name -> devices holding its units (offline, from the index)."""
    from kvfs.cli.offline import offline_index
    from kvfs.format.records import DEV_SHIFT, NO_UNIT
    from kvfs.index.namespace import ROOT_INO

    ns, _ = offline_index([str(d) for d in devices])
    root = ns.inodes[ROOT_INO].entries
    assert root is not None
    return {
        n.decode(): {u >> DEV_SHIFT for u in ns.inodes[i].units if u != NO_UNIT}
        for n, i in root.items()
    }


def data(i: int, size: int) -> bytes:
    import random

    return random.Random(i).randbytes(size)


def populate(mnt: Path, n: int = 8, size: int = 3 * MiB + 5) -> dict[str, bytes]:
    files = {f"f{i}": data(i, size) for i in range(n)}
    for name, content in files.items():
        write(mnt / name, content)
    return files


def timed(fn: Callable[..., T], *args: object) -> tuple[T, float]:
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


# =============================================================================== tests
def test_eio_device_fails_its_files_only(tmp_path: Path) -> None:
    from kvfs.testing import harness
    from tests.conftest import require_fuse

    require_fuse()
    with faultfs(tmp_path, {"d0.img": 128 * MiB, "d1.img": 128 * MiB}) as ffs:
        devs = [ffs.path / "d0.img", ffs.path / "d1.img"]
        mnt, log = tmp_path / "mnt", tmp_path / "kvfs.log"
        with harness.mounted(mnt, devs, "--format", "--meta-size", "8M", log_file=log):
            files = populate(mnt)
        where = device_of(devs)
        on1 = sorted(n for n in files if where[n] == {1})
        on0 = sorted(n for n in files if where[n] == {0})
        assert on0 and on1, where
        with harness.mounted(mnt, devs, log_file=log) as proc:  # fresh caches
            ffs.set(**{"d1.img": {"read": "eio", "write": "eio", "flush": "eio"}})
            for name in on1:
                got, took = timed(read_or_errno, mnt / name)
                assert got == errno.EIO, f"{name}: {got!r:.60}"
                assert took < 20  # at once, not after a deadline (a loaded machine is slow)
            for name in on0:
                assert read_or_errno(mnt / name) == files[name]
            assert sorted(os.listdir(mnt)) == sorted(files)  # nothing quarantined
            # writes: a file placed on the failing device fails at close; the device is
            # then taken offline and new files land on the healthy one
            failed = 0
            for i in range(4):
                try:
                    write(mnt / f"new{i}", data(100 + i, 2 * MiB))
                except OSError as e:
                    assert e.errno == errno.EIO
                    failed += 1
            assert failed >= 1
            later = data(200, 20 * MiB)
            write(mnt / "later", later)
            assert read_or_errno(mnt / "later") == later
            stats = json.loads(kvfs("stats", "--json", mnt).stdout)
            errors = {d["path"]: d["errors"] for d in stats["devices"]}
            assert errors[str(devs[1])] > 0 and errors[str(devs[0])] == 0, errors
            assert stats["store"]["corruptions"] == 0
            assert proc.poll() is None
            # the fault goes away: the very same files read fine again
            ffs.set()
            for name in on1:
                assert read_or_errno(mnt / name) == files[name]
        text = log.read_text()
        assert "device " in text and "failed a write" in text, text[-2000:]
        assert "Traceback" not in text


def test_hanging_device_times_out_and_the_mount_stays_responsive(tmp_path: Path) -> None:
    from kvfs.testing import harness
    from tests.conftest import require_fuse

    require_fuse()
    with faultfs(tmp_path, {"d0.img": 128 * MiB, "d1.img": 128 * MiB}) as ffs:
        devs = [ffs.path / "d0.img", ffs.path / "d1.img"]
        mnt, log = tmp_path / "mnt", tmp_path / "kvfs.log"
        with harness.mounted(mnt, devs, "--format", "--meta-size", "8M", log_file=log):
            files = populate(mnt)
        where = device_of(devs)
        on1 = sorted(n for n in files if where[n] == {1})
        on0 = sorted(n for n in files if where[n] == {0})
        # a deadline far above what a loaded machine takes to answer anything else,
        # so that "at once" and "after the deadline" cannot be confused
        with harness.mounted(mnt, devs, "--io-timeout", "10", log_file=log) as proc:
            ffs.set(**{"d1.img": {"read": "hang"}})
            result: dict[str, object] = {}

            def hung_read() -> None:
                result["got"], result["took"] = timed(read_or_errno, mnt / on1[0])

            t = threading.Thread(target=hung_read)
            t.start()
            time.sleep(0.3)
            # while that read hangs on the device, everything else answers at once
            _, took = timed(os.listdir, mnt)
            assert took < 5
            _, took = timed(os.stat, mnt / on1[1])
            assert took < 5
            got, took = timed(read_or_errno, mnt / on0[0])
            assert got == files[on0[0]] and took < 5
            t.join(60)
            assert not t.is_alive(), "a read of a hung device never returned"
            assert result["got"] == errno.EIO
            assert 7.5 < result["took"] < 40, result["took"]  # type: ignore[operator]
            assert proc.poll() is None
            ffs.set()  # the device comes back
            assert read_or_errno(mnt / on1[0]) == files[on1[0]]
        text = log.read_text()
        assert "missed its 10 s deadline" in text, text[-2000:]


def test_hanging_metadata_device_fails_commits_within_the_deadline(tmp_path: Path) -> None:
    """Device 0 holds the journal: if it hangs, close() (which waits for the journal)
    must still answer, with EIO, within about the I/O deadline, and the mount must keep
    answering lookups and reads of cached data."""
    from kvfs.testing import harness
    from tests.conftest import require_fuse

    require_fuse()
    with faultfs(tmp_path, {"d0.img": 128 * MiB}) as ffs:
        devs = [ffs.path / "d0.img"]
        mnt, log = tmp_path / "mnt", tmp_path / "kvfs.log"
        with harness.mounted(
            mnt, devs, "--format", "--meta-size", "8M", "--io-timeout", "10", log_file=log
        ) as proc:
            files = populate(mnt, 2)
            ffs.set(**{"d0.img": {"write": "hang", "flush": "hang"}})
            result: dict[str, object] = {}

            def commit() -> None:
                try:
                    # an empty file: its close waits for the journal alone
                    result["out"], result["took"] = timed(write, mnt / "late", b"")
                except OSError as e:
                    result["out"] = e.errno

            t = threading.Thread(target=commit)
            t0 = time.monotonic()
            t.start()
            time.sleep(0.3)
            _, took = timed(os.stat, mnt / "f0")
            assert took < 5
            t.join(60)
            hung = t.is_alive()
            ffs.set()  # release the device so the test can clean up either way
            t.join(30)
            assert not hung, (
                f"close() on a hung metadata device did not return within 60 s "
                f"(returned after {time.monotonic() - t0:.1f} s once the device came back)"
            )
            assert result["out"] == errno.EIO, result
            assert proc.poll() is None
            assert read_or_errno(mnt / "f1") == files["f1"]


def test_a_stat_is_answered_while_a_checkpoint_is_in_progress(tmp_path: Path) -> None:
    """A checkpoint started (user.kvfs.checkpoint) while the metadata device's writes
    hang cannot finish; meanwhile the mount answers stats, lookups and its statistics,
    which show the checkpoint in progress. Once the device answers it completes."""
    from kvfs.testing import harness
    from tests.conftest import errno_of, require_fuse, wait_for

    require_fuse()
    with faultfs(tmp_path, {"d0.img": 128 * MiB}) as ffs:
        devs = [ffs.path / "d0.img"]
        mnt, log = tmp_path / "mnt", tmp_path / "kvfs.log"
        with harness.mounted(
            mnt, devs, "--format", "--meta-size", "8M", "--io-timeout", "30", log_file=log
        ) as proc:
            files = populate(mnt, 3, 100_000)

            def journal() -> dict[str, Any]:
                stats = json.loads(os.getxattr(mnt, "user.kvfs.stats"))
                out: dict[str, Any] = stats["journal"]
                return out

            before = journal()
            ffs.set(**{"d0.img": {"write": "hang"}})
            os.setxattr(mnt, "user.kvfs.checkpoint", b"1")  # returns at once
            wait_for(lambda: journal()["checkpointing"], what="the checkpoint to start")
            # its write hangs, so it is still in progress while these are answered
            assert os.stat(mnt / "f1").st_size == 100_000
            assert errno_of(os.stat, mnt / "not-there") == errno.ENOENT
            assert sorted(os.listdir(mnt)) == ["f0", "f1", "f2"]
            now = journal()
            assert now["checkpointing"] and now["checkpoints"] == before["checkpoints"]
            assert now["generation"] == before["generation"]
            ffs.set()
            wait_for(
                lambda: (
                    not journal()["checkpointing"]
                    and journal()["checkpoints"] == before["checkpoints"] + 1
                ),
                what="the checkpoint to complete",
            )
            assert journal()["generation"] == before["generation"] + 1
            for name, content in files.items():
                assert read_or_errno(mnt / name) == content
            assert proc.poll() is None


def test_missing_device_refused_unless_degraded(tmp_path: Path) -> None:
    from kvfs.testing import harness
    from tests.conftest import require_fuse

    require_fuse()
    devs = [harness.make_image(tmp_path / f"d{i}.img", 128 * MiB) for i in range(2)]
    mnt, log = tmp_path / "mnt", tmp_path / "kvfs.log"
    with harness.mounted(mnt, devs, "--format", "--meta-size", "8M", log_file=log):
        files = populate(mnt)
    where = device_of(devs)
    lost = sorted(n for n in files if 1 in where[n])
    kept = sorted(n for n in files if where[n] == {0})
    assert lost and kept
    devs[1].rename(tmp_path / "away.img")  # device 2 unplugged
    r = kvfs("mount", "--foreground", mnt, devs[0])
    assert r.returncode == 2, r.stderr
    assert "has 2 devices; member 2 is missing" in r.stderr and "--degraded" in r.stderr
    assert not harness.is_mounted(mnt)
    r = kvfs("mount", "--foreground", mnt, devs[0], devs[1])
    assert r.returncode == 2 and "no such device or image file" in r.stderr, r.stderr
    # dropped on request (kept as unreadable by default: tests/mount/test_degraded.py)
    with harness.mounted(mnt, [devs[0]], "--degraded", "--drop-unreadable", log_file=log):
        assert sorted(os.listdir(mnt)) == kept
        for name in kept:
            assert read_or_errno(mnt / name) == files[name]
        big = data(300, 24 * MiB)  # new data avoids the missing device
        write(mnt / "big", big)
        assert read_or_errno(mnt / "big") == big
    text = log.read_text()
    assert f"degraded: {len(lost)} file(s)" in text, text[-2000:]
    for name in lost:
        assert f" {name}\n" in text  # "lost: inode N name"
    (tmp_path / "away.img").rename(devs[1])
    r = kvfs("fsck", *devs)
    assert r.returncode == 0, r.stdout + r.stderr
    with harness.mounted(mnt, devs, log_file=log):
        assert sorted(os.listdir(mnt)) == sorted([*kept, "big"])


def test_device_in_use_is_refused(tmp_path: Path) -> None:
    from kvfs.testing import harness
    from tests.conftest import loop_unavailable, require_fuse

    require_fuse()
    image = harness.make_image(tmp_path / "pool.img", 128 * MiB)
    with harness.mounted(tmp_path / "mnt", [image], "--format", "--meta-size", "8M"):
        (tmp_path / "mnt2").mkdir()
        r = kvfs("mount", "--foreground", tmp_path / "mnt2", image)
        assert r.returncode == 2, r.stderr
        assert f"{image}: already in use by another kvfs process" in r.stderr
        assert not harness.is_mounted(tmp_path / "mnt2")
    if loop_unavailable():
        return
    img2 = harness.make_image(tmp_path / "loop.img", 128 * MiB)
    with (
        harness.loop_device(img2) as dev,
        harness.mounted(tmp_path / "mnt", [dev], "--format", "--meta-size", "8M"),
    ):
        r = kvfs("mount", "--foreground", tmp_path / "mnt2", dev)
        assert r.returncode == 2, r.stderr
        assert f"{dev}: device is busy" in r.stderr, r.stderr
        assert not harness.is_mounted(tmp_path / "mnt2")


def test_bad_mountpoints_exit_2(tmp_path: Path) -> None:
    from kvfs.testing import harness
    from tests.conftest import require_fuse

    require_fuse()
    image = harness.make_image(tmp_path / "pool.img", 64 * MiB)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    for mp, msg in ((tmp_path / "nope", "does not exist"), (tmp_path / "full", "not empty")):
        r = kvfs("mount", "--foreground", mp, image, "--format")
        assert r.returncode == 2, r.stderr
        assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not any(image.read_bytes()[:4096])  # refused before formatting anything


# ------------------------------------------------------------ the journal, store level
def _journal(dev, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    from kvfs.log.journal import Journal

    return Journal(
        dev,
        4096,
        256 * 1024,
        [dev],
        lambda: iter(()),
        seed=7,
        commit_interval=0.001,
        io_timeout=timeout,
    )


async def test_journal_hang_fails_waiters_within_the_deadline() -> None:
    import pytest
    import trio

    from kvfs.common.errors import DeviceError
    from kvfs.format.records import Blob
    from kvfs.testing.devices import FaultyDevice, MemoryDevice

    dev = FaultyDevice(MemoryDevice(4096 + 256 * 1024 + 4096))
    journal = _journal(dev, timeout=0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await journal.checkpoint()
        dev.hang.set()
        seq = journal.append([Blob("k", b"v")])
        t0 = trio.current_time()
        with trio.fail_after(5), pytest.raises(DeviceError, match="deadline"):
            await journal.wait_durable(seq)
        assert trio.current_time() - t0 < 2
        dev.release.set()
        nursery.cancel_scope.cancel()


async def test_journal_is_fail_stop_after_a_failed_write() -> None:
    """After a failed journal write its batch is gone; a later successful write would
    leave a sequence gap where recovery stops, so its "durable" transactions would be
    lost. Waiters must be told (DeviceError), never falsely reassured."""
    import pytest
    import trio

    from kvfs.common.errors import DeviceError
    from kvfs.format.records import Blob, Op
    from kvfs.log.journal import ApplySink, recover
    from kvfs.testing.devices import FaultyDevice, MemoryDevice

    dev = FaultyDevice(MemoryDevice(4096 + 256 * 1024 + 4096))
    journal = _journal(dev)
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        await journal.checkpoint()
        dev.fail_writes = True
        with trio.fail_after(5), pytest.raises(DeviceError):
            await journal.wait_durable(journal.append([Blob("a", b"1")]))
        dev.fail_writes = False  # the device answers again
        seq = journal.append([Blob("b", b"2")])
        await trio.sleep(0.2)  # group commit: the flusher runs before anyone waits
        try:
            with trio.fail_after(5):
                await journal.wait_durable(seq)
            acked = True
        except DeviceError:
            acked = False
        nursery.cancel_scope.cancel()
    ops: list[Op] = []

    def keep(op: Op) -> bool:
        ops.append(op)
        return True

    recover(dev, 4096, 256 * 1024, 7, ApplySink(keep, ops.clear))
    persisted = any(isinstance(op, Blob) and op.name == "b" for op in ops)
    assert persisted or not acked, "a transaction was acknowledged durable but is not"


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "faultfs":
    faultfs_main(sys.argv[2], sys.argv[3])
