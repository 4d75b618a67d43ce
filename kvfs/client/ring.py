"""The engine side of the aware ring: shared memory registered with the mount's daemon
and a connection that submits whole-file reads and writes to it
(``docs/design.md``, "The aware ring"; the daemon's side is :mod:`kvfs.store.ring`).

Any user may use it: what a request may touch is what the ticket it names allows,
and a ticket comes only with the caller's own open of the file on the mount.

- :func:`shared` gives page-aligned memory that the daemon can map: a sealed memfd
  (it can neither shrink nor grow, so the daemon never touches a page that vanished).
  Buffers from it move with no copy in this process; any other buffer is bounced
  through a per-thread shared staging buffer (one memcpy).
- :class:`Ring` is one connection per thread (per daemon): a thread's requests are
  synchronous, their completions read by the thread that sent them.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import ctypes
import errno
import fcntl
import itertools
import mmap
import os
import socket
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from kvfs.devices.device import ALIGN
from kvfs.format import ring as wire

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class SharedBuffer(mmap.mmap):
    """Page-aligned memory backed by a sealed memfd, which the daemon maps too."""

    memfd: int
    region: int
    address: int


_ids = itertools.count(1)
_lock = threading.RLock()
"""Guards the registries below. Reentrant: a buffer's finalizer (:func:`_forget`)
takes it, and runs wherever the buffer's last reference goes, which may be a
thread that holds it already."""
_buffers: dict[int, weakref.ref[SharedBuffer]] = {}  # by address
_starts: list[int] = []  # sorted addresses of _buffers
_all_rings: weakref.WeakSet[Ring] = weakref.WeakSet()
"""Every thread's rings (a freed buffer is unregistered from each)."""
_local = threading.local()


def _forget(address: int, region: int, memfd: int) -> None:
    with _lock:
        _buffers.pop(address, None)
        i = bisect.bisect_left(_starts, address)
        if i < len(_starts) and _starts[i] == address:
            _starts.pop(i)
        rings = list(_all_rings)
    for r in rings:
        r.unregister(region)
    os.close(memfd)


