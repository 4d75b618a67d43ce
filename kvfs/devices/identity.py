"""What a device path *is*, whatever name it was given, and who holds it.

An image file and every loop device over it are the same bytes, so a pool member is
known by what backs it, not by its path. :func:`resolve` follows a bound loop device
down to its backing file (``/sys/dev/block/M:m/loop/backing_file``, recursively for a
loop over a loop); the last layer is the member's :func:`identity`: ``(st_dev, st_ino)``
of an image file, ``st_rdev`` of any other block device. :func:`loops_over` finds the
bound loop devices stacked on a chain (``LOOP_GET_STATUS64`` on each, which names the
backing file by device and inode without touching its filesystem). :func:`holder`
says, for an error message, who holds a lock on one of them (``/proc/locks``,
``/proc/<pid>/{cmdline,cwd,fd,fdinfo}``, ``/proc/self/mountinfo``).

Nothing here locks or writes; only :func:`loops_over` opens anything (loop devices,
read-only, never exclusively, closed at once). Every lookup is best effort: a file
that cannot be read means "unknown", never an exception.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass

LOOP_GET_STATUS64 = 0x4C05
"""linux/loop.h; fills ``struct loop_info64`` (232 bytes), which starts with the
backing file's ``lo_device`` and ``lo_inode`` (u64 each, st_dev encoding)."""
_LOOP_INFO64_SIZE = 232
_MAX_DEPTH = 8  # loop over loop over ...: deeper than any real stack

log = logging.getLogger(__name__)

Key = tuple[str, int, int]
"""``("file", st_dev, st_ino)`` or ``("blk", st_rdev, 0)``: equal keys, same bytes."""


@dataclass(frozen=True)
class Layer:
    """One name in a chain: the member as given, or what backs the layer above it."""

    path: str
    st: os.stat_result

    @property
    def node(self) -> tuple[int, int]:
        """(st_dev, st_ino) of the path itself: what flock and ``/proc/locks`` see."""
        return self.st.st_dev, self.st.st_ino

    @property
    def is_block(self) -> bool:
        return stat.S_ISBLK(self.st.st_mode)

    @property
    def key(self) -> Key:
        if self.is_block:
            return ("blk", self.st.st_rdev, 0)
        return ("file", self.st.st_dev, self.st.st_ino)


def resolve(path: str) -> list[Layer]:
    """``path``, then what backs it while it is a bound loop device, down to the
    bytes. Raises OSError only for ``path`` itself; a backing file that cannot be
    reached by the name the kernel gives ends the chain early."""
    layers = [Layer(path, os.stat(path))]
    while layers[-1].is_block and len(layers) < _MAX_DEPTH:
        backing = loop_backing(layers[-1].st.st_rdev)
        if backing is None:
            break
        try:
            layers.append(Layer(backing, os.stat(backing)))
        except OSError:
            break
    return layers


def identity(path: str) -> Key:
    """The key of the bytes behind ``path`` (OSError if ``path`` cannot be stat'ed)."""
    return resolve(path)[-1].key


def loop_backing(rdev: int) -> str | None:
    """The backing file of a bound loop device, as the kernel names it; None for an
    unbound loop device or any other block device."""
    sysfs = f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}/loop/backing_file"
    try:
        with open(sysfs) as f:
            name = f.read().rstrip("\n")
    except OSError:
        return None
    return name or None  # " (deleted)" suffix: stat fails and the chain ends


