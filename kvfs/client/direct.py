"""Zero-copy reads and writes of kvfs files, straight between the devices and a
buffer (a pinned torch tensor, a ``bytearray``, an mmap): the bytes never cross FUSE.

    import kvfs.direct
    n = kvfs.direct.read_into("/mnt/kv/chunk.pt", tensor)   # the file's bytes, verified
    kvfs.direct.write_from("/mnt/kv/new.pt", tensor)         # durable when it returns
    futs = [kvfs.direct.submit_read(p, b) for p, b in items]  # many in flight at once

The mount mediates the metadata (:mod:`kvfs.store.leases`): an extent map leased to
the open file, or room reserved for a new one, then a commit. The bytes take the
fastest route this process may use, and :func:`stats` counts each call's route:

1. ``devices``: a process that may open the pool's devices (root, the ``disk`` group,
   the image file's owner) moves them itself, O_DIRECT, every run of units in
   parallel on worker threads, each unit verified against the checksum the mount
   stored before a byte is returned.
2. ``ring``: any other user has the mount's daemon move them (:mod:`kvfs.client.ring`,
   ``docs/design.md``, "The aware ring"): its I/O threads read and write the devices
   O_DIRECT straight into this process's shared memory, verifying or computing the
   checksums; the ticket that comes with this process's own open of the file is all
   a request may touch. Buffers from :func:`aligned` are that shared memory (no copy
   here); others are bounced through it (one memcpy). A read, and a write of a new
   file, go as one message naming the path (the daemon opens or creates the file as
   this process's user, by the kernel's rules): no request through FUSE at all.
3. ``mount``: ordinary reads and writes of the same path (a file being written, a map
   over 64 KiB, not on kvfs, no ring), with the same result.

``KVFS_DIRECT_ROUTE=devices|ring|mount`` caps the route (``ring``: never open the
devices, as an ordinary user would; ``mount``: FUSE only), for comparisons.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import re
import secrets
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from kvfs.client import ring

# the protocol's xattrs, public here as before (kvfs.direct.MAP ...)
from kvfs.common.aware import COMMIT as COMMIT
from kvfs.common.aware import MAP as MAP
from kvfs.common.aware import PREFIX as PREFIX
from kvfs.common.aware import RESERVE as RESERVE
from kvfs.devices.device import ALIGN, member_id
from kvfs.devices.runs import PIECE as PIECE
from kvfs.devices.runs import pieces, read_piece, write_piece
from kvfs.format import ring as wire

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
ROUTES = ("devices", "ring", "mount")
T = TypeVar("T")


@dataclass
class Statistics:
    direct_reads: int = 0
    """Reads this process moved from the devices itself (route ``devices``)."""
    direct_writes: int = 0
    direct_bytes_read: int = 0
    direct_bytes_written: int = 0
    ring_reads: int = 0
    """Reads the daemon moved into this process's shared memory (route ``ring``)."""
    ring_writes: int = 0
    ring_bytes_read: int = 0
    ring_bytes_written: int = 0
    fallback_reads: int = 0
    """Reads served through the mount: no map (file being written, not kvfs, ...),
    no other route for this process, or a checksum mismatch (the mount then
    verifies, and answers EIO for a corrupt unit)."""
    fallback_writes: int = 0
    bounced_bytes: int = 0
    """Bytes copied through an aligned or shared buffer because the caller's was not
    one (or a file's partial last unit, which O_DIRECT cannot move in place)."""
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


def _cap() -> int:
    """The fastest route ``KVFS_DIRECT_ROUTE`` allows (an index into ROUTES)."""
    want = os.environ.get("KVFS_DIRECT_ROUTE", "devices")
    return ROUTES.index(want) if want in ROUTES else 0


def aligned(nbytes: int) -> mmap.mmap:
    """A zero-filled, page-aligned buffer of at least ``nbytes`` that the mount's
    daemon can share: no bounce on any route. Wrap it as a tensor with
    ``torch.frombuffer(buf, dtype=torch.uint8)`` (pin it for CUDA copies)."""
    return ring.shared(nbytes)


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
    """The threads that each move one file of :func:`write_many`, :func:`read_many`
    and the ``submit_*`` forms (they wait for their pieces on :func:`_workers`)."""
    return _threads("file")