def shared(nbytes: int) -> SharedBuffer:
    """A zero-filled, page-aligned buffer of ``nbytes`` (a page at least) that the daemon maps:
    reads into it and writes from it cross no copy in this process."""
    length = max(nbytes, ALIGN)  # exactly what was asked (a page at least), as before
    fd = os.memfd_create("kvfs-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, -(-length // ALIGN) * ALIGN)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        buf = SharedBuffer(fd, length)
    except BaseException:
        os.close(fd)
        raise
    buf.memfd, buf.region = fd, next(_ids)
    probe = ctypes.c_char.from_buffer(buf)
    buf.address = ctypes.addressof(probe)
    del probe
    with _lock:
        _buffers[buf.address] = weakref.ref(buf)
        bisect.insort(_starts, buf.address)
    weakref.finalize(buf, _forget, buf.address, buf.region, fd)
    return buf


def locate(address: int, nbytes: int) -> tuple[SharedBuffer, int] | None:
    """The shared buffer holding ``nbytes`` at ``address``, and the offset there."""
    with _lock:
        i = bisect.bisect_right(_starts, address) - 1
        ref = _buffers.get(_starts[i]) if i >= 0 else None
    buf = ref() if ref is not None else None
    if buf is None or buf.closed or address + nbytes > buf.address + len(buf):
        return None
    return buf, address - buf.address


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""Linux 5.14+: map (and allocate) every page now, in one call, not one fault each."""
STAGING_KEPT = 8
"""Staging buffers kept for reuse at most (each also stays mapped in the daemon)."""
_staging_free: list[SharedBuffer] = []


def populate(buf: mmap.mmap) -> None:
    """Fault ``buf``'s pages in now (where the kernel can): a first request into
    fresh memory otherwise pays a page fault per 4 KiB inside the transfer."""
    with contextlib.suppress(OSError, ValueError):
        buf.madvise(MADV_POPULATE_WRITE)


@contextlib.contextmanager
def staging(nbytes: int) -> Iterator[SharedBuffer]:
    """A shared bounce buffer of at least ``nbytes`` (sizes are powers of 2), this
    caller's until the block ends; buffers are reused by every thread, so one that
    is already mapped and registered serves the next caller too."""
    with _lock:
        fits = [b for b in _staging_free if len(b) >= nbytes]
        buf = min(fits, key=len) if fits else None
        if buf is not None:
            _staging_free.remove(buf)
    if buf is None:
        buf = shared(1 << max(nbytes - 1, ALIGN).bit_length())
        populate(buf)
    try:
        yield buf
    finally:
        dropped = None
        with _lock:
            _staging_free.append(buf)
            if len(_staging_free) > STAGING_KEPT:
                dropped = min(_staging_free, key=len)
                _staging_free.remove(dropped)
        # its last reference goes here, outside the lock: its finalizer takes the lock
        del dropped


class Ring:
    """One thread's connection to a mount's daemon: its requests are synchronous
    (sent, then their completions read by the same thread: no hand-off to a
    receiver thread). Threads of a process each have their own (:func:`connect`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.settimeout(5)
        self._sock.connect(path)
        self._sock.settimeout(None)
        # this thread's requests, a finalizer's unregister (which may run in this
        # very thread, at a collection while it sends: reentrant)
        self._send = threading.RLock()
        self._tags = itertools.count(1)
        self._registered: set[int] = set()
        self.broken: OSError | None = None
        self._sock.sendall(wire.hello())

    def _register(self, buf: SharedBuffer) -> None:
        """Tell the daemon of ``buf`` (once): the memfd travels with SCM_RIGHTS."""
        with self._send:
            if buf.region in self._registered:
                return
            fds = array.array("i", [buf.memfd])
            self._sock.sendmsg(
                [wire.register(buf.region, len(buf))],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)],
            )
            self._registered.add(buf.region)

    def unregister(self, region: int) -> None:
        with self._send:
            if region not in self._registered:
                return
            self._registered.discard(region)
            with contextlib.suppress(OSError):
                self._sock.sendall(wire.unregister(region))

    def run(self, items: list[tuple[int, bytes, SharedBuffer, int, int]]) -> list[int | OSError]:
        """Requests ``(op, ticket, buffer, offset, length)`` in one batch, all done when
        it returns: per request the bytes moved, or the OSError it failed with. A
        broken connection raises (EPIPE) and stays broken."""
        tags = {}
        messages = []
        reqs = []
        for i, (op, ticket, buf, offset, length) in enumerate(items):
            tag = next(self._tags)
            tags[tag] = i
            reqs.append((buf, wire.Request(op, buf.region, tag, ticket, offset, length)))
        for i in range(0, len(reqs), wire.MAX_BATCH):
            batch = reqs[i : i + wire.MAX_BATCH]
            messages.append(([b for b, _ in batch], wire.submit([r for _, r in batch])))
        return self._exchange(messages, tags)

    def read_paths(self, items: list[tuple[bytes, SharedBuffer, int, int]]) -> list[int | OSError]:
        """Whole-file reads named by path (from the filesystem's root) into
        ``(buffer, offset, length)``: the daemon opens each as this process's user,
        reads and verifies it; per file the bytes read or the OSError."""
        return self._paths([(wire.OP_READ, *item, 0) for item in items])

    def write_paths(
        self, items: list[tuple[bytes, SharedBuffer, int, int, int]]
    ) -> list[int | OSError]:
        """New files named by path, from ``(buffer, offset, size)``, with permission
        bits ``mode``: the daemon creates each as this process's user would
        (``O_CREAT | O_EXCL``), writes it, computes its checksums and commits it;
        per file the bytes written (durable) or the OSError (EEXIST: a name in use).
        Only for a daemon whose map answers say ``ring_writes``."""
        return self._paths([(wire.OP_WRITE, *item) for item in items])

    def _paths(
        self, items: list[tuple[int, bytes, SharedBuffer, int, int, int]]
    ) -> list[int | OSError]:
        tags = {}
        reqs = []
        for i, (op, path, buf, offset, length, mode) in enumerate(items):
            tag = next(self._tags)
            tags[tag] = i
            reqs.append((buf, wire.PathRequest(op, buf.region, tag, offset, length, path, mode)))
        messages = []
        for i in range(0, len(reqs), wire.MAX_PATH_BATCH):
            batch = reqs[i : i + wire.MAX_PATH_BATCH]
            messages.append(([b for b, _ in batch], wire.submit_paths([r for _, r in batch])))
        return self._exchange(messages, tags)

    def _exchange(
        self, messages: list[tuple[list[SharedBuffer], bytes]], tags: dict[int, int]
    ) -> list[int | OSError]:
        if self.broken is not None:
            raise _copy(self.broken)
        out: list[int | OSError | None] = [None] * len(tags)

        def receive() -> int:
            """One message of completions; how many of them were this batch's."""
            msg = self._sock.recv(wire.MAX_MESSAGE)
            if not msg:
                raise ConnectionResetError(errno.EPIPE, "the daemon closed the ring")
            n = 0
            for d in wire.done_of(msg):
                i = tags.pop(d.tag, -1)
                if i >= 0:
                    out[i] = OSError(d.error, os.strerror(d.error)) if d.error else d.nbytes
                    n += 1
            return n

        try:
            sent = answered = 0
            for bufs, message in messages:
                for buf in bufs:
                    self._register(buf)
                while sent - answered > wire.MAX_UNREAD:  # read before sending more
                    answered += receive()
                with self._send:
                    self._sock.sendall(message)
                sent += len(bufs)
            while answered < len(out):
                answered += receive()
        except (OSError, ValueError) as e:
            # kept without a traceback: one would hold the callers' frames, and their
            # buffers exported, for as long as this ring is remembered
            self.broken = _copy(e if isinstance(e, OSError) else OSError(errno.EPROTO, str(e)))
            with contextlib.suppress(OSError):
                self._sock.close()
            raise _copy(self.broken) from None
        return [r if r is not None else OSError(errno.EPROTO, "no completion") for r in out]

    def close(self) -> None:
        self.broken = OSError(errno.EPIPE, "ring closed")
        self._sock.close()

    def __del__(self) -> None:  # its thread ended: the daemon forgets the connection
        with contextlib.suppress(Exception):
            self._sock.close()


def _copy(e: OSError) -> OSError:
    """A fresh OSError of ``e``'s errno and message (no traceback)."""
    return OSError(e.errno or errno.EIO, e.strerror or str(e))


def connect(path: str) -> Ring | None:
    """This thread's ring to the daemon listening at ``path`` (made once; made again
    after it broke), or None when it cannot be reached."""
    rings: dict[str, Ring] = _local.__dict__.setdefault("rings", {})
    r = rings.get(path)
    if r is not None and r.broken is None:
        return r
    try:
        r = Ring(path)
    except OSError:
        return None
    rings[path] = r
    with _lock:
        _all_rings.add(r)
    return r


def _forked() -> None:
    """A forked child shares its parent's sockets but has no receiver thread: it
    starts its own rings (the parent's stay the parent's)."""
    global _lock
    _lock = threading.RLock()
    _all_rings.clear()
    _local.__dict__.clear()
    _staging_free.clear()


os.register_at_fork(after_in_child=_forked)


def address(view: Any) -> int | None:
    """Where a writable buffer starts in memory (None for a read-only one)."""
    mv = memoryview(view)
    if mv.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))