def loop_backing_node(fd: int) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the file an open loop device is bound to, or None."""
    try:
        info = fcntl.ioctl(fd, LOOP_GET_STATUS64, bytes(_LOOP_INFO64_SIZE))
    except OSError:
        return None
    device, inode = struct.unpack_from("QQ", info)
    return device, inode


def _bound_loops() -> list[str]:
    try:
        names = sorted(os.listdir("/sys/block"))
    except OSError:
        return []
    return [f"/dev/{n}" for n in names if n.startswith("loop") and _is_bound(n)]


def _is_bound(name: str) -> bool:
    return os.path.exists(f"/sys/block/{name}/loop")


def _scan_loops(devices: list[str], out: list[tuple[Layer, tuple[int, int]]]) -> None:
    for dev in devices:
        try:
            st = os.stat(dev)
            fd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            backing = loop_backing_node(fd)
        finally:
            os.close(fd)
        if backing is not None:
            out.append((Layer(dev, st), backing))


def loops_over(chain: list[Layer], timeout: float = 5.0) -> list[Layer]:
    """Bound loop devices, not in ``chain``, whose bytes are some layer of it: a loop
    over the member, over what backs it, or over one of those loops.

    The kernel answers ``LOOP_GET_STATUS64`` with a getattr on the backing file, which
    hangs while that file's filesystem hangs (a dead FUSE server): the scan runs in a
    thread, and loops it has not answered for after ``timeout`` are left out."""
    keys = {layer.key for layer in chain}
    answers: list[tuple[Layer, tuple[int, int]]] = []
    scan = threading.Thread(
        target=_scan_loops, args=(_bound_loops(), answers), name="kvfs-loop-scan", daemon=True
    )
    scan.start()
    scan.join(timeout)
    if scan.is_alive():
        log.warning("some loop devices did not say what backs them within %.0f s", timeout)
    pending = [(layer, backing) for layer, backing in list(answers) if layer.key not in keys]
    nodes = {layer.node for layer in chain}
    found: list[Layer] = []
    grew = True
    while grew:  # a loop over a loop over the member: repeat until nothing is added
        grew = False
        for layer, backing in list(pending):
            if backing in nodes:
                found.append(layer)
                nodes.add(layer.node)
                pending.remove((layer, backing))
                grew = True
    return found


# ------------------------------------------------------------------------- holders
@dataclass(frozen=True)
class Holder:
    """Who holds a device, for a message: ``a kvfs mount at /mnt, pid 42, through
    /dev/loop3`` (``through``: the name the holder opened it by, if another one)."""

    what: str
    pid: int | None = None
    through: str | None = None
    kvfs: bool = False

    def __str__(self) -> str:
        parts = [self.what]
        if self.pid is not None:
            parts.append(f"pid {self.pid}")
        if self.through:
            parts.append(f"through {self.through}")
        return ", ".join(parts)


def holder(path: str, layers: Iterable[Layer]) -> Holder | None:
    """Who holds one of ``layers`` (the names of ``path``'s bytes): a process with an
    flock on one of them, else a filesystem mounted on one of them; None if unknown."""
    layers = list(layers)
    names = {os.path.realpath(layer.path) for layer in layers}
    for pid in _flock_pids({layer.node for layer in layers}):
        through = _name_used(pid, names)
        if through == os.path.realpath(path):
            through = None
        what, is_kvfs = _describe(pid)
        return Holder(what, pid, through, is_kvfs)
    blocks = {layer.st.st_rdev: layer.path for layer in layers if layer.is_block}
    for rdev, fstype, point in _mounts():
        if rdev in blocks:
            through = blocks[rdev] if blocks[rdev] != path else None
            return Holder(f"{fstype} mounted at {point}", None, through)
    return None


def _flock_pids(nodes: set[tuple[int, int]]) -> list[int]:
    """Processes other than this one holding an flock on one of ``nodes``."""
    wanted = {(os.major(d), os.minor(d), i) for d, i in nodes}
    pids = []
    try:
        with open("/proc/locks") as f:
            lines = f.readlines()
    except OSError:
        return []
    for line in lines:
        # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:2147906 0 EOF"; waiters have "->"
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            major, minor, ino = fields[5].split(":")
            where = (int(major, 16), int(minor, 16), int(ino))
            pid = int(fields[4])
        except ValueError:
            continue
        if where in wanted and pid != os.getpid() and pid not in pids:
            pids.append(pid)
    return pids


def _name_used(pid: int, names: set[str]) -> str | None:
    """The one of ``names`` that ``pid`` has open read-write (kvfs opens a member
    read-write, what it only locks read-only). Compared by name, never by stat: a
    stat of another process's files may hang on a filesystem that does not answer."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return None
    for fd in fds:
        with contextlib.suppress(OSError, ValueError):
            name = os.readlink(f"{fd_dir}/{fd}")
            if name in names and _read_write(pid, fd):
                return name
    return None


def _read_write(pid: int, fd: str) -> bool:
    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("flags:"):
                return int(line.split()[1], 8) & os.O_ACCMODE == os.O_RDWR
    return False


def _describe(pid: int) -> tuple[str, bool]:
    """``("a kvfs mount at /mnt", True)``, ``("kvfs fsck", True)``, ``("qemu", False)``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "a process", False
    at = next((i for i, a in enumerate(argv[:3]) if os.path.basename(a) == "kvfs"), None)
    if at is None:
        return (os.path.basename(argv[0]) if argv else "a process"), False
    command = next((a for a in argv[at + 1 :] if not a.startswith("-")), "")
    if command != "mount":
        return f"kvfs {command}".strip(), True
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return "a kvfs mount", True
    points = {point for _, fstype, point in _mounts() if fstype == "fuse.kvfs"}
    for arg in argv[at + 1 :]:
        if os.path.normpath(os.path.join(cwd, arg)) in points:
            return f"a kvfs mount at {os.path.normpath(os.path.join(cwd, arg))}", True
    return "a kvfs mount", True  # still starting, or in another mount namespace


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal: ``\\040``."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _mounts() -> list[tuple[int, str, str]]:
    """(st_dev of the mounted filesystem, type, mount point) from mountinfo."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.readlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        try:
            major, minor = fields[2].split(":")
            fstype = fields[fields.index("-") + 1]
        except (IndexError, ValueError):
            continue
        out.append((os.makedev(int(major), int(minor)), fstype, _unescape(fields[4])))
    return out


__all__ = [
    "Holder",
    "Key",
    "Layer",
    "holder",
    "identity",
    "loop_backing",
    "loop_backing_node",
    "loops_over",
    "resolve",
]
