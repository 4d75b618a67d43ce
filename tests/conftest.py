"""Fixtures of the real-mount tests: a kvfs daemon on an image file or loop devices.

Every mount is the real CLI (``kvfs mount --foreground``) in a child process, started
and always torn down by :func:`kvfs.testing.harness.mounted`. After each test the daemon's log
is checked: an ERROR line the test did not declare with
``@pytest.mark.expect_errors("regex", ...)`` (or by appending to
``mount.expect_errors``) fails the test, and so does a daemon that exited non-zero
from a clean unmount.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from kvfs.testing import harness

KVFS_FSTYPE = "fuse.kvfs"
IMAGE_SIZE = 512 << 20
LOOP_IMAGE_SIZE = 256 << 20
META_SIZE = "8M"


# ---------------------------------------------------------------------- environment
def fuse_unavailable() -> str | None:
    """Why real mounts cannot run here, or None."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no fuse kernel module in this environment)"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (apt-get install fuse3)"
    return None


def loop_unavailable() -> str | None:
    if os.geteuid() != 0:
        return f"loop devices need root (losetup); running as uid {os.geteuid()}"
    if shutil.which("losetup") is None:
        return "losetup is not installed (util-linux)"
    if not os.path.exists("/dev/loop-control"):
        return "/dev/loop-control is missing (no loop kernel module)"
    return None


def require_fuse() -> None:
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)


def kvfs_mounts() -> list[str]:
    """Mountpoints of every kvfs mount visible to this process."""
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and fields[2] == KVFS_FSTYPE:
                out.append(fields[1].replace("\\040", " "))
    return out


def _daemon_alive_and_owned(mountpoint: str) -> bool:
    """True if a kvfs daemon serving ``mountpoint`` runs under a live parent that is
    not init (a mount of a concurrently running test session)."""
    try:
        os.stat(mountpoint)
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            return False  # daemon gone: a dead mount
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(") ", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if "mount" in argv and any(os.path.abspath(a) == mountpoint for a in argv):
            return ppid > 1 and os.path.exists(f"/proc/{ppid}")
    return False


def sweep_stale_mounts(root: Path, *, everything: bool = False) -> list[str]:
    """Lazily unmount kvfs mounts under ``root`` left by crashed sessions (dead daemon
    or orphaned daemon); with ``everything``, every kvfs mount under ``root``. An
    unmounted daemon exits by itself, so no process is killed here."""
    root_s = os.path.realpath(root) + os.sep
    swept = []
    for mnt in kvfs_mounts():
        if not mnt.startswith(root_s):
            continue
        if everything or not _daemon_alive_and_owned(mnt):
            subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
            swept.append(mnt)
    return swept


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "expect_errors(*patterns): ERROR lines of the kvfs log this test expects"
    )
    config.addinivalue_line("markers", "slow: a longer real-mount test (still < 60 s)")
    config.addinivalue_line(
        "markers", "mount_options(*args): extra `kvfs mount --format` options for kvfs_mount"
    )


@pytest.fixture(scope="session", autouse=True)
def _sweep_kvfs_mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if fuse_unavailable():
        yield
        return
    base = tmp_path_factory.getbasetemp()
    sweep_stale_mounts(base.parent)  # pytest-of-<user>: earlier, crashed sessions
    yield
    sweep_stale_mounts(base, everything=True)  # whatever this session left behind


# ---------------------------------------------------------------------- the mount
class KvfsMount:
    """One kvfs pool mounted at ``path``; remountable and crashable."""

    def __init__(
        self,
        path: Path,
        devices: list[str],
        log: Path,
        expect_errors: list[str],
        extra: tuple[str, ...] = (),
    ) -> None:
        self.path = path
        self.devices = devices
        self.log = log
        self.extra = extra
        self.expect_errors = expect_errors
        self.proc: subprocess.Popen[bytes] | None = None
        self.exit_codes: list[int] = []
        self.stderr: list[str] = []
        self._stack: ExitStack | None = None

    def start(self, *extra: str) -> None:
        assert self._stack is None, "already mounted"
        stack = ExitStack()
        self.proc = stack.enter_context(
            harness.mounted(self.path, self.devices, *self.extra, *extra, log_file=self.log)
        )
        self._stack = stack

    def stop(self) -> int:
        """Clean unmount; waits for the daemon's final checkpoint."""
        assert self._stack is not None and self.proc is not None
        proc = self.proc
        try:
            if proc.poll() is None:
                harness.unmount(self.path)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(60)  # on time-out, harness.stop escalates
            if proc.poll() is not None and proc.stderr is not None:
                self.stderr.append(proc.stderr.read().decode(errors="replace"))
        finally:
            self._stack.close()
            self._stack = None
        self.exit_codes.append(proc.returncode)
        return proc.returncode

    def remount(self) -> None:
        """Clean unmount, then mount the same devices again (no --format)."""
        code = self.stop()
        assert code == 0, f"kvfs exited {code} on a clean unmount: {self.stderr[-1:]}"
        self.start()

    def crash(self) -> None:
        """kill -9 the daemon (no final checkpoint), then mount again (recovery)."""
        assert self.proc is not None and self._stack is not None
        harness.kill(self.proc, self.path)
        self._stack.close()
        self._stack = None
        self.proc = None
        self.start()

    def stats(self) -> dict[str, Any]:
        import json

        stats: dict[str, Any] = json.loads(os.getxattr(self.path, "user.kvfs.stats"))
        return stats

    @property
    def mounted(self) -> bool:
        return self._stack is not None

    def close(self) -> None:
        if self._stack is not None:
            self.stop()

    def unexpected_errors(self) -> list[str]:
        if not self.log.exists():
            return []
        pats = [re.compile(p) for p in self.expect_errors]
        bad = []
        for line in self.log.read_text(errors="replace").splitlines():
            serious = " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback")
            if serious and not any(p.search(line) for p in pats):
                bad.append(line)
        return bad


