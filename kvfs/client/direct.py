"""Zero-copy reads and writes of kvfs files, straight between the raw devices and a
buffer (a pinned torch tensor, a ``bytearray``, an mmap): the bytes never cross FUSE.

    import kvfs.client.direct
    n = kvfs.client.direct.read_into("/mnt/kv/chunk.pt", tensor)   # the file's bytes, verified
    kvfs.client.direct.write_from("/mnt/kv/new.pt", tensor)         # durable when it returns

The mount mediates the metadata (:mod:`kvfs.store.leases`): an extent map leased to
the open file, or room reserved for a new one, then a commit with the checksums.
This process does the device I/O: O_DIRECT, every run of units in parallel (worker
threads; the reads, writes and xxh3 checksums release the GIL), each unit verified
against the checksum the mount stored before a byte is returned.

Who may use it: a process that can open the pool's devices (root, or the ``disk``
group for block devices; the image file's owner for image files). Anyone else, and
any file the mount cannot map (being written, a map over 64 KiB, not on kvfs at
all), is served by ordinary reads and writes of the same path, with the same
result: the functions work on every path, and :func:`stats` says which way each
call went. An unaligned buffer (O_DIRECT needs page-aligned memory) is bounced
through an aligned one; :func:`aligned` gives buffers that are not.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import mmap
import os
import secrets
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import xxhash

# the protocol's xattrs, public here as before (kvfs.direct.MAP ...)
from kvfs.common.aware import COMMIT as COMMIT
from kvfs.common.aware import MAP as MAP
from kvfs.common.aware import PREFIX as PREFIX
from kvfs.common.aware import RESERVE as RESERVE
from kvfs.devices.device import ALIGN, aligned_buffer, member_id

PIECE = 8 << 20
"""Bytes per device request: a run is read or written in pieces this big, in
parallel, so checksums of one piece overlap the I/O of the next."""
_NO_MAP = {
    errno.EACCES,
    errno.EBUSY,
    errno.E2BIG,
    errno.ENODATA,
    errno.EOPNOTSUPP,
    errno.ERANGE,
    errno.EPERM,
}
"""Answers that mean "not through the direct path": read or write through the mount."""
T = TypeVar("T")


@dataclass
class Statistics:
    direct_reads: int = 0
    direct_writes: int = 0
    direct_bytes_read: int = 0
    direct_bytes_written: int = 0
    fallback_reads: int = 0
    """Reads served through the mount: no map (file being written, not kvfs, ...),
    devices this process may not open, or a checksum mismatch (the mount then
    verifies, and answers EIO for a corrupt unit)."""
    fallback_writes: int = 0
    bounced_bytes: int = 0
    """Bytes copied through an aligned buffer because the caller's was not aligned
    (or a file's partial last unit, which O_DIRECT cannot move in place)."""
    checksum_failures: int = 0


_stats = Statistics()
_lock = threading.Lock()
_pools: dict[str, ThreadPoolExecutor] = {}
_fds: dict[tuple[str, bool, tuple[int, ...]], int] = {}


def stats() -> dict[str, int]:
    """This process's counters (see :class:`Statistics`)."""
    with _lock:
        return asdict(_stats)


def _count(**deltas: int) -> None:
    with _lock:
        for k, v in deltas.items():
            setattr(_stats, k, getattr(_stats, k) + v)


def aligned(nbytes: int) -> mmap.mmap:
    """A zero-filled, page-aligned buffer of at least ``nbytes`` (no bounce when
    used); wrap it as a tensor with ``torch.frombuffer(buf, dtype=torch.uint8)``."""
    return aligned_buffer(nbytes)


def _threads(name: str) -> ThreadPoolExecutor:
    with _lock:
        pool = _pools.get(name)
        if pool is None:
            pool = _pools[name] = ThreadPoolExecutor(16, thread_name_prefix=f"kvfs-{name}")
        return pool


def _workers() -> ThreadPoolExecutor:
    """The threads that move pieces (and never wait for other jobs)."""
    return _threads("direct")


def _files() -> ThreadPoolExecutor:
    """The threads that each store one file of :func:`write_many` (they wait for
    their pieces on :func:`_workers`)."""
    return _threads("file")


def _forked() -> None:
    """A forked child has none of its parent's worker threads (a job given to an
    inherited pool would never run), and a lock may have been held at the fork."""
    global _lock
    _pools.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)


