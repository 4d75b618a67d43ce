"""Run a kvfs mount in a child process and always clean it up.

Used by the real-mount tests, the benchmarks and the demo: spawn the real CLI in the
foreground, poll for the mount with a deadline (failing early if the child died), and
on exit unmount lazily, wait, then terminate and kill.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfs.index.namespace import Namespace


class MountFailed(RuntimeError):
    pass


def kvfs_command() -> list[str]:
    return [sys.executable, "-m", "kvfs"]


def is_mounted(path: str | Path) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f)


def unmount(path: str | Path) -> None:
    if is_mounted(path):
        subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True)


@contextmanager
def mounted(
    mountpoint: str | Path,
    devices: Sequence[str | Path],
    *extra: str,
    log_file: str | Path | None = None,
    timeout: float = 120.0,  # a hang guard: start-up on a loaded machine is slow
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Mount ``devices`` at ``mountpoint`` with ``kvfs mount --foreground *extra``."""
    Path(mountpoint).mkdir(parents=True, exist_ok=True)
    cmd = [*kvfs_command(), "mount", "--foreground", str(mountpoint), *map(str, devices), *extra]
    if log_file is not None:
        cmd += ["--log-file", str(log_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        wait_mounted(proc, mountpoint, timeout)
        yield proc
    finally:
        stop(proc, mountpoint)


def wait_mounted(proc: subprocess.Popen[bytes], mountpoint: str | Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not is_mounted(mountpoint):
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise MountFailed(f"kvfs exited with {proc.returncode}: {err.decode().strip()}")
        if time.monotonic() > deadline:
            raise MountFailed(f"{mountpoint} not mounted after {timeout} s")
        time.sleep(0.02)
    # the kernel has the mount; wait until INIT is answered
    os.stat(mountpoint)


def stop(proc: subprocess.Popen[bytes], mountpoint: str | Path, timeout: float = 60.0) -> int:
    """Unmount and wait for a clean exit (final checkpoint); escalate if it hangs."""
    if proc.poll() is None:
        unmount(mountpoint)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    unmount(mountpoint)
    if proc.stdout:
        proc.stdout.close()
    if proc.stderr:
        proc.stderr.close()
    return proc.returncode


def kill(proc: subprocess.Popen[bytes], mountpoint: str | Path, grace: float = 10.0) -> bool:
    """kill -9 the daemon (crash tests) and clear the dead mount. True if the daemon
    could not exit within ``grace`` s and its FUSE connection was aborted for it (a
    thread stuck in a notification: see :func:`kvfs.cli.daemon.abort_connection`)."""
    from kvfs.cli import daemon

    # its entry (the lazy unmount hides it), found without a request to the mount root
    here = Path(os.path.abspath(mountpoint))
    mount = daemon.mount_at(os.path.join(os.path.realpath(here.parent), here.name))
    proc.kill()
    try:
        proc.wait(grace)
        aborted = False
    except subprocess.TimeoutExpired:
        aborted = mount is not None and daemon.abort_connection(mount)
        proc.wait()
    unmount(mountpoint)
    return aborted


def make_image(path: str | Path, size: int) -> Path:
    """A sparse image file of ``size`` bytes (a stand-in device)."""
    p = Path(path)
    with open(p, "wb") as f:
        f.truncate(size)
    return p


@contextmanager
def loop_device(image: str | Path, direct_io: bool = False) -> Iterator[str]:
    """Attach ``image`` to a free loop device (root only); ``direct_io``: the loop
    device reads and writes its image with direct I/O (no host page cache below it,
    as benchmarks want)."""
    flags = ["--direct-io=on"] if direct_io else []
    dev = subprocess.run(
        ["losetup", "-f", "--show", *flags, str(image)], check=True, capture_output=True, text=True
    ).stdout.strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True)


def write_file(path: str | Path, data: bytes) -> None:
    """Create or truncate ``path`` and write all of ``data`` (short writes retried)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def chunk_name(i: int) -> bytes:
    """File i's name in :func:`fill_namespace`'s default: ``chunk-%08d.pt`` (14 bytes)."""
    return b"chunk-%08d.pt" % i


def lmcache_name(i: int) -> bytes:
    """File i's name as LMCache's ``local_disk`` names a chunk (``docs/engines.md`` of
    the shared docs: model with ``/`` as ``-``, world size, worker, the chunk hash as
    signed hex, dtype): ~56-60 bytes, a distinct pseudo-random hash per ``i``."""
    h = (i * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & ((1 << 64) - 1)
    signed = h - (1 << 64) if h >> 63 else h
    return b"meta-llama-Meta-Llama-3-8B@1@0@%x@bfloat16.pt" % signed


def fill_namespace(
    ns: Namespace, files: int, per_dir: int = 1000, name: Callable[[int], bytes] = chunk_name
) -> list[tuple[int, int, int]]:
    """Directories ``d00000``.. of ``per_dir`` committed one-unit files named
    ``name(i)`` (``chunk-%08d.pt``; file i maps unit i of device 0, checksum i *
    2654435761), made in bulk, with a mount's spread of times: the pools and
    namespaces of ``tools/mounttime.py``, ``nsmem.py`` and ``nsindex.py``. Returns
    (directory inode, first file inode, files) per directory."""
    import stat
    from array import array

    from kvfs.index.namespace import ROOT_INO

    out = []
    for d, first in enumerate(range(0, files, per_dir)):
        count = min(per_dir, files - first)
        dino = ns.make(ROOT_INO, b"d%05d" % d, stat.S_IFDIR | 0o755, 0, 0).ino
        ino = ns.add_files(
            dino,
            [name(i) for i in range(first, first + count)],
            stat.S_IFREG | 0o644,
            (0, 0),
            1 << 20,
            array("q", range(first, first + count)),
            array("Q", (i * 2654435761 for i in range(first, first + count))),
        )
        # as written through a mount: atime is the create, 1-51 ms before the last
        # write (mtime = ctime), so the atime column holds 4-byte distances
        ns._atime.fill(ino, array("q", (-1_000_000 - i * 7919 % 50_000_000 for i in range(count))))
        out.append((dino, ino, count))
    return out


# ---------------------------------------------------------------------- Mooncake
# A real Mooncake master (RPC + its built-in HTTP metadata server) on loopback, for the
# cluster tier's tests and benchmark (``mooncake_master`` ships in the cluster extra).
LEASE_MS = 500
"""The master's object lease in the tests (Mooncake's default is 10 s): a delete of an
object read or written less than a lease ago is refused until the lease ends."""


def master_binary() -> str | None:
    """The ``mooncake_master`` next to this interpreter, or on PATH."""
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class MooncakeMaster:
    """One ``mooncake_master`` (RPC + HTTP metadata) on fixed loopback ports, so that
    a restart comes back at the same address as a real master would."""

    def __init__(self, log: Path, lease_ms: int = LEASE_MS) -> None:
        binary = master_binary()
        if binary is None:
            raise MountFailed("mooncake_master missing: make install (the cluster extra)")
        self.binary = binary
        self.rpc_port = free_port()
        self.http_port = free_port()
        self.metrics_port = free_port()  # its default (9003) would clash between tests
        self.log = log
        self.lease_ms = lease_ms
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The ``--cluster`` value that points a kvfs mount at this master (the node
        named and announced on loopback: nothing of a test leaves 127.0.0.0/8)."""
        return (
            f"mooncake://127.0.0.1:{self.rpc_port}"
            f"?metadata=http://127.0.0.1:{self.http_port}/metadata&local=127.0.0.1"
        )

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        argv = [
            self.binary,
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
            f"--default_kv_lease_ttl={self.lease_ms}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
        ]
        out = self.log.open("ab")
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        deadline = time.monotonic() + 30
        while not (_listening(self.rpc_port) and _listening(self.http_port)):
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited {self.proc.returncode}: {self.log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not listen in 30 s: {self.log}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: the master dies as in a crash (its objects' index is lost)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None


@contextmanager
def running_master(log: Path, lease_ms: int = LEASE_MS) -> Iterator[MooncakeMaster]:
    master = MooncakeMaster(log, lease_ms)
    master.start()
    try:
        yield master
    finally:
        master.stop()
