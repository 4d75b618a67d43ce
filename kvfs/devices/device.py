"""Block devices kvfs owns: a checked public API over raw, blocking, aligned I/O.

Every method here blocks; the async layers call them from worker threads only.
Subclasses implement ``_pread``/``_pwrite``/``_flush``/``_discard``; the base class
checks bounds and alignment and keeps byte counters, so a bug above never turns into
a write outside the device or an unaligned O_DIRECT request.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from kvfs.common.errors import DeviceError, UserError
from kvfs.common.timing import Histogram
from kvfs.devices import identity
from kvfs.format.records import ALIGN as ALIGN  # the format's block: device I/O is aligned to it

log = logging.getLogger(__name__)


# linux/fs.h ioctls
_BLKGETSIZE64 = 0x80081272
_BLKSSZGET = 0x1268
_BLKPBSZGET = 0x127B
_BLKIOOPT = 0x1279
_BLKDISCARD = 0x1277
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def aligned_buffer(size: int) -> mmap.mmap:
    """Page-aligned, zero-filled anonymous memory, usable for O_DIRECT.

    Private, not the default shared mapping: shared anonymous memory is shmem, whose
    page faults and teardown cost ~2.5x more (1.7 vs 0.66 ms per MiB mapped, filled
    and unmapped, measured on the 2-core test VM; ``docs/performance.md``)."""
    return mmap.mmap(-1, max(size, ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class BufferPool:
    """Hands out ``size``-byte aligned buffers and reuses the ones nobody holds any more.

    Used from one thread (the trio loop). Filling a warm buffer costs ~60 us per MiB
    on the test VM, a fresh mapping ~660 us (page faults and zeroing on first touch,
    unmapping at the end). Every buffer handed out stays listed here; once this list
    holds its only reference (no dict entry, no closure of a worker thread, no
    memoryview: a view and all its slices count as one reference), it is free.
    """

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self.keep = keep
        self._loaned: list[mmap.mmap] = []
        self._free: list[mmap.mmap] = []
        self._zeros = bytes(size)
        self.fresh = self.reused = 0

    def take(self, zeroed: bool = True) -> mmap.mmap:
        """A buffer, zero-filled unless ``zeroed`` is false (the caller overwrites all
        of it before anything else can see it)."""
        if not self._free:
            self.reap()
        if self._free:
            buf = self._free.pop()
            self.reused += 1
            if zeroed:
                buf[:] = self._zeros
        else:
            buf = aligned_buffer(self.size)
            self.fresh += 1
        self._loaned.append(buf)
        return buf

    def reap(self) -> None:
        """Move buffers that only this pool still references to the free list (up to
        ``keep`` of them; the rest are unmapped)."""
        loaned, self._loaned = self._loaned, []
        for i in range(len(loaned)):
            # 2 = the list slot + getrefcount's argument: nothing else can see it
            if sys.getrefcount(loaned[i]) > 2:
                self._loaned.append(loaned[i])
            elif len(self._free) < self.keep:
                self._free.append(loaned[i])


DEVICE_OPS = ("read", "write", "flush")
"""The requests whose latency a device keeps."""


@dataclass(frozen=True)
class DeviceStatistics:
    path: str
    size: int
    reads: int
    writes: int
    bytes_read: int
    bytes_written: int
    discards: int
    errors: int


class Device(ABC):
    """A fixed-size, aligned, blocking byte store."""

    def __init__(self, path: str, size: int, logical_block: int, optimal_io: int) -> None:
        self.path = path
        self.size = size
        self.logical_block = logical_block
        self.optimal_io = optimal_io
        self._lock = threading.Lock()
        self._reads = self._writes = self._bytes_read = self._bytes_written = 0
        self._discards = self._errors = 0
        self._latency = {op: Histogram() for op in DEVICE_OPS}

    def _check(self, offset: int, length: int) -> None:
        if offset % ALIGN or length % ALIGN:
            raise ValueError(f"unaligned device request {offset}+{length}")
        if offset < 0 or offset + length > self.size:
            raise ValueError(f"device request {offset}+{length} outside {self.path}")

    def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from ``offset``; a short or failed read raises DeviceError."""
        self.read_vec(offset, [buf])

    def read_vec(self, offset: int, bufs: Sequence[memoryview]) -> None:
        """Fill the buffers back to back from ``offset`` (one request where the device
        allows); a short or failed read raises DeviceError."""
        length = sum(len(b) for b in bufs)
        self._check(offset, length)
        start = time.perf_counter()
        try:
            got = self._preadv(offset, bufs)
        except OSError as e:
            self._count_error()
            raise DeviceError(f"{self.path}: read at {offset}: {e.strerror}") from e
        if got != length:
            self._count_error()
            raise DeviceError(f"{self.path}: short read at {offset} ({got}/{length})")
        elapsed = time.perf_counter() - start
        with self._lock:
            self._reads += 1
            self._bytes_read += got
            self._latency["read"].observe(elapsed)

    def write(self, offset: int, bufs: Sequence[memoryview]) -> None:
        """Write the buffers back to back from ``offset``; all or DeviceError."""
        length = sum(len(b) for b in bufs)
        self._check(offset, length)
        for b in bufs:
            if len(b) % ALIGN:
                raise ValueError("unaligned buffer length")
        start = time.perf_counter()
        try:
            done = self._pwrite(offset, bufs)
        except OSError as e:
            self._count_error()
            raise DeviceError(f"{self.path}: write at {offset}: {e.strerror}") from e
        if done != length:
            self._count_error()
            raise DeviceError(f"{self.path}: short write at {offset} ({done}/{length})")
        elapsed = time.perf_counter() - start
        with self._lock:
            self._writes += 1
            self._bytes_written += done
            self._latency["write"].observe(elapsed)

    def flush(self) -> None:
        """Make completed writes durable (device write cache included)."""
        start = time.perf_counter()
        try:
            self._flush()
        except OSError as e:
            self._count_error()
            raise DeviceError(f"{self.path}: flush: {e.strerror}") from e
        elapsed = time.perf_counter() - start
        with self._lock:
            self._latency["flush"].observe(elapsed)

    def discard(self, offset: int, length: int) -> None:
        """Tell the device a range is free (TRIM); best effort, never raises."""
        self._check(offset, length)
        try:
            self._discard(offset, length)
        except OSError as e:
            log.debug("%s: discard %d+%d failed: %s", self.path, offset, length, e)
            return
        with self._lock:
            self._discards += 1

    def _count_error(self) -> None:
        with self._lock:
            self._errors += 1

    def statistics(self) -> DeviceStatistics:
        with self._lock:
            return DeviceStatistics(
                self.path,
                self.size,
                self._reads,
                self._writes,
                self._bytes_read,
                self._bytes_written,
                self._discards,
                self._errors,
            )

    def latency(self) -> dict[str, Histogram]:
        """Copies of the completed requests' latency histograms, by operation
        (:data:`DEVICE_OPS`; a failed request counts as an error, not here)."""
        with self._lock:
            return {op: h.copy() for op, h in self._latency.items()}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the device."""

    @abstractmethod
    def _pread(self, offset: int, buf: memoryview) -> int: ...

    def _preadv(self, offset: int, bufs: Sequence[memoryview]) -> int:
        """Bytes read into ``bufs`` from ``offset``: one :meth:`_pread` per buffer
        (so a wrapper's faults apply to each) unless a device does better."""
        done = 0
        for b in bufs:
            n = self._pread(offset + done, b)
            done += n
            if n < len(b):
                break
        return done

    @abstractmethod
    def _pwrite(self, offset: int, bufs: Sequence[memoryview]) -> int: ...

    @abstractmethod
    def _flush(self) -> None: ...

    @abstractmethod
    def _discard(self, offset: int, length: int) -> None: ...


class FileDevice(Device):
    """A block device or a regular image file, opened exclusively with O_DIRECT.

    Claimed by what it is, not by its name (:mod:`kvfs.devices.identity`): as long as it is
    open it also holds an flock on whatever backs a loop device and an exclusive open
    of every loop device over it, so no other name of the same bytes can be mounted,
    formatted or checked meanwhile (``docs/design.md``, "One pool, one daemon")."""

    def __init__(self, path: str) -> None:
        claim = _claim(path)
        self.fd = claim.fd
        self.direct = claim.direct
        self.identity = claim.chain[-1].key
        """What this device is: equal for every name of the same bytes."""
        self._guards = claim.guards
        st = claim.chain[0].st
        self.is_block = stat.S_ISBLK(st.st_mode)
        try:
            size, logical, optimal = _geometry(self.fd, st)
        except OSError as e:
            self.close()
            raise UserError(f"{path}: cannot read device geometry: {e.strerror}") from e
        super().__init__(path, size - size % ALIGN, max(logical, ALIGN), optimal)

    def _pread(self, offset: int, buf: memoryview) -> int:
        done = 0
        while done < len(buf):
            n = os.preadv(self.fd, [buf[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    def _preadv(self, offset: int, bufs: Sequence[memoryview]) -> int:
        if len(bufs) > 1:
            n = os.preadv(self.fd, bufs, offset)
            if n == sum(len(b) for b in bufs):
                return n
        return super()._preadv(offset, bufs)  # one buffer, or a rare short read

    def _pwrite(self, offset: int, bufs: Sequence[memoryview]) -> int:
        done = os.pwritev(self.fd, bufs, offset)
        total = sum(len(b) for b in bufs)
        while done < total:  # rare partial write: finish it piecewise
            rest = b"".join(bytes(b) for b in bufs)[done:]
            tmp = aligned_buffer(len(rest))
            tmp[: len(rest)] = rest
            n = os.pwritev(self.fd, [memoryview(tmp)[: len(rest)]], offset + done)
            if n <= 0:
                break
            done += n
        return done

    def _flush(self) -> None:
        os.fdatasync(self.fd)

    def _discard(self, offset: int, length: int) -> None:
        if self.is_block:
            fcntl.ioctl(self.fd, _BLKDISCARD, struct.pack("QQ", offset, length))
            return
        mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
        if _libc.fallocate(self.fd, mode, offset, length) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        for fd in self._guards:
            os.close(fd)
        self._guards = []


def member_id(st: os.stat_result) -> list[int]:
    """What an open member is, as the direct path compares it (a client checks that
    the path it opened names the device the mount has open): a block device's
    number, or an image file's (device, inode)."""
    return [st.st_rdev, 0] if stat.S_ISBLK(st.st_mode) else [st.st_dev, st.st_ino]


def member_identity(path: str) -> identity.Key:
    """What ``path`` is (an image file, a loop device over one, another block device),
    without opening it: how a command finds one member named twice."""
    return _resolve(path)[-1].key


def _resolve(path: str) -> list[identity.Layer]:
    try:
        chain = identity.resolve(path)
    except FileNotFoundError:
        raise UserError(f"{path}: no such device or image file") from None
    except OSError as e:
        raise UserError(f"{path}: cannot open: {e.strerror}") from None
    mode = chain[0].st.st_mode
    if not (stat.S_ISBLK(mode) or stat.S_ISREG(mode)):
        raise UserError(f"{path}: not a block device or regular image file")
    return chain


@dataclass
class _Claim:
    fd: int
    direct: bool
    chain: list[identity.Layer]
    """The member, then what backs it (verified against the kernel's answer)."""
    guards: list[int]
    """Descriptors held only for their locks: backing files, loop devices over it."""


def _claim(path: str) -> _Claim:
    """Open ``path`` for I/O and claim every name of its bytes, or raise UserError.

    Every step holds its lock before it checks the next one, so of two processes
    claiming the same bytes by different names at least one is refused."""
    chain = _resolve(path)
    fd, direct = _open_exclusive(path, chain)
    guards: list[int] = []
    try:
        chain = chain[: _lock_backing(path, fd, chain, guards)]
        _hold_loops_over(path, chain, guards)
    except BaseException:
        for g in [fd, *guards]:
            os.close(g)
        raise
    return _Claim(fd, direct, chain, guards)


def _open_exclusive(path: str, chain: list[identity.Layer]) -> tuple[int, bool]:
    """Open for O_DIRECT I/O, refusing a device someone else holds."""
    is_block = chain[0].is_block
    flags = os.O_RDWR | os.O_CLOEXEC
    if is_block:
        flags |= os.O_EXCL  # the kernel refuses it while mounted or held elsewhere
    direct = True
    try:
        fd = os.open(path, flags | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL and not is_block:
            # tmpfs and a few others have no O_DIRECT; an image file there still works
            log.warning("%s: O_DIRECT unsupported here, using buffered I/O", path)
            fd, direct = os.open(path, flags), False
        elif e.errno == errno.EBUSY:
            raise _busy(path, chain, "device is busy", "mounted or in use") from None
        else:
            raise UserError(f"{path}: cannot open: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise _locked(path, chain) from None
    return fd, direct


def _lock_backing(path: str, fd: int, chain: list[identity.Layer], guards: list[int]) -> int:
    """Lock what backs a loop device (flock; a backing block device is also opened
    O_EXCL), layer by layer; returns how many layers of ``chain`` are verified."""
    parent = fd
    for depth, layer in enumerate(chain[1:], 1):
        flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_EXCL if layer.is_block else 0)
        try:
            guard = os.open(layer.path, flags)
        except OSError as e:
            if e.errno == errno.EBUSY:
                problem = f"backed by {layer.path}, which is busy"
                raise _busy(path, chain, problem, "mounted or in use") from None
            log.warning("%s: cannot lock %s behind it: %s", path, layer.path, e.strerror)
            return depth
        guards.append(guard)
        st = os.fstat(guard)
        if identity.loop_backing_node(parent) != (st.st_dev, st.st_ino):
            # the kernel's name for it leads elsewhere (another mount namespace)
            log.warning("%s: cannot lock %s behind it: not the same file", path, layer.path)
            return depth
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise _locked(path, chain) from None
        parent = guard
    return len(chain)


def _hold_loops_over(path: str, chain: list[identity.Layer], guards: list[int]) -> None:
    """Open every loop device over these bytes O_EXCL, refusing if one is held: a
    filesystem mounted on it, a kvfs mount through it."""
    for loop in identity.loops_over(chain):
        try:
            guards.append(os.open(loop.path, os.O_RDONLY | os.O_CLOEXEC | os.O_EXCL))
        except OSError as e:
            if e.errno == errno.EBUSY:
                problem = f"in use through {loop.path}"
                raise _busy(path, chain, problem, "held by another program", loop.path) from None
            log.warning("%s: cannot hold %s over it: %s", path, loop.path, e.strerror)


def _holder(path: str, chain: list[identity.Layer]) -> identity.Holder | None:
    return identity.holder(path, [*chain, *identity.loops_over(chain)])


def _busy(
    path: str, chain: list[identity.Layer], problem: str, unknown: str, via: str = ""
) -> UserError:
    who = _holder(path, chain)
    if who is not None and who.through == via:
        who = dataclasses.replace(who, through=None)  # the problem names it already
    return UserError(f"{path}: {problem} ({who or unknown})")


def _locked(path: str, chain: list[identity.Layer]) -> UserError:
    """An flock kvfs takes is held: by another kvfs process, as a rule."""
    who = _holder(path, chain)
    if who is None:
        return UserError(f"{path}: already in use by another kvfs process")
    if not who.kvfs:
        return UserError(f"{path}: in use ({who})")
    return UserError(f"{path}: already in use by another kvfs process ({who})")


def _geometry(fd: int, st: os.stat_result) -> tuple[int, int, int]:
    """(size, logical block size, optimal I/O size) in bytes."""
    if not stat.S_ISBLK(st.st_mode):
        return st.st_size, ALIGN, 0
    buf = fcntl.ioctl(fd, _BLKGETSIZE64, b"\0" * 8)
    size = struct.unpack("Q", buf)[0]
    logical = struct.unpack("i", fcntl.ioctl(fd, _BLKSSZGET, b"\0" * 4))[0]
    physical = struct.unpack("i", fcntl.ioctl(fd, _BLKPBSZGET, b"\0" * 4))[0]
    optimal = struct.unpack("i", fcntl.ioctl(fd, _BLKIOOPT, b"\0" * 4))[0]
    return size, max(logical, physical), optimal


class MissingDevice(Device):
    """Stands in for an absent device of a pool mounted ``--degraded``: every request
    fails, nothing is allocated on it."""

    def __init__(self, path: str) -> None:
        super().__init__(path, 0, ALIGN, 0)

    def _pread(self, offset: int, buf: memoryview) -> int:
        raise OSError(errno.ENODEV, "device missing (degraded pool)")

    def _pwrite(self, offset: int, bufs: Sequence[memoryview]) -> int:
        raise OSError(errno.ENODEV, "device missing (degraded pool)")

    def _flush(self) -> None:
        pass

    def _discard(self, offset: int, length: int) -> None:
        pass