def _address(view: memoryview) -> int | None:
    """Where ``view`` starts in memory, or None when it cannot be told (read-only)."""
    if view.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _bytes_view(buf: Any) -> memoryview:
    """The buffer's bytes: anything with the buffer protocol, or a torch tensor in
    host memory (pinned or not, any dtype: its bytes, shared, never copied)."""
    if hasattr(buf, "untyped_storage") and hasattr(buf, "is_cuda"):  # torch, not imported
        if buf.is_cuda:
            raise ValueError("a CUDA tensor: use a host (pinned) tensor and copy it to the GPU")
        if not buf.is_contiguous():
            raise ValueError("the buffer must be contiguous")
        buf = buf.reshape(-1).view(sys.modules["torch"].uint8).numpy()
    view = memoryview(buf)
    if not view.contiguous:
        raise ValueError("the buffer must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _device(desc: dict[str, Any], write: bool) -> int:
    """An O_DIRECT descriptor of a member, opened once per process and checked to be
    the member the mount named (a path can come to name another device: the cache
    is keyed by what the mount says the member is, not only by its path)."""
    path = desc["path"]
    ident = desc.get("id")
    if ident is None:
        raise PermissionError(errno.EACCES, "member not openable", path)
    key = (path, write, tuple(ident))
    with _lock:
        fd = _fds.get(key)
    if fd is None:
        flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_CLOEXEC
        if desc.get("direct", True):
            flags |= os.O_DIRECT
        fd = os.open(path, flags)
        if member_id(os.fstat(fd)) != list(ident):
            os.close(fd)
            raise PermissionError(errno.ESTALE, "names another device than the mount's", path)
        with _lock:
            if key in _fds:
                os.close(fd)
                fd = _fds[key]
            else:
                _fds[key] = fd
    return fd


def _devices(info: dict[str, Any], write: bool) -> list[int] | None:
    """Descriptors of every member, or None if this process may not open one."""
    try:
        return [_device(d, write) for d in info["devices"]]
    except OSError:
        return None


def available(path: str | os.PathLike[str]) -> bool:
    """Whether reads and writes under ``path`` (a kvfs file or directory) take the
    direct path: it is on a kvfs mount and this process may open its devices."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        info = json.loads(os.getxattr(fd, MAP))
    except OSError:
        return False
    finally:
        os.close(fd)
    return _devices(info, write=False) is not None


# ---------------------------------------------------------------------- reads
def read_into(path: str | os.PathLike[str], buf: Any) -> int:
    """Fill ``buf`` (writable, at least the file's size) with the file's bytes and
    return the file's size. Raises FileNotFoundError for a missing file, ValueError
    for a buffer too small, OSError (EIO) when a unit fails its checksum."""
    view = _bytes_view(buf)
    if view.readonly:
        raise ValueError("read_into needs a writable buffer")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            info = json.loads(os.getxattr(fd, MAP))
        except OSError as e:
            if e.errno not in _NO_MAP:
                raise
            return _read_through(fd, view)
        size: int = info["size"]
        if len(view) < size:
            raise ValueError(f"{os.fspath(path)}: {size} bytes do not fit {len(view)} bytes")
        fds = _devices(info, write=False)
        if fds is None:
            return _read_through(fd, view)
        if _read_runs(info, fds, view):
            _count(direct_reads=1, direct_bytes_read=size)
            return size
        # a unit failed its checksum: the mount reads it again, and quarantines a bad
        # unit (EIO) instead of serving it
        _count(checksum_failures=1)
        return _read_through(fd, view)
    finally:
        os.close(fd)


def _read_through(fd: int, view: memoryview) -> int:
    """Read the whole file through the mount (ordinary reads)."""
    size = os.fstat(fd).st_size
    if len(view) < size:
        raise ValueError(f"{size} bytes do not fit a {len(view)}-byte buffer")
    got = 0
    while True:
        n = os.preadv(fd, [view[got:]], got) if got < len(view) else 0
        if n == 0:
            break
        got += n
    if got < size:
        raise OSError(errno.EIO, f"short read: {got} of {size} bytes")
    _count(fallback_reads=1)
    return got


@dataclass(frozen=True)
class _Piece:
    """Units ``first``.. (``n`` of them) of one run: at ``offset`` on member ``fd``,
    ``stored`` bytes there (less than ``n`` units for a fragment tail). ``whole``:
    every unit lies within the file's size and is stored whole, so it can move in
    place between the device and the caller's buffer."""

    fd: int
    offset: int
    first: int
    n: int
    stored: int
    whole: bool


def _pieces(run: list[int], fds: list[int], unit: int, size: int) -> list[_Piece]:
    """A run as pieces of at most PIECE bytes; a file's partial last unit is a piece
    of its own (a fragment tail is a run of its own already)."""
    fd, offset, length, first, n = fds[run[0]], run[1], run[2], run[3], run[4]
    if length < n * unit:  # a fragment tail (n == 1): its stored bytes only
        return [_Piece(fd, offset, first, 1, length, False)]
    full = min(n, max(size // unit - first, 0))
    per = max(PIECE // unit, 1)
    out = []
    for i in range(0, full, per):
        k = min(per, full - i)
        out.append(_Piece(fd, offset + i * unit, first + i, k, k * unit, True))
    if full < n:
        k = n - full
        out.append(_Piece(fd, offset + full * unit, first + full, k, k * unit, False))
    return out


def _unit_sums(data: memoryview, n: int, unit: int) -> list[int]:
    """xxh3-64 of each of ``n`` units of ``data`` (what the mount stores per unit)."""
    return [xxhash.xxh3_64_intdigest(data[i * unit : (i + 1) * unit]) for i in range(n)]


def _in_place(piece: _Piece, base: int | None, unit: int) -> bool:
    """Whether ``piece`` moves straight to/from the caller's buffer at ``base`` (an
    unknown address, a read-only buffer's, is tried and bounced on EINVAL)."""
    return piece.whole and (base is None or (base + piece.first * unit) % ALIGN == 0)


def _read_runs(info: dict[str, Any], fds: list[int], view: memoryview) -> bool:
    """Read and verify every run into ``view`` (holes zero-filled); False if any unit
    failed its checksum."""
    size, unit, csums = info["size"], info["unit"], info["csums"]
    covered = bytearray(len(csums))
    jobs: list[Future[bool]] = []
    pool = _workers()
    base = _address(view)  # never None: read_into takes writable buffers only
    for run in info["runs"]:
        for piece in _pieces(run, fds, unit, size):
            covered[piece.first : piece.first + piece.n] = b"\1" * piece.n
            work = _read_direct if _in_place(piece, base, unit) else _read_bounced
            jobs.append(pool.submit(work, piece, view, unit, size, csums))
    for u, c in enumerate(covered):  # holes read as zeros
        if not c:
            lo, hi = u * unit, min((u + 1) * unit, size)
            if lo < hi:
                view[lo:hi] = bytes(hi - lo)
    verified = _wait(jobs)
    return all(verified)


def _pread_all(fd: int, target: memoryview, offset: int) -> None:
    done = 0
    while done < len(target):
        n = os.preadv(fd, [target[done:]], offset + done)
        if n == 0:
            raise OSError(errno.EIO, f"short device read at {offset + done}")
        done += n


def _read_direct(p: _Piece, view: memoryview, unit: int, size: int, csums: list[int]) -> bool:
    target = view[p.first * unit : (p.first + p.n) * unit]
    _pread_all(p.fd, target, p.offset)
    return _unit_sums(target, p.n, unit) == csums[p.first : p.first + p.n]


def _read_bounced(p: _Piece, view: memoryview, unit: int, size: int, csums: list[int]) -> bool:
    scratch = aligned(p.n * unit)  # zero-filled: a fragment tail's unit ends in zeros
    try:
        whole = memoryview(scratch)[: p.n * unit]
        _pread_all(p.fd, whole[: -(-p.stored // ALIGN) * ALIGN], p.offset)
        ok = _unit_sums(whole, p.n, unit) == csums[p.first : p.first + p.n]
        start = p.first * unit
        end = min(start + p.n * unit, size)
        if ok:
            view[start:end] = whole[: end - start]
            _count(bounced_bytes=end - start)
        del whole
        return ok
    finally:
        scratch.close()


# ---------------------------------------------------------------------- writes
def write_from(path: str | os.PathLike[str], buf: Any, mode: int = 0o644) -> int:
    """Store ``buf``'s bytes as the file ``path`` (created, or replaced as by
    ``O_TRUNC``), durable when it returns, as after a close; returns the bytes
    written. A failure leaves no partial file behind."""
    view = _bytes_view(buf)
    size = len(view)
    parent = os.path.dirname(os.fspath(path)) or "."
    info: dict[str, Any] | None = None
    if size:
        try:
            dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                info = json.loads(os.getxattr(dfd, MAP))
            finally:
                os.close(dfd)
        except OSError as e:
            if e.errno not in _NO_MAP:
                raise
    fds = _devices(info, write=True) if info is not None else None
    # the mount binds a reservation to the handle this thread opened: one file's
    # create, reserve and commit stay on one thread
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        if fds is None:
            n = _write_through(fd, view)
        else:
            nonce = secrets.token_hex(8)
            plan = json.loads(os.getxattr(fd, f"{RESERVE}{size}.{nonce}"))
            sums = [0] * -(-plan["size"] // plan["unit"])
            _wait(_submit_runs(plan, fds, view, sums))
            os.setxattr(fd, COMMIT, json.dumps({"nonce": nonce, "csums": sums}).encode())
            _count(direct_writes=1, direct_bytes_written=size)
            n = size
    except BaseException:
        # the last close before the commit (its release, not any FLUSH: a forked
        # child's exec sends those): the mount frees the room and drops the file
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    os.close(fd)
    return n


def write_many(items: Iterable[tuple[str | os.PathLike[str], Any]], mode: int = 0o644) -> list[int]:
    """Store several files, each as :func:`write_from` would, all durable when it
    returns; returns the bytes written per file. The files are written at once, so
    their device writes overlap and their commits reach the mount together and share
    its flushes (a group commit, not one flush per file). Each file is whole or
    absent: when one fails, the others are still stored, and the first error is
    raised once every file is committed or dropped."""
    return _wait([_files().submit(write_from, path, buf, mode) for path, buf in items])


def _wait(jobs: list[Future[T]]) -> list[T]:
    """Every job's result, once all of them are done: no device request may still
    be touching a buffer or a unit when the caller learns of an error (the mount
    frees a failed write's units at its close)."""
    wait(jobs)
    return [job.result() for job in jobs]


def _write_through(fd: int, view: memoryview) -> int:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])
    os.fsync(fd)  # as durable as a direct write (a kvfs close is durable anyway)
    _count(fallback_writes=1)
    return done


def _submit_runs(
    plan: dict[str, Any], fds: list[int], view: memoryview, sums: list[int]
) -> list[Future[None]]:
    """Start writing ``view`` to the planned runs, in pieces on the worker threads;
    each piece fills its units' entries of ``sums``."""
    unit, pool, base = plan["unit"], _workers(), _address(view)
    jobs = []
    for run in plan["runs"]:
        for piece in _pieces(run, fds, unit, plan["size"]):
            work = _write_direct if _in_place(piece, base, unit) else _write_bounced
            jobs.append(pool.submit(work, piece, view, unit, sums))
    return jobs


def _pwrite_all(fd: int, source: memoryview, offset: int) -> None:
    done = 0
    while done < len(source):
        n = os.pwritev(fd, [source[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short device write at {offset + done}")
        done += n


def _write_direct(p: _Piece, view: memoryview, unit: int, sums: list[int]) -> None:
    source = view[p.first * unit : (p.first + p.n) * unit]
    sums[p.first : p.first + p.n] = _unit_sums(source, p.n, unit)
    try:
        _pwrite_all(p.fd, source, p.offset)
    except OSError as e:  # a read-only buffer's alignment shows only here
        if e.errno != errno.EINVAL or not view.readonly:
            raise
        _write_bounced(p, view, unit, sums)


def _write_bounced(p: _Piece, view: memoryview, unit: int, sums: list[int]) -> None:
    start = p.first * unit
    end = min(start + p.n * unit, len(view))
    scratch = aligned(p.n * unit)  # zero-filled: a partial last unit is padded with zeros
    try:
        whole = memoryview(scratch)[: p.n * unit]
        whole[: end - start] = view[start:end]
        sums[p.first : p.first + p.n] = _unit_sums(whole, p.n, unit)
        _pwrite_all(p.fd, whole[: -(-p.stored // ALIGN) * ALIGN], p.offset)
        _count(bounced_bytes=end - start)
        del whole
    finally:
        scratch.close()