def _forked() -> None:
    """A forked child has none of its parent's worker threads (a job given to an
    inherited pool would never run), and a lock may have been held at the fork."""
    global _lock
    _pools.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)


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
    """Descriptors of every member, or None if this process may not (or, capped by
    ``KVFS_DIRECT_ROUTE``, shall not) open one."""
    if _cap() > 0:
        return None
    try:
        return [_device(d, write) for d in info["devices"]]
    except OSError:
        return None


def _ring(info: dict[str, Any] | None) -> ring.Ring | None:
    """The daemon's ring named in a mount's answer, if this process may use it."""
    path = info.get("ring") if info is not None else None
    if not path or _cap() > 1:
        return None
    return ring.connect(path)


def _map_of(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info: dict[str, Any] = json.loads(os.getxattr(fd, MAP))
        return info
    except OSError:
        return None
    finally:
        os.close(fd)


def route(path: str | os.PathLike[str]) -> str:
    """The route reads and writes under ``path`` (a kvfs file or directory) take
    from this process: ``devices``, ``ring`` or ``mount``."""
    info = _map_of(path)
    if info is None:
        return "mount"
    if _devices(info, write=False) is not None:
        return "devices"
    return "ring" if _ring(info) is not None else "mount"


def available(path: str | os.PathLike[str]) -> bool:
    """Whether reads and writes under ``path`` skip FUSE (route ``devices`` or
    ``ring``)."""
    return route(path) != "mount"


# ---------------------------------------------------------------------- reads
def read_into(path: str | os.PathLike[str], buf: Any) -> int:
    """Fill ``buf`` (writable, at least the file's size) with the file's bytes and
    return the file's size. Raises FileNotFoundError for a missing file, ValueError
    for a buffer too small, OSError (EIO) when a unit fails its checksum."""
    view = _bytes_view(buf)
    if view.readonly:
        raise ValueError("read_into needs a writable buffer")
    by_path = _ring_path_of(os.fspath(path))
    r = ring.connect(by_path[0]) if by_path is not None else None
    if r is not None:  # one message: the daemon opens, reads, verifies and closes it
        out: list[int | OSError | None] = [None]
        with contextlib.suppress(OSError):  # the ring broke: the mount's way
            _ring_read_paths(r, [(0, os.fspath(path), view)], out)
        got = out.pop()
        if isinstance(got, OSError):
            try:
                raise got  # as _raise_first: no frame keeps it
            finally:
                del got
        if got is not None:
            return got
    return _read_by_open(path, view)


def _raise_first(results: list[Any]) -> None:
    """Raise the first exception in ``results`` (emptied), if any, from a frame that
    keeps no reference to it. A raised exception whose traceback reaches a frame that
    holds it is a cycle only the garbage collector frees, and until then the frames
    keep the caller's buffers exported: an ``mmap`` of theirs could not close
    (``BufferError``; the soak's readers met it)."""
    err = next((r for r in results if isinstance(r, BaseException)), None)
    results.clear()
    if err is None:
        return
    try:
        raise err
    finally:
        del err


def _read_by_open(path: str | os.PathLike[str], view: memoryview) -> int:
    """:func:`read_into` through the caller's own open of the file: its map, then
    the devices or the ring's ticket, or ordinary reads."""
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
        if fds is not None:
            if _read_runs(info, fds, view):
                _count(direct_reads=1, direct_bytes_read=size)
                return size
        else:
            r = _ring(info) if "ticket" in info else None
            if r is None or not size:
                return _read_through(fd, view)
            try:
                _ring_move(r, wire.OP_READ, info, view)
                _count(ring_reads=1, ring_bytes_read=size)
                return size
            except OSError as e:
                if e.errno != errno.EIO:  # the ring is gone or refused: the mount serves
                    return _read_through(fd, view)
        # a unit failed its checksum: the mount reads it again, and quarantines a bad
        # unit (EIO) instead of serving it
        _count(checksum_failures=1)
        return _read_through(fd, view)
    finally:
        os.close(fd)


def _ring_move(r: ring.Ring, op: int, info: dict[str, Any], view: memoryview) -> None:
    """Have the daemon move the file's bytes between the devices and ``view``: in
    place when ``view`` is shared memory at a page boundary, else through this
    thread's staging buffer."""
    size = info["size"]
    ticket = bytes.fromhex(info["ticket"])
    where = _shared_at_page(view)
    if where is not None:
        _done(r.run([(op, ticket, where[0], where[1], size)])[0])
        return
    with ring.staging(size) as stage:
        if op == wire.OP_WRITE:
            stage[:size] = view[:size]
        _done(r.run([(op, ticket, stage, 0, size)])[0])
        if op == wire.OP_READ:
            view[:size] = stage[:size]
    _count(bounced_bytes=size)


def _done(result: int | OSError) -> int:
    if isinstance(result, OSError):
        raise result
    return result


def read_many(items: Iterable[tuple[str | os.PathLike[str], Any]]) -> list[int]:
    """Read several files, each as :func:`read_into`, all in flight at once; the sizes
    in order. Every read is done when it returns; the first error is raised then."""
    results = read_batch(items)
    sizes = [r for r in results if not isinstance(r, BaseException)]
    if len(sizes) < len(results):
        _raise_first(results)
    return sizes


def read_batch(items: Iterable[tuple[str | os.PathLike[str], Any]]) -> list[int | OSError]:
    """Read several files, each as :func:`read_into` would, all at once; per file its
    size or the OSError it failed with (FileNotFoundError for a missing one, EFBIG
    for one larger than its buffer), in order, never raised. On the ring the whole
    batch is one message: the daemon opens every file as this process's user (the
    kernel's permission rules), reads and verifies them on its I/O threads, and
    answers each; a few system calls for the batch instead of five per file (this
    thread takes the GIL back a few times, not five times per file, in an engine
    whose other threads keep it busy). Files the ring does not resolve (a symbolic
    link, ``..``) and every other route go through :func:`read_into`, in parallel."""
    pairs = [(os.fspath(p), _bytes_view(b)) for p, b in items]
    out: list[int | OSError | None] = [None] * len(pairs)
    by_ring: dict[str, list[int]] = {}
    for i, (path, view) in enumerate(pairs):
        where = _ring_path_of(path) if not view.readonly else None
        if where is not None:
            by_ring.setdefault(where[0], []).append(i)
    for sock, idx in by_ring.items():
        r = ring.connect(sock)
        if r is None:
            continue
        with contextlib.suppress(OSError):  # the ring broke: the rest goes the other way
            _ring_read_paths(r, [(i, *pairs[i]) for i in idx], out)
    rest = [i for i, got in enumerate(out) if got is None]
    # not by path again: each one's own open decides (a checksum failure: the mount)
    futs = {i: _files().submit(_read_by_open, *pairs[i]) for i in rest}
    wait(list(futs.values()))
    for i, fut in futs.items():
        exc = fut.exception()
        if exc is None:
            out[i] = fut.result()
        elif isinstance(exc, OSError):
            out[i] = exc
        elif isinstance(exc, ValueError):  # the file does not fit its buffer
            out[i] = OSError(errno.EFBIG, str(exc), pairs[i][0])
        else:
            raise exc
    return [r if r is not None else OSError(errno.EIO, "not read") for r in out]


_FALL_BACK = {errno.EINVAL, errno.ENOTDIR, errno.EOPNOTSUPP, errno.EIO, errno.EBUSY, errno.E2BIG}
"""Path-read answers that send a file to :func:`read_into` (its own route decides)."""


def _ring_read_paths(
    r: ring.Ring, items: list[tuple[int, str, memoryview]], out: list[int | OSError | None]
) -> None:
    """Read ``(index, path, view)`` by path through ``r`` into ``out``; in place where
    a view is shared memory, else through one staging buffer for the batch."""
    bounced = [v for _, _, v in items if not _shared_at_page(v)]
    size = sum(-(-len(v) // ALIGN) * ALIGN for v in bounced)
    with ring.staging(size) if bounced else contextlib.nullcontext() as stage:
        jobs: list[tuple[bytes, ring.SharedBuffer, int, int]] = []
        bounce: list[tuple[int, str, memoryview, int]] = []
        at = 0
        for i, path, view in items:
            fs_path = _fs_path(path)
            assert fs_path is not None
            where = _shared_at_page(view)
            if where is not None:
                jobs.append((fs_path, where[0], where[1], len(view)))
                bounce.append((i, path, view, -1))
                continue
            assert stage is not None
            jobs.append((fs_path, stage, at, len(view)))
            bounce.append((i, path, view, at))
            at += -(-len(view) // ALIGN) * ALIGN
        results = r.read_paths(jobs)
        for (i, path, view, at_), got in zip(bounce, results, strict=True):
            if isinstance(got, OSError):
                if got.errno == errno.ENOENT:
                    out[i] = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
                elif got.errno not in _FALL_BACK:
                    out[i] = got
                continue  # the other route
            if at_ >= 0:
                assert stage is not None
                view[:got] = stage[at_ : at_ + got]
                _count(bounced_bytes=got)
            _count(ring_reads=1, ring_bytes_read=got)
            out[i] = got


def _shared_at_page(view: memoryview) -> tuple[ring.SharedBuffer, int] | None:
    """The shared buffer and page-aligned offset ``view`` lies at, if it does."""
    where = ring.locate(addr, len(view)) if (addr := ring.address(view)) is not None else None
    return where if where is not None and where[1] % ALIGN == 0 else None


_MOUNTS: list[tuple[float, list[tuple[str, str]]]] = []


def _kvfs_mounts(fresh: bool = False) -> list[tuple[str, str]]:
    """(mount point, root inside the filesystem) of each kvfs mount this process
    sees, longest mount point first (``/proc/self/mountinfo``, read every 5 s, or
    now if ``fresh``)."""
    now = time.monotonic()
    if _MOUNTS and now - _MOUNTS[0][0] < DIRECTORY_TTL and not fresh:
        return _MOUNTS[0][1]
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            sep = fields.index(b"-") if b"-" in fields else -1
            if sep < 0 or fields[sep + 1] != b"fuse.kvfs":
                continue
            root, point = (_unescape(x) for x in (fields[3], fields[4]))
            found.append((point, root))
    found.sort(key=lambda m: -len(m[0]))
    _MOUNTS[:] = [(now, found)]
    return found


def _unescape(field: bytes) -> str:
    """A mountinfo field: its octal escapes (a backslash and 3 digits) undone."""
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), field))


def _fs_path(path: str) -> bytes | None:
    """``path`` relative to its kvfs filesystem's root (``a/b/c``), or None (also
    for a path with ``..``: the kernel walks it, needing search permission on the
    directory it leaves, which no lexical shortcut may skip)."""
    if ".." in path.split("/"):
        return None
    found = _mount_of(path)
    if found is None:
        return None
    point, root = found
    inside = os.path.abspath(path)[len(point) :].strip("/")
    joined = "/".join(p for p in (root.strip("/"), inside) if p)
    return os.fsencode(joined) if joined else None


def _mount_point(path: str) -> str | None:
    """The kvfs mount point ``path`` lies under, if any (``/proc/self/mountinfo``)."""
    found = _mount_of(path)
    return found[0] if found is not None else None


def _mount_of(path: str) -> tuple[str, str] | None:
    """(mount point, root inside the filesystem) of the kvfs mount ``path`` lies
    under; ``/proc/self/mountinfo`` read again on a miss (a mount made since)."""
    full = os.path.abspath(path)
    for fresh in (False, True):
        for point, root in _kvfs_mounts(fresh):
            if full == point or full.startswith(point.rstrip("/") + "/"):
                return point, root
    return None


def _route_map(path: str, point: str | None, fresh: bool = False) -> dict[str, Any] | None:
    """The members and ring of the mount ``path`` is on: its root's map (one per
    mount, remembered), else its directory's, named as the caller names it (the way
    to the root may not be searchable by this user: a mount reached through its
    working directory). Raises what opening that directory raises."""
    if point is not None:
        with contextlib.suppress(OSError):
            info = _directory_map(point, fresh)
            if info is not None:
                return info
    return _directory_map(os.path.dirname(path) or ".", fresh)


def _ring_path_of(path: str, write: bool = False) -> tuple[str, str] | None:
    """(ring socket, mount point) for a file under a kvfs mount this process reads
    (or, ``write``, creates) through the ring by path (not its devices); None
    otherwise."""
    point = _mount_point(path)
    if _cap() > 1 or point is None or _fs_path(path) is None:
        return None
    try:
        info = _route_map(path, point)
    except OSError:  # no such directory...: read_into says so, for this file alone
        return None
    if info is None or not info.get("ring") or (write and not info.get("ring_writes")):
        return None
    if _devices(info, write=write) is not None:
        return None
    return str(info["ring"]), point


def submit_read(path: str | os.PathLike[str], buf: Any) -> Future[int]:
    """:func:`read_into` started now, its result a Future: keep many in flight
    (the buffer must stay untouched until it is done)."""
    return _files().submit(read_into, path, buf)


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


def _read_runs(info: dict[str, Any], fds: list[int], view: memoryview) -> bool:
    """Read and verify every run into ``view`` (holes zero-filled); False if any unit
    failed its checksum."""
    size, unit, csums = info["size"], info["unit"], info["csums"]
    covered = bytearray(len(csums))
    jobs: list[Future[tuple[bool, int]]] = []
    pool = _workers()
    base = ring.address(view)  # never None: read_into takes writable buffers only
    for run in info["runs"]:
        for piece in pieces(run, fds, unit, size):
            covered[piece.first : piece.first + piece.n] = b"\1" * piece.n
            jobs.append(pool.submit(read_piece, piece, view, base, unit, size, csums))
    for u, c in enumerate(covered):  # holes read as zeros
        if not c:
            lo, hi = u * unit, min((u + 1) * unit, size)
            if lo < hi:
                view[lo:hi] = bytes(hi - lo)
    results = _wait(jobs)
    _count(bounced_bytes=sum(b for _, b in results))
    return all(ok for ok, _ in results)


# ---------------------------------------------------------------------- writes
def write_from(path: str | os.PathLike[str], buf: Any, mode: int = 0o644) -> int:
    """Store ``buf``'s bytes as the file ``path`` (created, or replaced as by
    ``O_TRUNC``), durable when it returns, as after a close; returns the bytes
    written. A failure leaves no partial file behind."""
    view = _bytes_view(buf)
    size = len(view)
    fds: list[int] | None = None
    rng: ring.Ring | None = None
    point = _mount_point(os.fspath(path))
    for fresh in (False, True) if size else ():
        info = _route_map(os.fspath(path), point, fresh)
        fds = _devices(info, write=True) if info is not None else None
        # the ring only once it is reachable: after the reservation a failure fails the file
        rng = _ring(info) if fds is None else None
        if fds is not None or rng is not None or info is None or not info.get("ring"):
            break  # else a remembered ring is gone (a remount): ask the mount again
    if rng is not None and info is not None and info.get("ring_writes"):
        made = _ring_write_new(rng, os.fspath(path), view, mode)
        if made is not None:
            return made
    # the mount binds a reservation to the handle this thread opened: one file's
    # create, reserve and commit stay on one thread
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        if fds is None and rng is None:
            n = _write_through(fd, view)
        else:
            nonce = secrets.token_hex(8)
            plan = json.loads(os.getxattr(fd, f"{RESERVE}{size}.{nonce}"))
            assert info is not None  # a route was found in it
            if plan.get("devices") != info.get("devices") or plan.get("ring") != info.get("ring"):
                _DIRECTORIES.clear()  # remounted meanwhile: ask again next time
                if fds is not None:
                    fds = _devices(plan, write=True)
                    if fds is None:
                        raise OSError(errno.ESTALE, "the mount's members changed")
                else:
                    rng = _ring(plan)
                    if rng is None:
                        raise OSError(errno.ESTALE, "the mount's ring changed")
            if fds is not None:
                sums = [0] * -(-plan["size"] // plan["unit"])
                results = _wait(_submit_runs(plan, fds, view, sums))
                _count(bounced_bytes=sum(results))
                commit = {"nonce": nonce, "csums": sums}
            else:
                assert rng is not None
                if "ticket" not in plan:
                    raise OSError(errno.EPROTO, "the mount gave no ring ticket")
                _ring_move(rng, wire.OP_WRITE, plan, view)
                commit = {"nonce": nonce}  # the daemon computed the checksums
            os.setxattr(fd, COMMIT, json.dumps(commit).encode())
            if fds is not None:
                _count(direct_writes=1, direct_bytes_written=size)
            else:
                _count(ring_writes=1, ring_bytes_written=size)
            n = size
    except BaseException:
        # the last close before the commit (its release, not any FLUSH: a forked
        # child's exec sends those): the mount frees the room and drops the file
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    os.close(fd)
    return n


_WRITE_FALL_BACK = {
    errno.EEXIST,
    errno.EINVAL,
    errno.EOPNOTSUPP,
    errno.EBUSY,
    errno.EBADF,
    errno.EIO,
    errno.EPROTO,
}
"""Path-write answers that send a file the mount's way (``open(O_TRUNC)``, then a
reservation): a name in use is replaced there; anything else the mount decides."""
STAGED_BATCH = 256 << 20
"""Bytes of one path-write message at most when they are bounced through staging."""


def _umask() -> int:
    """This process's umask, read without changing it (``/proc/self/status``)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def _ring_write_new(r: ring.Ring, path: str, view: memoryview, mode: int) -> int | None:
    """Store ``view`` as the new file ``path`` by one path write on ``r`` (the daemon
    creates, writes and commits it); the bytes written, or None where the mount's
    way must do it (a name in use, a broken ring...). Raises what creating the file
    through the mount would raise (ENOENT, EACCES, ENOSPC...)."""
    fs_path = _fs_path(path)
    if fs_path is None:
        return None
    try:
        got = _ring_write_paths(r, [(fs_path, view, mode & ~_umask())])[0]
    except OSError:
        return None
    if isinstance(got, int):
        return got
    if got.errno in _WRITE_FALL_BACK:
        return None
    raise _error(got, path)


def _error(got: OSError, path: str) -> OSError:
    """``got`` as the mount would raise it for ``path`` (FileNotFoundError...)."""
    code = got.errno or errno.EIO
    return OSError(code, os.strerror(code), path)


def _ring_write_paths(
    r: ring.Ring, items: list[tuple[bytes, memoryview, int]]
) -> list[int | OSError]:
    """New files ``(path in the filesystem, view, mode)`` written by path through
    ``r``: in place where a view is shared memory, else copied into one staging
    buffer for the batch; per file the bytes written or the OSError."""
    shared = [_shared_at_page(v) for _, v, _ in items]
    pairs = list(zip(items, shared, strict=True))
    size = sum(-(-len(v) // ALIGN) * ALIGN for (_, v, _), where in pairs if where is None)
    bounced = any(where is None for where in shared)
    with ring.staging(size) if bounced else contextlib.nullcontext() as stage:
        jobs: list[tuple[bytes, ring.SharedBuffer, int, int, int]] = []
        at = 0
        for (fs_path, view, mode), where in pairs:
            if where is None:
                assert stage is not None
                stage[at : at + len(view)] = view
                where = (stage, at)
                at += -(-len(view) // ALIGN) * ALIGN
            jobs.append((fs_path, where[0], where[1], len(view), mode))
        results = r.write_paths(jobs)
    for (_, view, _), where, got in zip(items, shared, results, strict=True):
        if isinstance(got, int):
            staged = len(view) if where is None else 0
            _count(ring_writes=1, ring_bytes_written=got, bounced_bytes=staged)
    return results


_DIRECTORIES: dict[str, tuple[float, dict[str, Any] | None]] = {}
DIRECTORY_TTL = 5.0
"""Seconds a directory's map (its mount's members and ring) is reused by this
process: a write then costs no directory open and getxattr. A reservation names the
members and ring again; a change (a remount) is followed, never trusted stale."""


def _directory_map(parent: str, fresh: bool = False) -> dict[str, Any] | None:
    """The map of directory ``parent`` (members, ring), None where it has none;
    ``fresh``: asked of the mount now, not remembered."""
    now = time.monotonic()
    hit = _DIRECTORIES.get(parent)
    if hit is not None and now - hit[0] < DIRECTORY_TTL and not fresh:
        return hit[1]
    info: dict[str, Any] | None = None
    try:
        dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            info = json.loads(os.getxattr(dfd, MAP))
        finally:
            os.close(dfd)
    except OSError as e:
        if e.errno not in _NO_MAP:
            raise
    if len(_DIRECTORIES) > 4096:
        _DIRECTORIES.clear()
    _DIRECTORIES[parent] = (now, info)
    return info


def write_many(items: Iterable[tuple[str | os.PathLike[str], Any]], mode: int = 0o644) -> list[int]:
    """Store several files, each as :func:`write_from` would, all durable when it
    returns; returns the bytes written per file. The files are written at once, so
    their device writes overlap and their commits reach the mount together and share
    its flushes (a group commit, not one flush per file). Each file is whole or
    absent: when one fails, the others are still stored, and the first error is
    raised once every file is committed or dropped. On the ring, new files go by
    path in one message per ``STAGED_BATCH`` bytes: the daemon creates, writes and
    commits them all, with no request through the mount."""
    pairs = [(os.fspath(p), _bytes_view(b)) for p, b in items]
    out: list[int | BaseException | None] = [None] * len(pairs)
    by_ring: dict[str, list[int]] = {}
    for i, (path, view) in enumerate(pairs):
        where = _ring_path_of(path, write=True) if len(view) else None
        if where is not None:
            by_ring.setdefault(where[0], []).append(i)
    umask = _umask() if by_ring else 0
    for sock, idx in by_ring.items():
        r = ring.connect(sock)
        if r is None:
            continue
        for group in _batches(idx, [len(pairs[i][1]) for i in idx]):
            fs = [(_fs_path(pairs[i][0]) or b"", pairs[i][1], mode & ~umask) for i in group]
            try:
                results = _ring_write_paths(r, fs)
            except OSError:  # the ring broke: the rest goes the mount's way
                break
            for i, got in zip(group, results, strict=True):
                if isinstance(got, int):
                    out[i] = got
                elif got.errno not in _WRITE_FALL_BACK:
                    out[i] = _error(got, pairs[i][0])
    futs = {i: submit_write(*pairs[i], mode) for i, got in enumerate(out) if got is None}
    wait(list(futs.values()))
    _settle(out, futs)  # no frame of the raise below may keep a future or its exception
    sizes = [one if isinstance(one, int) else 0 for one in out]
    _raise_first(out)
    return sizes


def _settle(out: list[int | BaseException | None], futs: dict[int, Future[int]]) -> None:
    """Each done future's result or exception into its slot of ``out``; ``futs``
    emptied (a future holds its exception)."""
    for i, fut in futs.items():
        exc = fut.exception()
        out[i] = exc if exc is not None else fut.result()
    futs.clear()


def _batches(idx: list[int], sizes: list[int]) -> Iterable[list[int]]:
    """``idx`` cut into path-write messages: ``wire.MAX_PATH_BATCH`` files and
    ``STAGED_BATCH`` bytes at most each (one file over it goes alone)."""
    group: list[int] = []
    nbytes = 0
    for i, n in zip(idx, sizes, strict=True):
        if group and (len(group) == wire.MAX_PATH_BATCH or nbytes + n > STAGED_BATCH):
            yield group
            group, nbytes = [], 0
        group.append(i)
        nbytes += n
    if group:
        yield group


def submit_write(path: str | os.PathLike[str], buf: Any, mode: int = 0o644) -> Future[int]:
    """:func:`write_from` started now, its result a Future (durable once it is done;
    the buffer must stay untouched until then)."""
    return _files().submit(write_from, path, buf, mode)


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
) -> list[Future[int]]:
    """Start writing ``view`` to the planned runs, in pieces on the worker threads;
    each piece fills its units' entries of ``sums`` and gives the bytes it bounced."""
    unit, pool, base = plan["unit"], _workers(), ring.address(view)
    return [
        pool.submit(write_piece, piece, view, base, unit, sums)
        for run in plan["runs"]
        for piece in pieces(run, fds, unit, plan["size"])
    ]