def _expected(request: pytest.FixtureRequest) -> list[str]:
    return [p for m in request.node.iter_markers("expect_errors") for p in m.args]


def _finish(mount: KvfsMount) -> None:
    """Teardown: unmount, then fail on a bad exit or unexpected ERROR log lines."""
    mount.close()
    problems = []
    bad_exits = [c for c in mount.exit_codes if c != 0]
    if bad_exits:
        problems.append(f"kvfs exited with {bad_exits} on unmount; stderr: {mount.stderr}")
    errors = mount.unexpected_errors()
    if errors:
        problems.append("unexpected ERROR lines in the kvfs log:\n  " + "\n  ".join(errors[:20]))
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.fixture
def kvfs_mount(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[KvfsMount]:
    """A fresh 512 MiB pool on a sparse image file, mounted at ``tmp_path/mnt``."""
    require_fuse()
    image = harness.make_image(tmp_path / "pool.img", IMAGE_SIZE)
    mount = KvfsMount(tmp_path / "mnt", [str(image)], tmp_path / "kvfs.log", _expected(request))
    options = [a for m in request.node.iter_markers("mount_options") for a in m.args]
    try:
        mount.start("--format", "--meta-size", META_SIZE, *options)
        yield mount
    finally:
        _finish(mount)


@pytest.fixture
def small_mount(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[KvfsMount]:
    """A 128 MiB pool (ENOSPC tests)."""
    require_fuse()
    image = harness.make_image(tmp_path / "small.img", 128 << 20)
    mount = KvfsMount(tmp_path / "mnt", [str(image)], tmp_path / "kvfs.log", _expected(request))
    try:
        mount.start("--format", "--meta-size", META_SIZE)
        yield mount
    finally:
        _finish(mount)


def _loop_mount(tmp_path: Path, request: pytest.FixtureRequest, n: int) -> Iterator[KvfsMount]:
    require_fuse()
    reason = loop_unavailable()
    if reason:
        pytest.skip(reason)
    with ExitStack() as stack:
        devices = []
        for i in range(n):
            img = harness.make_image(tmp_path / f"loop{i}.img", LOOP_IMAGE_SIZE)
            devices.append(stack.enter_context(harness.loop_device(img)))
        mount = KvfsMount(tmp_path / "mnt", devices, tmp_path / "kvfs.log", _expected(request))
        try:
            mount.start("--format", "--meta-size", META_SIZE)
            yield mount
        finally:
            _finish(mount)


@pytest.fixture
def loop_mount(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[KvfsMount]:
    """A pool on two loop devices (256 MiB each)."""
    yield from _loop_mount(tmp_path, request, 2)


@pytest.fixture
def loop_mount1(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[KvfsMount]:
    """A pool on one loop device (256 MiB)."""
    yield from _loop_mount(tmp_path, request, 1)


def pattern(seed: object, size: int) -> bytes:
    """Deterministic pseudo-random bytes for ``seed`` (every read is checked against it)."""
    import random

    return random.Random(repr(seed)).randbytes(size)


def aligned(size: int) -> Any:
    """A page-aligned buffer (anonymous mmap) for O_DIRECT I/O."""
    import mmap

    return mmap.mmap(-1, max(size, mmap.PAGESIZE))


def wait_for(predicate: Any, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll ``predicate`` until true or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def eviction_settled(stats: Any) -> None:
    """Wait until background eviction has nothing left to do: the free space (what
    the journal still has to release counted as free, as the store counts it) holds
    the headroom, so no round will run before the next write. ``stats``: a callable
    returning the mount's ``kvfs stats --json``. A test that lists a full pool and
    then reads what it listed must wait for this first: the round a last write
    started may still be evicting."""

    def idle() -> bool:
        s = stats()["store"]
        return bool(s["free_bytes"] + s["pending_free_bytes"] >= s["headroom_bytes"])

    wait_for(idle, what="background eviction to settle")


write_file = harness.write_file


def read_or_errno(path: Path) -> bytes | int:
    """The whole file, or the errno that opening or reading it failed with."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        assert e.errno is not None, e
        return e.errno
    try:
        out = b""
        while chunk := os.read(fd, 4 << 20):
            out += chunk
        return out
    except OSError as e:
        assert e.errno is not None, e
        return e.errno
    finally:
        os.close(fd)


def errno_of(fn: Callable[..., object], *args: object) -> int:
    """The errno ``fn(*args)`` fails with; the test fails if it succeeds."""
    try:
        fn(*args)
    except OSError as e:
        assert e.errno is not None, e
        return e.errno
    raise AssertionError(f"{getattr(fn, '__name__', fn)}{args} did not fail")


@pytest.fixture
def unprivileged_user() -> Iterator[pwd.struct_passwd]:
    """A throwaway unprivileged system user (no home), removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip(f"creating a user needs root; running as uid {os.geteuid()}")
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("useradd/userdel are not installed (passwd)")
    name = f"kvfs-test-{secrets.token_hex(4)}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
        timeout=60,
    )
    try:
        pw = pwd.getpwnam(name)
        assert pw.pw_uid != 0 and pw.pw_gid != 0
        yield pw
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=60)
